"""Host copies of the shards this process owns (``replica_id == 0``: every byte written once
across processes, none materialised by a process that does not own it; host-local leaves by the
primary), and the :class:`SnapshotQueue` that hands them to the writer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.pipeline import relayout as _relayout
from orbax_safetensors._src.storage import buffers as _buffers


def owned_shards(x: jax.Array) -> list[tuple[_runs.Index, jax.Array]]:
    """The shards of ``x`` this process writes: the addressable ones with ``replica_id == 0``."""
    return [
        (_runs.normalize_index(s.index, x.shape), s.data)
        for s in x.addressable_shards
        if s.replica_id == 0
    ]


def is_host_local(x: Any, multi_process: bool | None = None) -> bool:
    """Whether ``x`` is host-local data, written by the primary alone: a numpy array, or in a
    multi-process job (``multi_process``, default from JAX) a fully addressable ``jax.Array``
    (each process holds its own copy; Orbax refuses to save these)."""
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


# Host copies smaller than this are plain numpy copies (one call); larger ones go to
# 64-byte-aligned buffers, which the kernel copies into the page cache faster.
_SMALL_COPY = 64 << 10


# A tensor this process writes: (its key: a name or an index, array, its owned shards or None
# when this process writes it whole, whether it is on CPU).
_Owned = tuple[Any, Any, list[tuple[_runs.Index, Any]] | None, bool]


# A tensor's host data: (box of a shard inside the tensor, or None for all of it; values).
HostCopies = list[tuple[_runs.Index | None, np.ndarray]]


def host_views(arrays: Iterable[Any]) -> bool:
    """Whether the host data of every array of ``arrays`` is a view of memory it already
    holds (numpy, or a ``jax.Array`` on CPU), so that writing it needs no copy."""
    placement = _sharding.ShardingMemo(_placement)
    return all(not isinstance(x, jax.Array) or placement(x.sharding)[1] for x in arrays)


def owned_tensors(arrays: Iterable[tuple[Any, Any]], is_primary: bool) -> list[_Owned]:
    # ``arrays``: (key, array) pairs; the key labels the tensor (its name, or an index).
    owned: list[_Owned] = []
    placement = _sharding.ShardingMemo(_placement)  # trees of many arrays share a few shardings
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
                    _runs.byte_runs(dtype, x.shape, index, name)
            owned.append((name, x, shards, on_cpu))
    return owned


def _host_array(
    data: Any, on_cpu: bool, buffers: _buffers.BufferArena | None, dtype: np.dtype | None = None
) -> np.ndarray:
    """``data`` on the host, C-contiguous: a copy we own when ``buffers`` is given (else maybe
    a view of the caller's memory); cast to ``dtype`` when given (always a copy then)."""
    host = data if isinstance(data, np.ndarray) else np.asarray(data)
    if dtype is not None and host.dtype != dtype:
        return _cast(host, dtype, buffers)
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


def _cast(host: np.ndarray, dtype: np.dtype, buffers: _buffers.BufferArena | None) -> np.ndarray:
    # One pass from the caller's values into the stored dtype; large casts go to aligned
    # buffers (see _SMALL_COPY).
    nbytes = host.size * dtype.itemsize
    if buffers is None or nbytes < _SMALL_COPY:
        return _casting.astype(host, dtype)
    out = buffers.empty(nbytes).view(dtype).reshape(host.shape)
    _casting.cast_into(out, host)
    return out


def host_copies(
    owned: _Owned, buffers: _buffers.BufferArena | None, dtype: np.dtype | None = None
) -> HostCopies:
    """The host copies of a tensor this process writes (see :func:`owned_tensors`), cast to
    ``dtype`` when given: copies we own when ``buffers`` is given, else maybe views."""
    _, x, shards, on_cpu = owned
    if shards is None:
        return [(None, _host_array(x, on_cpu, buffers, dtype))]
    return [(index, _host_array(data, on_cpu, buffers, dtype)) for index, data in shards]


def iter_snapshots(
    arrays: Iterable[tuple[Any, Any]],
    *,
    is_primary: bool = True,
    casts: Mapping[Any, np.dtype] | None = None,
    buffers: _buffers.BufferArena | None = None,
    row_blocks: bool = False,
    moved_only: bool = False,
) -> Iterator[tuple[Any, HostCopies]]:
    """``(key, copies)`` for each ``(key, array)`` of ``arrays`` this process writes any of,
    one tensor at a time, into ``buffers`` (default a fresh arena); no file plan needed. Once
    the iteration ends the caller may donate its arrays. ``casts``: key -> stored dtype (the
    copies hold the cast bytes).

    ``row_blocks`` (object storage): the tensors a save re-lays out
    (``relayout.row_block_sharding``) are copied as this process's row blocks, the groups
    ``relayout.array_groups`` joins first (every member yielded, maybe empty); ``moved_only``:
    those only. Each is moved on the devices (a collective: every process iterates this on its
    main thread, in the same order) and the moved array deleted before the next, so the extra
    device memory is one tensor's share at a time.
    """
    buffers = buffers if buffers is not None else _buffers.BufferArena()
    if row_blocks:
        items = list(arrays)
        joined = yield from _iter_joined(items, casts, buffers)
        arrays = [item for item in items if item[0] not in joined]
    owned = owned_tensors(arrays, is_primary)
    moved = _row_block_targets(owned, casts) if row_blocks else {}
    if moved_only:
        owned = [item for item in owned if item[0] in moved]
    yield from iter_owned(owned, casts=casts, buffers=buffers, moved=moved)


def _device_data(item: _Owned) -> list[Any]:
    # The arrays holding an owned tensor's data: the array itself, or its owned shards.
    _, x, shards, _ = item
    return [x] if shards is None else [d for _, d in shards]


def iter_owned(
    owned: list[_Owned],
    *,
    casts: Mapping[Any, np.dtype] | None = None,
    buffers: _buffers.BufferArena,
    moved: Mapping[Any, jax.sharding.Sharding] | None = None,
    delete: bool = False,
) -> Iterator[tuple[Any, HostCopies]]:
    """Host copies of ``owned`` tensors, as :func:`iter_snapshots` yields them; ``moved``: the
    tensors to re-lay out first; ``delete``: each array (this save's own device copy) is
    deleted once copied, transfers started :data:`COPIES_AHEAD_BYTES` ahead (at least the
    tensor being copied)."""
    if delete:
        sizes = [sum(d.nbytes for d in _device_data(item)) for item in owned]
        started = 0
    else:
        start_copies([o for o in owned if not moved or o[0] not in moved])  # all at once
    for k, item in enumerate(owned):
        name, x, shards, on_cpu = item
        dtype = casts.get(name) if casts else None
        if delete:
            until, budget = started, sum(sizes[k:started])
            while until < len(owned) and (until <= k or budget < COPIES_AHEAD_BYTES):
                budget += sizes[until]
                until += 1
            start_copies(owned[started:until])
            started = max(started, until)
            copies = host_copies(item, buffers, dtype)
            for data in _device_data(item):
                data.delete()  # its bytes are on the host: free the device memory now
            yield name, copies
            continue
        if moved and name in moved:
            # (moved on the devices, a collective; the moved array freed once copied)
            yield name, made_copies(_relayout.move(x, moved[name]), buffers, dtype)
            continue
        if dtype is not None:
            yield name, host_copies(item, buffers, dtype)
            continue
        if shards is None and on_cpu:  # host_copies of a small whole array on CPU, inlined
            # (two calls less per tensor, for trees of many small tensors)
            host = np.asarray(x)  # a view of the device buffer: copy it
            if host.nbytes < _SMALL_COPY:
                yield name, [(None, host.copy())]
                continue
        yield name, host_copies(item, buffers)


# How far ahead of the tensor being copied to host a device snapshot's copier starts transfers.
COPIES_AHEAD_BYTES = 64 << 20


def _stored_dtype(name: Any, x: Any, casts: Mapping[Any, np.dtype] | None) -> str:
    # The safetensors dtype tensor ``name`` is stored in (``casts``: key -> stored dtype).
    stored = casts.get(name) if casts else None
    return _dtypes.from_numpy(stored if stored is not None else x.dtype, key=str(name))


def _iter_joined(
    items: list[tuple[Any, Any]],
    casts: Mapping[Any, np.dtype] | None,
    buffers: _buffers.BufferArena,
) -> Generator[tuple[Any, HostCopies], None, set[Any]]:
    # Joins each group on the devices (collectives, every process in the same order) and
    # yields its members' copies; returns the keys of the tensors joined.
    if jax.process_count() <= 1:
        return set()
    arrays = [x if isinstance(x, jax.Array) else None for _, x in items]
    dtypes = [
        "U8" if x is None else _stored_dtype(name, x, casts) for (name, _), x in zip(items, arrays)
    ]
    shapes = [() if x is None else tuple(x.shape) for x in arrays]
    keys = [None if x is None else _relayout.group_key(x, d) for x, d in zip(arrays, dtypes)]
    done: set[Any] = set()
    for group in _relayout.array_groups(shapes, dtypes, keys):
        xs = [items[i][1] for i in group.members]
        on_cpu = any(d.platform == "cpu" for d in xs[0].sharding.device_set)
        copies = _relayout.group_copies(
            group, xs, lambda data, cpu=on_cpu: _host_array(data, cpu, buffers)
        )
        for i, member in zip(group.members, copies):
            done.add(items[i][0])
            yield items[i][0], list(member)
    return done


def _row_block_targets(
    owned: list[_Owned], casts: Mapping[Any, np.dtype] | None
) -> dict[Any, jax.sharding.Sharding]:
    # key -> the row-block sharding of each tensor a save to object storage re-lays out
    out: dict[Any, jax.sharding.Sharding] = {}
    seen: dict[tuple[Any, ...], jax.sharding.Sharding | None] = {}  # models repeat shapes
    for name, x, shards, _ in owned:
        if shards is None or not isinstance(x, jax.Array):
            continue  # written whole (one device, or host-local)
        dtype = _stored_dtype(name, x, casts)
        key = (x.sharding, x.shape, dtype)
        if key not in seen:
            seen[key] = _relayout.row_block_sharding(x.sharding, x.shape, dtype)
        target = seen[key]
        if target is not None:
            out[name] = target
    return out


def made_copies(
    value: jax.Array, buffers: _buffers.BufferArena | None, dtype: np.dtype | None = None
) -> HostCopies:
    """Host copies of this process's owned shards of ``value``, an array a save or an export
    made on the devices (cast to ``dtype`` when given); with ``buffers`` (copies we own: on CPU
    a view would share the buffer) ``value`` is deleted at once."""
    devices: set[Any] = value.sharding.device_set
    on_cpu = any(d.platform == "cpu" for d in devices)
    try:
        return host_copies((None, value, owned_shards(value), on_cpu), buffers, dtype)
    finally:
        if buffers is not None:
            value.delete()


# The device memory an on-device snapshot leaves free on each device, besides its copies.
_DEVICE_HEADROOM = 256 << 20

#: Which arrays :func:`device_copies` copies on their devices: ``"auto"``, those in an
#: accelerator's memory; ``"always"``, every ``jax.Array`` (CPU ones too, with no room check
#: where the device reports no memory statistics: tests of this path on CPU).
DEVICE_COPIES = "auto"


def device_copies(owned: list[_Owned]) -> tuple[list[_Owned], list[_Owned]] | None:
    """``owned`` split into (tensors to copy to host now, device copies of the others): the
    shards on an accelerator copied on their own devices (one program per device, none
    spanning processes), so an async save returns while the host copies run on a thread.
    None when nothing is on an accelerator or a device lacks room (``memory_stats`` less
    :data:`_DEVICE_HEADROOM`)."""
    later = [o for o in owned if _on_accelerator(o)]
    if not later:
        return None
    by_device = _by_device(later)
    for device, arrays in by_device.items():
        stats = _memory_stats(device)
        if stats is None:
            if DEVICE_COPIES == "always":
                continue
            return None
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        if sum(a.nbytes for a in arrays) + _DEVICE_HEADROOM > free:
            return None
    now = [o for o in owned if not _on_accelerator(o)]
    return now, _copied(later, by_device)


def detached(owned: list[_Owned]) -> list[_Owned]:
    """``owned`` with its accelerator tensors copied on their devices, so that JAX caches their
    host copies on these (freed by :func:`delete_device_copies`), not on the caller's arrays
    for as long as they live. Where no device memory is left, the tensor is kept as it is."""
    later = [o for o in owned if _on_accelerator(o) and not o[3]]  # (never CPU: host views)
    if not later:
        return owned
    try:
        copies = {id(o): c for o, c in zip(later, _copied(later, _by_device(later)))}
    except Exception:  # (device out of memory: the caller's arrays give their host copies)
        return owned
    return [copies.get(id(o), o) for o in owned]


def _by_device(items: list[_Owned]) -> dict[Any, list[Any]]:
    by_device: dict[Any, list[Any]] = {}
    for item in items:
        for data in _device_data(item):
            by_device.setdefault(next(iter(data.devices())), []).append(data)
    return by_device


def _copied(items: list[_Owned], by_device: dict[Any, list[Any]]) -> list[_Owned]:
    # The items with their data replaced by device copies, one program per device.
    copied = {}
    for arrays in by_device.values():
        for data, copy in zip(arrays, _copy_on_device(arrays)):
            copied[id(data)] = copy
    return [
        (name, copied[id(x)], None, on_cpu)
        if shards is None
        else (name, x, [(index, copied[id(d)]) for index, d in shards], on_cpu)
        for name, x, shards, on_cpu in items
    ]


def delete_device_copies(copies: list[_Owned]) -> None:
    """Frees the device memory of :func:`device_copies`' copies (those not deleted yet)."""
    for item in copies:
        for data in _device_data(item):
            if not data.is_deleted():
                data.delete()


def _on_accelerator(item: _Owned) -> bool:
    # A jax.Array in an accelerator's own memory (not CPU, not a host memory kind).
    _, x, _, on_cpu = item
    if not isinstance(x, jax.Array) or (on_cpu and DEVICE_COPIES != "always"):
        return False
    kind = getattr(x.sharding, "memory_kind", None)
    return kind in (None, "device") or kind == _default_memory_kind(x)


def _default_memory_kind(x: jax.Array) -> str | None:
    # The memory kind of the arrays' device by default ("device" on accelerators; on CPU,
    # "unpinned_host" before jax 0.8, "device" after).
    try:
        return next(iter(x.devices())).default_memory().kind
    except Exception:  # (a backend without memories)
        return None


def _memory_stats(device: Any) -> dict[str, int] | None:
    try:
        stats = device.memory_stats()
    except Exception:  # (a backend without it raises or returns None)
        return None
    return stats if stats and "bytes_limit" in stats else None


@jax.jit
def _copy_on_device(arrays: list[jax.Array]) -> list[jax.Array]:
    # New buffers with the arrays' values (never aliased: the arguments are not donated).
    return [jnp.copy(a) for a in arrays]


def start_copies(owned: list[_Owned]) -> None:
    # Device-to-host copies of these (name, array, shards, on CPU) entries, started now so they
    # overlap what comes before them (nothing to copy on CPU).
    for item in owned:
        if item[3]:  # on CPU
            continue
        for data in _device_data(item):
            if isinstance(data, jax.Array):
                data.copy_to_host_async()


class SnapshotQueue:
    """Hands host snapshots ``(index, copies)`` from the thread that copies them to the one
    that plans and writes them, so a large state starts writing before its last copy."""

    _END = object()
    # Items are handed over in groups of up to this many bytes or items: waking the writer
    # thread for each of 10,000 small tensors cost more than copying them (GIL ping-pong).
    _GROUP_BYTES = 4 << 20
    _GROUP_ITEMS = 256
    # The first group, on which the writer plans (Python work per tensor), waits for 16 MiB
    # of at most 256 tensors, else for 64 MiB, else for the end: large tensors start writing
    # soon, and a small state of many tensors is planned after the copy loop rather than
    # against it for the GIL.
    _FIRST_GROUP_BYTES = 16 << 20
    _FIRST_GROUP_MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._group: list[tuple[int, HostCopies]] = []
        self._group_bytes = 0
        self._first = True
        self._started = threading.Event()
        self._done = False

    def put(self, item: tuple[int, HostCopies]) -> None:
        self._group.append(item)
        copies = item[1]
        self._group_bytes += (
            copies[0][1].nbytes if len(copies) == 1 else sum(h.nbytes for _, h in copies)
        )
        size, count = self._group_bytes, len(self._group)
        if self._first:
            if size >= self._FIRST_GROUP_MAX_BYTES or (
                size >= self._FIRST_GROUP_BYTES and count <= self._GROUP_ITEMS
            ):
                self._first = False
                self._flush()
        elif size >= self._GROUP_BYTES or count >= self._GROUP_ITEMS:
            self._flush()

    def _flush(self) -> None:
        if self._group:
            self._queue.put(self._group)
            self._group, self._group_bytes = [], 0
            self._started.set()

    def close(self) -> None:
        """No more snapshots: the writer finishes."""
        self._flush()
        self._queue.put(self._END)
        self._done = True
        self._started.set()

    def fail(self, error: BaseException) -> None:
        """The producer failed: the writer raises instead of finishing the checkpoint."""
        self._queue.put(error)
        self._done = True
        self._started.set()

    def complete(self) -> bool:
        """Whether the producer has closed the queue (every snapshot is in) or failed."""
        return self._done

    def wait_started(self, timeout: float | None = None) -> bool:
        """Blocks until the first group, the end or a failure is queued; False on timeout."""
        return self._started.wait(timeout)

    def __iter__(self) -> Iterator[tuple[int, HostCopies]]:
        while (group := self._queue.get()) is not self._END:
            if isinstance(group, BaseException):
                raise RuntimeError("copying the checkpoint's arrays to host failed") from group
            yield from group
