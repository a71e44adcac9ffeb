"""Save-time dtype policies (issue 18, point 1): ``dtype=`` on ``save_file``, ``save_model``,
``SafetensorsSave``, the v1 handler and ``convert``.

What is checked: the policy forms (one dtype for floating-point arrays, glob patterns over
dotted names with first match winning and None keeping, a callable); bad policies fail before
any file exists, naming the pattern or value; the official ``safetensors`` reader sees the
stored dtype with jnp's rounding; checksums are of the stored bytes; the schema records each
cast tensor's original dtype and ``inspect`` shows both; a restore without a target gives the
stored dtype, with a target the target's; a synchronous manager save's extra memory stays
within the largest tensor plus 64 MiB while the whole cast state is larger; an async save's
host snapshot holds the cast bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open
from traced_memory import traced_peak

import orbax_safetensors as osf
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import orbaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.tools import cli
from orbax_safetensors._src.tools import inspection as _inspection

BF16 = np.dtype(ml_dtypes.bfloat16)


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "layer": {
            "kernel": jnp.asarray(rng.standard_normal((8, 16), dtype=np.float32)),
            "bias": jnp.asarray(rng.standard_normal(16, dtype=np.float32)),
            "norm": {"scale": jnp.ones(16, jnp.float32)},
        },
        "table": rng.standard_normal((4, 3)),  # numpy float64
        "half": jnp.linspace(-1, 1, 6, dtype=jnp.float16),
        "ids": jnp.arange(5, dtype=jnp.int32),
        "key": jax.random.key(3),
        "step": 12,
    }


def _official(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as the official reader gives it: numpy has no bfloat16, so BF16 tensors
    through the flax (jax) framework, as test_multihost does (it would make float64 float32)."""
    out = {}
    with safe_open(str(path), framework="numpy") as f, safe_open(str(path), "flax") as fx:
        for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            bf16 = f.get_slice(k).get_dtype() == "BF16"
            out[k] = np.asarray((fx if bf16 else f).get_tensor(k))
    return out


def _schema_text(path: Path) -> str:
    with safe_open(str(path), framework="numpy") as f:
        return str(f.metadata()["orbax_safetensors.tree"])


def _cast(x: Any, dtype: Any) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(dtype))  # jnp's rounding is the reference


# --------------------------------------------------------------------------- the policy


def test_policy_forms_resolve_by_name_and_dtype() -> None:
    names = ["a.kernel", "a.bias", "a.norm.scale", "ids"]
    dtypes = [np.dtype("float32")] * 3 + [np.dtype("int32")]
    shapes = [(2, 2), (2,), (2,), (3,)]
    leaves = [None] * 4
    resolve = _casting.resolve
    single = _casting.parse_policy(jnp.bfloat16)
    assert resolve(single, names, dtypes, shapes, leaves) == [BF16, BF16, BF16, None]
    patterns = _casting.parse_policy({"*.norm.*": None, "a.*": "float16", "*": "BF16"})
    assert resolve(patterns, names, dtypes, shapes, leaves) == [
        np.dtype("float16"),
        np.dtype("float16"),
        None,  # the first match keeps it, though later patterns match too
        BF16,  # a pattern may cast any array, ints too
    ]
    unmatched = _casting.parse_policy({"*.kernel": "bfloat16"})
    assert resolve(unmatched, names, dtypes, shapes, leaves) == [BF16, None, None, None]
    seen = []

    def fn(name: str, leaf: Any) -> Any:
        seen.append(name)
        return "float16" if name.endswith("bias") else None

    assert resolve(_casting.parse_policy(fn), names, dtypes, shapes, leaves)[1] == np.float16
    assert seen == names
    # Spellings of one dtype: numpy / jnp / ml_dtypes types, numpy and safetensors names.
    for spelling in (jnp.bfloat16, ml_dtypes.bfloat16, BF16, "bfloat16", "BF16"):
        assert _casting.parse_policy(spelling) == _casting.Policy(single=BF16), spelling


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("bfloat17", r"dtype: 'bfloat17' is not a dtype"),
        ("int8", r"dtype=int8: a single dtype applies to floating-point arrays"),
        ({"*.kernel": "half-ish"}, r"pattern '\*\.kernel': 'half-ish' is not a dtype"),
        ({"": "bfloat16"}, r"pattern '': patterns are non-empty glob strings"),
        ({3: "bfloat16"}, r"pattern 3: patterns are non-empty glob strings"),
        (np.dtype("U3"), r"safetensors cannot store dtype <U3"),
    ],
)
def test_a_bad_policy_fails_before_any_file_exists(
    tmp_path: Path, policy: Any, message: str
) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=message):
        osf.save_file(_tree(), path, dtype=policy)
    with pytest.raises(ValueError, match=message):
        osf.SafetensorsSave(_tree(), dtype=policy)
    mngr = ocp.CheckpointManager(tmp_path / "root")
    with pytest.raises(ValueError, match=message):
        mngr.save(0, args=osf.SafetensorsSave(_tree(), dtype=policy))
    mngr.close()
    assert not path.exists() and not (tmp_path / "root" / "0").exists()
    assert [p.name for p in tmp_path.iterdir()] in ([], ["root"])


