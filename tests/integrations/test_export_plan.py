"""The per-shard export arithmetic (``integrations/links``): cutting a Flax tensor into
boxes, mapping each box on its own and assembling the PyTorch tensors gives exactly what
``Link.to_torch`` gives for the whole tensor; transforms that are not axis permutations are
recognised and computed on the devices instead. One process, no files."""

from __future__ import annotations

import itertools

import hf_models
import jax
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.integrations import links, lora
from orbax_safetensors._src.pipeline import relayout

RNG = np.random.default_rng(0)


def _link(rule, shapes):
    # several Flax tensors: the fused parts' names, or "{e}" counting (a stack of Flax tensors)
    parts = rule.parts or [str(e) for e in range(len(shapes))] if len(shapes) > 1 else ["w"]
    names = {(f"{p}.kernel" if len(shapes) > 1 else p): s for p, s in zip(parts, shapes)}
    found, report = links.find_links(osf.KeyMapping([rule]), names, flax_side=True)
    assert report.ok and len(found) == 1, report.problems()
    return found[0]


def _boxes(shape, cuts):
    # a grid of boxes: each axis cut into ``cuts[axis]`` uneven slices
    per_axis = []
    for size, n in zip(shape, cuts):
        edges = sorted({0, size, *RNG.integers(1, max(2, size), n - 1).tolist()})
        per_axis.append([slice(a, b) for a, b in itertools.pairwise(edges) if a < b])
    return list(itertools.product(*per_axis))


CASES = [
    # (rule, Flax shapes)
    (osf.Rule("a.weight", "w", osf.Transpose()), [(6, 10)]),
    (osf.Rule("a.weight", "w"), [(6, 10)]),
    (osf.Rule("a.weight", "w", osf.Transpose((2, 0, 1))), [(3, 4, 5)]),
    (osf.Rule("a.weight", "w", osf.Chain(osf.Transpose(), osf.Transpose((1, 0)))), [(6, 10)]),
    (osf.Rule("l.{i}.w", "w", osf.Transpose(), stacked="i"), [(4, 6, 10)]),
    (hf_models.stacked_fused_rule("l.{i}.{p:q|k|v}.w", "w", (8, 4, 4)), [(3, 6, 16)]),
    (osf.Rule("l.{p:gate|up}.w", "w", osf.Transpose(), fused="p", axis=-1), [(6, 10)]),
    (osf.Rule("c_attn.weight", "{p:q|k|v}.kernel", fused="p", axis=-1), [(6, 4)] * 3),
    (osf.Rule("qkv.weight", "{p:q|k}.kernel", osf.Transpose(), fused="p", axis=0), [(6, 4)] * 2),
    # issue 42: MaxText's experts (experts, L, emb, mlp), layers on axis 1 with fused parts,
    # stacks on the PyTorch side, a fused PyTorch tensor per layer from stacked Flax parts
    (osf.Rule("l.{i}.x.{e}.w", "w", osf.Transpose(), stacked={"e": 0, "i": 1}), [(3, 2, 6, 10)]),
    (
        osf.Rule("l.{i}.{p:q|k|v}.w", "w", osf.Transpose(), stacked={"i": 1}, fused="p",
                 axis=-1, sizes=(8, 4, 4)),
        [(6, 3, 16)],
    ),
    (osf.Rule("l.{i}.{p:g|u}.w", "w", osf.Transpose(), stacked={"i": 1, "p": -2}), [(6, 3, 2, 10)]),
    (osf.Rule("experts.w", "{e}.kernel", osf.Transpose(), stacked={"e": 1}), [(6, 10)] * 3),
    (
        osf.Rule("l.{i}.qkv.w", "{p:q|k}.kernel", osf.Transpose(), stacked={"i": 1}, fused="p",
                 axis=0, sizes=(4, 8)),
        [(6, 3, 4), (6, 3, 8)],
    ),
]  # fmt: skip


