"""Legacy Flax msgpack checkpoints -> safetensors: files written by flax itself
(``flax.training.checkpoints`` with Orbax checkpointing off, ``flax.serialization.to_bytes``,
chunked arrays, every ext type), checked with the official ``safetensors`` reader and Orbax's
CheckpointManager against ``flax.traverse_util.flatten_dict`` of what flax restores; truncated
and forged files fail clearly and write nothing."""

from __future__ import annotations

import struct
import tracemalloc

import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization, traverse_util
from flax.training import checkpoints, train_state
from official_reader import reads
from safetensors import safe_open

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.catalog import flax_msgpack


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def state_example():
    """A Flax TrainState (params, adam state, step) plus every kind of leaf flax encodes."""
    params = {
        "Dense_0": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.zeros(4)},
        "embed": np.arange(300, dtype=np.float32).reshape(30, 10),  # chunked below
        "half": jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16),
    }
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    return {
        "state": ts,
        "extra": {
            "i8": np.arange(-3, 3, dtype=np.int8),
            "mask": np.array([True, False]),
            "u64": np.array([2**63 + 5], np.uint64),
            "f64": np.linspace(0, 1, 3),
            "f16": np.ones((2, 2), np.float16),
            "empty": np.zeros((0, 3), np.float32),
            "np_scalar": np.float32(2.5),
            "np_int": np.int64(-7),
            "py_int": 42,
            "py_float": 0.125,
            "flag": True,
            "name": "run-7",
            "nothing": None,
            "pair": (np.ones(2, np.int32), 3),
        },
        "no_state": {},
    }


@pytest.fixture(scope="module")
def flax_ckpt(tmp_path_factory):
    """A ``checkpoint_3`` file written by flax.training.checkpoints with Orbax off, with a
    chunked array (MAX_CHUNK_SIZE lowered while flax writes)."""
    d = tmp_path_factory.mktemp("flax_ckpts")
    old_flag = checkpoints.config.flax_use_orbax_checkpointing
    old_chunk = serialization.MAX_CHUNK_SIZE
    checkpoints.config.update("flax_use_orbax_checkpointing", False)
    serialization.MAX_CHUNK_SIZE = 256  # bytes: "embed" (1200 bytes) is written in 5 chunks
    try:
        path = checkpoints.save_checkpoint(d, state_example(), step=3)
    finally:
        serialization.MAX_CHUNK_SIZE = old_chunk
        checkpoints.config.update("flax_use_orbax_checkpointing", old_flag)
    return d / "checkpoint_3" if not path else type(d)(path)


def flax_expected(path):
    """What flax itself restores, flattened as flax.traverse_util does."""
    restored = checkpoints.restore_checkpoint(path, target=None)
    return traverse_util.flatten_dict(restored, sep=".")


def assert_same_leaves(expected, got):
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        value = got[name]
        if isinstance(want, (np.ndarray, np.generic)):
            assert np.asarray(value).dtype == np.asarray(want).dtype, name
            np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=name)
        else:
            assert value == want and type(value) is type(want), name


def test_the_file_is_really_flax_msgpack_with_chunks(flax_ckpt):
    raw = flax_ckpt.read_bytes()
    assert flax_ckpt.name == "checkpoint_3" and raw[:1] in (b"\x83", b"\xde")
    assert b"__msgpack_chunked_array__" in raw
    # load_file says what it is and what to run (it once said "header length ... exceeds").
    with pytest.raises(osf.SafetensorsCheckpointError, match="looks like a Flax msgpack"):
        osf.load_file(flax_ckpt)


def test_decoder_gives_what_flax_restores(flax_ckpt):
    expected = flax_expected(flax_ckpt)
    got = flax_msgpack.flatten(flax_msgpack.read_file(flax_ckpt))
    assert_same_leaves(expected, got)
    assert expected["state.params.embed"].shape == (30, 10)
    assert "state.opt_state.0.mu.Dense_0.kernel" in expected


def test_convert_to_one_file_read_by_the_official_reader(flax_ckpt, tmp_path, capsys):
    out = tmp_path / "out.safetensors"
    code, stdout, err = run(capsys, "convert", flax_ckpt, out, "-q")
    assert code == 0, err
    assert "to safetensors" in stdout
    expected = flax_expected(flax_ckpt)
    arrays = {n: v for n, v in expected.items() if isinstance(v, (np.ndarray, np.generic))}
    # The official reader: numpy for every dtype it has, flax (jax) for bfloat16.
    with safe_open(out, "numpy") as f, safe_open(out, "flax") as fj:
        assert sorted(f.keys()) == sorted(arrays)
        for name, want in arrays.items():
            bf16 = np.asarray(want).dtype == ml_dtypes.bfloat16
            got = np.asarray(fj.get_tensor(name) if bf16 else f.get_tensor(name))
            assert got.dtype == np.asarray(want).dtype, name
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)
    # Scalars, strings and None come back from the tree schema: the whole state dict.
    assert_same_leaves(expected, traverse_util.flatten_dict(osf.load_file(out), sep="."))
    code, stdout, _ = run(capsys, "diff", flax_ckpt, out)
    assert code == 0, stdout


