"""The Orbax plugin end to end: SafetensorsCheckpointHandler driven by a real CheckpointManager.

Covers issue 3: the registered args (no other registration), Composite items, no-arg restores
in a fresh process, configured handlers (item_handlers, handler_registry) and their options,
the item directory's contents, async saves against donated/mutated arrays, restore targets
(concrete, sharded ShapeDtypeStruct, partial, mismatched, flax TrainState, nnx Optimizer) and
metadata that reads no tensor bytes. Interop checks read our files with ``safetensors`` itself.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import crc32c
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from traced_memory import traced_peak

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import snapshots as _snapshots

SCRIPTS = Path(__file__).parent / "scripts"
OUR_FILES = {"model.safetensors", "orbax_safetensors.json"}
ORBAX_MARKERS = {"commit_success.txt"}  # Orbax's own per-item commit marker on local disks


# --------------------------------------------------------------------------- helpers


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))


def _state() -> dict[str, Any]:
    """A mixed tree: jax arrays of several dtypes, a numpy leaf, a list, Python scalars."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "params": {
            "dense": {
                "kernel": jax.random.normal(k1, (8, 16), jnp.float32),
                "bias": jax.random.normal(k2, (16,), jnp.float32).astype(jnp.bfloat16),
            },
        },
        "layers": [jnp.arange(6, dtype=jnp.int8).reshape(2, 3), jnp.array([True, False, True])],
        "host": np.linspace(0.0, 1.0, 10),
        "step": 7,
        "lr": 0.25,
    }


# The dotted names of every array leaf of _state() (Python scalars are inline, not tensors).
STATE_TENSORS = {"params.dense.kernel", "params.dense.bias", "layers.0", "layers.1", "host"}


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _assert_same_values(got: Any, want: Any) -> None:
    """Same tree structure; every leaf equal in value and dtype."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, (jax.Array, np.ndarray)):
            assert np.asarray(g).dtype == np.asarray(w).dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            assert type(g) is type(w) and g == w


def _item_dir(root: Path, step: int, item: str = "default") -> Path:
    return root / str(step) / item


def _manager(root: Path, **kwargs: Any) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(root, **kwargs)


def _wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
    time.sleep(0.2)  # let the thread that made it true finish


def _let_step_directory_creation_finish(root: Path, step: int) -> None:
    # Orbax starts creating the step directory in a background thread before it calls the
    # handler; after a save() that raised, let that finish, or interpreter exit races it and
    # hangs until Orbax's coordination timeout.
    # (Orbax < 0.12 adds a suffix to both names: "0.orbax-checkpoint-tmp-0/default...-1".)
    _wait_until(
        lambda: any(root.glob(f"{step}.orbax-checkpoint-tmp*/default.orbax-checkpoint-tmp*"))
    )


def _data_region(path: Path) -> tuple[int, int]:
    """(start, end) of a safetensors file's tensor bytes, from the standard 8-byte prefix."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, path.stat().st_size


def _tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute byte range of every tensor, parsed from the header with plain json."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


# --------------------------------------------------------------------------- point 1: wiring


