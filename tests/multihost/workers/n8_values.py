"""The state of the N=8 launch (tests/multihost/test_multihost_n8.py): every value a pure
function of its name, so the workers of any process count and the test process agree.

Meshes are built over the job's D devices in ``jax.devices()`` order: ``"1d"`` = (D,) with axis
"x", ``"2d"`` = (D // 2, 2) with axes ("a", "b"); restores use the same shapes over the devices
in reverse order. Every sharded dimension divides by 8 and by 4.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# name -> (shape, dtype, (saved mesh kind, spec), (restore mesh kind, spec))
SHARDED: dict[str, tuple[tuple[int, ...], Any, tuple[str, tuple], tuple[str, tuple]]] = {
    # rows across processes, restored as column stripes across processes
    "rows": ((64, 256), np.float32, ("1d", ("x", None)), ("1d", (None, "x"))),
    # column stripes across processes (row blocks on object storage), restored as rows
    "cols": ((256, 512), np.float32, ("1d", (None, "x")), ("1d", ("x", None))),
    # both dimensions across processes, transposed roles on restore
    "grid": ((32, 48), BF16, ("2d", ("b", "a")), ("2d", ("a", "b"))),
    # replicated over "a": written by replica 0 only
    "partial": ((16, 8), np.int32, ("2d", (None, "b")), ("2d", ("a", None))),
    # fully replicated
    "bias": ((10,), np.float32, ("1d", ()), ("2d", ())),
}
HOST: dict[str, tuple[tuple[int, ...], Any]] = {"host": ((5, 3), np.float64)}
STEP = 4


def value(name: str) -> np.ndarray:
    """The global value of tensor ``name``."""
    shape, dtype = {**{k: v[:2] for k, v in SHARDED.items()}, **HOST}[name]
    seed = sum(map(ord, name))
    flat = np.arange(int(np.prod(shape)), dtype=np.float64) * 0.5 - seed
    return flat.astype(dtype).reshape(shape)


def data_bytes() -> int:
    """Bytes of every tensor's data."""
    return sum(value(n).nbytes for n in [*SHARDED, *HOST])
