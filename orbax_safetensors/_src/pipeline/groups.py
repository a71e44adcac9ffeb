"""Concatenated groups on the devices (``core.groups`` decides which, from global facts): a save
to object storage by several processes joins tensors of one shape, stored dtype and sharding
along their first dimension and lays the result out in row blocks over the mesh's devices, so
that each process holds one contiguous byte range of the group as the file stores it.

The join is one jitted concatenation with the row-block sharding as ``out_shardings``: XLA
exchanges the blocks between devices (all-to-all collectives, no gather), and every process
reaches it in the same order (each decides from the same facts, on its main thread). A small
group (``ConcatGroup.writer >= 0``) is joined onto every device and written whole by one
process. The extra device memory is about three times a group's bytes per device, one group
at a time.

Example::

    keys = [group_key(x, stored) for x, stored in zip(arrays, stored_dtypes)]
    for group in array_groups(shapes, stored_dtypes, keys):
        members = [arrays[i] for i in group.members]
        for i, copies in zip(group.members, group_copies(group, members, np.asarray)):
            ...
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import groups as _groups


def group_key(x: Any, stored: str) -> Hashable | None:
    """What ``x`` is grouped by (its sharding, shape and stored dtype), or None when it is not
    joined: not a ``jax.Array`` sharded by a ``NamedSharding`` over a concrete mesh in device
    memory spanning every process of the job, stored in another dtype than its own (a dtype
    policy), a scalar, or in a multi-process job held whole by each process."""
    if not isinstance(x, jax.Array) or not x.shape:
        return None
    sharding = x.sharding
    if (
        not isinstance(sharding, jax.sharding.NamedSharding)
        or not isinstance(sharding.mesh, jax.sharding.Mesh)
        or getattr(sharding, "memory_kind", None) not in (None, "device")
        or sharding.is_fully_addressable
        or _dtypes.from_numpy(x.dtype) != stored
        or len(_processes(sharding.mesh)[1]) != jax.process_count()
    ):
        return None
    return (sharding, tuple(x.shape), stored)


@functools.lru_cache(maxsize=64)
def _processes(mesh: jax.sharding.Mesh) -> tuple[np.ndarray, frozenset[int]]:
    # (the process of each device in the mesh's order, the set of them)
    procs = np.array([d.process_index for d in mesh.devices.flat], np.int64)
    return procs, frozenset(procs.tolist())


def array_groups(
    shapes: Sequence[Sequence[int]], dtypes: Sequence[str], keys: Sequence[Hashable | None]
) -> list[_groups.ConcatGroup]:
    """``core.groups.concat_groups`` of tensors keyed by :func:`group_key` (the keys' sharding
    gives each group's devices); positions index the given lists."""
    out: list[_groups.ConcatGroup] = []
    meshes: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            meshes.setdefault(k[0].mesh, []).append(i)  # type: ignore[index]
    for mesh, positions in meshes.items():
        chosen = set(positions)
        mesh_keys = [k if i in chosen else None for i, k in enumerate(keys)]
        out += _groups.concat_groups(
            shapes, dtypes, mesh_keys, jax.process_count(), int(mesh.devices.size)
        )
    return sorted(out, key=lambda g: g.members[0])


def _concat(*xs: Any) -> Any:
    return jnp.concatenate(xs, axis=0)


def join(group: _groups.ConcatGroup, xs: Sequence[jax.Array]) -> jax.Array:
    """The members ``xs`` joined on the devices, in row blocks over their mesh's devices (in
    the mesh's order), or on every device for a group written whole (a collective: every
    process calls it, in the same order)."""
    mesh = xs[0].sharding.mesh  # type: ignore[attr-defined]  # (group_key: a NamedSharding)
    devices = np.array(list(mesh.devices.flat))
    rows = jax.sharding.Mesh(devices[group.device_order(len(devices))], ("rows",))
    spec = jax.sharding.PartitionSpec() if group.writer >= 0 else jax.sharding.PartitionSpec("rows")
    target = jax.sharding.NamedSharding(rows, spec)
    return jax.jit(_concat, out_shardings=target)(*xs)


Copies = list[tuple[tuple[slice, ...], np.ndarray]]


def group_copies(
    group: _groups.ConcatGroup, xs: Sequence[jax.Array], host_array: Any
) -> list[Copies]:
    """Each member's copies: this process's rows of the joined group, mapped back onto the
    members as boxes (a member's list may be empty). ``host_array(data)`` makes the host copy
    of a device block (one per block: the members' copies are views of it). The joined array
    is deleted before this returns."""
    joined = join(group, xs)
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
        # every local device's part of the exchange done (blocks not copied included) before
        # the next collective starts
        joined.block_until_ready()
        joined.delete()
