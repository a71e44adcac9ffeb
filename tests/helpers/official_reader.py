"""What the installed official ``safetensors`` package can read, probed, not assumed.

safetensors 0.4.5 (the floor of the supported stacks) knows fewer dtypes than 0.8: a file
holding a C64, F8_E8M0, F4 or F6 tensor fails to open there as a whole ("Error while
deserializing header"). Interop tests restrict themselves to the dtypes the installed reader
knows and say what they skipped.

Example::

    if reads("C64"): ...
"""

from __future__ import annotations

import functools
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
import safetensors
from safetensors import safe_open

from orbax_safetensors._src.core import dtypes as _dtypes

VERSION = safetensors.__version__


@functools.cache
def reads(name: str) -> bool:
    """Whether ``safe_open`` opens a file holding one tensor of dtype ``name``."""
    size = _dtypes.nbytes(name, (8,))
    header = json.dumps({"x": {"dtype": name, "shape": [8], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "probe.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(size))
        try:
            with safe_open(path, "numpy") as f:
                return list(f.keys()) == ["x"]
        except Exception:
            return False


def reads_numpy(dtype: np.dtype | type) -> bool:
    """:func:`reads` for the safetensors name of a numpy dtype."""
    return reads(_dtypes.from_numpy(np.dtype(dtype)))


def tensor_bytes(directory: Path) -> int:
    """The tensor data bytes of a directory's safetensors files (each file's size less its
    8-byte length and header), read from the headers' lengths alone."""
    total = 0
    for f in directory.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
        total += f.stat().st_size - 8 - header_len
    return total
