"""Hugging Face model directories proved with the real client: every exported directory loads
with ``transformers.AutoModelForCausalLM.from_pretrained`` (no missing or unexpected keys) and
its logits match the JAX model's; the official safetensors reader opens every file. Tiny
configs built in code, no hub downloads."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402
import safetensors  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


def hf_logits(directory, dtype=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=False, dtype=dtype
    ).eval()
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


def load_cleanly(directory):
    """transformers loads every tensor and the official reader opens every file."""
    official_reader_opens(directory)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


def official_reader_opens(directory):
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    assert files
    values = {}
    for f in files:
        with safetensors.safe_open(str(f), "np") as g:
            assert g.metadata() == {"format": "pt"}
            for k in g.keys():  # noqa: SIM118 (safe_open is no dict)
                values[k] = g.get_tensor(k)
    orbax_layout_opens(directory, values)
    return files


def orbax_layout_opens(directory, values):
    """Orbax's own safetensors loader (its v1 ``checkpoint_layout="safetensors"``) reads the
    same tensors, where this orbax-checkpoint has it."""
    if not orbaxcompat.has_orbax_v1():
        return
    from orbax.checkpoint import v1 as ocp

    with ocp.Context(checkpoint_layout="safetensors"):
        got = dict(ocp.load(directory))
    assert sorted(got) == sorted(values)
    for k, v in values.items():
        assert np.array_equal(np.asarray(got[k]).view(np.uint8), v.view(np.uint8)), k


def jax_model(kind, tied, seed=0):
    config = hf_models.tiny_config(kind, tied)
    model = hf_models.CausalLM(config, kind, rngs=nnx.Rngs(seed))
    # non-trivial norms, so a wrong norm mapping cannot pass; weights of the scale
    # transformers initialises (std 0.02), so logits stay O(1) and f32 rounding small
    for index, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var.get_value()
        if path[-1] == "scale":
            var.set_value(value + 0.1 * jnp.arange(value.shape[0]))
        else:
            var.set_value(
                0.02 * jax.random.normal(jax.random.key(seed * 1000 + index), value.shape)
            )
    return config, model


@pytest.mark.parametrize(
    "kind, tied, max_file_size",
    [
        ("llama", False, None),
        ("llama", True, 20_000),
        ("qwen2", False, 20_000),
        ("qwen3", True, None),
        ("qwen3", False, 20_000),
    ],
)
def test_export_jax_model_loads_in_transformers_with_same_logits(
    tmp_dir, kind, tied, max_file_size
):
    config, model = jax_model(kind, tied)
    out = tmp_dir / "hf"
    report = osf.export_pytorch(
        model, out, osf.preset_mapping(kind), hf_config=config, max_file_size=max_file_size
    )
    assert report.ok
    files = official_reader_opens(out)
    assert (len(files) > 1) == (max_file_size is not None)
    assert (out / "model.safetensors.index.json").exists() == (max_file_size is not None)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    load_cleanly(out)
    np.testing.assert_allclose(
        hf_logits(out), np.asarray(model(jnp.asarray(IDS))), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_directory_into_jax_model_and_back(tmp_dir, kind):
    """transformers' save_pretrained -> load_pytorch -> same logits; export -> same model."""
    config = hf_models.tiny_config(kind, tied=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_dir / "orig")
    model = hf_models.CausalLM(config, kind, rngs=nnx.Rngs(1))
    mapping = osf.preset_mapping(kind, tie_word_embeddings=True)
    assert osf.load_pytorch(model, tmp_dir / "orig", mapping).ok
    want = hf_logits(tmp_dir / "orig")
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), want, rtol=1e-5, atol=1e-5)
    osf.export_pytorch(model, tmp_dir / "back", mapping, hf_config=hf.config)
    load_cleanly(tmp_dir / "back")
    np.testing.assert_array_equal(hf_logits(tmp_dir / "back"), want)


