"""LoRA as Tunix users apply it, merged on export (issue 42 points 7-8; issue 40 point 6):
qwix's ``LoraProvider`` (Tunix's LoRA tool: adapters ``w_lora_a``/``w_lora_b`` on Tunix's
einsum layers, ``kernel_lora_a``/``kernel_lora_b`` on linear layers, scaled by
``alpha / rank``) on every preset's model (the reference ports of ``tests/helpers/hf_models.py`` and
Tunix's own classes), and flax's ``nnx.LoRA(base_module=...)`` on Tunix's. Adapters are
trained to non-zero values; transformers' ``from_pretrained`` of the export computes the LoRA
model's logits, and the files equal a merge this test computes itself (and Tunix's own merged
saver's output). A Tunix Qwen 3 goes out from memory, from a checkpoint restored bit-exact
through the manager, as a servable item and through the command line, the same bytes; Tunix's
Gemma family (heads-first ``q_einsum``, one adapter pair on ``kv_einsum``) and Qwen 2 (issue 48)
from memory, from a checkpoint and through the command line.

qwix and Tunix are installed without their dependencies (``.ci/run``); the tests that need
them skip naming why where they are absent."""

from __future__ import annotations

import dataclasses
import importlib

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
import tunix_models
from flax import nnx
from lora_training import qwix_or_skip, train_adapters

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))
ROPE_THETA = 1_000_000  # (Tunix's attention applies its default base: see test_tunix.py)
PROJECTIONS = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_attn|c_proj|c_fc)"


@pytest.fixture(scope="module")
def qwix():
    return qwix_or_skip()


@pytest.fixture
def tunix():
    """Tunix's model modules ``(llama3, qwen3)``, Flax configured as they configure it."""
    with tunix_models.tunix_flags():
        yield tunix_models.model_modules()


# --------------------------------------------------------------------------- models


def tunix_config(kind):
    """The tiny Hugging Face config of Tunix's ``kind`` (``llama3``, ``qwen3``), untied."""
    config = hf_models.tiny_config("qwen3" if kind == "qwen3" else "llama")
    config.rope_parameters = {"rope_type": "default", "rope_theta": ROPE_THETA}
    config.head_dim = config.hidden_size // config.num_attention_heads
    return config


def tunix_model(modules, kind, config, seed=1):
    llama3, qwen3 = modules
    sizes = dict(
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        embed_dim=config.hidden_size,
        hidden_dim=config.intermediate_size,
        num_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_key_value_heads,
        rope_theta=ROPE_THETA,
        norm_eps=config.rms_norm_eps,
    )
    if kind == "qwen3":
        config = qwen3.ModelConfig(**sizes, use_tied_embedding=False)
        model = qwen3.Qwen3(config, rngs=nnx.Rngs(seed))
    else:
        model = llama3.Llama3(llama3.ModelConfig(**sizes, weight_tying=False), rngs=nnx.Rngs(seed))
    # Tunix initialises its MLP kernels to zeros (an adapter there would learn nothing):
    # weights of the scale transformers initialises.
    for index, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var.get_value()
        if value.ndim > 1:
            key = jax.random.key(seed * 1000 + index)
            var.set_value(0.02 * jax.random.normal(key, value.shape, value.dtype))
    return model


def tunix_inputs():
    """A Tunix model's inputs for :data:`IDS`: ``(tokens, positions, cache, attention mask)``."""
    b, t = IDS.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return jnp.asarray(IDS), positions, None, mask


def tunix_logits(model):
    return model(*tunix_inputs())[0]


def port_logits(model):
    return model(jnp.asarray(IDS))


