"""Safetensors dtype names <-> numpy dtypes (via ml_dtypes), sizes and sub-byte packing."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orbax_safetensors._src.core.errors import UnsupportedLeafError

if TYPE_CHECKING:
    import numpy as np

# The safetensors dtype vocabulary (the reference Rust `Dtype` enum): each name with the numpy
# (or ml_dtypes) type of one element and its width on disk in bits. NumPy and ml_dtypes are
# imported on first use: reading a header and the command line's start need only these.
_TYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "U16": ("uint16", 16),
    "I16": ("int16", 16),
    "U32": ("uint32", 32),
    "I32": ("int32", 32),
    "U64": ("uint64", 64),
    "I64": ("int64", 64),
    "F16": ("float16", 16),
    "BF16": ("ml_dtypes.bfloat16", 16),
    "F32": ("float32", 32),
    "F64": ("float64", 64),
    "C64": ("complex64", 64),
    "F8_E4M3": ("ml_dtypes.float8_e4m3fn", 8),
    "F8_E5M2": ("ml_dtypes.float8_e5m2", 8),
    "F8_E4M3FNUZ": ("ml_dtypes.float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("ml_dtypes.float8_e5m2fnuz", 8),
    "F8_E8M0": ("ml_dtypes.float8_e8m0fnu", 8),
    "F4": ("ml_dtypes.float4_e2m1fn", 4),
    "F6_E2M3": ("ml_dtypes.float6_e2m3fn", 6),
    "F6_E3M2": ("ml_dtypes.float6_e3m2fn", 6),
}
_BITS: dict[str, int] = {name: width for name, (_, width) in _TYPES.items()}
_WHOLE_BYTES: dict[str, int] = {name: w // 8 for name, w in _BITS.items() if w % 8 == 0}

SAFETENSORS_DTYPES: tuple[str, ...] = tuple(_TYPES)
_CHUNK = 1 << 16  # elements per sub-byte packing step; a multiple of 8, so steps end on bytes


@functools.cache
def _numpy_table() -> tuple[dict[str, np.dtype], dict[np.dtype, str]]:
    # ({name: numpy dtype}, {numpy dtype: name}), built on first use.
    import ml_dtypes
    import numpy as np

    def holder(type_name: str) -> np.dtype:
        if type_name.startswith("ml_dtypes."):
            return np.dtype(getattr(ml_dtypes, type_name.removeprefix("ml_dtypes.")))
        return np.dtype(type_name)

    by_name = {name: holder(type_name) for name, (type_name, _) in _TYPES.items()}
    return by_name, {dt: name for name, dt in by_name.items()}


def is_known(name: object) -> bool:
    """Whether ``name`` is a safetensors dtype string this library reads and writes."""
    return isinstance(name, str) and name in _BITS


def to_numpy(name: str) -> np.dtype:
    """The numpy dtype holding one element of safetensors dtype ``name``."""
    try:
        return _numpy_table()[0][name]
    except KeyError:
        raise UnsupportedLeafError(
            f"unknown safetensors dtype {name!r}; known: {', '.join(_TYPES)}"
        ) from None


def from_numpy(dtype: np.dtype | type, *, key: str = "?") -> str:
    """The safetensors dtype string for a numpy (or ml_dtypes) dtype.

    Raises:
      UnsupportedLeafError: naming ``key`` when the format has no such dtype.
    """
    import numpy as np

    dt = np.dtype(dtype)
    by_numpy = _numpy_table()[1]
    try:
        return by_numpy[dt]
    except KeyError:
        raise UnsupportedLeafError(
            f"leaf {key!r}: dtype {dt} has no safetensors equivalent "
            f"(supported: {', '.join(str(d) for d in by_numpy)})"
        ) from None


def bits(name: str) -> int:
    """Width of one element of ``name`` on disk, in bits."""
    return _BITS[name]


def num_elements(shape: Sequence[int]) -> int:
    """Product of ``shape`` (1 for a scalar); exact for any size (Python ints)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def nbytes(name: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies on disk (sub-byte dtypes bit-packed;
    ``UnsupportedLeafError`` when its bits are not a whole number of bytes)."""
    n = 1
    for d in shape:  # num_elements, inline: this runs several times per tensor of every save
        n *= int(d)
    itemsize = _WHOLE_BYTES.get(name)
    if itemsize is not None:
        return n * itemsize
    total_bits = n * bits(name)
    if total_bits % 8:
        raise UnsupportedLeafError(
            f"dtype {name} with shape {tuple(shape)} is {total_bits} bits: "
            "not a whole number of bytes, which safetensors cannot store"
        )
    return total_bits // 8


def pack(values: np.ndarray, name: str) -> np.ndarray:
    """The on-disk bytes of ``values`` (C order) as a flat uint8 array: a view for whole-byte
    dtypes; sub-byte ones packed little-endian (element 0 in the lowest bits of byte 0, as
    PyTorch's ``float4_e2m1fn_x2`` and the safetensors reference do)."""
    import numpy as np

    width = bits(name)
    flat = np.ascontiguousarray(values).reshape(-1)
    if width % 8 == 0:
        return flat.view(np.uint8)
    codes = flat.view(np.uint8)
    out = np.empty(-(-codes.size * width // 8), dtype=np.uint8)
    for start in range(0, codes.size, _CHUNK):  # in steps, so temporaries stay small
        bit_matrix = np.unpackbits(codes[start : start + _CHUNK, None], axis=1, bitorder="little")[
            :, :width
        ]
        packed = np.packbits(bit_matrix.reshape(-1), bitorder="little")
        out[start * width // 8 : start * width // 8 + packed.size] = packed
    return out


def unpack(raw: np.ndarray, name: str, shape: Sequence[int]) -> np.ndarray:
    """Inverse of :func:`pack`: ``raw`` uint8 bytes -> array of ``shape`` (a view if possible)."""
    import numpy as np

    dtype, width = to_numpy(name), _BITS[name]
    if width % 8 == 0:
        return raw.view(dtype).reshape(tuple(shape))
    count = num_elements(shape)
    out = np.empty(count, dtype=np.uint8)
    for start in range(0, count, _CHUNK):  # in steps, so temporaries stay small
        n = min(_CHUNK, count - start)
        first = start * width // 8
        chunk = raw[first : first + -(-n * width // 8)]
        stream = np.unpackbits(chunk, bitorder="little")[: n * width].reshape(n, width)
        padded = np.zeros((n, 8), dtype=np.uint8)
        padded[:, :width] = stream
        out[start : start + n] = np.packbits(padded, axis=1, bitorder="little").reshape(-1)
    return out.view(dtype).reshape(tuple(shape))
