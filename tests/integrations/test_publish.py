"""Publishing every step (issue 28 point 3): ``SafetensorsSave(item, mapping=, hf_config=)`` is
a CheckpointManager item that is a Hugging Face model directory. A real async manager with
retention saves a training state and a servable item per step (the RL weight-publication
recipe); transformers' own ``from_pretrained`` loads every kept step with the JAX model's
logits, ``SafetensorsRestore(target, mapping=)`` restores it exactly, and deleted steps are
gone. Tiny configs built in code, no hub downloads."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_safetensors as osf

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402
import safetensors  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


def randomize(model, seed):
    """Weights of the scale transformers initialises, norms non-trivial (a wrong norm mapping
    cannot pass)."""
    for index, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var.get_value()
        if path[-1] == "scale":
            var.set_value(value + 0.1 * jnp.arange(value.shape[0]))
        else:
            key = jax.random.key(seed * 1000 + index)
            var.set_value(0.02 * jax.random.normal(key, value.shape))


def hf_logits(directory, dtype=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


def loads_cleanly(directory):
    for f in sorted(p for p in directory.iterdir() if p.suffix == ".safetensors"):
        with safetensors.safe_open(str(f), "np") as g:
            assert g.metadata() == {"format": "pt"}
    _, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


def equal_trees(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_rl_weight_publication_recipe(tmp_dir):
    """Training state + servable item per step, async, max_to_keep=2: each kept step's
    servable item loads in transformers with the JAX logits and restores back exactly."""
    config = hf_models.tiny_config()
    model = hf_models.CausalLM(config, rngs=nnx.Rngs(0))
    mapping = osf.preset_mapping("llama")
    root = tmp_dir / "run"
    handlers = {
        "train": osf.SafetensorsCheckpointHandler(),
        "policy": osf.SafetensorsCheckpointHandler(max_file_size=20_000),  # shards + index
    }
    logits, params = {}, {}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(root, options=options, item_handlers=handlers) as mngr:
        for step in range(4):
            randomize(model, seed=step)
            state = nnx.state(model, nnx.Param)
            train_state = {"params": state, "opt": {"count": jnp.asarray(step)}}
            mngr.save(
                step,
                args=ocp.args.Composite(
                    train=osf.SafetensorsSave(train_state),
                    policy=osf.SafetensorsSave(state, mapping=mapping, hf_config=config),
                ),
            )
            logits[step] = np.asarray(model(jnp.asarray(IDS)))
            params[step] = jax.tree.map(np.asarray, state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        abstract = nnx.eval_shape(lambda: nnx.state(hf_models.CausalLM(config, rngs=nnx.Rngs(9))))
        for step in (2, 3):
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(policy=osf.SafetensorsRestore(abstract, mapping=mapping)),
            )
            assert isinstance(restored.policy, nnx.State)
            equal_trees(restored.policy, params[step])
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]  # steps 0 and 1 are gone
    for step in (2, 3):
        served = root / str(step) / "policy"
        names = {p.name for p in served.iterdir()}
        assert {"config.json", "model.safetensors.index.json", "orbax_safetensors.json"} <= names
        assert len([n for n in names if n.endswith(".safetensors")]) > 1
        loads_cleanly(served)
        hf_models.assert_outputs_close(hf_logits(served), logits[step], rtol=1e-5, atol=1e-5)


def test_transforms_run_off_the_caller_thread_from_the_snapshot(tmp_dir):
    """save() returns after the host copies: the rule's to_torch runs on the writer thread,
    and the arrays may be deleted (donated) as soon as save() returns."""
    seen = []

    class Recording:
        def to_flax(self, x):
            return x.T

        def to_torch(self, x):
            if any(x.strides):  # (shapes are probed on zero-stride arrays, on any thread)
                seen.append(threading.current_thread())
            return x.T

    kernel = jnp.arange(12.0).reshape(3, 4)
    tree = {"layer": {"kernel": kernel, "bias": jnp.ones(4)}}
    mapping = osf.KeyMapping(
        [osf.Rule("l.weight", "layer.kernel", Recording()), osf.Rule("l.bias", "layer.bias")]
    )
    with ocp.CheckpointManager(tmp_dir / "run") as mngr:
        mngr.save(1, args=osf.SafetensorsSave(tree, mapping=mapping))
        kernel.delete()  # the caller may donate its arrays once save() returned
        mngr.wait_until_finished()
    assert seen and all(t is not threading.main_thread() for t in seen)
    with safetensors.safe_open(
        str(tmp_dir / "run" / "1" / "default" / "model.safetensors"), "np"
    ) as f:
        np.testing.assert_array_equal(f.get_tensor("l.weight"), np.arange(12.0).reshape(3, 4).T)


def test_scanned_fused_lora_model_publishes_a_plain_hf_model(tmp_dir):
    """Stacked layers, fused QKV and gate/up, a LoRA adapter merged, a sync save: transformers
    loads the item with the reference model's logits."""
    config = hf_models.tiny_config()
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_dir / "ref")
    mapping = hf_models.scanned_llama_mapping(head="head.kernel")
    abstract = hf_models.scanned_llama_abstract(config, head="head.kernel")
    params = osf.load_pytorch(abstract, tmp_dir / "ref", mapping)
    # A LoRA fine-tune of the head: the published kernel is kernel + a @ b * scale.
    a = 0.1 * jax.random.normal(jax.random.key(1), (32, 2))
    b = 0.1 * jax.random.normal(jax.random.key(2), (2, 96))
    params["head"]["lora"] = {"lora_a": a, "lora_b": b}
    mapping = osf.KeyMapping(mapping.rules, lora_scale=0.5)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_dir / "run", options=options) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(params, mapping=mapping, hf_config=config))
    served = tmp_dir / "run" / "0" / "default"
    loads_cleanly(served)
    merged = np.asarray(params["head"]["kernel"]) + 0.5 * (np.asarray(a) @ np.asarray(b))
    with safetensors.safe_open(str(served / "model.safetensors"), "np") as f:
        # (the merge sums the rank terms in order, not through BLAS: last-bit differences)
        np.testing.assert_allclose(f.get_tensor("lm_head.weight"), merged.T, rtol=1e-6, atol=1e-8)
    with torch.no_grad():
        reference.lm_head.weight.copy_(torch.from_numpy(merged.T.copy()))
        want = reference(torch.from_numpy(IDS)).logits.numpy()
    hf_models.assert_outputs_close(hf_logits(served), want, rtol=1e-5, atol=1e-5)


