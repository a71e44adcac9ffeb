"""Cold local reads through O_DIRECT, and every fallback to buffered reads.

Real files on the test machine's disk (``tmp_path``) and on tmpfs (``/dev/shm``); a file's
pages are dropped from the page cache with ``posix_fadvise(DONTNEED)`` (no root needed), which
makes its next read cold. ``OSF_DIRECT_IO`` picks the mode: ``auto`` (direct for cold data),
``never``, ``always``.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.storage import direct as _direct
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import local as _local
from orbax_safetensors._src.storage import router as _router

MiB = 1 << 20
SHM = Path("/dev/shm")


def _tree(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal((1024, 1025), np.float32),  # ~4 MiB, size not 64-aligned
        "w": rng.standard_normal((768, 1024), np.float32),  # 3 MiB
        "odd": rng.standard_normal((3, 333_333), np.float32),
        "bias": rng.standard_normal(7, np.float32),
        "ids": np.arange(5, dtype=np.int8),
    }


def _evict(path: Path) -> None:
    """Drops the file's pages from the page cache: its next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: Path) -> int:
    """Pages of the file in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = _direct.resident_pages(fd, os.path.getsize(path))
    finally:
        os.close(fd)
    assert pages is not None
    return int(pages.sum())


def _restore(directory: Path) -> tuple[dict, osf.ReadStats]:
    stats = osf.ReadStats()
    return osf.restore_directory(directory, stats=stats), stats


def _load_file(path: Path) -> tuple[dict, osf.ReadStats]:
    """Every tensor of any safetensors file, as numpy, with the read's statistics."""
    header = _router.read_header(path)
    _, stored = _read.file_index(epath.Path(path), header, strict=False)
    stats = osf.ReadStats()
    requests = [_read.ReadRequest(s, kind=_read.ReadKind.NUMPY) for s in stored.values()]
    return dict(zip(stored, _read.read_tensors(requests, stats))), stats


def _same(got: dict, tree: dict) -> None:
    assert set(got) == set(tree)
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)