def test_issue_snippet_works_with_no_other_registration(tmp_path: Path) -> None:
    state = _state()
    abstract_state = _abstract(state)
    path = tmp_path / "ckpt"
    step = 3
    # The exact snippet of issue 3, point 1.
    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore(abstract_state))
    mngr.close()

    assert mngr.latest_step() == step
    # As Orbax's StandardRestore gives it: a ShapeDtypeStruct without a sharding restores a
    # leaf saved as numpy as a numpy array of the struct's dtype (float64 here, not narrowed).
    _assert_same_values(restored, state)
    assert isinstance(restored["host"], np.ndarray) and restored["host"].dtype == np.float64
    assert isinstance(restored["step"], int) and isinstance(restored["lr"], float)
    # The stable typestr is what Orbax records for the item.
    step_meta = json.loads((path / str(step) / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"] == {
        "default": "orbax_safetensors.SafetensorsCheckpointHandler"
    }
    assert (
        osf.SafetensorsCheckpointHandler.typestr()
        == "orbax_safetensors.SafetensorsCheckpointHandler"
    )


def test_restore_without_target_returns_the_saved_tree(tmp_path: Path) -> None:
    state = _state()
    mngr = _manager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(0, args=osf.SafetensorsRestore())
    mngr.close()
    _assert_same_values(restored, state)
    assert isinstance(restored["host"], np.ndarray)  # host-local leaves come back as numpy
    assert isinstance(restored["params"]["dense"]["kernel"], jax.Array)


def test_composite_item_with_json(tmp_path: Path) -> None:
    state = _state()
    mngr = _manager(tmp_path)
    mngr.save(
        5,
        args=ocp.args.Composite(
            state=osf.SafetensorsSave(state, metadata={"note": "hello"}),
            meta=ocp.args.JsonSave({"loss": 0.5, "epoch": 2}),
        ),
    )
    mngr.wait_until_finished()
    restored = mngr.restore(
        5,
        args=ocp.args.Composite(
            state=osf.SafetensorsRestore(_abstract(state)), meta=ocp.args.JsonRestore()
        ),
    )
    mngr.close()
    _assert_same_values(restored["state"], state)  # "host" as saved: numpy float64, as Orbax
    assert restored["meta"] == {"loss": 0.5, "epoch": 2}
    item = _item_dir(tmp_path, 5, "state")
    assert set(os.listdir(item)) >= OUR_FILES
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert doc["metadata"] == {"note": "hello"}


def test_restore_with_no_args_in_a_fresh_process(tmp_path: Path) -> None:
    state = _state()
    roots = {"default-item": tmp_path / "plain", "composite": tmp_path / "composite"}
    for label, root in roots.items():
        mngr = _manager(root)
        if label == "composite":
            args = ocp.args.Composite(
                state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({"epoch": 4})
            )
        else:
            args = osf.SafetensorsSave(state)
        mngr.save(2, args=args)
        mngr.wait_until_finished()
        mngr.close()

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, str(SCRIPTS / "restore_no_args.py")]
    for root in roots.values():
        cmd += [str(root), "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    for label, doc in zip(roots, docs):
        composite = label == "composite"
        rows = {r["path"]: r for r in doc["leaves"]}
        prefix = "['state']" if composite else ""
        if composite:
            assert doc["composite"] is True
            assert rows["['meta']['epoch']"]["value"] == 4
        else:
            assert doc["composite"] is False and doc["top"] == "dict"
        # The raw tree: saved containers, jax arrays stay jax, numpy stays numpy, scalars inline.
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            row = rows[prefix + jax.tree_util.keystr(path)]
            if isinstance(leaf, (jax.Array, np.ndarray)):
                host = np.asarray(leaf)
                assert row["kind"] == ("jax" if isinstance(leaf, jax.Array) else "numpy")
                assert row["dtype"] == str(host.dtype) and row["shape"] == list(host.shape)
                assert row["values"] == host.astype(np.float64).ravel().tolist()
            else:
                assert row["kind"] == "python" and row["value"] == leaf
                assert row["type"] == type(leaf).__name__
        assert len(rows) == len(jax.tree.leaves(state)) + composite


def _tensor_names(item: Path) -> set[str]:
    names: set[str] = set()
    for f in sorted(item.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as g:
            names.update(g.keys())
    return names


def test_configured_handler_as_the_single_item_handler(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(6)}  # 256 bytes each
    handler = osf.SafetensorsCheckpointHandler(max_file_size=600, checksums=False)
    mngr = _manager(tmp_path, item_handlers=handler)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=osf.SafetensorsRestore(_abstract(state)))
    mngr.close()
    _assert_same_values(restored, state)
    # The options reached the writer: split files, no checksums.
    _assert_split_without_checksums(_item_dir(tmp_path, 1), files=3)


def test_configured_handler_per_item_in_a_composite(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(4)}
    mngr = _manager(
        tmp_path,
        item_handlers={
            "state": osf.SafetensorsCheckpointHandler(max_file_size=300),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    restored = _composite_round_trip(mngr, state)
    assert restored["meta"] == {"a": 1}
    assert len(list(_item_dir(tmp_path, 1, "state").glob("model-*-of-*.safetensors"))) == 4


def _composite_round_trip(mngr: ocp.CheckpointManager, state: Any) -> Any:
    """Saves ``state`` beside a JSON item at step 1, restores both, closes ``mngr``."""
    mngr.save(
        1,
        args=ocp.args.Composite(state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({"a": 1})),
    )
    mngr.wait_until_finished()
    restored = mngr.restore(
        1,
        args=ocp.args.Composite(
            state=osf.SafetensorsRestore(_abstract(state)), meta=ocp.args.JsonRestore()
        ),
    )
    mngr.close()
    _assert_same_values(restored["state"], state)
    return restored


def _assert_split_without_checksums(item: Path, files: int) -> None:
    assert len(list(item.glob("model-*-of-*.safetensors"))) == files
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert all("crc32c" not in t for t in doc["tensors"].values())


def test_configured_handler_through_handler_registry(tmp_path: Path) -> None:
    state = {f"w{i}": jnp.full((64,), i, jnp.float32) for i in range(4)}
    handler = osf.SafetensorsCheckpointHandler(max_file_size=600, checksums=False)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", osf.SafetensorsSave, handler)
    registry.add("state", osf.SafetensorsRestore, handler)
    mngr = _manager(tmp_path, handler_registry=registry)
    _composite_round_trip(mngr, state)
    _assert_split_without_checksums(_item_dir(tmp_path, 1, "state"), files=2)


def test_plain_checkpointer_uses_the_synchronous_save(tmp_path: Path) -> None:
    state = _state()
    ckptr = ocp.Checkpointer(osf.SafetensorsCheckpointHandler())
    ckptr.save(tmp_path / "ck", args=osf.SafetensorsSave(state))
    restored = ckptr.restore(tmp_path / "ck", args=osf.SafetensorsRestore())
    ckptr.close()
    _assert_same_values(restored, state)
    assert set(os.listdir(tmp_path / "ck")) >= OUR_FILES


# --------------------------------------------------------------------------- constructor options


def test_max_file_size_splits_into_standard_sharded_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = [100, 300, 700, 250, 1500, 40, 600, 330, 20, 900]  # float32 elements
    state = {
        f"t{i:02d}": jnp.asarray(rng.standard_normal(n, np.float32)) for i, n in enumerate(sizes)
    }
    state["big"] = jnp.asarray(rng.standard_normal((40, 100), np.float32))  # 16000 B > limit
    limit = 4096
    mngr = _manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(max_file_size=limit))
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=osf.SafetensorsRestore(_abstract(state)))
    mngr.close()
    _assert_same_values(restored, state)

    item = _item_dir(tmp_path, 1)
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
    state = _state()
    mngr = _manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(checksums=checksums))
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    item = _item_dir(tmp_path, 1)
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert set(doc["tensors"]) == STATE_TENSORS
    ranges = _tensor_offsets(item / "model.safetensors")
    raw = (item / "model.safetensors").read_bytes()
    for name, info in doc["tensors"].items():
        if checksums:
            begin, end = ranges[name]
            assert info["crc32c"] == f"{crc32c.crc32c(raw[begin:end]):08x}", name
        else:
            assert "crc32c" not in info
    assert set(os.listdir(item)) - ORBAX_MARKERS == OUR_FILES  # no leftover part/draft files


