"""Integrity: one flipped bit in any tensor's bytes is caught and named, on restore and by verify.

Checksums are CRC32C per tensor, computed while saving: in ``__metadata__`` for ``save_file``
files, in ``orbax_safetensors.json`` for directories. Restores check every tensor read whole
(``verify=False`` opts out); ``osf.verify`` streams every tensor of a file, directory, step or
manager root in bounded chunks without building arrays.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

import orbax_safetensors as osf
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save

pytestmark = pytest.mark.timeout(300)


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 33)).astype(np.float32)
    return {
        "w": w,
        "tied": w,
        "bf16": jnp.asarray(rng.standard_normal((5, 7)), dtype=jnp.bfloat16),
        "i8": rng.integers(-128, 127, (3, 5, 7), dtype=np.int8),
        "mask": rng.random(13) > 0.5,
        "f4": rng.standard_normal(10).astype(ml_dtypes.float4_e2m1fn),
        "scalar": np.float64(3.25),
        "key": jax.random.key(7),
        "big": rng.integers(0, 2**31, 300_000, dtype=np.int32),  # > 1 MiB: several chunks
        "step": 3,
    }


def _flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _positions(nbytes: int, rng: np.random.Generator) -> list[int]:
    """First byte, last byte and a random one inside a tensor of ``nbytes``."""
    return sorted({0, nbytes - 1, int(rng.integers(0, nbytes))})


def _same(a: Any, b: Any) -> bool:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if np.asarray(x).tobytes() != np.asarray(y).tobytes():
            return False
    return True


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "tree.safetensors"
    osf.save_file(_tree(), path)
    return path


def test_every_bit_flip_in_every_tensor_is_named(saved_file: Path, tmp_path: Path) -> None:
    header = osf.read_header(saved_file)
    assert set(header.tensors) == {"w", "bf16", "i8", "mask", "f4", "scalar", "key", "big"}
    rng = np.random.default_rng(1)
    damaged = tmp_path / "damaged.safetensors"
    for name, entry in header.tensors.items():
        for pos in _positions(entry.nbytes, rng):
            shutil.copyfile(saved_file, damaged)
            bit = int(rng.integers(0, 8))
            _flip(damaged, header.data_start + entry.begin + pos, bit)

            with pytest.raises(osf.IntegrityError, match=rf"tensor '{name}'.*CRC32C") as info:
                osf.load_file(damaged)
            assert isinstance(info.value, ValueError)
            report = osf.verify(damaged, chunk_bytes=64 << 10)
            assert not report.ok
            assert len(report.problems) == 1, report.problems
            assert f"tensor '{name}'" in report.problems[0] and str(damaged) in report.problems[0]

            # Opting out loads the damaged bytes as they are.
            tree = osf.load_file(damaged, verify=False)
            assert tree["step"] == 3


def test_targeted_restore_verifies_what_it_reads(saved_file: Path, tmp_path: Path) -> None:
    header = osf.read_header(saved_file)
    damaged = tmp_path / "damaged.safetensors"
    shutil.copyfile(saved_file, damaged)
    _flip(damaged, header.data_start + header.tensors["i8"].begin + 17, 3)

    target = jax.eval_shape(lambda: {k: v for k, v in _tree().items() if k != "step"})
    with pytest.raises(osf.IntegrityError, match="'i8'"):
        osf.load_file(damaged, target=target, strict=False)
    # A target that does not ask for the damaged tensor reads (and checks) only what it asks.
    partial = {"w": np.zeros((64, 33), np.float32), "big": np.zeros(300_000, np.int32)}
    out = osf.load_file(damaged, target=partial, strict=False)
    assert np.array_equal(out["w"], _tree()["w"])
    # The alias is checked through the tensor it points at.
    _flip(damaged, header.data_start + header.tensors["w"].begin, 0)
    with pytest.raises(osf.IntegrityError, match="'w'"):
        osf.load_file(damaged, target={"tied": np.zeros((64, 33), np.float32)}, strict=False)


def test_verify_counts_and_chunking(saved_file: Path) -> None:
    header = osf.read_header(saved_file)
    for chunk in (4093, 1 << 20, 16 << 20):
        report = osf.verify(saved_file, chunk_bytes=chunk)
        assert report.ok, report.problems
        assert report.files == 1
        assert report.tensors == len(header.tensors)
        assert report.bytes == header.data_size
        assert report.unverified == []
    with pytest.raises(FileNotFoundError):
        osf.verify(saved_file.parent / "missing.safetensors")
    with pytest.raises(ValueError):
        osf.verify(saved_file, chunk_bytes=0)


def test_files_without_checksums_are_unverifiable_but_valid(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"a": np.ones((4, 4), np.float32), "b": np.arange(3)}, str(path))
    report = osf.verify(path)
    assert report.ok and report.files == 1 and report.tensors == 2 and report.bytes == 0
    assert sorted(report.unverified) == [f"{path}: a", f"{path}: b"]
    # The header is still checked: a file whose header cannot be read is no checkpoint to check.
    raw = bytearray(path.read_bytes())
    raw[0:8] = (2**63).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(osf.HeaderError, match="exceeds"):
        osf.verify(path)


def test_empty_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(osf.NotSafetensorsError, match="not a checkpoint: an empty directory"):
        osf.verify(tmp_path)


def test_a_named_step_is_judged_without_reading_its_siblings(tmp_path: Path) -> None:
    # The parent is listed (is the named directory one step of a root?), but what a sibling
    # holds is outside what the user named: a special file planted there is never opened.
    (tmp_path / "7").mkdir()
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "_CHECKPOINT_METADATA").mkdir()
    os.mkfifo(tmp_path / "9")
    # (An empty step-named directory beside a step Orbax wrote is what cleanup leaves.)
    report = osf.verify(tmp_path / "7")
    assert not report.ok and report.incomplete == [str(tmp_path / "7")]


def test_another_roots_step_beside_a_named_directory_vouches_for_nothing(tmp_path: Path) -> None:
    # pytest's own temporary directories look like this: ``test_a_0`` beside ``test_b_0`` that
    # holds Orbax's metadata file. A step of another name prefix is another manager's (or no
    # step at all): the named directory is not judged half-deleted by it.
    osf.save_directory({"w": np.arange(4.0)}, tmp_path / "test_a_0" / "state")
    (tmp_path / "test_b_0").mkdir()
    (tmp_path / "test_b_0" / "_CHECKPOINT_METADATA").write_text("{}")
    report = osf.verify(tmp_path / "test_a_0")
    assert report.ok and report.incomplete == [], report.problems


def test_a_directory_of_tensors_named_like_a_step_is_read_as_it_is(tmp_path: Path) -> None:
    # A Hugging Face directory (or pytest's ``test_x_0``) holds tensors itself: a step that is
    # one item, never "a step missing every item".
    hf = tmp_path / "model_0"
    hf.mkdir()
    safetensors.numpy.save_file(
        {"w": np.arange(6, dtype=np.float32)}, str(hf / "model.safetensors")
    )
    summary = osf.convert(hf, tmp_path / "out")
    assert (summary.direction, summary.tensors, summary.bytes) == ("orbax", 1, 24)
    assert osf.verify(hf).ok


# --------------------------------------------------------------------------- CheckpointManager


def _sharded_state(seed: int) -> dict[str, Any]:
    mesh = devices.mesh((4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32), sharding),
            "b": jnp.asarray(rng.standard_normal(32), dtype=jnp.bfloat16),
        },
        "opt": [np.arange(1000, dtype=np.int64) * seed, jax.random.key(seed)],
        "step": seed,
    }


def _manager(root: Path, **handler_kwargs: Any) -> ocp.CheckpointManager:
    handler = osf.SafetensorsCheckpointHandler(max_file_size=4096, **handler_kwargs)
    return ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(max_to_keep=None),
        item_names=("state",),
        item_handlers={"state": handler},
    )


def _restore(mngr: ocp.CheckpointManager, step: int, target: Any = None) -> Any:
    args = ocp.args.Composite(state=osf.SafetensorsRestore(target))
    return mngr.restore(step, args=args)["state"]


def test_bit_flips_in_checkpoint_manager_steps(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with _manager(root) as mngr:
        for step in (1, 2):
            mngr.save(
                step, args=ocp.args.Composite(state=osf.SafetensorsSave(_sharded_state(step)))
            )
        mngr.wait_until_finished()
    item = root / "1" / "state"
    meta = json.loads((item / _metadata.METADATA_FILE).read_text())
    assert len(meta["files"]) > 1  # split: bits are flipped in several files
    assert osf.verify(root).ok

    rng = np.random.default_rng(2)
    pristine = tmp_path / "pristine"
    shutil.copytree(item, pristine)
    target = jax.eval_shape(lambda: _sharded_state(1))
    for name, info in meta["tensors"].items():
        shutil.rmtree(item)
        shutil.copytree(pristine, item)
        path = item / info["file"]
        header = osf.read_header(path)
        entry = header.tensors[name]
        _flip(path, header.data_start + entry.begin + int(rng.integers(entry.nbytes)), 5)

        with _manager(root) as mngr:
            with pytest.raises(osf.IntegrityError, match=rf"tensor '{name}'"):
                _restore(mngr, 1)
            with pytest.raises(osf.IntegrityError, match=rf"tensor '{name}'"):
                _restore(mngr, 1, target)  # sharded target: still read whole, still checked
            assert _same(_restore(mngr, 2), _sharded_state(2))
        with _manager(root, verify=False) as mngr:
            assert _restore(mngr, 1)["step"] == 1

        report = osf.verify(root)
        assert not report.ok and len(report.problems) == 1, report.problems
        assert f"tensor '{name}'" in report.problems[0] and str(path) in report.problems[0]
        step_report = osf.verify(root / "1")
        assert step_report.problems == report.problems
        file_report = osf.verify(path)  # one file: checked against the directory's checksums
        assert file_report.problems == report.problems and file_report.files == 1
        assert osf.verify(root / "2").ok


def test_verify_whole_manager_root(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with _manager(root) as mngr:
        for step in (1, 2, 3):
            mngr.save(
                step, args=ocp.args.Composite(state=osf.SafetensorsSave(_sharded_state(step)))
            )
        mngr.wait_until_finished()
    report = osf.verify(root)
    assert report.ok, report.problems
    per_step = [osf.verify(root / str(s)) for s in (1, 2, 3)]
    assert report.files == sum(r.files for r in per_step) and report.files >= 6
    assert report.tensors == sum(r.tensors for r in per_step)
    assert report.bytes == sum(r.bytes for r in per_step) > 0
    for path in (root / "2" / "state").glob("*.safetensors"):
        one = osf.verify(path)
        assert one.ok and one.files == 1 and one.bytes > 0 and one.unverified == []

    # An uncommitted step left by a crash is skipped, not reported.
    tmp_step = root / "4.orbax-checkpoint-tmp-123"
    shutil.copytree(root / "3", tmp_step)
    (tmp_step / "state" / _metadata.METADATA_FILE).write_text("{garbage")
    report = osf.verify(root)
    assert report.ok and report.skipped == [str(tmp_step)]

    # Several damaged tensors in several steps: each is listed.
    for step in (1, 3):
        item = root / str(step) / "state"
        path = (
            item
            / json.loads((item / _metadata.METADATA_FILE).read_text())["tensors"]["params.w"][
                "file"
            ]
        )
        header = osf.read_header(path)
        _flip(path, header.data_start + header.tensors["params.w"].begin + 100, 1)
    report = osf.verify(root)
    assert len(report.problems) == 2
    assert all("tensor 'params.w'" in p for p in report.problems)
    assert "/1/state/" in report.problems[0] and "/3/state/" in report.problems[1]


def test_checkpoints_saved_without_checksums(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    with _manager(root, checksums=False) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(_sharded_state(1))))
        mngr.wait_until_finished()
        assert _same(_restore(mngr, 1), _sharded_state(1))
    report = osf.verify(root)
    assert report.ok and report.bytes == 0
    assert len(report.unverified) == report.tensors > 0


def test_finalize_from_the_draft_in_memory_writes_what_the_file_draft_gives(
    tmp_path: Path,
) -> None:
    """The primary's finalize may take the metadata draft it wrote from memory instead of
    reading it back: the metadata file comes out byte for byte the same, checksums included."""
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": {"step": 3, "b": np.ones(2)}}
    docs = []
    # (draft from memory, checksum part kept in memory only)
    for from_memory, part_in_memory in ((False, False), (True, False), (True, True)):
        directory = tmp_path / f"memory_{from_memory}_{part_in_memory}"
        directory.mkdir()
        prepared = _checkpoint_save.prepare(
            _checkpoint_save.validate_save(tree, {"epoch": 1}), _checkpoint_save.SaveLayout()
        )
        part = _checkpoint_save.write_process_share(
            prepared, directory, persist_share=not part_in_memory
        )
        if part_in_memory:  # nothing but the data files on disk until finalize
            assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors"]
        _checkpoint_save.finalize(
            directory, prepared.metadata if from_memory else None, [part] if part_in_memory else []
        )
        assert sorted(p.name for p in directory.iterdir()) == [
            "model.safetensors",
            _metadata.METADATA_FILE,
        ]
        docs.append((directory / _metadata.METADATA_FILE).read_bytes())
    assert docs[0] == docs[1] == docs[2]
    assert all(t["crc32c"] for t in json.loads(docs[1])["tensors"].values())


def test_single_process_manager_saves_keep_draft_and_part_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a one-process job the handler's finalize is its own: no draft or checksum part is
    written, and the committed step holds checksums all the same (sync and async)."""
    tree = {"w": jnp.arange(6.0), "b": np.ones(3, np.int32)}
    written: list[str] = []  # what the item directory holds once this process's part is written
    original = _checkpoint_save.write_process_share

    def listing_after(*args: Any, **kwargs: Any) -> Any:
        part = original(*args, **kwargs)
        written.extend(sorted(p.name for p in Path(str(args[1])).iterdir()))
        return part

    monkeypatch.setattr(_checkpoint_save, "write_process_share", listing_after)
    for enable_async in (False, True):
        written.clear()
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=enable_async)
        with ocp.CheckpointManager(tmp_path / f"async_{enable_async}", options=options) as mngr:
            mngr.save(0, args=osf.SafetensorsSave(tree))
            mngr.wait_until_finished()
            restored = mngr.restore(0, args=osf.SafetensorsRestore())
        assert written == ["model.safetensors"], written
        np.testing.assert_array_equal(restored["w"], np.arange(6.0))
        step = tmp_path / f"async_{enable_async}" / "0" / "default"
        doc = json.loads((step / _metadata.METADATA_FILE).read_text())
        assert all(t["crc32c"] for t in doc["tensors"].values())


