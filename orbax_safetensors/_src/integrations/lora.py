"""LoRA adapters merged into their kernels on export: which tensors are adapters of which
kernel (flax's ``nnx.LoRALinear`` and ``nnx.LoRA(base_module=...)``, qwix's ``W_lora_a`` /
``W_lora_b`` next to ``W``), how their shapes lie against it (:func:`layout`), and the merge
``kernel + a @ b * scale`` in the kernel's dtype, of the whole kernel or of one block of a
sharded one, bit-identical (:func:`merge_lora`, :func:`merge_lora_block`).

Example::

    found = plan({"q.w": (8, 2, 4), "q.w_lora_a": (8, 3), "q.w_lora_b": (3, 2, 4)},
                 KeyMapping([], lora_scale=2.0), MappingReport())
    found.merges          # {"q.w": ("q.w_lora_a", "q.w_lora_b")}
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport

Shape = tuple[int, ...]

_ADAPTER_NAME = re.compile(r"(?:^|.*[._])lora_[ab]")
_QWIX_A, _QWIX_B = "_lora_a", "_lora_b"


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is named like a LoRA adapter (``lora_a``/``lora_b`` last, after a
    dot or an underscore)."""
    return _ADAPTER_NAME.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class Pair:
    """One kernel's adapters: ``a`` and ``b`` by name; ``qwix``: named by qwix (scaled on
    the forward pass by ``alpha / rank``, which the export must be given)."""

    kernel: str
    a: str
    b: str
    qwix: bool = False


def find_pairs(names: Iterable[str]) -> list[Pair]:
    """The adapter pairs among ``names``, each next to its kernel (see the module
    docstring), in name order."""
    present = set(names)
    out = []
    for a in sorted(present):
        if a.endswith(_QWIX_A):
            weight = a[: -len(_QWIX_A)]
            if weight in present and weight + _QWIX_B in present:
                out.append(Pair(weight, a, weight + _QWIX_B, qwix=True))
                continue
        if not (a == "lora_a" or a.endswith(".lora_a")):
            continue
        stem = a[: -len("lora_a")]
        b = stem + "lora_b"
        if b not in present:
            continue
        kernels = [stem[: -len("lora.")] + "kernel"] if stem.endswith("lora.") else []
        kernels += [stem + "base_module.kernel", stem + "base_module.w"]
        kernel = next((k for k in kernels if k in present), None)
        if kernel is not None:
            out.append(Pair(kernel, a, b))
    return out


