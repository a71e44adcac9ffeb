"""What importing the package and starting the command line load (issue 40, point 5): JAX,
Orbax, Flax and ml_dtypes only where a command needs them; every public name still importable,
typed and listed; a broken install still fails where a name is used. Times are measured in
``benchmarks/cli_startup_bench.py``, never here."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.tools import inspection as _inspection

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("jax", "orbax", "flax", "ml_dtypes", "tensorstore")

# Prints the heavy modules loaded after running the code above it (``args``: sys.argv[1:]).
_REPORT = f"""
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def _fresh(code: str, *args: object, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that imports this checkout's package."""
    path = os.pathsep.join(p for p in (pythonpath, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", "import json, sys\n" + code, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=240,
    )


def _heavy_after(code: str, *args: object) -> list[str]:
    done = _fresh(code + _REPORT, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_package_loads_neither_jax_nor_numpy() -> None:
    code = "import orbax_safetensors as osf\nassert 'numpy' not in sys.modules\nosf.HeaderError"
    assert _heavy_after(code) == []


def test_help_loads_nothing_heavy() -> None:
    code = """
import contextlib, io
from orbax_safetensors.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        assert e.code == 0
assert 'numpy' not in sys.modules
"""
    assert _heavy_after(code, "--help") == []
    assert _heavy_after(code, "inspect", "--help") == []


def _cast_file(path: Path) -> Path:
    tree = {"params": {"w": np.ones((4, 4), np.float32), "norm": np.ones(4, np.float32)}}
    osf.save_file(tree, path, metadata={"run": "a"}, dtype={"*norm*": None, "*": "bfloat16"})
    return path


def test_inspect_of_a_file_imports_no_jax_nor_numpy_and_lists_what_sources_list(
    tmp_path: Path,
) -> None:
    path = _cast_file(tmp_path / "model.safetensors")
    code = """
import contextlib, io
from orbax_safetensors.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(sys.argv[1:]) == 0
print(out.getvalue().replace(chr(10), ' '))
"""
    code += "assert 'numpy' not in sys.modules  # the header is read with os.pread and core/\n"
    done = _fresh(code + _REPORT, "inspect", path, "--json")
    assert done.returncode == 0, done.stderr
    *listing, heavy = done.stdout.splitlines()
    assert json.loads(heavy) == []
    report = json.loads("".join(listing))
    full = _inspection._Inspection().source(_sources.open_source(path))  # through catalog/sources
    assert report == json.loads(json.dumps(full))
    cast = {t["name"]: (t["dtype"], t.get("cast_from")) for t in report["tensors"]}
    assert cast == {"params.w": ("BF16", "F32"), "params.norm": ("F32", None)}
    assert report["metadata"]["run"] == "a"


def test_every_public_name_is_listed_importable_and_typed() -> None:
    code = """
import orbax_safetensors as osf
assert set(osf.__all__) <= set(dir(osf)), set(osf.__all__) - set(dir(osf))
namespace = {}
exec('from orbax_safetensors import *', namespace)
missing = [n for n in osf.__all__ if n not in namespace]
assert not missing, missing
from orbax_safetensors import KeyMapping, Rule, SafetensorsSave, save_file
assert save_file is osf.save_file and KeyMapping.__module__.startswith('orbax_safetensors._src')
"""
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        osf.no_such_name  # noqa: B018
    # Type checkers see the same names: the TYPE_CHECKING imports are the lazy table, and with
    # the names imported at once they make up __all__.
    tree = ast.parse((ROOT / "orbax_safetensors" / "__init__.py").read_text())
    typed, eager = set(), set()
    for node in tree.body:
        imports = node.body if isinstance(node, ast.If) else [node]
        for imp in imports:
            if isinstance(imp, ast.ImportFrom) and imp.module != "__future__":
                names = {a.asname or a.name for a in imp.names}
                (typed if isinstance(node, ast.If) else eager).update(names)
    assert typed == set(osf._LAZY)
    assert typed | (eager & set(osf.__all__)) == set(osf.__all__)


def test_the_hugging_face_namespace_after_importing_the_package_alone() -> None:
    """``osf.hf`` (issue 47 point 6): reached as an attribute after ``import orbax_safetensors``
    alone; its names are the top level's objects, its presets by group; its mappings work
    with the Orbax args."""
    code = """
import numpy as np
import orbax_safetensors as osf
assert 'orbax_safetensors.hf' not in sys.modules
hf = osf.hf
assert hf is sys.modules['orbax_safetensors.hf'] and 'hf' in osf.__all__
own = {'PRESETS', 'presets'}
assert [n for n in hf.__all__ if n not in own and getattr(hf, n) is not getattr(osf, n)] == []
assert hf.presets.maxtext.llama3 is hf.PRESETS['maxtext-llama3']
assert hf.presets.generic.dense() == osf.preset_mapping('llama')
mapping = hf.KeyMapping([hf.Rule('fc.weight', 'w', hf.Transpose())])
osf.SafetensorsSave({'w': np.ones((2, 3), np.float32)}, mapping=mapping)
print(sorted(hf.__all__))
"""
    done = _fresh(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == str(sorted(HF_NAMES))


# What ``osf.hf`` holds.
HF_NAMES = {
    *("KeyMapping", "Rule", "MappingReport", "Transform", "Transpose", "SplitHeads", "Reshape"),
    *("Chain", "Scale", "RopeInterleave", "VocabRows", "Offset"),
    *("preset_mapping", "PRESETS", "presets", "load_pytorch", "export_pytorch", "import_pytorch"),
    "abstract_pytorch",
}


def test_a_key_mapping_from_the_package_works_with_the_orbax_args() -> None:
    """A KeyMapping from the package works as the Orbax args' mapping= (its protocol methods)."""
    code = """
import numpy as np
import orbax_safetensors as osf
mapping = osf.KeyMapping([osf.Rule('fc.weight', 'w', osf.Transpose())])
osf.SafetensorsSave({'w': np.ones((2, 3), np.float32)}, mapping=mapping)
print('ok')
"""
    done = _fresh(code)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_broken_install_fails_where_a_name_is_used(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "jax"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this jax install is broken')\n")
    code = """
import orbax_safetensors as osf
assert issubclass(osf.HeaderError, osf.SafetensorsCheckpointError)  # imported with the package
for use in ('osf.save_file', 'from orbax_safetensors import load_file'):
    try:
        exec(use)
    except ImportError as e:
        assert 'this jax install is broken' in str(e), (use, e)
    else:
        raise AssertionError(use + ' did not fail')
print('ok')
"""
    done = _fresh(code, pythonpath=str(tmp_path / "site"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("first", ["orbax_safetensors", "orbax.checkpoint"])
def test_orbax_finds_the_handler_whichever_is_imported_first(tmp_path: Path, first: str) -> None:
    """``mngr.restore(step)`` without args after only ``import orbax_safetensors``: Orbax looks
    the handler up by the name the step records, whichever package was imported first."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "root") as mngr:
        mngr.save(3, args=osf.SafetensorsSave({"w": np.arange(4.0)}))
        mngr.wait_until_finished()
    second = "orbax.checkpoint" if first == "orbax_safetensors" else "orbax_safetensors"
    code = f"""
import {first}
import {second}
import orbax.checkpoint as ocp
with ocp.CheckpointManager(sys.argv[1]) as mngr:
    print(mngr.restore(3)["w"].tolist())
"""
    done = _fresh(code, tmp_path / "root")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[0.0, 1.0, 2.0, 3.0]"
