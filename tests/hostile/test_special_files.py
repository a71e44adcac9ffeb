"""Special files never hang a verb (issue 46, class 3).

A FIFO opened for reading waits for a writer, so a FIFO planted where a file is read (an index,
``config.json``, ``generation_config.json``, a tokenizer file, the metadata JSON, a tensor file,
an Orbax item's ``_METADATA`` or chunk, a step's ``_CHECKPOINT_METADATA``, or the path the user
names, ``--hf-config`` included) would block the verb forever. Every file the library opens is
opened by ``storage/confine.open_regular`` (``O_NONBLOCK``, then ``fstat``: only a regular file),
whole files read by ``router.read_file``: each cell below refuses it at once, with
``UnsafePathError`` through the API, one ``error:`` line and status 2 through the command line
(``verify`` of a checkpoint: the problem listed, status 1), nothing left behind. Each cell has a
timeout of a few seconds, so a regression fails instead of hanging; two run the real command
line as a subprocess, with a timeout. A device and a socket are refused too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat
from orbax_safetensors._src.tools import cli

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import planted
except ImportError:  # tests/ became a package
    from tests.hostile import planted

FAST = pytest.mark.timeout(10)  # a blocked open fails the cell instead of hanging the run
SPECIAL = "not a regular file"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[planted.Sources, dict[str, Path]]:
    """The sources, and each planting by name: the path a verb is given (built once)."""
    s = planted.build(tmp_path_factory.mktemp("special"))
    planted_at: dict[str, Path] = {}

    def plant(name: str, source: Path, where: str, given: Callable[[Path], Path] = Path) -> None:
        copy = s.copy(source, name)
        planted.fifo(copy / where)
        planted_at[name] = given(copy)

    plant("hf-tensor", s.hf, "model-00001-of-00002.safetensors")
    plant("hf-index", s.hf, "model.safetensors.index.json")
    plant("item-metadata", s.item, "orbax_safetensors.json")
    plant("item-tensor", s.item, "model.safetensors")
    plant("item-index", s.sharded, "model.safetensors.index.json")
    plant("orbax-metadata", s.orbax, "_METADATA")
    plant("orbax-chunk", s.orbax, "embed/0.0")
    plant("step-metadata", s.step, "_CHECKPOINT_METADATA")
    plant("config", s.hf_config, "config.json")
    plant("generation-config", s.hf_config, "generation_config.json")
    plant("tokenizer", s.hf_config, "tokenizer.json")
    plant("root-metadata", s.item_root, "0/default/orbax_safetensors.json")
    plant("named", s.hf, "named.safetensors", lambda p: p / "named.safetensors")
    return s, planted_at


# --------------------------------------------------------------------------- the command line


_CONFIGS = ("config", "generation-config", "tokenizer", "named")
_CONVERTED = (
    "hf-tensor", "hf-index", "item-metadata", "item-tensor", "orbax-metadata", "orbax-chunk",
    "step-metadata", "named",
)  # fmt: skip
CLI_CELLS = [
    *(
        ("inspect", p)
        for p in ("hf-tensor", "hf-index", "item-metadata", "orbax-metadata", "step-metadata")
    ),
    ("inspect", "named"),
    *(("verify", p) for p in ("item-metadata", "item-tensor", "item-index", "hf-tensor")),
    ("verify", "named"),
    ("verify", "step-metadata"),
    *(("diff", p) for p in ("hf-tensor", "hf-index", "item-metadata", "orbax-metadata", "named")),
    *(("convert", p) for p in _CONVERTED),
    *(("export", p) for p in ("hf-tensor", "hf-index", "item-metadata", "orbax-chunk", "named")),
    *(("export --hf-config", p) for p in _CONFIGS),
]


@FAST
@pytest.mark.parametrize(("verb", "planting"), CLI_CELLS, ids=lambda v: v)
def test_the_command_line_refuses_a_fifo_at_once(
    world: Any, verb: str, planting: str, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    s, planted_at = world
    monkeypatch.chdir(s.mapping_dir)  # (export --mapping imports the module from here)
    out = tmp_path / "out" / "deep" / "dst"
    status = cli.main(planted.argv(verb, s, planted_at[planting], out))
    stdout, stderr = capsys.readouterr()
    if verb == "verify" and planting in ("item-metadata", "item-tensor", "item-index", "hf-tensor"):
        assert status == 1 and f"a FIFO, {SPECIAL}" in stdout, (status, stdout, stderr)
        return
    planted.assert_one_error_line(verb, status, stderr, f"a FIFO, {SPECIAL}", tmp_path / "out")


# --------------------------------------------------------------------------- the API


def _api(verb: str, planting: str, s: planted.Sources, path: Path, out: Path) -> Any:
    if verb == "load_file":
        return osf.load_file(path if planting == "named" else path / "model.safetensors")
    if verb == "restore_directory":
        return osf.restore_directory(path)
    if verb == "load_pytorch":
        return osf.load_pytorch(None, path, planted.MAPPING)
    if verb == "abstract_pytorch":
        return osf.abstract_pytorch(path, planted.MAPPING)
    if verb == "read_header":
        return osf.read_header(path)
    if verb == "load_metadata":
        return osf.load_metadata(path)
    if verb == "export_pytorch":
        if planting in _CONFIGS:
            return osf.export_pytorch(s.item, out, planted.MAPPING, hf_config=path)
        return osf.export_pytorch(path, out, planted.MAPPING)
    if verb == "convert":
        return osf.convert(path, out, progress=False)
    if verb == "verify":
        return osf.verify(path)
    if verb == "SafetensorsSave(hf_config=)":
        args = osf.SafetensorsSave(planted.state(), mapping=planted.MAPPING, hf_config=path)
        with ocp.CheckpointManager(out) as mngr:
            mngr.save(0, args=args)
        return None
    restore = {
        "manager SafetensorsRestore": osf.SafetensorsRestore(),
        "manager StandardRestore": ocp.args.StandardRestore(),
    }[verb]
    with ocp.CheckpointManager(path, handler_registry=osf.handler_registry()) as mngr:
        return mngr.restore(0, args=restore)


API_CELLS = [
    ("load_file", "named"),
    ("load_file", "item-metadata"),
    ("load_file", "item-tensor"),
    ("restore_directory", "item-metadata"),
    ("restore_directory", "item-tensor"),
    ("load_pytorch", "named"),
    ("load_pytorch", "hf-tensor"),
    ("load_pytorch", "hf-index"),
    ("load_pytorch", "item-metadata"),
    ("load_pytorch", "orbax-chunk"),
    ("abstract_pytorch", "hf-index"),
    ("read_header", "named"),
    ("load_metadata", "named"),
    ("export_pytorch", "orbax-metadata"),
    ("export_pytorch", "hf-index"),
    *(("export_pytorch", p) for p in _CONFIGS),
    ("convert", "orbax-chunk"),
    ("convert", "named"),
    ("verify", "named"),
    ("SafetensorsSave(hf_config=)", "tokenizer"),
    ("manager SafetensorsRestore", "root-metadata"),
]


@FAST
@pytest.mark.parametrize(("verb", "planting"), API_CELLS, ids=lambda v: v)
def test_the_api_refuses_a_fifo_at_once(
    world: Any, verb: str, planting: str, tmp_path: Path
) -> None:
    s, planted_at = world
    out = tmp_path / "out" / "deep" / "dst"
    with pytest.raises(osf.UnsafePathError, match=f"a FIFO, {SPECIAL}"):
        _api(verb, planting, s, planted_at[planting], out)
    if verb != "SafetensorsSave(hf_config=)":
        assert not (tmp_path / "out").exists()


@FAST
def test_a_manager_restore_of_an_orbax_item_holding_a_fifo(world: Any, tmp_path: Path) -> None:
    """Orbax's own restore through ``osf.handler_registry``: the item is checked first."""
    s, _ = world
    root = s.copy(s.native_root, "native-chunk")
    chunks = [p for p in (root / "0" / "default").rglob("*") if p.is_file() and p.stat().st_size]
    planted.fifo(chunks[0])
    for args in (ocp.args.StandardRestore(), osf.SafetensorsRestore()):
        with (
            ocp.CheckpointManager(root, handler_registry=osf.handler_registry()) as mngr,
            pytest.raises(osf.UnsafePathError, match=f"a FIFO, {SPECIAL}"),
        ):
            mngr.restore(0, args=args)