def test_convert_to_a_checkpoint_manager_root(flax_ckpt, tmp_path, capsys):
    root = tmp_path / "st_ckpts"
    code, stdout, err = run(capsys, "convert", flax_ckpt, root, "-q")
    assert code == 0, err
    assert "3/default" in stdout
    with ocp.CheckpointManager(root) as mngr:
        assert mngr.all_steps() == [3]
        restored = mngr.restore(3)
        meta = mngr.item_metadata(3)
    expected = flax_expected(flax_ckpt)
    assert_same_leaves(expected, traverse_util.flatten_dict(restored, sep="."))
    assert meta.tree["state"]["params"]["embed"].shape == (30, 10)
    files = sorted((root / "3" / "default").glob("*.safetensors"))
    with safe_open(files[0], "numpy") as f:
        np.testing.assert_array_equal(
            np.asarray(f.get_tensor("state.params.Dense_0.kernel")),
            expected["state.params.Dense_0.kernel"],
        )


def test_to_bytes_file_every_ext_type(tmp_path):
    tree = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "c64": np.array([1 + 2j, -0.5j], np.complex64),
        "z": 1.5 - 2j,  # native_complex ext: exact in complex64
        "s": np.float16(0.5),  # npscalar ext
        "b": np.bool_(True),
        "f8": np.array([0.5, 2.0], ml_dtypes.float8_e4m3fn),
        "list": [np.ones(2, np.int32), 5],  # a raw msgpack array (not a state dict)
    }
    src = tmp_path / "flax_model.msgpack"
    src.write_bytes(serialization.msgpack_serialize(tree))  # (to_bytes makes lists dicts)
    restored = serialization.msgpack_restore(src.read_bytes())
    osf.convert(src, tmp_path / "m.safetensors", progress=False)
    back = osf.load_file(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(back["w"], restored["w"])
    np.testing.assert_array_equal(back["c64"], restored["c64"])
    assert complex(back["z"]) == restored["z"] == 1.5 - 2j
    assert back["s"] == restored["s"] and np.asarray(back["s"]).dtype == np.float16
    assert bool(back["b"]) is True
    np.testing.assert_array_equal(back["f8"], np.array([0.5, 2.0], ml_dtypes.float8_e4m3fn))
    np.testing.assert_array_equal(back["list"][0], restored["list"][0])
    assert back["list"][1] == 5
    if reads("C64") and reads("F8_E4M3"):
        with safe_open(tmp_path / "m.safetensors", "numpy") as f:
            np.testing.assert_array_equal(f.get_tensor("c64"), tree["c64"])


def test_a_directory_needs_a_step_unless_the_name_has_one(tmp_path, capsys):
    src = tmp_path / "flax_model.msgpack"
    src.write_bytes(serialization.to_bytes({"w": np.ones(3, np.float32)}))
    code, _, err = run(capsys, "convert", src, tmp_path / "root", "-q")
    assert code == 2 and "--step" in err
    assert not (tmp_path / "root").exists()
    code, _, err = run(capsys, "convert", src, tmp_path / "root", "--step", "7", "-q")
    assert code == 0, err
    with ocp.CheckpointManager(tmp_path / "root") as mngr:
        assert mngr.all_steps() == [7]
        np.testing.assert_array_equal(mngr.restore(7)["w"], np.ones(3, np.float32))


def test_complex128_that_complex64_cannot_hold_is_refused(tmp_path):
    src = tmp_path / "c.msgpack"
    src.write_bytes(serialization.to_bytes({"z": 0.1 + 0j}))
    with pytest.raises(osf.SafetensorsCheckpointError, match=r"'z'.*complex64"):
        osf.convert(src, tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.msgpack"]


# --------------------------------------------------------------------------- hostile files


def ext(code, payload):
    return msgpack.ExtType(code, payload)


def ndarray_ext(shape, dtype, data):
    return ext(1, msgpack.packb((shape, dtype, data), use_bin_type=True))


def assert_refused(tmp_path, raw, *patterns):
    src = tmp_path / "checkpoint_1"
    src.write_bytes(raw)
    before = sorted(p.name for p in tmp_path.iterdir())
    for dst in (tmp_path / "out.safetensors", tmp_path / "root"):
        with pytest.raises(osf.SafetensorsCheckpointError) as info:
            osf.convert(src, dst, progress=False)
        for pattern in patterns:
            assert pattern in str(info.value), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    return str(info.value)


@pytest.mark.parametrize("cut", [1, 2, 9, 40, -30, -1])
def test_truncated_file_fails_clearly_and_writes_nothing(flax_ckpt, tmp_path, cut):
    raw = flax_ckpt.read_bytes()
    assert_refused(tmp_path, raw[:cut], "checkpoint_1")


def test_forged_shape_is_checked_against_the_payload_before_allocating(tmp_path):
    huge = [2**20, 2**20, 2**10]  # 4 PiB of float32 claimed, 8 bytes present
    raw = msgpack.packb({"params": {"w": ndarray_ext(huge, "float32", b"\0" * 8)}})
    tracemalloc.start()
    try:
        message = assert_refused(tmp_path, raw, "'params.w'", "float32", "8")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "(1048576, 1048576, 1024)" in message
    assert peak < 4 << 20, peak  # bounded by the file's real size, not the claimed shape


@pytest.mark.parametrize(
    ("payload", "pattern"),
    [
        (ext(5, b"\x80\x04K\x01."), "ext type 5"),  # e.g. a pickle: never run
        (ndarray_ext([1], "object", b"\0" * 8), "'object'"),
        (ndarray_ext([2], "V4", b"\0" * 8), "'V4'"),
        (ndarray_ext([-1], "float32", b""), "shape"),
        (ndarray_ext("abc", "float32", b""), "shape"),
        (ext(1, b"\x93\x91\x01"), "damaged array"),
        (ext(2, msgpack.packb(("a", 1))), "complex"),
        (ext(3, msgpack.packb(([2], "float32", b"\0" * 8), use_bin_type=True)), "scalar"),
        (
            {
                "__msgpack_chunked_array__": True,
                "shape": {"0": 10},
                "chunks": {"0": ndarray_ext([3], "float32", b"\0" * 12)},
            },
            "chunks hold 3",
        ),
    ],
)
def test_forged_values_are_refused_naming_the_key(tmp_path, payload, pattern):
    raw = msgpack.packb({"layer": {"x": payload}})
    assert_refused(tmp_path, raw, "'layer.x'", pattern)


def test_not_a_state_dict_and_trailing_bytes(tmp_path):
    ok = msgpack.packb({"w": 1})
    assert_refused(tmp_path, ok + b"\x00", "follow")
    deep = b"\x81\xa1a" * 5000 + b"\x01"  # nested maps far beyond msgpack's stack
    assert_refused(tmp_path, deep, "nested too deeply")
    deep = b"\x81\xa1a" * 600 + b"\x01"  # within msgpack's stack, beyond Python's recursion
    assert_refused(tmp_path, deep, "nested deeper than 128")


def test_safetensors_file_is_never_taken_for_msgpack(tmp_path):
    # A header length whose first byte is a msgpack map marker (0x80-0x8f).
    osf.save_file({"w": np.ones(3, np.float32)}, tmp_path / "x.bin")
    head = (tmp_path / "x.bin").read_bytes()[:9]
    assert head[8:9] == b"{" and not flax_msgpack.looks_like_flax_msgpack(head)
    assert flax_msgpack.looks_like_flax_msgpack(struct.pack("B", 0x85) + b"\xa1w")


def test_convert_selects_by_name(tmp_path):
    """``convert(include=..., exclude=...)`` on a Flax msgpack file keeps only the selected
    leaves (in their containers); a pattern matching nothing raises before DST exists."""

    src = tmp_path / "fm.msgpack"
    state = {"params": {"a": {"w": np.ones(2)}, "b": {"w": np.zeros(3)}}, "step": 3}
    src.write_bytes(serialization.to_bytes(state))
    summary = osf.convert(src, tmp_path / "a.safetensors", include=["params.a", "step"])
    assert summary.tensors == 1
    got = osf.load_file(tmp_path / "a.safetensors")
    assert set(got) == {"params", "step"} and set(got["params"]) == {"a"} and got["step"] == 3
    np.testing.assert_array_equal(got["params"]["a"]["w"], np.ones(2))
    got = osf.load_file(_convert_to(src, tmp_path / "b.safetensors", exclude="params.a.*"))
    assert set(got["params"]) == {"b"}
    with pytest.raises(osf.TargetMismatchError, match=r"'nothing\.\*' matches no name"):
        osf.convert(src, tmp_path / "c.safetensors", include="nothing.*")
    assert not (tmp_path / "c.safetensors").exists()


def _convert_to(src, dst, **selection):
    osf.convert(src, dst, **selection)
    return dst


def test_convert_with_a_dtype_policy(tmp_path):
    """``convert(dtype=...)`` applies to a Flax msgpack source too (a bf16 export)."""
    src = tmp_path / "fm.msgpack"
    state = {"params": {"w": np.ones(3, np.float32), "n": np.arange(2, dtype=np.int32)}}
    src.write_bytes(serialization.to_bytes(state))
    osf.convert(src, tmp_path / "bf16.safetensors", dtype="bfloat16")
    with safe_open(str(tmp_path / "bf16.safetensors"), "flax") as f:
        assert f.get_tensor("params.w").dtype == jnp.bfloat16
        assert f.get_tensor("params.n").dtype == jnp.int32
