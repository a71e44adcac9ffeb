"""Every device re-layout: a jitted function with the target sharding as ``out_shardings``, a
collective every process reaches in the same order (each decides from the same global facts,
``core.relayout``): :func:`move` (to row blocks for object-storage I/O), :func:`group_copies` (a group
concatenated in row blocks) and :func:`relaid_rows` (an export's output computed on the devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import relayout as _relayout
from orbax_safetensors._src.core import runs as _runs

# --------------------------------------------------------------------------- row blocks


@functools.lru_cache(maxsize=64)
def _mesh_facts(mesh: jax.sharding.Mesh) -> tuple[np.ndarray, jax.sharding.NamedSharding]:
    # (the process of each device, in mesh order; the row-block sharding over its devices in
    # the mesh's own order, which a jitted reshard keeps)
    procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
    rows = jax.sharding.Mesh(np.array(list(mesh.devices.flat)), ("rows",))
    return procs, jax.sharding.NamedSharding(rows, jax.sharding.PartitionSpec("rows"))


def _concrete(sharding: Any) -> TypeGuard[jax.sharding.NamedSharding]:
    # A NamedSharding over a concrete mesh (an abstract one has no devices) in device memory.
    return (
        isinstance(sharding, jax.sharding.NamedSharding)
        and isinstance(sharding.mesh, jax.sharding.Mesh)
        and getattr(sharding, "memory_kind", None) in (None, "device")
    )


def row_block_sharding(
    sharding: Any, shape: Sequence[int], dtype: str
) -> jax.sharding.NamedSharding | None:
    """The row-block sharding (device ``k`` of the mesh, in mesh order, holds the ``k``-th
    block of rows) a tensor of ``shape`` and stored ``dtype`` over ``sharding`` is moved to
    for object-storage I/O, or None to write or read its boxes directly
    (``core.relayout.row_block_layout`` says which)."""
    if not _concrete(sharding) or len(shape) < 2 or sharding.is_fully_addressable:
        return None
    procs, rows = _mesh_facts(sharding.mesh)
    axes = sharding.mesh.axis_names
    count = jax.process_count()
    layout = _relayout.row_block_layout(shape, dtype, tuple(sharding.spec), axes, procs, count)
    return None if layout is None else rows


def _identity(x: Any) -> Any:
    return x


def move(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` resharded onto ``sharding`` (a collective), complete when it returns: many
    cross-process collectives in flight at once can hang on CPU (gloo), and one at a time
    bounds the device memory they hold."""
    moved = jax.jit(_identity, out_shardings=sharding)(x)
    moved.block_until_ready()
    return moved


# --------------------------------------------------------------------------- joined groups


def group_key(x: Any, stored: str) -> Hashable | None:
    """What ``x`` is grouped by (its sharding, shape and stored dtype), or None when it is not
    joined: not a ``jax.Array`` with a concrete ``NamedSharding`` in device memory spanning
    every process of the job, stored in another dtype than its own, or a scalar."""
    if not isinstance(x, jax.Array) or not x.shape:
        return None
    sharding = x.sharding
    if (
        not _concrete(sharding)
        or sharding.is_fully_addressable
        or _dtypes.from_numpy(x.dtype) != stored
        or len(_processes(sharding.mesh)) != jax.process_count()
    ):
        return None
    return (sharding, tuple(x.shape), stored)


@functools.lru_cache(maxsize=64)
def _processes(mesh: jax.sharding.Mesh) -> frozenset[int]:
    return frozenset(d.process_index for d in mesh.devices.flat)


def array_groups(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[str], keys: Sequence[Hashable | None]
) -> list[_relayout.ConcatGroup]:
    """``core.relayout.concat_groups`` of tensors keyed by :func:`group_key`, mesh by mesh;
    positions index the given lists."""
    out: list[_relayout.ConcatGroup] = []
    meshes = [None if k is None else k[0].mesh for k in keys]  # type: ignore[index]
    for mesh in dict.fromkeys(m for m in meshes if m is not None):
        mesh_keys = [k if m == mesh else None for k, m in zip(keys, meshes)]
        count = jax.process_count()
        out += _relayout.concat_groups(shapes, dtypes, mesh_keys, count, int(mesh.devices.size))
    return sorted(out, key=lambda g: g.members[0])


