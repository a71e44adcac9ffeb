"""Property: any stacked layout round-trips Hugging Face -> JAX -> Hugging Face bit for bit
(issue 42 point 1).

A random layout draws a per-slice transform (none, a transpose of 2-3 axes, ``nn.Linear`` to
a head-split kernel on either axis), one or two stacking placeholders (each 1-3 long, on
either side of the rule, on any axis of the stacked tensor, negative axes too), and maybe a
fused placeholder (2-3 parts of unequal sizes, on either side, along any axis where parts can
differ), plus a plain placeholder that makes one or two links. Each example:

- writes the Hugging Face tensors of random values to a real file;
- loads them with ``load_pytorch(None, ...)`` (the target derived from the headers) and checks
  every JAX tensor against an independent, element-by-element reconstruction;
- exports the tree and checks every tensor of the export is the original, byte for byte;
- maps the JAX tensors shard by shard over a random grid of boxes (``links.shard_boxes``,
  what a multi-process export writes) and checks the pieces tile each PyTorch tensor exactly,
  and computes each PyTorch tensor with ``jax.numpy`` under ``jit`` (the devices' re-layout).
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from campaign import campaign
from hypothesis import given
from hypothesis import strategies as st

import orbax_safetensors as osf
from orbax_safetensors._src.integrations import links

pytestmark = pytest.mark.timeout(600)

DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.int8)]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A per-slice transform and how its slices' shapes read on each side: ``dims`` names
    the sizes, ``flax``/``torch`` give each side's shape from them, ``free`` the dims a
    fused part may differ in, with their axis on the Flax side and on the PyTorch side."""

    transform: Any
    dims: int
    flax: Any
    torch: Any
    free: dict[int, tuple[int, int]]


HEAD_DIM = 2


def _kinds() -> dict[str, Kind]:
    t = osf.Transpose()
    heads_out = osf.Chain(t, osf.SplitHeads(head_dim=HEAD_DIM))
    heads_in = osf.Chain(t, osf.SplitHeads(head_dim=HEAD_DIM, axis=0))
    return {
        "none1": Kind(None, 1, lambda a: a, lambda a: a, {0: (0, 0)}),
        "none2": Kind(None, 2, lambda a: a, lambda a: a, {0: (0, 0), 1: (1, 1)}),
        "transpose2": Kind(t, 2, lambda a: a, lambda a: a[::-1], {0: (0, 1), 1: (1, 0)}),
        "transpose3": Kind(t, 3, lambda a: a, lambda a: a[::-1], {0: (0, 2), 1: (1, 1), 2: (2, 0)}),
        # nn.Linear (heads * dim, in) -> kernel (in, heads, dim)
        "heads_out": Kind(
            heads_out,
            2,
            lambda a: (a[0], a[1], HEAD_DIM),
            lambda a: (a[1] * HEAD_DIM, a[0]),
            {0: (0, 1), 1: (1, 0)},
        ),
        # nn.Linear (out, heads * dim) -> kernel (heads, dim, out)
        "heads_in": Kind(
            heads_in,
            2,
            lambda a: (a[0], HEAD_DIM, a[1]),
            lambda a: (a[1], a[0] * HEAD_DIM),
            {0: (0, 1), 1: (2, 0)},
        ),
    }


KINDS = _kinds()


