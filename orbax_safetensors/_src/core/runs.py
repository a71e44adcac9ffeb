"""Byte runs: where a shard's box lies inside a row-major tensor, and how wanted runs are
grouped into reads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.errors import UnsupportedLeafError

Index = tuple[slice, ...]
IOV_MAX = 1024  # Linux's per-call iovec limit
MAX_BATCH_BYTES = 256 << 20  # per vectored read
MAX_CALL_BYTES = 0x7FFFF000  # Linux transfers at most this much per read/write call
DEFAULT_MAX_GAP = 4096
# Object-storage reads fetch at most this many times the bytes wanted (Orbax's own safetensors
# loader warns above the same ratio).
MAX_READ_RATIO = 1.5
ReadBatch = tuple[int, list[memoryview], list[int]]  # file offset, buffers, run numbers


def share_bytes(total: int, workers: int, *, low: int = 4 << 20, high: int = 16 << 20) -> int:
    """Bytes each of ``workers`` threads should take of ``total``: the even share, rounded up to
    whole MiB and kept within ``[low, high]`` (a smaller piece costs more than a thread gains).
    """
    mib = 1 << 20
    share = -(-max(total, 1) // max(workers, 1))
    return max(low, min(high, -(-share // mib) * mib))


def piece_spans(offset: int, nbytes: int, piece: int, block: int = 4096) -> list[tuple[int, int]]:
    """Where to cut ``nbytes`` at file ``offset`` into pieces of about ``piece`` bytes for
    several threads: ``(start, end)`` inside the run per piece, every cut at a
    ``block``-aligned file offset (so direct I/O reads each piece's whole blocks in place), and
    no tail piece under half a piece (which direct I/O would read buffered).
    """
    if nbytes <= piece:
        return [(0, nbytes)]
    first = (-offset) % block + piece
    starts = [0, *(k for k in range(first, nbytes, piece) if nbytes - k >= piece // 2)]
    return list(zip(starts, [*starts[1:], nbytes]))


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """``index`` (as jax's ``devices_indices_map`` gives it) with explicit start/stop per dim."""
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise UnsupportedLeafError(f"strided shard index {sl} is not supported")
        out.append(slice(start, max(start, stop)))
    out.extend(slice(0, d) for d in list(shape)[len(index) :])
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def whole_index(shape: tuple[int, ...]) -> Index:
    """The normalised index of a whole tensor of ``shape`` (cached: models repeat shapes)."""
    return tuple(slice(0, int(d)) for d in shape)


def index_key(index: Index) -> tuple[tuple[int, int], ...]:
    """A hashable, JSON-friendly form of a normalised index."""
    return tuple((int(s.start), int(s.stop)) for s in index)


def box_shape(index: Index) -> tuple[int, ...]:
    """The shape of a normalised index's box."""
    return tuple(int(s.stop - s.start) for s in index)


def box_runs(shape: Sequence[int], index: Index) -> tuple[np.ndarray, int]:
    """``(offsets, length)``: the box (a normalised index) of a row-major tensor is ``length``
    consecutive elements at each of ``offsets`` (ascending), in the box's row-major order."""
    shape = tuple(int(d) for d in shape)
    extents = box_shape(index)
    if any(e == 0 for e in extents):
        return np.zeros(0, dtype=np.int64), 0
    # j: the innermost dimension the box does not cover in full (everything after is full).
    j = len(shape) - 1
    while j >= 0 and extents[j] == shape[j]:
        j -= 1
    if j < 0:
        return np.zeros(1, dtype=np.int64), _dtypes.num_elements(shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    length = extents[j] * strides[j]
    offsets = np.array([int(index[j].start) * strides[j]], dtype=np.int64)
    for d in range(j - 1, -1, -1):
        starts = (np.arange(extents[d], dtype=np.int64) + int(index[d].start)) * strides[d]
        offsets = (starts[:, None] + offsets[None, :]).reshape(-1)
    return offsets, length


def is_whole(index: Index, shape: Sequence[int]) -> bool:
    """Whether a normalised ``index`` covers the whole tensor."""
    return all(s.start == 0 and s.stop == d for s, d in zip(index, shape, strict=True))


def byte_runs(
    spec_dtype: str, shape: Sequence[int], index: Index, name: str
) -> tuple[np.ndarray, int]:
    """:func:`box_runs` in bytes of tensor ``name`` (named in the error). Sub-byte dtypes must
    split on whole bytes.

    Raises:
      UnsupportedLeafError: naming the tensor, its shard, dtype and shape, for a sub-byte
        shard that does not start and end on whole bytes.
    """
    offsets, length = box_runs(shape, index)
    width = _dtypes.bits(spec_dtype)
    if width % 8 == 0:
        return offsets * (width // 8), length * (width // 8)
    if (length * width) % 8 or np.any((offsets * width) % 8):
        raise UnsupportedLeafError(
            f"leaf {name!r}: a shard {index_key(index)} of a {spec_dtype} tensor of shape "
            f"{tuple(shape)} does not start and end on whole bytes; shard sub-byte tensors "
            "along whole bytes"
        )
    return offsets * width // 8, length * width // 8


def coalesce_runs(
    runs: Sequence[tuple[int, np.ndarray]],
    max_gap: int,
    *,
    bounded: bool = False,
    max_batch: int = MAX_BATCH_BYTES,
) -> list[ReadBatch]:
    """Wanted byte runs ``(offset, buffer)`` grouped into vectored reads: ``(file offset,
    buffers, run numbers)`` per read, in offset order; gaps up to ``max_gap`` are read into a
    shared scratch buffer. ``bounded``: a gap only when no longer than the run after it, so at
    most half of what is read is unwanted (column shards' narrow runs are read exactly)."""
    ordered = sorted(((o, d, i) for i, (o, d) in enumerate(runs) if d.nbytes), key=lambda r: r[0])
    scratch = np.empty(max(max_gap, 1), dtype=np.uint8).data
    batches: list[ReadBatch] = []
    start = end = 0
    bufs: list[memoryview] = []
    ids: list[int] = []
    size = 0
    for offset, dest, i in ordered:
        if dest.nbytes <= MAX_CALL_BYTES:  # the common case
            views = [dest.data]
        else:
            views = [
                dest.data[k : k + MAX_CALL_BYTES] for k in range(0, dest.nbytes, MAX_CALL_BYTES)
            ]
        gap = offset - end
        if (
            bufs
            and 0 <= gap <= max_gap
            and (not bounded or gap <= dest.nbytes)
            and len(bufs) + len(views) + 1 < IOV_MAX
            and size < max_batch
        ):
            if gap:
                bufs.append(scratch[:gap])
            bufs.extend(views)
            ids.append(i)
        else:
            if bufs:
                batches.append((start, bufs, ids))
            start, bufs, ids, size = offset, list(views), [i], 0
        size += dest.nbytes + max(gap, 0)
        end = offset + dest.nbytes
    if bufs:
        batches.append((start, bufs, ids))
    return batches


def ranged_reads(
    runs: Sequence[tuple[int, np.ndarray]], max_gap: int, *, max_ratio: float = MAX_READ_RATIO
) -> list[tuple[int, list[memoryview]]]:
    """Wanted byte runs ``(offset, buffer)`` grouped into the fewest contiguous ranges that read
    at most ``max_ratio`` times the wanted bytes: ``(file offset, buffers)`` per range, in
    offset order (gap bytes land in a shared scratch buffer; no gap over ``max_gap``).
    """
    # Merging a gap saves one range and costs its bytes: the smallest gaps first, within the
    # budget, give the fewest ranges for the byte bound.
    ordered = sorted(((o, d) for o, d in runs if d.nbytes), key=lambda r: r[0])
    if not ordered:
        return []
    offsets = np.fromiter((o for o, _ in ordered), dtype=np.int64, count=len(ordered))
    sizes = np.fromiter((d.nbytes for _, d in ordered), dtype=np.int64, count=len(ordered))
    gaps = offsets[1:] - (offsets[:-1] + sizes[:-1])
    budget = int((max_ratio - 1) * int(sizes.sum()))
    candidates = np.flatnonzero((gaps >= 0) & (gaps <= max_gap))
    by_size = candidates[np.argsort(gaps[candidates], kind="stable")]
    taken = int(np.searchsorted(np.cumsum(gaps[by_size]), budget, side="right"))
    merged = np.zeros(len(gaps), dtype=bool)
    merged[by_size[:taken]] = True
    widest = int(gaps[by_size[:taken]].max()) if taken else 0
    scratch = np.empty(max(widest, 1), dtype=np.uint8).data
    reads: list[tuple[int, list[memoryview]]] = []
    for k, (offset, dest) in enumerate(ordered):
        if k and merged[k - 1]:
            gap = int(gaps[k - 1])
            if gap:
                reads[-1][1].append(scratch[:gap])
            reads[-1][1].append(dest.data)
        else:
            reads.append((offset, [dest.data]))
    return reads