def _corrupt_one_byte(path: Path, name: str) -> None:
    begin, _ = _tensor_offsets(path)[name]
    with open(path, "r+b") as f:
        f.seek(begin)
        b = f.read(1)
        f.seek(begin)
        f.write(bytes([b[0] ^ 0x40]))


def test_verify_on_detects_damage_and_off_skips_the_check(tmp_path: Path) -> None:
    state = {"a": jnp.arange(32, dtype=jnp.float32), "b": jnp.ones((4, 4), jnp.float32)}
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    _corrupt_one_byte(_item_dir(tmp_path, 1) / "model.safetensors", "a")

    checked = _manager(tmp_path)  # default handler: verify=True
    with pytest.raises(osf.IntegrityError, match="'a'"):
        checked.restore(1, args=osf.SafetensorsRestore(_abstract(state)))
    checked.close()

    unchecked = _manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(verify=False))
    restored = unchecked.restore(1, args=osf.SafetensorsRestore(_abstract(state)))
    unchecked.close()
    np.testing.assert_array_equal(restored["b"], state["b"])
    diff = np.flatnonzero(np.asarray(restored["a"]) != np.asarray(state["a"]))
    assert diff.tolist() == [0]  # the damaged value comes back unchecked


def test_primary_host(tmp_path: Path) -> None:
    state = _state()
    mngr = _manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler(primary_host=0))
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    _assert_same_values(mngr.restore(1, args=osf.SafetensorsRestore()), state)
    mngr.close()
    # A primary host this job does not have is refused when save() is called, not later in
    # the background commit thread.
    bad = _manager(tmp_path / "bad", item_handlers=osf.SafetensorsCheckpointHandler(primary_host=1))
    with pytest.raises(ValueError, match="primary_host"):
        bad.save(1, args=osf.SafetensorsSave(state))
    _let_step_directory_creation_finish(tmp_path / "bad", 1)
    bad.close()
    with pytest.raises(ValueError, match="max_file_size"):
        osf.SafetensorsCheckpointHandler(max_file_size=0)


