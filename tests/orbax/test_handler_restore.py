"""Restore targets (concrete, sharded ShapeDtypeStruct, partial, mismatched, flax TrainState,
nnx Optimizer) and metadata that reads no tensor bytes (issue 3).

Interop checks read our files with ``safetensors`` itself.
"""

from __future__ import annotations

from pathlib import Path

import handler_helpers as helpers  # (tests/orbax/ is on sys.path)
import jax
import jax.numpy as jnp
import kernel_io  # (tests/ is on sys.path)
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf


def test_restore_into_concrete_arrays(tmp_path: Path) -> None:
    state = helpers.state()
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    target = jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x * 0, state)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(target))
    mngr.close()
    helpers.assert_same_values(restored, state)
    assert isinstance(restored["host"], np.ndarray)  # a numpy target leaf stays numpy
    assert isinstance(restored["layers"][0], jax.Array)


_TARGET_SPECS = {
    "rows": P("x"),
    "columns": P(None, "y"),
    "2d": P("x", "y"),
    "2d-swapped": P("y", "x"),
    "rows-over-all": P(("x", "y")),
    "replicated": P(),
}


@pytest.mark.parametrize(
    "saved_spec",
    [None, P("x", "y"), P(None, ("y", "x"))],
    ids=["saved-single-device", "saved-2d", "saved-columns-over-all"],
)
def test_sharded_restore_carries_exactly_the_target_sharding(
    tmp_path: Path, saved_spec: P | None
) -> None:
    mesh = helpers.mesh()
    values = {
        "w": np.arange(16 * 24, dtype=np.float32).reshape(16, 24),
        "b": (np.arange(8 * 32, dtype=np.float32) / 7).reshape(8, 32).astype(jnp.bfloat16),
    }
    if saved_spec is None:
        state = {k: jnp.asarray(v) for k, v in values.items()}
    else:
        state = {k: jax.device_put(v, NamedSharding(mesh, saved_spec)) for k, v in values.items()}
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    for label, spec in _TARGET_SPECS.items():
        sharding = NamedSharding(mesh, spec)
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in values.items()
        }
        restored = mngr.restore(1, args=osf.SafetensorsRestore(target))
        for k, v in values.items():
            got = restored[k]
            assert got.sharding == sharding, (label, k, got.sharding)
            assert got.dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(got), v, err_msg=f"{label} {k}")
            assert len(got.addressable_shards) == 8
            for shard in got.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
    mngr.close()


def test_restore_args_from_construct_restore_args(tmp_path: Path) -> None:
    mesh = helpers.mesh()
    state = {"w": jnp.arange(32.0).reshape(4, 8), "b": jnp.arange(8, dtype=jnp.int32)}
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    shardings = {"w": NamedSharding(mesh, P("x", "y")), "b": NamedSharding(mesh, P("y"))}
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in state.items()
    }
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(restore_args=restore_args))
    helpers.assert_same_values(restored, state)
    assert all(restored[k].sharding == shardings[k] for k in state)
    # ArrayRestoreArgs may also ask for another dtype.
    cast = {
        "w": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P()), dtype=jnp.bfloat16),
        "b": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P())),
    }
    restored = mngr.restore(1, args=osf.SafetensorsRestore(restore_args=cast))
    mngr.close()
    assert restored["w"].dtype == jnp.bfloat16 and restored["b"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(restored["w"], np.float32), np.asarray(state["w"]))


def test_partial_restore_reads_only_requested_tensors(tmp_path: Path) -> None:
    state = {
        "big": jnp.ones((512, 512), jnp.float32),  # 1 MiB that a partial restore must not read
        "small": {"a": jnp.arange(4, dtype=jnp.float32), "b": jnp.arange(3, dtype=jnp.int32)},
    }
    handler = osf.SafetensorsCheckpointHandler()
    mngr = helpers.manager(tmp_path, item_handlers=handler)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()

    keep = jnp.full((2,), 9.0)
    target = {"small": {"a": jax.ShapeDtypeStruct((4,), jnp.float32)}, "extra": keep}
    restored = mngr.restore(1, args=osf.SafetensorsRestore(target, partial_restore=True))
    assert set(restored) == {"small", "extra"} and set(restored["small"]) == {"a"}
    np.testing.assert_array_equal(restored["small"]["a"], np.arange(4, dtype=np.float32))
    assert restored["extra"] is keep  # missing key: the concrete target value is kept
    assert handler.last_read_stats is not None
    stats = handler.last_read_stats
    assert stats.bytes_needed == 16  # only small.a's bytes ...
    assert stats.bytes_read <= 16 + 4096  # ... read, give or take a coalesced gap; never "big"

    with pytest.raises(osf.TargetMismatchError) as err:
        mngr.restore(1, args=osf.SafetensorsRestore(target))  # every key by default
    assert "partial_restore=True" in str(err.value)
    assert "extra" in str(err.value) and "big" in str(err.value) and "small.b" in str(err.value)
    mngr.close()


