"""One error hierarchy, and a public type for everything the public API returns.

Every exception the package exports is a ``SafetensorsCheckpointError`` (a ``ValueError``); the
ones that also carry a built-in meaning keep it (``MetadataError`` is a ``TypeError``,
``ObjectStoreError`` an ``OSError``), so existing ``except`` clauses still catch them.
"""

from __future__ import annotations

import errno
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf

EXCEPTIONS = [
    name
    for name in osf.__all__
    if isinstance(getattr(osf, name), type) and issubclass(getattr(osf, name), BaseException)
]


def test_every_exported_exception_is_a_safetensors_checkpoint_error() -> None:
    assert {"DeletedArrayError", "MetadataError", "ObjectStoreError"} <= set(EXCEPTIONS)
    for name in EXCEPTIONS:
        cls = getattr(osf, name)
        assert issubclass(cls, osf.SafetensorsCheckpointError), name
        assert issubclass(cls, ValueError), name


def test_the_new_classes_keep_their_builtin_meaning() -> None:
    assert issubclass(osf.ObjectStoreError, OSError)
    assert issubclass(osf.MetadataError, TypeError)
    assert issubclass(osf.DeletedArrayError, osf.UnsupportedLeafError)


def test_object_store_error_reads_as_the_oserror_it_was() -> None:
    """str, args, errno and strerror are those of a plain ``OSError(message)``."""
    cause = ConnectionResetError(errno.ECONNRESET, "reset by peer")
    error = osf.ObjectStoreError("s3://b/k", "GET bytes 0-9", 3, cause)
    plain = OSError(str(error))
    assert str(error).startswith("s3://b/k: GET bytes 0-9 failed after 3 attempts: ")
    assert error.args == plain.args == (str(error),)
    assert error.errno is plain.errno is None
    assert error.strerror is plain.strerror is None
    assert (error.url, error.operation, error.attempts) == ("s3://b/k", "GET bytes 0-9", 3)
    with pytest.raises(OSError):
        raise error


def test_metadata_that_is_not_json_raises_metadata_error(tmp_path: Path) -> None:
    with pytest.raises(osf.MetadataError, match=r"metadata must be JSON-serialisable: .*set"):
        osf.save_directory({"w": np.ones(2)}, tmp_path / "a", metadata={"s": {1}})
    with pytest.raises(TypeError):  # what callers caught before
        osf.save_directory({"w": np.ones(2)}, tmp_path / "b", metadata={"s": {1}})
    with pytest.raises(osf.MetadataError):  # checked where Orbax's args are built
        osf.SafetensorsSave({"w": np.ones(2)}, metadata={"s": object()})


def test_saving_a_donated_array_raises_deleted_array_error(tmp_path: Path) -> None:
    w = jnp.ones((4, 4))
    jax.jit(lambda x: x, donate_argnums=0)(w)
    expected = f"cannot save 'layer.w' ({w.dtype}{list(w.shape)}): the array has been deleted"
    with pytest.raises(osf.DeletedArrayError) as err:
        osf.save_directory({"layer": {"w": w}}, tmp_path / "ckpt")
    assert str(err.value).startswith(expected)
    assert isinstance(err.value, ValueError)


def test_read_header_returns_exported_types(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    osf.save_file({"a": np.ones((2, 3), np.float32), "b": np.arange(4)}, path)
    header = osf.read_header(path)
    assert isinstance(header, osf.Header)
    assert set(header.tensors) == {"a", "b"}
    assert all(isinstance(t, osf.TensorEntry) for t in header.tensors.values())


def test_handler_stats_are_exported_types(tmp_path: Path) -> None:
    handler = osf.SafetensorsCheckpointHandler()
    state = {"w": jnp.arange(6.0), "b": np.ones(3, np.int32)}
    with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(state))
        mngr.wait_until_finished()
        assert type(handler.last_write_stats) is osf.WriteStats
        mngr.restore(0, args=osf.SafetensorsRestore())
    assert type(handler.last_read_stats) is osf.ReadStats


def test_restore_directory_fills_exported_read_stats(tmp_path: Path) -> None:
    osf.save_directory({"w": np.arange(5.0)}, tmp_path)
    stats = osf.ReadStats()
    osf.restore_directory(tmp_path, stats=stats)
    assert stats.bytes_needed == 5 * 8