def test_async_save_of_a_header_over_the_cap_fails_in_the_call(tmp_path: Path) -> None:
    """An async save plans its files on the writer thread, except when the header might exceed
    safetensors' 100 MiB cap: then the HeaderError comes from save(), not the background."""
    long = "k" * (1 << 20)
    state = {f"{long}{i:03d}": np.zeros(1, np.float32) for i in range(101)}  # 101 MiB of names
    mngr = _manager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    with pytest.raises(osf.HeaderError, match="exceeds"):
        mngr.save(1, args=osf.SafetensorsSave(state))
    _let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == []


def test_sub_byte_shards_off_whole_bytes_fail_in_the_call(tmp_path: Path) -> None:
    """A float4 tensor whose shards split bytes cannot be written by each shard's owner; the
    error names the shard and comes from save() (before the writer thread plans anything)."""
    import ml_dtypes

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.zeros((8, 3), ml_dtypes.float4_e2m1fn)  # 12 bits per shard
    state = {"q": jax.device_put(values, sharding)}
    even = {"q": jax.device_put(np.zeros((8, 4), ml_dtypes.float4_e2m1fn), sharding)}
    mngr = _manager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    mngr.save(0, args=osf.SafetensorsSave(even))  # 2 bytes per shard: fine
    mngr.wait_until_finished()
    with pytest.raises(osf.UnsupportedLeafError, match="whole bytes"):
        mngr.save(1, args=osf.SafetensorsSave(state))
    _let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == [0]


# --------------------------------------------------------------------------- point 2: item dir


def test_item_directory_holds_one_safetensors_file_and_the_json(tmp_path: Path) -> None:
    state = _state()
    sharded = jax.device_put(
        jnp.arange(64, dtype=jnp.float32).reshape(8, 8), NamedSharding(_mesh(), P("x", "y"))
    )
    state["params"]["sharded"] = sharded
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    item = _item_dir(tmp_path, 1)
    assert set(os.listdir(item)) - ORBAX_MARKERS == OUR_FILES
    names = STATE_TENSORS | {"params.sharded"}
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
    mngr = _manager(tmp_path, options=options)
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


