"""load_file with a target: leaf kinds, shardings, partial reads, strictness, casts, errors."""

from __future__ import annotations

import json
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import kernel_io  # (tests/ is on sys.path)
import ml_dtypes
import numpy as np
import pytest
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jax_casts import x64  # (tests/helpers is on sys.path)

import orbax_safetensors as osf
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline.read import ReadStats
from orbax_safetensors._src.pipeline.restore_options import RestoreOptions
from orbax_safetensors._src.pipeline.restore_plan import restore_tree


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return devices.mesh((4, 2), ("x", "y"))


@pytest.fixture
def saved(tmp_path) -> tuple[epath.Path, dict]:
    tree = {
        "w": np.arange(64, dtype=np.float32).reshape(8, 8),
        "b": np.arange(8, dtype=np.int32),
        "layers": [{"k": np.full((4, 2), i, np.float32)} for i in range(2)],
        "step": 12,
        "lr": 0.25,
        "done": False,
        "zero_d": np.float32(1.5),
    }
    path = epath.Path(tmp_path) / "t.safetensors"
    osf.save_file(tree, path)
    return path, tree


# --------------------------------------------------------------------------- target leaf kinds


def test_numpy_and_python_scalar_targets(saved):
    path, tree = saved
    target = {
        "w": np.zeros((8, 8), np.float32),
        "b": np.zeros(8, np.int32),
        "layers": [{"k": np.zeros((4, 2), np.float32)} for _ in range(2)],
        "step": 0,
        "lr": 0.0,
        "done": True,
        "zero_d": 0.0,  # a Python float receiving a 0-d tensor
    }
    out = osf.load_file(path, target=target)
    assert type(out["w"]) is np.ndarray
    np.testing.assert_array_equal(out["w"], tree["w"])
    np.testing.assert_array_equal(out["layers"][1]["k"], tree["layers"][1]["k"])
    assert out["step"] == 12 and type(out["step"]) is int
    assert out["lr"] == 0.25 and type(out["lr"]) is float
    assert out["done"] is False
    assert out["zero_d"] == 1.5 and type(out["zero_d"]) is float


@pytest.mark.parametrize("kind", ["numpy", "numpy_scalar", "shape_dtype_struct"])
def test_python_scalars_onto_narrower_dtypes_are_cast_as_tensors_are(tmp_path, kind):
    # As Orbax casts them; out-of-range floats as every restore cast (jax's: saturating).
    saved = {"a": 300, "b": -1, "c": float("nan"), "d": 1e10, "f": 2**63 + 5, "g": -2.5}
    dtypes = {"a": np.uint8, "b": np.uint32, "c": np.int32, "d": np.int32, "f": np.uint64,
              "g": np.int8}  # fmt: skip
    want = {"a": 44, "b": 2**32 - 1, "c": 0, "d": 2**31 - 1, "f": 2**63 + 5, "g": -2}
    osf.save_file({**saved, "big": 2**80}, tmp_path / "s.safetensors")

    def leaf(dtype: Any) -> Any:
        if kind == "numpy":
            return np.zeros((), dtype)
        if kind == "numpy_scalar":
            return np.dtype(dtype).type(0)
        return jax.ShapeDtypeStruct((), dtype)

    with x64():  # (uint64 as a jax.Array; jax.enable_x64 is newer than the floor's JAX)
        out = osf.load_file(
            tmp_path / "s.safetensors", {k: leaf(d) for k, d in dtypes.items()}, strict=False
        )
        for k, d in dtypes.items():
            assert np.asarray(out[k]).dtype == d and int(out[k]) == want[k], k
        with pytest.raises(
            osf.TargetMismatchError, match=r"big: .*Python int 1208925819614629174706176.*int64"
        ):
            osf.load_file(tmp_path / "s.safetensors", {"big": leaf(np.int64)}, strict=False)
    with pytest.raises(osf.TargetMismatchError, match=r"c: .*Python float nan, target wants a int"):
        osf.load_file(tmp_path / "s.safetensors", {"c": 0}, strict=False)


def test_jax_array_targets_keep_their_placement(saved, mesh):
    path, tree = saved
    device = devices.take(4)[3]
    sharded = NamedSharding(mesh, PartitionSpec("x"))
    target = jax.tree.map(lambda x: x, tree)
    target["w"] = jax.device_put(jnp.zeros((8, 8)), device)
    target["b"] = jax.device_put(jnp.zeros(8, jnp.int32), sharded)
    out = osf.load_file(path, target=target)
    assert isinstance(out["w"], jax.Array)
    assert out["w"].sharding == SingleDeviceSharding(device)
    assert out["b"].sharding == sharded
    np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])
    np.testing.assert_array_equal(np.asarray(out["b"]), tree["b"])


