"""``orbax-safetensors diff``: which tensors two checkpoints of any kind share and how far apart
their values are, read a batch at a time and compared a bounded chunk at a time: bitwise by
default, or within a :class:`Tolerance`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import orbax_source as _orbax_source
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.tools import convert_items as _convert_items
from orbax_safetensors._src.tools.inspection import counted


@dataclasses.dataclass
class DiffReport:
    """How two checkpoints differ, tensor by tensor.

    Attributes:
      only_a, only_b: tensor names present on one side only.
      mismatched: ``(name, a, b)`` where shape or dtype differ (``a``/``b`` read ``F32(4, 3)``),
        with the max abs difference appended when the shapes agree.
      values: ``(name, max_abs_difference)`` for tensors whose values differ (exact for
        integers; 0 when only the bits differ, e.g. ``-0.0`` against ``0.0``).
      differing: by name, how many elements of each tensor in ``values`` differ.
      same: how many tensors are equal.
    """

    only_a: list[str] = dataclasses.field(default_factory=list)
    only_b: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    values: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    differing: dict[str, int] = dataclasses.field(default_factory=dict)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched or self.values)

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [{"name": n, "a": a, "b": b} for n, a, b in self.mismatched],
            "values": [
                {"name": n, "max_abs_diff": d, "differing": self.differing.get(n)}
                for n, d in self.values
            ],
            "same": self.same,
        }

    def _value_line(self, name: str, d: float) -> str:
        line = f"max abs difference {d:.6g}"
        if d == 0:
            line += " (equal values, different bits: -0.0 vs 0.0 or NaN payloads)"
        count = self.differing.get(name)
        if count is None:
            return line
        return f"{line}; {counted(count, 'element')} {'differs' if count == 1 else 'differ'}"

    def format(self) -> str:
        lines = []
        for title, entries in (
            ("only in A", self.only_a),
            ("only in B", self.only_b),
            ("shape or dtype differs", [f"{n}: {a} vs {b}" for n, a, b in self.mismatched]),
            ("values differ", [f"{n}: {self._value_line(n, d)}" for n, d in self.values]),
        ):
            if entries:
                lines += [f"{title} ({len(entries)}):", *(f"  {e}" for e in entries)]
        lines.append(
            f"{counted(self.same, 'tensor')} equal; "
            + ("checkpoints are identical" if self.identical else "checkpoints differ")
        )
        return "\n".join(lines)


class _Renamed:
    """A source under other names: ``original`` maps each name to the source's tensor it reads
    (an Orbax ``nnx.State`` under the names ``convert`` gives; a tied tensor under each of its
    names, as Orbax stores it)."""

    def __init__(self, source: _sources.TensorSource, original: dict[str, str]) -> None:
        self.path, self.kind, self.metadata = source.path, source.kind, source.metadata
        self.source = source
        self.original = original
        self.tensors = {
            n: dataclasses.replace(source.tensors[o], name=n) for n, o in original.items()
        }

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        values = self.source.read(list(dict.fromkeys(self.original[n] for n in names)))
        return {n: values[self.original[n]] for n in names}


def _sources_of(path: epath.PathLike) -> dict[str, _sources.TensorSource]:
    out: dict[str, _sources.TensorSource] = {}
    for item, source in _sources.open_items(path).items():
        original: dict[str, str] = {}
        if isinstance(source, _orbax_source.OrbaxSource):
            names = _convert_items.converted_names(source)
            original = {names[n]: n for n in source.tensors} if names else {}
        elif isinstance(source, _sources.SafetensorsSource) and source.aliases:
            # Each name of a tied tensor compared (its Orbax copy stores one array per name).
            original = {n: n for n in source.tensors} | source.aliases
        out[item] = _Renamed(source, original) if original else source
    return out


def _dtype_shape(t: _sources.TensorInfo) -> str:
    return f"{t.dtype}{list(t.shape)}"


_CHUNK = 1 << 22  # elements compared at a time (bounded memory whatever the tensor size)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """When two values of one tensor count as equal (``diff --atol/--rtol``).

    Without a tolerance values are equal only when their bits are (``-0.0 != 0.0``). With one,
    floats (and complex) are equal when ``|a - b| <= atol + rtol * |b|`` (in float64 /
    complex128), any NaN equals any NaN and an infinity only the same infinity; integers and
    bools when the exact ``|a - b|`` is at most ``atol``.
    """

    atol: float = 0.0
    rtol: float = 0.0
    bitwise: bool = True

    @classmethod
    def of(cls, atol: float | None, rtol: float | None) -> Tolerance:
        for name, value in (("atol", atol), ("rtol", rtol)):
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise SafetensorsCheckpointError(
                    f"{name}={value!r}: a tolerance is a finite number >= 0"
                )
        if atol is None and rtol is None:
            return cls()
        return cls(float(atol or 0.0), float(rtol or 0.0), bitwise=False)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How two same-shaped arrays compare under a tolerance: ``equal``, how many elements
    differ, and the largest ``|a - b|`` (exact for integers; ``inf`` for NaN against a number
    or opposite infinities; 0 when only the bits differ)."""

    equal: bool
    differing: int
    max_abs_difference: float | int


