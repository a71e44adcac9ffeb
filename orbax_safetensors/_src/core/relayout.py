"""Row blocks: which tensors move between devices before object-storage I/O, and which rows
each process then writes or reads. Pure functions of global facts (shape, dtype, partition
spec, the mesh's axes and the process of each of its devices), so every process, and a planner
simulating any number of them, gets the same answer without talking to the others.

A sharding whose axis spanning processes cuts a dimension other than the first gives every
process one byte run per row (a column stripe). On object storage that is one staged range
(save) or one ranged read (restore) per row. Instead the tensor is re-laid out on the devices
into row blocks: device ``k`` of the mesh, in the mesh's device order, holds rows
``[k * r, (k + 1) * r)`` (``r = rows / devices``), so each process's share is as many
contiguous byte ranges as its devices form runs in that order: one when they are adjacent (as
in meshes built process by process).

Example::

    layout = row_block_layout((512, 4096), "F32", (None, "data"), ("data",), [0, 1])
    layout.process_rows(1)        # ((256, 512),)
    layout.byte_ranges(1)         # ((4194304, 4194304),): offset and size inside the tensor
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes

# A tensor whose boxes would be cut into at most this many runs per box (the product of the
# dimensions before the cut one) is read or written directly: row blocks are not worth a
# collective.
ROW_BLOCK_MIN_RUNS = 16


@dataclasses.dataclass(frozen=True)
class RowBlockLayout:
    """How a re-laid-out tensor's rows are spread: device ``k`` (mesh order) holds rows
    ``[k * rows_per_device, (k + 1) * rows_per_device)``; ``blocks[p]`` are process ``p``'s
    row ranges ``(start, stop)``, adjacent ranges joined, in row order.

    Attributes:
      shape: the tensor's global shape.
      dtype: its stored safetensors dtype.
      rows_per_device: rows each device of the mesh holds.
      blocks: process index -> its row ranges.
    """

    shape: tuple[int, ...]
    dtype: str
    rows_per_device: int
    blocks: Mapping[int, tuple[tuple[int, int], ...]]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (whole bytes: :func:`row_block_layout` checks the blocks are)."""
        return _dtypes.nbytes(self.dtype, self.shape[1:])

    def process_rows(self, process: int) -> tuple[tuple[int, int], ...]:
        """Process ``process``'s row ranges ``(start, stop)`` (empty if it has no device)."""
        return self.blocks.get(process, ())

    def byte_ranges(self, process: int) -> tuple[tuple[int, int], ...]:
        """Process ``process``'s bytes as ``(offset inside the tensor, size)`` ranges."""
        width = _dtypes.bits(self.dtype) * int(np.prod(self.shape[1:], dtype=np.int64))
        return tuple((a * width // 8, (b - a) * width // 8) for a, b in self.process_rows(process))


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def row_block_layout(
    shape: Sequence[int],
    dtype: str,
    spec: Sequence[Any],
    mesh_axes: Sequence[str],
    mesh_processes: Any,
    process_count: int | None = None,
) -> RowBlockLayout | None:
    """Whether a tensor sharded as described is re-laid out into row blocks for object-storage
    I/O, and if so which rows each process holds then; None when its boxes are written or read
    directly.

    Args:
      shape: the tensor's global shape.
      dtype: its stored safetensors dtype (e.g. ``"F32"``).
      spec: the partition spec's entries, one per leading dimension (None, an axis name, or a
        tuple of axis names).
      mesh_axes: the mesh's axis names.
      mesh_processes: the process index of each device of the mesh, as an array (or nested
        lists) of the mesh's shape, in the mesh's device order.
      process_count: the job's process count: a mesh that leaves out a process is not
        re-laid out (that process could not take part). None: not checked.

    A tensor is re-laid out when all hold: it has two dimensions or more; a mesh axis along
    which the devices' process changes cuts a dimension other than the first; the dimensions
    before that one hold more than :data:`ROW_BLOCK_MIN_RUNS` elements; its rows divide
    evenly among the mesh's devices, each device's block on whole bytes.

    Example::

        row_block_layout((512, 4096), "F32", (None, "data"), ("data",), [0, 1])  # layout
        row_block_layout((512, 4096), "F32", ("data", None), ("data",), [0, 1])  # None
    """
    shape = tuple(int(d) for d in shape)
    procs = np.asarray(mesh_processes, dtype=np.int64)
    if procs.ndim != len(mesh_axes):
        raise ValueError(f"mesh_processes has {procs.ndim} dimensions for mesh axes {mesh_axes}")
    if len(shape) < 2 or procs.size == 0:
        return None
    if process_count is not None and len(np.unique(procs)) != process_count:
        return None
    across = {name for ax, name in enumerate(mesh_axes) if np.any(np.diff(procs, axis=ax) != 0)}
    cut = next(
        (d for d, e in enumerate(spec) if d > 0 and any(n in across for n in _names(e))), None
    )
    devices = int(procs.size)
    if (
        cut is None
        or int(np.prod(shape[:cut], dtype=np.int64)) <= ROW_BLOCK_MIN_RUNS
        or shape[0] % devices
    ):
        return None
    rows = shape[0] // devices
    if (rows * int(np.prod(shape[1:], dtype=np.int64)) * _dtypes.bits(dtype)) % 8:
        return None  # a sub-byte dtype whose blocks would not end on whole bytes
    blocks: dict[int, list[tuple[int, int]]] = {}
    for k, p in enumerate(procs.reshape(-1).tolist()):
        mine = blocks.setdefault(p, [])
        if mine and mine[-1][1] == k * rows:
            mine[-1] = (mine[-1][0], (k + 1) * rows)
        else:
            mine.append((k * rows, (k + 1) * rows))
    return RowBlockLayout(shape, dtype, rows, {p: tuple(b) for p, b in blocks.items()})


def row_block_layout_of_json(
    desc: Mapping[str, Any] | None,
    shape: Sequence[int],
    dtype: str,
    process_of_device: Mapping[int, int],
    process_count: int | None = None,
) -> RowBlockLayout | None:
    """:func:`row_block_layout` of a sharding described as in ``orbax_safetensors.json``
    (``core.sharding.named_sharding_json``: mesh axes and shape, spec, ``device_ids``), with
    ``process_of_device`` mapping each device id to its process. None for no description or
    one without device ids.

    Example::

        desc = named_sharding_json(["data"], [2], [None, "data"], device_ids=[0, 1])
        row_block_layout_of_json(desc, (512, 4096), "F32", {0: 0, 1: 1}, process_count=2)
    """
    if not desc or "device_ids" not in desc:
        return None
    mesh_shape = tuple(int(d) for d in desc["mesh_shape"])
    procs = np.array([process_of_device[int(i)] for i in desc["device_ids"]]).reshape(mesh_shape)
    return row_block_layout(
        shape, dtype, desc["spec"], desc["mesh_axes"], procs, process_count=process_count
    )
