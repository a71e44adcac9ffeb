"""The presets of plain transformers architectures (issue 42 point 6): Mistral, Phi-3, Gemma 3
(``Gemma3ForCausalLM``), Mixtral, Qwen 2 MoE and Qwen 3 MoE, each with transformers' own model
class (tiny random configs built in code, every weight moved off its initial value).

For each: the directory ``save_pretrained`` wrote loads into the preset's JAX layout (the
tensors equal the transformers model's own, transposed for kernels; MoE experts stacked
``(experts, in, out)``, equal to the slices of transformers 5's fused in-memory
``mlp.experts.gate_up_proj``); the JAX state goes through an async CheckpointManager; it is
exported four ways (the pytree, the checkpoint root, the CLI, a servable item) and each
export loads in ``from_pretrained`` without missing or unexpected keys, with float32 logits
bit-identical to the original model's, and the small files of a complete model directory
(``config.json`` and ``generation_config.json`` equal to ``save_pretrained``'s, the
tokenizer's files)."""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402
import safetensors  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))

# (preset, tied embeddings: each family's usual choice; Gemma 3 ties by default)
CASES = [
    ("mistral", False),
    ("phi3", False),
    ("gemma3", True),
    ("mixtral", False),
    ("qwen2-moe", False),
    ("qwen3-moe", True),
]

# What the JAX layout holds for layer 0 of each (tiny: embed 32, 4 experts of hidden 16).
LAYOUT = {
    "mistral": {"model.layers.0.self_attn.k_proj.kernel": (32, 16)},
    "phi3": {
        "model.layers.0.self_attn.qkv_proj.kernel": (32, 64),
        "model.layers.0.mlp.gate_up_proj.kernel": (32, 128),
    },
    "gemma3": {
        "model.layers.0.self_attn.q_norm.scale": (8,),
        "model.layers.0.pre_feedforward_layernorm.scale": (32,),
        "model.layers.0.post_feedforward_layernorm.scale": (32,),
    },
    "mixtral": {
        "model.layers.0.mlp.gate.kernel": (32, 4),
        "model.layers.0.mlp.experts.gate_proj": (4, 32, 64),
        "model.layers.0.mlp.experts.down_proj": (4, 64, 32),
    },
    "qwen2-moe": {
        "model.layers.0.mlp.gate.kernel": (32, 4),
        "model.layers.0.mlp.experts.up_proj": (4, 32, 16),
        "model.layers.0.mlp.shared_expert.gate_proj.kernel": (32, 24),
        "model.layers.0.mlp.shared_expert_gate.kernel": (32, 1),
        "model.layers.0.self_attn.q_proj.bias": (32,),
    },
    "qwen3-moe": {
        "model.layers.0.mlp.experts.down_proj": (4, 16, 32),
        "model.layers.0.self_attn.k_norm.scale": (8,),
    },
}


def logits(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


def loads_with_logits(directory, want):
    """transformers loads every tensor of ``directory``, and its logits are ``want``'s bits."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    np.testing.assert_array_equal(logits(model.eval()), want)


def is_complete(directory, original):
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` wrote them, and
    the tokenizer's files, byte for byte."""
    for name in ("config.json", "generation_config.json"):
        got = json.loads((directory / name).read_text())
        assert got == json.loads((original / name).read_text()), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (directory / name).read_bytes() == (original / name).read_bytes(), name


def abstract_layout(directory, mapping):
    """The JAX layout of the directory's tensors through ``mapping``, as a nested tree of
    ``jax.ShapeDtypeStruct``s: each key's tensor transformed by its rule, the keys a stacked
    rule joins stacked on axis 0."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    with safetensors.safe_open(str(directory / "model.safetensors"), "np") as f:
        for key in sorted(f.keys()):
            name, transform = mapping.to_flax(key)
            probe = np.zeros(f.get_slice(key).get_shape(), np.float32)
            shapes.setdefault(name, []).append(transform.to_flax(probe).shape)
    tree: dict = {}
    for name, parts in shapes.items():
        shape = parts[0] if len(parts) == 1 else (len(parts), *parts[0])
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, np.float32)
    return tree


def flat(tree):
    return {
        ".".join(str(k.key) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def same_as_in_memory(jax_state, hf, mapping, num_experts):
    """Every JAX tensor equals the transformers model's own parameter (a kernel its weight
    transposed); stacked experts equal the slices of transformers 5's fused experts."""
    memory = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, value in jax_state.items():
        if ".mlp.experts." in name:
            layer, part = name.split(".mlp.experts.")
            assert value.shape[0] == num_experts, name
            if f"{layer}.mlp.experts.gate_up_proj" in memory:  # transformers 5: fused in memory
                fused = memory[f"{layer}.mlp.experts.gate_up_proj"]  # (experts, 2 * hidden, in)
                half = fused.shape[1] // 2
                want = {
                    "gate_proj": fused[:, :half],
                    "up_proj": fused[:, half:],
                    "down_proj": memory[f"{layer}.mlp.experts.down_proj"],
                }[part]
                np.testing.assert_array_equal(value, np.swapaxes(want, 1, 2), name)
            continue
        key, _ = mapping.to_torch(name)
        key = key.replace(".block_sparse_moe.", ".mlp.")  # (Mixtral's router, in memory)
        want = memory[key]
        np.testing.assert_array_equal(value, want.T if name.endswith(".kernel") else want, name)


