"""Concatenated groups: tensors of one shape, stored dtype and sharding that a save to object
storage by several processes joins on the devices, so that each process writes one contiguous
byte range of the group instead of a small range of every member (issue 27 point 1 at scale).

At a thousand processes each process's bytes of a tensor are tiny (16 KB - 4 MB for a
Llama-3-70B state), under the 5 MiB an S3 part needs: almost every upload window would mix
several processes' bytes and its builder would download and upload them again. Instead, the
members of a group sit next to each other in the file (:func:`file_order`), and on the devices
the group is concatenated along its first dimension and laid out in row blocks over all the
mesh's devices, in the mesh's order (``pipeline.groups``): the group's bytes, as the file holds
them, split into one contiguous block per device, hence one range per process when its devices
are adjacent in that order. Each range is mapped back onto the members' rows
(:meth:`ConcatGroup.member_rows`), so the written pieces are ordinary boxes of the members.

Pure functions of global facts (each tensor's shape, stored dtype and a key standing for its
sharding, the number of processes, the process of each device), so every process and the
simulation in ``benchmarks/scale_sim.py`` compute the same groups without talking.

Example::

    keys = ["s", "s", None, "s"]                          # same shape, dtype and sharding
    groups = concat_groups([(64, 8)] * 4, ["F32"] * 4, keys, processes=2, devices=4)
    groups[0].members                                     # (0, 1, 3)
    file_order(keys)                                      # [0, 1, 3, 2]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes

# What a group aims at: each process's range of it about this many bytes (a few S3 minimum
# parts, so that its upload windows are its own). The extra device memory of a save is about
# three times a group's bytes on a device (the joined block and the exchange's buffers), one
# group at a time.
GROUP_RUN_BYTES = 24 << 20
# The tensors of a key totalling at most WHOLE_KEY_BYTES are not spread: they are cut into
# groups of at most WHOLE_GROUP_BYTES (or one tensor), the devices each get all of such a group
# and one process writes it whole. (Spread, their bytes would be a few bytes per process, and
# an upload window holding them one ranged read per process for its builder.)
# (Only where a process's part would be under WHOLE_BELOW_RUN: a tensor whose processes hold
# ranges long enough is left as it is.)
WHOLE_KEY_BYTES = 64 << 20
WHOLE_GROUP_BYTES = 8 << 20
WHOLE_BELOW_RUN = 4 << 20


@dataclasses.dataclass(frozen=True)
class ConcatGroup:
    """Members (positions in the caller's tensor list, in file order) joined along their first
    dimension; the joined array's rows are spread over ``devices`` devices in blocks of
    ``rows_per_device`` (the last blocks shorter or empty, as jax's uneven shardings).

    Attributes:
      members: positions of the member tensors, in the order they are joined and stored.
      rows: the first dimension shared by every member.
      row_bytes: bytes of one row.
      devices: devices the joined rows are spread over (the mesh's, in its order).
      writer: -1 when spread; else the group is small, every device gets all of it and
        process ``writer`` writes it whole.
      offset: the rows are spread over the mesh's devices from this one on (wrapping): a
        group of fewer rows than devices leaves the last ones empty, and successive groups
        start where the previous one's rows ended, so such groups land on every process in
        turn instead of all on the first.
    """

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
        """Positions (in the mesh's order) of the ``count`` devices in the order the joined
        rows are spread over them: the mesh's order rotated by ``offset``."""
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


def concat_groups(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str],
    keys: Sequence[Hashable | None],
    processes: int,
    devices: int,
    run_bytes: int = GROUP_RUN_BYTES,
) -> list[ConcatGroup]:
    """The groups of a save: the tensors sharing a key (a stand-in for one sharding; None:
    not joined), in their order, cut into groups of near-equal member counts, just enough
    members that each of ``processes`` processes holds about ``run_bytes`` of a group. The
    tensors of a key totalling at most :data:`WHOLE_KEY_BYTES`, under
    :data:`WHOLE_BELOW_RUN` per process, make groups (a lone tensor none) of at most
    :data:`WHOLE_GROUP_BYTES` (or one tensor) each written whole by one process (the last
    process for the first such group, then the one before, ...: the primary, process 0, has
    the commit to do). Otherwise a key with a single tensor makes
    no group; nor does a scalar or a sub-byte dtype.

    Every process must pass the same lists (global facts), in the same order.

    Example::

        concat_groups([(8192, 8192)] * 80, ["BF16"] * 80, ["q"] * 80, 1024, 8192)
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
