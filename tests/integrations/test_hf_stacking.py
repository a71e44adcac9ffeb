"""Stacked layouts (issue 42 points 1 and 4): several stacking placeholders on any axis
(MaxText's scanned decoder on axis 1, experts on axis 0), on either side of a rule, combined
with ``fused`` on either side; each value checked against explicit indexing, through real
files, and back bit for bit; errors that name the rule; ``load_pytorch(None, ...)`` and
``abstract_pytorch`` deriving the target from the headers."""

from __future__ import annotations

import devices
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf
from orbax_safetensors._src.integrations import links

T = osf.Transpose()
L, X, E, M, H, KV, D = 3, 4, 8, 6, 4, 2, 2  # layers, experts, emb, mlp, heads, kv heads, dim
RNG = np.random.default_rng(0)


def save(directory, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"), {"format": "pt"})


def read(directory):
    return safetensors.numpy.load_file(str(directory / "model.safetensors"))


def assert_same_files(a, b):
    got, want = read(a), read(b)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def mixtral_tensors():
    """A Mixtral-like checkpoint as transformers 5 saves it: per layer, per expert."""
    out = {}
    for i in range(L):
        layer = f"model.layers.{i}"
        out[f"{layer}.self_attn.q_proj.weight"] = normal(H * D, E)
        out[f"{layer}.self_attn.k_proj.weight"] = normal(KV * D, E)
        out[f"{layer}.self_attn.v_proj.weight"] = normal(KV * D, E)
        out[f"{layer}.self_attn.o_proj.weight"] = normal(E, H * D)
        out[f"{layer}.input_layernorm.weight"] = normal(E)
        out[f"{layer}.block_sparse_moe.gate.weight"] = normal(X, E)
        for e in range(X):
            for w, shape in (("w1", (M, E)), ("w2", (E, M)), ("w3", (M, E))):
                out[f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = normal(*shape)
    return out


LAYER = "model.layers.{i}"
MOE = LAYER + ".block_sparse_moe"
# MaxText's scanned decoder: layers on axis 1, experts on axis 0.
MAXTEXT = osf.KeyMapping(
    [
        osf.Rule(LAYER + ".self_attn.{p:q|k|v}_proj.weight", "layers.attn.{p}",
                 osf.Chain(T, osf.SplitHeads(head_dim=D)), stacked={"i": 1}),
        osf.Rule(LAYER + ".self_attn.o_proj.weight", "layers.attn.out",
                 osf.Chain(T, osf.SplitHeads(head_dim=D, axis=0)), stacked={"i": 1}),
        osf.Rule(LAYER + ".input_layernorm.weight", "layers.norm", stacked={"i": 1}),
        osf.Rule(MOE + ".gate.weight", "layers.moe.gate", T, stacked={"i": 1}),
        osf.Rule(MOE + ".experts.{e}.w1.weight", "layers.moe.wi_0", T, stacked={"e": 0, "i": 1}),
        osf.Rule(MOE + ".experts.{e}.w3.weight", "layers.moe.wi_1", T, stacked={"e": 0, "i": 1}),
        osf.Rule(MOE + ".experts.{e}.w2.weight", "layers.moe.wo", T, stacked={"e": 0, "i": 1}),
    ]
)  # fmt: skip


def test_maxtext_layout_puts_each_slice_in_its_place_and_exports_bit_for_bit(tmp_dir):
    hf = mixtral_tensors()
    save(tmp_dir / "hf", hf)
    params = osf.load_pytorch(None, tmp_dir / "hf", MAXTEXT)
    attn, moe = params["layers"]["attn"], params["layers"]["moe"]
    assert attn["q"].shape == (E, L, H, D) and attn["k"].shape == (E, L, KV, D)
    assert attn["out"].shape == (H, L, D, E) and params["layers"]["norm"].shape == (E, L)
    assert moe["gate"].shape == (E, L, X) and moe["wi_0"].shape == (X, L, E, M)
    assert moe["wo"].shape == (X, L, M, E)
    for i in range(L):
        w = f"model.layers.{i}"
        np.testing.assert_array_equal(
            attn["q"][:, i], hf[f"{w}.self_attn.q_proj.weight"].T.reshape(E, H, D)
        )
        np.testing.assert_array_equal(
            attn["out"][:, i], hf[f"{w}.self_attn.o_proj.weight"].T.reshape(H, D, E)
        )
        np.testing.assert_array_equal(
            params["layers"]["norm"][:, i], hf[f"{w}.input_layernorm.weight"]
        )
        for e in range(X):
            expert = f"{w}.block_sparse_moe.experts.{e}"
            np.testing.assert_array_equal(moe["wi_1"][e, i], hf[f"{expert}.w3.weight"].T)
            np.testing.assert_array_equal(moe["wo"][e, i], hf[f"{expert}.w2.weight"].T)
    assert osf.export_pytorch(params, tmp_dir / "out", MAXTEXT).ok
    assert_same_files(tmp_dir / "out", tmp_dir / "hf")


def test_the_pytorch_side_stacks_and_fuses(tmp_dir):
    """transformers' in-memory MoE layout (``experts.gate_up_proj`` ``(X, 2M, E)``) against
    a JAX model with one kernel per expert and projection: both collective placeholders in
    the Flax pattern, so the PyTorch tensor gathers them."""
    gate_up = normal(X, 2 * M, E)
    save(tmp_dir / "hf", {"layers.0.experts.gate_up_proj": gate_up})
    mapping = osf.KeyMapping(
        [
            osf.Rule("layers.{i}.experts.gate_up_proj", "layers.{i}.experts.{e}.{p:gate|up}",
                     T, stacked={"e": 0}, fused="p", axis=0),
        ]
    )  # fmt: skip
    tree = osf.load_pytorch(None, tmp_dir / "hf", mapping)
    experts = tree["layers"][0]["experts"]
    assert sorted(experts) == list(range(X))
    for e in range(X):
        np.testing.assert_array_equal(experts[e]["gate"], gate_up[e, :M].T)
        np.testing.assert_array_equal(experts[e]["up"], gate_up[e, M:].T)
    assert osf.export_pytorch(tree, tmp_dir / "out", mapping).ok
    assert_same_files(tmp_dir / "out", tmp_dir / "hf")


def test_fused_per_layer_tensors_into_separate_stacked_jax_tensors(tmp_dir):
    """Phi-3: ``qkv_proj`` fused per layer in Hugging Face, separate query/key/value stacked
    on axis 1 in JAX: each link ties 3 JAX tensors to L PyTorch tensors."""
    hf = {
        f"model.layers.{i}.self_attn.qkv_proj.weight": normal((H + 2 * KV) * D, E) for i in range(L)
    }
    hf |= {f"model.layers.{i}.mlp.gate_up_proj.weight": normal(2 * M, E) for i in range(L)}
    save(tmp_dir / "hf", hf)
    mapping = osf.KeyMapping(
        [
            osf.Rule(LAYER + ".self_attn.qkv_proj.weight", "layers.{p:query|key|value}",
                     osf.Chain(T, osf.SplitHeads(head_dim=D)), stacked={"i": 1}, fused="p",
                     axis=0, sizes=(H * D, KV * D, KV * D)),
            osf.Rule(LAYER + ".mlp.gate_up_proj.weight", "layers.{p:wi_0|wi_1}", T,
                     stacked={"i": 1}, fused="p", axis=0),
        ]
    )  # fmt: skip
    found, report = links.find_links(mapping, {k: v.shape for k, v in hf.items()}, flax_side=False)
    assert report.ok and [len(x.flax) for x in found] == [3, 2]
    assert [len(x.torch) for x in found] == [L, L]
    tree = osf.load_pytorch(None, tmp_dir / "hf", mapping)["layers"]
    assert tree["query"].shape == (E, L, H, D) and tree["value"].shape == (E, L, KV, D)
    qkv = hf["model.layers.2.self_attn.qkv_proj.weight"]
    np.testing.assert_array_equal(tree["key"][:, 2], qkv[H * D : (H + KV) * D].T.reshape(E, KV, D))
    np.testing.assert_array_equal(
        tree["wi_1"][:, 1], hf["model.layers.1.mlp.gate_up_proj.weight"][M:].T
    )
    assert osf.export_pytorch({"layers": tree}, tmp_dir / "out", mapping).ok
    assert_same_files(tmp_dir / "out", tmp_dir / "hf")


def test_listed_values_stack_on_a_new_axis(tmp_dir):
    """``{p:gate_proj|up_proj}`` stacked: the projections on an axis of their own, in the
    listed order (a fused MLP kernel ``(emb, L, 2, mlp)``)."""
    hf = {f"l.{i}.{p}.weight": normal(M, E) for i in range(L) for p in ("gate_proj", "up_proj")}
    save(tmp_dir / "hf", hf)
    rule = osf.Rule("l.{i}.{p:gate_proj|up_proj}.weight", "wi", T, stacked={"i": 1, "p": 2})
    wi = osf.load_pytorch(None, tmp_dir / "hf", osf.KeyMapping([rule]))["wi"]
    assert wi.shape == (E, L, 2, M)
    np.testing.assert_array_equal(wi[:, 1, 1], hf["l.1.up_proj.weight"].T)
    assert rule.match_flax("wi") == "l.0.gate_proj.weight"
    assert osf.export_pytorch({"wi": wi}, tmp_dir / "out", osf.KeyMapping([rule])).ok
    assert_same_files(tmp_dir / "out", tmp_dir / "hf")


def test_the_spellings_of_stacked():
    def axes(stacked):
        return osf.Rule("a.{i}.{e}.w", "w", stacked=stacked).stacked

    assert axes(("i", "e")) == (("i", 0), ("e", 1)) == axes({"i": 0, "e": 1})
    assert axes({"e": 0, "i": 1}) == (("e", 0), ("i", 1)) == axes([("e", 0), ("i", 1)])
    assert axes(("i", ("e", -1))) == (("i", 0), ("e", -1))
    assert osf.Rule("a.{i}.w", "w", stacked="i").stacked == (("i", 0),)


@pytest.mark.parametrize(
    ("torch", "flax", "kwargs", "message"),
    [
        ("a.{i}.w", "b.{i}", {"stacked": "i"}, r"\{i\} must be on one side only.*per-layer"),
        ("a.{i}.w", "b", {"stacked": ("i", "e")}, r"\{e\} must be on one side only.*neither"),
        (
            "a.{i}.{e}.w",
            "b",
            {"stacked": {"i": 1, "e": 1}},
            "two placeholders of one side on one axis",
        ),
        ("a.{i}.w", "b", {"stacked": ("i", "i")}, "distinct placeholders"),
        ("a.{i}.w", "b", {"stacked": 3}, r"stacked= takes a placeholder name"),
        ("a.{i}.w", "b", {"stacked": {"i": "1"}}, r"stacked= takes a placeholder name"),
        ("a.{p:x|y}.w", "b", {"stacked": "p", "fused": "p"}, "both stacked and fused"),
        ("a.{i}.{j}.w", "b", {"stacked": "i"}, "same placeholders, except stacked"),
    ],
)
def test_ill_defined_rules_raise_naming_the_rule(torch, flax, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        osf.Rule(torch, flax, **kwargs)
    assert f"rule {torch!r} -> {flax!r}" in str(info.value)


def test_stack_problems_are_reported_all_at_once(tmp_dir):
    hf = {k: v for k, v in mixtral_tensors().items() if ".experts.2.w1" not in k}
    save(tmp_dir / "hf", hf)
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.load_pytorch(None, tmp_dir / "hf", MAXTEXT)
    assert (
        "layers.moe.wi_0 joins 12 tensors but 3 are absent "
        "(e.g. model.layers.0.block_sparse_moe.experts.2.w1.weight)" in str(info.value)
    )
    # an export: a stacked axis the tensor lacks, separate tensors of different lengths
    mapping = osf.KeyMapping(
        [
            osf.Rule("l.{i}.w", "{p:a|b}", stacked={"i": 2}, fused="p", axis=-1),
            osf.Rule("n.{i}.w", "norm", stacked={"i": 1}),
        ]
    )
    report = osf.export_pytorch(
        {"a": np.zeros((2, 3, 4)), "b": np.zeros((2, 3, 5)), "norm": np.zeros(4)},
        tmp_dir / "bad",
        mapping,
        strict=False,
    )
    assert report.mismatched == [
        "a, b stack {i} on axis 2 with different lengths [4, 5]",
        "norm [4] has no axis 1 that stacks {i} (rule 'n.{i}.w' -> 'norm')",
    ]
    report = osf.export_pytorch(
        {"a": np.zeros((2, 3, 4)), "b": np.zeros((2, 5, 4))}, tmp_dir / "bad2", mapping,
        strict=False,
    )  # fmt: skip
    assert report.mismatched == [
        "a F64[2, 3, 4] -> l.0.w: rule 'l.{i}.w' -> '{p:a|b}': a, b <-> l.0.w, l.1.w, l.2.w, "
        "...: parts of sizes [3, 5] along axis -1, which a rule without sizes= splits into "
        "equal parts: give sizes=(3, 5)"
    ]


def test_a_stacked_load_into_a_sharded_target_reads_slices_sharded(tmp_dir):
    hf = mixtral_tensors()
    save(tmp_dir / "hf", hf)
    devices.take(4)  # (a skip on fewer; the mesh is every device, as on CPU's 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, -1), ("x", "m"))
    abstract = osf.abstract_pytorch(tmp_dir / "hf", MAXTEXT)
    specs = {
        "wi_0": P("x", None, "m"),  # experts over x: a stacked axis
        "wo": P(None, None, "x"),
        "gate": P(None, None, "x"),
    }

    def shard(path, leaf):
        spec = specs.get(path[-1].key, P())
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    sharded = jax.tree_util.tree_map_with_path(shard, abstract)
    params = osf.load_pytorch(sharded, tmp_dir / "hf", MAXTEXT)
    whole = osf.load_pytorch(None, tmp_dir / "hf", MAXTEXT)
    for name in ("wi_0", "wo", "gate"):
        got = params["layers"]["moe"][name]
        assert got.sharding.spec == specs[name]
        np.testing.assert_array_equal(got, whole["layers"]["moe"][name])


def test_the_derived_target_is_nested_and_updates_an_nnx_model(tmp_dir):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(E, M, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = getattr(nnx, "List", list)(
                [Block(rngs) for _ in range(L)]
            )  # (flax 0.11: a list)

    hf = {
        f"layers.{i}.fc.{w}": normal(*s)
        for i in range(L)
        for w, s in (("weight", (M, E)), ("bias", (M,)))
    }
    hf["extra"] = normal(3).astype(jnp.bfloat16)
    save(tmp_dir / "hf", hf)
    mapping = osf.KeyMapping(osf.Rule.linear("layers.{i}.fc", "layers.{i}.fc"))
    with pytest.raises(osf.TargetMismatchError, match=r"no rule maps these keys \(1\):\n  extra"):
        osf.load_pytorch(None, tmp_dir / "hf", mapping)
    params, report = osf.load_pytorch(None, tmp_dir / "hf", mapping, strict=False, with_report=True)
    assert report.unmapped == ["extra"]
    assert sorted(params["layers"]) == [0, 1, 2]
    assert isinstance(params["layers"][1]["fc"]["kernel"], jax.Array)
    model = Model(nnx.Rngs(0))
    nnx.update(model, params)
    np.testing.assert_array_equal(model.layers[2].fc.kernel[...], hf["layers.2.fc.weight"].T)
    abstract = osf.abstract_pytorch(tmp_dir / "hf", mapping, strict=False, prefix="params.")
    leaf = abstract["params"]["layers"][0]["fc"]["kernel"]
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape == (E, M)
    assert leaf.dtype == np.float32


def test_the_derived_target_keeps_the_stored_dtype(tmp_dir):
    hf = {f"l.{i}.w": normal(2, 3).astype(jnp.bfloat16) for i in range(2)}
    save(tmp_dir / "hf", hf)
    mapping = osf.KeyMapping([osf.Rule("l.{i}.w", "w", T, stacked={"i": -1})])
    w = osf.load_pytorch(None, tmp_dir / "hf", mapping)["w"]
    assert w.dtype == jnp.bfloat16 and w.shape == (3, 2, 2)
    np.testing.assert_array_equal(np.asarray(w[..., 1]), hf["l.1.w"].T)


def test_hostile_stack_lengths_are_refused_without_allocating(tmp_dir):
    """A layer index of 10^12 is one present tensor of a huge stack, and a zero-size tensor
    may stack 10^12 experts: both are reported, neither enumerated."""
    save(tmp_dir / "far", {"l.0.w": normal(2), "l.1000000000000.w": normal(2)})
    mapping = osf.KeyMapping([osf.Rule("l.{i}.w", "w", stacked="i")])
    with pytest.raises(osf.TargetMismatchError, match=r"w joins 1000000000001 tensors but"):
        osf.load_pytorch(None, tmp_dir / "far", mapping)
    save(tmp_dir / "wide", {"experts": np.zeros((10**12, 0), np.float32)})
    mapping = osf.KeyMapping([osf.Rule("experts", "e.{e}", stacked="e")])
    with pytest.raises(osf.TargetMismatchError, match=r"would make 1000000000000 tensors"):
        osf.abstract_pytorch(tmp_dir / "wide", mapping)


class Interleave:
    """RoPE's rotate-half layout of ``head_dim`` as interleaved pairs (a permutation of the
    last axis), a transform of one's own."""

    def to_flax(self, x):
        d = x.shape[-1]
        order = np.stack([np.arange(d // 2), np.arange(d // 2, d)], -1).reshape(-1)
        return x[..., order]

    def to_torch(self, x):
        d = x.shape[-1]
        order = np.stack([np.arange(d // 2), np.arange(d // 2, d)], -1).reshape(-1)
        return x[..., np.argsort(order)]


class Scale:
    def to_flax(self, x):
        return x * 2

    def to_torch(self, x):
        return x / 2


def test_value_transforms_of_ones_own_apply_to_each_slice(tmp_dir):
    dim = 4
    hf = {f"l.{i}.q.weight": normal(H * dim, E) for i in range(L)}
    hf |= {f"l.{i}.norm.weight": normal(E) for i in range(L)}
    save(tmp_dir / "hf", hf)
    mapping = osf.KeyMapping(
        [
            osf.Rule("l.{i}.q.weight", "query",
                     osf.Chain(T, osf.SplitHeads(head_dim=dim), Interleave()), stacked={"i": 1}),
            osf.Rule("l.{i}.norm.weight", "norm", Scale(), stacked={"i": -1}),
        ]
    )  # fmt: skip
    params = osf.load_pytorch(None, tmp_dir / "hf", mapping)
    q = hf["l.2.q.weight"].T.reshape(E, H, dim)
    np.testing.assert_array_equal(params["query"][:, 2], q[..., [0, 2, 1, 3]])
    np.testing.assert_array_equal(params["norm"][:, 1], hf["l.1.norm.weight"] * 2)
    assert osf.export_pytorch(params, tmp_dir / "out", mapping).ok
    assert_same_files(tmp_dir / "out", tmp_dir / "hf")