def test_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    state = {"enc": {"w": jnp.zeros((3, 4), jnp.float32)}, "b": jnp.zeros(2)}
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    target = {
        "enc": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)},
        "b": helpers.abstract(state["b"]),
    }
    with pytest.raises(osf.TargetMismatchError, match=r"enc\.w.*\(3, 4\).*\(4, 4\)"):
        mngr.restore(1, args=osf.SafetensorsRestore(target))
    mngr.close()


def test_flax_train_state_with_adamw_round_trips(tmp_path: Path) -> None:
    from flax import linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))

    model, x, tx = MLP(), jnp.ones((4, 3)), optax.adamw(1e-2)

    @jax.jit  # compiled once: far faster than op-by-op on a busy CPU
    def create(key: jax.Array) -> train_state.TrainState:
        return train_state.TrainState.create(apply_fn=model.apply, params=model.init(key, x), tx=tx)

    @jax.jit
    def train_step(ts: train_state.TrainState) -> train_state.TrainState:
        grads = jax.grad(lambda p: ts.apply_fn(p, x).sum())(ts.params)
        return ts.apply_gradients(grads=grads)

    ts = train_step(create(jax.random.key(0)))  # a non-trivial step count, mu and nu
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(ts))
    mngr.wait_until_finished()

    restored = mngr.restore(
        1, args=osf.SafetensorsRestore(helpers.abstract(create(jax.random.key(1))))
    )
    mngr.close()
    assert isinstance(restored, train_state.TrainState)
    assert int(restored.step) == 1
    helpers.assert_same_values(restored.params, ts.params)
    helpers.assert_same_values(restored.opt_state, ts.opt_state)
    # It trains on exactly like the original.
    helpers.assert_same_values(train_step(restored).params, train_step(ts).params)


def test_nnx_optimizer_state_round_trips(tmp_path: Path) -> None:
    def make(seed: int) -> tuple[nnx.Module, nnx.Optimizer]:
        model = nnx.Sequential(
            nnx.Linear(3, 8, rngs=nnx.Rngs(seed)), nnx.relu, nnx.Linear(8, 1, rngs=nnx.Rngs(seed))
        )
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: nnx.Module, opt: nnx.Optimizer, x: jax.Array) -> None:
        opt.update(model, nnx.grad(lambda m: m(x).sum())(model))

    model, opt = make(0)
    train_step(model, opt, jnp.ones((4, 3)))
    saved = nnx.state(opt)
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(saved))
    mngr.wait_until_finished()

    _, opt2 = make(1)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(nnx.state(opt2)))
    mngr.close()
    assert type(restored) is type(saved)
    nnx.update(opt2, restored)
    helpers.assert_same_values(nnx.state(opt2), saved)
    assert int(opt2.step[...]) == 1


# --------------------------------------------------------------------------- point 6: metadata


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not kernel_io.counts_reads(), reason=kernel_io.NO_COUNTER)
def test_item_metadata_reads_no_tensor_bytes(tmp_path: Path) -> None:
    state = {
        "big": jnp.ones((1024, 1024), jnp.float32),  # 4 MiB
        "nested": {"k": jnp.zeros((3, 5), jnp.bfloat16), "n": np.arange(4, dtype=np.int64)},
        "step": 12,
    }
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    path = helpers.item_dir(tmp_path, 1) / "model.safetensors"
    start, end = helpers.data_region(path)
    with open(path, "r+b") as f:  # scramble every tensor byte; headers stay intact
        f.seek(start)
        f.write(np.random.default_rng(0).integers(0, 256, end - start, np.uint8).tobytes())

    # A fresh manager learns the item's handler from item_handlers (Orbax resolves handlers
    # from the step's typestr only in restore(); item_metadata() would give None, as it does
    # for Orbax's own StandardCheckpointHandler).
    fresh = helpers.manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler())
    before = _rchar()
    meta = fresh.item_metadata(1)
    read = _rchar() - before
    expected = {
        "big": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
        "nested": {
            "k": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16),
            "n": jax.ShapeDtypeStruct((4,), jnp.int64),
        },
        "step": 12,
    }
    assert jax.tree.structure(meta.tree) == jax.tree.structure(expected)
    assert meta.custom_metadata is None  # as Orbax's TreeMetadata when none was saved
    for got, want in zip(jax.tree.leaves(meta), jax.tree.leaves(expected)):
        if isinstance(want, jax.ShapeDtypeStruct):
            assert isinstance(got, jax.ShapeDtypeStruct)
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
        else:
            assert got == want
    assert read < 256 * 1024, read  # far below the 4 MiB of tensor data
    with pytest.raises(osf.IntegrityError):  # the damage is real: a restore notices it
        fresh.restore(1, args=osf.SafetensorsRestore())
    fresh.close()


def test_item_metadata_of_a_composite(tmp_path: Path) -> None:
    state = {"w": jnp.zeros((2, 3), jnp.float32)}
    mngr = helpers.manager(tmp_path)
    mngr.save(
        1, args=ocp.args.Composite(state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({}))
    )
    mngr.wait_until_finished()
    meta = mngr.item_metadata(1)
    mngr.close()
    w = meta["state"]["w"]
    assert isinstance(w, jax.ShapeDtypeStruct) and (w.shape, w.dtype) == ((2, 3), jnp.float32)