def test_casts_that_cannot_be_stored_name_the_leaf(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(osf.UnsupportedLeafError, match=r"leaf 'key' is a PRNG key"):
        osf.save_file(_tree(), path, dtype={"key": "float32"})
    with pytest.raises(osf.UnsupportedLeafError, match=r"leaf 'z' .*complex"):
        osf.save_file({"z": np.ones(2, np.complex64)}, path, dtype={"z": "float32"})
    with pytest.raises(osf.UnsupportedLeafError, match=r"answer for 'layer.kernel'"):
        osf.save_file(_tree(), path, dtype=lambda name, leaf: "nope")
    with pytest.raises(osf.UnsupportedLeafError, match=r"leaf 'q' cast to float4_e2m1fn"):
        osf.save_file({"q": np.ones(3, np.float32)}, path, dtype={"q": "F4"})
    assert not path.exists()


# --------------------------------------------------------------------------- save_file


def test_save_file_bf16_read_by_the_official_reader(tmp_path: Path) -> None:
    tree = _tree()
    path = tmp_path / "w.safetensors"
    osf.save_file(tree, path, dtype=jnp.bfloat16)
    got = _official(path)
    assert got["layer.kernel"].dtype == BF16
    np.testing.assert_array_equal(
        got["layer.kernel"].view(np.uint16), _cast(tree["layer"]["kernel"], BF16).view(np.uint16)
    )
    assert got["table"].dtype == BF16 and got["half"].dtype == BF16  # f64 and f16 too
    assert got["ids"].dtype == np.int32 and got["key"].dtype == np.uint32  # not floating
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    data = path.stat().st_size - 8 - header_len
    assert data == 2 * (8 * 16 + 16 + 16 + 12 + 6) + 4 * 5 + 4 * 2  # bf16 floats, ints, key
    # Our reader checks the CRC32C of the stored bytes, and rebuilds the tree.
    assert osf.verify(path).ok
    restored = osf.load_file(path)
    assert restored["layer"]["kernel"].dtype == BF16  # no target: the stored dtype
    assert restored["step"] == 12 and restored["ids"].dtype == np.int32
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(tree["key"])
    target = osf.load_file(path, target=tree)  # a target: the target's dtype
    assert target["layer"]["kernel"].dtype == np.float32
    assert target["table"].dtype == np.float64
    np.testing.assert_array_equal(
        np.asarray(target["layer"]["kernel"]),
        _cast(tree["layer"]["kernel"], BF16).astype(np.float32),
    )


def test_patterns_callable_and_the_recorded_original_dtypes(tmp_path: Path, capsys: Any) -> None:
    tree = _tree()
    path = tmp_path / "w.safetensors"
    osf.save_file(tree, path, dtype={"*.norm.*": None, "layer.*": "float16", "ids": "int8"})
    got = _official(path)
    assert {k: v.dtype.name for k, v in got.items()} == {
        "layer.kernel": "float16",
        "layer.bias": "float16",
        "layer.norm.scale": "float32",
        "table": "float64",
        "half": "float16",
        "ids": "int8",
        "key": "uint32",
    }
    tensors = _sources.open_source(path).tensors
    assert {n: t.cast_from for n, t in tensors.items() if t.cast_from} == {
        "layer.kernel": "F32",
        "layer.bias": "F32",
        "ids": "I32",
    }
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "F16 (from F32)" in out and "I8 (from I32)" in out
    report = _inspection.inspect_path(path)
    by_name = {t["name"]: t for t in report["tensors"]}
    assert by_name["layer.kernel"]["cast_from"] == "F32"
    assert "cast_from" not in by_name["layer.norm.scale"]

    osf.save_file(tree, path, dtype=lambda name, leaf: jnp.bfloat16 if leaf.ndim == 2 else None)
    got = _official(path)
    assert got["layer.kernel"].dtype == BF16 and got["table"].dtype == BF16
    assert got["layer.bias"].dtype == np.float32


def test_an_alias_is_cast_once_and_stays_shared(tmp_path: Path) -> None:
    w = jnp.arange(6.0, dtype=jnp.float32)
    path = tmp_path / "tied.safetensors"
    osf.save_file({"embed": w, "head": w}, path, dtype=jnp.bfloat16)
    assert list(_official(path)) == ["embed"]
    restored = osf.load_file(path)
    assert restored["head"] is restored["embed"] and restored["head"].dtype == BF16


@pytest.mark.parametrize(
    "policy",
    [{"embed": "bfloat16"}, {"head": "bfloat16"}, {"embed": "float16", "head": "bfloat16"}],
    ids=str,
)
@pytest.mark.parametrize("how", ["save_file", "save_directory", "manager"])
def test_an_alias_named_another_dtype_is_stored_on_its_own(
    tmp_path: Path, policy: dict[str, str], how: str
) -> None:
    # As Orbax's SaveArgs(dtype=) would: each path in the dtype its own name resolves to.
    w = jnp.arange(6.0, dtype=jnp.float32) + 0.1
    tree = {"embed": w, "head": w, "also": w}
    if how == "save_file":
        osf.save_file(tree, tmp_path / "t.safetensors", dtype=policy)
        files = [tmp_path / "t.safetensors"]
        restored = osf.load_file(tmp_path / "t.safetensors")
    elif how == "save_directory":
        osf.save_directory(tree, tmp_path / "d", dtype=policy)
        files = sorted((tmp_path / "d").glob("*.safetensors"))
        restored = osf.restore_directory(tmp_path / "d")
    else:
        with ocp.CheckpointManager(tmp_path / "m") as mngr:
            mngr.save(0, args=osf.SafetensorsSave(tree, dtype=policy))
            mngr.wait_until_finished()
            restored = mngr.restore(0, args=osf.SafetensorsRestore())
        files = sorted((tmp_path / "m" / "0").rglob("*.safetensors"))
    stored = {k: v for f in files for k, v in _official(f).items()}
    want = {k: np.dtype(policy.get(k, "float32")) for k in tree}
    assert {k: v.dtype for k, v in stored.items()} == {k: want[k] for k in stored}
    # one tensor per dtype, the first path of each: the paths that agree stay tied
    firsts = {want[k]: k for k in reversed(tree)}
    assert sorted(stored) == sorted(firsts.values())
    for k in tree:
        assert restored[k].dtype == want[k]
        np.testing.assert_array_equal(np.asarray(restored[k]), _cast(w, want[k]))
        assert restored[k] is restored[firsts[want[k]]]


def test_files_without_cast_records_still_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    osf.save_file(_tree(), path)
    assert "cast_from" not in _schema_text(path)
    assert all(t.cast_from is None for t in _sources.open_source(path).tensors.values())
    assert osf.load_file(path)["layer"]["kernel"].dtype == np.float32


def test_save_model_bf16_and_load_model_gives_the_models_dtype(tmp_path: Path) -> None:
    from flax import nnx

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    path = tmp_path / "m.safetensors"
    osf.save_model(model, path, dtype=jnp.bfloat16)
    assert _official(path)["kernel"].dtype == BF16
    fresh = nnx.Linear(4, 3, rngs=nnx.Rngs(1))
    osf.load_model(fresh, path)
    assert fresh.kernel.value.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(fresh.kernel.value), _cast(model.kernel.value, BF16).astype(np.float32)
    )


