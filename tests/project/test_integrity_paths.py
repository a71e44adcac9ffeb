"""Every read path of docs/security.md's table (*What is verified, and when*), each with one
flipped bit (issue 40 point 3).

Wherever this library wrote a tensor's CRC32C (a file's own header, or the
``orbax_safetensors.json`` of the checkpoint directory the file belongs to), every public way of
reading that tensor whole checks it: a flipped bit raises ``IntegrityError`` naming the tensor
and the file. Real files on disk, real CheckpointManagers (Orbax v0 and v1), the public API and
the command line. The multi-host row is in ``tests/multihost/test_integrity_multihost.py``, the
object-storage row in ``tests/objstore/test_objstore_reads.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.compat import orbaxcompat

pytestmark = pytest.mark.timeout(300)

META = "orbax_safetensors.json"
MAPPING = osf.KeyMapping(
    [osf.Rule("l.weight", "layer.kernel", osf.Transpose()), osf.Rule("l.bias", "layer.bias")]
)

_PARAMS = osf.KeyMapping([osf.Rule("w", "w"), osf.Rule("b", "b")])  # _state()'s params


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": rng.standard_normal((32, 40)).astype(np.float32),  # 5 KiB: a file of its own
            "b": np.zeros(40, np.float32),  # a flipped low bit reads back as 1e-45
        },
        "emb": rng.integers(0, 9, (64, 8), dtype=np.int32),
        "step": 3,
    }


def _saved_item(root: Path, tree: Any, **handler_options: Any) -> Path:
    """The item directory of step 1 of a fresh CheckpointManager root holding ``tree``."""
    handler = osf.SafetensorsCheckpointHandler(**handler_options)
    with ocp.CheckpointManager(root, item_names=("state",), item_handlers={"state": handler}) as m:
        m.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(tree)))
        m.wait_until_finished()
    return root / "1" / "state"


def _file_of(item: Path, name: str) -> Path:
    return item / json.loads((item / META).read_text())["tensors"][name]["file"]


def _flip(file: Path, name: str, at: int = 0, bit: int = 0) -> None:
    """Flips one bit of tensor ``name``'s bytes in ``file``."""
    header = osf.read_header(file)
    offset = header.data_start + header.tensors[name].begin + at
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _names_damage(name: str, file: Path) -> Any:
    """``pytest.raises`` for the IntegrityError naming tensor ``name`` in ``file``."""
    return pytest.raises(
        osf.IntegrityError, match=rf"tensor '{re.escape(name)}' in {re.escape(file.name)}: CRC32C"
    )


def _run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- load_file, load_model


def test_load_file_of_a_checkpoint_file_checks_the_directory_checksums(tmp_path: Path) -> None:
    """The issue's case: a bit flipped in a CheckpointManager item's ``model.safetensors``
    (whose checksums live in the directory's metadata, not in its header) is caught by
    ``load_file`` on that file, whatever subset a target or ``include`` asks for."""
    item = _saved_item(tmp_path / "one", _state())
    file = item / "model.safetensors"
    assert "orbax_safetensors.crc32c" not in osf.read_header(file).metadata
    _flip(file, "params.b")

    with _names_damage("params.b", file):
        osf.load_file(file)
    with _names_damage("params.b", file):
        osf.load_file(file, include="params")
    with _names_damage("params.b", file):
        osf.load_file(file, target={"params": {"b": np.zeros(40, np.float32)}}, strict=False)
    # What is not read is not checked, and is intact.
    np.testing.assert_array_equal(osf.load_file(file, include="emb")["emb"], _state()["emb"])
    out = osf.load_file(file, target={"emb": np.zeros((64, 8), np.int32)}, strict=False)
    np.testing.assert_array_equal(out["emb"], _state()["emb"])
    # verify=False opts out: the damaged value, as the issue saw it.
    assert osf.load_file(file, verify=False)["params.b"][0] == np.float32(1e-45)


def test_every_file_of_a_sharded_item_is_checked_by_load_file(tmp_path: Path) -> None:
    item = _saved_item(tmp_path / "split", _state(), max_file_size=4096)
    files = json.loads((item / META).read_text())["files"]
    assert len(files) > 1 and all(
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in files
    )
    pristine = tmp_path / "pristine"
    shutil.copytree(item, pristine)
    for name in ("params.w", "params.b", "emb"):
        file = _file_of(item, name)
        _flip(file, name, at=osf.read_header(file).tensors[name].nbytes - 1, bit=7)
        with _names_damage(name, file):
            osf.load_file(file)
        for other in sorted(set(files) - {file.name}):
            osf.load_file(item / other)  # the intact files load
        shutil.copyfile(pristine / file.name, file)


