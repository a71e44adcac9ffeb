"""Flax NNX: save_model/load_model give bit-identical forward passes, eval and train mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open

import orbax_safetensors as osf

NnxList = getattr(nnx, "List", list)  # nnx.List: flax >= 0.12 (0.11 takes a plain list)


class Block(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(nnx.relu(self.bn(self.linear(x))))


class Model(nnx.Module):
    """Embedding, nnx.List of blocks, nnx.Sequential, BatchNorm, Dropout, tied output weights."""

    def __init__(self, rngs: nnx.Rngs, depth: int = 2, dim: int = 8) -> None:
        self.embed = nnx.Embed(16, dim, rngs=rngs)
        self.layers = NnxList([Block(dim, rngs) for _ in range(depth)])
        self.seq = nnx.Sequential(
            nnx.Linear(dim, dim, rngs=rngs), nnx.gelu, nnx.Linear(dim, dim, rngs=rngs)
        )
        self.out = self.embed.embedding  # tied: the same Variable at two places

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.seq(h) @ self.out[...].T


IDS = jnp.arange(12).reshape(3, 4) % 16


def _trained(seed: int = 0) -> Model:
    model = Model(nnx.Rngs(seed))
    model.train()
    for _ in range(2):  # BatchNorm statistics move, Dropout RNG counters advance
        model(IDS)
    return model


def _forward(model: Model, train: bool) -> np.ndarray:
    model.train() if train else model.eval()
    return np.asarray(model(IDS))


def test_load_model_gives_bit_identical_forward_passes(tmp_path):
    saved = _trained(0)
    path = tmp_path / "model.safetensors"
    osf.save_model(saved, path)
    fresh = Model(nnx.Rngs(1))
    assert not np.array_equal(_forward(fresh, False), _forward(saved, False))
    osf.load_model(fresh, path)
    assert fresh.out is fresh.embed.embedding  # ties survive loading
    np.testing.assert_array_equal(_forward(fresh, False), _forward(saved, False))
    for _ in range(3):  # train mode: same dropout masks, same batch statistics updates
        np.testing.assert_array_equal(_forward(fresh, True), _forward(saved, True))
    np.testing.assert_array_equal(_forward(fresh, False), _forward(saved, False))


def test_saved_names_and_state_kinds(tmp_path):
    model = _trained(0)
    path = tmp_path / "model.safetensors"
    osf.save_model(model, path)
    with safe_open(path, "numpy") as f:
        names = set(f.keys())
        mean = f.get_tensor("layers.1.bn.mean")
    assert {
        "embed.embedding",
        "layers.0.linear.kernel",
        "layers.1.bn.mean",
        "layers.1.bn.var",
        "layers.0.drop.rngs.key",
        "layers.0.drop.rngs.count",
        "seq.layers.0.kernel",
        "seq.layers.2.bias",
    } <= names
    assert not any(n.startswith("out") for n in names)  # the tied Variable is stored once
    assert np.abs(mean).sum() > 0  # non-trivial BatchNorm statistics
    np.testing.assert_array_equal(mean, np.asarray(model.layers[1].bn.mean[...]))
    with safe_open(path, "numpy") as f:
        assert int(f.get_tensor("layers.0.drop.rngs.count")) == int(
            model.layers[0].drop.rngs.count[...]
        )


def test_loaded_rng_keys_are_typed_keys(tmp_path):
    model = _trained(0)
    path = tmp_path / "model.safetensors"
    osf.save_model(model, path)
    fresh = osf.load_model(Model(nnx.Rngs(5)), path)
    key = fresh.layers[0].drop.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert bool(key == model.layers[0].drop.rngs.key[...])


def test_loading_into_another_structure_names_the_offending_keys(tmp_path):
    path = tmp_path / "model.safetensors"
    osf.save_model(_trained(0), path)
    deeper = Model(nnx.Rngs(0), depth=3)
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.load_model(deeper, path)
    message = str(info.value)
    assert "layers.2.linear.kernel" in message and "layers.2.bn.mean" in message
    wider = Model(nnx.Rngs(0), dim=4)
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.load_model(wider, path)
    assert "layers.0.linear.kernel: checkpoint has shape (8, 8)" in str(info.value)
    assert "(4, 4)" in str(info.value)
    shallow = Model(nnx.Rngs(0), depth=1)
    with pytest.raises(osf.TargetMismatchError, match=r"layers\.1\.linear\.kernel"):
        osf.load_model(shallow, path)
    osf.load_model(shallow, path, strict=False)  # the extra layer in the file is skipped
    np.testing.assert_array_equal(
        np.asarray(shallow.layers[0].linear.kernel[...]),
        np.asarray(_trained(0).layers[0].linear.kernel[...]),
    )


def test_pure_dict_round_trip_is_accepted_by_replace_by_pure_dict(tmp_path):
    saved = _trained(0)
    pure = nnx.to_pure_dict(nnx.state(saved))
    path = tmp_path / "pure.safetensors"
    osf.save_file(pure, path)
    loaded = osf.load_file(path)
    assert sorted(loaded["layers"]) == [0, 1]  # list indices stay int keys
    fresh = Model(nnx.Rngs(3))
    state = nnx.state(fresh)
    nnx.replace_by_pure_dict(state, loaded)
    nnx.update(fresh, state)
    np.testing.assert_array_equal(_forward(fresh, False), _forward(saved, False))
    np.testing.assert_array_equal(_forward(fresh, True), _forward(saved, True))


def _loss(model: nnx.Linear, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x) ** 2)


def test_optimizer_state_round_trip(tmp_path):
    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(3):
        opt.update(model, nnx.grad(_loss)(model, x))
    model_path, opt_path = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    osf.save_model(model, model_path)
    osf.save_model(opt, opt_path)
    with safe_open(opt_path, "numpy") as f:
        assert {"step", "opt_state.0.count", "opt_state.0.mu.kernel", "opt_state.0.nu.bias"} <= set(
            f.keys()
        )

    model2 = nnx.Linear(3, 2, rngs=nnx.Rngs(9))
    opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    osf.load_model(model2, model_path)
    osf.load_model(opt2, opt_path)
    assert int(opt2.step[...]) == 3
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(opt2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for _ in range(2):  # training continues identically
        opt.update(model, nnx.grad(_loss)(model, x))
        opt2.update(model2, nnx.grad(_loss)(model2, x))
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), np.asarray(model2.kernel[...]))
    np.testing.assert_array_equal(np.asarray(model.bias[...]), np.asarray(model2.bias[...]))


def test_save_model_with_bfloat16_params_reads_in_torch(tmp_path):
    pytest.importorskip("torch", reason="needs PyTorch (in the main environment)")
    from safetensors.torch import load_file

    model = nnx.Linear(4, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    path = tmp_path / "bf16.safetensors"
    osf.save_model(model, path)
    loaded = load_file(str(path))
    assert str(loaded["kernel"].dtype) == "torch.bfloat16"
    np.testing.assert_array_equal(
        loaded["kernel"].float().numpy(), np.asarray(model.kernel[...]).astype(np.float32)
    )
