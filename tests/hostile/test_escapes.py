"""Reads stay inside what the user named (issue 46, class 1).

A name read from a checkpoint or a model directory becomes a path: an Orbax-native item's
``_METADATA`` names its arrays (Orbax and TensorStore read ``<item>/<name>``), a Hugging Face
index maps tensors to files, this library's metadata lists its files, a model directory holds
its config and tokenizer files, a step holds items copied as they are. Each forgery here points
such a name, or a symbolic link planted in the directory, at real files outside it that would
read fine (an Orbax array, a safetensors file, a copy of the checkpoint's own file): every verb
and API that reads refuses it with ``UnsafePathError`` and the one wording
(``core/metadata.escape_error``: the file holding the name, the name, the directory), the command
line with one ``error:`` line and status 2 (``verify``: the problem listed, status 1), and a
refused ``convert`` or ``export`` leaves nothing behind, not even the parents of its output.

Links that stay inside are followed, and so are those of a Hugging Face hub cache snapshot into
its own repository's ``blobs/`` (a layout built here, no network).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat
from orbax_safetensors._src.tools import cli

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import planted
except ImportError:  # tests/ became a package
    from tests.hostile import planted

pytestmark = pytest.mark.timeout(120)

ESCAPE = "leads outside"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[planted.Sources, dict[str, Path]]:
    """The sources, and each forgery by name (built once: the verbs only read them)."""
    s = planted.build(tmp_path_factory.mktemp("escapes"))
    out = s.outside
    planted.save_pt({"embed": planted.secret()["embed"]}, str(out / "embed.safetensors"))
    forged: dict[str, Path] = {}

    def forge(name: str, source: Path, edit: Callable[[Path], Any]) -> None:
        forged[name] = s.copy(source, name)
        edit(forged[name])

    secret_array = out / "secret_orbax" / "embed"
    forge(
        "orbax-absolute", s.orbax, lambda p: planted.forge_orbax_name(p, "embed", str(secret_array))
    )
    forge(
        "orbax-dotdot",
        s.orbax,
        lambda p: planted.forge_orbax_name(p, "embed", os.path.relpath(secret_array, p)),
    )
    forge("orbax-symlink", s.orbax, lambda p: planted.symlink(p / "embed", secret_array))

    def index_names(p: Path, file: str) -> None:
        index = p / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        doc["weight_map"]["embed"] = file
        index.write_text(json.dumps(doc))

    secret_file = out / "embed.safetensors"
    forge("index-absolute", s.hf, lambda p: index_names(p, str(secret_file)))
    forge("index-dotdot", s.hf, lambda p: index_names(p, os.path.relpath(secret_file, p)))
    forge(
        "hf-symlink",
        s.hf,
        lambda p: planted.symlink(p / "model-00001-of-00002.safetensors", secret_file),
    )
    forge(
        "item-file-symlink",
        s.item,
        lambda p: planted.symlink(p / "model.safetensors", out / "item_copy.safetensors"),
    )
    forge(
        "item-metadata-symlink",
        s.item,
        lambda p: planted.symlink(p / "orbax_safetensors.json", out / "item_copy.json"),
    )
    forge(
        "config-symlink",
        s.hf_config,
        lambda p: planted.symlink(p / "tokenizer.json", out / "secret.txt"),
    )
    forge(
        "step-symlink",
        s.step,
        lambda p: planted.symlink(p / "extra" / "notes.json", out / "secret.txt"),
    )
    forge(
        "native-root",
        s.native_root,
        lambda p: planted.forge_orbax_name(
            p / "0" / "default", "embed", str(secret_array), ocdbt=False
        ),
    )

    def item_root(p: Path) -> None:
        file = p / "0" / "default" / "model.safetensors"
        shutil.copyfile(file, out / "root_copy.safetensors")
        planted.symlink(file, out / "root_copy.safetensors")

    forge("item-root", s.item_root, item_root)
    return s, forged


# --------------------------------------------------------------------------- the command line


_INSPECTED = (
    "orbax-absolute", "orbax-dotdot", "orbax-symlink", "index-absolute", "index-dotdot",
    "hf-symlink", "item-file-symlink", "item-metadata-symlink",
)  # fmt: skip
_CONVERTED = (
    "orbax-absolute", "orbax-dotdot", "orbax-symlink", "index-absolute", "item-file-symlink",
    "step-symlink",
)  # fmt: skip
_EXPORTED = ("orbax-absolute", "index-absolute", "item-file-symlink")
CLI_CELLS = [
    *(("inspect", f) for f in _INSPECTED),
    *(("verify", f) for f in ("item-file-symlink", "item-metadata-symlink", "hf-symlink")),
    *(("diff", f) for f in ("orbax-absolute", "index-absolute", "item-file-symlink")),
    *(("convert", f) for f in _CONVERTED),
    *(("export", f) for f in _EXPORTED),
    ("export --hf-config", "config-symlink"),
]


@pytest.mark.parametrize(("verb", "forgery"), CLI_CELLS, ids=lambda v: v)
def test_the_command_line_refuses_a_read_outside_in_one_line(
    world: Any, verb: str, forgery: str, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    s, forged = world
    monkeypatch.chdir(s.mapping_dir)  # (export --mapping imports the module from here)
    out = tmp_path / "out" / "deep" / "dst"
    status = cli.main(planted.argv(verb, s, forged[forgery], out))
    stdout, stderr = capsys.readouterr()
    if verb == "verify":  # damage of a checkpoint: listed, status 1
        assert status == 1 and ESCAPE in stdout and not stderr, (status, stdout, stderr)
        return
    planted.assert_one_error_line(verb, status, stderr, ESCAPE, tmp_path / "out")


# --------------------------------------------------------------------------- the API


def _api(verb: str, forgery: str, s: planted.Sources, path: Path, out: Path) -> Any:
    if verb == "convert":
        return osf.convert(path, out, progress=False)
    if verb == "export_pytorch":
        if forgery == "config-symlink":
            return osf.export_pytorch(s.item, out, planted.MAPPING, hf_config=path)
        return osf.export_pytorch(path, out, planted.MAPPING)
    if verb == "load_pytorch":
        return osf.load_pytorch(None, path, planted.MAPPING)
    if verb == "abstract_pytorch":
        return osf.abstract_pytorch(path, planted.MAPPING)
    if verb == "load_file":  # one file of a checkpoint directory: checked against its metadata
        return osf.load_file(path / "model.safetensors")
    if verb == "restore_directory":
        return osf.restore_directory(path)
    if verb == "SafetensorsSave(hf_config=)":
        with ocp.CheckpointManager(out) as mngr:
            mngr.save(
                0,
                args=osf.SafetensorsSave(planted.state(), mapping=planted.MAPPING, hf_config=path),
            )
            mngr.wait_until_finished()
        return None
    registry = osf.handler_registry()
    args = {
        "manager StandardRestore": ocp.args.StandardRestore(),
        "manager PyTreeRestore": ocp.args.PyTreeRestore(),
        "manager SafetensorsRestore": osf.SafetensorsRestore(),
    }[verb]
    with ocp.CheckpointManager(path, handler_registry=registry) as mngr:
        return mngr.restore(0, args=args)


API_CELLS = [
    ("convert", "orbax-absolute"),
    ("convert", "orbax-symlink"),
    ("convert", "step-symlink"),
    ("export_pytorch", "orbax-absolute"),
    ("export_pytorch", "item-file-symlink"),
    ("export_pytorch", "config-symlink"),
    ("load_pytorch", "orbax-absolute"),
    ("load_pytorch", "index-absolute"),
    ("load_pytorch", "index-dotdot"),
    ("load_pytorch", "hf-symlink"),
    ("load_pytorch", "item-file-symlink"),
    ("abstract_pytorch", "orbax-absolute"),
    ("abstract_pytorch", "index-absolute"),
    ("load_file", "item-metadata-symlink"),
    ("restore_directory", "item-file-symlink"),
    ("restore_directory", "item-metadata-symlink"),
    ("SafetensorsSave(hf_config=)", "config-symlink"),
    ("manager StandardRestore", "native-root"),
    ("manager PyTreeRestore", "native-root"),
    ("manager SafetensorsRestore", "native-root"),
    ("manager SafetensorsRestore", "item-root"),
]


@pytest.mark.parametrize(("verb", "forgery"), API_CELLS, ids=lambda v: v)
def test_the_api_refuses_a_read_outside(
    world: Any, verb: str, forgery: str, tmp_path: Path
) -> None:
    s, forged = world
    out = tmp_path / "out" / "deep" / "dst"
    with pytest.raises(osf.UnsafePathError, match=ESCAPE) as info:
        _api(verb, forgery, s, forged[forgery], out)
    assert str(forged[forgery]) in str(info.value)  # names the directory (and what holds the name)
    if verb != "SafetensorsSave(hf_config=)":
        assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not orbaxcompat.has_orbax_v1(), reason="this orbax-checkpoint lacks v1")
def test_orbax_v1_load_refuses_a_file_linked_out(world: Any, tmp_path: Path) -> None:
    from orbax.checkpoint import v1 as ocp_v1

    s, _ = world
    ctx = ocp_v1.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        ocp_v1.save(tmp_path / "ckpt", planted.state())
        planted.symlink(
            tmp_path / "ckpt" / "state" / "model.safetensors", s.outside / "item_copy.safetensors"
        )
        with pytest.raises(osf.UnsafePathError, match=ESCAPE):
            ocp_v1.load(tmp_path / "ckpt")


def test_verify_lists_a_file_linked_out(world: Any) -> None:
    _, forged = world
    for forgery in ("item-file-symlink", "item-metadata-symlink", "hf-symlink"):
        report = osf.verify(forged[forgery])
        assert not report.ok and any(ESCAPE in p for p in report.problems), report.problems


def test_the_one_wording_names_the_file_the_name_and_the_directory(world: Any) -> None:
    _, forged = world
    item = forged["orbax-absolute"]
    with pytest.raises(osf.UnsafePathError) as info:
        osf.load_pytorch(None, item, planted.MAPPING)
    secret = item.parent.parent / "outside" / "secret_orbax" / "embed"
    assert str(info.value).startswith(
        f"{item / '_METADATA'}: names '{secret}', which leads outside {item} (an absolute path); "
    )


# --------------------------------------------------------------------------- what still reads


def test_links_that_stay_inside_are_followed(world: Any, tmp_path: Path, capsys: Any) -> None:
    s, _ = world
    hf = tmp_path / "hf"
    shutil.copytree(s.hf, hf)
    (hf / "real").mkdir()
    shard = "model-00001-of-00002.safetensors"
    (hf / shard).rename(hf / "real" / shard)
    os.symlink(Path("real") / shard, hf / shard)
    tree = osf.load_pytorch(None, hf, planted.MAPPING)
    np.testing.assert_array_equal(tree["embed"], planted.state()["embed"])
    assert cli.main(["inspect", str(hf)]) == 0, capsys.readouterr()


def test_a_hugging_face_hub_snapshot_reads_through_its_blobs(
    world: Any, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    """``load_pytorch`` and ``--hf-config`` of a hub cache snapshot, whose every file is a link
    to ``../../blobs/<hash>``; a link into another repository's blobs is outside."""
    s, _ = world
    files = {p.name: p.read_bytes() for p in sorted(s.hf.iterdir())}
    files.update({p.name: p.read_bytes() for p in sorted(s.hf_config.iterdir())})
    snapshot = planted.hub_snapshot(tmp_path, files)
    tree = osf.load_pytorch(None, snapshot, planted.MAPPING)
    for name, value in planted.state().items():
        np.testing.assert_array_equal(tree[name], value)
    monkeypatch.chdir(s.mapping_dir)
    out = tmp_path / "hf_out"
    argv = ["export", str(s.item), str(out), "--mapping", f"{planted.MAPPING_MODULE}:mapping"]
    assert cli.main([*argv, "--hf-config", str(snapshot)]) == 0, capsys.readouterr()
    assert (out / "tokenizer.json").read_bytes() == files["tokenizer.json"]

    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "blob").write_bytes(files["tokenizer.json"])
    (snapshot / "tokenizer.json").unlink()
    os.symlink("../../../models--org--other/blobs/blob", snapshot / "tokenizer.json")
    with pytest.raises(osf.UnsafePathError, match=ESCAPE):
        osf.export_pytorch(s.item, tmp_path / "refused", planted.MAPPING, hf_config=snapshot)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../x", "a/../../x", "s3://bucket/x", "x\0y", ""], ids=repr
)
def test_every_name_that_is_no_relative_path_below_is_refused(tmp_path: Path, name: str) -> None:
    from orbax_safetensors._src.storage import confine

    with pytest.raises(osf.UnsafePathError, match=ESCAPE):
        confine.inside(tmp_path, name, where=tmp_path / "index.json")
    assert confine.inside(tmp_path, "a/./b.safetensors") == tmp_path / "a/./b.safetensors"


