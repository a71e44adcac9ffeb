"""core/astype: every source/target pair of the safetensors dtypes casts to the bits
``jnp.asarray(x).astype(target)`` gives on CPU, on every stack CI runs."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax_casts import EDGES as _EDGES
from jax_casts import OLD_JAX as _OLD_JAX
from jax_casts import bits, jax_dtypes, x64
from jax_casts import small_float as _small_float

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes


def sources(dt: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """Every bit pattern of an 8- or 16-bit dtype; edge and random values of wider ones."""
    if dt == np.bool_:
        return np.array([True, False])
    if dt.itemsize <= 2 and dt.kind != "c":
        width = _dtypes.bits(_dtypes.from_numpy(dt))  # float4 fills 4 bits of its byte
        return np.arange(1 << width, dtype=f"u{dt.itemsize}").view(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        edges = [v for v in (0, 1, -1, 127, 128, 255, 256, 2**24 + 1, 2**31 - 1, 2**53 + 1,
                             info.max, info.min, info.max - 1, info.min + 1)
                 if info.min <= v <= info.max]  # fmt: skip
        randoms = rng.integers(info.min, info.max, 20000, dtype=dt, endpoint=True)
        return np.concatenate([np.array(edges, dt), randoms])
    real = np.dtype(np.float32) if dt.kind == "c" else dt
    with np.errstate(all="ignore"):
        edges = np.array(_EDGES, np.float64).astype(real)
    randoms = rng.integers(0, 1 << 62, 20000, dtype=np.uint64, endpoint=True)
    randoms = (randoms * 4 + rng.integers(0, 4, 20000, dtype=np.uint64)).view(np.float64)
    small = rng.standard_normal(5000) * 10.0 ** rng.integers(-45, 40, 5000)
    halves = rng.integers(-70000, 70000, 5000) + 0.5
    with np.errstate(all="ignore"):
        values = np.concatenate([edges, randoms.astype(real), small.astype(real)])
        values = np.concatenate([values, halves.astype(real)])
    if real.itemsize == 4:  # every class of float32 bit pattern, NaN payloads included
        values = np.concatenate([values, rng.integers(0, 1 << 32, 20000, np.uint32).view(real)])
    values = np.concatenate([values, single_bit_nans(real)])
    if dt.kind == "c":
        return values + 1j * values[::-1]
    return values


def single_bit_nans(dt: np.dtype) -> np.ndarray:
    """NaNs of a float32 / float64 whose payload is one bit, for every bit and both signs
    (a narrowing cast that drops the low payload bits must still give a NaN)."""
    width, mantissa = 8 * dt.itemsize, np.finfo(dt).nmant
    exponent = ((1 << (width - 1)) - 1) & ~((1 << mantissa) - 1)
    patterns = [
        exponent | (1 << k) | sign for k in range(mantissa) for sign in (0, 1 << (width - 1))
    ]
    return np.array(patterns, np.uint64).astype(f"u{dt.itemsize}").view(dt)


@functools.cache
def reference(src: np.dtype) -> tuple[np.ndarray, dict[np.dtype, np.ndarray]]:
    """The source values of ``src`` and JAX's cast of them to every other dtype (one compiled
    function per source)."""
    x = sources(src, np.random.default_rng(0))
    targets = [t for t in jax_dtypes() if t != src and not (src.kind == "c" and t.kind != "c")]
    with x64():
        outs = jax.jit(lambda v: [v.astype(t) for t in targets])(jnp.asarray(x))
        return x, {t: np.asarray(o) for t, o in zip(targets, outs)}


def pairs():
    dts = jax_dtypes()
    for s, t in itertools.product(dts, dts):
        if s != t and not (s.kind == "c" and t.kind != "c"):
            yield pytest.param(s, t, id=f"{s}->{t}")


@pytest.mark.parametrize(("src", "dst"), list(pairs()))
def test_cast_equals_jax_bit_for_bit(src, dst):
    if _OLD_JAX and (_small_float(src) or _small_float(dst)):
        pytest.skip(f"jax {jax.__version__} converts float8/float4 differently (see docs/api.md)")
    x, want_by_dst = reference(src)
    want = want_by_dst[dst]
    got = _casting.astype(x, dst)
    bad = np.flatnonzero(bits(got).reshape(x.size, -1) != bits(want).reshape(x.size, -1))
    old_bf16 = _OLD_JAX and (src, dst) == (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
    if old_bf16 or (src, dst) == (np.dtype(np.float64), np.dtype(np.float16)):
        # Before 0.10, XLA kept a float16 NaN's payload in bfloat16 (0x7c08 -> 0x7fc1); the
        # library stores the current quiet NaN (0x7fc0), sign kept (docs/api.md). From
        # float64 to float16, XLA's CPU gives the canonical NaN (0x7e00) on some processors and
        # keeps the payload's top bits on others (0x7ffe380e80a69556 -> 0x7f8e, as numpy
        # does), with jax 0.10.2 on both: the library stores the canonical NaN, sign kept.
        sign = bits(got) >> 15 == bits(want) >> 15
        bad = bad[
            ~(
                np.isnan(got[bad].astype(np.float32))
                & np.isnan(want[bad].astype(np.float32))
                & sign[bad]
            )
        ]
    assert got.dtype == dst
    assert bad.size == 0, [(x[i], want[i], got[i]) for i in bad[:8]]
    # Transposed views (an export's kernels) take the tiled path: the same bits as the
    # contiguous copy, at shapes that are not multiples of its tiles and bands.
    for view in (
        np.resize(x, (131, 2500)).T,
        np.resize(x, (3, 131, 257)).transpose(0, 2, 1),
        np.resize(x, (5, 7, 300)).transpose(2, 0, 1),
    ):
        np.testing.assert_array_equal(
            bits(_casting.astype(view, dst)), bits(_casting.astype(np.ascontiguousarray(view), dst))
        )


def test_issue_example():
    x = np.array([300, -1, np.nan, np.inf, 255.5, 1e10], np.float32)
    assert _casting.astype(x, np.int8).tolist() == [127, -1, 0, 127, 127, 127]
    assert _casting.astype(np.array([np.nan]), np.int32).tolist() == [0]


def test_strided_and_chunked_input():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((300, 500)) * 1000).astype(np.float32)
    view = x[::2, ::-3]
    with x64():
        want = np.asarray(jnp.asarray(view).astype(jnp.int8))
        want_bf16 = np.asarray(jnp.asarray(view).astype("bfloat16"))
    np.testing.assert_array_equal(_casting.astype(view, np.int8), want)
    out = np.empty(view.shape, ml_dtypes.bfloat16)
    _casting.cast_into(out, view)
    np.testing.assert_array_equal(bits(out), bits(want_bf16))


def test_a_strided_copy_in_the_same_dtype_is_exact():
    x = np.arange(3 * 300 * 200, dtype=np.float32).reshape(3, 300, 200)
    for view in (x.transpose(0, 2, 1), x.transpose(2, 1, 0), x[:, ::-1, ::2], x[:, :0]):
        got = _casting.astype(view, np.float32)
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, view)


@pytest.mark.parametrize("dst", ["float6_e2m3fn", "float6_e3m2fn"])
def test_float6_follows_the_same_rules(dst):
    # JAX lacks float6; NaN and overflow follow ml_dtypes, float -> int rules are shared.
    x = np.array([1.0, 3.3, np.nan, 1e6, -0.0], np.float32)
    got = _casting.astype(x, np.dtype(getattr(ml_dtypes, dst)))
    np.testing.assert_array_equal(bits(got), bits(x.astype(getattr(ml_dtypes, dst))))
    back = _casting.astype(got, np.int8)
    assert back[0] == 1 and back[2] == 0
