"""From arrays to write pieces: which bytes this process owns and where they go.

Each process takes the shards of each ``jax.Array`` it holds with ``replica_id == 0`` (so every
byte is written exactly once across processes, and no process ever materialises data it does not
own), turns each shard's box into byte runs inside the global row-major tensor, and hands the
runs to the byte movers. Host-local leaves (numpy arrays) are written by the primary process.

Example::

    specs = _plan.tensor_specs(flat.arrays)
    plan = _plan.plan_files(specs, max_file_size=None)
    pieces = host_pieces(plan, flat.arrays, copy=False)   # {file index: [Piece, ...]}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import memo as _memo
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import runs as _runs
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


def owned_shards(x: jax.Array) -> list[tuple[_runs.Index, jax.Array]]:
    """The shards of ``x`` this process writes: the addressable ones with ``replica_id == 0``.

    (:func:`iter_host_pieces` writes an array held whole by one local device without asking.)
    """
    return [
        (_runs.normalize_index(s.index, x.shape), s.data)
        for s in x.addressable_shards
        if s.replica_id == 0
    ]


def is_host_local(x: Any, multi_process: bool | None = None) -> bool:
    """Whether ``x`` is host-local data, written by the primary process alone: a numpy array, or
    (in a multi-process job) a ``jax.Array`` whose every shard is on this process, so that each
    process holds its own copy (Orbax refuses to save these; we treat them like numpy leaves).

    ``multi_process`` is ``jax.process_count() > 1``, for callers asking about many arrays.
    """
    if not isinstance(x, jax.Array):
        return True
    if multi_process is None:
        multi_process = jax.process_count() > 1
    return multi_process and x.is_fully_addressable


def _placement(sharding: jax.sharding.Sharding) -> tuple[bool, bool, bool]:
    # (one addressable device holds all of the array, it is on CPU, it is fully addressable)
    devices: set[Any] = sharding.device_set
    addressable = sharding.is_fully_addressable
    whole = len(devices) == 1 and addressable
    return whole, any(d.platform == "cpu" for d in devices), addressable


# Host copies smaller than this are plain numpy copies (one call, ~1 us); larger ones go to
# 64-byte-aligned buffers, which the kernel copies into the page cache faster.
_SMALL_COPY = 64 << 10

# A tensor this process writes: (its key: a name or an index, array, its owned shards or None
# when this process writes it whole, whether it is on CPU).
_Owned = tuple[Any, Any, list[tuple[_runs.Index, Any]] | None, bool]

# A tensor's host data: (box of a shard inside the tensor, or None for all of it; values).
HostCopies = list[tuple[_runs.Index | None, np.ndarray]]


def _owned_tensors(arrays: Iterable[tuple[Any, Any]], is_primary: bool) -> list[_Owned]:
    # ``arrays``: (key, array) pairs; the key labels the tensor (its name, or an index).
    owned: list[_Owned] = []
    placement = _memo.ShardingMemo(_placement)  # trees of many arrays share a few shardings
    multi_process = jax.process_count() > 1
    for name, x in arrays:
        if not isinstance(x, jax.Array):
            if is_primary:
                owned.append((name, x, None, False))
            continue
        whole, on_cpu, addressable = placement(x.sharding)
        if multi_process and addressable:  # host-local (see is_host_local)
            if is_primary:
                owned.append((name, x, None, on_cpu))
        elif whole:
            owned.append((name, x, None, on_cpu))
        else:
            shards = owned_shards(x)
            dtype = _dtypes.from_numpy(x.dtype, key=name)
            if _dtypes.bits(dtype) % 8:  # fail now, not when the writer reaches this tensor
                for index, _ in shards:
                    _runs.byte_runs(dtype, x.shape, index)
            owned.append((name, x, shards, on_cpu))
    return owned


def _host_array(data: Any, on_cpu: bool, buffers: _buffers.BufferArena | None) -> np.ndarray:
    """``data`` on the host, C-contiguous: a copy we own when ``buffers`` is given (else maybe
    a view of the caller's memory)."""
    host = data if isinstance(data, np.ndarray) else np.asarray(data)
    if buffers is None or not (on_cpu or not isinstance(data, jax.Array)):
        # (On accelerators np.asarray already produced a fresh host copy.)
        return host
    # On CPU np.asarray shares the device buffer, which the caller may donate or overwrite once
    # save() returns; numpy leaves are the caller's to change. Copy into memory we own.
    if host.nbytes < _SMALL_COPY:
        return host.copy(order="C")
    out = buffers.empty(host.nbytes).view(host.dtype).reshape(host.shape)
    np.copyto(out, host)
    return out


def _host_copies(owned: _Owned, buffers: _buffers.BufferArena | None) -> HostCopies:
    _, x, shards, on_cpu = owned
    if shards is None:
        return [(None, _host_array(x, on_cpu, buffers))]
    return [(index, _host_array(data, on_cpu, buffers)) for index, data in shards]


def tensor_pieces(
    plan: _plan.CheckpointPlan, name: str, copies: HostCopies
) -> tuple[int, list[_interface.Piece]]:
    """``(file index, pieces)`` writing a tensor's host ``copies`` where ``plan`` puts them.

    Each piece's tag is ``(tensor name, offset inside the tensor)``.
    """
    file_index = plan.file_of[name]
    fplan = plan.files[file_index]
    entry = fplan.entries[name]
    base = fplan.data_start + entry.begin
    pieces: list[_interface.Piece] = []
    for index, host in copies:
        raw = _dtypes.pack(host, entry.dtype)
        if index is None or _runs.is_whole(index, entry.shape):  # e.g. a replica's first copy
            pieces.append(_interface.Piece(base, raw, (name, 0)))
            continue
        offsets, length = _runs.byte_runs(entry.dtype, entry.shape, index)
        for j, off in enumerate(offsets.tolist()):
            chunk = raw[j * length : (j + 1) * length]
            pieces.append(_interface.Piece(base + off, chunk, (name, off)))
    return file_index, pieces


def iter_host_pieces(
    plan: _plan.CheckpointPlan,
    arrays: Mapping[str, Any],
    *,
    copy: bool,
    is_primary: bool = True,
    copies_ahead: int | None = 1,
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    """The byte pieces this process writes, one tensor at a time: ``(file index, pieces)``.

    Args:
      plan: the checkpoint's file plan.
      arrays: stored tensors by name (``jax.Array`` or numpy).
      copy: copy host data into buffers we own (needed when writing happens after return).
      is_primary: whether this process writes host-local leaves (see :func:`is_host_local`).
      copies_ahead: start device-to-host copies this many tensors ahead of the one yielded
        (``None``: all at once, fastest when everything is copied before writing). With 1, a
        consumer that writes each tensor before asking for the next holds about one tensor in
        host memory at a time (on accelerators; on CPU, uncopied pieces are views).

    Each piece's tag is ``(tensor name, offset inside the tensor)``.
    """
    owned = _owned_tensors(arrays.items(), is_primary)
    buffers = _buffers.BufferArena() if copy else None
    started = 0
    ahead = len(owned) if copies_ahead is None else copies_ahead
    for k, item in enumerate(owned):
        if started < len(owned):  # keep copies started `ahead` tensors past this one
            until = min(len(owned), k + 1 + ahead)
            _start_copies(owned[started:until])
            started = until
        yield tensor_pieces(plan, item[0], _host_copies(item, buffers))


def iter_snapshots(
    arrays: Iterable[tuple[Any, Any]], *, is_primary: bool = True
) -> Iterator[tuple[Any, HostCopies]]:
    """Host copies of the bytes this process writes, one tensor at a time: ``(key, copies)``
    for each ``(key, array)`` of ``arrays`` this process writes any of.

    Needs no file plan, so an async save can copy first and plan on its writer thread. Once
    the iteration ends the caller may donate, overwrite or delete its arrays; turn the copies
    into write pieces with :func:`tensor_pieces`.
    """
    owned = _owned_tensors(arrays, is_primary)
    _start_copies(owned)  # all at once: everything is copied before this returns
    buffers = _buffers.BufferArena()
    for item in owned:
        name, x, shards, on_cpu = item
        if shards is None and on_cpu:  # _host_copies of a small whole array on CPU, inlined
            # (two calls less per tensor, for trees of many small tensors)
            host = np.asarray(x)  # a view of the device buffer: copy it
            if host.nbytes < _SMALL_COPY:
                yield name, [(None, host.copy())]
                continue
        yield name, _host_copies(item, buffers)


def _start_copies(owned: list[_Owned]) -> None:
    # Device-to-host copies of these (name, array, shards, on CPU) entries, started now so they
    # overlap what comes before them (nothing to copy on CPU).
    for _, x, shards, on_cpu in owned:
        if on_cpu:
            continue
        for data in [x] if shards is None else [d for _, d in shards]:
            if isinstance(data, jax.Array):
                data.copy_to_host_async()


def host_pieces(
    plan: _plan.CheckpointPlan,
    arrays: Mapping[str, Any],
    *,
    copy: bool,
    is_primary: bool = True,
) -> dict[int, list[_interface.Piece]]:
    """All of :func:`iter_host_pieces` at once, grouped by file index."""
    out: dict[int, list[_interface.Piece]] = {}
    stream = iter_host_pieces(plan, arrays, copy=copy, is_primary=is_primary, copies_ahead=None)
    for file_index, pieces in stream:
        out.setdefault(file_index, []).extend(pieces)
    return out


def tensor_checksums(
    records: list[tuple[object, int, int]], sizes: Mapping[str, int]
) -> dict[str, int]:
    """Whole-tensor CRC32C from per-piece ``((name, offset), nbytes, crc)`` records.

    Raises:
      ValueError: when the pieces of a tensor do not tile it exactly.
    """
    by_tensor: dict[str, list[tuple[int, int, int]]] = {name: [] for name in sizes}
    for tag, nbytes, crc in records:
        name, offset = tag  # type: ignore[misc]
        by_tensor[str(name)].append((int(offset), nbytes, crc))  # type: ignore[has-type]
    return {name: _checksum.combine_runs(runs, sizes[name]) for name, runs in by_tensor.items()}