def test_a_large_tensor_is_checked_in_parts_and_every_part_counts(tmp_path: Path) -> None:
    """A tensor larger than a reading thread's share is checked in parts (each part's CRC32C
    taken by the thread that read it, then combined): a flipped bit on either side of every
    cut, and at both ends, is caught and named; the intact file restores exactly."""
    from orbax_safetensors._src.core import runs as _runs
    from orbax_safetensors._src.storage import router as _router

    rng = np.random.default_rng(3)
    tree = {
        "a": rng.integers(0, 256, 1001, dtype=np.uint8),  # the big tensor off a 4 KiB block
        "big": rng.integers(0, 2**31, (5 << 20) + 77, dtype=np.int32),  # ~20 MiB
    }
    path = tmp_path / "big.safetensors"
    osf.save_file(tree, path)
    assert _same(osf.load_file(path), tree)
    header = osf.read_header(path)
    entry = header.tensors["big"]
    offset = header.data_start + entry.begin
    total = sum(e.nbytes for e in header.tensors.values())
    part = _runs.share_bytes(total, _router.READ_THREADS)
    cuts = [start for start, _ in _runs.piece_spans(offset, entry.nbytes, part)][1:]
    assert cuts, "the tensor must span several parts"
    damaged = tmp_path / "damaged.safetensors"
    for pos in sorted({0, entry.nbytes - 1, *cuts, *(c - 1 for c in cuts)}):
        shutil.copyfile(path, damaged)
        _flip(damaged, offset + pos, int(rng.integers(0, 8)))
        with pytest.raises(osf.IntegrityError, match=r"tensor 'big'.*CRC32C"):
            osf.load_file(damaged)
