"""One mapping, both directions, any layout: placeholders declared once, GPT-2 Conv1D, stacked
(scanned) layers, fused projections, LoRA adapters merged on export, and export sources
(pytrees, a CheckpointManager root's latest step, one item of a step)."""

from __future__ import annotations

import functools

import devices  # (tests/ is on sys.path)
import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx

import orbax_safetensors as osf


def read(path):
    return safetensors.numpy.load_file(str(path))


def test_placeholder_regex_declared_once_holds_on_export(tmp_dir):
    rule = osf.Rule("{p:.*_proj|lm_head}.weight", "{p}.kernel", osf.Transpose())
    assert rule.match_flax("layers.0.q_proj.kernel") == "layers.0.q_proj.weight"
    assert rule.match_flax("lm_head.kernel") == "lm_head.weight"
    assert rule.match_flax("norm.kernel") is None
    tree = {
        "layers": {"0": {"q_proj": {"kernel": jnp.ones((2, 3))}}},
        "lm_head": {"kernel": jnp.zeros((2, 5))},
    }
    report = osf.export_pytorch(tree, tmp_dir / "hf", osf.KeyMapping([rule]))
    assert report.ok
    out = read(tmp_dir / "hf" / "model.safetensors")
    assert out["layers.0.q_proj.weight"].shape == (3, 2) and out["lm_head.weight"].shape == (5, 2)
    with pytest.raises(ValueError, match="declares two regexes"):
        osf.Rule("{p:a|b}.w", "{p:c}.k")


def test_conv1d_keeps_in_out_even_when_square(tmp_dir):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)  # Conv1D (in, out)
    sq = np.arange(9, dtype=np.float32).reshape(3, 3)
    tree = {
        "c_fc": {"kernel": w, "bias": np.zeros(4, np.float32)},
        "c_proj": {"kernel": sq, "bias": np.zeros(3, np.float32)},
    }
    mapping = osf.KeyMapping(
        [*osf.Rule.conv1d("mlp.c_fc", "c_fc"), *osf.Rule.conv1d("mlp.c_proj", "c_proj")]
    )
    assert osf.export_pytorch(tree, tmp_dir / "hf", mapping).ok
    out = read(tmp_dir / "hf" / "model.safetensors")
    np.testing.assert_array_equal(out["mlp.c_fc.weight"], w)
    np.testing.assert_array_equal(out["mlp.c_proj.weight"], sq)


