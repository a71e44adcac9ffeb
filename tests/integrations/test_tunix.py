"""The ``tunix-*`` presets against Tunix's own model classes (``google-tunix``) and
transformers' real ones, tiny configs, both directions: a Hugging Face directory
(``save_pretrained``) loads into the Tunix model with the same logits; a Tunix model exports to
a directory that ``from_pretrained`` loads (no missing or unexpected keys) with the same
logits. Float32; tied embeddings where Tunix's config has them; Qwen 3 MoE too; Qwen 2 and the
Gemma family (Gemma 2 as Tunix's ``gemma``, Gemma 3, Gemma 4 with its global layers' own heads,
a key for a value, per-layer inputs, MoE and KV-shared layers), whose exports load back
bit for bit and which Tunix's own loaders (``models/<family>/params_safetensors.py``) read into
the same parameters."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402
import tunix_models  # noqa: E402

LLAMA3, QWEN3 = tunix_models.model_modules()
IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))
# Tunix's attention applies RoPE with its default base (1e6) whatever ModelConfig.rope_theta
# says, so the Hugging Face configs use that base.
ROPE_THETA = 1_000_000
# transformers and Tunix compute in float32 in different orders (logits of order 1)
ATOL = 1e-6


SIZES = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=96,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
)


@pytest.fixture(autouse=True)
def _tunix_flags():
    with tunix_models.tunix_flags():
        yield


def hf_config(kind, tied):
    common = dict(
        **SIZES,
        intermediate_size=64,
        tie_word_embeddings=tied,
    )
    if kind == "qwen3-moe":  # Tunix's MoE normalises the top-k routing weights
        return transformers.Qwen3MoeConfig(
            **SIZES,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=tied,
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.LlamaConfig(**common)


def tunix_model(kind, config, seed=1):
    """Tunix's model class for the Hugging Face ``config``."""
    sizes = dict(
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        embed_dim=config.hidden_size,
        hidden_dim=getattr(config, "moe_intermediate_size", config.intermediate_size),
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_key_value_heads,
        rope_theta=ROPE_THETA,
        norm_eps=config.rms_norm_eps,
    )
    if kind.startswith("qwen3"):
        experts = dict(
            num_experts=getattr(config, "num_experts", None),
            num_experts_per_tok=getattr(config, "num_experts_per_tok", None),
        )
        cfg = QWEN3.ModelConfig(**sizes, **experts, use_tied_embedding=config.tie_word_embeddings)
        return QWEN3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    cfg = LLAMA3.ModelConfig(**sizes, weight_tying=config.tie_word_embeddings)
    return LLAMA3.Llama3(cfg, rngs=nnx.Rngs(seed))


def forward(model):
    b, t = IDS.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    logits, _ = model(jnp.asarray(IDS), positions, None, mask)
    return logits


def tunix_logits(model):
    return np.asarray(forward(model), np.float32)


def hf_logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


def mapping_for(kind, config):
    return osf.preset_mapping(
        "tunix-" + kind.removesuffix("-moe"),
        head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def randomize(model, seed):
    """Weights of the scale transformers initialises (std 0.02) and norms that are not ones,
    so that a wrong transpose, head split or norm mapping cannot pass."""
    for index, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var.get_value()
        if path[-2].endswith("norm"):
            var.set_value(jnp.ones_like(value) + 0.1 * jnp.arange(value.shape[0]) / value.shape[0])
        else:
            key = jax.random.key(seed * 1000 + index)
            var.set_value(0.02 * jax.random.normal(key, value.shape, value.dtype))


KINDS = [
    ("llama3", False),
    ("llama3", True),
    ("qwen3", False),
    ("qwen3", True),
    ("qwen3-moe", False),
]


@pytest.mark.parametrize("kind, tied", KINDS)
def test_hf_directory_into_tunix_model_same_logits(tmp_dir, kind, tied):
    config = hf_config(kind, tied)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms that are not ones
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.arange(p.shape[0]) / p.shape[0])
    hf.save_pretrained(tmp_dir / "hf")
    model = tunix_model(kind, config)
    report = osf.load_pytorch(model, tmp_dir / "hf", mapping_for(kind, config))
    assert report.ok, report.problems()
    want = hf_logits(hf)
    got = tunix_logits(model)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    if kind == "qwen3":
        q_norm = model.layers[1].attn.q_norm.w[...]
        np.testing.assert_array_equal(
            q_norm, hf.model.layers[1].self_attn.q_norm.weight.detach().numpy()
        )


