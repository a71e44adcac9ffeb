"""Deterministic global tensors for the object-storage multi-process test.

Shared by ``objstore_worker.py`` (which holds shards) and ``tests/objstore/test_objstore_multiprocess.py``
(which downloads the files and checks them whole). Mesh: ``(N, 2)`` with axes
``("data", "model")``, so "data" splits across processes and "model" across a process's two
devices.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

try:  # imported from tests/ (a package path)
    from . import mh_common
except ImportError:  # a worker process, with the workers directory on sys.path
    import mh_common  # type: ignore[no-redef]

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


# value(name, shape, dtype, step): the same deterministic values as the multi-host tests.
value = mh_common.value


def global_arrays(step: int) -> dict[str, np.ndarray]:
    """Every tensor at ``step``, whole, by dotted name."""
    out = {n: value(n, s, d, step) for n, (s, d, _) in TENSORS.items()}
    out.update({n: value(n, s, d, step) for n, (s, d) in HOST.items()})
    return out
