"""The file plan: which tensors go in which file, at which offsets. Pure functions of names,
global shapes and dtypes, so every process computes the same plan without talking to others.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
DEFAULT_MAX_FILE_SIZE = 5 * 1000**3  # ~5 GB per file, as on the Hugging Face Hub


class TensorSpec(NamedTuple):
    """A tensor to store: its name, safetensors dtype and global shape."""

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


# Tensors start at multiples of this many bytes wherever sizes allow (cache lines, SIMD loads,
# and the 64-byte alignment zero-copy placement wants), within a data section that starts on a
# 4 KiB boundary (:data:`.header.DATA_ALIGNMENT`).
TENSOR_ALIGNMENT = 64


def _alignment(spec: TensorSpec) -> int:
    # The largest power of two up to TENSOR_ALIGNMENT dividing the tensor's byte size.
    n = spec.nbytes
    return TENSOR_ALIGNMENT if n % TENSOR_ALIGNMENT == 0 else n & -n


def _file_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    # Tensors stay contiguous (readers reject gaps), so alignment comes from the order alone:
    # by decreasing alignment of their byte sizes (stable, so deterministic on every process).
    # Every tensor whose size is a multiple of 64 bytes then starts 64-byte aligned, and each
    # other one starts at a multiple of its own size's alignment, hence of its element size:
    # mmap readers get aligned views, as in the reference writer.
    return sorted(specs, key=lambda s: (-_alignment(s), -_dtypes.bits(s.dtype)))


def header_bound(
    name_chars: int, count: int, max_ndim: int, metadata: Mapping[str, str] | None = None
) -> int:
    """An upper bound of the header bytes of any file planned from ``count`` tensors whose names
    total ``name_chars`` characters, of at most ``max_ndim`` dimensions, without laying them
    out (names fully JSON-escaped with a ``~N`` suffix, 20-digit numbers, the padding)."""
    meta = sum(6 * (len(k) + len(v)) + 6 for k, v in (metadata or {}).items()) + 64
    meta += _header.DATA_ALIGNMENT
    return meta + 6 * name_chars + count * (96 + 6 * 21 + 21 * max_ndim)


def plan_files(
    specs: Sequence[TensorSpec],
    *,
    max_file_size: int | None = DEFAULT_MAX_FILE_SIZE,
    single_file_name: str = SINGLE_FILE_NAME,
    metadata: Mapping[str, str] | None = None,
) -> CheckpointPlan:
    """Assigns tensors to files (in order, a new file past ``max_file_size`` bytes of data; a
    tensor never spans files) and lays out each; ``metadata`` goes into every header."""
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


def specs_of(entries: Iterable[tuple[str, Any, Sequence[int]]]) -> list[TensorSpec]:
    """Tensor specs from ``(name, numpy dtype, shape)``.

    Raises:
      UnsupportedLeafError: naming a tensor whose dtype has no safetensors name.
    """
    specs = []
    stored_of: dict[Any, str] = {}  # a tree of many arrays has a few dtypes
    for name, dtype, shape in entries:
        stored = stored_of.get(dtype)
        if stored is None:
            stored = stored_of[dtype] = _dtypes.from_numpy(dtype, key=name)
        if type(shape) is not tuple:  # (numpy's and jax's are: tuples of ints)
            shape = tuple(int(d) for d in shape)
        specs.append(TensorSpec(name, stored, shape))
    return specs