@pytest.mark.parametrize("kind, tied", KINDS)
def test_tunix_model_exports_to_transformers_same_logits(tmp_dir, kind, tied):
    config = hf_config(kind, tied)
    model = tunix_model(kind, config, seed=2)
    randomize(model, seed=2)
    report = osf.export_pytorch(
        model, tmp_dir / "hf", mapping_for(kind, config), hf_config=config, max_file_size=20_000
    )
    assert report.ok, report.problems()
    written = {k for _, k in report.moved}
    assert ("lm_head.weight" in written) == (not tied)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_dir / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    classes = {"llama3": "Llama", "qwen3": "Qwen3", "qwen3-moe": "Qwen3Moe"}
    assert type(hf).__name__ == classes[kind] + "ForCausalLM"
    hf_models.assert_outputs_close(hf_logits(hf.eval()), tunix_logits(model), rtol=0, atol=ATOL)


def test_tunix_round_trip_is_exact(tmp_dir):
    """HF directory -> Tunix model -> export: the same tensors, bit for bit."""
    config = hf_config("qwen3", tied=False)
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_dir / "orig")
    model = tunix_model("qwen3", config)
    mapping = mapping_for("qwen3", config)
    osf.load_pytorch(model, tmp_dir / "orig", mapping)
    osf.export_pytorch(model, tmp_dir / "back", mapping, hf_config=config)
    orig = osf.load_file(tmp_dir / "orig" / "model.safetensors")
    back = osf.load_file(tmp_dir / "back" / "model.safetensors")
    assert sorted(orig) == sorted(back)
    for key in orig:
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(orig[key]), err_msg=key)


def test_tunix_preset_needs_head_dim_and_reports_a_wrong_one(tmp_dir):
    with pytest.raises(ValueError, match="head_dim"):
        osf.preset_mapping("tunix-llama3")
    config = hf_config("llama3", tied=False)
    torch.manual_seed(4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_dir / "hf")
    model = tunix_model("llama3", config)
    wrong = osf.preset_mapping("tunix-llama3", head_dim=16)
    with pytest.raises(osf.TargetMismatchError, match=r"q_proj\.weight .*\[32, 2, 16\]"):
        osf.load_pytorch(model, tmp_dir / "hf", wrong)


def test_tunix_checkpoint_exported_by_the_command_line(tmp_dir, capsys):
    """A Tunix model's nnx.State in a CheckpointManager step -> ``orbax-safetensors export
    --mapping tunix-qwen3`` (head_dim from --hf-config) -> transformers, same logits."""
    config = hf_config("qwen3", tied=True)
    model = tunix_model("qwen3", config, seed=5)
    randomize(model, seed=5)
    config.save_pretrained(tmp_dir / "config")
    with ocp.CheckpointManager(tmp_dir / "ckpt") as mngr:
        mngr.save(7, args=ocp.args.Composite(model=osf.SafetensorsSave(nnx.state(model))))
        mngr.wait_until_finished()
    argv = ["export", tmp_dir / "ckpt", tmp_dir / "hf", "--mapping", "tunix-qwen3"]
    assert cli.main([str(a) for a in argv]) == 2
    assert "needs --hf-config with head_dim" in capsys.readouterr().err
    assert cli.main([str(a) for a in [*argv, "--hf-config", tmp_dir / "config"]]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_dir / "hf").eval()
    hf_models.assert_outputs_close(hf_logits(hf), tunix_logits(model), rtol=0, atol=ATOL)


# --------------------------------------------------------------------------- Gemma, Qwen 2


def randomize_all(model, seed):
    """Every weight random, norms around one, except Gemma 4's pre-MoE norm: Tunix 0.1.7
    routes the experts from the hidden state after it, transformers from the one before it
    (each normalised), which agree only where that norm's weights are all alike. (From numpy:
    nothing compiles per shape.)"""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        noise = 0.1 * rng.standard_normal(value.shape)
        if "moe_pre_ffw_norm" in path:
            noise = np.ones(value.shape)
        elif any("norm" in str(p) for p in path) or "skip_scale" in path:
            noise = 1.0 + noise
        var.set_value(jnp.asarray(noise, value.dtype))