def test_restore_into_concrete_arrays(tmp_path: Path) -> None:
    state = _state()
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    target = jax.tree.map(lambda x: jnp.zeros_like(x) if isinstance(x, jax.Array) else x * 0, state)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(target))
    mngr.close()
    _assert_same_values(restored, state)
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
    mesh = _mesh()
    values = {
        "w": np.arange(16 * 24, dtype=np.float32).reshape(16, 24),
        "b": (np.arange(8 * 32, dtype=np.float32) / 7).reshape(8, 32).astype(jnp.bfloat16),
    }
    if saved_spec is None:
        state = {k: jnp.asarray(v) for k, v in values.items()}
    else:
        state = {k: jax.device_put(v, NamedSharding(mesh, saved_spec)) for k, v in values.items()}
    mngr = _manager(tmp_path)
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
    mesh = _mesh()
    state = {"w": jnp.arange(32.0).reshape(4, 8), "b": jnp.arange(8, dtype=jnp.int32)}
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    shardings = {"w": NamedSharding(mesh, P("x", "y")), "b": NamedSharding(mesh, P("y"))}
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in state.items()
    }
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(restore_args=restore_args))
    _assert_same_values(restored, state)
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
    mngr = _manager(tmp_path, item_handlers=handler)
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
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    target = {"enc": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}, "b": _abstract(state["b"])}
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
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(ts))
    mngr.wait_until_finished()

    restored = mngr.restore(1, args=osf.SafetensorsRestore(_abstract(create(jax.random.key(1)))))
    mngr.close()
    assert isinstance(restored, train_state.TrainState)
    assert int(restored.step) == 1
    _assert_same_values(restored.params, ts.params)
    _assert_same_values(restored.opt_state, ts.opt_state)
    # It trains on exactly like the original.
    _assert_same_values(train_step(restored).params, train_step(ts).params)


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
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(saved))
    mngr.wait_until_finished()

    _, opt2 = make(1)
    restored = mngr.restore(1, args=osf.SafetensorsRestore(nnx.state(opt2)))
    mngr.close()
    assert type(restored) is type(saved)
    nnx.update(opt2, restored)
    _assert_same_values(nnx.state(opt2), saved)
    assert int(opt2.step[...]) == 1


