"""Host buffers: 64-byte aligned (``jax.device_put(..., may_alias=True)`` can share them),
large ones congruent to their file offset modulo 4 KiB (direct I/O fills their whole blocks in
place), and reused where a job repeats, since first touching fresh memory is slow on virtual
machines: across saves (:class:`HostBufferPool`), for an export's bands (:class:`LentBuffers`),
as a restore's ring (:class:`StagingRing`); and file objects over lists of memoryviews (an
upload's body, a download's sink: no copy).
"""

from __future__ import annotations

import bisect
import collections
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ALIGNMENT = 64
_PAGE = 4096  # the block direct I/O aligns to (:data:`.direct.BLOCK`)


def aligned_empty(
    nbytes: int, alignment: int = ALIGNMENT, *, file_offset: int | None = None
) -> np.ndarray:
    """An uninitialised flat uint8 array of ``nbytes``, ``alignment``-aligned, or congruent to
    ``file_offset`` (a multiple of ``alignment``) modulo 4 KiB when given."""
    if file_offset is not None and file_offset % alignment == 0:
        alignment, phase = max(alignment, _PAGE), file_offset % _PAGE
    else:
        phase = 0
    return _at_phase(np.empty(nbytes + alignment, dtype=np.uint8), nbytes, alignment, phase)


