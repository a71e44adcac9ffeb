"""``verify`` runs every check a restore runs on ``orbax_safetensors.json``: one validator
(``core.metadata.parse_metadata``, with ``core.sharding.check_sharding_json`` for each
tensor's sharding) serves both. Each test forges one field of a real checkpoint's metadata and
asserts that restore raises ``SchemaError`` and ``verify`` reports the same message (the CLI:
exit status 1, the message on stdout)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.core.errors import SchemaError

METADATA = "orbax_safetensors.json"


@pytest.fixture
def item(tmp_path):
    """A checkpoint whose ``w`` has a named sharding (a 1-device mesh) and ``b`` none."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    tree = {"w": jax.device_put(jnp.arange(8.0).reshape(2, 4), sharding), "b": np.ones(3)}
    osf.save_directory(tree, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def forge(directory, edit):
    path = directory / METADATA
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def assert_both_refuse(directory, capsys, match, error=SchemaError):
    with pytest.raises(error, match=match) as raised:
        osf.restore_directory(directory)
    report = osf.verify(directory)
    assert not report.ok
    assert any(str(raised.value) in p for p in report.problems), (report.problems, raised.value)
    assert cli.main(["verify", str(directory)]) == 1
    out, _ = capsys.readouterr()
    assert "DAMAGED" in out and str(raised.value) in out


def test_the_unforged_checkpoint_passes_both(item):
    restored = osf.restore_directory(item)
    np.testing.assert_array_equal(restored["w"], np.arange(8.0).reshape(2, 4))
    assert restored["w"].sharding.spec == jax.sharding.PartitionSpec("d", None)
    assert osf.verify(item).ok


def _sharding(doc):
    return doc["tensors"]["w"]["sharding"]


SHARDING_FORGERIES = {
    "a string": (lambda d: d["tensors"]["w"].update(sharding="d"), "not a mesh description"),
    "a list": (lambda d: d["tensors"]["w"].update(sharding=["d"]), "not a mesh description"),
    "string sizes": (lambda d: _sharding(d).update(mesh_shape=["1"]), "mesh_shape"),
    "float sizes": (lambda d: _sharding(d).update(mesh_shape=[1.0]), "mesh_shape"),
    "zero size": (lambda d: _sharding(d).update(mesh_shape=[0]), "mesh_shape"),
    "no mesh_shape": (lambda d: _sharding(d).pop("mesh_shape"), "mesh_shape"),
    "axes count": (lambda d: _sharding(d).update(mesh_axes=["d", "e"]), "mesh_axes"),
    "axis not a str": (lambda d: _sharding(d).update(mesh_axes=[3]), "mesh_axes"),
    "spec not a list": (lambda d: _sharding(d).update(spec="d"), "spec is not a list"),
    "spec too long": (lambda d: _sharding(d).update(spec=["d", None, None]), "at most 2"),
    "unknown axis": (lambda d: _sharding(d).update(spec=["x", None]), "spec entry 'x'"),
    "axis twice": (lambda d: _sharding(d).update(spec=["d", "d"]), "used twice"),
    "spec entry a number": (lambda d: _sharding(d).update(spec=[0, None]), "spec entry 0"),
    "mesh_devices out of range": (
        lambda d: _sharding(d).update(mesh_devices=7),
        "names no entry of device_meshes",
    ),
    "mesh_devices a str": (
        lambda d: _sharding(d).update(mesh_devices="0"),
        "names no entry of device_meshes",
    ),
    "device ids count": (
        lambda d: d.update(device_meshes=[[0, 1]]),
        "2 device ids for a mesh of 1 devices",
    ),
    "unknown axis type": (lambda d: _sharding(d).update(axis_types=["Hidden"]), "axis_types"),
    "axis types count": (
        lambda d: _sharding(d).update(axis_types=["Explicit", "Auto"]),
        "axis_types",
    ),
}


@pytest.mark.parametrize("forgery", sorted(SHARDING_FORGERIES))
def test_a_malformed_sharding_is_refused_by_restore_and_verify(item, capsys, forgery):
    edit, match = SHARDING_FORGERIES[forgery]
    forge(item, edit)
    assert_both_refuse(item, capsys, match)


def _tensor(doc, **fields):
    doc["tensors"]["b"].update(fields)


ENTRY_FORGERIES = {
    "unknown dtype": (lambda d: _tensor(d, dtype="F99"), "unknown dtype 'F99'"),
    "negative dimension": (lambda d: _tensor(d, shape=[-3]), "malformed shape"),
    "shape a string": (lambda d: _tensor(d, shape="3"), "malformed shape"),
    "boolean dimension": (lambda d: _tensor(d, shape=[True]), "malformed shape"),
    "file outside": (lambda d: _tensor(d, file="../model.safetensors"), "invalid file"),
    "file not listed": (lambda d: _tensor(d, file="other.safetensors"), "invalid file"),
    "checksum": (lambda d: _tensor(d, crc32c="zzzzzzzz"), "checksum of 'b' is malformed"),
    "device id a str": (lambda d: _tensor(d, device="0"), "device id '0' is not an integer"),
    "entry not an object": (lambda d: d["tensors"].update(b=[1]), "has no entry"),
    "file list entry": (lambda d: d["files"].append("a/x"), "invalid file name"),
    "device_meshes": (lambda d: d.update(device_meshes=[["0"]]), "device_meshes"),
    "user metadata": (lambda d: d.update(metadata=[1, 2]), "metadata is list"),
}


@pytest.mark.parametrize("forgery", sorted(ENTRY_FORGERIES))
def test_a_malformed_tensor_entry_is_refused_by_restore_and_verify(item, capsys, forgery):
    edit, match = ENTRY_FORGERIES[forgery]
    forge(item, edit)
    assert_both_refuse(item, capsys, match)


@pytest.mark.parametrize("name", ["../x", "/etc/x", "s3://b/x"])
def test_a_listed_file_outside_the_directory_is_refused_by_restore_and_verify(item, capsys, name):
    forge(item, lambda d: d["files"].append(name))
    assert_both_refuse(item, capsys, "leads outside", osf.UnsafePathError)


def test_orbax_restore_refuses_what_verify_refuses(tmp_path):
    """The handler reads the same metadata: a manager restore raises the same error."""
    with ocp.CheckpointManager(tmp_path / "root") as mngr:
        mngr.save(1, args=osf.SafetensorsSave({"w": jnp.ones((2, 2))}))
        mngr.wait_until_finished()
    item = tmp_path / "root" / "1" / "default"
    forge(item, lambda d: d["tensors"]["w"].update(sharding={"mesh_axes": ["d"]}))
    assert not osf.verify(tmp_path / "root").ok
    with (
        ocp.CheckpointManager(tmp_path / "root") as mngr,
        pytest.raises(SchemaError, match="mesh_shape"),
    ):
        mngr.restore(1, args=osf.SafetensorsRestore())