def _concat(*xs: Any) -> Any:
    return jnp.concatenate(xs, axis=0)


Copies = list[tuple[tuple[slice, ...], np.ndarray]]


def group_copies(
    group: _relayout.ConcatGroup, xs: Sequence[jax.Array], host_array: Any
) -> list[Copies]:
    """Each member's copies: this process's rows of the joined group, mapped back onto the
    members as boxes (a list may be empty); ``host_array(data)`` copies one device block to
    host (the members' copies are views of it). The members are joined on the devices (a
    collective), in row blocks over their mesh's devices, or on every device for a group
    written whole; the joined array is deleted on return."""
    mesh = xs[0].sharding.mesh  # type: ignore[attr-defined]  # (group_key: a NamedSharding)
    devices = np.array(list(mesh.devices.flat))
    rows = jax.sharding.Mesh(devices[group.device_order(len(devices))], ("rows",))
    spec = jax.sharding.PartitionSpec() if group.writer >= 0 else jax.sharding.PartitionSpec("rows")
    joined = jax.jit(_concat, out_shardings=jax.sharding.NamedSharding(rows, spec))(*xs)
    try:
        copies: list[Copies] = [[] for _ in xs]
        rest = tuple(slice(0, d) for d in xs[0].shape[1:])
        me = jax.process_index()
        if group.writer >= 0:
            blocks = [(0, joined.addressable_shards[0].data)] if me == group.writer else []
        else:
            blocks = [
                (s.index[0].indices(group.total_rows)[0], s.data)
                for s in joined.addressable_shards
                if s.replica_id == 0
            ]
        for start, data in blocks:
            host = host_array(data)
            stop = start + host.shape[0]
            for j, a, b in group.member_rows(start, stop):
                lo = j * group.rows + a - start
                copies[j].append(((slice(a, b), *rest), host[lo : lo + b - a]))
        return copies
    finally:
        # every local device's part of the exchange done before the next collective starts
        joined.block_until_ready()
        joined.delete()


# --------------------------------------------------------------------------- an export's outputs