def hf_logits(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(torch.from_numpy(IDS)).logits.float().numpy()


def with_qwix(qwix, model, rank, alpha, *inputs, module_path=PROJECTIONS, **kw_inputs):
    """``model`` with qwix's LoRA of ``rank`` and ``alpha`` on its projections (Tunix's
    recipe: ``qwix.apply_lora_to_model``), its adapters created."""
    provider = qwix.LoraProvider(module_path=module_path, rank=rank, alpha=alpha)
    return qwix.apply_lora_to_model(model, provider, *inputs, rngs=nnx.Rngs(3), **kw_inputs)


def model_for(preset, request):
    """``(hf_config, model, logits function, mapping without lora_scale)`` of ``preset``."""
    if preset.startswith("tunix-"):
        kind = preset.removeprefix("tunix-")
        config = tunix_config(kind)
        model = tunix_model(request.getfixturevalue("tunix"), kind, config)
        return config, model, tunix_logits, osf.preset_mapping(preset, head_dim=config.head_dim)
    config = hf_models.tiny_config(preset)
    if preset == "gpt2":
        model = hf_models.Gpt2LM(config, rngs=nnx.Rngs(1))
    else:
        model = hf_models.CausalLM(config, preset, rngs=nnx.Rngs(1))
    return config, model, port_logits, osf.preset_mapping(preset)


# --------------------------------------------------------------------------- the test's merge


def flat_params(model):
    return {
        ".".join(map(str, path)): np.asarray(var.get_value() if hasattr(var, "get_value") else var)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def merged_by_hand(params, scale):
    """Each kernel ``W`` plus ``scale * W_lora_a @ W_lora_b`` (contracted over the rank,
    reshaped to ``W``), in float64, then in ``W``'s dtype; the adapters dropped."""
    out = {}
    for name, value in params.items():
        if name.endswith(("_lora_a", "_lora_b")):
            continue
        a, b = params.get(name + "_lora_a"), params.get(name + "_lora_b")
        if a is not None:
            delta = np.tensordot(a.astype(np.float64), b.astype(np.float64), axes=1)
            value = (value.astype(np.float64) + scale * delta.reshape(value.shape)).astype(
                value.dtype
            )
        out[name] = value
    return out


def assert_files_close(got_dir, want_dir, exact=()):
    got = safetensors.numpy.load_file(str(got_dir / "model.safetensors"))
    want = safetensors.numpy.load_file(str(want_dir / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key in got:
        if key in exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:  # (the merges' sums in another order: float32 rounding)
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)


# --------------------------------------------------------------------------- every preset


@pytest.mark.parametrize(
    "preset, rank, alpha",
    [
        ("llama", 4, 8.0),
        ("qwen2", 1, 2.0),
        ("qwen3", 8, 4.0),
        ("gpt2", 2, 8.0),
        ("tunix-llama3", 4, 8.0),
        ("tunix-qwen3", 3, 6.0),
    ],
)
def test_qwix_lora_exports_through_every_preset(tmp_dir, qwix, request, preset, rank, alpha):
    config, model, logits, mapping = model_for(preset, request)
    inputs = model.get_model_input() if preset.startswith("tunix-") else {}
    lora_model = with_qwix(qwix, model, rank, alpha, *([] if inputs else [IDS]), **inputs)
    train_adapters(lora_model, logits)
    params = flat_params(lora_model)
    adapters = sorted(n for n in params if n.endswith(("_lora_a", "_lora_b")))
    assert adapters and any(n.endswith("kernel_lora_a") or n.endswith("w_lora_a") for n in adapters)
    scaled = osf.preset_mapping(
        preset, head_dim=getattr(config, "head_dim", None) if "tunix" in preset else None,
        lora_scale=alpha / rank,
    )  # fmt: skip
    report = osf.export_pytorch(lora_model, tmp_dir / "hf", scaled, hf_config=config)
    assert report.ok, report.problems()
    assert sorted(a for a, _ in report.merged) == adapters
    want = np.asarray(logits(lora_model))
    assert np.abs(want - np.asarray(logits(model))).max() > 1e-2  # the fine-tune shows
    hf_models.assert_outputs_close(hf_logits(tmp_dir / "hf"), want, rtol=2e-5, atol=2e-5)
    by_hand = merged_by_hand(params, alpha / rank)
    assert osf.export_pytorch(by_hand, tmp_dir / "by_hand", mapping, hf_config=config).ok
    assert_files_close(tmp_dir / "hf", tmp_dir / "by_hand")


# --------------------------------------------------------------------------- a Tunix Qwen 3


@pytest.fixture
def tunix_qwen3_lora(qwix, tunix):
    """Issue 42's model: a Tunix Qwen 3 with qwix's LoRA (rank 4, alpha 8) on q/k/v/o and
    gate/up/down, trained: ``(hf_config, base model, LoRA model)``."""
    config = tunix_config("qwen3")
    base = tunix_model(tunix, "qwen3", config, seed=5)
    lora_model = with_qwix(qwix, base, 4, 8.0, **base.get_model_input())
    train_adapters(lora_model, tunix_logits)
    return config, base, lora_model


def test_tunix_qwen3_lora_from_memory_checkpoint_servable_item_and_cli(
    tmp_dir, tunix_qwen3_lora, capsys
):
    config, _, lora_model = tunix_qwen3_lora
    mapping = osf.preset_mapping("tunix-qwen3", head_dim=8, lora_scale=2.0)
    report = osf.export_pytorch(lora_model, tmp_dir / "memory", mapping, hf_config=config)
    assert report.ok and len(report.merged) == 2 * 7 * 2  # 7 projections in 2 layers
    want = np.asarray(tunix_logits(lora_model))
    hf_models.assert_outputs_close(hf_logits(tmp_dir / "memory"), want, rtol=2e-5, atol=2e-5)
    memory = (tmp_dir / "memory" / "model.safetensors").read_bytes()

    # Trained, checkpointed, restored bit-exact through the manager, exported from the
    # checkpoint: the same bytes.
    state = nnx.state(lora_model)
    with ocp.CheckpointManager(tmp_dir / "ckpt") as mngr:
        mngr.save(3, args=ocp.args.Composite(model=osf.SafetensorsSave(state)))
        mngr.wait_until_finished()
        abstract = jax.tree.map(jnp.zeros_like, state)
        back = mngr.restore(3, args=ocp.args.Composite(model=osf.SafetensorsRestore(abstract)))
    for (path, x), (_, y) in zip(nnx.to_flat_state(state), nnx.to_flat_state(back.model)):
        np.testing.assert_array_equal(np.asarray(y.get_value()), np.asarray(x.get_value()), path)
    osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "from_ckpt", mapping, hf_config=config)
    assert (tmp_dir / "from_ckpt" / "model.safetensors").read_bytes() == memory

    # The command line: --lora-scale, needed for qwix's adapters.
    config.save_pretrained(tmp_dir / "config")
    argv = [
        "export", tmp_dir / "ckpt", tmp_dir / "cli", "--mapping", "tunix-qwen3",
        "--hf-config", tmp_dir / "config",
    ]  # fmt: skip
    assert cli.main([str(a) for a in argv]) == 2
    assert "--lora-scale" in capsys.readouterr().err
    assert cli.main([str(a) for a in [*argv, "--lora-scale", "2"]]) == 0
    assert (tmp_dir / "cli" / "model.safetensors").read_bytes() == memory

    # A servable item of every save: the same tensors.
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_dir / "run", options=options) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(state, mapping=mapping, hf_config=config))
    served = tmp_dir / "run" / "0" / "default"
    written = safetensors.numpy.load_file(str(tmp_dir / "memory" / "model.safetensors"))
    assert_files_close(served, tmp_dir / "memory", exact=set(written))
    hf_models.assert_outputs_close(hf_logits(served), want, rtol=2e-5, atol=2e-5)


