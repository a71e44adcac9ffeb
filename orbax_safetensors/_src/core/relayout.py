"""Device re-layouts decided: which tensors move between devices before they are written or
read, and what each process then holds. Pure functions of global facts (shapes, dtypes,
partition specs, the process of each device), so every process, and a planner simulating any
number of them (``benchmarks/scale_sim.py``), gets the same answer without talking.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes

# A tensor whose boxes would be cut into at most this many runs per box (the product of the
# dimensions before the cut one) is read or written directly: row blocks are not worth a
# collective.
ROW_BLOCK_MIN_RUNS = 16

# Each process's range of a group is about this many bytes (a few S3 minimum parts, so that
# its upload windows are its own); a save's extra device memory is about three times a
# group's bytes on a device, one group at a time.
GROUP_RUN_BYTES = 24 << 20
# The tensors of a key totalling at most WHOLE_KEY_BYTES, under WHOLE_BELOW_RUN per process,
# are not spread (each process's bytes would be a few, and an upload window holding them one
# ranged read per process for its builder): cut into groups of at most WHOLE_GROUP_BYTES (or
# one tensor), every device gets all of such a group and one process writes it whole.
WHOLE_KEY_BYTES = 64 << 20
WHOLE_GROUP_BYTES = 8 << 20
WHOLE_BELOW_RUN = 4 << 20


@dataclasses.dataclass(frozen=True)
class RowBlockLayout:
    """A re-laid-out tensor: device ``k`` (mesh order) holds rows ``[k * rows_per_device,
    (k + 1) * rows_per_device)``; ``blocks[p]``: process ``p``'s row ranges, adjacent ones
    joined, in row order."""

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
    """The row blocks a tensor of ``shape`` and stored ``dtype``, sharded by ``spec`` over a
    mesh of axes ``mesh_axes`` whose devices belong to processes ``mesh_processes`` (an array
    of the mesh's shape), moves to for object-storage I/O; None to use its boxes directly.
    Moved when a mesh axis along which the process changes cuts a dimension other than the
    first, the dimensions before it hold more than :data:`ROW_BLOCK_MIN_RUNS` elements, and
    the rows divide evenly among the devices on whole bytes (the mesh spanning
    ``process_count`` processes, when given).
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


@dataclasses.dataclass(frozen=True)
class ConcatGroup:
    """Members (positions in the caller's tensor list, in file order) joined along their first
    dimension of ``rows`` rows (``row_bytes`` each); the joined rows are spread over
    ``devices`` devices in blocks of ``rows_per_device`` (the last shorter or empty, as jax's
    uneven shardings), from device ``offset`` on (wrapping: successive small groups land on
    every process in turn, not all on the first). ``writer >= 0``: a small group every device
    holds whole, written by process ``writer``."""

    members: tuple[int, ...]
    rows: int
    row_bytes: int
    devices: int
    writer: int = -1
    offset: int = 0

    @property
    def total_rows(self) -> int:
        return self.rows * len(self.members)

    @property
    def rows_per_device(self) -> int:
        return -(-self.total_rows // self.devices)

    @property
    def nbytes(self) -> int:
        return self.total_rows * self.row_bytes

    def device_order(self, count: int) -> np.ndarray:
        """Positions (mesh order) of the ``count`` devices in the order the rows are spread."""
        return np.roll(np.arange(count), -self.offset)

    def process_rows(self, process_of_device: Any) -> dict[int, list[tuple[int, int]]]:
        """Each process's rows ``[start, stop)`` of the joined array, adjacent blocks joined,
        from the process of each device in the mesh's order (any shape, flattened)."""
        procs = np.asarray(process_of_device, np.int64).reshape(-1)
        if len(procs) != self.devices:
            raise ValueError(f"{len(procs)} devices for a group spread over {self.devices}")
        c, total = self.rows_per_device, self.total_rows
        if self.writer >= 0:
            return {self.writer: [(0, total)]}
        k = np.arange(self.devices)
        a, b = np.minimum(k * c, total), np.minimum((k + 1) * c, total)
        p = procs[self.device_order(self.devices)]
        keep = b > a
        a, b, p = a[keep], b[keep], p[keep]
        head = np.append(True, p[1:] != p[:-1])  # a new run where the process changes
        starts, owners = a[head], p[head]
        stops = np.append(a[head][1:], b[-1]) if len(a) else a
        out: dict[int, list[tuple[int, int]]] = {}
        for x, y, q in zip(starts.tolist(), stops.tolist(), owners.tolist()):
            out.setdefault(q, []).append((x, y))
        return out

    def member_rows(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(member index in the group, first row, stop row)`` of joined rows
        ``[start, stop)``, member by member (rows inside each member)."""
        out = []
        for j in range(start // self.rows, -(-stop // self.rows)):
            a, b = max(start - j * self.rows, 0), min(stop - j * self.rows, self.rows)
            if b > a:
                out.append((j, a, b))
        return out


def file_order(keys: Sequence[Hashable | None]) -> list[int]:
    """A permutation of the tensors putting every key's tensors next to each other, at the
    place of the first of them (tensors without a key keep theirs): the order a save that
    joins groups hands to ``plan.plan_files`` (whose stable alignment sort keeps them so)."""
    first: dict[Hashable, list[int]] = {}
    order: list[Any] = []
    for i, k in enumerate(keys):
        if k is None:
            order.append(i)
        elif k in first:
            first[k].append(i)
        else:
            first[k] = [i]
            order.append(first[k])
    return [j for item in order for j in (item if isinstance(item, list) else [item])]


# At a thousand processes a process's bytes of one tensor fall under the 5 MiB an S3 part needs:
# joined, tensors of one sharding give each process one range of a group.
def concat_groups(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    keys: Sequence[Hashable | None],
    processes: int,
    devices: int,
    run_bytes: int = GROUP_RUN_BYTES,
) -> list[ConcatGroup]:
    """The groups of a save: the tensors sharing a key (a stand-in for one sharding; None: not
    joined), cut into groups of near-equal member counts, just enough that each of
    ``processes`` holds about ``run_bytes`` of one. A key's tensors of at most
    :data:`WHOLE_KEY_BYTES` (under :data:`WHOLE_BELOW_RUN` per process) make groups of at most
    :data:`WHOLE_GROUP_BYTES` each written whole by one process (the last one first: the
    primary has the commit to do). A lone tensor, a scalar or a sub-byte dtype makes none.
    """
    by_key: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            by_key.setdefault(k, []).append(i)
    out: list[ConcatGroup] = []
    small: list[ConcatGroup] = []
    for members in by_key.values():
        shape = tuple(int(d) for d in shapes[members[0]])
        dtype = dtypes[members[0]]
        if not shape or shape[0] == 0 or _dtypes.bits(dtype) % 8:
            continue
        nbytes = _dtypes.nbytes(dtype, shape)
        if nbytes == 0:
            continue
        row_bytes = nbytes // shape[0]
        total = nbytes * len(members)
        if len(members) > 1 and total <= WHOLE_KEY_BYTES and total < WHOLE_BELOW_RUN * processes:
            per = max(1, WHOLE_GROUP_BYTES // nbytes)
            for at in range(0, len(members), per):
                chunk = tuple(members[at : at + per])
                small.append(ConcatGroup(chunk, shape[0], row_bytes, devices))
            continue
        if len(members) < 2:
            continue
        k = max(2, min(len(members), math.ceil(run_bytes * processes / nbytes)))
        count = -(-len(members) // k)
        bounds = [len(members) * g // count for g in range(count + 1)]
        for g in range(count):
            chunk = tuple(members[bounds[g] : bounds[g + 1]])
            if len(chunk) > 1:
                out.append(ConcatGroup(chunk, shape[0], row_bytes, devices))
    out.sort(key=lambda g: g.members[0])
    placed: list[ConcatGroup] = []
    at = 0
    for spread in out:  # each spread group starts on the device after the previous one's rows
        placed.append(dataclasses.replace(spread, offset=at))
        at = (at + -(-spread.total_rows // spread.rows_per_device)) % devices
    for i, lone in enumerate(small):
        placed.append(dataclasses.replace(lone, writer=processes - 1 - i % processes))
    return sorted(placed, key=lambda g: g.members[0])


def even_rows(total: int, most: int, devices: int) -> int:
    """At most ``most`` rows of ``total`` that divide it (one band shape: one compiled
    re-layout): the largest multiple of ``devices`` that does (each band split over every
    device by its rows), else the largest divisor.
    """
    if most >= total:
        return total
    for rows in range(most - most % devices, 0, -devices):
        if total % rows == 0:
            return rows
    return next(rows for rows in range(most, 0, -1) if total % rows == 0)
