"""What every storage engine writes and returns: pieces (bytes at a file offset), write
results, and the writer protocol ``router.open_writer`` hands out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np


@dataclasses.dataclass
class Piece:
    """Bytes to write at an absolute file offset; ``data`` is a flat, C-contiguous uint8 array."""

    offset: int
    data: np.ndarray
    tag: object = None  # the caller's label (e.g. tensor name and offset in it)


def header_piece(header: bytes) -> Piece:
    """The piece that writes a file's header (its first bytes); untagged, so not checksummed."""
    return Piece(0, np.frombuffer(header, dtype=np.uint8))


WriteResult = list[tuple[object, int, int]]  # (tag, nbytes, crc32c or 0) per piece


class PendingWrite(Protocol):
    """A write under way: ``result()`` waits for it (its error raised)."""

    def result(self) -> WriteResult: ...


class Writer(Protocol):
    """Positional writes into one file of known final size (see :func:`.router.open_writer`)."""

    path: str

    def write(self, pieces: Sequence[Piece], *, checksums: bool = False) -> WriteResult:
        """Writes each piece at its offset; the results in offset order."""
        ...

    def submit(self, pieces: Sequence[Piece], *, checksums: bool = False) -> PendingWrite:
        """Starts writing; the pieces' buffers stay untouched until ``result()`` returns."""
        ...


@dataclasses.dataclass
class Done:
    value: WriteResult

    def result(self) -> WriteResult:
        return self.value