def _is_integer(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer) or dtype == np.bool_


def _int_abs_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b|`` of two integer arrays of one dtype, exact, as unsigned of their width."""
    if a.dtype == np.bool_:
        return (a != b).astype(np.uint8)
    unsigned = np.dtype(f"u{a.dtype.itemsize}")
    with np.errstate(over="ignore"):
        up = (a - b).view(unsigned)  # wraps, but read as unsigned it is exact when a >= b
        down = (b - a).view(unsigned)
    return np.where(a >= b, up, down)


def _float_abs_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ca, cb = _as_float(a), _as_float(b)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(ca - cb)
        d[(ca == cb) | (np.isnan(ca) & np.isnan(cb))] = 0.0
    d[np.isnan(d)] = np.inf
    return d


def compare_arrays(a: np.ndarray, b: np.ndarray, tolerance: Tolerance | None = None) -> Comparison:
    """Compares two arrays of one shape and dtype, a bounded chunk of elements at a time
    (integers exactly: ``2**53`` and ``2**53 + 1`` differ by 1)."""
    tolerance = tolerance or Tolerance()
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"arrays differ in shape or dtype: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
    fa = np.ascontiguousarray(a).reshape(-1)
    fb = np.ascontiguousarray(b).reshape(-1)
    integer = _is_integer(a.dtype)
    differing = 0
    worst: float | int = 0 if integer else 0.0
    for start in range(0, fa.size, _CHUNK):
        ca, cb = fa[start : start + _CHUNK], fb[start : start + _CHUNK]
        bits_differ = _bits_differ(ca, cb)
        if not bits_differ.any():
            continue
        if integer:
            d = _int_abs_difference(ca, cb)
            worst = max(worst, int(d.max()))
        else:
            d = _float_abs_difference(ca, cb)
            worst = max(worst, float(d.max()))
        if tolerance.bitwise:
            differing += int(np.count_nonzero(bits_differ))
        elif integer:
            differing += int(np.count_nonzero(d > math.floor(tolerance.atol)))
        else:
            bound: Any = tolerance.atol
            if tolerance.rtol:
                bound = tolerance.atol + tolerance.rtol * np.abs(_as_float(cb))
            with np.errstate(invalid="ignore"):
                differing += int(np.count_nonzero((d != 0) & ~(d <= bound)))
    return Comparison(differing == 0, differing, worst)


def _bits_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element: whether the bit patterns of ``a`` and ``b`` differ."""
    size = a.dtype.itemsize
    if size in (1, 2, 4, 8):
        unsigned = np.dtype(f"u{size}")
        return a.view(unsigned) != b.view(unsigned)
    rows = (a.size, size)
    return (a.view(np.uint8).reshape(rows) != b.view(np.uint8).reshape(rows)).any(axis=1)