def test_tunix_qwen3_lora_equals_tunixs_own_merged_saver(tmp_dir, tunix_qwen3_lora, monkeypatch):
    """Tunix's ``qwen3.params.save_lora_merged_model_as_safetensors`` merges into a base
    model's files: the same tensors (its merge is one XLA matmul: float32 rounding apart), the
    unadapted ones bit for bit."""
    config, base, lora_model = tunix_qwen3_lora
    try:
        params = importlib.import_module("tunix.models.qwen3.params")
        saver = importlib.import_module("tunix.models.safetensors_saver")
    except ImportError as e:
        pytest.skip(f"Tunix's merged saver does not import here: {e}")
    # (Tunix adds its jax.numpy deltas to numpy arrays in place, which gives jax.Arrays on
    # this jax, and safetensors.numpy then needs numpy: converted, values untouched.)
    save_file = saver.safe_np.save_file
    monkeypatch.setattr(
        saver.safe_np,
        "save_file",
        lambda tensors, path: save_file({k: np.asarray(v) for k, v in tensors.items()}, path),
    )
    plain = osf.preset_mapping("tunix-qwen3", head_dim=8)
    osf.export_pytorch(base, tmp_dir / "base", plain, hf_config=config)
    params.save_lora_merged_model_as_safetensors(
        str(tmp_dir / "base"), str(tmp_dir / "tunix"), lora_model, rank=4, alpha=8.0
    )
    mapping = osf.preset_mapping("tunix-qwen3", head_dim=8, lora_scale=2.0)
    osf.export_pytorch(lora_model, tmp_dir / "ours", mapping, hf_config=config)
    adapted = {f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    )}  # fmt: skip
    ours = safetensors.numpy.load_file(str(tmp_dir / "ours" / "model.safetensors"))
    assert_files_close(tmp_dir / "ours", tmp_dir / "tunix", exact=set(ours) - adapted)


