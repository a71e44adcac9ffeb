"""Deterministic global tensors for the object-storage multi-process test.

Shared by ``objstore_worker.py`` (which holds shards) and ``tests/test_objstore.py`` (which
downloads the files and checks them whole). Mesh: ``(N, 2)`` with axes ``("data", "model")``,
so "data" splits across processes and "model" across a process's two devices.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
MiB = 1 << 20

# name -> (shape, dtype, save partition spec)
TENSORS: dict[str, tuple[tuple[int, ...], Any, tuple[Any, ...]]] = {
    # 40 MiB, rows across processes: one contiguous 20 MiB range per process (N=2), large
    # enough for S3 parts uploaded straight into the shared multipart upload.
    "big_rows": ((2560, 4096), np.float32, ("data", None)),
    # 2 MiB, columns across processes: 2 KiB runs that alternate between processes.
    "mid_cols": ((512, 1024), np.float32, (None, "data")),
    # fully sharded bfloat16: each process's rows are one contiguous range
    "emb": ((1000, 256), BF16, ("data", "model")),
    # replicated: process 0 owns it
    "bias": ((256,), np.float32, ()),
}
# Restore specs, applied on a mesh with the process order reversed: each process needs about
# half of the bytes, most of them written by the other process.
RESTORE_SPECS: dict[str, tuple[Any, ...]] = {
    "big_rows": ("data", "model"),
    "mid_cols": ("data", None),
    "emb": ("model", "data"),
    "bias": ("data",),
}
# Host-local numpy leaves: the primary writes them.
HOST: dict[str, tuple[tuple[int, ...], Any]] = {"host_table": ((5, 3), np.float64)}


def value(name: str, shape: tuple[int, ...], dtype: Any, step: int) -> np.ndarray:
    """The global value of ``name`` at ``step`` (exact in bfloat16)."""
    seed = sum(ord(c) for c in name) % 97
    n = int(np.prod(shape))
    raw = (np.arange(n, dtype=np.int64) * 7 + seed + 1000 * step) % 251 - 125
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        raw = raw.astype(np.float64) / 4.0
    return raw.astype(dtype).reshape(shape)


def global_arrays(step: int) -> dict[str, np.ndarray]:
    """Every tensor at ``step``, whole, by dotted name."""
    out = {n: value(n, s, d, step) for n, (s, d, _) in TENSORS.items()}
    out.update({n: value(n, s, d, step) for n, (s, d) in HOST.items()})
    return out
