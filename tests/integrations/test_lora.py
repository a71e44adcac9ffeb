"""LoRA adapters merged on export (``integrations/lora.py``): which tensors are adapters of
which kernel (flax's ``nnx.LoRALinear`` and ``nnx.LoRA(base_module=...)``, qwix's
``W_lora_a``/``W_lora_b``), every layout their shapes take against the kernel (checked
against a float64 merge, each block of a sharded kernel bit-identical to the whole merge),
adapters never dropped silently, and flax's wrappers through every Hugging Face preset into
transformers with the LoRA model's logits. qwix itself: ``test_qwix.py``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import hf_models
import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from lora_training import train_adapters

import orbax_safetensors as osf
from orbax_safetensors._src.integrations import lora

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


# --------------------------------------------------------------------------- layouts


def _reference(kernel, a, b, scale, shared, lead, m, n):
    # kernel + a @ b * scale in float64, the adapters (*lead, m, r) / (*lead, r, n)
    r = a.shape[-1]
    a64 = a.astype(np.float64).reshape(*a.shape[:lead], m, r)
    b64 = b.astype(np.float64).reshape(*b.shape[:lead], r, n)
    delta = np.matmul(a64, b64) * scale
    whole = kernel.astype(np.float64).reshape(*kernel.shape[: shared + lead], m, n) + delta
    return whole.reshape(kernel.shape)


@st.composite
def _layouts(draw):
    shared = draw(st.lists(st.integers(1, 3), max_size=1))
    lead = draw(st.lists(st.integers(1, 3), max_size=1))
    rows = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    cols = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    rank = draw(st.integers(1, 5))
    a_rows = [math.prod(rows)] if draw(st.booleans()) else rows  # flattened, as qwix's linear
    b_cols = [math.prod(cols)] if draw(st.booleans()) else cols
    kernel = (*shared, *lead, *rows, *cols)
    a, b = (*lead, *a_rows, rank), (*lead, rank, *b_cols)
    dtype = draw(st.sampled_from([np.float32, np.float64, ml_dtypes.bfloat16]))
    return kernel, a, b, len(shared), len(lead), math.prod(rows), math.prod(cols), dtype


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(case=_layouts(), seed=st.integers(0, 2**16))
def test_merge_of_every_layout_is_the_float64_merge_and_blocks_are_bit_identical(case, seed):
    kernel_shape, a_shape, b_shape, shared, lead, m, n, dtype = case
    hypothesis.assume(_unambiguous(kernel_shape, a_shape, b_shape))
    rng = np.random.default_rng(seed)
    kernel = rng.standard_normal(kernel_shape).astype(dtype)
    a, b = (rng.standard_normal(s).astype(dtype) for s in (a_shape, b_shape))
    whole = lora.merge_lora(kernel, a, b, 0.37)
    assert whole.dtype == kernel.dtype and whole.shape == kernel.shape
    want = _reference(kernel, a, b, 0.37, shared, lead, m, n)
    tol = 3e-2 if dtype is ml_dtypes.bfloat16 else 1e-5
    np.testing.assert_allclose(whole.astype(np.float64), want, rtol=tol, atol=tol)
    for box in _boxes(kernel_shape, rng):
        block = lora.merge_lora_block(kernel[box], box, a, b, 0.37, kernel_shape)
        assert block.tobytes() == whole[box].tobytes(), box


def _unambiguous(kernel, a, b):
    try:
        lora.layout(kernel, a, b)
    except ValueError:
        return False  # (random sizes can fit two layouts: refused, see the next test)
    return True


def _boxes(shape, rng):
    per_axis = []
    for size in shape:
        edges = sorted({0, size, *rng.integers(1, max(2, size), 2).tolist()})
        per_axis.append([slice(lo, hi) for lo, hi in itertools.pairwise(edges) if lo < hi])
    return list(itertools.product(*per_axis))[:24]


def test_layouts_of_tunix_qwix_adapters_and_refusals():
    # Tunix's einsum layers under qwix: query (D, N, H) with (D, r) / (r, N, H), output
    # (N, H, D) with (N, H, r) / (r, D); a linear kernel with its products flattened.
    assert lora.layout((32, 4, 8), (32, 3), (3, 4, 8)).rows == (32,)
    assert lora.layout((4, 8, 32), (4, 8, 3), (3, 32)).cols == (32,)
    assert lora.layout((6, 5, 7), (30, 2), (2, 7)).rows == (6, 5)
    assert lora.layout((3, 24, 40), (24, 8), (8, 40)).shared == 1  # served alike by 3 layers
    with pytest.raises(ValueError, match=r"\[4, 3\] and \[3, 8\] against the kernel \[8, 4, 4\]"):
        lora.layout((8, 4, 4), (4, 3), (3, 8))  # no split of the kernel: no layout
    # Tunix's Gemma (N, D, H) under qwix: the rows among the columns; a square kernel's
    # adapters are rows first (flax's and qwix's linear layouts)
    assert lora.layout((4, 32, 8), (32, 3), (3, 4, 8)).order == (1, 0, 2)
    assert lora.layout((32, 32), (32, 3), (3, 32)).rows_at == (0,)
    with pytest.raises(ValueError, match="ambiguous"):  # a query whose D is its head size
        lora.layout((3, 2, 2), (2, 4), (4, 3, 2))
    with pytest.raises(ValueError, match="ambiguous"):  # 2 stacked layers or none, rank 2
        lora.layout((2, 2, 2, 3), (2, 2, 2), (2, 2, 3))


@pytest.mark.parametrize(
    ("kernel", "a", "b", "delta"),
    [
        ((4, 32, 8), (32, 3), (3, 4, 8), "dr,rnh->ndh"),  # Tunix Gemma's q_einsum
        ((2, 2, 32, 8), (32, 3), (3, 2, 2, 8), "dr,rckh->ckdh"),  # kv_einsum: one pair
        ((3, 4, 32, 8), (32, 2), (2, 3, 4, 8), "dr,rsnh->sndh"),  # qkv_einsum
    ],
)
def test_qwix_adapters_among_the_columns_merge_as_their_einsum(kernel, a, b, delta):
    rng = np.random.default_rng(5)
    w, fa, fb = (rng.standard_normal(s).astype(np.float32) for s in (kernel, a, b))
    whole = lora.merge_lora(w, fa, fb, 0.37)
    want = w + 0.37 * np.einsum(delta, fa.astype(np.float64), fb.astype(np.float64))
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-5)
    for box in _boxes(kernel, rng):
        block = lora.merge_lora_block(w[box], box, fa, fb, 0.37, kernel)
        assert block.tobytes() == whole[box].tobytes(), box


def test_adapter_pairs_by_name():
    names = [
        "attn.q.w", "attn.q.w_lora_a", "attn.q.w_lora_b",  # qwix, Tunix's einsum
        "mlp.up.kernel", "mlp.up.kernel_lora_a", "mlp.up.kernel_lora_b",  # qwix, nnx.Linear
        "fc.kernel", "fc.bias", "fc.lora.lora_a", "fc.lora.lora_b",  # nnx.LoRALinear
        "down.base_module.w", "down.lora_a", "down.lora_b",  # nnx.LoRA around an einsum
        "orphan.x_lora_a", "orphan.x_lora_b",  # no kernel next to them
    ]  # fmt: skip
    assert lora.find_pairs(names) == [
        lora.Pair("attn.q.w", "attn.q.w_lora_a", "attn.q.w_lora_b", qwix=True),
        lora.Pair("down.base_module.w", "down.lora_a", "down.lora_b"),
        lora.Pair("fc.kernel", "fc.lora.lora_a", "fc.lora.lora_b"),
        lora.Pair("mlp.up.kernel", "mlp.up.kernel_lora_a", "mlp.up.kernel_lora_b", qwix=True),
    ]
    assert all(lora.is_adapter_name(n) for n in names if "lora" in n)
    assert not lora.is_adapter_name("flora_a") and not lora.is_adapter_name("w")


# --------------------------------------------------------------------------- refusals


def _qwix_tree():
    rng = np.random.default_rng(1)
    return {
        "q": {
            "w": rng.standard_normal((8, 2, 4)).astype(np.float32),
            "w_lora_a": rng.standard_normal((8, 3)).astype(np.float32),
            "w_lora_b": rng.standard_normal((3, 2, 4)).astype(np.float32),
        }
    }


QWIX_RULES = [osf.Rule("q.weight", "q.w", osf.Chain(osf.Transpose(), osf.SplitHeads(2, -1)))]


def test_qwix_adapters_need_their_scale(tmp_dir):
    with pytest.raises(ValueError, match=r"adapters of q\.w are .*alpha / rank.*lora_scale"):
        osf.export_pytorch(_qwix_tree(), tmp_dir / "hf", osf.KeyMapping(QWIX_RULES))
    report = osf.export_pytorch(
        _qwix_tree(), tmp_dir / "hf", osf.KeyMapping(QWIX_RULES, lora_scale=2.0)
    )
    assert report.ok and report.merged == [("q.w_lora_a", "q.w"), ("q.w_lora_b", "q.w")]
    tree = _qwix_tree()["q"]
    want = tree["w"] + 2.0 * np.einsum("dr,rnh->dnh", tree["w_lora_a"], tree["w_lora_b"])
    got = osf.load_file(tmp_dir / "hf" / "model.safetensors")["q.weight"]
    np.testing.assert_allclose(np.asarray(got), want.reshape(8, 8).T, rtol=1e-6, atol=1e-6)


def test_ignoring_adapters_is_refused_not_reported_ok(tmp_dir):
    """Issue 40's third silent answer: ignore_flax=[".*_lora_[ab]"] to get past the adapters'
    names exported the base model with report.ok True."""
    mapping = osf.KeyMapping(QWIX_RULES, ignore_flax=[r".*_lora_[ab]"], lora_scale=2.0)
    with pytest.raises(osf.TargetMismatchError, match=r"q\.w_lora_a: ignore_flax leaves out"):
        osf.export_pytorch(_qwix_tree(), tmp_dir / "hf", mapping)
    report = osf.export_pytorch(_qwix_tree(), tmp_dir / "hf", mapping, strict=False)
    assert not report.ok and len(report.refused) == 2 and not report.merged
    assert not (tmp_dir / "hf" / "model.safetensors").exists() or "q.weight" not in osf.load_file(
        tmp_dir / "hf" / "model.safetensors"
    )
    # an adapter no kernel takes (a LoRAParam of a custom module), ignored: refused as well
    model = nnx.Module()
    model.proj = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    model.extra = nnx.LoRAParam(jnp.ones((4, 2)))
    rules = osf.Rule.linear("proj", "proj")
    with pytest.raises(osf.TargetMismatchError, match="extra: ignore_flax leaves out"):
        osf.export_pytorch(model, tmp_dir / "m", osf.KeyMapping(rules, ignore_flax=["extra"]))


def test_adapters_that_fit_no_layout_are_named(tmp_dir):
    tree = _qwix_tree()
    tree["q"]["w_lora_b"] = np.ones((3, 5), np.float32)
    with pytest.raises(osf.TargetMismatchError, match=r"q\.w with q\.w_lora_a and q\.w_lora_b"):
        osf.export_pytorch(tree, tmp_dir / "hf", osf.KeyMapping(QWIX_RULES, lora_scale=2.0))


def test_lora_scale_on_presets_replace_and_bad_values():
    tied = osf.preset_mapping("llama", tie_word_embeddings=True)
    scaled = dataclasses.replace(tied, lora_scale=2.0)  # (issue 42: AttributeError on a tuple)
    assert scaled.lora_scale == 2.0 and scaled.tied == tied.tied and scaled.rules == tied.rules
    assert osf.preset_mapping("tunix-qwen3", head_dim=8, lora_scale=0.5).lora_scale == 0.5
    assert osf.preset_mapping("gpt2", lora_scale=4).tied == osf.preset_mapping("gpt2").tied
    assert tied.lora_scale is None
    with pytest.raises(ValueError, match="finite"):
        osf.KeyMapping([], lora_scale=float("nan"))


# --------------------------------------------------------------------------- flax's wrappers


def _wrapped_llama(kind):
    """The reference port of ``kind`` with flax's LoRA on two layers: ``nnx.LoRA`` wrapping
    layer 0's ``down_proj`` and ``q_proj`` (``base_module``), ``nnx.LoRALinear`` for layer
    1's ``up_proj`` (its kernel copied), trained."""
    config = hf_models.tiny_config(kind)
    model = hf_models.CausalLM(config, kind, rngs=nnx.Rngs(0))
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    rngs = nnx.Rngs(7)
    layer0.mlp.down_proj = nnx.LoRA(64, 3, 32, base_module=layer0.mlp.down_proj, rngs=rngs)
    q = layer0.self_attn.q_proj
    layer0.self_attn.q_proj = nnx.LoRA(32, 2, 32, base_module=q, rngs=rngs)
    up = nnx.LoRALinear(32, 64, lora_rank=4, use_bias=False, rngs=rngs)
    up.kernel[...] = layer1.mlp.up_proj.kernel[...]
    layer1.mlp.up_proj = up
    train_adapters(model, lambda m: m(jnp.asarray(IDS)))
    return config, model