def test_flax_lora_wrapper_on_tunix_layers_exports_with_the_tunix_presets(tmp_dir, tunix):
    """Issue 42: ``nnx.LoRA(base_module=...)`` on a Tunix model's ``down_proj`` failed with
    every preset (``no rule maps ...down_proj.base_module.kernel``)."""
    for kind in ("llama3", "qwen3"):
        config = tunix_config(kind)
        model = tunix_model(tunix, kind, config, seed=6)
        for layer in model.layers:
            down = layer.mlp.down_proj
            layer.mlp.down_proj = nnx.LoRA(64, 2, 32, base_module=down, rngs=nnx.Rngs(4))
        train_adapters(model, tunix_logits)
        mapping = osf.preset_mapping("tunix-" + kind, head_dim=8)
        report = osf.export_pytorch(model, tmp_dir / kind, mapping, hf_config=config)
        assert report.ok, report.problems()
        assert len(report.merged) == 4
        np.testing.assert_allclose(
            hf_logits(tmp_dir / kind), np.asarray(tunix_logits(model)), rtol=2e-5, atol=2e-5
        )


# --------------------------------------------------------------------------- Gemma, Qwen 2


def random_adapters(model, seed):
    """``model``'s LoRA adapters made random, from numpy (no compile per shape): non-zero, as
    trained ones are, so that a merge that dropped them would show. (Tunix's tiny models,
    ``tunix_models.tiny``, have random kernels and their norms alike, as Gemma 4's pre-MoE
    norm must be: see test_tunix.py.)"""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = var.get_value()
        var.set_value(jnp.asarray(0.1 * rng.standard_normal(value.shape), value.dtype))


