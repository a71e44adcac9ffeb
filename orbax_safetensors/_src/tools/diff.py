"""``orbax-safetensors diff``: which tensors two checkpoints (of any kind) share, and how far
apart their values are, compared a batch at a time.

Example::

    report = diff_paths("/ckpt/100/state", "model.safetensors")
    report.identical                        # True when names, dtypes, shapes and bytes agree
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.orbax import steps as _steps


@dataclasses.dataclass
class DiffReport:
    """How two checkpoints differ, tensor by tensor.

    Attributes:
      only_a, only_b: tensor names present on one side only.
      mismatched: ``(name, a, b)`` where shape or dtype differ (``a``/``b`` read ``F32(4, 3)``),
        with the max abs difference appended when the shapes agree.
      values: ``(name, max_abs_difference)`` for tensors whose values differ.
      same: how many tensors are equal.
    """

    only_a: list[str] = dataclasses.field(default_factory=list)
    only_b: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    values: list[tuple[str, float]] = dataclasses.field(default_factory=list)
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
            "values": [{"name": n, "max_abs_diff": d} for n, d in self.values],
            "same": self.same,
        }

    def format(self) -> str:
        lines = []
        if self.only_a:
            lines.append(f"only in A ({len(self.only_a)}):")
            lines += [f"  {n}" for n in self.only_a]
        if self.only_b:
            lines.append(f"only in B ({len(self.only_b)}):")
            lines += [f"  {n}" for n in self.only_b]
        if self.mismatched:
            lines.append(f"shape or dtype differs ({len(self.mismatched)}):")
            lines += [f"  {n}: {a} vs {b}" for n, a, b in self.mismatched]
        if self.values:
            lines.append(f"values differ ({len(self.values)}):")
            lines += [f"  {n}: max abs difference {d:.6g}" for n, d in self.values]
        lines.append(
            f"{self.same} tensor(s) equal; "
            + ("checkpoints are identical" if self.identical else "checkpoints differ")
        )
        return "\n".join(lines)


def _sources_of(path: epath.Path) -> dict[str, _sources.TensorSource]:
    kind = _steps.classify(path)
    if kind == "step":
        items = [n for n, k in _steps.list_items(path).items() if k in _steps.TENSOR_KINDS]
        return {n: _sources.open_source(path / n) for n in items}
    return {"": _sources.open_source(path)}


def _dtype_shape(t: _sources.TensorInfo) -> str:
    return f"{t.dtype}{list(t.shape)}"


_CHUNK = 1 << 22


def max_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest ``|a - b|`` (0.0 for bitwise-equal arrays; NaN equals NaN; a NaN against a
    number, or infinities of opposite sign, give ``inf``)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.dtype == b.dtype:
        ra = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        rb = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        if np.array_equal(ra, rb):
            return 0.0
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, fa.size, _CHUNK):
        ca = _as_float(fa[start : start + _CHUNK])
        cb = _as_float(fb[start : start + _CHUNK])
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(ca - cb)
            d[(ca == cb) | (np.isnan(ca) & np.isnan(cb))] = 0.0
        d[np.isnan(d)] = np.inf
        if d.size:
            worst = max(worst, float(d.max()))
    return worst


def _as_float(x: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(x):
        return x.astype(np.complex128)
    if x.dtype == np.bool_:
        return x.astype(np.float64)
    return x.astype(np.float64)


def diff_paths(
    a: epath.PathLike,
    b: epath.PathLike,
    *,
    atol: float = 0.0,
    batch_bytes: int = 128 << 20,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
) -> DiffReport:
    """Compares the tensors of two checkpoints (files, items, Orbax items or steps).

    Steps are compared item by item (names read ``item/name``); a step with a single tensor
    item compares with a single item or file. Values are read a batch at a time.
    ``include`` / ``exclude`` (globs over dotted names, as in ``osf.load_file``) limit the
    comparison to the tensors they select (in every item); only those are read. A pattern
    that matches no tensor on either side raises ``TargetMismatchError``.

    Example::

        report = diff_paths("run1/100/state", "run2/100/state")
        report.identical, report.values    # (False, [("params.w", 0.5)])
    """
    select = _select.Selection.of(include, exclude)
    sa, sb = _sources_of(epath.Path(a)), _sources_of(epath.Path(b))
    if select is not None:
        everywhere = [n for s in (*sa.values(), *sb.values()) for n in s.tensors]
        select.check(dict.fromkeys(everywhere), f"{a} or {b}")

    def tensors(source: _sources.TensorSource) -> dict[str, _sources.TensorInfo]:
        if select is None:
            return source.tensors
        return {n: t for n, t in source.tensors.items() if select.selects(n)}

    if len(sa) == 1 and len(sb) == 1:
        pairs = [("", next(iter(sa.values())), next(iter(sb.values())))]
        only_items_a: list[str] = []
        only_items_b: list[str] = []
    else:
        pairs = [(f"{n}/", sa[n], sb[n]) for n in sa if n in sb]
        only_items_a = [n for n in sa if n not in sb]
        only_items_b = [n for n in sb if n not in sa]
    report = DiffReport()
    for n in only_items_a:
        report.only_a += [f"{n}/{t}" for t in tensors(sa[n])]
    for n in only_items_b:
        report.only_b += [f"{n}/{t}" for t in tensors(sb[n])]
    for prefix, x, y in pairs:
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
        for group in _sources.batches(comparable, max_bytes=batch_bytes):
            names = [t.name for t in group]
            va, vb = x.read(names), y.read(names)
            for t in group:
                u = ty[t.name]
                d = max_abs_difference(va[t.name], vb[t.name])
                if t.dtype != u.dtype:
                    report.mismatched.append(
                        (
                            prefix + t.name,
                            _dtype_shape(t),
                            f"{_dtype_shape(u)} (max abs difference {d:.6g})",
                        )
                    )
                elif d > atol:
                    report.values.append((prefix + t.name, d))
                else:
                    report.same += 1
            del va, vb
    return report