def _wrapped_gpt2():
    config = hf_models.tiny_config("gpt2")
    model = hf_models.Gpt2LM(config, rngs=nnx.Rngs(0))
    mlp = model.transformer.h[0].mlp
    mlp.c_fc = nnx.LoRA(32, 2, 128, base_module=mlp.c_fc, rngs=nnx.Rngs(7))  # (and its bias)
    train_adapters(model, lambda m: m(jnp.asarray(IDS)))
    return config, model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gpt2"])
def test_flax_lora_wrappers_export_through_every_preset(tmp_dir, kind):
    """Issue 42: ``nnx.LoRA(base_module=...)`` failed with every preset (``no rule maps
    ...down_proj.base_module.kernel``). Merged, the wrapper exports as the layer it wraps;
    transformers computes the LoRA model's logits."""
    transformers = pytest.importorskip("transformers", minversion="5")
    torch = pytest.importorskip("torch")
    config, model = _wrapped_gpt2() if kind == "gpt2" else _wrapped_llama(kind)
    report = osf.export_pytorch(model, tmp_dir / "hf", osf.preset_mapping(kind), hf_config=config)
    assert report.ok, report.problems()
    assert {k for k, _ in report.merged} == {
        n for n in _names(model) if n.endswith(("lora_a", "lora_b"))
    }
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_dir / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        got = hf.eval()(torch.from_numpy(IDS)).logits.numpy()
    hf_models.assert_outputs_close(got, np.asarray(model(jnp.asarray(IDS))), rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_dir / "hf" / "config.json").read_text())["model_type"]