@dataclasses.dataclass
class Layout:
    kind: Kind
    dims: list[int]  # the slices' sizes (dims of the kind)
    stacks: list[tuple[str, int, str, int]]  # (name, count, side holding it, axis as given)
    fused: tuple[str, int, list[int], bool] | None  # (side with parts, free dim, sizes, give)
    groups: int  # values of the plain placeholder {j}
    dtype: np.dtype
    seed: int

    def holds(self, side: str) -> list[str]:
        """The placeholders in ``side``'s pattern only (the other side gathers them)."""
        names = [n for n, _, s, _ in self.stacks if s == side]
        return names + (["p"] if self.fused and self.fused[0] == side else [])

    def rule(self) -> osf.Rule:
        def pattern(root: str, side: str) -> str:
            holes = [f"{{{n}}}" if n != "p" else self._parts_hole() for n in self.holds(side)]
            return ".".join([root, "{j}", *holes, "w"])

        fused: dict[str, Any] = {}
        if self.fused is not None:
            joined = "flax" if self.fused[0] == "torch" else "torch"
            axis = self.fused_axis(joined)
            ndim = len(self.slot_shape(joined, 0))
            fused = {"fused": "p", "axis": axis - ndim if self.seed % 2 else axis}
            if self.fused[3]:
                parts = range(len(self.fused[2]))
                fused["sizes"] = tuple(self.slot_shape(joined, k)[axis] for k in parts)
        return osf.Rule(
            pattern("t", "torch"),
            pattern("f", "flax"),
            self.kind.transform,
            stacked=tuple((n, axis) for n, _, _, axis in self.stacks) or None,
            **fused,
        )

    def _parts_hole(self) -> str:
        assert self.fused is not None
        return "{p:" + "|".join(f"part{k}" for k in range(len(self.fused[2]))) + "}"

    def fused_axis(self, side: str) -> int:
        """The axis of a slot of ``side`` that the fused parts differ in."""
        assert self.fused is not None
        return self.kind.free[self.fused[1]][0 if side == "flax" else 1]

    def slot_shape(self, side: str, part: int) -> tuple[int, ...]:
        """One slot (one part) of ``side``."""
        dims = list(self.dims)
        if self.fused is not None:
            dims[self.fused[1]] = self.fused[2][part]
        return tuple((self.kind.flax if side == "flax" else self.kind.torch)(dims))


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    kind = KINDS[draw(st.sampled_from(sorted(KINDS)))]
    dims = [draw(st.integers(1, 3)) for _ in range(kind.dims)]
    fused = None
    if draw(st.booleans()):
        free = draw(st.sampled_from(sorted(kind.free)))
        sizes = draw(st.lists(st.integers(1, 3), min_size=2, max_size=3))
        give = len(set(sizes)) > 1 or draw(st.booleans())
        fused = (draw(st.sampled_from(["torch", "flax"])), free, sizes, give)
    names = draw(st.sampled_from([["i"], ["i", "e"], ["e", "i"]]))
    sides = {n: draw(st.sampled_from(["torch", "flax"])) for n in names}
    layout = Layout(kind, dims, [], fused, draw(st.integers(1, 2)), draw(st.sampled_from(DTYPES)),
                    draw(st.integers(0, 2**31)))  # fmt: skip
    for side in ("torch", "flax"):  # the axes of the tensor of the *other* side
        mine = [n for n in names if sides[n] == side]
        other = "flax" if side == "torch" else "torch"
        ndim = len(layout.slot_shape(other, 0)) + len(mine)
        axes = draw(st.permutations(range(ndim)))[: len(mine)]
        for n, a in zip(mine, axes):
            given_axis = a - ndim if draw(st.booleans()) else a
            layout.stacks.append((n, draw(st.integers(1, 3)), side, given_axis))
    return layout


def _whole(layout: Layout, side: str, part: int | None) -> tuple[tuple[int, ...], dict]:
    """The shape of a tensor of ``side`` (its part ``part`` if that side has the parts) and
    where its gathered stacks sit: ``{name: axis}``."""
    other = "flax" if side == "torch" else "torch"
    gathered = [(n, c, a) for n, c, s, a in layout.stacks if s == other]
    fused = layout.fused
    if fused is not None and fused[0] == other:  # this side joins the parts
        parts = [layout.slot_shape(side, k) for k in range(len(fused[2]))]
        ax = layout.fused_axis(side)
        slot = list(parts[0])
        slot[ax] = sum(p[ax] for p in parts)
    else:
        slot = list(layout.slot_shape(side, part or 0))
    ndim = len(slot) + len(gathered)
    where = {n: a % ndim for n, _, a in gathered}
    counts = {where[n]: c for n, c, _ in gathered}
    rest = iter(slot)
    return tuple(counts[d] if d in counts else next(rest) for d in range(ndim)), where


def _assignments(layout: Layout, side: str) -> list[dict[str, int]]:
    """Every combination of the placeholders of ``side``'s pattern only."""
    names = layout.holds(side)
    ranges = [
        range(len(layout.fused[2])) if n == "p" and layout.fused else
        range(next(c for m, c, _, _ in layout.stacks if m == n))
        for n in names
    ]  # fmt: skip
    return [dict(zip(names, v)) for v in itertools.product(*ranges)]


def _name(root: str, j: int, values: dict[str, int]) -> str:
    return ".".join([root, str(j), *(f"part{v}" if n == "p" else str(v) for n, v in values.items()), "w"])  # fmt: skip


def _slot_index(layout: Layout, side: str, shape: tuple[int, ...], where: dict, values: dict):
    """The index in a tensor of ``side`` of the slot the other side's ``values`` name."""
    index: list[Any] = [slice(None)] * len(shape)
    for n, a in where.items():
        index[a] = values[n]
    fused = layout.fused
    other = "flax" if side == "torch" else "torch"
    if fused is not None and fused[0] == other:
        rest = [d for d in range(len(shape)) if d not in where.values()]
        widths = [layout.slot_shape(side, k) for k in range(len(fused[2]))]
        ax = layout.fused_axis(side)
        lo = sum(w[ax] for w in widths[: values["p"]])
        index[rest[ax]] = slice(lo, lo + widths[values["p"]][ax])
    return tuple(index)