def max_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest ``|a - b|`` (0.0 for equal values, ``-0.0`` and ``0.0`` included, and NaN
    against NaN; ``inf`` for NaN against a number or opposite infinities): integers of one
    dtype exactly, other dtypes through float64."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.dtype == b.dtype and _is_integer(a.dtype):
        return compare_arrays(a, b).max_abs_difference
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, fa.size, _CHUNK):
        d = _float_abs_difference(fa[start : start + _CHUNK], fb[start : start + _CHUNK])
        if d.size:
            worst = max(worst, float(d.max()))
    return worst


def _as_float(x: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(x):
        return x.astype(np.complex128)
    return x.astype(np.float64)


def diff_paths(
    a: epath.PathLike,
    b: epath.PathLike,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    batch_bytes: int = 128 << 20,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
) -> DiffReport:
    """Compares two checkpoints (files, items or steps: item by item, names ``item/name``, or
    by tensor names when each side has one item), a batch at a time, bitwise or within
    :class:`Tolerance`; an Orbax ``nnx.State`` under the names ``convert`` gives it.
    ``include`` / ``exclude`` as in ``osf.load_file`` (TargetMismatchError if one matches
    nothing on either side)."""
    tolerance = Tolerance.of(atol, rtol)
    select = _select.Selection.of(include, exclude)
    sa, sb = _sources_of(a), _sources_of(b)
    if select is not None:
        everywhere = [n for s in (*sa.values(), *sb.values()) for n in s.tensors]
        select.check(dict.fromkeys(everywhere), f"{a} or {b}")

    def tensors(source: _sources.TensorSource) -> dict[str, _sources.TensorInfo]:
        if select is None:
            return source.tensors
        return {n: t for n, t in source.tensors.items() if select.selects(n)}

    if len(sa) == 1 and len(sb) == 1:  # one item each (of any names): compared by tensor names
        sa, sb = {"": next(iter(sa.values()))}, {"": next(iter(sb.values()))}
    report = DiffReport()
    for item in [i for i in sa if i not in sb]:
        report.only_a += [f"{item}/{t}" for t in tensors(sa[item])]
    for item in [i for i in sb if i not in sa]:
        report.only_b += [f"{item}/{t}" for t in tensors(sb[item])]
    for item in [i for i in sa if i in sb]:
        prefix, x, y = f"{item}/" if item else "", sa[item], sb[item]
        tx, ty = tensors(x), tensors(y)
        report.only_a += [prefix + n for n in tx if n not in ty]
        report.only_b += [prefix + n for n in ty if n not in tx]
        common = [tx[n] for n in tx if n in ty]
        comparable = []
        for t in common:
            u = ty[t.name]
            if t.shape != u.shape:
                report.mismatched.append((prefix + t.name, _dtype_shape(t), _dtype_shape(u)))
            else:
                comparable.append(t)
        for group in _plan.batched(comparable, lambda t: t.nbytes, batch_bytes):
            names = [t.name for t in group]
            va, vb = x.read(names), y.read(names)
            for t in group:
                u = ty[t.name]
                if t.dtype != u.dtype:
                    d = max_abs_difference(va[t.name], vb[t.name])
                    report.mismatched.append(
                        (
                            prefix + t.name,
                            _dtype_shape(t),
                            f"{_dtype_shape(u)} (max abs difference {d:.6g})",
                        )
                    )
                    continue
                result = compare_arrays(va[t.name], vb[t.name], tolerance)
                if result.equal:
                    report.same += 1
                else:
                    report.values.append((prefix + t.name, result.max_abs_difference))
                    report.differing[prefix + t.name] = result.differing
            del va, vb
    return report