class Scanned(nnx.Module):
    """Two stacked layers with a fused QKV kernel [L, in, 3 * out] and a plain kernel."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.qkv = nnx.Param(jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32))
        self.fc = nnx.Param(jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32))


STACKED = osf.KeyMapping(
    [
        hf_models.stacked_fused_rule(
            "layers.{i}.attn.{p:q_proj|k_proj|v_proj}.weight", "qkv", (4, 2, 2)
        ),
        osf.Rule("layers.{i}.fc.weight", "fc", osf.Transpose(), stacked="i"),
    ]
)


def test_stacked_and_fused_layers_both_ways(tmp_dir):
    model = Scanned()
    report = osf.export_pytorch(model, tmp_dir / "hf", STACKED)
    assert report.ok
    out = read(tmp_dir / "hf" / "model.safetensors")
    qkv, fc = np.asarray(model.qkv[...]), np.asarray(model.fc[...])
    assert sorted(out) == sorted(
        [f"layers.{i}.attn.{p}.weight" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")]
        + ["layers.0.fc.weight", "layers.1.fc.weight"]
    )
    np.testing.assert_array_equal(out["layers.1.attn.k_proj.weight"], qkv[1, :, 4:6].T)
    np.testing.assert_array_equal(out["layers.0.fc.weight"], fc[0].T)
    fresh = Scanned()
    fresh.qkv[...] = jnp.zeros_like(fresh.qkv[...])
    fresh.fc[...] = jnp.zeros_like(fresh.fc[...])
    assert osf.load_pytorch(fresh, tmp_dir / "hf", STACKED).ok
    np.testing.assert_array_equal(fresh.qkv[...], qkv)
    np.testing.assert_array_equal(fresh.fc[...], fc)


def test_stacked_layer_missing_is_reported(tmp_dir):
    tensors = {f"layers.{i}.fc.weight": np.ones((6, 4), np.float32) for i in (0, 2)}
    safetensors.numpy.save_file(tensors, str(tmp_dir / "m.safetensors"))
    mapping = osf.KeyMapping([STACKED.rules[1]])
    with pytest.raises(osf.TargetMismatchError, match="fc joins 3 tensors but 1 are absent"):
        osf.load_pytorch(Scanned(), tmp_dir / "m.safetensors", mapping, variables=nnx.Param)


@pytest.mark.parametrize("stacked", ["i", None], ids=["stacked", "per-layer"])
def test_a_tensor_the_last_layer_lacks_is_named(tmp_dir, stacked):
    # A stack counts the layers it holds: the last one missing read as a shorter stack. A
    # per-layer layout loads what the files hold (layers may differ: dense and MoE layers).
    tensors = {f"layers.{i}.{p}.weight": np.ones((6, 4), np.float32) for i in (0, 1) for p in "ab"}
    del tensors["layers.1.b.weight"]
    safetensors.numpy.save_file(tensors, str(tmp_dir / "m.safetensors"))
    flax = "{p}" if stacked else "{p}_{i}"
    mapping = osf.KeyMapping([osf.Rule("layers.{i}.{p}.weight", flax, stacked=stacked)])
    absent = r"layers\.1\.b\.weight absent: the files hold layers\.N\.b\.weight for 1 of the 2"
    for load in (osf.abstract_pytorch, functools.partial(osf.load_pytorch, None)):
        if stacked:
            with pytest.raises(osf.TargetMismatchError, match=absent):
                load(tmp_dir / "m.safetensors", mapping)
        else:
            assert sorted(load(tmp_dir / "m.safetensors", mapping)) == ["a_0", "a_1", "b_0"]


def test_lora_linear_exports_merged_plain_linear(tmp_dir):
    torch = pytest.importorskip("torch")
    layer = nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0))
    layer.lora.lora_b[...] = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3)), jnp.float32)
    mapping = osf.KeyMapping(
        [osf.Rule("proj.weight", "kernel", osf.Transpose()), osf.Rule("proj.bias", "bias")]
    )
    report = osf.export_pytorch(layer, tmp_dir / "hf", mapping)
    assert report.ok and not report.ignored
    assert sorted(report.merged) == [("lora.lora_a", "kernel"), ("lora.lora_b", "kernel")]
    out = read(tmp_dir / "hf" / "model.safetensors")
    assert sorted(out) == ["proj.bias", "proj.weight"]
    linear = torch.nn.Linear(4, 3)
    linear.load_state_dict({k[5:]: torch.from_numpy(v) for k, v in out.items()})
    x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    np.testing.assert_allclose(
        linear(torch.from_numpy(x)).detach().numpy(), layer(jnp.asarray(x)), rtol=1e-5, atol=1e-6
    )


def test_lora_scale_and_base_dtype():
    kernel = np.ones((4, 3), dtype=jnp.bfloat16)
    a, b = np.ones((4, 2), np.float32), np.ones((2, 3), np.float32)
    from orbax_safetensors._src.integrations import lora

    merged = lora.merge_lora(kernel, a, b, 0.25)
    assert merged.dtype == kernel.dtype and float(merged[0, 0]) == 1.5
    assert lora.find_pairs(["q.base_module.kernel", "q.lora_a", "q.lora_b"]) == [
        lora.Pair("q.base_module.kernel", "q.lora_a", "q.lora_b")
    ]


def test_export_latest_step_of_a_manager_root_and_one_item(tmp_dir):
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    mapping = osf.KeyMapping(osf.Rule.linear("fc", "params.dense"))
    with ocp.CheckpointManager(tmp_dir / "ckpt") as mngr:
        for step in (1, 2):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=osf.SafetensorsSave(
                        {"params": jax.tree.map(lambda x, s=step: x * s, params)}
                    ),
                    extra=ocp.args.JsonSave({"step": step}),
                ),
            )
        mngr.wait_until_finished()
    osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "hf", mapping, item="state")
    np.testing.assert_array_equal(
        read(tmp_dir / "hf" / "model.safetensors")["fc.weight"], 2 * np.ones((3, 2))
    )
    osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "hf1", mapping, item="state", step=1)
    np.testing.assert_array_equal(
        read(tmp_dir / "hf1" / "model.safetensors")["fc.weight"], np.ones((3, 2))
    )
    with pytest.raises(osf.SafetensorsCheckpointError, match="no tensor item 'nope'"):
        osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "x", mapping, item="nope")
    with pytest.raises(osf.SafetensorsCheckpointError, match="no committed step 7"):
        osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "x", mapping, item="state", step=7)


def test_export_from_linen_params_train_state_nnx_state_and_sharded_arrays(tmp_dir):
    optax = pytest.importorskip("optax")
    from flax import linen
    from flax.training import train_state

    dense = linen.Dense(3)
    params = dense.init(jax.random.key(0), jnp.ones((1, 2)))
    mapping = osf.KeyMapping(osf.Rule.linear("fc", "params"))
    want = np.asarray(params["params"]["kernel"]).T
    assert osf.export_pytorch(params, tmp_dir / "linen", mapping).ok
    np.testing.assert_array_equal(read(tmp_dir / "linen" / "model.safetensors")["fc.weight"], want)
    state = train_state.TrainState.create(apply_fn=dense.apply, params=params, tx=optax.adam(1e-3))
    assert osf.export_pytorch(state.params, tmp_dir / "ts", mapping).ok
    report = osf.export_pytorch(state, tmp_dir / "ts2", mapping, prefix="params.")
    assert report.ok
    np.testing.assert_array_equal(read(tmp_dir / "ts2" / "model.safetensors")["fc.weight"], want)
    # an nnx.State with RNG state: the RNG variables are not weights
    model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Dropout(0.1, rngs=nnx.Rngs(1)))
    rules = osf.KeyMapping(osf.Rule.linear("fc", "layers.0"))
    assert osf.export_pytorch(nnx.state(model), tmp_dir / "state", rules).ok
    # sharded jax.Arrays, with hf_config as a dict
    mesh = devices.mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    kernel = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
    tree = {"params": {"kernel": kernel, "bias": jnp.zeros(4)}}
    osf.export_pytorch(tree, tmp_dir / "sharded", mapping, hf_config={"model_type": "x"})
    out = read(tmp_dir / "sharded" / "model.safetensors")
    np.testing.assert_array_equal(out["fc.weight"], np.arange(32.0).reshape(8, 4).T)
    config = (tmp_dir / "sharded" / "config.json").read_text()
    assert '"dtype": "float32"' in config and '"model_type": "x"' in config


def test_export_holds_one_batch_in_host_memory(tmp_dir):
    """A checkpoint of 32 MiB exported with 2 MiB batches: host allocations stay near a batch."""
    import tracemalloc

    rng = np.random.default_rng(0)
    tensors = {f"l{i}.kernel": rng.normal(size=(512, 512)).astype(np.float32) for i in range(32)}
    safetensors.numpy.save_file(tensors, str(tmp_dir / "ckpt.safetensors"))
    del tensors
    mapping = osf.KeyMapping([osf.Rule("layers.{i}.weight", "l{i}.kernel", osf.Transpose())])
    tracemalloc.start()
    try:
        report = osf.export_pytorch(
            tmp_dir / "ckpt.safetensors", tmp_dir / "hf", mapping, batch_bytes=2 << 20
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok and len(report.moved) == 32
    assert peak < 12 << 20, peak  # a batch read, its transposed copies: not the 32 MiB model


def test_band_cast_export_is_byte_identical_to_whole_tensor_casts(tmp_dir, monkeypatch):
    """Large tensors of an export into a local directory are cast band by band into reused
    buffers (``pipeline/pieces.band_piece``): transposed, stacked and fused tensors cast to
    bf16 (and kept in f32 by the policy) give the same files, byte for byte, as casting each
    tensor whole, and the official reader reads ``astype`` of the JAX-side values."""
    import ml_dtypes
    import safetensors.flax

    from orbax_safetensors._src.core import casting as _casting
    from orbax_safetensors._src.pipeline import pieces as _pieces

    rng = np.random.default_rng(3)
    tree = {
        "embed": {"embedding": rng.standard_normal((4099, 257), np.float32)},  # 4 MiB
        "layers": {
            "qkv": {"kernel": rng.standard_normal((3, 384, 3 * 640), np.float32)},
            "fc": {"kernel": rng.standard_normal((3, 640, 384), np.float32)},
            "norm": {"scale": rng.standard_normal((3, 640 * 512), np.float32)},
        },
    }
    mapping = osf.KeyMapping(
        [
            osf.Rule("embed.weight", "embed.embedding"),
            hf_models.stacked_fused_rule(
                "layers.{i}.{p:q_proj|k_proj|v_proj}.weight", "layers.qkv.kernel"
            ),
            osf.Rule("layers.{i}.fc.weight", "layers.fc.kernel", osf.Transpose(), stacked="i"),
            osf.Rule("layers.{i}.norm.weight", "layers.norm.scale", stacked="i"),
        ]
    )
    policy = {"*norm*": "keep", "*": jnp.bfloat16}
    files = {}
    for way, min_bytes in (("bands", _pieces.BAND_MIN_BYTES), ("whole", 1 << 62)):
        monkeypatch.setattr(_pieces, "BAND_MIN_BYTES", min_bytes)
        monkeypatch.setattr(_pieces, "BAND_BYTES", 1 << 20)  # several bands per tensor
        out = tmp_dir / way
        assert osf.export_pytorch(tree, out, mapping, dtype=policy, max_file_size=9 << 20).ok
        files[way] = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors*"))}
    assert len(files["bands"]) > 2 and files["bands"] == files["whole"]
    got = {}
    for name in files["bands"]:
        if name.endswith(".safetensors"):
            got.update(safetensors.flax.load_file(str(tmp_dir / "bands" / name)))
    bf16 = ml_dtypes.bfloat16
    layers = tree["layers"]
    want = {"embed.weight": _casting.astype(tree["embed"]["embedding"], bf16)}
    for i in range(3):
        for j, p in enumerate(("q_proj", "k_proj", "v_proj")):
            part = layers["qkv"]["kernel"][i, :, j * 640 : (j + 1) * 640].T
            want[f"layers.{i}.{p}.weight"] = _casting.astype(part, bf16)
        want[f"layers.{i}.fc.weight"] = _casting.astype(layers["fc"]["kernel"][i].T, bf16)
        want[f"layers.{i}.norm.weight"] = layers["norm"]["scale"][i]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=key)