def _expected_flax(layout: Layout, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each Flax tensor built slot by slot from the PyTorch tensors, independently of the
    library's arithmetic."""
    rule = layout.rule()
    transform = rule.transform_or_identity
    out = {}
    for j in range(layout.groups):
        for mine in _assignments(layout, "flax"):
            shape, where = _whole(layout, "flax", mine.get("p"))
            value = np.zeros(shape, layout.dtype)
            for theirs in _assignments(layout, "torch"):
                tshape, twhere = _whole(layout, "torch", theirs.get("p"))
                t = hf[_name("t", j, theirs)]
                assert t.shape == tshape
                piece = t[_slot_index(layout, "torch", tshape, twhere, mine)]
                value[_slot_index(layout, "flax", shape, where, theirs)] = transform.to_flax(piece)
            out[_name("f", j, mine)] = value
    return out


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def _hf_tensors(layout: Layout) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(layout.seed)
    out = {}
    for j in range(layout.groups):
        for theirs in _assignments(layout, "torch"):
            shape, _ = _whole(layout, "torch", theirs.get("p"))
            bits = rng.integers(0, 256, size=(*shape, layout.dtype.itemsize), dtype=np.uint8)
            value = bits.view(layout.dtype).reshape(shape)
            if layout.dtype != np.int8:  # finite floats (XLA may quiet a NaN's payload)
                value = rng.standard_normal(shape).astype(layout.dtype)
            out[_name("t", j, theirs)] = value
    return out


@campaign(weight=1.0)
@given(layout=layouts())
def test_any_stacked_layout_round_trips_through_files_bit_for_bit(layout: Layout) -> None:
    mapping = osf.KeyMapping([layout.rule()])
    hf = _hf_tensors(layout)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "hf"), Path(tmp, "out")
        src.mkdir()
        safetensors.numpy.save_file(hf, str(src / "model.safetensors"))
        tree = osf.load_pytorch(None, src, mapping)
        got = {k: np.asarray(v) for k, v in _flat(tree).items()}
        want = _expected_flax(layout, hf)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            assert got[name].tobytes() == value.tobytes(), name
        assert osf.export_pytorch(tree, out, mapping).ok
        back = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert back[key].dtype == value.dtype and back[key].tobytes() == value.tobytes(), key


def _grid(shape: tuple[int, ...], rng: np.random.Generator) -> list[tuple[slice, ...]]:
    per_axis = []
    for size in shape:
        cuts = sorted({0, size, *rng.integers(0, size + 1, 2).tolist()})
        per_axis.append([slice(a, b) for a, b in itertools.pairwise(cuts) if a < b])
    return list(itertools.product(*per_axis))


@campaign(weight=1.0)
@given(layout=layouts())
def test_shards_mapped_alone_tile_the_export_and_the_devices_agree(layout: Layout) -> None:
    hf = _hf_tensors(layout)
    flax = _expected_flax(layout, hf)
    found, report = links.find_links(
        osf.KeyMapping([layout.rule()]), {k: v.shape for k, v in flax.items()}, flax_side=True
    )
    assert report.ok, report.problems()
    rng = np.random.default_rng(layout.seed)
    for link in found:
        arrays = [flax[n] for n in link.flax]
        shapes = [a.shape for a in arrays]
        want = link.values(arrays, to_torch=True)
        on_devices = jax.jit(
            lambda xs, link=link: [links.device_value(link, xs, j) for j in range(len(link.torch))]
        )
        for j, (key, device) in enumerate(zip(link.torch, on_devices(arrays))):
            assert want[j].tobytes() == hf[key].tobytes(), key
            assert np.asarray(device).tobytes() == hf[key].tobytes(), key
        back = jax.jit(lambda ts, link=link: link.values(ts, to_torch=False, xp=jnp))(
            [hf[k] for k in link.torch]
        )
        for name, value in zip(link.flax, back):
            assert np.asarray(value).tobytes() == flax[name].tobytes(), name
        if not links.commutes(link, shapes):
            continue
        seen = [np.zeros(w.shape, np.int8) for w in want]
        got = [np.zeros_like(w) for w in want]
        for k, x in enumerate(arrays):
            for box in _grid(x.shape, rng):
                for j, tbox, values in links.shard_boxes(link, k, box, x[box], shapes):
                    seen[j][tbox] += 1
                    got[j][tbox] = values
        for j, w in enumerate(want):
            assert (seen[j] == 1).all(), "a PyTorch element written twice or never"
            assert got[j].tobytes() == w.tobytes()
