"""Dtype casts in numpy that give the bits ``jnp.asarray(x).astype(dtype)`` gives on CPU.

A save-time dtype policy (see :mod:`.casting`) casts host copies as they are written, so the
cast must not depend on JAX devices, yet a tensor saved under ``dtype={"*": jnp.int8}`` must
hold what ``x.astype(jnp.int8)`` (and Orbax's ``SaveArgs(dtype=)``) would hold. numpy and
ml_dtypes differ from XLA's CPU conversions in these places, each handled here:

- float -> integer saturates: NaN gives 0, values beyond the range give the integer's
  max / min, others truncate toward zero (numpy wraps or gives an arbitrary value);
  from float4_e2m1fn, +-6 (its largest magnitude) gives the integer's max / min;
- float32 / float64 subnormals read as zero (XLA's CPU runs with denormals-are-zero and
  flush-to-zero): float32 / float64 -> bool, float32 -> float64, bfloat16 -> float64, and
  float64 -> any narrower float flush magnitudes below float32's smallest normal to a signed
  zero first;
- NaN: into float8_e5m2 from a 16- or 8-bit float it is 0x7f; into float4_e2m1fn (which has
  no NaN) it is 0x8 (-0); from a float8 ``fnuz`` type (whose one NaN has the sign bit set) it
  is a positive NaN; float32 -> float16 and float16 -> wider floats quiet it, keeping the
  sign and the payload's top bits (numpy keeps a signalling NaN signalling).

Everything else (integer wrap, int -> float rounding, float -> float rounding and overflow,
bool) is numpy's / ml_dtypes' already. ``tests/test_astype.py`` compares every source/target
pair of the safetensors dtypes bit for bit with JAX over every bit pattern of the 8- and
16-bit types and edge and random values of the wider ones. float6 types, which JAX lacks,
follow ml_dtypes under the same rules.

Example::

    >>> astype(np.array([300, -1, np.nan, np.inf, 255.5, 1e10], np.float32), np.int8)
    array([ 127,   -1,    0,  127,  127,  127], dtype=int8)
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_C64 = np.dtype(np.complex64)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_F4 = np.dtype(ml_dtypes.float4_e2m1fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_QUIET = {2: 0x0200, 4: 0x0040_0000, 8: 0x0008_0000_0000_0000}  # the quiet bit of a NaN
_FNUZ = frozenset({np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2fnuz)})
_F32_TINY = float(np.finfo(np.float32).tiny)
_CHUNK = 1 << 18  # elements cast per step, so temporaries (float64 and masks) stay small
_TILE = 128  # a strided array is copied in tiles of _TILE x _TILE elements
# Casts numpy's own conversion gets right (no rule of the module docstring applies), done
# while a strided copy moves each tile (``tests/core/test_astype.py`` checks every pair).
_ASSIGNED = frozenset({(_F32, _BF16), (_BF16, _F32)})


def is_float(dt: np.dtype) -> bool:
    """Whether ``dt`` is a real floating-point dtype (numpy's or ml_dtypes')."""
    if dt.kind == "f":
        return True
    try:
        ml_dtypes.finfo(dt)
    except (TypeError, ValueError):
        return False
    return dt.kind != "c"


def astype(x: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """``x`` cast to ``dtype`` as ``jnp.asarray(x).astype(dtype)`` casts on CPU (a new
    C-contiguous array; see the module docstring)."""
    x = np.asarray(x)
    out = np.empty(x.shape, np.dtype(dtype))
    cast_into(out, x)
    return out


def cast_into(out: np.ndarray, x: np.ndarray) -> None:
    """Writes ``x`` cast to ``out.dtype`` into ``out`` (C-contiguous, same shape), a bounded
    number of elements at a time (see :func:`astype`)."""
    x = np.asarray(x)
    if out.shape != x.shape:
        raise ValueError(f"cast of shape {x.shape} into shape {out.shape}")
    if not x.size:
        return
    assigned = x.dtype == out.dtype or (x.dtype, out.dtype) in _ASSIGNED
    if assigned and x.flags.c_contiguous:  # numpy's own cast, in one pass
        with np.errstate(all="ignore"):
            np.copyto(out, x, casting="unsafe")
        return
    step = _cast_fn(x.dtype, out.dtype)
    if x.ndim >= 2 and not x.flags.c_contiguous:
        _cast_strided(out, x, None if assigned else step)
        return
    flat_out = out.reshape(-1)  # a view: out is C-contiguous
    flat_in = x.reshape(-1) if x.flags.c_contiguous else None
    for start in range(0, x.size, _CHUNK):
        stop = min(x.size, start + _CHUNK)
        if flat_in is not None:
            chunk = flat_in[start:stop]
        else:  # a strided view: copy one chunk's worth of elements in C order
            chunk = np.ravel(x)[start:stop] if x.ndim <= 1 else _c_order_slice(x, start, stop)
        flat_out[start:stop] = step(chunk)


def _cast_strided(
    out: np.ndarray, x: np.ndarray, step: Callable[[np.ndarray], np.ndarray] | None
) -> None:
    # A strided view (most often a transpose: a JAX kernel written as a PyTorch weight) is
    # copied in square tiles of its last two axes, each read and written as a cache-sized
    # block: numpy's elementwise copy in C order would read a transposed source one element
    # per cache line, several times slower. Written by hand because this copy is the bulk
    # of an export's CPU time. With a ``step``, bands of rows are copied into a contiguous
    # buffer in the source dtype, then cast whole by it (any cast's rules apply unchanged);
    # without (the same dtype, or a cast in _ASSIGNED), tiles go straight into ``out``.
    rows, cols = x.shape[-2:]
    band = max(1, min(rows, _CHUNK // cols))
    buffer = None if step is None else np.empty((band, cols), x.dtype)
    with np.errstate(all="ignore"):  # (overflow to inf is the cast's answer, not an error)
        for lead in np.ndindex(*x.shape[:-2]):
            src, dst = x[lead], out[lead]
            for r in range(0, rows, band):
                n = min(band, rows - r)
                rows_in = src[r : r + n]
                tiles = dst[r : r + n] if buffer is None else buffer[:n]
                for i in range(0, n, _TILE):
                    for j in range(0, cols, _TILE):
                        tiles[i : i + _TILE, j : j + _TILE] = rows_in[i : i + _TILE, j : j + _TILE]
                if step is not None:  # (the casts take flat chunks)
                    dst[r : r + n] = step(tiles.reshape(-1)).reshape(n, cols)


def _c_order_slice(x: np.ndarray, start: int, stop: int) -> np.ndarray:
    # Elements start..stop of x in C order, without copying all of x.
    idx = np.unravel_index(np.arange(start, stop), x.shape)
    return x[idx]


def _cast_fn(src: np.dtype, dst: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    if src == dst:
        return lambda c: c
    if is_float(src) and dst.kind in "iu":
        return lambda c: _float_to_int(c, dst)
    if is_float(src) and dst == np.bool_:
        if src in (_F32, _F64):
            return lambda c: (c != 0) & ~(np.abs(c) < np.finfo(src).tiny)
        return lambda c: _plain(c, dst)
    if is_float(src) and (is_float(dst) or dst == _C64):
        return lambda c: _float_to_float(c, dst)
    return lambda c: _plain(c, dst)


def _plain(c: np.ndarray, dst: np.dtype) -> np.ndarray:
    # numpy's / ml_dtypes' cast; older ml_dtypes lack some float8 <-> float8 casts, done
    # through float32 then (exact for every type narrower than it, so one rounding).
    with np.errstate(all="ignore"):
        try:
            return c.astype(dst)
        except TypeError:
            return c.astype(_F32 if c.dtype.itemsize < 4 else _F64).astype(dst)


def _float_to_int(c: np.ndarray, dst: np.dtype) -> np.ndarray:
    v = c.astype(_F64)
    info = np.iinfo(dst)
    t = np.trunc(v)
    high = t >= 2.0 ** (info.bits - (1 if info.min < 0 else 0))  # max + 1, exact in float64
    low = t < float(info.min)
    if c.dtype == _F4:  # XLA's bound is the integer's max / min in float4: +-6
        high |= v >= 6.0
        low |= v <= -6.0
    bad = high | low | np.isnan(v)
    out = np.where(bad, 0.0, t).astype(dst)
    out[high] = info.max
    out[low] = info.min
    return out


def _float_to_float(c: np.ndarray, dst: np.dtype) -> np.ndarray:
    src = c.dtype
    if (src == _F64 and dst not in (_F64, _E8M0)) or (src == _F32 and dst == _F64):
        c = _flush(c, src)
    with np.errstate(all="ignore"):
        out = _plain(c, dst) if src != _BF16 or dst != _F64 else _flush(c.astype(_F32), _F32)
    if dst == _E8M0:
        _e8m0_small(c, out)
    nan = np.isnan(c)
    if nan.any():
        _fix_nans(c, out, nan)
    return out


def _e8m0_small(c: np.ndarray, out: np.ndarray) -> None:
    # Into float8_e8m0fnu (positive powers of two) XLA rounds values between 2**-127 and
    # 2**-126 up, and a positive float64 below 2**-127 is NaN.
    with np.errstate(all="ignore"):
        mag = c.astype(_F64)
    codes = out.view(np.uint8)
    codes[(mag > 2.0**-127) & (mag < 2.0**-126)] = 0x1
    if c.dtype == _F64:
        codes[(mag > 0) & (mag < 2.0**-127)] = 0xFF


def _fix_nans(c: np.ndarray, out: np.ndarray, nan: np.ndarray) -> None:
    src, dst = c.dtype, out.dtype
    if dst == _F4:
        out.view(np.uint8)[nan] = 0x8
        return
    if dst == _E5M2 and src.itemsize <= 2:
        out.view(np.uint8)[nan] = 0x7F
        return
    width = 4 if dst == _C64 else dst.itemsize  # a complex's NaN is in its real part
    bits = out.view(f"u{width}").reshape(out.size, -1)[:, 0]
    sign = np.array(1 << (8 * width - 1), bits.dtype)
    if src in _FNUZ and dst not in _FNUZ and dst != _E8M0:
        bits[nan] &= ~sign  # fnuz's one NaN has the sign bit set: XLA gives a positive NaN
    elif src == _F16 and dst in (_F32, _F64, _C64):
        bits[nan] |= np.array(_QUIET[width], bits.dtype)
    elif src == _F32 and dst == _F16:  # quieted, the payload's top 10 bits kept
        raw = c.view(np.uint32)[nan]
        bits[nan] = ((raw >> 16) & 0x8000) | 0x7E00 | ((raw >> 13) & 0x3FF)
    elif src == _F64 and dst == _F16:  # the canonical NaN, with the sign (docs/api.md)
        bits[nan] = (bits[nan] & sign) | np.array(0x7E00, bits.dtype)
    elif src == _BF16 and dst == _F16:  # the payload shifted along, quieted
        raw = c.view(np.uint16)[nan]
        bits[nan] = (raw & 0x8000) | 0x7E00 | ((raw & 0x7F) << 3)


def _flush(c: np.ndarray, src: np.dtype) -> np.ndarray:
    # Magnitudes below float32's smallest normal read as a zero of the same sign.
    tiny = np.abs(c) < _F32_TINY
    if not tiny.any():
        return c
    return np.where(tiny, np.copysign(np.zeros((), src), c), c)
