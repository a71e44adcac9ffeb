"""The handler's options and files: sharded files, checksums, verify, primary host, limits
checked in the call, the item directory's contents and async saves against donated arrays (issue 3).

Interop checks read our files with ``safetensors`` itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import devices  # (tests/ is on sys.path)
import handler_helpers as helpers  # (tests/orbax/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import orbax_safetensors as osf


def test_max_file_size_splits_into_standard_sharded_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = [100, 300, 700, 250, 1500, 40, 600, 330, 20, 900]  # float32 elements
    state = {
        f"t{i:02d}": jnp.asarray(rng.standard_normal(n, np.float32)) for i, n in enumerate(sizes)
    }
    state["big"] = jnp.asarray(rng.standard_normal((40, 100), np.float32))  # 16000 B > limit
    limit = 4096
    mngr = helpers.manager(
        tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(max_file_size=limit)
    )
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=osf.SafetensorsRestore(helpers.abstract(state)))
    mngr.close()
    helpers.assert_same_values(restored, state)

    item = helpers.item_dir(tmp_path, 1)
    files = sorted(p.name for p in item.glob("*.safetensors"))
    n = len(files)
    assert n >= 4 and "model.safetensors" not in files
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((item / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(state)
    assert set(weight_map.values()) == set(files)
    assert index["metadata"]["total_size"] == sum(int(np.asarray(v).nbytes) for v in state.values())
    seen: list[str] = []
    for f in files:
        with safe_open(item / f, framework="numpy") as g:
            keys = list(g.keys())
            assert keys and all(weight_map[k] == f for k in keys)
            seen.extend(keys)
            data = sum(g.get_tensor(k).nbytes for k in keys)
            assert data <= limit or len(keys) == 1
            for k in keys:
                np.testing.assert_array_equal(g.get_tensor(k), np.asarray(state[k]))
    assert sorted(seen) == sorted(state)  # every tensor exactly once
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert doc["files"] == files
    assert {k: t["file"] for k, t in doc["tensors"].items()} == weight_map


@pytest.mark.parametrize("checksums", [True, False])
def test_checksums_on_and_off(tmp_path: Path, checksums: bool) -> None:
    state = helpers.state()
    mngr = helpers.manager(
        tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(checksums=checksums)
    )
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    item = helpers.item_dir(tmp_path, 1)
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert set(doc["tensors"]) == helpers.STATE_TENSORS
    ranges = helpers.tensor_offsets(item / "model.safetensors")
    raw = (item / "model.safetensors").read_bytes()
    for name, info in doc["tensors"].items():
        if checksums:
            begin, end = ranges[name]
            assert info["crc32c"] == f"{crc32c.crc32c(raw[begin:end]):08x}", name
        else:
            assert "crc32c" not in info
    assert (
        set(os.listdir(item)) - helpers.ORBAX_MARKERS == helpers.OUR_FILES
    )  # no leftover part/draft files


def _corrupt_one_byte(path: Path, name: str) -> None:
    begin, _ = helpers.tensor_offsets(path)[name]
    with open(path, "r+b") as f:
        f.seek(begin)
        b = f.read(1)
        f.seek(begin)
        f.write(bytes([b[0] ^ 0x40]))


def test_verify_on_detects_damage_and_off_skips_the_check(tmp_path: Path) -> None:
    state = {"a": jnp.arange(32, dtype=jnp.float32), "b": jnp.ones((4, 4), jnp.float32)}
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    _corrupt_one_byte(helpers.item_dir(tmp_path, 1) / "model.safetensors", "a")

    checked = helpers.manager(tmp_path)  # default handler: verify=True
    with pytest.raises(osf.IntegrityError, match="'a'"):
        checked.restore(1, args=osf.SafetensorsRestore(helpers.abstract(state)))
    checked.close()

    unchecked = helpers.manager(
        tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(verify=False)
    )
    restored = unchecked.restore(1, args=osf.SafetensorsRestore(helpers.abstract(state)))
    unchecked.close()
    np.testing.assert_array_equal(restored["b"], state["b"])
    diff = np.flatnonzero(np.asarray(restored["a"]) != np.asarray(state["a"]))
    assert diff.tolist() == [0]  # the damaged value comes back unchecked


def test_primary_host(tmp_path: Path) -> None:
    state = helpers.state()
    mngr = helpers.manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(primary_host=0))
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    helpers.assert_same_values(mngr.restore(1, args=osf.SafetensorsRestore()), state)
    mngr.close()
    # A primary host this job does not have is refused when save() is called, not later in
    # the background commit thread.
    bad = helpers.manager(
        tmp_path / "bad", item_handlers=osf.SafetensorsCheckpointHandler(primary_host=1)
    )
    with pytest.raises(ValueError, match="primary_host"):
        bad.save(1, args=osf.SafetensorsSave(state))
    helpers.let_step_directory_creation_finish(tmp_path / "bad", 1)
    bad.close()
    with pytest.raises(ValueError, match="max_file_size"):
        osf.SafetensorsCheckpointHandler(max_file_size=0)


def test_async_save_of_a_header_over_the_cap_fails_in_the_call(tmp_path: Path) -> None:
    """An async save plans its files on the writer thread, except when the header might exceed
    safetensors' 100 MiB cap: then the HeaderError comes from save(), not the background."""
    long = "k" * (1 << 20)
    state = {f"{long}{i:03d}": np.zeros(1, np.float32) for i in range(101)}  # 101 MiB of names
    mngr = helpers.manager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    with pytest.raises(osf.HeaderError, match="exceeds"):
        mngr.save(1, args=osf.SafetensorsSave(state))
    helpers.let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == []


