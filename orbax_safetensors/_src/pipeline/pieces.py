"""From host copies to write pieces: each shard's box as byte runs (``core.runs``), each run a
``storage.interface.Piece`` at its file offset; per-tensor CRC32C from the same pieces. Also the
bulk-work helpers of the pipeline: :func:`ordered_map` (casts on several threads) and
:func:`gc_paused` (the cyclic GC held off while a caller waits for a save or restore).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import interface as _interface


@dataclasses.dataclass
class WriteStats:
    """What this process wrote into a checkpoint's safetensors files.

    Attributes:
      bytes_written: tensor data bytes written by this process.
      header_bytes: header bytes written (the primary only).
      ranges: ``(file name, offset, nbytes)`` of the tensor data written, adjacent runs merged;
        across all processes of a save they tile every file's data section exactly once.

    Example::

        handler = osf.SafetensorsCheckpointHandler()
        mngr = ocp.CheckpointManager(root, item_handlers=handler)
        mngr.save(step, args=osf.SafetensorsSave(state)); mngr.wait_until_finished()
        handler.last_write_stats.bytes_written   # this process's tensor bytes
    """

    bytes_written: int = 0
    header_bytes: int = 0
    ranges: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    def add(self, filename: str, pieces: list[_interface.Piece]) -> None:
        """Records the data pieces written into ``filename`` (pieces without a tag are headers)."""
        for p in sorted(pieces, key=lambda p: p.offset):
            n = int(p.data.nbytes)
            if p.tag is None:
                self.header_bytes += n
                continue
            self.bytes_written += n
            last = self.ranges[-1] if self.ranges else None
            if last is not None and last[0] == filename and last[1] + last[2] == p.offset:
                self.ranges[-1] = (filename, last[1], last[2] + n)
            else:
                self.ranges.append((filename, int(p.offset), n))


def tensor_pieces(
    plan: _plan.CheckpointPlan, name: str, copies: _snapshots.HostCopies
) -> tuple[int, list[_interface.Piece]]:
    """``(file index, pieces)`` writing a tensor's host ``copies`` where ``plan`` puts them
    (cast to the planned dtype shard by shard); each tag is ``(name, offset in the tensor)``."""
    file_index, base, entry, stored = _placement(plan, name)
    pieces: list[_interface.Piece] = []
    for index, host in copies:
        if _to_lay_out(host, stored):
            host = _casting.astype(host, stored)
        raw = _dtypes.pack(host, entry.dtype)
        if index is None or _runs.is_whole(index, entry.shape):  # e.g. a replica's first copy
            pieces.append(_interface.Piece(base, raw, (name, 0)))
            continue
        offsets, length = _runs.byte_runs(entry.dtype, entry.shape, index, name)
        for j, off in enumerate(offsets.tolist()):
            chunk = raw[j * length : (j + 1) * length]
            pieces.append(_interface.Piece(base + off, chunk, (name, off)))
    return file_index, pieces


def _placement(
    plan: _plan.CheckpointPlan, name: str
) -> tuple[int, int, _header.TensorEntry, np.dtype]:
    # Tensor ``name``'s file index, file offset, header entry and planned numpy dtype.
    file_index = plan.file_of[name]
    fplan = plan.files[file_index]
    entry = fplan.entries[name]
    return file_index, fplan.data_start + entry.begin, entry, _dtypes.to_numpy(entry.dtype)


def _to_lay_out(host: np.ndarray, stored: np.dtype) -> bool:
    # Whether ``host`` must be cast or laid out C-contiguous (a transposed view, say) to be
    # written as a tensor of dtype ``stored``.
    return host.dtype != stored or not host.flags.c_contiguous


BAND_BYTES = 8 << 20  # one band of a tensor cast into a reused buffer (band_piece)
BAND_MIN_BYTES = 1 << 20  # tensors below this are cast whole (tensor_pieces)
# Bands written at once: more bands are fresh memory faulted in, and were slower; 4 leave a
# faster device room for a deeper queue.
BANDS_IN_FLIGHT = 4


def cast_in_bands(plan: _plan.CheckpointPlan, name: str, value: np.ndarray) -> bool:
    """Whether ``value`` is worth casting band by band (:func:`band_piece`): a cast or
    re-layout to make, a whole-byte planned dtype, at least ``BAND_MIN_BYTES`` written."""
    _, _, entry, stored = _placement(plan, name)
    if _dtypes.bits(entry.dtype) % 8 or entry.nbytes < BAND_MIN_BYTES:
        return False
    return _to_lay_out(value, stored)


def band_rows(shape: tuple[int, ...], itemsize: int, band_bytes: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` along axis 0 cutting a tensor of ``shape`` into bands of
    at most ``band_bytes`` (at least one row each; a 0- or 1-D tensor is one band)."""
    if len(shape) < 2 or not shape[0]:
        return [(0, int(shape[0]) if shape else 1)]
    rows = int(shape[0])
    row_bytes = itemsize * _dtypes.num_elements(shape[1:])
    step = max(1, band_bytes // max(1, row_bytes))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def band_piece(
    plan: _plan.CheckpointPlan,
    name: str,
    value: np.ndarray,
    rows: tuple[int, int],
    buffers: _buffers.LentBuffers,
) -> tuple[int, list[_interface.Piece]]:
    """``(file index, [piece])``: rows ``rows`` of the host tensor ``value`` (any layout)
    cast to ``name``'s planned dtype straight into a buffer of ``buffers``, which the caller
    gives back once the piece is written. (Bands cast into reused buffers keep an export's
    host memory to the bands in flight, its pages faulted in once.)"""
    file_index, base, _, stored = _placement(plan, name)
    start, stop = rows
    part = value[start:stop] if value.ndim else value
    offset = start * stored.itemsize * _dtypes.num_elements(value.shape[1:])
    at = base + offset
    out = buffers.take(part.size * stored.itemsize, file_offset=at)
    _casting.cast_into(out.view(stored).reshape(part.shape), part)
    piece = _interface.Piece(at, out, (name, offset))
    return file_index, [piece]


