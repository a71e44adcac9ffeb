"""What the cast tests compare against: ``jnp.astype`` with 64-bit types, on every stack.

JAX releases before 0.10 (CI's floor and mid-2025 stacks) convert to and from float8 and
float4 differently in places (double rounding through float16, NaN bits, float4's +-6 to
integers); the library follows the current release (docs/api.md), so tests compare those
pairs only on JAX 0.10 and newer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np

OLD_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10)


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """64-bit JAX types, on the CPU, for one reference cast (jax.enable_x64 on new releases,
    jax.experimental.enable_x64 on old ones). On the CPU: the library's casts are XLA's CPU
    conversions, which a TPU's own differ from (it flushes subnormals to zero; docs/api.md),
    and the tests may run on a TPU (``OSF_TEST_PLATFORM=accelerator``)."""
    with jax.default_device(jax.devices("cpu")[0]):
        ctx = getattr(jax, "enable_x64", None)
        if ctx is not None:
            with ctx(True):
                yield
            return
        from jax.experimental import enable_x64  # (releases before jax.enable_x64)

        with enable_x64():
            yield


def small_float(dt: np.dtype) -> bool:
    """A float8 / float4 dtype (one byte or less)."""
    dt = np.dtype(dt)
    return dt.kind not in "biuc" and dt.itemsize == 1 and "float" in dt.name


def compared(*dtypes: np.dtype) -> bool:
    """Whether a cast between these dtypes is compared with ``jnp.astype`` on this JAX."""
    return not (OLD_JAX and any(small_float(d) for d in dtypes))
