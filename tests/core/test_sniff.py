"""A path that is not safetensors: load_file, inspect and verify say what it looks like and
what to run, from real files written by flax, pickle, zipfile, numpy, torch and Orbax."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import zipfile

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors._src.core import sniff
from orbax_safetensors._src.core.errors import NotSafetensorsError
from orbax_safetensors._src.tools import cli

STATE = {"params": {"dense": {"kernel": np.ones((3, 4), np.float32)}}, "step": 3}


def _flax_to_bytes(tmp_path) -> epath.Path:
    from flax import serialization

    path = epath.Path(tmp_path) / "flax_model.msgpack"
    path.write_bytes(serialization.to_bytes(STATE))
    return path


def _flax_training_checkpoint(tmp_path) -> epath.Path:
    import flax
    from flax.training import checkpoints

    before = flax.config.flax_use_orbax_checkpointing
    flax.config.update("flax_use_orbax_checkpointing", False)  # the legacy msgpack file
    try:
        written = checkpoints.save_checkpoint(
            os.fspath(epath.Path(tmp_path) / "flax_ckpts"), STATE, step=3
        )
    finally:
        flax.config.update("flax_use_orbax_checkpointing", before)
    path = epath.Path(written)
    assert path.name == "checkpoint_3" and path.is_file()
    return path


def _pickle(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "state.pkl"
    with open(path, "wb") as f:
        pickle.dump(STATE, f)  # written here, never loaded
    return path


def _zip(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "weights.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("README.txt", "hello")
    return path


def _npz(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "arrays.npz"
    np.savez(path, w=np.ones(3))
    return path


def _npy(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "w.npy"
    np.save(path, np.ones(3))
    return path


def _gzip(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "ckpt.tar.gz"
    path.write_bytes(gzip.compress(b"x" * 100))
    return path


def _lfs_pointer(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "model.safetensors"
    path.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 12345\n"
    )
    return path


def _orbax_dir(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "orbax_ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"w": jnp.ones(3)})
        ckptr.wait_until_finished()
    return path


def _orbax_root(tmp_path) -> epath.Path:
    path = epath.Path(tmp_path) / "orbax_root"
    with ocp.CheckpointManager(path) as mngr:
        mngr.save(7, args=ocp.args.StandardSave({"w": jnp.ones(3)}))
        mngr.wait_until_finished()
    return path


CASES = [
    (_flax_to_bytes, "flax-msgpack", ["Flax msgpack checkpoint", "'params'", "convert"]),
    (_flax_training_checkpoint, "flax-msgpack", ["checkpoint_<step>", "orbax-safetensors convert"]),
    (_pickle, "pickle", ["pickle", "never unpickles"]),
    (_zip, "zip", ["zip archive", "'README.txt'"]),
    (_npz, "npz", ["NumPy .npz", "np.load"]),
    (_npy, "npy", ["NumPy .npy"]),
    (_gzip, "gzip", ["gzip"]),
    (_lfs_pointer, "lfs-pointer", ["Git LFS pointer", "git lfs pull"]),
    (_orbax_dir, "orbax-item", ["Orbax-native checkpoint", "orbax-safetensors convert"]),
    (_orbax_root, "orbax-root", ["CheckpointManager root (steps 7)", "convert"]),
]


@pytest.mark.parametrize(
    ("make", "kind", "words"), CASES, ids=[c[1] + c[0].__name__ for c in CASES]
)
def test_load_file_says_what_it_is(tmp_path, make, kind, words):
    path = make(tmp_path)
    with pytest.raises(NotSafetensorsError) as e:
        osf.load_file(path)
    assert isinstance(e.value, osf.HeaderError)  # callers catching HeaderError still do
    assert e.value.found.kind == kind
    text = str(e.value)
    assert str(path) in text and "byte cap" not in text
    for word in words:
        assert word in text, (word, text)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "make", [_flax_to_bytes, _flax_training_checkpoint, _pickle, _zip], ids=lambda m: m.__name__
)
def test_inspect_and_verify_say_what_it_is(tmp_path, capsys, make):
    path = make(tmp_path)
    commands = ["inspect", "verify"]
    if make in (_flax_to_bytes, _flax_training_checkpoint):
        # inspect reads a Flax msgpack file itself (as diff and convert do) and says so.
        code, out = _cli(capsys, "inspect", os.fspath(path))
        assert code == 0 and "params.dense.kernel" in out, out
        assert "a Flax msgpack checkpoint, not safetensors" in out and "convert" in out, out
        commands.remove("inspect")
    for command in commands:
        code, out = _cli(capsys, command, os.fspath(path))
        assert code == cli.EXIT_ERROR, out  # not damage (1): not a checkpoint at all
        assert "it looks like" in out and "byte cap" not in out, out
    with pytest.raises(NotSafetensorsError, match="it looks like"):
        osf.verify(path)


def test_verify_of_an_orbax_native_checkpoint_says_so(tmp_path, capsys):
    for path, what in (
        (_orbax_dir(tmp_path), "Orbax-native checkpoint"),
        (_orbax_root(tmp_path), "CheckpointManager root (steps 7)"),
    ):
        code, out = _cli(capsys, "verify", os.fspath(path))
        assert code == cli.EXIT_ERROR and "which verify cannot check" in out, out
        assert what in out and "orbax-safetensors convert" in out, out


def test_torch_save_file(tmp_path):
    torch = pytest.importorskip("torch")
    new = epath.Path(tmp_path) / "pytorch_model.bin"
    torch.save({"w": torch.ones(2)}, os.fspath(new))
    old = epath.Path(tmp_path) / "legacy.pt"
    torch.save({"w": torch.ones(2)}, os.fspath(old), _use_new_zipfile_serialization=False)
    for path, kind in ((new, "torch-zip"), (old, "pickle")):
        with pytest.raises(NotSafetensorsError) as e:
            osf.load_file(path)
        assert e.value.found.kind == kind
        assert "never unpickles" in str(e.value) and "safetensors.torch.save_file" in str(e.value)


def test_damaged_safetensors_is_not_mistaken_for_something_else(tmp_path):
    # A header whose length begins with a msgpack-map byte (0x85) and a pickle-like 0x80 0x02:
    # damaged safetensors files stay plain HeaderErrors naming the real problem.
    for length in (0x285, 0x0280):
        header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        header += b" " * (length - len(header))
        data = struct.pack("<Q", length) + header + b"\0\0\0\0"
        path = epath.Path(tmp_path) / f"h{length}.safetensors"
        path.write_bytes(data)
        assert set(osf.load_file(path)) == {"a"}  # valid: read as usual
        path.write_bytes(data[:-2])  # truncated
        with pytest.raises(osf.HeaderError) as e:
            osf.load_file(path)
        assert not isinstance(e.value, NotSafetensorsError), e.value
    assert sniff.sniff_bytes(b"\x85\x02" + b"\0" * 6 + b'{"') is None


def test_sniff_needs_a_string_key_for_msgpack():
    # A fixmap byte followed by no string is not called msgpack.
    assert sniff.sniff_bytes(b"\x85\x01\x02\x03") is None
    found = sniff.sniff_bytes(b"\xde\x00\x02\xa6params\x80")
    assert found is not None and found.kind == "flax-msgpack" and "'params'" in found.description
    assert sniff.sniff_bytes(b"") is None


def test_load_file_on_directories_of_our_own_layouts(tmp_path):
    item = epath.Path(tmp_path) / "item"
    osf.save_directory({"w": np.ones(2)}, item)
    with pytest.raises(NotSafetensorsError, match=r"osf\.restore_directory") as e:
        osf.load_file(item)
    assert e.value.found.kind == "osf-checkpoint" and "a directory, not a safetensors" in str(
        e.value
    )
    plain = epath.Path(tmp_path) / "hf"
    plain.mkdir()
    osf.save_file({"w": np.ones(2)}, plain / "model.safetensors")
    with pytest.raises(NotSafetensorsError, match="directory of safetensors files"):
        osf.load_file(plain)
    spaced = epath.Path(tmp_path) / "my ckpt.msgpack"
    spaced.write_bytes(_flax_to_bytes(tmp_path).read_bytes())
    with pytest.raises(NotSafetensorsError) as e:
        osf.load_file(spaced)
    assert f"convert '{spaced}' 'my ckpt.safetensors'" in str(e.value)  # shell-quoted