def test_a_directory_metadata_that_cannot_vouch_for_a_file_is_an_error(tmp_path: Path) -> None:
    """A file of a checkpoint directory is checked against that directory's metadata, which
    must describe it exactly as its header does; damaged or forged metadata is a clear error
    (never a reason to read unchecked), and ``verify=False`` does not read it at all."""
    item = _saved_item(tmp_path / "ckpt", _state())
    file = item / "model.safetensors"
    good = (item / META).read_text()

    def forged(edit: Any) -> None:
        doc = json.loads(good)
        edit(doc)
        (item / META).write_text(json.dumps(doc))

    def refused(match: str) -> None:
        refused_as = (osf.SchemaError, osf.HeaderError, osf.UnsafePathError)
        with pytest.raises(refused_as, match=match) as info:
            osf.load_file(file)
        assert "verify=False" in str(info.value) and META in str(info.value)
        assert osf.load_file(file, verify=False)["params.b"].shape == (40,)

    (item / META).write_text("{garbage")
    refused("not valid JSON")

    def unplaced(doc: dict[str, Any]) -> None:  # (as written before the offsets were recorded)
        doc.pop("file_layout")
        for info in doc["tensors"].values():
            info.pop("data_offsets")
        del doc["tensors"]["emb"]

    forged(unplaced)
    refused("holds tensor 'emb', which orbax_safetensors.json does not place in this file")

    def reshaped(doc: dict[str, Any]) -> None:
        doc.pop("file_layout")
        for info in doc["tensors"].values():
            info.pop("data_offsets")
        doc["tensors"]["emb"]["shape"] = [8, 64]

    forged(reshaped)
    refused(r"tensor 'emb' is I32\[64, 8\] in the file but I32\[8, 64\]")

    def moved(doc: dict[str, Any]) -> None:  # consistent in itself, not with the file
        doc["file_layout"]["model.safetensors"]["data_start"] += 4096
        doc["file_layout"]["model.safetensors"]["size"] += 4096

    forged(moved)
    refused(r"tensor '[\w.]+' lies at data_offsets \[\d+, \d+\] after a 4096-byte header")

    forged(lambda doc: doc["tensors"]["params.w"].update(crc32c="not-hex"))
    refused("params.w")

    os.remove(item / META)
    os.mkfifo(item / META)  # refused without blocking
    refused("not a regular file")
    os.remove(item / META)

    # A recorded checksum that does not match is damage, named like damaged data.
    forged(lambda doc: doc["tensors"]["params.w"].update(crc32c="00000000"))
    with _names_damage("params.w", file):
        osf.load_file(file)

    # A file the metadata does not list is not the checkpoint's: read as a file on its own.
    (item / META).write_text(good)
    stray = item / "stray.safetensors"
    shutil.copyfile(file, stray)
    assert osf.load_file(stray)["emb"].shape == (64, 8)
    assert len(osf.verify(stray).unverified) == 3

    # A file's own checksums always win: the metadata beside it is not read.
    own = item / "own.safetensors"
    osf.save_file(_state(), own)
    (item / META).write_text("{garbage")
    assert osf.load_file(own)["step"] == 3
    _flip(own, "emb", at=5)
    with _names_damage("emb", own):
        osf.load_file(own)


def test_load_model_checks_its_file(tmp_path: Path) -> None:
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    osf.save_model(model, tmp_path / "m.safetensors")
    _flip(tmp_path / "m.safetensors", "kernel", at=7, bit=3)
    with _names_damage("kernel", tmp_path / "m.safetensors"):
        osf.load_model(nnx.Linear(3, 4, rngs=nnx.Rngs(1)), tmp_path / "m.safetensors")

    item = _saved_item(tmp_path / "ckpt", nnx.state(model))
    file = item / "model.safetensors"
    fresh = nnx.Linear(3, 4, rngs=nnx.Rngs(1))
    osf.load_model(fresh, file)
    np.testing.assert_array_equal(np.asarray(fresh.kernel[...]), np.asarray(model.kernel[...]))
    _flip(file, "bias")
    with _names_damage("bias", file):
        osf.load_model(nnx.Linear(3, 4, rngs=nnx.Rngs(1)), file)


# --------------------------------------------------------------------------- directories, managers


def test_restore_directory_and_orbax_restores_check_every_tensor_read(tmp_path: Path) -> None:
    directory = tmp_path / "dir"
    osf.save_directory(_state(), directory, max_file_size=4096)
    file = _file_of(directory, "emb")
    _flip(file, "emb", at=100)
    with _names_damage("emb", file):
        osf.restore_directory(directory)
    with _names_damage("emb", file):
        osf.restore_directory(directory, include="emb")
    got = osf.restore_directory(directory, include="params")  # not read, not checked
    np.testing.assert_array_equal(got["params"]["w"], _state()["params"]["w"])

    # A manager's restore, whole, into a target, or a selection.
    item = _saved_item(tmp_path / "root", _state())
    _flip(item / "model.safetensors", "params.w", at=33)
    handler = osf.SafetensorsCheckpointHandler()
    with ocp.CheckpointManager(tmp_path / "root", item_handlers={"state": handler}) as mngr:
        for args in (
            osf.SafetensorsRestore(),
            osf.SafetensorsRestore(jax.eval_shape(_state)),
            osf.SafetensorsRestore(include="params.w"),
        ):
            with _names_damage("params.w", item / "model.safetensors"):
                mngr.restore(1, args=ocp.args.Composite(state=args))