@pytest.mark.parametrize("rule, shapes", CASES)
def test_boxes_mapped_alone_assemble_the_whole_export(rule, shapes):
    link = _link(rule, shapes)
    arrays = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    want = link.values(arrays, to_torch=True)
    assert links.commutes(link, shapes)
    got = [np.full(w.shape, np.nan, np.float32) for w in want]
    for k, x in enumerate(arrays):
        for box in _boxes(x.shape, [3] * x.ndim):
            for j, tbox, values in links.shard_boxes(link, k, box, x[box], shapes):
                assert np.isnan(got[j][tbox]).all(), "a byte written twice"
                got[j][tbox] = values
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "rule, shapes",
    [
        (osf.Rule("q.weight", "w", osf.Chain(osf.Transpose(), osf.SplitHeads(2, -1))), [(6, 2, 4)]),
        (osf.Rule("l.{i}.w", "w", osf.Reshape((2, 6), (12,)), stacked="i"), [(3, 2, 6)]),
        (osf.Rule("l.{p:a|b}.w", "w", osf.SplitHeads(2, 0), fused="p", axis=-1), [(2, 3, 8)]),
        (
            osf.Rule(
                "l.{i}.x.{e}.w",
                "w",
                osf.Chain(osf.Transpose(), osf.SplitHeads(2, -1)),
                stacked={"e": -1, "i": 1},
            ),
            [(6, 3, 2, 4, 2)],
        ),
        (osf.Rule("a.weight", "w", osf.Transpose()), [(6, 10)]),
    ],
)
def test_device_value_matches_host_transform(rule, shapes):
    link = _link(rule, shapes)
    arrays = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    want = link.values(arrays, to_torch=True)
    for j, w in enumerate(want):
        got = jax.jit(lambda a, j=j: links.device_value(link, a, j))(arrays)
        np.testing.assert_array_equal(np.asarray(got), w)


def test_only_axis_permutations_commute():
    assert links.axis_permutation(osf.Transpose(), 3) == (2, 1, 0)
    assert links.axis_permutation(osf.Transpose((2, 0, 1)), 3) == (1, 2, 0)
    assert links.axis_permutation(osf.SplitHeads(2), 2) is None
    assert links.axis_permutation(osf.Chain(osf.Transpose(), osf.Reshape((4,), (4,))), 1) is None
    link = _link(
        osf.Rule("q.weight", "w", osf.Chain(osf.Transpose(), osf.SplitHeads(2, -1))), [(6, 2, 4)]
    )
    assert not links.commutes(link, [(6, 2, 4)])


def test_spread_sharding_splits_the_first_divisible_axis():
    n = len(jax.devices())
    spec = relayout.spread_sharding((3, 4 * n)).spec
    assert tuple(spec) == ((None, "devices") if n > 1 else ("devices",))


@pytest.mark.parametrize(
    ("kernel", "a", "b", "dtype"),
    [
        ((37, 53), (37, 4), (4, 53), np.float32),
        ((3, 24, 40), (3, 24, 8), (3, 8, 40), np.float32),  # stacked layers, stacked adapters
        ((3, 24, 40), (24, 8), (8, 40), jax.numpy.bfloat16),  # adapters shared by the layers
        ((64, 48), (64, 16), (16, 48), np.float64),
    ],
)
def test_lora_merge_of_any_block_is_bit_identical_to_the_whole_merge(kernel, a, b, dtype):
    """A multi-process save merges each kernel shard on its own (from the rows of a and the
    columns of b its box needs): the merge sums the rank terms in order, elementwise, so a
    block's merge is the same arithmetic as that block of the whole merge, bit for bit
    (a BLAS matmul's reduction order depends on the matrix sizes)."""
    w = RNG.standard_normal(kernel).astype(dtype)
    fa, fb = RNG.standard_normal(a).astype(dtype), RNG.standard_normal(b).astype(dtype)
    whole = lora.merge_lora(w, fa, fb, 0.37)
    assert whole.dtype == w.dtype
    np.testing.assert_allclose(
        whole.astype(np.float64),
        (w.astype(np.float64) + np.matmul(fa.astype(np.float64), fb.astype(np.float64)) * 0.37),
        rtol=1e-2 if dtype is jax.numpy.bfloat16 else 1e-5,
        atol=1e-2 if dtype is jax.numpy.bfloat16 else 1e-5,
    )
    for box in _boxes(kernel, [2] * (len(kernel) - 2) + [3, 4]):
        block = lora.merge_lora_block(w[box], box, fa, fb, 0.37, kernel)
        assert block.tobytes() == whole[box].tobytes(), box