def _names(model):
    return [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def test_the_command_line_takes_the_lora_scale(tmp_dir, capsys):
    """``orbax-safetensors export ... --lora-scale X``: qwix-named adapters of a checkpoint
    merged with X; without it the command fails naming the flag."""
    from orbax_safetensors import cli

    rng = np.random.default_rng(2)
    head = {
        "kernel": rng.standard_normal((8, 6)).astype(np.float32),
        "kernel_lora_a": rng.standard_normal((8, 2)).astype(np.float32),
        "kernel_lora_b": rng.standard_normal((2, 6)).astype(np.float32),
    }
    osf.save_file({"lm_head": head}, tmp_dir / "ckpt.safetensors")
    argv = ["export", str(tmp_dir / "ckpt.safetensors"), str(tmp_dir / "hf"), "--mapping", "llama"]
    assert cli.main(argv) == 2
    assert "--lora-scale" in capsys.readouterr().err
    assert cli.main([*argv, "--lora-scale", "0.5"]) == 0
    got = np.asarray(osf.load_file(tmp_dir / "hf" / "model.safetensors")["lm_head.weight"])
    want = head["kernel"] + 0.5 * head["kernel_lora_a"] @ head["kernel_lora_b"]
    np.testing.assert_allclose(got, want.T, rtol=1e-6, atol=1e-6)
