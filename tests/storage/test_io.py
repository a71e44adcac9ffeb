"""The byte movers of ``storage``: positional writes with checksums computed on the way."""

from __future__ import annotations

from pathlib import Path

import crc32c
import numpy as np
import pytest

from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import router as _router


def _pieces(sizes: list[int], start: int = 16) -> list[_interface.Piece]:
    rng = np.random.default_rng(0)
    out, offset = [], start
    for k, n in enumerate(sizes):
        out.append(_interface.Piece(offset, rng.integers(0, 256, n, dtype=np.uint8), ("t", k)))
        offset += n
    return out


@pytest.mark.parametrize(
    "sizes",
    [
        [(8 << 20) + 3, 20 << 20, 5],  # pieces cut into several write units
        [1024] * 3000,  # many small pieces: units of up to 1024 iovecs
        [0, 7, 0, 1 << 20],  # empty pieces
    ],
    ids=["large", "many-small", "empty"],
)
def test_write_file_checksums_every_piece_and_writes_every_byte(
    tmp_path: Path, sizes: list[int]
) -> None:
    pieces = _pieces(sizes)
    header = _interface.header_piece(b"H" * 16)
    size = 16 + sum(sizes)
    with _router.open_writer(tmp_path / "f", size=size) as w:
        records = w.write([*reversed(pieces), header], checksums=True)
    by_tag = {tag: (n, crc) for tag, n, crc in records}
    for p in pieces:
        assert by_tag[p.tag] == (p.data.nbytes, crc32c.crc32c(p.data)), p.tag
    data = (tmp_path / "f").read_bytes()
    assert data == b"H" * 16 + b"".join(p.data.tobytes() for p in pieces)


def test_open_writer_writes_header_after_data_and_syncs_on_exit(tmp_path: Path) -> None:
    data = np.arange(100, dtype=np.uint8)
    with _router.open_writer(tmp_path / "f", size=108, truncate=True) as w:
        [(_, _, crc)] = w.write([_interface.Piece(8, data, "d")], checksums=True)
        w.write([_interface.header_piece(crc.to_bytes(8, "little"))])
    raw = (tmp_path / "f").read_bytes()
    assert int.from_bytes(raw[:8], "little") == crc32c.crc32c(data) and raw[8:] == data.tobytes()


def test_open_writer_error_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info, _router.open_writer(tmp_path / "missing" / "f", size=8):
        pass
    assert "missing" in str(info.value)


def test_submitted_writes_run_together_and_report_like_write(tmp_path: Path) -> None:
    """Several batches submitted before any is awaited: every byte lands, every CRC is right,
    and each pending write reports its own pieces in offset order."""
    pieces = _pieces([(9 << 20) + 1, 1024, 5, 3 << 20, *([4096] * 300)])
    batches = [pieces[:1], pieces[1:3], pieces[3:4], pieces[4:]]
    size = 16 + sum(p.data.nbytes for p in pieces)
    with _router.open_writer(tmp_path / "f", size=size, truncate=True) as w:
        pending = [w.submit(list(reversed(b)), checksums=True) for b in batches]
        header = w.submit([_interface.header_piece(b"H" * 16)])
        results = [p.result() for p in pending]
        assert header.result() == [(None, 16, 0)]
    for batch, records in zip(batches, results):
        assert records == [(p.tag, p.data.nbytes, crc32c.crc32c(p.data)) for p in batch]
    data = (tmp_path / "f").read_bytes()
    assert data == b"H" * 16 + b"".join(p.data.tobytes() for p in pieces)


def test_every_object_store_scheme_the_router_routes_has_a_client():
    # The router keeps its own set of schemes so that local I/O never imports the object-store
    # engine; the two lists must name the same schemes.
    from orbax_safetensors._src.storage.objstore import engine as _engine

    assert set(_engine._CLIENTS) == set(_router._OBJECT_SCHEMES)
    assert all(_router.is_object_url(f"{scheme}://bucket/key") for scheme in _engine._CLIENTS)
