"""Configuration is explicit (issue 26, point 4): ``osf.IOOptions`` (direct I/O mode,
object-store options, tracing) passed to ``save_file`` / ``load_file`` / ``save_directory`` /
``restore_directory`` and the handler wins over the environment, which only gives defaults,
read in one module (``storage/config.py``) when needed, never at import;
``set_object_store_options`` still works, deprecated.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import direct as _direct

MiB = 1 << 20
PACKAGE = Path(osf.__file__).parent


def _tree() -> dict[str, np.ndarray]:
    return {"w": np.arange(4 * MiB // 4, dtype=np.float32).reshape(-1, 1024)}


def _direct_ok(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    fd = _direct.open_direct(str(probe), os.stat(probe)) if _direct.available() else None
    probe.unlink()
    if fd is None:
        pytest.skip(f"{tmp_path}: no O_DIRECT here")
    os.close(fd)


def test_an_explicit_direct_io_mode_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _direct_ok(tmp_path)
    monkeypatch.setenv("OSF_DIRECT_IO", "never")
    osf.save_directory(_tree(), tmp_path / "ckpt", io_options=osf.IOOptions(direct_io="never"))
    stats = osf.ReadStats()
    got = osf.restore_directory(
        tmp_path / "ckpt", stats=stats, io_options=osf.IOOptions(direct_io="always")
    )
    np.testing.assert_array_equal(np.asarray(got["w"]), _tree()["w"])
    if stats.direct_bytes == 0:
        pytest.skip("the filesystem refused O_DIRECT on read")
    stats = osf.ReadStats()
    osf.restore_directory(tmp_path / "ckpt", stats=stats)  # the environment's default: never
    assert stats.direct_bytes == 0


def test_the_handler_takes_io_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", "sometimes")  # a bad default: never read below
    handler = osf.SafetensorsCheckpointHandler(io_options=osf.IOOptions(direct_io="never"))
    with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(_tree()))
        mngr.wait_until_finished()
        got = mngr.restore(0, args=osf.SafetensorsRestore())
    np.testing.assert_array_equal(np.asarray(got["w"]), _tree()["w"])
    assert handler.last_read_stats is not None and handler.last_read_stats.direct_bytes == 0


def test_the_args_take_io_options_over_the_handlers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handler has none, so its default is the environment's (a bad one here): the args'
    # options are the ones used, for the save and for the restore.
    monkeypatch.setenv("OSF_DIRECT_IO", "sometimes")
    io = osf.IOOptions(direct_io="never")
    handler = osf.SafetensorsCheckpointHandler()
    with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(_tree(), io_options=io))
        mngr.wait_until_finished()
        got = mngr.restore(0, args=osf.SafetensorsRestore(io_options=io))
        np.testing.assert_array_equal(np.asarray(got["w"]), _tree()["w"])
        assert handler.last_read_stats is not None and handler.last_read_stats.direct_bytes == 0
        with pytest.raises(ValueError, match="OSF_DIRECT_IO='sometimes'"):
            mngr.restore(0, args=osf.SafetensorsRestore())  # the handler's: the environment's
    assert "io_options=" in repr(osf.SafetensorsSave(_tree(), io_options=io))


def test_save_file_and_load_file_take_io_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", "sometimes")
    io = osf.IOOptions(direct_io="auto", object_store=osf.ObjectStoreOptions(max_attempts=2))
    osf.save_file({"x": np.ones(3)}, tmp_path / "w.safetensors", io_options=io)
    got = osf.load_file(tmp_path / "w.safetensors", io_options=io)
    assert np.asarray(got["x"]).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="OSF_DIRECT_IO='sometimes'"):
        osf.load_file(tmp_path / "w.safetensors")  # the default comes from the environment


def test_bad_options_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="direct_io='sometimes'"):
        osf.IOOptions(direct_io="sometimes")
    with pytest.raises(TypeError, match="ObjectStoreOptions"):
        osf.IOOptions(object_store={"max_in_flight": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_in_flight"):
        osf.ObjectStoreOptions(max_in_flight=0)


def test_environment_defaults_are_read_when_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSF_OBJSTORE_MAX_IN_FLIGHT", "3")
    monkeypatch.setenv("OSF_OBJSTORE_READ_TIMEOUT", "7.5")
    monkeypatch.setenv("OSF_OBJSTORE_TRACE", "1")
    monkeypatch.setenv("OSF_DIRECT_IO", "ALWAYS")
    resolved = _config.resolve(None)
    assert resolved.object_store == osf.ObjectStoreOptions(max_in_flight=3, read_timeout=7.5)
    assert resolved.trace is True and resolved.direct_io == "always"
    explicit = _config.resolve(
        osf.IOOptions(direct_io="never", object_store=osf.ObjectStoreOptions(), trace=False)
    )
    assert explicit == osf.IOOptions("never", osf.ObjectStoreOptions(), False)
    monkeypatch.setenv("OSF_OBJSTORE_MAX_ATTEMPTS", "many")
    with pytest.raises(ValueError, match="OSF_OBJSTORE_MAX_ATTEMPTS='many'"):
        _config.resolve(None)


def test_set_object_store_options_is_a_deprecated_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OSF_OBJSTORE_MAX_IN_FLIGHT", "3")
    try:
        with pytest.warns(DeprecationWarning, match="io_options"):
            previous = osf.set_object_store_options(max_gap=0)
        assert previous.max_in_flight == 3
        assert _config.resolve(None).object_store == dataclasses.replace(previous, max_gap=0)
        given = osf.ObjectStoreOptions(max_gap=5)
        assert _config.resolve(osf.IOOptions(object_store=given)).object_store == given
    finally:
        _config.reset_object_store_defaults(None)


def test_no_dead_option_fields() -> None:
    fields = {f.name for f in dataclasses.fields(osf.ObjectStoreOptions)}
    assert "coordination_timeout" not in fields


def _environ_users(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            lines.append(node.lineno)
        names = {a.name for a in node.names} if isinstance(node, ast.ImportFrom) else set()
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and names & {"environ", "getenv"}
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_config_module_reads_the_environment() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_src/storage/config.py":
            continue
        lines = _environ_users(ast.parse(path.read_text()))
        if lines:
            offenders[rel] = lines
    assert offenders == {}, "read the environment through storage/config.py only"


@pytest.mark.main_env_only("an AST scan of config.py and one import with bad settings")
def test_importing_reads_no_environment_variable() -> None:
    # config.py reads only inside functions: no module-level statement touches os.environ.
    tree = ast.parse((PACKAGE / "_src/storage/config.py").read_text())
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            continue
        assert not _environ_users(stmt), ast.unparse(stmt)
    # and bad values in the environment do not break an import (a fresh interpreter)
    env = {**os.environ, "OSF_DIRECT_IO": "sometimes", "OSF_OBJSTORE_MAX_GAP": "x"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])
    code = "import orbax_safetensors._src.storage.router, orbax_safetensors"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_object_store_options_reach_the_requests(s3_bucket: str) -> None:
    # A retry budget of one attempt turns a transient failure into an error at once; what we
    # check here is that explicit options reach the store the router builds for the call.
    from orbax_safetensors._src.storage.objstore import engine as _engine

    io = _config.resolve(osf.IOOptions(object_store=osf.ObjectStoreOptions(max_attempts=1)))
    store = _engine.store_for("s3://bucket", io)
    assert store.options.max_attempts == 1 and store.trace is False
    path = epath.Path(s3_bucket) / "w.safetensors"
    osf.save_file({"x": np.ones(3)}, path, io_options=io)
    assert np.asarray(osf.load_file(path, io_options=io)["x"]).tolist() == [1.0, 1.0, 1.0]