@pytest.mark.skipif(not orbaxcompat.has_orbax_v1(), reason="this orbax-checkpoint lacks v1")
def test_orbax_v1_load_checks_every_tensor_read(tmp_path: Path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    tree = {"w": jnp.arange(64.0), "b": np.zeros(8, np.float32)}
    ctx = ocp_v1.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        ocp_v1.save(tmp_path / "ckpt", tree)
        file = tmp_path / "ckpt" / "state" / "model.safetensors"
        _flip(file, "w", at=8)
        with _names_damage("w", file):
            ocp_v1.load(tmp_path / "ckpt")
        with _names_damage("w", file):
            ocp_v1.load(tmp_path / "ckpt", jax.eval_shape(lambda: tree))


# --------------------------------------------------------------------------- mappings, PyTorch


def test_servable_items_and_load_pytorch_check_what_they_read(tmp_path: Path) -> None:
    tree = {"layer": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.zeros(4)}}
    abstract = jax.eval_shape(lambda: tree)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(0, args=osf.SafetensorsSave(tree, mapping=MAPPING))
        mngr.wait_until_finished()
    item = tmp_path / "run" / "0" / "default"
    file = item / "model.safetensors"
    _flip(file, "l.bias")
    with ocp.CheckpointManager(tmp_path / "run") as mngr, _names_damage("l.bias", file):
        mngr.restore(0, args=osf.SafetensorsRestore(abstract, mapping=MAPPING))
    with _names_damage("l.bias", file):
        osf.load_pytorch(abstract, item, MAPPING)  # the item directory
    with _names_damage("l.bias", file):
        osf.load_pytorch(abstract, file, MAPPING)  # one file of it
    with _names_damage("l.bias", file):
        osf.load_pytorch(abstract, item / "model.safetensors.index.json", MAPPING, strict=False)

    # Files save_file wrote, alone or in a plain directory of them, carry their own checksums.
    plain = tmp_path / "plain"
    plain.mkdir()
    torch_side = {"l.weight": np.arange(12.0).reshape(4, 3), "l.bias": np.zeros(4)}
    osf.save_file(torch_side, plain / "model.safetensors")
    _flip(plain / "model.safetensors", "l.weight", at=9)
    for path in (plain / "model.safetensors", plain):
        with _names_damage("l.weight", plain / "model.safetensors"):
            osf.load_pytorch(abstract, path, MAPPING)


def test_an_export_for_pytorch_records_no_checksums(tmp_path: Path) -> None:
    """``export_pytorch`` writes a Hugging Face directory for other readers, without
    checksums: nothing can check it, and ``verify`` says so (every tensor unverified)."""
    tree = {"layer": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.zeros(4)}}
    osf.export_pytorch(tree, tmp_path / "hf", MAPPING)
    _flip(tmp_path / "hf" / "model.safetensors", "l.bias")
    report = osf.verify(tmp_path / "hf")
    assert report.ok and report.bytes == 0
    assert sorted(report.unverified) == [
        f"{tmp_path / 'hf' / 'model.safetensors'}: l.bias",
        f"{tmp_path / 'hf' / 'model.safetensors'}: l.weight",
    ]
    got = osf.load_pytorch(jax.eval_shape(lambda: tree), tmp_path / "hf", MAPPING)
    assert np.asarray(got["layer"]["bias"])[0] == np.float32(1e-45)  # as any reader would


# --------------------------------------------------------------------------- the tools


def test_the_tools_check_every_tensor_they_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``diff``, ``convert`` and ``export`` from a checkpoint read through the catalog, which
    checks every tensor it reads (a file of a checkpoint directory against the directory's
    checksums); ``inspect`` reads no tensor bytes and checks none; ``verify`` checks all."""
    item = _saved_item(tmp_path / "root", _state())
    pristine = tmp_path / "pristine"
    shutil.copytree(item, pristine)
    file = item / "model.safetensors"
    _flip(file, "params.b", bit=4)
    damage = re.compile(r"tensor 'params\.b' in model\.safetensors: CRC32C mismatch")

    for a, b in ((file, pristine / "model.safetensors"), (item, pristine)):
        code, _, err = _run(capsys, "diff", a, b)
        assert code == 2 and damage.search(err), err
    for k, src in enumerate((file, item, tmp_path / "root" / "1")):
        code, _, err = _run(capsys, "convert", src, tmp_path / f"out{k}", "-q")
        assert code == 2 and damage.search(err), err
        assert not (tmp_path / f"out{k}").exists()
    with pytest.raises(osf.IntegrityError, match=damage.pattern):
        osf.export_pytorch(item, tmp_path / "hf", _PARAMS, prefix="params.")

    code, out, _ = _run(capsys, "inspect", file)
    assert code == 0 and "params.b" in out
    code, out, _ = _run(capsys, "verify", file)
    assert code == 1 and "tensor 'params.b'" in out