def test_tied_head_loads_from_embedding_and_is_not_written(tmp_dir):
    """An untied JAX model (own lm_head) with a tied HF config: loaded from the embedding,
    exported without lm_head.weight."""
    config = hf_models.tiny_config(tied=True)
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_dir / "orig")
    untied = hf_models.CausalLM(hf_models.tiny_config(tied=False), rngs=nnx.Rngs(0))
    mapping = osf.preset_mapping("llama", tie_word_embeddings=True)
    report = osf.load_pytorch(untied, tmp_dir / "orig", mapping)
    assert report.ok
    np.testing.assert_array_equal(
        untied.lm_head.kernel[...], untied.model.embed_tokens.embedding[...].T
    )
    report = osf.export_pytorch(untied, tmp_dir / "back", mapping, hf_config=config)
    assert "lm_head.kernel" in report.ignored
    with safetensors.safe_open(str(tmp_dir / "back" / "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118
    load_cleanly(tmp_dir / "back")
    np.testing.assert_allclose(hf_logits(tmp_dir / "back"), hf_logits(tmp_dir / "orig"), atol=1e-6)


def test_bf16_export_with_keep_policy_loads_in_bf16(tmp_dir):
    config, model = jax_model("llama", tied=False, seed=3)
    policy = {"*norm*": "keep", "*": jnp.bfloat16}
    osf.export_pytorch(
        model, tmp_dir / "hf", osf.preset_mapping("llama"), hf_config=config, dtype=policy
    )
    with safetensors.safe_open(str(tmp_dir / "hf" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes["model.norm.weight"] == "F32" and dtypes["lm_head.weight"] == "BF16"
    assert json.loads((tmp_dir / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    load_cleanly(tmp_dir / "hf")
    got = hf_logits(tmp_dir / "hf", dtype=torch.float32)
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(IDS))), atol=5e-2)


@pytest.mark.parametrize("max_file_size, dtype", [(None, None), (20_000, "bfloat16")])
def test_gpt2_conv1d_round_trip(tmp_dir, max_file_size, dtype):
    config = hf_models.tiny_config("gpt2")
    torch.manual_seed(4)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_dir / "orig")
    model = hf_models.Gpt2LM(config, rngs=nnx.Rngs(0))
    mapping = osf.preset_mapping("gpt2")
    assert osf.load_pytorch(model, tmp_dir / "orig", mapping).ok
    want = hf_logits(tmp_dir / "orig")
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), want, rtol=1e-5, atol=1e-5)
    osf.export_pytorch(
        model,
        tmp_dir / "back",
        mapping,
        hf_config=config,
        max_file_size=max_file_size,
        dtype=dtype,
    )
    files = official_reader_opens(tmp_dir / "back")
    assert (len(files) > 1) == (max_file_size is not None)
    load_cleanly(tmp_dir / "back")
    if dtype is None:
        np.testing.assert_array_equal(hf_logits(tmp_dir / "back"), want)
        return
    assert json.loads((tmp_dir / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_dir / "back").eval()
    assert bf16.transformer.wte.weight.dtype == torch.bfloat16
    np.testing.assert_allclose(hf_logits(tmp_dir / "back", dtype=torch.float32), want, atol=2e-2)


def test_gpt2_fused_c_attn_as_separate_jax_projections(tmp_dir):
    """fused on the Flax side: one HF c_attn is three JAX kernels (and biases)."""
    config = hf_models.tiny_config("gpt2")
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_dir / "orig")
    base = osf.preset_mapping("gpt2")
    split = osf.KeyMapping(
        [
            osf.Rule(
                "transformer.h.{i}.attn.c_attn.weight", "h.{i}.{p:q|k|v}.kernel", fused="p", axis=-1
            ),
            osf.Rule(
                "transformer.h.{i}.attn.c_attn.bias", "h.{i}.{p:q|k|v}.bias", fused="p", axis=0
            ),
            osf.Rule("transformer.{rest:(?!h\\.\\d+\\.attn\\.c_attn).*}", "{rest}"),
        ],
        tied=dict(base.tied),
    )
    tree = osf.load_file(tmp_dir / "orig" / "model.safetensors")
    flat = {}
    for key, value in tree.items():
        target = split.to_flax(key)
        if key == "lm_head.weight":
            continue
        flat[key] = value
        assert target is not None, key
    # the JAX pytree: q/k/v split out of c_attn, the rest under its HF name
    jax_tree = {}
    for key, value in flat.items():
        if ".attn.c_attn." in key:
            i, leaf = key.split(".")[2], key.rsplit(".", 1)[1]
            axis = -1 if leaf == "weight" else 0
            for p, part in zip("qkv", np.split(np.asarray(value), 3, axis=axis)):
                jax_tree[f"h.{i}.{p}.{'kernel' if leaf == 'weight' else 'bias'}"] = part
        else:
            jax_tree[key[len("transformer.") :]] = np.asarray(value)
    nested = {}
    for name, value in jax_tree.items():
        node = nested
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    report = osf.export_pytorch(nested, tmp_dir / "back", split, hf_config=config)
    assert report.ok, report.problems()
    load_cleanly(tmp_dir / "back")
    np.testing.assert_array_equal(hf_logits(tmp_dir / "back"), hf_logits(tmp_dir / "orig"))