def _direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"x")
    try:
        fd = _direct.open_direct(str(probe), os.stat(probe))
    finally:
        probe.unlink()
    if fd is None:
        return False
    os.close(fd)
    return True


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    if not _direct.available() or not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    return tmp_path


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_cold_restore_reads_direct_and_leaves_no_page_cache(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", mode)
    tree = _tree()
    osf.save_directory(tree, disk_dir / "ckpt")
    path = disk_dir / "ckpt" / "model.safetensors"
    _evict(path)
    got, stats = _restore(disk_dir / "ckpt")
    _same(got, tree)
    large = sum(v.nbytes for v in tree.values() if v.nbytes >= MiB)
    # Whole 4 KiB blocks of the large tensors: all but at most a block at either end of each.
    assert large - 3 * 2 * 4096 <= stats.direct_bytes <= large
    assert stats.bytes_read == sum(v.nbytes for v in tree.values())
    # Direct reads leave nothing in the page cache: the restore holds only its arrays.
    assert _resident(path) * 4096 < (sum(v.nbytes for v in tree.values()) - large) + 2 * MiB


def test_warm_restore_stays_buffered_in_auto_mode(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", "auto")
    tree = _tree(1)
    osf.save_directory(tree, disk_dir / "ckpt")
    path = disk_dir / "ckpt" / "model.safetensors"
    path.read_bytes()  # read before: its pages are cached
    assert _resident(path) * 4096 >= os.path.getsize(path) // 2
    got, stats = _restore(disk_dir / "ckpt")
    _same(got, tree)
    assert stats.direct_bytes == 0


def test_never_mode_reads_buffered(disk_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", "never")
    tree = _tree(2)
    osf.save_directory(tree, disk_dir / "ckpt")
    _evict(disk_dir / "ckpt" / "model.safetensors")
    got, stats = _restore(disk_dir / "ckpt")
    _same(got, tree)
    assert stats.direct_bytes == 0


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("mode", ["auto", "always"])
def test_tmpfs_restores_in_every_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """tmpfs holds its files in the page cache: ``auto`` reads them buffered; ``always`` uses
    O_DIRECT where the kernel allows it there (Linux 6.6+), else falls back, same values."""
    monkeypatch.setenv("OSF_DIRECT_IO", mode)
    import tempfile

    with tempfile.TemporaryDirectory(dir=SHM) as d:
        tree = _tree(3)
        osf.save_directory(tree, Path(d) / "ckpt")
        got, stats = _restore(Path(d) / "ckpt")
        _same(got, tree)
        if mode == "auto" or not _direct_supported(Path(d)):
            assert stats.direct_bytes == 0


def test_legacy_misaligned_file_falls_back_to_buffered(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose data starts off a 4 KiB boundary and whose tensors start off 64-byte
    boundaries (as other writers lay them out) reads buffered, even in ``always`` mode."""
    monkeypatch.setenv("OSF_DIRECT_IO", "always")
    n = 1 << 20
    tree = {"a": np.arange(3, dtype=np.int8), "w": np.arange(n, dtype=np.float32)}
    header = {
        "a": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
        "w": {"dtype": "F32", "shape": [n], "data_offsets": [3, 3 + 4 * n]},
    }
    text = json.dumps(header).encode()
    path = disk_dir / "legacy.safetensors"
    path.write_bytes(
        struct.pack("<Q", len(text)) + text + tree["a"].tobytes() + tree["w"].tobytes()
    )
    _evict(path)
    got, stats = _load_file(path)
    _same(got, tree)
    assert stats.direct_bytes == 0
    _same(osf.load_file(path), tree)


def test_official_writer_file_reads_direct_where_aligned(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files from the official writer (8-byte padding) load in every mode; a tensor whose
    offset happens to be 64-byte aligned still gets its whole blocks read direct."""
    from safetensors.numpy import save_file

    tree = {"x": np.arange(1 << 20, dtype=np.float32), "y": np.ones((512, 1024), np.float32)}
    path = disk_dir / "official.safetensors"
    save_file(tree, str(path))
    for mode in ("never", "auto", "always"):
        monkeypatch.setenv("OSF_DIRECT_IO", mode)
        _evict(path)
        got, stats = _load_file(path)
        _same(got, tree)
        assert (stats.direct_bytes > 0) == (mode != "never" and _header_is_64_aligned(path))


def _header_is_64_aligned(path: Path) -> bool:
    return (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 64 == 0


def _cold_blob(disk_dir: Path, size: int, seed: int) -> tuple[Path, np.ndarray]:
    """A file of ``size`` random bytes, out of the page cache, and its bytes."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path = disk_dir / "blob"
    path.write_bytes(data.tobytes())
    _evict(path)
    return path, data


def _congruent(nbytes: int, offset: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    start = (offset - raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def test_read_runs_at_any_offset_fill_every_byte_and_report_each_run_once(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs with and without aligned heads and tails, buffers congruent to their offsets or
    not, the file's last unaligned bytes: every byte lands, and ``on_run(i)`` comes once per
    run, after all its parts (direct blocks, buffered head and tail) are in place."""
    monkeypatch.setenv("OSF_DIRECT_IO", "always")
    size = 40 * MiB + 1234
    path, data = _cold_blob(disk_dir, size, seed=5)
    spans = [
        (0, 3 * MiB),  # aligned start
        (3 * MiB + 100, 5 * MiB),  # unaligned head and tail
        (9 * MiB, 20 * MiB + 7),  # several chunks
        (30 * MiB, 64),  # small: buffered
        (31 * MiB + 8, 2 * MiB),  # not congruent (below): buffered
        (size - 3 * MiB - 5, 3 * MiB + 5),  # to the unaligned end of the file
    ]
    runs = []
    for k, (offset, n) in enumerate(spans):
        dest = _congruent(n, offset) if k != 4 else _congruent(n + 1, offset)[1:]
        runs.append((offset, dest))
    seen: list[int] = []

    def on_run(i: int) -> None:
        offset, dest = runs[i]
        np.testing.assert_array_equal(dest, data[offset : offset + dest.nbytes])
        seen.append(i)

    reader = _local.LocalReader(path, threads=4)
    try:
        reader.read_runs(runs, on_run=on_run)
        assert sorted(seen) == list(range(len(runs)))
        assert reader.direct_bytes >= 3 * MiB + 4 * MiB + 20 * MiB
        assert reader.bytes_read >= sum(n for _, n in spans)
    finally:
        reader.close()


def test_refused_direct_read_is_read_buffered(disk_dir: Path) -> None:
    """A read the filesystem refuses (here: an offset off the block, EINVAL from the kernel)
    returns what it moved; the reader reads the rest buffered and stops trying direct."""
    data = np.random.default_rng(6).integers(0, 256, 2 * MiB, dtype=np.uint8)
    path = disk_dir / "blob"
    path.write_bytes(data.tobytes())
    fd = _direct.open_direct(str(path), os.stat(path))
    assert fd is not None
    try:
        view = _congruent(MiB, 0)
        assert _direct.read_direct(fd, 1, view.data) == 0
        assert _direct.read_direct(fd, 4096, view.data) == MiB
        np.testing.assert_array_equal(view, data[4096 : 4096 + MiB])
        # The file's end: a short read, reported as such.
        assert _direct.read_direct(fd, 2 * MiB - 4096, _congruent(8192, 0).data) == 4096
    finally:
        os.close(fd)
    reader = _local.LocalReader(path, threads=1)
    try:
        reader._direct_fd = _direct.open_direct(str(path), os.stat(path))
        view = _congruent(MiB, 1)
        reader._read_direct(1, view.data, 0, lambda i: None)
        np.testing.assert_array_equal(view, data[1 : 1 + MiB])
        assert reader._direct_refused and reader.direct_bytes == 0
    finally:
        reader.close()


def test_unknown_mode_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    osf.save_file({"w": np.ones(3)}, tmp_path / "w.safetensors")
    monkeypatch.setenv("OSF_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="OSF_DIRECT_IO='sometimes'"):
        osf.load_file(tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="OSF_DIRECT_IO='sometimes'"):
        osf.save_file({"w": np.ones(3)}, tmp_path / "v.safetensors")


def test_damaged_bytes_read_direct_fail_the_checksum(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSF_DIRECT_IO", "always")
    tree = _tree(7)
    path = disk_dir / "w.safetensors"
    osf.save_file(tree, path)
    header = _router.read_header(path)
    entry = header.tensors["w"]
    with open(path, "r+b") as f:
        f.seek(header.data_start + entry.begin + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    _evict(path)
    with pytest.raises(osf.IntegrityError, match="'w'"):
        osf.load_file(path)


def test_page_cache_probe_sees_cached_and_evicted_ranges(disk_dir: Path) -> None:
    """The probe (``cachestat``, or ``mincore`` before Linux 6.5) agrees with ``mincore``:
    a range just written is cached, one just evicted is not."""
    path = disk_dir / "blob"
    path.write_bytes(bytes(8 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 4 * MiB, 4 * MiB, os.POSIX_FADV_DONTNEED)
        cached = _direct.page_cache_probe(fd, str(path), os.fstat(fd))
        assert cached is not None
        pages = _direct.resident_pages(fd, 8 * MiB)
        assert pages is not None
        per_page = MiB // 4096 * 4
        assert cached(0, 4 * MiB) and pages[:per_page].all()
        assert not cached(4 * MiB, 4 * MiB) and not pages[per_page:].any()
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- direct writes


def _pieces_at(data: np.ndarray, cuts: list[int], base: int) -> list[_interface.Piece]:
    bounds = [0, *cuts, data.nbytes]
    return [
        _interface.Piece(base + a, data[a:b], tag=i)
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


@pytest.mark.parametrize("base", [0, 4096, 100, 64 * 1001])
def test_direct_writer_fills_every_byte_at_any_offset(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch, base: int
) -> None:
    """Pieces at block-aligned and misaligned file offsets, of sizes that are not whole
    blocks, across several 8 MiB units: whole blocks go direct, the rest buffered; the file
    holds every byte, the CRCs are those of the pieces, and its pages are not left cached."""
    monkeypatch.setenv("OSF_DIRECT_IO", "auto")
    data = np.random.default_rng(8).integers(0, 256, 21 * MiB + 333, dtype=np.uint8)
    pieces = _pieces_at(data, [7, 5 * MiB + 1, 5 * MiB + 4097, 17 * MiB], base)
    path = disk_dir / "blob"
    path.write_bytes(b"\xff" * base)  # what lies before the pieces must stay
    writer = _local.LocalWriter(str(path), base + data.nbytes, False, 2, True)
    try:
        result = writer.write(pieces, checksums=True)
    finally:
        writer.close(sync=True)
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    assert (raw[:base] == 0xFF).all()
    np.testing.assert_array_equal(raw[base:], data)
    assert [(t, n, c) for t, n, c in result] == [
        (p.tag, p.data.nbytes, _checksum.crc32c(p.data)) for p in pieces
    ]
    assert data.nbytes - 6 * 4096 * 3 <= writer.direct_bytes <= data.nbytes


def test_durable_save_goes_direct_and_leaves_no_page_cache(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto``: a saved file reaches the device without filling the page cache; the official
    reader and ours read it back; ``never`` writes through the page cache."""
    from safetensors.numpy import load_file as official_load

    tree = {"w": np.random.default_rng(9).standard_normal((1024, 2049), np.float32)}
    tree["b"] = np.arange(7, dtype=np.float32)
    for mode in ("auto", "never"):
        monkeypatch.setenv("OSF_DIRECT_IO", mode)
        path = disk_dir / f"{mode}.safetensors"
        osf.save_file(tree, path)
        resident = _resident(path) * 4096
        if mode == "auto":
            assert resident < 64 * 4096  # the header and the blocks at the tensors' ends
        else:
            assert resident >= tree["w"].nbytes // 2
        _same(official_load(str(path)), tree)
        _same(osf.load_file(path), tree)


def test_refused_direct_write_is_written_buffered(disk_dir: Path) -> None:
    """A direct write the kernel refuses (here: a staging buffer off the block boundary,
    EINVAL) writes nothing; the writer writes those bytes buffered and stops trying direct."""
    path = disk_dir / "blob"
    path.write_bytes(bytes(2 * MiB))
    fd = _direct.open_direct(str(path), os.stat(path), write=True)
    assert fd is not None
    try:
        misaligned = _congruent(MiB + 64, 64)[64:]  # address 128 past a block
        assert _direct.write_direct(fd, 0, misaligned.data) == 0
        aligned = memoryview(_congruent(MiB, 0))
        assert _direct.write_direct(fd, 1, aligned) == 0  # offset off the block
        assert _direct.write_direct(fd, 4096, aligned) == MiB
    finally:
        os.close(fd)
    data = np.random.default_rng(10).integers(0, 256, 4 * MiB, dtype=np.uint8)
    writer = _local.LocalWriter(str(path), data.nbytes, True, 1, True)
    try:
        # A staging buffer off the block boundary: the kernel refuses the direct write.
        writer._staging.put(_congruent(8 * MiB + 64, 64)[64:].data)
        writer.write(_pieces_at(data, [MiB], 0))
        assert writer.direct_bytes == 0 and not writer._direct_wanted
    finally:
        writer.close(sync=True)
    np.testing.assert_array_equal(np.frombuffer(path.read_bytes(), np.uint8), data)


def _misplaced(piece: _interface.Piece) -> _interface.Piece:
    # The same bytes 64 bytes off their file offset's phase: staged to be written direct.
    data = _congruent(piece.data.nbytes, piece.offset + 64)
    data[:] = piece.data
    return _interface.Piece(piece.offset, data, piece.tag)


@pytest.mark.parametrize("base", [0, 4096 + 64])
def test_placed_buffers_are_written_direct_with_no_staging_copy(disk_dir: Path, base: int) -> None:
    """Pieces in buffers lent at their file offsets' phase (an export's cast bands,
    ``buffers.LentBuffers``), contiguous in the file: each is sent to the device as it is
    (the writer's staging buffers are never used; a small piece in between is written
    buffered), and the file holds every byte, as the staged path writes it."""
    from orbax_safetensors._src.storage import buffers as _buffers

    data = np.random.default_rng(11).integers(0, 256, 19 * MiB + 4096 + 5, dtype=np.uint8)
    bounds = [0, 3 * MiB + 64, 11 * MiB + 64, 11 * MiB + 6000, 17 * MiB, data.nbytes]
    lent = _buffers.LentBuffers(8 * MiB)
    pieces = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        view = lent.take(b - a, file_offset=base + a)
        view[:] = data[a:b]
        piece = _interface.Piece(base + a, view, tag=i)
        pieces.append(_misplaced(piece) if i == 2 else piece)  # a small tensor's, in between
    for staged in (False, True):
        path = disk_dir / f"blob{staged}"
        path.write_bytes(b"\xff" * base)
        writer = _local.LocalWriter(str(path), base + data.nbytes, False, 2, True)
        try:
            ready = [_misplaced(p) for p in pieces] if staged else pieces
            writer.write(ready)
            used_staging = writer._staging.qsize()
        finally:
            writer.close(sync=True)
        raw = np.frombuffer(path.read_bytes(), np.uint8)
        assert (raw[:base] == 0xFF).all()
        np.testing.assert_array_equal(raw[base:], data)
        assert data.nbytes - 6 * 2 * 4096 <= writer.direct_bytes <= data.nbytes
        assert (used_staging > 0) == staged


def test_a_large_buffered_run_is_read_by_every_thread_and_reported_once(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 48 MiB run read buffered (a restore's wave of one large tensor from the page
    cache) on 8 threads: read in pieces of an even share (6 MiB, cut at 4 KiB blocks of the
    file) rather than by one thread, and ``on_run`` comes once, after every piece is in place.
    (Direct reads keep their own chunks, ``direct.CHUNK_BYTES``.)"""
    monkeypatch.setenv("OSF_DIRECT_IO", "never")
    size = 48 * MiB + 4096
    path, data = _cold_blob(disk_dir, size, seed=6)
    offset, n = 100, 48 * MiB - 100
    dest = _congruent(n, offset)
    seen: list[int] = []

    def on_run(i: int) -> None:
        np.testing.assert_array_equal(dest, data[offset : offset + n])
        seen.append(i)

    reader = _local.LocalReader(path, threads=8)
    try:
        reader.read_runs([(offset, dest)], on_run=on_run)
        assert seen == [0]
        assert reader.requests >= 8, reader.requests  # 8 pieces (and their unaligned edges)
    finally:
        reader.close()