def jit_logits(model):
    """:func:`tunix_logits` compiled once (run eagerly, each operation compiles alone)."""
    return np.asarray(_jit_forward(model), np.float32)


_jit_forward = nnx.jit(forward)


@pytest.mark.parametrize("case", tunix_models.TINY)
def test_gemma_and_qwen2_export_to_transformers_and_load_back(tmp_dir, case):
    """A Tunix model exports to a directory that ``from_pretrained`` loads with its logits;
    what that transformers model's ``save_pretrained`` writes loads into a fresh Tunix model
    (the same logits) whose export is the export's files, bit for bit; Tunix's own loader
    reads the export into the model's parameters."""
    config, model, mapping = tunix_models.tiny(case, seed=2)
    randomize_all(model, seed=2)
    report = osf.export_pytorch(model, tmp_dir / "hf", mapping, hf_config=config)
    assert report.ok, report.problems()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_dir / "hf", output_loading_info=True
    )
    assert not any(info.values()), info
    want = jit_logits(model)
    assert np.abs(want).max() > 0.1
    hf_models.assert_outputs_close(hf_logits(hf.eval()), want, rtol=0, atol=1e-5)

    hf.save_pretrained(tmp_dir / "saved")  # (transformers' own files)
    _, fresh, _ = tunix_models.tiny(case, seed=3)
    assert osf.load_pytorch(fresh, tmp_dir / "saved", mapping).ok
    hf_models.assert_outputs_close(jit_logits(fresh), want, rtol=0, atol=1e-5)
    osf.export_pytorch(fresh, tmp_dir / "back", mapping, hf_config=config)
    for name in ("hf", "back"):
        files = sorted((tmp_dir / name).glob("*.safetensors"))
        assert len(files) == 1
    original, back = (osf.load_file(tmp_dir / n / "model.safetensors") for n in ("hf", "back"))
    assert sorted(original) == sorted(back)
    for key in original:
        np.testing.assert_array_equal(np.asarray(back[key]), np.asarray(original[key]), key)
    assert_tunix_reads(case, model, mapping, config, tmp_dir / "hf")


# Tunix 0.1.7's own readers of Hugging Face files, the reference of the presets' names
TUNIX_LOADERS = {
    "gemma": "gemma.params_safetensors",
    "gemma3": "gemma3.params_safetensors",
    "qwen2": "qwen2.params",
    "gemma4": "gemma4.params_safetensors",
}


def assert_tunix_reads(case, model, mapping, config, directory):
    """Tunix's own loader (``create_model_from_safe_tensors``) reads the export into a model
    whose every parameter equals ``model``'s, bit for bit. Tunix's Gemma 4 loader reads only
    ``Gemma4ForConditionalGeneration``'s names (``model.language_model.*``), which the preset
    reads too: that check exports in those names (the preset's rules for them put first)."""
    family = case.split("-")[0]
    if case == "gemma4-shared":  # (Tunix 0.1.7 wants a k_norm in every layer, which
        return  # transformers 5's KV-shared layers do not have)
    try:
        loader = importlib.import_module("tunix.models." + TUNIX_LOADERS[family])
    except ImportError as e:
        pytest.skip(f"Tunix's own loader does not import here: {e}")
    if family == "gemma4":
        rules = sorted(mapping.rules, key=lambda r: not r.torch.startswith("model.language_model."))
        mapping = osf.KeyMapping(
            rules, ignore_torch=mapping.ignore_torch, ignore_flax=mapping.ignore_flax
        )
        directory = directory.parent / "for_tunix"
        assert osf.export_pytorch(model, directory, mapping, hf_config=config).ok
    read = loader.create_model_from_safe_tensors(str(directory), model.config)
    want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(read, nnx.Param)))
    assert sorted(got) == sorted(want)
    for path, var in want.items():
        value = np.asarray(var.get_value())
        np.testing.assert_array_equal(np.asarray(got[path].get_value()), value, str(path))
