"""``load_pytorch`` into any target (issue 28 point 4): plain dicts, Linen-style params,
``nnx.State``, abstract trees of ``jax.ShapeDtypeStruct`` with shardings (8 CPU devices, see
conftest.py), stacked layers and fused projections, tied embeddings; from a file, a Hugging
Face directory (sharded or not) or its index JSON; errors that name keys and shapes."""

from __future__ import annotations

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


def nested(flat):
    return traverse_util.unflatten_dict(flat, sep=".")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A seeded transformers LLaMA saved whole and sharded; its logits and state dict."""
    root = tmp_path_factory.mktemp("ref")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_models.tiny_config()).eval()
    hf.save_pretrained(root / "whole")
    hf.save_pretrained(root / "sharded", max_shard_size="40KB")
    with torch.no_grad():
        logits = hf(torch.from_numpy(IDS)).logits.numpy()
    weights = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return root, logits, weights


def model_names():
    model = hf_models.CausalLM(hf_models.tiny_config(), rngs=nnx.Rngs(0))
    return {
        ".".join(map(str, path)): var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize("where", ["whole", "sharded", "index", "file"])
def test_plain_dict_of_numpy_from_every_path_form(reference, where):
    root, _, weights = reference
    path = {
        "whole": root / "whole",
        "sharded": root / "sharded",
        "index": root / "sharded" / "model.safetensors.index.json",
        "file": root / "whole" / "model.safetensors",
    }[where]
    target = nested({n: np.zeros(v.shape, np.float32) for n, v in model_names().items()})
    got = osf.load_pytorch(target, path, osf.preset_mapping("llama"))
    assert jax.tree.structure(got) == jax.tree.structure(target)
    q = got["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert isinstance(q, np.ndarray)
    np.testing.assert_array_equal(q, weights["model.layers.0.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(got["model"]["norm"]["scale"], weights["model.norm.weight"])


def test_linen_params_with_prefix_and_nnx_state(reference):
    root, logits, weights = reference
    names = model_names()
    params = {"params": nested({n: jnp.zeros(v.shape, v.dtype) for n, v in names.items()})}
    got = osf.load_pytorch(params, root / "whole", osf.preset_mapping("llama"), prefix="params.")
    assert set(got) == {"params"}
    embed = got["params"]["model"]["embed_tokens"]["embedding"]
    assert isinstance(embed, jax.Array)
    np.testing.assert_array_equal(embed, weights["model.embed_tokens.weight"])
    # nnx.State: the same structure back, variables kept; the model then gives the HF logits
    model = hf_models.CausalLM(hf_models.tiny_config(), rngs=nnx.Rngs(5))
    state = osf.load_pytorch(
        nnx.state(model, nnx.Param), root / "sharded", osf.preset_mapping("llama")
    )
    assert isinstance(state, nnx.State)
    nnx.update(model, state)
    hf_models.assert_outputs_close(
        np.asarray(model(jnp.asarray(IDS))), logits, rtol=1e-5, atol=1e-5
    )


def test_abstract_sharded_target(reference):
    """ShapeDtypeStruct leaves with shardings: jax.Arrays of those shardings and dtypes."""
    root, _, _ = reference
    mesh = devices.mesh((4, 2), ("data", "model"))
    abstract = nnx.eval_shape(lambda: hf_models.CausalLM(hf_models.tiny_config(), rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)

    def shard(x):
        spec = P("data", "model") if x.ndim == 2 else P("model")
        return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    target = jax.tree.map(shard, state)
    got = osf.load_pytorch(target, root / "sharded", osf.preset_mapping("llama"))
    plain = osf.load_pytorch(
        jax.tree.map(lambda x: np.zeros(x.shape, np.float32), state),
        root / "whole",
        osf.preset_mapping("llama"),
    )
    for want, value, ref in zip(
        jax.tree.leaves(target), jax.tree.leaves(got), jax.tree.leaves(plain)
    ):
        assert value.sharding == want.sharding and value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(value), ref.astype(jnp.bfloat16))


SCANNED = hf_models.scanned_llama_mapping()
SCANNED_SPECS = {
    "embed": ((96, 32), P("x", "y")),
    "qkv": ((2, 32, 64), P("x", None, "y")),
    "out": ((2, 32, 32), P(None, "y", "x")),
    "gate_up": ((2, 32, 128), P("x", "y", None)),
    "down": ((2, 64, 32), P(None, "x", "y")),
    "attn_norm": ((2, 32), P("x", "y")),
    "mlp_norm": ((2, 32), P(None, "y")),
    "norm": ((32,), P("y")),
    "head": ((32, 96), P("y", "x")),
}


def test_stacked_and_fused_abstract_sharded_target_and_restore(reference, tmp_path):
    """A scanned model's abstract params, sharded on every axis (the layer axis too): loaded
    sharded, equal to a host load; published and restored with SafetensorsRestore(target,
    mapping=) into the same shardings."""
    root, _, weights = reference
    mesh = devices.mesh((2, 4), ("x", "y"))
    target = {
        n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
        for n, (s, spec) in SCANNED_SPECS.items()
    }
    host = {n: np.zeros(s, np.float32) for n, (s, _) in SCANNED_SPECS.items()}
    got = osf.load_pytorch(target, root / "sharded", SCANNED)
    plain = osf.load_pytorch(host, root / "whole", SCANNED)
    for n in target:
        assert got[n].sharding == target[n].sharding, n
        np.testing.assert_array_equal(np.asarray(got[n]), plain[n])
    np.testing.assert_array_equal(
        plain["qkv"][1, :, 32:48], weights["model.layers.1.self_attn.k_proj.weight"].T
    )
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(0, args=osf.SafetensorsSave(got, mapping=SCANNED))
        mngr.wait_until_finished()
        back = mngr.restore(0, args=osf.SafetensorsRestore(target, mapping=SCANNED))
    for n in target:
        assert back[n].sharding == target[n].sharding, n
        np.testing.assert_array_equal(np.asarray(back[n]), plain[n])


def test_tied_embeddings_load_from_the_embedding(tmp_path):
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(hf_models.tiny_config(tied=True))
    hf.save_pretrained(tmp_path / "tied")
    target = {
        "model": {"embed_tokens": {"embedding": np.zeros((96, 32), np.float32)}},
        "lm_head": {"kernel": np.zeros((32, 96), np.float32)},
    }
    mapping = osf.KeyMapping(
        osf.preset_mapping("llama").rules, tied={"lm_head.weight": "model.embed_tokens.weight"}
    )
    got = osf.load_pytorch(target, tmp_path / "tied", mapping, strict=False)
    embed = got["model"]["embed_tokens"]["embedding"]
    np.testing.assert_array_equal(got["lm_head"]["kernel"], embed.T)
    assert np.abs(embed).sum() > 0


def test_errors_name_keys_and_shapes(reference):
    root, _, _ = reference
    names = model_names()
    flat = {n: np.zeros(v.shape, np.float32) for n, v in names.items()}
    flat["model.layers.0.mlp.up_proj.kernel"] = np.zeros((32, 65), np.float32)  # not (32, 64)
    del flat["model.norm.scale"]  # the file has it: unexpected
    flat["extra.kernel"] = np.ones((3,), np.float32)  # nothing fills it: missing
    with pytest.raises(osf.TargetMismatchError) as e:
        osf.load_pytorch(nested(flat), root / "whole", osf.preset_mapping("llama"))
    message = str(e.value)
    assert "model.layers.0.mlp.up_proj.weight F32[64, 32] becomes [32, 64]" in message
    assert "model.layers.0.mlp.up_proj.kernel is [32, 65]" in message
    assert "model.norm.weight -> model.norm.scale" in message
    assert "extra.kernel" in message
    got, report = osf.load_pytorch(
        nested(flat), root / "whole", osf.preset_mapping("llama"), strict=False, with_report=True
    )
    assert not report.ok and report.missing == ["extra.kernel"]
    np.testing.assert_array_equal(got["extra"]["kernel"], np.ones(3))  # as given
    assert got["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"].shape == (32, 65)
    assert np.abs(got["model"]["layers"]["0"]["mlp"]["gate_proj"]["kernel"]).sum() > 0
