"""Device snapshots of async saves (pipeline/snapshots.device_copies): on an accelerator an
async ``save()`` copies this process's shards on their devices and returns; a thread then makes
the host copies and frees each device copy, while training goes on and may donate the state.

Off an accelerator this is never chosen by itself, so these tests force it on CPU
(``snapshots.DEVICE_COPIES = "always"``): the same copies, thread and queue. What a save writes
must be the state at ``save()``, whatever the caller does after it returns: donate the arrays
to a jitted step, overwrite numpy leaves, delete the arrays.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import snapshots as _snapshots


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(_snapshots, "DEVICE_COPIES", "always")


def _manager(path: Path, **handler: Any) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        path,
        item_handlers=osf.SafetensorsCheckpointHandler(**handler),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True),
    )


def _state() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))
    replicated = NamedSharding(mesh, PartitionSpec())
    return {
        "w": jax.device_put(jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024), sharded),
        "b": jax.device_put(jnp.linspace(0, 1, 4096, dtype=jnp.bfloat16), replicated),
        "h": np.arange(10, dtype=np.int64),
        "step": 7,
    }


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.array(x) if isinstance(x, jax.Array | np.ndarray) else x, tree)


def _same(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).dtype == np.asarray(y).dtype


def test_auto_mode_copies_on_accelerators_only():
    owned = _snapshots.owned_tensors(enumerate(jax.tree.leaves(_state())), is_primary=True)
    split = _snapshots.device_copies(owned)
    if jax.devices()[0].platform == "cpu":
        assert split is None
    else:  # the two device arrays are copied; the numpy leaf and the int are copied now
        assert split is not None and len(split[1]) == 2 and len(split[0]) == 2
        _snapshots.delete_device_copies(split[1])


def test_the_save_holds_the_state_at_save_even_when_the_next_step_donates_it(
    tmp_path: Path, forced
):
    state = _state()
    expected = _host(state)
    step = jax.jit(lambda w, b: (w * 2 + 1, b * 3), donate_argnums=(0, 1))
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(state))
    state["w"], state["b"] = step(state["w"], state["b"])  # donated right after save()
    state["h"][:] = -1  # a host leaf overwritten in place
    mngr.wait_until_finished()
    _same(mngr.restore(0), expected)
    mngr.close()


def test_deleting_the_arrays_after_save_does_not_touch_the_snapshot(tmp_path: Path, forced):
    state = _state()
    expected = _host(state)
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(state))
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    mngr.wait_until_finished()
    _same(mngr.restore(0), expected)
    mngr.close()


def test_the_device_copies_are_freed_once_on_the_host(tmp_path: Path, forced, monkeypatch):
    made: list[list[Any]] = []
    device_copies = _snapshots.device_copies

    def recording(owned):
        split = device_copies(owned)
        assert split is not None
        made.append(split[1])
        return split

    monkeypatch.setattr(_snapshots, "device_copies", recording)
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(_state()))
    mngr.wait_until_finished()
    copies = [
        d
        for _, x, shards, _ in made[0]
        for d in ([x] if shards is None else [s for _, s in shards])
    ]
    assert copies and all(c.is_deleted() for c in copies)
    assert {t.name for t in threading.enumerate()} & {"osf-host-copies"} == set()
    mngr.close()


def test_a_dtype_policy_is_applied_to_the_device_snapshot(tmp_path: Path, forced):
    state = {"w": jnp.linspace(-3, 3, 50_000, dtype=jnp.float32)}
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(state, dtype=jnp.bfloat16))
    state["w"] = state["w"] + 1
    mngr.wait_until_finished()
    out = mngr.restore(0)
    assert out["w"].dtype == jnp.bfloat16
    expected = jnp.linspace(-3, 3, 50_000, dtype=jnp.float32).astype(jnp.bfloat16)
    assert np.asarray(out["w"]).tobytes() == np.asarray(expected).tobytes()
    mngr.close()


def test_device_snapshot_false_copies_to_host_before_save_returns(
    tmp_path: Path, forced, monkeypatch
):
    called = []
    monkeypatch.setattr(_snapshots, "device_copies", lambda owned: called.append(1))
    mngr = _manager(tmp_path, device_snapshot=False)
    state = _state()
    expected = _host(state)
    mngr.save(0, args=osf.SafetensorsSave(state))
    state["h"][:] = 5
    mngr.wait_until_finished()
    _same(mngr.restore(0), expected)
    assert called == []
    mngr.close()


def test_a_failed_host_copy_fails_the_save_and_leaves_no_step(tmp_path: Path, forced, monkeypatch):
    def failing(owned, **kwargs):
        if kwargs.get("delete"):
            raise RuntimeError("device-to-host copy failed")
        yield from iter_owned(owned, **kwargs)

    iter_owned = _snapshots.iter_owned
    monkeypatch.setattr(_snapshots, "iter_owned", failing)
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(_state()))
    with pytest.raises(Exception, match="copying the checkpoint's arrays to host failed"):
        mngr.wait_until_finished()
    assert mngr.all_steps() == []
    mngr.close()
