"""Checkpoints and model directories with something planted where a read looks: a name or a
symbolic link that leads out of the directory (``test_escapes.py``), a FIFO or another special
file (``test_special_files.py``). Each kind of source is written once, real files by the real
writers (``osf.save_directory``, Orbax's own checkpointers, ``safetensors``), then copied and
forged; the forgeries only read.

Sources (``Sources`` attributes): ``item`` (this library's checkpoint directory), ``sharded``
(the same, in two files with an index), ``orbax`` (an Orbax-native item, one directory per
array), ``hf`` (a Hugging Face directory: two shards and ``model.safetensors.index.json``),
``hf_config`` (a model directory: config, generation config, tokenizer), ``step`` (a step
holding an Orbax-native item and another item copied as it is), ``native_root`` and
``item_root`` (CheckpointManager roots, the first saved by Orbax's own handler through
``osf.handler_registry``). ``outside`` holds what a forgery points at: copies that read
fine, so a read that left the directory would succeed unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
from safetensors.numpy import save_file as save_pt

import orbax_safetensors as osf

MAPPING_MODULE = "planted_names"  # what `export --mapping planted_names:mapping` imports
MAPPING = osf.KeyMapping([osf.Rule("{k:.*}", "{k}")])  # every name as it is


def state() -> dict[str, np.ndarray]:
    return {
        "embed": np.arange(32, dtype=np.float32).reshape(8, 4),
        "proj": np.arange(16, dtype=np.float32).reshape(4, 4),
    }


def secret() -> dict[str, np.ndarray]:
    """What the files outside hold: the same names and shapes, other values."""
    return {k: np.full(v.shape, 7.0, v.dtype) for k, v in state().items()}


@dataclasses.dataclass(frozen=True)
class Sources:
    base: Path  # everything lies below it; `outside` and the sources are siblings
    outside: Path
    item: Path
    sharded: Path
    orbax: Path
    hf: Path
    hf_config: Path
    step: Path
    native_root: Path
    item_root: Path
    mapping_dir: Path  # holds MAPPING_MODULE's file: the working directory of `export`

    def copy(self, source: Path, name: str) -> Path:
        """A copy of ``source`` (a directory) under ``base/forged`` to forge."""
        dst = self.base / "forged" / name
        shutil.copytree(source, dst, symlinks=True)
        return dst


def build(base: Path) -> Sources:
    """Writes every source once (a second or so, mostly Orbax)."""
    outside = base / "outside"
    outside.mkdir(parents=True)
    save_pt(secret(), str(outside / "secret.safetensors"), metadata={"format": "pt"})
    (outside / "secret.txt").write_text('{"secret": true}\n')
    plain_orbax = ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    )  # (floor: no use_ocdbt on Standard)
    plain_orbax.save(outside / "secret_orbax", secret())

    item = base / "item"
    osf.save_directory(state(), item)
    shutil.copyfile(item / "model.safetensors", outside / "item_copy.safetensors")
    shutil.copyfile(item / "orbax_safetensors.json", outside / "item_copy.json")
    sharded = base / "sharded"
    osf.save_directory(state(), sharded, max_file_size=100)
    assert (sharded / "model.safetensors.index.json").exists()

    orbax = base / "orbax"
    plain_orbax.save(orbax, state())

    hf = base / "hf"
    hf.mkdir()
    names = {
        "embed": "model-00001-of-00002.safetensors",
        "proj": "model-00002-of-00002.safetensors",
    }
    for name, file in names.items():
        save_pt({name: state()[name]}, str(hf / file), metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))

    hf_config = base / "hf_config"
    hf_config.mkdir()
    (hf_config / "config.json").write_text(json.dumps({"hidden_size": 4}))  # (no model_type:
    # nothing imports transformers to name the model's class)
    (hf_config / "generation_config.json").write_text(json.dumps({"max_length": 9}))
    (hf_config / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))

    step = base / "step"
    plain_orbax.save(step / "state", state())
    (step / "extra").mkdir()
    (step / "extra" / "notes.json").write_text("{}")
    (step / "_CHECKPOINT_METADATA").write_text(
        json.dumps({"item_handlers": {"state": "StandardCheckpointHandler"}})
    )

    native_root = base / "native_root"
    with ocp.CheckpointManager(native_root, handler_registry=osf.handler_registry()) as mngr:
        mngr.save(0, args=ocp.args.StandardSave(state()))
        mngr.wait_until_finished()
    item_root = base / "item_root"
    with ocp.CheckpointManager(item_root) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(state()))
        mngr.wait_until_finished()

    mapping_dir = base / "mapping"
    mapping_dir.mkdir()
    (mapping_dir / f"{MAPPING_MODULE}.py").write_text(
        "import orbax_safetensors as osf\nmapping = osf.KeyMapping([osf.Rule('{k:.*}', '{k}')])\n"
    )
    return Sources(
        base, outside, item, sharded, orbax, hf, hf_config, step, native_root, item_root,
        mapping_dir,
    )  # fmt: skip


def forge_orbax_name(item: Path, tensor: str, name: str, *, ocdbt: bool | None = None) -> None:
    """Rewrites the Orbax ``_METADATA`` of ``item`` so that leaf ``tensor`` is named ``name``
    (Orbax reads the array at ``item/name``); ``ocdbt`` also forges ``use_ocdbt``."""
    path = item / "_METADATA"
    doc = json.loads(path.read_text())
    tree = doc["tree_metadata"]
    entry = tree.pop(f"('{tensor}',)")
    entry["key_metadata"][0]["key"] = name
    tree[f"('{name}',)"] = entry
    if ocdbt is not None:
        doc["use_ocdbt"] = ocdbt
    path.write_text(json.dumps(doc))


def symlink(path: Path, target: Path) -> None:
    """Replaces ``path`` (a file or directory) with a symbolic link to ``target``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)


def fifo(path: Path) -> Path:
    """Replaces ``path`` (a file or directory) with a FIFO nobody writes to."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


def hub_snapshot(base: Path, files: dict[str, bytes]) -> Path:
    """A directory laid out as the Hugging Face hub cache lays out a download
    (``models--ORG--NAME/snapshots/<rev>/<file>`` a relative link to ``../../blobs/<hash>``),
    built here: no network."""
    repo = base / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, (name, data) in enumerate(sorted(files.items())):
        (repo / "blobs" / f"blob{i:04d}").write_bytes(data)
        os.symlink(f"../../blobs/blob{i:04d}", snapshot / name)
    return snapshot


def argv(verb: str, s: Sources, path: Path, out: Path) -> list[str]:
    """The command line of ``verb`` reading ``path`` (``out``: where ``convert`` and
    ``export`` write; ``export --hf-config`` exports ``s.item`` with ``path`` as the config)."""
    mapping = ["--mapping", f"{MAPPING_MODULE}:mapping"]
    if verb == "diff":
        return ["diff", str(path), str(s.item)]
    if verb == "convert":
        return ["convert", "-q", str(path), str(out)]
    if verb == "export":
        return ["export", str(path), str(out), *mapping]
    if verb == "export --hf-config":
        return ["export", str(s.item), str(out), *mapping, "--hf-config", str(path)]
    return [verb, str(path)]


def assert_one_error_line(verb: str, status: int, stderr: str, match: str, out: Path) -> None:
    """Status 2, one ``orbax-safetensors VERB: error: ...`` line matching ``match``, and
    nothing at ``out`` (the first missing parent of where ``convert`` or ``export`` wrote)."""
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, (status, stderr)
    assert re.match(rf"orbax-safetensors {verb.split()[0]}: error: .*{match}", lines[0]), lines
    assert not out.exists()