@pytest.mark.parametrize("preset, tied", CASES)
def test_preset_round_trips_through_jax_four_ways(tmp_dir, capsys, preset, tied):
    config = hf_models.tiny_config(preset, tied=tied)
    torch.manual_seed(0)
    hf = hf_models.randomize_torch(
        transformers.AutoModelForCausalLM.from_config(config).eval(), seed=1
    )
    original = tmp_dir / "original"
    hf.save_pretrained(original)
    hf_models.tiny_tokenizer().save_pretrained(original)
    want = logits(hf)

    mapping = osf.preset_mapping(preset, tie_word_embeddings=tied)
    state, report = osf.load_pytorch(
        abstract_layout(original, mapping), original, mapping, with_report=True
    )
    assert report.ok, report.problems()
    jax_state = flat(state)
    for name, shape in LAYOUT[preset].items():
        assert jax_state[name].shape == shape, name
    assert ("lm_head.kernel" in jax_state) == (not tied)
    experts = getattr(config, "num_local_experts", getattr(config, "num_experts", 0))
    same_as_in_memory(jax_state, hf, mapping, experts)

    root = tmp_dir / "run"
    with ocp.CheckpointManager(root) as mngr:  # async
        mngr.save(
            7,
            args=ocp.args.Composite(
                state=osf.SafetensorsSave(state),
                served=osf.SafetensorsSave(state, mapping=mapping, hf_config=original),
            ),
        )
        mngr.wait_until_finished()

    fresh = type(config)(**config.to_dict())  # (save_pretrained set the model's dtype)
    assert osf.export_pytorch(state, tmp_dir / "pytree", mapping, hf_config=fresh).ok
    assert osf.export_pytorch(root, tmp_dir / "root", mapping, hf_config=original, item="state").ok
    argv = ["export", root, tmp_dir / "cli", "--mapping", preset, "--hf-config", original]
    assert cli.main([str(a) for a in [*argv, "--item", "state"]]) == 0, capsys.readouterr()
    for out in ("pytree", "root", "cli", "run/7/served"):
        loads_with_logits(tmp_dir / out, want)
        if out != "pytree":  # (a config object: no tokenizer)
            is_complete(tmp_dir / out, original)
    for name in ("config.json", "generation_config.json"):  # save_pretrained's own
        got = json.loads((tmp_dir / "pytree" / name).read_text())
        assert got == json.loads((original / name).read_text()), name


def test_a_dense_preset_names_the_moe_keys_it_cannot_map(tmp_dir):
    """The issue's report: ``qwen2`` on a Qwen 2 MoE directory names the router and shared
    expert gate; ``qwen2-moe`` maps them."""
    config = hf_models.tiny_config("qwen2-moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_dir / "moe")
    with pytest.raises(osf.TargetMismatchError, match=r"mlp\.shared_expert_gate\.weight"):
        osf.load_pytorch(
            abstract_layout(tmp_dir / "moe", osf.preset_mapping("qwen2-moe")),
            tmp_dir / "moe",
            osf.preset_mapping("qwen2"),
        )


def test_presets_for_plain_architectures_are_listed():
    from orbax_safetensors._src.integrations import presets

    for name in ("mistral", "gemma3", "phi3", "mixtral", "qwen2-moe", "qwen3-moe"):
        assert name in presets.PRESETS
        assert osf.preset_mapping(name).rules
    mixtral = osf.preset_mapping("mixtral")
    assert mixtral.to_torch("model.layers.3.mlp.experts.up_proj")[0] == (
        "model.layers.3.block_sparse_moe.experts.0.w3.weight"
    )
    assert mixtral.to_flax("model.layers.3.block_sparse_moe.gate.weight")[0] == (
        "model.layers.3.mlp.gate.kernel"
    )
