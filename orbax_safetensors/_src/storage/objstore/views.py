"""Bytes as lists of memoryviews, without copies: upload bodies (:class:`ViewsReader`),
download sinks (:class:`ViewsWriter`), this process's contiguous bytes of a file
(:class:`Segment`) and the splitting of long requests.

Example::

    body = ViewsReader([memoryview(b"abc"), memoryview(b"de")])
    assert body.read() == b"abcde"
    assert even_chunks(10, 4) == [(0, 3), (3, 6), (6, 10)]
"""

from __future__ import annotations

import bisect
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.storage import interface as _interface


class ViewsReader(io.RawIOBase):
    """A seekable, read-only file over a list of memoryviews (an upload body, no copy)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        self._starts = [0]
        for v in self._views:
            self._starts.append(self._starts[-1] + len(v))
        self._size = self._starts[-1]
        self._pos = 0
        self._i = 0  # index of the view holding byte ``_pos`` (sequential reads skip search)

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        self._i = max(0, bisect.bisect_right(self._starts, self._pos) - 1)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            while self._starts[self._i + 1] <= self._pos:
                self._i += 1
            view = self._views[self._i]
            start = self._pos - self._starts[self._i]
            n = min(len(out) - done, len(view) - start)
            out[done : done + n] = view[start : start + n]
            done += n
            self._pos += n
        return done

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes, copied once (``bytes`` of one view, or a join of several)."""
        if size is None or size < 0:
            size = self._size - self._pos
        stop = min(self._pos + size, self._size)
        chunks = []
        while self._pos < stop:
            while self._starts[self._i + 1] <= self._pos:
                self._i += 1
            start = self._pos - self._starts[self._i]
            n = min(stop - self._pos, len(self._views[self._i]) - start)
            chunks.append(self._views[self._i][start : start + n])
            self._pos += n
        return chunks[0].tobytes() if len(chunks) == 1 else b"".join(chunks)

    def readall(self) -> bytes:
        return self.read(-1)


class ViewsWriter(io.RawIOBase):
    """A write-only file that fills a list of memoryviews in order (a download sink)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = list(views)
        self._i = 0
        self._off = 0
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        done = 0
        while done < len(src):
            if self._i >= len(self._views):
                raise EOFError("object storage returned more bytes than requested")
            view = self._views[self._i]
            n = min(len(src) - done, len(view) - self._off)
            view[self._off : self._off + n] = src[done : done + n]
            done += n
            self._off += n
            if self._off == len(view):
                self._i += 1
                self._off = 0
        self.written += done
        return done


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The bytes ``[start, stop)`` of the concatenation of ``views``, as views."""
    out: list[memoryview] = []
    pos = 0
    for view in views:
        end = pos + len(view)
        if end > start and pos < stop:
            out.append(view[max(start, pos) - pos : min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


def even_chunks(total: int, target: int) -> list[tuple[int, int]]:
    """Splits ``[0, total)`` into the fewest near-equal chunks of at most ``target`` bytes.

    Every chunk is at least ``min(total, target // 2)`` bytes long, so with ``target >= 2 * m``
    and ``total >= m`` every chunk is >= ``m`` (S3's minimum part size).
    """
    if total <= 0:
        return []
    n = max(1, -(-total // target))
    bounds = [total * k // n for k in range(n + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


def split_request(
    start: int, bufs: Sequence[memoryview], limit: int
) -> list[tuple[int, list[memoryview]]]:
    """The request that fills ``bufs`` from object offset ``start``, as ``(start, views)``
    requests of at most ``limit`` bytes each."""
    total = sum(len(b) for b in bufs)
    if total <= limit:
        return [(start, list(bufs))]
    return [(start + a, slice_views(bufs, a, b)) for a, b in even_chunks(total, limit)]


@dataclasses.dataclass
class Segment:
    """Contiguous bytes this process holds: ``views`` concatenated start at ``start``."""

    start: int
    views: list[memoryview]
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def slice(self, a: int, b: int) -> list[memoryview]:
        """Views of absolute file bytes ``[a, b)`` (inside this segment)."""
        return slice_views(self.views, a - self.start, b - self.start)


def segments_of(pieces: Sequence[_interface.Piece]) -> list[Segment]:
    """The bytes of ``pieces`` as contiguous segments in offset order (touching pieces
    joined, empty ones dropped); ValueError if two pieces overlap."""
    out: list[Segment] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        n = int(p.data.nbytes)
        if n == 0:
            continue
        view = np.ascontiguousarray(p.data).reshape(-1).view(np.uint8).data
        if out and out[-1].end == p.offset:
            out[-1].views.append(view)
            out[-1].size += n
        elif out and out[-1].end > p.offset:
            raise ValueError(f"pieces overlap at offset {p.offset}")
        else:
            out.append(Segment(int(p.offset), [view], n))
    return out