# --------------------------------------------------------------------------- point 6: metadata


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_item_metadata_reads_no_tensor_bytes(tmp_path: Path) -> None:
    state = {
        "big": jnp.ones((1024, 1024), jnp.float32),  # 4 MiB
        "nested": {"k": jnp.zeros((3, 5), jnp.bfloat16), "n": np.arange(4, dtype=np.int64)},
        "step": 12,
    }
    mngr = _manager(tmp_path)
    mngr.save(1, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    mngr.close()
    path = _item_dir(tmp_path, 1) / "model.safetensors"
    start, end = _data_region(path)
    with open(path, "r+b") as f:  # scramble every tensor byte; headers stay intact
        f.seek(start)
        f.write(np.random.default_rng(0).integers(0, 256, end - start, np.uint8).tobytes())

    # A fresh manager learns the item's handler from item_handlers (Orbax resolves handlers
    # from the step's typestr only in restore(); item_metadata() would give None, as it does
    # for Orbax's own StandardCheckpointHandler).
    fresh = _manager(tmp_path, item_handlers=osf.SafetensorsCheckpointHandler())
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
    mngr = _manager(tmp_path)
    mngr.save(
        1, args=ocp.args.Composite(state=osf.SafetensorsSave(state), meta=ocp.args.JsonSave({}))
    )
    mngr.wait_until_finished()
    meta = mngr.item_metadata(1)
    mngr.close()
    w = meta["state"]["w"]
    assert isinstance(w, jax.ShapeDtypeStruct) and (w.shape, w.dtype) == ((2, 3), jnp.float32)


# --------------------------------------------------------------------------- host memory of saves


def _big_state() -> dict[str, Any]:
    return {f"w{i}": jnp.full((1 << 21,), float(i), jnp.float32) for i in range(4)}  # 4 x 8 MiB


@pytest.mark.parametrize(
    ("async_enabled", "reuse"),
    [(True, False), (True, True), (False, True)],
    ids=["async-fresh-buffers", "async-reused-buffers", "sync"],
)
def test_sync_saves_write_in_place_async_saves_snapshot(
    tmp_path: Path, async_enabled: bool, reuse: bool
) -> None:
    """A synchronous manager save writes each tensor straight from its buffer (no host
    snapshot); an async one copies every owned byte to host before save() returns: into new
    memory, or (the default) into the buffers of the previous save, allocating nothing."""
    state = _big_state()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    handler = osf.SafetensorsCheckpointHandler(reuse_host_buffers=reuse)
    mngr = _manager(tmp_path, options=options, item_handlers=handler)
    mngr.save(0, args=osf.SafetensorsSave(state))  # warm-up: Orbax's one-off allocations
    mngr.wait_until_finished()

    def save() -> None:
        mngr.save(1, args=osf.SafetensorsSave(state))
        mngr.wait_until_finished()

    peak = traced_peak(save)
    restored = mngr.restore(1, args=osf.SafetensorsRestore())
    mngr.close()
    _assert_same_values(restored, state)
    if async_enabled and not reuse:
        assert peak >= 8 << 20, peak  # at least the largest tensor was snapshotted
    else:
        assert peak < 2 << 20, peak  # 32 MiB saved (or snapshotted) with < 2 MiB allocated


@pytest.mark.parametrize("checkpointer", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_checkpointer_with_the_handler_alone(tmp_path: Path, checkpointer: Any) -> None:
    """The handler under a bare Checkpointer (sync: handler.save, in place) and an
    AsyncCheckpointer (async_save: snapshot, then donation is safe)."""
    state = _big_state()
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)  # not a view: donatable
    ckptr = checkpointer(osf.SafetensorsCheckpointHandler())
    donate = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)

    def save() -> None:
        ckptr.save(tmp_path / "ck", args=osf.SafetensorsSave(state))
        if checkpointer is ocp.AsyncCheckpointer:
            donate(state)  # right after save() returns
            ckptr.wait_until_finished()

    peak = traced_peak(save)
    restored = ckptr.restore(tmp_path / "ck", args=osf.SafetensorsRestore())
    ckptr.close()
    for k in expected:
        np.testing.assert_array_equal(np.asarray(restored[k]), expected[k], err_msg=k)
    if checkpointer is ocp.Checkpointer:
        assert peak < 2 << 20, peak
    else:
        assert all(x.is_deleted() for x in state.values())


def test_saving_a_donated_array_names_it(tmp_path: Path) -> None:
    state = {"layer": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}}
    jax.jit(lambda s: s, donate_argnums=0)(state["layer"]["w"])
    mngr = _manager(tmp_path)
    with pytest.raises(ValueError, match=r"'layer\.w'.*deleted.*donated"):
        # Raised where the args are built, before Orbax starts any background work.
        mngr.save(1, args=osf.SafetensorsSave(state))
    assert mngr.all_steps() == []
    mngr.close()


def test_snapshot_queue_starts_the_writer_early_for_large_tensors() -> None:
    """A state of large tensors reaches the writer once 16 MiB is copied; 10,000 small tensors
    (10 MB) only at close, after the copy loop."""
    large = _snapshots.SnapshotQueue()
    for i in range(3):
        large.put((i, [(None, np.zeros(3 << 20, np.float32))]))  # 12 MiB each
        assert large.wait_started(timeout=0) == (i >= 1), i
    small = _snapshots.SnapshotQueue()
    for i in range(10_000):
        small.put((i, [(None, np.zeros(256, np.float32))]))
    assert not small.wait_started(timeout=0)
    small.close()
    assert small.wait_started(timeout=0) and small.complete()
    assert sum(1 for _ in small) == 10_000