_T = TypeVar("_T")
_R = TypeVar("_R")

# Threads that cast and lay out tensors at once (ordered_map): numpy releases the GIL while it
# copies (the bfloat16 cast only part of the time), so the cores share an export's CPU work.
TRANSFORM_THREADS = max(1, min(4, os.cpu_count() or 1))


DRAIN = object()  # an item of ordered_map's: every item before it done before one after


def ordered_map(
    fn: Callable[[_T], _R], items: Iterable[Any], workers: int = TRANSFORM_THREADS
) -> Iterator[_R]:
    """``fn`` of each item, in order, by up to ``workers`` threads (at most ``workers``
    results ahead of the caller; ``items`` consumed on the caller's thread). A :data:`DRAIN`
    item is not mapped: every result before it is yielded before the next item is taken."""
    if workers <= 1:
        yield from (fn(item) for item in items if item is not DRAIN)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="osf-cast") as pool:
        pending: collections.deque[concurrent.futures.Future[_R]] = collections.deque()
        try:
            for item in items:
                if item is DRAIN:
                    while pending:
                        yield pending.popleft().result()
                    continue
                pending.append(pool.submit(fn, item))
                if len(pending) >= workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # the caller stopped early: nothing more starts
                future.cancel()


def iter_host_pieces(
    plan: _plan.CheckpointPlan,
    arrays: Mapping[str, Any],
    *,
    is_primary: bool = True,
    ready: Mapping[str, _snapshots.HostCopies] | None = None,
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    """``(file index, pieces)`` this process writes of ``arrays``, one tensor at a time, its
    host data viewed (or copied off an accelerator) as the consumer reaches it, the next
    tensor's transfer started ahead: a consumer writing each before the next holds about one
    tensor in host memory. ``is_primary``: this process writes host-local leaves. ``ready``:
    host copies made beforehand, by name."""
    items: Any = arrays.items()
    if ready:
        for name, copies in ready.items():
            yield tensor_pieces(plan, name, copies)
        items = [(name, x) for name, x in items if name not in ready]
    owned = _snapshots.owned_tensors(items, is_primary)
    started = 0
    # One tensor ahead, accelerator data is copied from device copies
    # (snapshots.detached), each freed once on the host: JAX would otherwise keep every host
    # copy cached on the caller's arrays, the whole state in host memory after the save.
    window: dict[int, Any] = {}
    for k, item in enumerate(owned):
        if started < len(owned):  # keep copies started one tensor past this one
            until = min(len(owned), k + 2)
            batch = _snapshots.detached(owned[started:until])
            window.update(zip(range(started, until), batch))
            _snapshots.start_copies(batch)
            started = until
        current = window.pop(k, item)
        copies = _snapshots.host_copies(current, None)  # (tensor_pieces casts them)
        if current is not item:
            _snapshots.delete_device_copies([current])
        yield tensor_pieces(plan, item[0], copies)
        del copies, current  # (written by now: not held while the next tensor is copied)


def tensor_checksums(
    records: list[tuple[object, int, int]], sizes: Mapping[str, int]
) -> dict[str, int]:
    """Whole-tensor CRC32C from per-piece ``((name, offset), nbytes, crc)`` records; a
    ``ValueError`` when the pieces of a tensor do not tile it exactly."""
    by_tensor: dict[str, list[tuple[int, int, int]]] = {name: [] for name in sizes}
    for tag, nbytes, crc in records:
        name, offset = tag  # type: ignore[misc]
        by_tensor[str(name)].append((int(offset), nbytes, crc))  # type: ignore[has-type]
    return {name: _checksum.combine_runs(runs, sizes[name]) for name, runs in by_tensor.items()}


# A tree of many tensors allocates many small objects and frees few: each burst triggers
# collections that rescan every live object, and nothing a save or restore builds is cyclic
# garbage. The pause is process-wide, so it is held only while the caller's thread waits for
# the work (never by an async save's background write); pauses nest and overlap (a count under
# a lock): the collector comes back on when the last ends, if it was on when the first began.
_gc_lock = threading.Lock()
_gc_depth = 0  # pauses in force, over all threads
_gc_reenable = False  # whether the first of them found the collector enabled
gc_pause_enabled = True  # False: pauses do nothing (benchmarks/studies/gc_pause_bench.py)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic garbage collector inside the block, or around each call of a
    function decorated ``@gc_paused()`` (see the comment above)."""
    global _gc_depth, _gc_reenable
    if not gc_pause_enabled:
        yield
        return
    with _gc_lock:
        if _gc_depth == 0:
            _gc_reenable = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_reenable:
                gc.enable()