# --------------------------------------------------------------------------- CheckpointManager


@pytest.mark.parametrize("async_enabled", [True, False], ids=["async", "sync"])
def test_manager_saves_bf16_and_restores_either_dtype(tmp_path: Path, async_enabled: bool) -> None:
    tree = _tree()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    mngr = ocp.CheckpointManager(tmp_path, options=options)
    policy = {"*.norm.*": None, "key": None, "*": jnp.bfloat16}
    args = osf.SafetensorsSave(tree, dtype=policy)
    assert "dtype={'*.norm.*': None, 'key': None, '*': bfloat16}" in repr(args)
    mngr.save(0, args=args)
    mngr.wait_until_finished()
    item = tmp_path / "0" / "default"
    got = _official(item / "model.safetensors")
    assert got["layer.kernel"].dtype == BF16 and got["layer.norm.scale"].dtype == np.float32
    assert got["ids"].dtype == BF16  # '*' maps every name, ints too
    np.testing.assert_array_equal(
        got["layer.kernel"].view(np.uint16), _cast(tree["layer"]["kernel"], BF16).view(np.uint16)
    )
    doc = json.loads((item / "orbax_safetensors.json").read_text())
    assert doc["tensors"]["layer.kernel"]["dtype"] == "BF16"
    assert osf.verify(item).ok  # CRC32C of the stored (cast) bytes
    meta = mngr.item_metadata(0)
    assert meta["layer"]["kernel"].dtype == BF16  # the stored dtype
    assert mngr.restore(0, args=osf.SafetensorsRestore())["layer"]["kernel"].dtype == BF16
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    restored = mngr.restore(0, args=osf.SafetensorsRestore(abstract))
    assert restored["layer"]["kernel"].dtype == jnp.float32
    assert restored["ids"].dtype == jnp.int32 and restored["table"].dtype == np.float64
    np.testing.assert_array_equal(np.asarray(restored["ids"]), np.arange(5))
    mngr.close()