def test_sub_byte_shards_off_whole_bytes_fail_in_the_call(tmp_path: Path) -> None:
    """A float4 tensor whose shards split bytes cannot be written by each shard's owner; the
    error names the shard and comes from save() (before the writer thread plans anything)."""
    import ml_dtypes

    mesh = devices.mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.zeros((8, 3), ml_dtypes.float4_e2m1fn)  # 12 bits per shard
    state = {"q": jax.device_put(values, sharding)}
    even = {"q": jax.device_put(np.zeros((8, 4), ml_dtypes.float4_e2m1fn), sharding)}
    mngr = helpers.manager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    mngr.save(0, args=osf.SafetensorsSave(even))  # 2 bytes per shard: fine
    mngr.wait_until_finished()
    with pytest.raises(osf.UnsupportedLeafError, match="whole bytes"):
        mngr.save(1, args=osf.SafetensorsSave(state))
    helpers.let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == [0]


# --------------------------------------------------------------------------- point 2: item dir


def test_item_directory_holds_one_safetensors_file_and_the_json(tmp_path: Path) -> None:
    state = helpers.state()
    sharded = jax.device_put(
        jnp.arange(64, dtype=jnp.float32).reshape(8, 8), NamedSharding(helpers.mesh(), P("x", "y"))
    )
    state["params"]["sharded"] = sharded
    mngr = helpers.manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    item = helpers.item_dir(tmp_path, 1)
    assert set(os.listdir(item)) - helpers.ORBAX_MARKERS == helpers.OUR_FILES
    names = helpers.STATE_TENSORS | {"params.sharded"}
    with safe_open(item / "model.safetensors", framework="numpy") as g:
        keys = g.keys()
        assert set(keys) == names
        header = {k: (g.get_slice(k).get_dtype(), g.get_slice(k).get_shape()) for k in keys}
        np.testing.assert_array_equal(g.get_tensor("params.sharded"), np.asarray(sharded))
        np.testing.assert_array_equal(g.get_tensor("host"), state["host"])
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert doc["format"] == "orbax-safetensors"
    assert doc["format_version"] == 1
    assert doc["library_version"] == osf.__version__
    assert doc["files"] == ["model.safetensors"]
    assert isinstance(doc["schema"], dict) and doc["schema"]
    assert set(doc["tensors"]) == names
    for name, info in doc["tensors"].items():
        assert (info["dtype"], info["shape"]) == (header[name][0], list(header[name][1]))
        assert info["file"] == "model.safetensors"
    assert doc["tensors"]["params.dense.bias"]["dtype"] == "BF16"
    assert doc["tensors"]["params.sharded"]["sharding"] == {
        "mesh_axes": ["x", "y"],
        "mesh_shape": [2, 4],
        "spec": ["x", "y"],
        "mesh_devices": 0,
    }
    assert doc["device_meshes"] == [[d.id for d in sharded.sharding.mesh.devices.flat]]
    assert doc["tensors"]["host"]["sharding"] is None
    # Nothing pickled: every file of the step parses as JSON or is a safetensors file.
    for p in (tmp_path / "1").rglob("*"):
        if p.is_file() and p.suffix != ".safetensors" and p.stat().st_size:
            json.loads(p.read_text()) if p.name != "commit_success.txt" else p.read_text()


# --------------------------------------------------------------------------- point 3: async


@pytest.mark.parametrize("async_enabled", [True, False], ids=["async", "sync"])
def test_donated_and_mutated_arrays_after_save_keep_old_values(
    tmp_path: Path, async_enabled: bool
) -> None:
    n = 1 << 20  # 4 MB per leaf: the write is still pending when the caller strikes
    state = {
        "w": jnp.arange(n, dtype=jnp.float32),
        "m": jnp.full((n,), 3.0, jnp.float32),
        "np": np.arange(n, dtype=np.float32),
    }
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)
    donate = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    donate({"w": jnp.zeros(n), "m": jnp.zeros(n)})  # compiled now: nothing delays the strike
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    mngr = helpers.manager(tmp_path, options=options)
    mngr.save(1, args=osf.SafetensorsSave(state))
    # Right after save() returns: overwrite the numpy leaf in place, donate the jax arrays.
    state["np"][:] = -1
    new = donate({"w": state["w"], "m": state["m"]})
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=osf.SafetensorsRestore())
    mngr.close()
    for k in expected:
        np.testing.assert_array_equal(np.asarray(restored[k]), expected[k], err_msg=k)
    # The donation really happened: the handler kept no reference to the caller's buffers (on
    # CPU a live numpy view of a buffer makes JAX copy instead of donating).
    assert state["w"].is_deleted() and state["m"].is_deleted()
    assert float(new["w"][5]) == -1.0


# --------------------------------------------------------------------------- point 5: targets
