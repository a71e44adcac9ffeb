"""A directory written twice holds only the second save (issue 25, point 4).

Saving a 3-file tree and then a 1-file tree into one directory must leave no old shard or
index that a reader following ``model.safetensors.index.json`` (transformers does) could
reach; ``verify`` calls the second save sound; files the writer does not own stay; a failed
write leaves the old directory as it was; object storage deletes the old checkpoint's own
objects before writing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors._src.storage import replace as _replace


def _tree(value: float, n: int) -> dict[str, np.ndarray]:
    return {f"w{i}": np.full((64, 64), value + i, np.float32) for i in range(n)}


def _follow_index(directory: epath.Path) -> dict[str, np.ndarray]:
    """What a transformers-style reader loads: the index's shards, else model.safetensors."""
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, np.ndarray] = {}
    for name in files:
        out.update(osf.load_file(directory / name))
    return out


def _save_twice(directory: epath.Path) -> None:
    osf.save_directory(_tree(1.0, 3), directory, max_file_size=20_000)
    assert (directory / "model.safetensors.index.json").exists()
    osf.save_directory(_tree(100.0, 1), directory)


def test_a_directory_saved_twice_holds_only_the_second_save(tmp_path: Path) -> None:
    directory = epath.Path(tmp_path / "ckpt")
    directory.mkdir()
    (directory / "config.json").write_text("{}")  # not the writer's: kept
    _save_twice(directory)
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["config.json", "model.safetensors", "orbax_safetensors.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary sibling left
    seen = _follow_index(directory)
    assert list(seen) == ["w0"] and float(np.asarray(seen["w0"])[0, 0]) == 100.0
    assert osf.verify(directory).ok
    restored = osf.restore_directory(directory)
    assert float(np.asarray(restored["w0"])[0, 0]) == 100.0


def test_a_failed_write_leaves_the_old_directory(tmp_path: Path) -> None:
    directory = epath.Path(tmp_path / "ckpt")
    osf.save_directory(_tree(1.0, 3), directory, max_file_size=20_000)
    before = sorted((p.name, p.read_bytes()) for p in directory.iterdir())
    with (
        pytest.raises(RuntimeError, match="interrupted"),
        _replace.replacing_directory(directory) as out,
    ):
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted")
    assert sorted((p.name, p.read_bytes()) for p in directory.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert osf.verify(directory).ok


def test_the_swap_is_one_exchange_on_linux(tmp_path: Path) -> None:
    # Both directories exist before and after an exchange: never a moment without the path.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    if not _replace._exchange(epath.Path(a), epath.Path(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable here")
    assert (b / "x").read_text() == "a" and not (a / "x").exists()


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(FileExistsError, match="not a directory"):
        osf.save_directory(_tree(1.0, 1), path)
    assert path.read_text() == "not a directory"


def test_object_storage_keeps_no_stale_object(s3_bucket: str) -> None:
    directory = epath.Path(s3_bucket) / "ckpt"
    (directory / "config.json").write_text("{}")
    _save_twice(directory)
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["config.json", "model.safetensors", "orbax_safetensors.json"]
    assert osf.verify(directory).ok
