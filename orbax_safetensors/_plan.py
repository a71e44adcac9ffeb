"""Planning: which tensors go in which file, at which offsets, and which byte runs each
process writes or reads. Pure functions of names, global shapes and dtypes (and, for
ownership, of shardings), so every process computes the same plan without talking to others.

One process is the N=1 case: it owns every shard.

Example::

    plan = plan_files([TensorSpec("w", "F32", (4, 6))], max_file_size=None)
    plan.files[0].filename                       # 'model.safetensors'
    offsets, run = box_runs((4, 6), (slice(0, 4), slice(3, 6)))
    # 4 runs of 3 elements each, at element offsets [3, 9, 15, 21]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core.errors import UnsupportedLeafError

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
DEFAULT_MAX_FILE_SIZE = 5 * 1000**3  # ~5 GB per file, as on the Hugging Face Hub

Index = tuple[slice, ...]


class TensorSpec(NamedTuple):
    """A tensor to store: its name, safetensors dtype and global shape (a named tuple: cheap
    to create, one per tensor of every save)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.dtype, self.shape)


@dataclasses.dataclass(frozen=True)
class FilePlan:
    """One output file: its name, exact header bytes, tensor entries and final size."""

    filename: str
    header: bytes
    entries: dict[str, _header.TensorEntry]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @functools.cached_property
    def size(self) -> int:
        return self.data_start + sum(e.nbytes for e in self.entries.values())


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Every file of a checkpoint and where each tensor lives."""

    files: list[FilePlan]
    file_of: dict[str, int]

    def locate(self, name: str) -> tuple[FilePlan, _header.TensorEntry]:
        f = self.files[self.file_of[name]]
        return f, f.entries[name]

    @property
    def total_size(self) -> int:
        return sum(e.nbytes for f in self.files for e in f.entries.values())

    def index_json(self, metadata: Mapping[str, object] | None = None) -> dict[str, object]:
        """The Hugging Face ``model.safetensors.index.json`` document for this plan."""
        meta: dict[str, object] = {"total_size": self.total_size}
        if metadata:
            meta.update(metadata)
        weight_map = {n: self.files[i].filename for n, i in sorted(self.file_of.items())}
        return {"metadata": meta, "weight_map": weight_map}


def _file_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    # Widest elements first (stable), so every tensor starts at a multiple of its element size
    # once the header is padded to 8 bytes: mmap readers get aligned views, as in the
    # reference writer.
    return sorted(specs, key=lambda s: -_dtypes.bits(s.dtype))


def header_bound(
    name_chars: int, count: int, max_ndim: int, metadata: Mapping[str, str] | None = None
) -> int:
    """An upper bound of the header bytes of any file planned from ``count`` tensors whose
    names total ``name_chars`` characters (before collision suffixes), with at most
    ``max_ndim`` dimensions each, without laying them out: every name fully JSON-escaped
    (6 bytes per character) with a ``~N`` suffix, 20-digit numbers."""
    meta = sum(6 * (len(k) + len(v)) + 6 for k, v in (metadata or {}).items()) + 64
    return meta + 6 * name_chars + count * (96 + 6 * 21 + 21 * max_ndim)


def plan_files(
    specs: Sequence[TensorSpec],
    *,
    max_file_size: int | None = DEFAULT_MAX_FILE_SIZE,
    single_file_name: str = SINGLE_FILE_NAME,
    metadata: Mapping[str, str] | None = None,
) -> CheckpointPlan:
    """Assigns tensors to files (in order, splitting at ``max_file_size`` bytes of data; a
    tensor never spans files) and lays out each file. ``metadata`` goes into every header."""
    groups: list[list[TensorSpec]] = [[]]
    used = 0
    for s in specs:
        size = s.nbytes
        if max_file_size is not None and groups[-1] and used + size > max_file_size:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += size
    n = len(groups)
    files: list[FilePlan] = []
    file_of: dict[str, int] = {}
    for i, group in enumerate(groups):
        name = single_file_name if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        ordered = _file_order(group)
        header, entries = _header.build_header(
            [(s.name, s.dtype, s.shape) for s in ordered], metadata
        )
        files.append(FilePlan(name, header, {e.name: e for e in entries}))
        for s in group:
            file_of[s.name] = i
    return CheckpointPlan(files, file_of)


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
    return tuple(int(s.stop - s.start) for s in index)


def box_runs(shape: Sequence[int], index: Index) -> tuple[np.ndarray, int]:
    """The element runs of a box (a normalised index) inside a row-major tensor.

    Returns ``(offsets, length)``: the box's elements, in row-major order of the box, are
    ``length`` consecutive elements starting at each of ``offsets`` (ascending). One run when
    only leading dimensions are split; equally spaced runs otherwise.
    """
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


def byte_runs(spec_dtype: str, shape: Sequence[int], index: Index) -> tuple[np.ndarray, int]:
    """:func:`box_runs` in bytes. Sub-byte dtypes must split on whole bytes."""
    offsets, length = box_runs(shape, index)
    width = _dtypes.bits(spec_dtype)
    if width % 8 == 0:
        return offsets * (width // 8), length * (width // 8)
    if (length * width) % 8 or np.any((offsets * width) % 8):
        raise UnsupportedLeafError(
            f"a shard {index_key(index)} of a {spec_dtype} tensor of shape {tuple(shape)} does "
            "not start and end on whole bytes; shard sub-byte tensors along whole bytes"
        )
    return offsets * width // 8, length * width // 8