@pytest.mark.parametrize(
    "spec",
    [PartitionSpec("x", "y"), PartitionSpec(None, "x"), PartitionSpec(("x", "y")), PartitionSpec()],
)
def test_shape_dtype_struct_with_named_sharding(saved, mesh, spec):
    path, tree = saved
    sharding = NamedSharding(mesh, spec)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) if hasattr(x, "shape") else x
        ),
        tree,
    )
    target["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding)
    out = osf.load_file(path, target=target)
    assert out["w"].sharding == sharding  # exactly the requested sharding
    assert len(out["w"].addressable_shards) == 8
    for shard in out["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), tree["w"][shard.index])
    # A ShapeDtypeStruct without a sharding gives what was saved (a numpy array here), as
    # Orbax's StandardRestore does.
    assert type(out["layers"][0]["k"]) is np.ndarray


def test_sharding_and_dtype_cast_together(saved, mesh):
    path, tree = saved
    sharding = NamedSharding(mesh, PartitionSpec("y", "x"))
    out = osf.load_file(
        path,
        target={"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=sharding)},
        strict=False,
    )
    assert out["w"].dtype == jnp.bfloat16
    assert out["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"].astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------- only requested bytes


def _restore_with_stats(path: epath.Path, target: Any, **kwargs: Any) -> tuple[Any, ReadStats]:
    header = osf.read_header(path)
    schema = json.loads(header.metadata[_metadata.SCHEMA_KEY])
    crcs = json.loads(header.metadata[_metadata.CHECKSUM_KEY])
    stats = ReadStats()
    options = RestoreOptions.standalone(target, **kwargs)
    out = restore_tree(schema, _read.locate_in_file(path, header, crcs), options, stats=stats)
    return out, stats


def test_only_requested_tensors_are_read_read_stats(tmp_path):
    big = {f"t{i}": np.full((256, 256), i, np.float32) for i in range(6)}  # 256 KiB each
    path = epath.Path(tmp_path) / "big.safetensors"
    osf.save_file(big, path)
    out, stats = _restore_with_stats(
        path,
        {"t1": np.zeros((256, 256), np.float32), "t4": np.zeros((256, 256), np.float32)},
        strict=False,
    )
    assert stats.bytes_needed == 2 * big["t1"].nbytes
    assert stats.bytes_read == 2 * big["t1"].nbytes  # no other tensor, not even partly
    np.testing.assert_array_equal(out["t4"], big["t4"])
    _, everything = _restore_with_stats(path, None)
    assert everything.bytes_read == 6 * big["t1"].nbytes


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not kernel_io.counts_reads(), reason=kernel_io.NO_COUNTER)
def test_only_requested_tensors_are_read_kernel_counters(tmp_path):
    # The kernel's count of bytes this process read, independent of the library's own stats.
    mb = 1 << 20
    tree = {
        "a": np.ones(4 * mb, np.uint8),
        "b": np.full(4 * mb, 2, np.uint8),
        "c": np.ones(4 * mb, np.uint8),
    }
    path = epath.Path(tmp_path) / "io.safetensors"
    osf.save_file(tree, path)
    osf.load_file(path, target={"b": np.zeros(4 * mb, np.uint8)}, strict=False)  # warm up
    before = _rchar()
    out = osf.load_file(path, target={"b": np.zeros(4 * mb, np.uint8)}, strict=False)
    delta = _rchar() - before
    assert 4 * mb <= delta < 4 * mb + 256 * 1024, delta  # one tensor plus the header
    assert int(out["b"][0]) == 2


# --------------------------------------------------------------------------- errors and strictness


def test_shape_mismatch_names_key_and_both_shapes(saved):
    path, _ = saved
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.load_file(path, target={"w": np.zeros((4, 16), np.float32)}, strict=False)
    message = str(info.value)
    assert "w" in message and "(8, 8)" in message and "(4, 16)" in message
    assert isinstance(info.value, ValueError)


def test_strict_lists_every_missing_unexpected_and_mis_shaped_key_at_once(saved):
    path, _ = saved
    target = {
        "w": np.zeros((2, 2), np.float32),  # wrong shape
        "b": np.zeros(8, np.int32),
        "extra": np.zeros(3),  # missing from the file
        "more": {"deep": jax.ShapeDtypeStruct((1,), jnp.float32)},  # missing too
    }
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.load_file(path, target=target)
    message = str(info.value)
    for key in ("extra", "more.deep"):
        assert key in message
    for key in ("layers.0.k", "layers.1.k", "step", "lr", "done", "zero_d"):
        assert key in message  # unexpected: in the file, not in the target
    assert "(2, 2)" in message and "(8, 8)" in message
    assert "missing from the checkpoint (2)" in message
    assert "in the checkpoint but not the target (6)" in message


def test_non_strict_skips_unexpected_and_keeps_concrete_missing_values(saved):
    path, tree = saved
    keep = np.full(3, 7.0)
    keep_jax = jnp.arange(2)
    out = osf.load_file(
        path,
        target={"w": np.zeros((8, 8), np.float32), "new": keep, "also_new": keep_jax, "n": 5},
        strict=False,
    )
    assert set(out) == {"w", "new", "also_new", "n"}
    assert out["new"] is keep
    assert out["also_new"] is keep_jax
    assert out["n"] == 5
    np.testing.assert_array_equal(out["w"], tree["w"])


def test_non_strict_cannot_invent_abstract_missing_leaves(saved):
    path, _ = saved
    with pytest.raises(osf.TargetMismatchError, match=r"missing from the checkpoint \(1\): ghost"):
        osf.load_file(path, target={"ghost": jax.ShapeDtypeStruct((2,), jnp.float32)}, strict=False)


@pytest.mark.parametrize(
    ("target_dtype", "kind"),
    [
        (np.float16, "numpy"),
        (np.float64, "numpy"),
        (np.int64, "numpy"),
        (jnp.bfloat16, "jax"),
        (jnp.float16, "sds"),
        (jnp.int8, "sds"),
    ],
)
def test_dtype_difference_casts_to_the_target_dtype(saved, target_dtype, kind):
    path, tree = saved
    if kind == "numpy":
        leaf: Any = np.zeros((8, 8), target_dtype)
    elif kind == "jax":
        leaf = jnp.zeros((8, 8), target_dtype)
    else:
        leaf = jax.ShapeDtypeStruct((8, 8), target_dtype)
    out = osf.load_file(path, target={"w": leaf}, strict=False)
    assert out["w"].dtype == np.dtype(target_dtype)
    # "w" was saved as numpy: a ShapeDtypeStruct without a sharding gives numpy (as Orbax does)
    assert isinstance(out["w"], jax.Array if kind == "jax" else np.ndarray)
    np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"].astype(target_dtype))


def test_prng_key_vs_array_mismatch_is_reported(tmp_path):
    path = epath.Path(tmp_path) / "k.safetensors"
    osf.save_file({"k": jax.random.key(0), "a": np.zeros(2, np.uint32)}, path)
    with pytest.raises(osf.TargetMismatchError, match="k: a PRNG key in the checkpoint, an array"):
        osf.load_file(path, target={"k": np.zeros((), np.uint32), "a": np.zeros(2, np.uint32)})
    # a numpy target of the key data's shape gets the key data, as Orbax gives it
    out = osf.load_file(path, target={"k": np.zeros(2, np.uint32), "a": np.zeros(2, np.uint32)})
    assert type(out["k"]) is np.ndarray
    np.testing.assert_array_equal(out["k"], jax.random.key_data(jax.random.key(0)))
    with pytest.raises(
        osf.TargetMismatchError, match=r"k: checkpoint has a PRNG key of shape \(\)"
    ):
        osf.load_file(path, target={"k": np.zeros(3, np.uint32), "a": np.zeros(2, np.uint32)})
    with pytest.raises(osf.TargetMismatchError, match="a: an array in the checkpoint, a PRNG key"):
        osf.load_file(
            path, target={"k": jax.random.key(1), "a": jax.random.split(jax.random.key(2))}
        )


def test_target_leaf_that_cannot_hold_a_tensor(saved):
    path, _ = saved
    with pytest.raises(osf.TargetMismatchError, match="w: target leaf of type str"):
        osf.load_file(path, target={"w": "not an array"}, strict=False)


def test_plain_safetensors_file_without_schema_loads_flat(tmp_path):
    from safetensors.numpy import save_file as np_save_file

    path = epath.Path(tmp_path) / "plain.safetensors"
    np_save_file({"a.b": np.ones(2, np.float32), "c": np.zeros(3, np.int64)}, str(path))
    out = osf.load_file(path)
    assert set(out) == {"a.b", "c"}
    out = osf.load_file(path, target={"a.b": jax.ShapeDtypeStruct((2,), jnp.float32)}, strict=False)
    np.testing.assert_array_equal(np.asarray(out["a.b"]), np.ones(2))
