"""Other ``etils.epath`` backends: a file written as one sequential stream once every byte is
in hand, and ranged reads through a seekable file object.

Example::

    writer = BufferedWriter(path, size, flush=write_stream)
    writer.write(pieces)
    writer.close(sync=True)  # flush(path, pieces in offset order, size)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.storage import interface as _interface

Flush = Callable[[str, Sequence[_interface.Piece], int], None]


class BufferedWriter:
    """Collects pieces for a path that is written as a whole on close (object storage, other
    epath backends): a streamed write needs every byte, in order. ``flush(path, pieces in
    offset order, size)`` writes them."""

    def __init__(self, path: str, size: int, flush: Flush) -> None:
        self.path = path
        self.size = size
        self._flush = flush
        self._pieces: list[_interface.Piece] = []

    def write(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.WriteResult:
        self._pieces.extend(pieces)
        return [
            (p.tag, p.data.nbytes, _checksum.crc32c(p.data) if checksums else 0) for p in pieces
        ]

    def submit(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.PendingWrite:
        return _interface.Done(self.write(pieces, checksums=checksums))

    def close(self, sync: bool) -> None:
        ordered = sorted(self._pieces, key=lambda p: p.offset)
        self._pieces = []
        self._flush(self.path, ordered, self.size)


def write_stream(path: str, ordered: Sequence[_interface.Piece], size: int) -> None:
    """Writes ``ordered`` (every byte of the file, in offset order) as one stream to ``path``."""
    target = epath.Path(path)
    expected = 0
    with target.open("wb") as f:
        for p in ordered:
            if p.offset != expected:
                raise ValueError(
                    f"{target}: a streamed write needs every byte (gap at offset {expected})"
                )
            f.write(p.data.data)
            expected += p.data.nbytes
    if expected != size:
        raise ValueError(f"{target}: streamed {expected} bytes, expected {size}")


class StreamReader:
    """Ranged reads through a file-like object (object storage, other epath backends)."""

    def __init__(self, path: epath.PathLike) -> None:
        self.path = epath.Path(path)
        self._f = self.path.open("rb")
        self._f.seek(0, os.SEEK_END)
        self.size = self._f.tell()
        self.bytes_read = 0
        self.requests = 0

    def close(self) -> None:
        self._f.close()

    def pread(self, offset: int, nbytes: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(max(0, min(nbytes, self.size - offset)))

    def read_runs(
        self,
        runs: Sequence[tuple[int, np.ndarray]],
        max_gap: int = _runs.DEFAULT_MAX_GAP,
        on_run: Callable[[int], None] | None = None,
    ) -> None:
        for i, (offset, dest) in sorted(enumerate(runs), key=lambda r: r[1][0]):
            if offset + dest.nbytes > self.size:
                raise EOFError(
                    f"{self.path}: needs bytes up to {offset + dest.nbytes}, file has {self.size}"
                )
            self._f.seek(offset)
            self.requests += 1
            self.bytes_read += dest.nbytes
            view = dest.data
            got = 0
            while got < dest.nbytes:
                n = self._f.readinto(view[got:])
                if not n:
                    raise EOFError(f"{self.path}: unexpected end of file at {offset + got}")
                got += n
            if on_run is not None:
                on_run(i)