def _at_phase(raw: np.ndarray, nbytes: int, alignment: int, phase: int) -> np.ndarray:
    # ``nbytes`` of ``raw`` (``nbytes + alignment`` long) from the address congruent to
    # ``phase`` modulo ``alignment``.
    start = (phase - raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


def data_address(data: Any) -> int:
    """The address of the first byte of ``data`` (an array, a memoryview, bytes), 0 if empty."""
    return int(np.frombuffer(data, np.uint8).ctypes.data) if len(data) else 0


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The bytes ``[start, stop)`` of the concatenation of ``views``, as views (no copy)."""
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

    def _take(self, n: int) -> list[memoryview]:
        # Views of the next ``n`` bytes (fewer at the end), the position moved past them.
        stop = min(self._pos + n, self._size)
        chunks = []
        while self._pos < stop:
            while self._starts[self._i + 1] <= self._pos:
                self._i += 1
            start = self._pos - self._starts[self._i]
            k = min(stop - self._pos, len(self._views[self._i]) - start)
            chunks.append(self._views[self._i][start : start + k])
            self._pos += k
        return chunks

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        for chunk in self._take(len(out)):
            out[done : done + len(chunk)] = chunk
            done += len(chunk)
        return done

    def read(self, size: int | None = -1) -> bytes:  # (copied once)
        if size is None or size < 0:
            size = self._size - self._pos
        chunks = self._take(size)
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


class BufferArena:
    """Aligned buffers, small ones carved from shared slabs (many small tensors cost a few
    allocations); a slab lives while any of its buffers does. Large ones come from ``pool``
    when given (:meth:`HostBufferPool.arena`), kept in :attr:`taken` for its release."""

    _SLAB = 4 << 20

    def __init__(self, pool: HostBufferPool | None = None) -> None:
        self._slab: np.ndarray | None = None
        self._used = 0
        self._pool = pool
        self.taken: list[np.ndarray] = []

    def empty(self, nbytes: int, *, file_offset: int | None = None) -> np.ndarray:
        """An uninitialised flat uint8 array of ``nbytes`` (see :func:`aligned_empty`; a pooled
        large buffer is 64-byte aligned, whatever ``file_offset``)."""
        if nbytes > self._SLAB // 8:
            if self._pool is None:
                return aligned_empty(nbytes, file_offset=file_offset)
            buffer = self._pool.take(nbytes)
            self.taken.append(buffer)
            return buffer[:nbytes]
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._slab is None or start + nbytes > self._slab.nbytes:
            self._slab, start = aligned_empty(self._SLAB), 0
        self._used = start + nbytes
        return self._slab[start : start + nbytes]


class HostBufferPool:
    """Large host buffers kept from one save to the next (an async save's host copy lands in
    pages already mapped). Each save takes an :meth:`arena` and gives it back with
    :meth:`release` once its writes are done; between saves the pool holds at most one save's
    large buffers. Thread-safe."""

    # Capacities are rounded up to whole pages, so that a slightly smaller tensor reuses too.
    _GRANULE = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}

    def arena(self) -> BufferArena:
        return BufferArena(self)

    def take(self, nbytes: int) -> np.ndarray:
        """An aligned buffer of at least ``nbytes`` (a free one of that rounded capacity)."""
        capacity = -(-nbytes // self._GRANULE) * self._GRANULE
        with self._lock:
            free = self._free.get(capacity)
            if free:
                return free.pop()
        return aligned_empty(capacity)

    def release(self, arena: BufferArena) -> None:
        """Makes ``arena``'s large buffers the free ones (dropping those of earlier saves), once
        nothing reads them any more."""
        taken, arena.taken = arena.taken, []
        with self._lock:
            self._free = {}
            for buffer in taken:
                self._free.setdefault(buffer.nbytes, []).append(buffer)

    def clear(self) -> None:
        with self._lock:
            self._free = {}

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for buffers in self._free.values() for b in buffers)


class LentBuffers:
    """Host buffers of one fixed capacity, lent out and given back, for a job that fills and
    writes many same-sized blocks (an export's cast bands), so each block lands in memory
    already mapped. Larger requests get fresh memory. With ``file_offset`` a block is placed
    for direct I/O (no staging copy). Give a buffer back only once nothing reads it (its
    write's ``result()`` returned). Thread-safe."""

    def __init__(self, capacity: int, max_idle: int = 64) -> None:
        self.capacity = capacity
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._lent: dict[int, np.ndarray] = {}  # data address of a view lent -> its buffer
        self.fresh = 0  # buffers of this capacity allocated (not reused)

    def take(self, nbytes: int, *, file_offset: int | None = None) -> np.ndarray:
        """``nbytes`` of a free buffer (else a new one), page-aligned or placed for
        ``file_offset``."""
        if nbytes > self.capacity:
            fresh = np.empty(nbytes + _PAGE, np.uint8)
            return _at_phase(fresh, nbytes, _PAGE, (file_offset or 0) % _PAGE)
        with self._lock:
            buffer = self._free.pop() if self._free else None
            if buffer is None:
                self.fresh += 1
        if buffer is None:  # a page to spare for the phase
            buffer = np.empty(self.capacity + _PAGE, np.uint8)
        view = _at_phase(buffer, nbytes, _PAGE, (file_offset or 0) % _PAGE)
        with self._lock:
            self._lent[view.ctypes.data] = buffer
        return view

    def give_back(self, data: Any) -> None:
        """Makes the buffer of ``data`` (a :meth:`take` result or a view from its start) free
        again; anything else is ignored."""
        address = data_address(data) if len(data) else -1
        with self._lock:
            buffer = self._lent.pop(address, None)
            if buffer is not None and len(self._free) < self._max_idle:
                self._free.append(buffer)


class StagingRing:
    """One host buffer used as a ring for transfers that copy out of it (a restore onto an
    accelerator): reads land in the ring while the transfers of earlier reads run, and space is
    taken again once the transfers out of it are done, so a state of any size is read with the
    ring's pages faulted once.

    Space is taken with :meth:`take` and handed over in groups with :meth:`hold` (``wait``
    returns once the group's transfers are done; :meth:`take` calls the oldest groups' first
    when it needs their space). Not thread-safe: one restore at a time (:meth:`drain` between).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = -(-capacity // _PAGE) * _PAGE
        raw = np.empty(self.capacity + _PAGE, np.uint8)
        self._ring = _at_phase(raw, self.capacity, _PAGE, 0)  # page-aligned
        self._head = 0  # ring offset where the next take starts
        self._segments: list[tuple[int, int]] = []  # space taken since the last hold
        # Space in flight, oldest first: (start, end, wait of its group).
        self._held: collections.deque[tuple[int, int, Callable[[], Any]]] = collections.deque()
        self.waits = 0  # how many times a take waited for a transfer

    def fits(self, nbytes: int) -> bool:  # (placed for any file offset)
        return nbytes + _PAGE <= self.capacity

    def take(self, nbytes: int, *, file_offset: int | None = None) -> np.ndarray:
        """``nbytes`` of the ring, placed as :func:`aligned_empty` places it, once the transfers
        still reading that space are done; ``ValueError`` if it does not :meth:`fit <fits>`."""
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes do not fit a staging ring of {self.capacity}")
        placed = file_offset is not None and file_offset % ALIGNMENT == 0
        phase = file_offset % _PAGE if placed and file_offset is not None else 0
        start = self._placed_at(self._head, phase, placed)
        if start + nbytes > self.capacity:  # wrap: the rest of this lap stays unused
            start = self._placed_at(0, phase, placed)
        end = start + nbytes
        if any(s < end and start < e for s, e in self._segments):
            raise ValueError(
                f"a group of more than {self.capacity} bytes: hold() its transfers first"
            )
        while any(s < end and start < e for s, e, _ in self._held):
            self.waits += 1
            self._release_oldest()
        if self._segments and start >= self._head:
            self._segments[-1] = (self._segments[-1][0], end)
        else:
            self._segments.append((start, end))
        self._head = end
        return self._ring[start:end]

    @staticmethod
    def _placed_at(at: int, phase: int, placed: bool) -> int:
        start = -(-at // ALIGNMENT) * ALIGNMENT
        return start + (phase - start) % _PAGE if placed else start

    def hold(self, wait: Callable[[], Any]) -> None:
        """The space taken since the last hold stays in use until ``wait()`` has returned."""
        for start, end in self._segments:
            self._held.append((start, end, wait))
        self._segments = []

    def drain(self) -> None:
        """Waits for every transfer held: the whole ring is free again."""
        while self._held:
            self._release_oldest()
        self._segments = []
        self._head = 0

    def _release_oldest(self) -> None:
        _, _, wait = self._held.popleft()
        wait()