@pytest.mark.parametrize("use_ocdbt", [True, False], ids=["ocdbt", "zarr"])
def test_an_orbax_item_with_an_empty_string_key_is_read_as_orbax_reads_it(
    tmp_path: Path, capsys: Any, use_ocdbt: bool
) -> None:
    # Orbax names the array of a top-level "" key "": it reads it in the item's own directory
    # (zarr) or under the OCDBT path "" (keys .zarray, 0), both inside the item. Names that do
    # lead outside ('..', above) stay refused.
    import jax.numpy as jnp

    tree = {"": jnp.arange(2.0), "w": jnp.zeros(3)}
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)
    with ocp.CheckpointManager(tmp_path / "orbax", item_handlers=handler) as mngr:
        try:
            mngr.save(1, args=ocp.args.PyTreeSave(tree))
            mngr.wait_until_finished()
            want = mngr.restore(1, args=ocp.args.PyTreeRestore())
        except ValueError as e:  # (orbax-checkpoint 0.11: its save's own check, its restore)
            pytest.skip(f"this orbax-checkpoint cannot save and restore such an item: {e}")
    registry = osf.handler_registry()
    with ocp.CheckpointManager(tmp_path / "orbax", handler_registry=registry) as mngr:
        got = mngr.restore(1, args=ocp.args.PyTreeRestore())
    assert cli.main(["inspect", str(tmp_path / "orbax" / "1")]) == 0, capsys.readouterr().err
    assert cli.main(["convert", "-q", str(tmp_path / "orbax"), str(tmp_path / "st")]) == 0
    converted = osf.restore_directory(tmp_path / "st" / "1" / "default")
    for restored in (got, converted):
        assert restored.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(want[key]))
