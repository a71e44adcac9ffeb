"""What the cast tests compare against: ``jnp.astype`` with 64-bit types, on every stack.

JAX releases before 0.10 (CI's floor and mid-2025 stacks) convert to and from float8 and
float4 differently in places (double rounding through float16, NaN bits, float4's +-6 to
integers); the library follows the current release (docs/api.md), so tests compare those
pairs only on JAX 0.10 and newer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from orbax_safetensors._src.core import dtypes

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


@functools.cache
def jax_dtypes() -> list[np.dtype]:
    """The safetensors dtypes JAX itself can hold (not float6 on any release yet)."""
    out = []
    for name in dtypes.SAFETENSORS_DTYPES:
        dt = dtypes.to_numpy(name)
        try:
            np.asarray(jnp.zeros(2, dt).astype(jnp.float32))
        except Exception:
            continue
        out.append(dt)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of ``a``, as unsigned integers of its width."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a.view("u1")


EDGES = [
    0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, 2.5, -2.5, 3.5, 127.5, -128.5, 255.5, 300.0, -300.0,
    32767.5, 65535.5, 65504.0, 65519.0, 65520.0, 2.0**31 - 64, 2.0**31, -(2.0**31),
    4294967295.5, 2.0**32, 2.0**53 + 2, 2.0**63, -(2.0**63), 2.0**64, 1e10, -1e10, 3e38,
    -3e38, 1e300, -1e300, 1 / 3, 2 / 3, 1e-8, 1e-40, -1e-40, 1e-45, 5e-324, 2.0**-126,
    2.0**-127, 448.0, 464.0, 57344.0, 61440.0, 240.0, 6.0, 7.0, np.nan, -np.nan, np.inf,
    -np.inf,
]  # fmt: skip