# --------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """How adapters lie against a kernel of ``shape``: its first ``shared`` axes are served
    alike, the next ``lead`` are the adapters' own leading axes; of the rest, the axes
    ``rows_at`` are the rows (``lora_a``'s) and the others, in order, the columns
    (``lora_b``'s)."""

    shape: Shape
    shared: int
    lead: int
    rows_at: tuple[int, ...]

    @property
    def cols_at(self) -> tuple[int, ...]:
        start = self.shared + self.lead
        return tuple(i for i in range(start, len(self.shape)) if i not in self.rows_at)

    @property
    def rows(self) -> Shape:
        return tuple(self.shape[i] for i in self.rows_at)

    @property
    def cols(self) -> Shape:
        return tuple(self.shape[i] for i in self.cols_at)

    @property
    def order(self) -> tuple[int, ...]:
        """The kernel's axes with the rows before the columns (a transpose; the identity
        where they already are)."""
        return (*range(self.shared + self.lead), *self.rows_at, *self.cols_at)


def _holds(kernel_axes: Shape, adapter_axes: Shape) -> bool:
    # the adapter's axes are the kernel's, or their product in one axis
    return tuple(adapter_axes) == tuple(kernel_axes) or (
        len(adapter_axes) == 1 and adapter_axes[0] == math.prod(kernel_axes)
    )


# Row axes may interleave with the columns (qwix's adapters of an einsum whose contracted
# axis is not the kernel's first) in kernels of at most this many axes; past it, only rows
# then columns are tried (the splits to try grow as 2 ** axes).
_INTERLEAVED_AXES = 8


def _row_sets(n: int) -> Iterable[tuple[int, ...]]:
    if n > _INTERLEAVED_AXES:
        return (tuple(range(k)) for k in range(1, n))
    return (s for k in range(1, n) for s in itertools.combinations(range(n), k))


def layout(kernel: Sequence[int], a: Sequence[int], b: Sequence[int]) -> Layout:
    """The :class:`Layout` of adapters of shapes ``a`` and ``b`` against a kernel of shape
    ``kernel``.

    Raises:
      ValueError: when they fit no layout, or fit two that compute differently.

    Example::

        layout((32, 4, 8), (32, 2), (2, 4, 8))     # rows (32,), columns (4, 8)
        layout((4, 8, 32), (4, 8, 2), (2, 32))     # rows (4, 8), columns (32,)
        layout((4, 32, 8), (32, 2), (2, 4, 8))     # rows (32,), columns (4, 8): Gemma's query
    """
    kernel, a, b = tuple(map(int, kernel)), tuple(map(int, a)), tuple(map(int, b))
    # rows then columns (every flax layout, qwix's linear ones) before rows among the columns
    tiers: tuple[dict[tuple[int, ...], Layout], ...] = ({}, {})
    for lead in range(min(len(a), len(b)) - 1):
        if a[:lead] != b[:lead] or a[-1] != b[lead]:
            continue
        a_rows, b_cols = a[lead:-1], b[lead + 1 :]
        for shared in range(len(kernel) - lead - 1):
            if kernel[shared : shared + lead] != a[:lead]:
                continue
            start = shared + lead
            for rows in _row_sets(len(kernel) - start):
                lay = Layout(kernel, shared, lead, tuple(start + i for i in rows))
                if _holds(lay.rows, a_rows) and _holds(lay.cols, b_cols):
                    # (fits whose rows differ only by axes of size 1 compute alike)
                    key = (shared, lead, *(i for i in lay.rows_at if kernel[i] != 1))
                    tiers[rows != tuple(range(len(rows)))].setdefault(key, lay)
    fits = tiers[0] or tiers[1]
    if len(fits) == 1:
        return next(iter(fits.values()))
    what = f"LoRA adapters {list(a)} and {list(b)} against the kernel {list(kernel)}"
    if not fits:
        raise ValueError(
            f"{what}: no layout fits (lora_a (*lead, *rows, rank), lora_b (*lead, rank, "
            "*cols), the kernel (*lead, rows and cols in any order, each in its adapter's))"
        )
    raise ValueError(f"{what}: several layouts fit ({sorted(fits)}), the merge is ambiguous")


# --------------------------------------------------------------------------- merges


def _merge_rows_cols(kernel: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    # kernel (..., m, n) + a (..., m, r) @ b (..., r, n) * scale, the rank terms summed
    # elementwise in rank order (see merge_lora).
    work = np.result_type(kernel.dtype, np.float32) if kernel.dtype.kind == "f" else np.float32
    a, b = a.astype(work, copy=False), b.astype(work, copy=False)
    delta = a[..., :, 0:1] * b[..., 0:1, :]
    term = np.empty_like(delta)
    for k in range(1, int(a.shape[-1])):
        np.multiply(a[..., :, k : k + 1], b[..., k : k + 1, :], out=term)
        delta += term
    del term
    delta *= np.asarray(scale, work)
    return (kernel.astype(work) + delta).astype(kernel.dtype)


def merge_lora(kernel: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """``kernel + a @ b * scale`` in the kernel's dtype (computed in at least float32), the
    adapters laid against the kernel as :func:`layout` finds.

    The rank terms of ``a @ b`` are summed elementwise, in rank order (no BLAS call, whose
    reduction order depends on the matrix sizes): every element is the same arithmetic
    whatever block of the kernel is merged, so :func:`merge_lora_block` of any shard is
    bit-identical to the same block of the whole merge.

    Raises:
      ValueError: adapters that do not fit the kernel (see :func:`layout`).

    Example::

        merge_lora(np.zeros((4, 3)), np.ones((4, 2)), np.ones((2, 3)), 0.5)  # all 1.0
        merge_lora(np.zeros((8, 2, 4)), np.ones((8, 3)), np.ones((3, 2, 4)), 2.0)  # qwix
    """
    whole = tuple(slice(0, int(n)) for n in kernel.shape)
    return merge_lora_block(kernel, whole, a, b, scale, kernel.shape)


def merge_lora_block(
    block: np.ndarray,
    box: Sequence[slice],
    a: np.ndarray,
    b: np.ndarray,
    scale: float,
    kernel_shape: Sequence[int],
) -> np.ndarray:
    """:func:`merge_lora` of the block ``box`` of a kernel of ``kernel_shape`` (its values
    ``block``), from the whole adapters ``a`` and ``b`` (small: rank columns / rows):
    bit-identical to ``merge_lora(kernel, a, b, scale)[box]``.

    Raises:
      ValueError: adapters that do not fit the kernel (see :func:`layout`).

    Example::

        merge_lora_block(kernel[2:4], (slice(2, 4), slice(0, 3)), a, b, 0.5, kernel.shape)
    """
    lay = layout(kernel_shape, a.shape, b.shape)
    order = lay.order  # (the rows before the columns: merged so, then put back)
    block, box = block.transpose(order), tuple(tuple(box)[i] for i in order)
    start, split = lay.shared + lay.lead, len(lay.rows_at)
    lead_box = box[lay.shared : start]
    row_box, col_box = box[start : start + split], box[start + split :]
    r = int(a.shape[-1])
    # the rows of a and the columns of b the block needs, each side's axes as the kernel's
    rows = a.reshape(*a.shape[: lay.lead], *lay.rows, r)[(*lead_box, *row_box, slice(None))]
    cols = b.reshape(*b.shape[: lay.lead], r, *lay.cols)[(*lead_box, slice(None), *col_box)]
    m = math.prod(block.shape[start : start + split])
    n = math.prod(block.shape[start + split :])
    merged = _merge_rows_cols(
        block.reshape(*block.shape[:start], m, n),
        rows.reshape(*rows.shape[: lay.lead], m, r),
        cols.reshape(*cols.shape[: lay.lead], r, n),
        scale,
    )
    merged = merged.reshape(block.shape).transpose(np.argsort(order))
    return np.ascontiguousarray(merged)


# --------------------------------------------------------------------------- an export's plan


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """The LoRA merges of an export.

    Attributes:
      merges: ``{kernel: (lora_a, lora_b)}``: each kernel is written merged.
      scale: the scale of every merge.
      skip: names not exported on their own: the merged adapters, and adapters (with their
        kernel) the export refused.
      renamed: ``{name: the name the mapping sees}``: a module ``nnx.LoRA`` wraps exports
        as that module (``P.base_module.kernel`` as ``P.kernel``).
    """

    merges: Mapping[str, tuple[str, str]]
    scale: float
    skip: frozenset[str]
    renamed: Mapping[str, str]


def plan(
    shapes: Mapping[str, Shape],
    mapping: KeyMapping,
    report: MappingReport,
    lora_params: Collection[str] = (),
) -> LoraPlan:
    """The merges of the adapters among the Flax tensors of ``shapes`` (by name) through
    ``mapping``. Merged adapters go to ``report.merged``; adapters ``ignore_flax`` would drop
    (those found here, any name like an adapter's, and ``lora_params``: the names of a
    model's ``nnx.LoRAParam`` variables) to ``report.refused``, and adapters that fit no
    layout to ``report.mismatched`` (neither is merged, nor their kernel exported).

    Raises:
      ValueError: qwix adapters without ``mapping.lora_scale`` (their ``alpha / rank``).
    """
    pairs = find_pairs(shapes)
    merges: dict[str, tuple[str, str]] = {}
    skip: set[str] = set()
    qwix = []
    for pair in pairs:
        skip.update((pair.a, pair.b))
        dropped = [n for n in (pair.a, pair.b) if mapping.flax_ignored(n)]
        if dropped:
            report.refused += [
                f"{n}: ignore_flax leaves out this adapter of {pair.kernel} (it is merged "
                "into its kernel on export; to export the base model, leave the adapters out "
                "of the source)"
                for n in dropped
            ]
            skip.add(pair.kernel)
            continue
        try:
            layout(shapes[pair.kernel], shapes[pair.a], shapes[pair.b])
        except ValueError as e:
            report.mismatched.append(f"{pair.kernel} with {pair.a} and {pair.b}: {e}")
            skip.add(pair.kernel)
            continue
        merges[pair.kernel] = (pair.a, pair.b)
        report.merged += [(pair.a, pair.kernel), (pair.b, pair.kernel)]
        if pair.qwix:
            qwix.append(pair.kernel)
    paired = {n for p in pairs for n in (p.a, p.b)}
    report.refused += [
        f"{n}: ignore_flax leaves out this LoRA adapter, which no kernel takes"
        for n in sorted(set(lora_params) | {n for n in shapes if is_adapter_name(n)})
        if n in shapes and n not in paired and mapping.flax_ignored(n)
    ]
    if qwix and mapping.lora_scale is None:
        more = f" and {len(qwix) - 1} more kernels" if len(qwix) > 1 else ""
        raise ValueError(
            f"the qwix LoRA adapters of {qwix[0]}{more} are scaled by alpha / rank on the "
            "forward pass, which their tensors do not record: give it as lora_scale "
            "(KeyMapping(..., lora_scale=), preset_mapping(..., lora_scale=), "
            "orbax-safetensors export --lora-scale; LoraProvider(rank=4, alpha=8): 2.0)"
        )
    scale = 1.0 if mapping.lora_scale is None else float(mapping.lora_scale)
    return LoraPlan(merges, scale, frozenset(skip), _renamed(shapes, pairs, merges))


def _renamed(
    shapes: Mapping[str, Shape], pairs: Sequence[Pair], merges: Mapping[str, tuple[str, str]]
) -> dict[str, str]:
    # S.base_module.X -> S.X for each nnx.LoRA wrapper S merged (its kernel under base_module)
    stems = set()
    for p in pairs:
        stem = p.a[: -len("lora_a")]
        if p.kernel in merges and p.kernel.startswith(stem + "base_module."):
            stems.add(stem)
    out = {}
    for name in shapes:
        wrapper = next((s for s in stems if name.startswith(s + "base_module.")), None)
        if wrapper is not None:
            out[name] = wrapper + name[len(wrapper + "base_module.") :]
    return out