def test_dtype_policy_keep_and_tied_embeddings(tmp_dir):
    """The dtype policy over JAX names ("keep" accepted), tied lm_head not written,
    config.json's dtype the stored one."""
    config = hf_models.tiny_config(tied=True)
    model = hf_models.CausalLM(config, rngs=nnx.Rngs(0))
    randomize(model, seed=7)
    state = nnx.state(model, nnx.Param)
    mapping = osf.preset_mapping("llama", tie_word_embeddings=True)
    policy = {"*norm*": "keep", "*": jnp.bfloat16}
    with ocp.CheckpointManager(tmp_dir / "run") as mngr:
        mngr.save(
            0, args=osf.SafetensorsSave(state, mapping=mapping, hf_config=config, dtype=policy)
        )
        mngr.save(1, args=osf.SafetensorsSave(state, mapping=mapping, dtype="keep"))
        mngr.wait_until_finished()
    served = tmp_dir / "run" / "0" / "default"
    with safetensors.safe_open(str(served / "model.safetensors"), "np") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert "lm_head.weight" not in dtypes
    assert dtypes["model.norm.weight"] == "F32" and dtypes["model.embed_tokens.weight"] == "BF16"
    assert json.loads((served / "config.json").read_text())["dtype"] == "bfloat16"
    loads_cleanly(served)
    got = hf_logits(served, dtype=torch.float32)
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(IDS))), atol=5e-2)
    kept = tmp_dir / "run" / "1" / "default"
    assert not (kept / "config.json").exists()
    with safetensors.safe_open(str(kept / "model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # noqa: SIM118


def test_problems_raise_before_the_step_exists(tmp_dir):
    tree = {"layer": {"kernel": jnp.ones((3, 4)), "extra": jnp.ones(2)}}
    mapping = osf.KeyMapping([osf.Rule("l.weight", "layer.kernel", osf.Transpose())])
    with pytest.raises(osf.TargetMismatchError, match=r"(?s)no rule maps.*layer\.extra"):
        osf.SafetensorsSave(tree, mapping=mapping)
    with pytest.raises(ValueError, match=r"hf_config= .* needs mapping="):
        osf.SafetensorsSave(tree, hf_config={"model_type": "llama"})
    with pytest.raises(TypeError, match=r"mapping= takes an osf\.KeyMapping"):
        osf.SafetensorsSave(tree, mapping={"l.weight": "layer.kernel"})
    with pytest.raises(ValueError, match="give item="):
        osf.SafetensorsRestore(mapping=mapping)
    stacked = osf.KeyMapping([osf.Rule("l.{i}.w", "w", stacked="i")])
    with pytest.raises(osf.TargetMismatchError, match="w is a scalar"):
        osf.SafetensorsSave({"w": jnp.ones(())}, mapping=stacked)


@pytest.mark.parametrize("policy", ["keep", "KEEP", {"*": "keep"}, lambda name, leaf: "keep"])
def test_keep_is_a_dtype_policy_value(tmp_dir, policy):
    tree = {"w": jnp.ones(3, jnp.float32), "b": jnp.ones(2, jnp.bfloat16)}
    args = osf.SafetensorsSave(tree, dtype=policy)
    assert "SafetensorsSave(item=" in repr(args)
    assert [s.dtype for s in args.validated_tree.specs] == ["F32", "BF16"]


def test_several_processes_may_publish_to_object_storage():
    """A servable item saved by several processes may go to object storage (each process
    uploads its own bytes: tests/objstore/test_objstore_hf_export.py writes one from 2 real
    processes); building the job no longer refuses it."""
    from orbax_safetensors._src.pipeline import save_job

    tree = {"layer": {"kernel": jnp.ones((3, 4))}}
    mapping = osf.KeyMapping([osf.Rule("l.weight", "layer.kernel", osf.Transpose())])
    args = osf.SafetensorsSave(tree, mapping=mapping)
    job = save_job.SaveJob(
        args.validated_tree,
        "s3://bucket/run/3/policy",
        mode=save_job.SaveMode.SNAPSHOT,
        processes=save_job.Processes(0, 2, 0),
        export=args.export_plan,
    )
    assert job.export is args.export_plan
