"""The local engine: positional, vectored writes (``pwritev``, several processes can fill one
pre-sized file) and reads (``preadv`` into aligned buffers, small gaps read into scratch so one
call serves many runs) of many byte runs, from a few threads; large aligned runs may go
through ``O_DIRECT`` (:mod:`.direct`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import direct as _direct
from orbax_safetensors._src.storage import interface as _interface


def _vectored_all(
    call: Callable[[int, list[memoryview], int], int],
    fd: int,
    bufs: list[memoryview],
    offset: int,
    on_stall: Callable[[int], Exception],
) -> None:
    # os.pwritev / os.preadv may move fewer bytes than asked: resume where they stopped.
    while bufs:
        moved = call(fd, bufs, offset)
        if moved <= 0:
            raise on_stall(offset)
        offset += moved
        while bufs and moved >= len(bufs[0]):
            moved -= len(bufs[0])
            bufs.pop(0)
        if bufs and moved:
            bufs[0] = bufs[0][moved:]


# Linux's sync_file_range(SYNC_FILE_RANGE_WRITE) starts writeback of a range without waiting:
# called on each range as it is written, the disk works while later ranges are copied, the
# final fsync has little left to do, and the writer is not throttled for its dirty pages.
_sync_file_range = _direct.libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2

# Work unit of a local write: up to this many bytes (or _runs.IOV_MAX pieces) per pwritev, each
# checksummed just before it is written, so the CRC of one unit overlaps the write of another.
_WRITE_UNIT_BYTES = 8 << 20
WRITE_THREADS = 2
DIRECT_WRITE_THREADS = 4  # at least this many threads when writing through O_DIRECT


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    _vectored_all(os.pwritev, fd, bufs, offset, lambda at: OSError(f"pwritev stalled at {at}"))


def _write_units(pieces: Sequence[_interface.Piece]) -> list[list[tuple[int, int, memoryview]]]:
    # (piece number, start inside the piece, bytes), in file order: at most _WRITE_UNIT_BYTES
    # / _runs.IOV_MAX entries per unit, which may hold several runs apart (a column shard's
    # rows are one task of the pool, not one each). Large pieces are cut at file offsets that
    # are multiples of _WRITE_UNIT_BYTES: whole 4 KiB blocks (written direct) but at the ends.
    units: list[list[tuple[int, int, memoryview]]] = []
    unit: list[tuple[int, int, memoryview]] = []
    size = 0
    for k, p in enumerate(pieces):
        view = p.data.data
        start = 0
        while start < len(view):  # nothing for an empty piece
            offset = p.offset + start
            stop = min(len(view), (offset // _WRITE_UNIT_BYTES + 1) * _WRITE_UNIT_BYTES - p.offset)
            chunk = view if (start, stop) == (0, len(view)) else view[start:stop]
            if unit and (len(unit) >= _runs.IOV_MAX or size + len(chunk) > _WRITE_UNIT_BYTES):
                units.append(unit)
                unit, size = [], 0
            unit.append((k, start, chunk))
            size += len(chunk)
            start = stop
    if unit:
        units.append(unit)
    return units


def _contiguous_runs(
    ordered: Sequence[_interface.Piece], unit: list[tuple[int, int, memoryview]]
) -> list[tuple[int, list[memoryview]]]:
    # A unit's entries (in file order) as (file offset, views) of back-to-back bytes.
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for k, start, view in unit:
        offset = ordered[k].offset + start
        if offset != end:
            runs.append((offset, []))
        runs[-1][1].append(view)
        end = offset + len(view)
    return runs


def _placed_apart(views: Sequence[memoryview], offset: int) -> list[tuple[int, list[memoryview]]]:
    # A run of ``views`` (written from ``offset`` on, one after the other) cut so that every
    # view of a block or more at an address congruent to its file offset modulo a block is a
    # run of its own (buffers.LentBuffers places them so: their whole blocks go direct as they
    # are); the views between stay together (staged for direct I/O, or buffered).
    runs: list[tuple[int, list[memoryview]]] = []
    loose = False  # whether the last run holds views that are not placed
    for view in views:
        placed = (
            len(view) >= _direct.BLOCK
            and (_buffers.data_address(view) - offset) % _direct.BLOCK == 0
        )
        if placed or not loose:
            runs.append((offset, []))
        runs[-1][1].append(view)
        loose = not placed
        offset += len(view)
    return runs


def _piece_results(
    ordered: Sequence[_interface.Piece],
    results: Sequence[list[tuple[int, int, int, int]]],
    checksums: bool,
) -> _interface.WriteResult:
    # Per-unit (piece number, start, nbytes, crc) records -> (tag, nbytes, crc) per piece.
    if not checksums:
        return [(p.tag, p.data.nbytes, 0) for p in ordered]
    runs: list[list[tuple[int, int, int]]] = [[] for _ in ordered]
    for result in results:
        for k, start, n, crc in result:
            runs[k].append((start, n, crc))
    return [
        (p.tag, p.data.nbytes, _checksum.combine_runs(r, p.data.nbytes))
        for p, r in zip(ordered, runs, strict=True)
    ]


@dataclasses.dataclass
class _PendingUnits:
    ordered: Sequence[_interface.Piece]
    futures: list[concurrent.futures.Future[list[tuple[int, int, int, int]]]]
    checksums: bool

    def result(self) -> _interface.WriteResult:
        return _piece_results(self.ordered, [f.result() for f in self.futures], self.checksums)


class LocalWriter:
    """Writes pieces with ``pwritev`` from a small thread pool, CRC32C on the way; a durable
    writer (``sync``) sends the whole blocks of large units through ``O_DIRECT``."""

    def __init__(
        self,
        path: str,
        size: int,
        truncate: bool,
        threads: int,
        sync: bool,
        *,
        direct_io: str | None = None,
    ) -> None:
        self.path = path
        self.size = size
        self._sync = sync
        mode = _direct.mode(direct_io)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self._fd = self._call(os.open, path, flags, 0o644)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Direct writes only pay off for bytes that must reach the device (a durable file).
        self._direct_wanted = mode == "always" or (mode == "auto" and sync)
        # A direct write holds its thread until the device has the bytes: more threads keep
        # more writes in flight (the page cache's writeback queues them for buffered writes).
        direct_threads = max(threads, DIRECT_WRITE_THREADS) if threads > 1 else threads
        self._threads = direct_threads if self._direct_wanted else threads
        self._direct_fd: int | None = None  # opened on the first direct write
        self._direct_lock = threading.Lock()
        self._staging: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self.direct_bytes = 0  # bytes written through O_DIRECT
        try:
            self._call(os.ftruncate, self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            # ftruncate/pwritev/fsync errors carry no file name: name the file (disk full, quota).
            raise OSError(e.errno, f"{e.strerror} (writing {self.size} bytes)", self.path) from e

    def _run(
        self,
        ordered: Sequence[_interface.Piece],
        unit: list[tuple[int, int, memoryview]],
        checksums: bool,
    ) -> list[tuple[int, int, int, int]]:
        # crc32c releases the GIL on large buffers, as pwritev does: two units proceed on two
        # cores, and each unit's bytes are still in cache when written.
        crcs = [(k, s, len(v), _checksum.crc32c(v) if checksums else 0) for k, s, v in unit]
        for offset, views in _contiguous_runs(ordered, unit):
            self._write_run(views, offset)
        return crcs

    def _write_run(self, views: list[memoryview], offset: int) -> None:
        # Placed views (buffers.LentBuffers) sent on their own: no staging copy.
        runs = _placed_apart(views, offset) if len(views) > 1 else [(offset, views)]
        for at, part in runs:
            self._write_span(part, at)

    def _write_span(self, views: list[memoryview], offset: int) -> None:
        nbytes = sum(len(v) for v in views)
        first, last = _direct.block_span(offset, nbytes)
        if last - first >= _direct.MIN_BYTES and self._direct_descriptor() is not None:
            # Partial blocks at either end buffered, the blocks between direct.
            self._write_buffered(_buffers.slice_views(views, 0, first - offset), offset)
            self._write_buffered(_buffers.slice_views(views, last - offset, nbytes), last)
            self._write_direct(_buffers.slice_views(views, first - offset, last - offset), first)
        else:
            self._write_buffered(views, offset)

    def _write_buffered(self, views: list[memoryview], offset: int) -> None:
        if not views:
            return
        self._call(_pwritev_all, self._fd, views, offset)
        if self._sync and _sync_file_range is not None:  # (a failure only loses the head start)
            n = sum(len(v) for v in views)
            _sync_file_range(self._fd, offset, n, _SYNC_FILE_RANGE_WRITE)

    def _direct_descriptor(self) -> int | None:
        if not self._direct_wanted:
            return None
        with self._direct_lock:
            if self._direct_fd is None:
                self._direct_fd = _direct.open_direct(self.path, os.fstat(self._fd), write=True)
                if self._direct_fd is None:  # the filesystem refuses: buffered from now on
                    self._direct_wanted = False
            return self._direct_fd

    def _write_direct(self, views: list[memoryview], offset: int) -> None:
        fd = self._direct_fd
        assert fd is not None
        nbytes = sum(len(v) for v in views)
        stage = None
        if len(views) == 1 and _buffers.data_address(views[0]) % _direct.BLOCK == 0:
            source = views[0]  # a buffer placed for its file offset (buffers.LentBuffers)
        else:
            # O_DIRECT needs a block-aligned source address: the pieces' host buffers are
            # most often not (XLA's or numpy's allocations), so the bytes are staged through an
            # aligned buffer of this thread's (a memory-speed copy, overlapped with the other
            # threads' writes).
            try:
                stage = self._staging.get_nowait()
            except queue.Empty:
                stage = _direct.staging_buffer(_WRITE_UNIT_BYTES)
            at = 0
            for v in views:
                np.copyto(
                    np.frombuffer(stage[at : at + len(v)], np.uint8), np.frombuffer(v, np.uint8)
                )
                at += len(v)
            source = stage[:nbytes]
        try:
            moved = self._call(_direct.write_direct, fd, offset, source)
            if moved < nbytes:  # refused or short: the rest buffered, and buffered from now on
                self._direct_wanted = False
                self._write_buffered([source[moved:nbytes]], offset + moved)
        finally:
            if stage is not None:
                self._staging.put(stage)
        with self._direct_lock:
            self.direct_bytes += moved

    def write(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.WriteResult:
        return self._start(pieces, checksums, hop=False).result()

    def submit(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.PendingWrite:
        return self._start(pieces, checksums, hop=True)

    def _start(
        self, pieces: Sequence[_interface.Piece], checksums: bool, *, hop: bool
    ) -> _interface.PendingWrite:
        # On the pool's threads, or here (one thread; or one unit of a write that waits: no
        # thread hop for a small write).
        ordered = sorted(pieces, key=lambda p: p.offset)
        units = _write_units(ordered)
        if self._threads <= 1 or (not hop and len(units) <= 1):
            crcs = [self._run(ordered, u, checksums) for u in units]
            return _interface.Done(_piece_results(ordered, crcs, checksums))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads)
        futures = [self._pool.submit(self._run, ordered, u, checksums) for u in units]
        return _PendingUnits(ordered, futures, checksums)

    def close(self, sync: bool) -> None:
        try:
            if self._pool is not None:
                # On failure (not sync) writes not yet started are dropped, not run.
                self._pool.shutdown(cancel_futures=not sync)
            if sync:  # one inode: this also makes the direct writes durable (device cache)
                self._call(os.fsync, self._fd)
        finally:
            if self._direct_fd is not None:
                os.close(self._direct_fd)
            os.close(self._fd)


class LocalReader:
    def __init__(self, path: epath.PathLike, threads: int, *, direct_io: str | None = None) -> None:
        self.path = os.fspath(path)
        self._fd, self._stat = _confine.open_regular(self.path)  # (a FIFO: refused, not waited on)
        self.size = self._stat.st_size
        self._threads = threads
        self._direct_mode = _direct.mode(direct_io)
        self._direct_fd: int | None = None  # opened on the first direct read
        self._direct_refused = False  # the filesystem refused O_DIRECT: read buffered
        self._cache_probe: Any = _UNPROBED  # auto mode: which ranges are in the page cache
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # reading threads
        self.bytes_read = 0  # bytes asked of the file, coalesced gaps included
        self.requests = 0  # ranged read requests (one per coalesced batch)
        self.direct_bytes = 0  # of bytes_read, read through O_DIRECT
        self._count_lock = threading.Lock()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._direct_fd is not None:
            os.close(self._direct_fd)
        os.close(self._fd)

    def pread(self, offset: int, nbytes: int) -> bytes:
        nbytes = max(0, min(nbytes, self.size - offset))
        out = bytearray()
        while len(out) < nbytes:
            chunk = os.pread(
                self._fd, min(nbytes - len(out), _runs.MAX_CALL_BYTES), offset + len(out)
            )
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def read_runs(
        self,
        runs: Sequence[tuple[int, np.ndarray]],
        max_gap: int = _runs.DEFAULT_MAX_GAP,
        on_run: Callable[[int], None] | None = None,
    ) -> None:
        """Fills each ``(offset, dest)`` with the file bytes at ``offset`` (dest is flat uint8).

        ``on_run(i)`` is called (from a reading thread) as soon as run ``i`` is in place: work
        on its bytes then finds them still in the CPU cache. The whole 4 KiB blocks of large
        runs may be read through ``O_DIRECT`` (see :mod:`.direct`).
        """
        split = self._split_direct(runs)
        if split is None or not split.direct:
            self._read_buffered(runs, max_gap, on_run, [])
            return
        # Runs read in several parts: run i is in place once its last part is.
        owners = [i for _, _, i in split.buffered]
        part_done = _once_all_parts_in(owners + [i for _, _, i in split.direct], len(runs), on_run)

        self.requests += len(split.direct)
        self.bytes_read += sum(len(v) for _, v, _ in split.direct)
        direct_tasks: list[tuple[int, Callable[[], None]]] = [
            (offset, functools.partial(self._read_direct, offset, view, i, part_done))
            for offset, view, i in split.direct
        ]
        self._read_buffered(
            [(o, d) for o, d, _ in split.buffered],
            max_gap,
            lambda k: part_done(owners[k]),
            direct_tasks,
        )

    def _split_direct(self, runs: Sequence[tuple[int, np.ndarray]]) -> _direct.Split | None:
        if self._direct_mode == "never" or self._direct_refused:
            return None
        if not any(dest.nbytes >= _direct.MIN_BYTES for _, dest in runs):
            return None
        cached = None
        if self._direct_mode == "auto":
            if self._cache_probe is _UNPROBED:  # once per open file (a restore reads it in
                # several calls; the probe maps the whole file where cachestat is missing)
                self._cache_probe = _direct.page_cache_probe(self._fd, self.path, self._stat)
            cached = self._cache_probe
            if cached is None:
                return None  # the page cache cannot be seen: buffered, as warm reads want
        split = _direct.split_runs(runs, cached)
        if split.direct and self._direct_fd is None:
            self._direct_fd = _direct.open_direct(self.path, self._stat)
            if self._direct_fd is None:
                self._direct_refused = True
                return None
        return split

    def _read_direct(
        self, offset: int, view: memoryview, run: int, done: Callable[[int], None]
    ) -> None:
        fd = self._direct_fd
        moved = 0 if fd is None or self._direct_refused else _direct.read_direct(fd, offset, view)
        if moved < len(view):  # refused or short: the rest buffered, and buffered from now on
            self._direct_refused = True
            self._read_batch((offset + moved, [view[moved:]]))
        with self._count_lock:  # reading threads finish at once: += is not atomic
            self.direct_bytes += moved
        done(run)

    def _read_buffered(
        self,
        runs: Sequence[tuple[int, np.ndarray]],
        max_gap: int,
        on_run: Callable[[int], None] | None,
        extra: list[tuple[int, Callable[[], None]]],
    ) -> None:
        # ``extra``: (file offset, direct read) to run on the same threads, each one task.
        # Batches of an even share of the bytes per thread (4-16 MiB), a large run split into
        # such pieces: a few large tensors (a restore's wave) are read by every thread, not
        # one thread each.
        whole_runs = runs
        max_batch = _LOCAL_BATCH_BYTES
        if self._threads > 1:
            max_batch = _runs.share_bytes(sum(d.nbytes for _, d in runs), self._threads)
            runs, on_run = _split_runs(runs, max_batch, on_run)
        batches = _runs.coalesce_runs(runs, max_gap, bounded=True, max_batch=max_batch)
        self.requests += len(batches)
        self.bytes_read += sum(len(b) for _, bufs, _ in batches for b in bufs)
        tasks = len(batches) + len(extra)
        if self._threads > 1 and tasks > 1:
            # One task per thread, each a contiguous share of the batches: many small reads
            # (column shards) would otherwise pay the pool's per-task overhead each. Direct
            # reads are large: one task each, in file order, so the device sees one stream.
            workers = min(self._threads, tasks)
            shares = []
            if batches:
                step = -(-len(batches) // min(workers, len(batches)))
                shares = [batches[i : i + step] for i in range(0, len(batches), step)]
            jobs = extra + [
                (s[0][0], functools.partial(self._read_share, s, on_run)) for s in shares
            ]
            jobs.sort(key=lambda job: job[0])
            if self._pool is None:  # kept for the reader's life: a restore reads in waves
                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads)
            futures = [self._pool.submit(job) for _, job in jobs]
            concurrent.futures.wait(futures)  # all done (a failed one included) before raising
            for future in futures:
                future.result()
        else:
            for _, job in extra:
                job()
            self._read_share(batches, on_run)
        if on_run is not None:  # empty runs need no bytes: done at once
            for i, (_, dest) in enumerate(whole_runs):
                if not dest.nbytes:
                    on_run(i)

    def _read_share(
        self, batches: list[_runs.ReadBatch], on_run: Callable[[int], None] | None
    ) -> None:
        for start, bufs, ids in batches:
            self._read_batch((start, bufs))
            if on_run is not None:
                for i in ids:
                    on_run(i)

    def _read_batch(self, batch: tuple[int, list[memoryview]]) -> None:
        offset, bufs = batch
        want = sum(len(b) for b in bufs)
        if offset + want > self.size:
            raise EOFError(f"{self.path}: needs bytes up to {offset + want}, file has {self.size}")
        _vectored_all(
            os.preadv,
            self._fd,
            bufs,
            offset,
            lambda at: EOFError(f"{self.path}: unexpected end of file at offset {at}"),
        )


def _split_runs(
    runs: Sequence[tuple[int, np.ndarray]], piece: int, on_run: Callable[[int], None] | None
) -> tuple[Sequence[tuple[int, np.ndarray]], Callable[[int], None] | None]:
    """``runs`` with those over ``piece`` bytes cut into pieces of about that size, and an
    ``on_run`` for the pieces that calls the given one once all of a run's pieces are in place.
    Empty runs are left out (the caller reports them)."""
    if all(d.nbytes <= piece for _, d in runs):
        return runs, on_run
    pieces: list[tuple[int, np.ndarray]] = []
    owner: list[int] = []
    for i, (offset, dest) in enumerate(runs):
        if not dest.nbytes:
            continue
        for start, end in _runs.piece_spans(offset, dest.nbytes, piece):
            pieces.append((offset + start, dest[start:end]))
            owner.append(i)
    if on_run is None:
        return pieces, None
    run_done = _once_all_parts_in(owner, len(runs), on_run)
    return pieces, lambda k: run_done(owner[k])


def _once_all_parts_in(
    owners: Sequence[int], runs: int, on_run: Callable[[int], None] | None
) -> Callable[[int], None]:
    """``done(i)``, to call (from any thread) as each part of run ``i`` is in place (``owners``:
    the run of each part): calls ``on_run(i)`` once the last one is."""
    parts = [0] * runs
    for i in owners:
        parts[i] += 1
    lock = threading.Lock()

    def done(i: int) -> None:
        with lock:
            parts[i] -= 1
            last = parts[i] == 0
        if last and on_run is not None:
            on_run(i)

    return done


_UNPROBED = object()

# Local reads: batches of at most 16 MiB, so several threads share a large contiguous read and
# each run's bytes are still cached when on_run looks at them.
_LOCAL_BATCH_BYTES = 16 << 20
