"""The Orbax plugin wiring: registered args with no other registration, Composite items, no-arg
restores in a fresh process, configured handlers (item_handlers, handler_registry) (issue 3).

Interop checks read our files with ``safetensors`` itself.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import handler_helpers as helpers  # (tests/orbax/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open

import orbax_safetensors as osf


def test_issue_snippet_works_with_no_other_registration(tmp_path: Path) -> None:
    state = helpers.state()
    abstract_state = helpers.abstract(state)
    path = tmp_path / "ckpt"
    step = 3
    # The exact snippet of issue 3, point 1.
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore(abstract_state))
    mngr.close()

    assert mngr.latest_step() == step
    # As Orbax's StandardRestore gives it: a ShapeDtypeStruct without a sharding restores a
    # leaf saved as numpy as a numpy array of the struct's dtype (float64 here, not narrowed).
    helpers.assert_same_values(restored, state)
    assert isinstance(restored["host"], np.ndarray) and restored["host"].dtype == np.float64
    assert isinstance(restored["step"], int) and isinstance(restored["lr"], float)
    # The stable typestr is what Orbax records for the item.
    step_meta = json.loads((path / str(step) / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"] == {
        "default": "orbax_safetensors.SafetensorsCheckpointHandler"
    }
    assert (
        osf.SafetensorsCheckpointHandler.typestr()
        == "orbax_safetensors.SafetensorsCheckpointHandler"
    )


def test_restore_without_target_returns_the_saved_tree(tmp_path: Path) -> None:
    state = helpers.state()
    mngr = helpers.manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(0, args=osf.SafetensorsRestore())
    mngr.close()
    helpers.assert_same_values(restored, state)
    assert isinstance(restored["host"], np.ndarray)  # host-local leaves come back as numpy
    assert isinstance(restored["params"]["dense"]["kernel"], jax.Array)


def test_composite_item_with_json(tmp_path: Path) -> None:
    state = helpers.state()
    mngr = helpers.manager(tmp_path)
    mngr.save(
        5,
        args=ocp.args.Composite(
            state=osf.SafetensorsSave(state, metadata={"note": "hello"}),
            meta=ocp.args.JsonSave({"loss": 0.5, "epoch": 2}),
        ),
    )
    mngr.wait_until_finished()
    restored = mngr.restore(
        5,
        args=ocp.args.Composite(
            state=osf.SafetensorsRestore(helpers.abstract(state)), meta=ocp.args.JsonRestore()
        ),
    )
    mngr.close()
    helpers.assert_same_values(restored["state"], state)  # "host" as saved: numpy float64, as Orbax
    assert restored["meta"] == {"loss": 0.5, "epoch": 2}
    item = helpers.item_dir(tmp_path, 5, "state")
    assert set(os.listdir(item)) >= helpers.OUR_FILES
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert doc["metadata"] == {"note": "hello"}


def test_restore_with_no_args_in_a_fresh_process(tmp_path: Path) -> None:
    state = helpers.state()
    roots = {"default-item": tmp_path / "plain", "composite": tmp_path / "composite"}
    for label, root in roots.items():
        mngr = helpers.manager(root)
        if label == "composite":
            args = ocp.args.Composite(
                state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({"epoch": 4})
            )
        else:
            args = osf.SafetensorsSave(state)
        mngr.save(2, args=args)
        mngr.wait_until_finished()
        mngr.close()

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, str(helpers.SCRIPTS / "restore_no_args.py")]
    for root in roots.values():
        cmd += [str(root), "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    for label, doc in zip(roots, docs):
        composite = label == "composite"
        rows = {r["path"]: r for r in doc["leaves"]}
        prefix = "['state']" if composite else ""
        if composite:
            assert doc["composite"] is True
            assert rows["['meta']['epoch']"]["value"] == 4
        else:
            assert doc["composite"] is False and doc["top"] == "dict"
        # The raw tree: saved containers, jax arrays stay jax, numpy stays numpy, scalars inline.
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            row = rows[prefix + jax.tree_util.keystr(path)]
            if isinstance(leaf, (jax.Array, np.ndarray)):
                host = np.asarray(leaf)
                assert row["kind"] == ("jax" if isinstance(leaf, jax.Array) else "numpy")
                assert row["dtype"] == str(host.dtype) and row["shape"] == list(host.shape)
                assert row["values"] == host.astype(np.float64).ravel().tolist()
            else:
                assert row["kind"] == "python" and row["value"] == leaf
                assert row["type"] == type(leaf).__name__
        assert len(rows) == len(jax.tree.leaves(state)) + composite


ORBAX_PACKAGE = Path(osf.__file__).parent / "_src" / "orbax"


def test_the_handler_module_reads_no_sibling_name_at_import() -> None:
    """The package root imports orbax/v0.py (which registers the handler) right after
    ``orbax.checkpoint`` is first imported, possibly while a sibling that imported Orbax first
    is still half imported: so the package's modules import each other as modules, never names
    from one, and its ``__init__`` imports nothing (docs/architecture.md, "Registering with
    Orbax")."""
    offenders = []
    for path in sorted(ORBAX_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and path.name == "__init__.py":
                offenders.append(f"{path.name}:{node.lineno}: the package's __init__ imports")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "orbax_safetensors._src.orbax."
            ):
                offenders.append(f"{path.name}:{node.lineno}: names from {node.module}")
    assert not offenders, offenders


def test_the_handler_registers_when_a_sibling_imports_orbax_first(tmp_path: Path) -> None:
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave({"w": np.arange(3.0)}))
    mngr.wait_until_finished()
    mngr.close()
    code = (
        "import sys\n"
        "import orbax_safetensors\n"
        "import orbax_safetensors._src.orbax.args  # imports Orbax before the handler's module\n"
        "import orbax.checkpoint as ocp\n"
        "with ocp.CheckpointManager(sys.argv[1]) as mngr:\n"
        "    print(mngr.restore(1)['w'].tolist())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "[0.0, 1.0, 2.0]"


def _tensor_names(item: Path) -> set[str]:
    names: set[str] = set()
    for f in sorted(item.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as g:
            names.update(g.keys())
    return names


def test_configured_handler_as_the_single_item_handler(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(6)}  # 256 bytes each
    handler = osf.SafetensorsCheckpointHandler(max_file_size=600, checksums=False)
    mngr = helpers.manager(tmp_path, item_handlers=handler)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=osf.SafetensorsRestore(helpers.abstract(state)))
    mngr.close()
    helpers.assert_same_values(restored, state)
    # The options reached the writer: split files, no checksums.
    _assert_split_without_checksums(helpers.item_dir(tmp_path, 1), files=3)


def test_configured_handler_per_item_in_a_composite(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(4)}
    mngr = helpers.manager(
        tmp_path,
        item_handlers={
            "state": osf.SafetensorsCheckpointHandler(max_file_size=300),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    restored = _composite_round_trip(mngr, state)
    assert restored["meta"] == {"a": 1}
    assert len(list(helpers.item_dir(tmp_path, 1, "state").glob("model-*-of-*.safetensors"))) == 4


def _composite_round_trip(mngr: ocp.CheckpointManager, state: Any) -> Any:
    """Saves ``state`` beside a JSON item at step 1, restores both, closes ``mngr``."""
    mngr.save(
        1,
        args=ocp.args.Composite(state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({"a": 1})),
    )
    mngr.wait_until_finished()
    restored = mngr.restore(
        1,
        args=ocp.args.Composite(
            state=osf.SafetensorsRestore(helpers.abstract(state)), meta=ocp.args.JsonRestore()
        ),
    )
    mngr.close()
    helpers.assert_same_values(restored["state"], state)
    return restored


def _assert_split_without_checksums(item: Path, files: int) -> None:
    assert len(list(item.glob("model-*-of-*.safetensors"))) == files
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert all("crc32c" not in t for t in doc["tensors"].values())


def test_configured_handler_through_handler_registry(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(4)}
    handler = osf.SafetensorsCheckpointHandler(max_file_size=600, checksums=False)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", osf.SafetensorsSave, handler)
    registry.add("state", osf.SafetensorsRestore, handler)
    mngr = helpers.manager(tmp_path, handler_registry=registry)
    _composite_round_trip(mngr, state)
    _assert_split_without_checksums(helpers.item_dir(tmp_path, 1, "state"), files=2)


def test_plain_checkpointer_uses_the_synchronous_save(tmp_path: Path) -> None:
    state = helpers.state()
    ckptr = ocp.Checkpointer(osf.SafetensorsCheckpointHandler())
    ckptr.save(tmp_path / "ck", args=osf.SafetensorsSave(state))
    restored = ckptr.restore(tmp_path / "ck", args=osf.SafetensorsRestore())
    ckptr.close()
    helpers.assert_same_values(restored, state)
    assert set(os.listdir(tmp_path / "ck")) >= helpers.OUR_FILES


# --------------------------------------------------------------------------- constructor options