def test_sharded_arrays_are_cast_shard_by_shard(tmp_path: Path) -> None:
    mesh = devices.mesh((4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    w = jax.device_put(jnp.linspace(-3, 3, 64 * 32, dtype=jnp.float32).reshape(64, 32), sharding)
    replicated = jax.device_put(
        jnp.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    mngr = ocp.CheckpointManager(tmp_path)
    mngr.save(0, args=osf.SafetensorsSave({"w": w, "r": replicated}, dtype="bfloat16"))
    mngr.wait_until_finished()
    got = _official(tmp_path / "0" / "default" / "model.safetensors")
    np.testing.assert_array_equal(got["w"].view(np.uint16), _cast(w, BF16).view(np.uint16))
    np.testing.assert_array_equal(got["r"], np.arange(8.0).astype(BF16))
    target = {"w": jax.ShapeDtypeStruct(w.shape, jnp.float32, sharding=sharding), "r": replicated}
    restored = mngr.restore(0, args=osf.SafetensorsRestore(target))
    assert restored["w"].sharding == sharding and restored["w"].dtype == jnp.float32
    mngr.close()


def test_sync_save_extra_memory_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    """16 x 16 MiB float32 saved as bf16 by a synchronous save written straight from the
    arrays (``snapshot=False``): the whole cast state (128 MiB) is more than the bound
    (largest tensor, 16 MiB, plus 64 MiB), so a cast copy of the state would fail."""
    mib = 1 << 20
    state = {f"w{i:02d}": jnp.full((4 * mib,), i + 0.5, jnp.float32) for i in range(16)}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    mngr = ocp.CheckpointManager(tmp_path, options=options)
    mngr.save(0, args=osf.SafetensorsSave({"w": jnp.ones(4)}, dtype=jnp.bfloat16))  # warm-up

    def save() -> None:
        mngr.save(1, args=osf.SafetensorsSave(state, dtype=jnp.bfloat16, snapshot=False))

    peak = traced_peak(save)
    restored = mngr.restore(1, args=osf.SafetensorsRestore())
    mngr.close()
    assert restored["w15"].dtype == BF16 and float(restored["w15"][0]) == 15.5
    largest = 16 * mib
    if jax.devices()[0].platform == "cpu":
        assert peak <= largest + 64 * mib, peak / mib
        assert peak < 128 * mib * 0.7, peak / mib  # well under a cast copy of the state
    else:  # also the uncast host copies of the tensor being cast and of the next (its
        # transfer started ahead): on CPU these are views of the device buffers
        assert peak <= 3 * largest + 64 * mib, peak / mib
        assert peak < (128 + 256) * mib * 0.7, peak / mib  # cast copy + host copy of the state


def test_save_file_extra_memory_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    """save_file casts a batch of tensors at a time: 24 x 8 MiB float32 as bf16 (96 MiB cast)
    with at most the largest tensor (8 MiB) plus 64 MiB extra."""
    mib = 1 << 20
    state = {f"w{i:02d}": np.full(2 * mib, i + 0.25, np.float32) for i in range(24)}
    path = tmp_path / "w.safetensors"
    osf.save_file({"w": np.ones(4, np.float32)}, path, dtype=jnp.bfloat16)  # warm-up
    peak = traced_peak(lambda: osf.save_file(state, path, dtype=jnp.bfloat16))
    assert peak <= 8 * mib + 64 * mib, peak / mib
    got = _official(path)
    assert got["w23"].dtype == BF16 and float(got["w23"][0]) == 23.25


def test_async_snapshot_holds_the_cast_bytes(tmp_path: Path) -> None:
    mib = 1 << 20
    state = {f"w{i}": jnp.full((2 * mib,), float(i), jnp.float32) for i in range(4)}  # 32 MiB
    casts = {i: BF16 for i in range(4)}
    snaps = list(_snapshots.iter_snapshots(enumerate(state.values()), casts=casts))
    assert [c[0][1].dtype for _, c in snaps] == [BF16] * 4
    assert sum(c[0][1].nbytes for _, c in snaps) == 16 * mib  # half of the float32 state
    for (_, copies), x in zip(snaps, state.values()):
        assert copies[0][1].ctypes.data != x.unsafe_buffer_pointer()  # owned, not a view
    del snaps

    mngr = ocp.CheckpointManager(tmp_path)  # async
    mngr.save(0, args=osf.SafetensorsSave({"w": jnp.ones(4)}, dtype=jnp.bfloat16))  # warm-up
    mngr.wait_until_finished()
    donate = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)

    def save() -> None:
        mngr.save(1, args=osf.SafetensorsSave(state, dtype=jnp.bfloat16))
        donate(state)  # right after save() returns: the snapshot must be complete
        mngr.wait_until_finished()

    peak = traced_peak(save)
    assert all(x.is_deleted() for x in state.values())
    restored = mngr.restore(1, args=osf.SafetensorsRestore())
    mngr.close()
    assert [float(restored[f"w{i}"][-1]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    if jax.devices()[0].platform == "cpu":
        assert peak < 24 * mib, peak / mib  # the cast snapshot (16 MiB), never the float32 one
    else:  # JAX's float32 host copies, started a bounded way ahead of the casts
        assert peak < 16 * mib + _snapshots.COPIES_AHEAD_BYTES + 8 * mib, peak / mib


# --------------------------------------------------------------------------- v1 and convert


@pytest.mark.skipif(not orbaxcompat.has_orbax_v1(), reason="this orbax-checkpoint lacks the v1 API")
def test_v1_handler_with_a_dtype_policy(tmp_path: Path) -> None:
    from orbax.checkpoint import v1

    class Bf16Export(osf.SafetensorsHandler):
        def __init__(self) -> None:
            super().__init__(dtype=jnp.bfloat16)

    with pytest.raises(ValueError, match="is not a dtype"):
        osf.SafetensorsHandler(dtype="bf17")
    tree = {"w": jnp.linspace(0, 1, 12, dtype=jnp.float32), "n": jnp.arange(3)}
    ctx = v1.Context()
    ctx.checkpointables.registry = osf.local_registry(Bf16Export)
    with ctx:
        v1.save(tmp_path / "ckpt", tree)
        restored = v1.load(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    got = _official(tmp_path / "ckpt" / "state" / "model.safetensors")
    assert got["w"].dtype == BF16 and got["n"].dtype == np.int32
    assert restored["w"].dtype == jnp.float32


def test_convert_dtype_from_orbax(tmp_path: Path, capsys: Any) -> None:
    tree = _tree()
    del tree["key"], tree["table"]
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "orbax", tree)
    ckptr.wait_until_finished()
    ckptr.close()
    code = cli.main(
        ["convert", str(tmp_path / "orbax"), str(tmp_path / "st"), "-q", "--dtype", "bfloat16"]
    )
    assert code == 0, capsys.readouterr()
    got = _official(tmp_path / "st" / "model.safetensors")
    assert got["layer.kernel"].dtype == BF16 and got["ids"].dtype == np.int32
    np.testing.assert_array_equal(
        got["layer.kernel"].view(np.uint16), _cast(tree["layer"]["kernel"], BF16).view(np.uint16)
    )
    assert osf.verify(tmp_path / "st").ok
    assert _sources.open_source(tmp_path / "st").tensors["layer.kernel"].cast_from == "F32"
    # Patterns, first match wins; 'keep' keeps.
    argv = ["convert", str(tmp_path / "orbax"), str(tmp_path / "st2"), "-q"]
    argv += ["--dtype", "*.norm.*=keep", "--dtype", "layer.*=float16"]
    assert cli.main(argv) == 0
    got = _official(tmp_path / "st2" / "model.safetensors")
    assert got["layer.kernel"].dtype == np.float16 and got["layer.norm.scale"].dtype == np.float32
    assert got["half"].dtype == np.float16
    capsys.readouterr()
    # A bad value fails before anything is written.
    bad = ["convert", str(tmp_path / "orbax"), str(tmp_path / "st3"), "-q", "--dtype", "int8"]
    assert cli.main(bad) == 2
    assert "single dtype applies to floating-point arrays" in capsys.readouterr().err
    bad = ["convert", str(tmp_path / "orbax"), str(tmp_path / "st3"), "-q", "--dtype", "=x"]
    assert cli.main(bad) == 2
    assert not (tmp_path / "st3").exists()
    # The reverse direction refuses a policy instead of ignoring it.
    with pytest.raises(ValueError, match="applies to conversions to safetensors"):
        osf.convert(tmp_path / "st", tmp_path / "back", dtype="bfloat16")
    assert not (tmp_path / "back").exists()
