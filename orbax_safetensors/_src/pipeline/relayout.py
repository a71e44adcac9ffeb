"""Row blocks on the devices: the sharding a tensor is moved to before object-storage I/O
(``core.relayout`` decides which tensors, from global facts), and the move itself.

Saving (``snapshots.iter_snapshots``, ``snapshots.iter_relaid``) and restoring
(``read.read_tensors``) a tensor whose across-process axis cuts a later dimension on
``s3://`` / ``gs://`` go through row blocks: one contiguous byte range per process instead of
one per row. The move is one jitted identity with the target sharding as ``out_shardings``: a
collective, which every process reaches in the same order (each decides from the same global
facts, tensor by tensor in tree order, on its main thread).

Example::

    rows = row_block_sharding(x.sharding, x.shape, "F32")
    if rows is not None:
        y = move(x, rows)       # every process, same order
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.core import relayout as _relayout


@functools.lru_cache(maxsize=64)
def _mesh_facts(mesh: jax.sharding.Mesh) -> tuple[np.ndarray, jax.sharding.NamedSharding]:
    # (the process of each device, in mesh order; the row-block sharding over its devices in
    # the mesh's own order, which a jitted reshard keeps)
    procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
    rows = jax.sharding.Mesh(np.array(list(mesh.devices.flat)), ("rows",))
    return procs, jax.sharding.NamedSharding(rows, jax.sharding.PartitionSpec("rows"))


def row_block_sharding(
    sharding: Any, shape: Sequence[int], dtype: str
) -> jax.sharding.NamedSharding | None:
    """The row-block sharding (device ``k`` of the mesh, in mesh order, holds the ``k``-th
    block of rows) a tensor of ``shape`` and stored ``dtype`` over ``sharding`` is moved to
    for object-storage I/O, or None to write or read its boxes directly
    (``core.relayout.row_block_layout`` says which; device memory shardings only)."""
    if (
        not isinstance(sharding, jax.sharding.NamedSharding)
        or not isinstance(sharding.mesh, jax.sharding.Mesh)  # an abstract mesh has no devices
        or getattr(sharding, "memory_kind", None) not in (None, "device")
        or len(shape) < 2
        or sharding.is_fully_addressable
    ):
        return None
    procs, rows = _mesh_facts(sharding.mesh)
    layout = _relayout.row_block_layout(
        shape,
        dtype,
        tuple(sharding.spec),
        sharding.mesh.axis_names,
        procs,
        process_count=jax.process_count(),
    )
    return None if layout is None else rows


def _identity(x: Any) -> Any:
    return x


def move(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` resharded onto ``sharding`` on the devices (a collective across the processes of
    its mesh: every one of them calls it, in the same order), complete when it returns.

    Each move is waited for before the next is dispatched: many cross-process collectives in
    flight at once can hang on CPU (gloo), seen with a restore of many column-sharded tensors
    (``tests/multihost/test_relayout_moves.py``); one at a time also bounds the device memory
    the moves hold."""
    moved = jax.jit(_identity, out_shardings=sharding)(x)
    moved.block_until_ready()
    return moved