@pytest.mark.parametrize(
    "case, rank, alpha",
    [("gemma", 3, 6.0), ("gemma3", 4, 8.0), ("qwen2", 3, 6.0), ("gemma4", 2, 4.0)],
)  # fmt: skip
def test_qwix_lora_on_tunix_gemma_and_qwen2_from_memory_checkpoint_and_cli(
    tmp_dir, qwix, tunix, case, rank, alpha
):
    """qwix's LoRA on every projection, Gemma's heads-first einsums too (``q_einsum``'s
    adapters ``(embed, r)`` and ``(r, heads, head_dim)``, ``kv_einsum``'s one pair for keys
    and values together, ``b`` ``(r, 2, kv_heads, head_dim)``), merged on export:
    ``from_pretrained`` gives the LoRA model's logits; a CheckpointManager step of it exported
    from Python and by the command line, the same bytes."""
    config, model, mapping = tunix_models.tiny(case, seed=7)
    # (qwix runs the model once, eagerly: on the logits' inputs, whose operations it compiles)
    inputs = tunix_inputs()
    lora_model = with_qwix(qwix, model, rank, alpha, *inputs, module_path=".*(_proj|_einsum)")
    random_adapters(lora_model, seed=7)
    params = flat_params(lora_model)
    adapters = sorted(n for n in params if n.endswith(("_lora_a", "_lora_b")))
    if case != "qwen2":  # (layer 0: 4 heads, 2 key/value heads of 8, embed 32)
        attn = "layers.0.attn."
        assert params[attn + "q_einsum.w"].shape == (4, 32, 8)
        assert params[attn + "q_einsum.w_lora_a"].shape == (32, rank)
        assert params[attn + "q_einsum.w_lora_b"].shape == (rank, 4, 8)
        assert params[attn + "kv_einsum.w"].shape == (2, 2, 32, 8)
        assert params[attn + "kv_einsum.w_lora_a"].shape == (32, rank)
        assert params[attn + "kv_einsum.w_lora_b"].shape == (rank, 2, 2, 8)
    scaled = dataclasses.replace(mapping, lora_scale=alpha / rank)
    report = osf.export_pytorch(lora_model, tmp_dir / "memory", scaled, hf_config=config)
    assert report.ok, report.problems()
    assert sorted(a for a, _ in report.merged) == adapters
    want = np.asarray(tunix_logits(lora_model))
    hf_models.assert_outputs_close(hf_logits(tmp_dir / "memory"), want, rtol=2e-5, atol=2e-5)

    with ocp.CheckpointManager(tmp_dir / "ckpt") as mngr:
        mngr.save(1, args=ocp.args.Composite(model=osf.SafetensorsSave(nnx.state(lora_model))))
        mngr.wait_until_finished()
    memory = (tmp_dir / "memory" / "model.safetensors").read_bytes()
    assert osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "step", scaled, hf_config=config).ok
    assert (tmp_dir / "step" / "model.safetensors").read_bytes() == memory
    config.save_pretrained(tmp_dir / "config")
    argv = ["export", tmp_dir / "ckpt", tmp_dir / "cli", "--mapping", "tunix-" + case,
            "--hf-config", tmp_dir / "config", "--lora-scale", alpha / rank]  # fmt: skip
    assert cli.main([str(a) for a in argv]) == 0
    assert (tmp_dir / "cli" / "model.safetensors").read_bytes() == memory


@pytest.mark.parametrize("case", ["gemma", "gemma3", "qwen2", "gemma4"])
def test_flax_lora_wrapper_on_tunix_gemma_and_qwen2(tmp_dir, tunix, case):
    """flax's ``nnx.LoRA(base_module=...)`` on the MLP of Tunix's Gemma and Qwen 2 models:
    merged on export, ``from_pretrained`` gives the model's logits."""
    config, model, mapping = tunix_models.tiny(case, seed=8)
    for layer in model.layers:
        down = layer.mlp.down_proj
        layer.mlp.down_proj = nnx.LoRA(64, 2, 32, base_module=down, rngs=nnx.Rngs(4))
    random_adapters(model, seed=8)
    report = osf.export_pytorch(model, tmp_dir / "hf", mapping, hf_config=config)
    assert report.ok, report.problems()
    assert len(report.merged) == 2 * len(model.layers)
    hf_models.assert_outputs_close(
        hf_logits(tmp_dir / "hf"), np.asarray(tunix_logits(model)), rtol=2e-5, atol=2e-5
    )