def test_args_reused_after_a_donation_fail_naming_the_leaf(tmp_path: Path) -> None:
    """SafetensorsSave checks for deleted arrays when built; args kept and saved again after
    the arrays were donated fail in save() with the same message, not a bare JAX error."""
    state = {"layer": {"w": jnp.arange(8.0)}}
    args = osf.SafetensorsSave(state)
    mngr = _manager(tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    mngr.save(0, args=args)
    mngr.wait_until_finished()
    jax.jit(lambda s: s, donate_argnums=0)(state["layer"]["w"])
    with pytest.raises(ValueError, match=r"'layer\.w'.*deleted.*donated"):
        mngr.save(1, args=args)
    _let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == [0]


def test_writer_fails_when_the_copying_thread_fails(tmp_path: Path) -> None:
    """The async writer reads host copies from a queue as they are made; a failed copy makes
    the writer raise (the step is not committed) instead of waiting forever or finishing."""
    tree = {"w": np.ones(8, np.float32)}
    validated = _checkpoint_save.validate_save(tree)
    queue = _snapshots.SnapshotQueue()
    for item in _snapshots.iter_snapshots(enumerate(validated.captured.arrays)):
        queue.put(item)
    queue.fail(MemoryError("host copy failed"))
    assert queue.wait_started(timeout=0)
    prepared = _checkpoint_save.PreparedSave.from_snapshots(
        validated, queue, _checkpoint_save.SaveLayout()
    )
    with pytest.raises(RuntimeError, match=r"copying .* to host failed") as info:
        _checkpoint_save.write_process_share(prepared, tmp_path)
    assert isinstance(info.value.__cause__, MemoryError)
    assert not (tmp_path / "orbax_safetensors.json").exists()


def test_snapshot_queue_hands_over_every_item_in_order_across_groups(tmp_path):
    """Host copies go to the writer in groups (the first once 16 MiB of at most 256 tensors or
    64 MiB is copied, then by bytes and by count); none is lost, reordered or held back at
    close, whatever the mix of sizes."""
    rng = np.random.default_rng(0)
    tree = {f"s{i:04d}": rng.standard_normal(16).astype(np.float32) for i in range(600)}
    tree["big"] = rng.standard_normal(17 << 20).astype(np.float32)  # 68 MiB: ends group one
    tree.update({f"t{i:04d}": rng.standard_normal(16).astype(np.float32) for i in range(600)})
    tree["tail"] = np.arange(5, dtype=np.int32)
    validated = _checkpoint_save.validate_save(tree)
    items = list(_snapshots.iter_snapshots(enumerate(validated.captured.arrays)))
    queue = _snapshots.SnapshotQueue()
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(queue))
    reader.start()
    for k, item in enumerate(items):
        queue.put(item)
        # 600 small tensors and a large one: nothing reaches the writer before 64 MiB is
        # copied; then groups of <= 256 tensors.
        assert queue.wait_started(timeout=0) == (k >= 600), k
    queue.close()
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert [key for key, _ in got] == [key for key, _ in items] == list(range(len(tree)))
    assert all(a is b for (_, pa), (_, pb) in zip(got, items) for (_, a), (_, b) in zip(pa, pb))
    # and written through a queue, the checkpoint is whole
    queue = _snapshots.SnapshotQueue()
    for item in _snapshots.iter_snapshots(enumerate(validated.captured.arrays)):
        queue.put(item)
    queue.close()
    prepared = _checkpoint_save.PreparedSave.from_snapshots(
        validated, queue, _checkpoint_save.SaveLayout()
    )
    _checkpoint_save.write_process_share(prepared, tmp_path)
    _checkpoint_save.finalize(tmp_path)
    restored = osf.restore_directory(tmp_path)
    for name, value in tree.items():
        np.testing.assert_array_equal(restored[name], value)