@FAST
@pytest.mark.skipif(not orbaxcompat.has_orbax_v1(), reason="this orbax-checkpoint lacks v1")
def test_orbax_v1_load_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    ctx = ocp_v1.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        ocp_v1.save(tmp_path / "ckpt", planted.state())
        planted.fifo(tmp_path / "ckpt" / "state" / "orbax_safetensors.json")
        with pytest.raises(osf.UnsafePathError, match=f"a FIFO, {SPECIAL}"):
            ocp_v1.load(tmp_path / "ckpt")


@FAST
def test_a_device_a_socket_and_a_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(osf.UnsafePathError, match=f"a device, {SPECIAL}"):
        osf.load_file("/dev/zero")
    with pytest.raises(osf.UnsafePathError, match=f"a device, {SPECIAL}"):
        osf.export_pytorch(planted.state(), tmp_path / "o", planted.MAPPING, hf_config="/dev/zero")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "sock.safetensors"))  # (opening one fails: ENXIO)
        with pytest.raises(OSError):
            osf.load_file(tmp_path / "sock.safetensors")
    finally:
        sock.close()
    config = tmp_path / "model"
    (config / "tokenizer.json").mkdir(parents=True)
    (config / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(osf.UnsafePathError, match=f"a directory, {SPECIAL}"):
        osf.export_pytorch(planted.state(), tmp_path / "o", planted.MAPPING, hf_config=config)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- real processes


@pytest.mark.parametrize("case", ["inspect", "export --hf-config"])
def test_the_real_command_line_does_not_hang(world: Any, case: str, tmp_path: Path) -> None:
    s, planted_at = world
    if case == "inspect":
        argv = ["inspect", str(planted_at["hf-tensor"])]
    else:
        argv = planted.argv("export --hf-config", s, planted_at["named"], tmp_path / "o")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "orbax_safetensors.cli", *argv],
        capture_output=True,
        text=True,
        cwd=s.mapping_dir,
        env=env,
        timeout=120,  # (startup imports JAX; a blocked open would wait forever)
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert f"a FIFO, {SPECIAL}" in lines[0] and not (tmp_path / "o").exists()
