"""Exact equality of restored trees, for the round-trip tests (unit and property)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def assert_same(a: Any, b: Any, where: str = "root") -> None:
    """Exact equality including container, key, scalar and array types (NaN == NaN, -0.0 != 0.0)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(x for x in b if x == k and type(x) is type(k)))
            assert_same(a[k], b[k], f"{where}.{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), where
    elif isinstance(a, (jax.Array, np.ndarray, np.generic)):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(a) == jax.random.key_impl(b), where
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