def spread_sharding(shape: Sequence[int], first: int = 0) -> jax.sharding.NamedSharding:
    """A sharding of a tensor of ``shape`` over every device of the job: axis ``first`` split
    over all devices (``jax.devices()`` order) if their count divides it, else the first axis
    it divides; replicated when none is."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    for axis in [first, *(a for a in range(len(shape)) if a != first)]:
        if axis < len(shape) and shape[axis] and shape[axis] % len(devices) == 0:
            spec = jax.sharding.PartitionSpec(*([None] * axis), "devices")
            return jax.sharding.NamedSharding(mesh, spec)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


_DEVICE_CASTS = frozenset(np.dtype(d) for d in ("float32", "float16", ml_dtypes.bfloat16))


@functools.lru_cache(maxsize=1024)
def compiled(fn: Callable[[list[Any]], Any], shape: tuple[int, ...], cast: Any = None) -> Any:
    """The jitted re-layout of ``fn`` (hashable: equal ones share it) into ``shape`` over the
    job, kept across calls: a save that publishes every step compiles each once."""

    def value(arrays: list[Any]) -> Any:
        return fn([a.astype(cast) for a in arrays] if cast is not None else arrays)

    return jax.jit(value, out_shardings=spread_sharding(shape))


def _relaid(
    fn: Callable[[list[Any]], Any],
    arrays: Sequence[jax.Array],
    shape: tuple[int, ...],
    dtype: np.dtype | None,
) -> jax.Array:
    # A float cast between float32, bfloat16 and float16 first, on the devices (XLA's
    # conversion, which core/astype reproduces on the host): narrower tensors move.
    sources = {np.dtype(a.dtype) for a in arrays}
    cast = dtype if dtype is not None and sources | {dtype} <= _DEVICE_CASTS else None
    return compiled(fn, tuple(shape), cast)(list(arrays))  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class Slot:
    """An output that one slot of its single source makes alone (a layer of a stacked
    tensor): ``fn`` of the slot, whose ``box`` in the source cuts the ``stacked`` axes;
    ``row_axis``: the source's axis that becomes the output's rows where bands may cut it."""

    fn: Callable[[list[Any]], Any]
    box: tuple[slice, ...]
    stacked: tuple[int, ...]
    row_axis: int | None


def relaid_rows(
    fn: Callable[[list[Any]], Any],
    arrays: Sequence[jax.Array],
    shape: tuple[int, ...],
    dtype: np.dtype | None = None,
    band_bytes: int | None = None,
    slot: Slot | None = None,
) -> Iterator[tuple[int, jax.Array]]:
    """``(first row, value)``: ``fn(arrays)`` (``jax.numpy``) of ``shape`` in the stored
    ``dtype``, spread over every device of the job (a collective); with ``slot`` from that
    slot alone (a slice of each device's shard: every slot shares one compiled re-layout),
    and with ``band_bytes`` a band of rows of about that many bytes per process at a time
    (a re-layout holds its input, the exchanged blocks and its output at once)."""
    rows = None if slot is None else _slot_rows(slot, arrays[0], shape, dtype, band_bytes)
    if slot is None or rows is None:
        yield 0, _relaid(fn, arrays, shape, dtype)
        return
    (x,) = arrays
    box = list(slot.box)
    if not shape or rows >= shape[0]:
        yield 0, _relaid(slot.fn, [_band_array(x, tuple(box))], shape, dtype)
        return
    assert slot.row_axis is not None
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        box[slot.row_axis] = slice(start, stop)
        band = _band_array(x, tuple(box))
        yield start, _relaid(slot.fn, [band], (stop - start, *shape[1:]), dtype)


def _slot_rows(
    slot: Slot, x: jax.Array, shape: tuple[int, ...], dtype: Any, band_bytes: int | None
) -> int | None:
    # Rows per band (all of them: the slot whole), or None to re-lay out the source whole.
    # From global facts only: every process decides alike.
    fshape = tuple(int(d) for d in x.shape)
    held = x.sharding.shard_shape(fshape)
    if any(held[a] != fshape[a] for a in slot.stacked):  # (split there: no global slot)
        return None
    whole = rows = shape[0] if shape else 0
    axis = slot.row_axis
    if band_bytes is not None and whole and axis is not None and held[axis] == fshape[axis]:
        itemsize = max(np.dtype(x.dtype).itemsize, (dtype or np.dtype(x.dtype)).itemsize)
        most = max(1, band_bytes * jax.process_count() // (itemsize * math.prod(shape[1:])))
        rows = _relayout.even_rows(whole, most, len(jax.devices()))
    if rows >= whole and not slot.stacked:  # (nothing to cut: the source as it is)
        return None
    return rows


def _band_array(x: jax.Array, box: tuple[slice, ...]) -> jax.Array:
    # x[box] as a global array sharded as x is, from slices of this process's shards (box
    # cuts only axes x is not split along)
    shape = tuple(s.stop - s.start for s in box)
    pieces = []
    for shard in x.addressable_shards:
        index = _runs.normalize_index(shard.index, x.shape)
        starts = [max(b.start, i.start) - i.start for b, i in zip(box, index)]
        sizes = [min(b.stop, i.stop) - max(b.start, i.start) for b, i in zip(box, index)]
        # (start indices as operands: one compiled slice serves every slot and band)
        pieces.append(jax.lax.dynamic_slice(shard.data, starts, sizes))
    return jax.make_array_from_single_device_arrays(shape, x.sharding, pieces)
