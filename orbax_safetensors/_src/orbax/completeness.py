"""Whether a checkpoint's files are all there: what a committed step lacks that restoring it
needs (:func:`missing_entries`, the one judgement for ``verify``, ``inspect`` and every tool
that reads a step's tensors). Above ``steps`` and ``claims``: an OCDBT database's data files
are found by the walk of its B-tree that also serves the checks before a read of an
Orbax-native array.

A step is judged file by file against what Orbax's restore reads, since a kill during Orbax's
deletion of an old step (``max_to_keep``) can leave any subset of its files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import claims as _claims
from orbax_safetensors._src.orbax import steps as _steps

# This library's handlers by class name: v0's, and v1's (orbax/v1.HANDLER_TYPESTR).
_OUR_HANDLERS = frozenset((_steps.HANDLER_TYPESTR.rsplit(".", 1)[-1], "SafetensorsHandler"))
_PYTREE_HANDLERS = frozenset(
    ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")
)
_ORBAX_ITEM_ENTRIES = (
    "_sharding",
    "_strings.json",
    "d",
    "array_metadatas",
    _steps.OCDBT_MANIFEST_FILE,
)
SHARDING_FILE = "_sharding"
STRINGS_FILE = "_strings.json"
_TENSORSTORE_VALUES = frozenset(("jax.Array", "np.ndarray", "scalar"))
_LISTED = 4  # missing files of one kind named one by one; more are counted
_NAMED_CHUNKS = 4096  # beyond this many missing chunk files, a grid is counted, not listed


# What a step's restore reads (checked against orbax-checkpoint 0.11.11 and 0.12.8 by deleting
# every file of real steps in turn: tests/hostile/test_half_deleted_steps.py):
# - its _CHECKPOINT_METADATA, where the root's other steps have one (it names the items);
# - every item it names: this library's, its orbax_safetensors.json and every file listed; an
#   Orbax PyTree item's _METADATA, _sharding (a jax.Array), _strings.json (a string), and
#   with OCDBT manifest.ocdbt and every data file its latest version references, else each
#   array's zarr metadata and (unless the item reads missing chunks as the fill value) its
#   chunk files; another handler's item, one file besides the commit marker.
# Not required: the commit marker (steps.scan_steps checks it where it is the commit),
# array_metadatas/, the per-process OCDBT manifests and the data files the merged manifest
# does not reference. Items present but not named are judged by what they hold.


def missing_entries(step: epath.PathLike | _steps.StepDir) -> list[str]:
    """What a committed step lacks that restoring it needs, relative to the step; empty when
    nothing is missing: the one judgement of a step's completeness. A step Orbax lists with
    entries missing cannot be restored (typically an old step whose deletion by
    ``max_to_keep`` a kill interrupted). Pass the ``StepDir`` of ``steps.scan_steps``
    where there is one (it knows the root); a path is looked up in its parent directory.
    """
    listed = step if isinstance(step, _steps.StepDir) else None
    path = step.path if isinstance(step, _steps.StepDir) else epath.Path(step)
    missing: list[str] = []
    recorded = (path / _steps.CHECKPOINT_METADATA_FILE).exists()
    if not recorded:
        listed = listed or _steps.listed_step(path)
        if listed is not None and listed.siblings_recorded:
            missing.append(_steps.CHECKPOINT_METADATA_FILE)
    doc = _steps.read_json(path / _steps.CHECKPOINT_METADATA_FILE) if recorded else None
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    if handlers == _steps.HANDLER_TYPESTR or (path / _metadata.METADATA_FILE).exists():
        return missing + _missing_in_our_item(path, "")  # a step that is one item
    if isinstance(handlers, str):  # one item of another handler (ocp.Checkpointer)
        return missing + _missing_in_item(path, "", handlers.rsplit(".", 1)[-1], True)
    named = (
        {n: h for n, h in handlers.items() if _steps.is_child_name(n)}
        if isinstance(handlers, dict)
        else {}
    )
    present = _steps.list_items(path)
    for name in sorted({*named, *present}):
        if not (path / name).is_dir():
            missing.append(f"{name}/")
            continue
        typestr = named.get(name)
        handler = typestr.rsplit(".", 1)[-1] if isinstance(typestr, str) else None
        missing += _missing_in_item(path / name, f"{name}/", handler, name in named or not recorded)
    if _orbaxcompat.orbax_uses_legacy_commit_rule():
        missing.extend(n for n in _unfinished_items(path) if n not in missing)
    if (
        not named
        and not present
        and not missing
        and _steps.item_kind(path) is _steps.PathKind.OTHER
    ):
        # (a directory that holds tensors itself is a step that is one item, read as it is)
        missing.append("every item (the step directory holds none)")
    return missing


def _missing_in_item(item: epath.Path, prefix: str, handler: str | None, named: bool) -> list[str]:
    """What ``item`` lacks for its restore, each as ``prefix`` + its path. ``handler``: the
    class name of its writer; None: judged by what it holds, and lacking its files only when
    ``named`` (an item of the step, or a step whose list of items is gone)."""
    names = {c.name for c in item.iterdir()}
    ours = handler in _OUR_HANDLERS or _metadata.METADATA_FILE in names
    pytree = not ours and (handler in _PYTREE_HANDLERS or _steps.ORBAX_METADATA_FILE in names)
    if handler is None and not ours and not pytree:  # unrecorded: by what is left
        ours = any(n.endswith(".safetensors") for n in names)
        pytree = not ours and any(
            n in _ORBAX_ITEM_ENTRIES or n.startswith(_steps.OCDBT_PROCESS_PREFIX) for n in names
        )
    if ours:
        return _missing_in_our_item(item, prefix)
    if pytree:
        return _missing_in_pytree_item(item, names, prefix)
    if named and not names - {_steps.COMMIT_SUCCESS_FILE}:
        return [f"the files of {prefix}"]  # an item of another handler, emptied
    return []


def _missing_in_our_item(item: epath.Path, prefix: str) -> list[str]:
    """This library's item: its metadata file and every file that lists."""
    if not (item / _metadata.METADATA_FILE).exists():
        return [prefix + _metadata.METADATA_FILE]
    meta = _steps.read_json(item / _metadata.METADATA_FILE)
    files = meta.get("files") if isinstance(meta, dict) else None
    listed = files if isinstance(files, list) else []
    return [prefix + f for f in listed if _steps.is_child_name(f) and not (item / f).exists()]


def _missing_in_pytree_item(item: epath.Path, names: set[str], prefix: str) -> list[str]:
    """What an Orbax PyTree item lacks for Orbax's restore."""
    if _steps.ORBAX_METADATA_FILE not in names:
        return [prefix + _steps.ORBAX_METADATA_FILE]
    doc = _steps.read_json(item / _steps.ORBAX_METADATA_FILE)
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        return []  # damaged, not deleted: Orbax's restore (and inspect) report it
    leaves = _claims.pytree_leaves(doc)
    missing = []
    kinds = set(leaves.values())
    if "jax.Array" in kinds and SHARDING_FILE not in names:
        missing.append(prefix + SHARDING_FILE)
    if "string" in kinds and STRINGS_FILE not in names:
        missing.append(prefix + STRINGS_FILE)
    if not kinds & _TENSORSTORE_VALUES:
        return missing  # no leaf stored by TensorStore: Orbax writes no OCDBT or zarr files
    storage = _steps.array_storage(item)
    # An OCDBT item names no array directory; Orbax before 0.12 records no use_ocdbt, and
    # tells OCDBT by manifest.ocdbt alone, which a deletion may have taken first.
    ocdbt_entries = {n for n in names if n.startswith(_steps.OCDBT_PROCESS_PREFIX)} | (
        {"d"} - set(leaves)
    )
    if storage.use_ocdbt or _orbax_ocdbt(item) or ocdbt_entries & names:
        return missing + _missing_ocdbt_files(item, prefix)
    for name, kind in sorted(leaves.items()):
        if kind in _TENSORSTORE_VALUES:
            keys = _claims.array_keys(name)  # ("" : the item's own directory)
            missing += _missing_zarr_files(item / name, storage, prefix + keys)
    return missing


def _orbax_ocdbt(item: epath.Path) -> bool:
    """Whether Orbax takes the item for an OCDBT one (its own test)."""
    import orbax.checkpoint as ocp

    return bool(ocp.type_handlers.is_ocdbt_checkpoint(item))


def _missing_ocdbt_files(item: epath.Path, prefix: str) -> list[str]:
    """``manifest.ocdbt`` or the data files of the item's OCDBT database that are missing
    (a node that cannot be read for another reason ends the walk of its subtree: damage,
    which the restore reports, not deletion)."""
    if not (item / _steps.OCDBT_MANIFEST_FILE).exists():
        return [prefix + _steps.OCDBT_MANIFEST_FILE]
    files: dict[str, bool] = {}  # each referenced file: whether it is present

    def present(ref: _claims.Ref) -> bool:
        if ref.file not in files:
            files[ref.file] = (item / ref.file).exists()
        return files[ref.file]

    try:
        _claims.OcdbtFiles(item, _orbax_kvstore(item)).walk(present, strict=False)
    except SafetensorsCheckpointError:  # no readable manifest: the restore reports it
        return []
    missing = sorted(f for f, there in files.items() if not there)
    return _counted(prefix, missing, len(files), "OCDBT data files")


def _orbax_kvstore(item: epath.Path) -> dict[str, Any]:
    # The kvstore of the item's directory as Orbax's own spec opens it (local disk, gs://);
    # where it gives none (s3:// in orbax-checkpoint 0.12), TensorStore cannot open the path
    # and nothing is walked.
    spec = _orbaxcompat.array_read_spec(
        item, "_", use_zarr3=False, use_ocdbt=True, fill_missing=False
    )
    base = spec.get("kvstore", {}).get("base") if isinstance(spec, dict) else None
    if not isinstance(base, dict):
        base = {"driver": "file", "path": str(item)}
    path = base.get("path")
    if isinstance(path, str) and not path.endswith("/"):
        base = {**base, "path": path + "/"}  # a directory: its files are its keys
    return base


def _missing_zarr_files(array: epath.Path, storage: _steps.ArrayStorage, prefix: str) -> list[str]:
    """What a zarr array directory lacks: its metadata file, and, where Orbax stored every
    chunk, the chunk files of its grid."""
    meta_name = "zarr.json" if storage.use_zarr3 else ".zarray"
    meta = _steps.read_json(array / meta_name)
    if meta is None:
        return [prefix + meta_name] if not (array / meta_name).exists() else []
    grid = None if storage.fill_missing else _zarr_chunk_grid(meta, storage.use_zarr3)
    if grid is None:
        return []
    shape, key = grid
    present = _files_under(array) - {meta_name}
    expected = math.prod(shape)
    if expected <= len(present):
        return []  # (files are only ever deleted: none is missing)
    if expected > len(present) + _NAMED_CHUNKS:  # count them: a grid is not enumerated
        return [f"{expected - len(present)} of the {expected} chunk files of {prefix}"]
    keys = [key(index) for index in itertools.product(*(range(n) for n in shape))]
    return _counted(prefix, [k for k in keys if k not in present], expected, "chunk files")


def _zarr_chunk_grid(
    meta: Any, zarr3: bool
) -> tuple[list[int], Callable[[tuple[int, ...]], str]] | None:
    """The chunks along each axis of a zarr v2/v3 array, and a chunk's key from its index
    (the key encodings Orbax writes); None where the metadata is not of that form."""
    if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list):
        return None
    shape = meta["shape"]
    if zarr3:
        grid = meta.get("chunk_grid", {})
        chunks = (
            grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) else None
        )
        encoding = meta.get("chunk_key_encoding", {"name": "default"})
        name = encoding.get("name") if isinstance(encoding, dict) else None
        config = encoding.get("configuration", {}) if isinstance(encoding, dict) else {}
        if name not in ("default", "v2") or not isinstance(config, dict):
            return None
        sep = config.get("separator", "/" if name == "default" else ".")
        lead = ["c"] if name == "default" else []
    else:
        chunks = meta.get("chunks")
        sep, lead = meta.get("dimension_separator", "."), []
    if (
        not isinstance(chunks, list)
        or len(chunks) != len(shape)
        or sep not in ("/", ".")
        or not all(isinstance(n, int) and n >= 0 for n in shape)
        or not all(isinstance(c, int) and c > 0 for c in chunks)
    ):
        return None

    def key(index: tuple[int, ...]) -> str:
        parts = [*lead, *(str(i) for i in index)]
        return sep.join(parts) if parts else "0"

    return [-(-n // c) for n, c in zip(shape, chunks)], key


def _files_under(directory: epath.Path, prefix: str = "") -> set[str]:
    out = set()
    for child in directory.iterdir():
        if child.is_dir():
            out |= _files_under(child, f"{prefix}{child.name}/")
        else:
            out.add(prefix + child.name)
    return out


def _counted(prefix: str, missing: list[str], total: int, what: str) -> list[str]:
    """``missing`` named when few; else the first few, then how many more are missing."""
    named = [
        prefix + m for m in missing[: len(missing) if len(missing) <= _LISTED else _LISTED - 1]
    ]
    if len(named) == len(missing):
        return named
    rest = len(missing) - len(named)
    return [*named, f"{rest} more of the {total} {what} of {prefix or './'}"]


def _unfinished_items(step: epath.Path) -> list[str]:
    """``"<item>/"`` for each item of ``step`` present only under its temporary name: its
    save never finished, yet Orbax < 0.12.3 lists such a step on local disk."""
    names = []
    for child in sorted(step.iterdir(), key=lambda p: p.name):
        name = child.name.split(_steps.TMP_SUFFIX, 1)[0]
        unfinished = name != child.name and _steps.is_child_name(name) and child.is_dir()
        if unfinished and not (step / name).is_dir():
            names.append(f"{name}/")
    return names


def incomplete_problem(path: epath.PathLike, missing: Sequence[str]) -> str:
    """The problem line for a committed step with ``missing`` entries."""
    return (
        f"{path}: incomplete step, missing {', '.join(missing)} (Orbax lists this step but "
        "cannot restore it)"
    )


def require_complete(step: epath.PathLike | _steps.StepDir) -> None:
    """Raises a ``SafetensorsCheckpointError`` naming what the committed ``step`` lacks, if
    anything (for ``convert``, which would carry it on as whole)."""
    missing = missing_entries(step)
    if missing:
        path = step.path if isinstance(step, _steps.StepDir) else step
        raise SafetensorsCheckpointError(
            f"{incomplete_problem(path, missing)}; most likely the process was killed while "
            "Orbax's cleanup (max_to_keep) was deleting it: delete it, or name the other steps "
            "one by one"
        )


def refuse_incomplete(path: epath.PathLike) -> None:
    """Raises (as :func:`require_complete`) when ``path`` names a committed step, as its root
    lists it or on its own, that lacks what restoring it needs; anything else passes. A tool
    that reads a step's tensors calls it first: what is left is not the checkpoint."""
    entry = _steps.step_entry(path)
    if entry is not None and entry.committed:
        require_complete(entry)


def incomplete_warning(
    step: int, path: epath.PathLike, missing: Sequence[str], latest: int | None
) -> str:
    """The warning line for a committed step with ``missing`` entries (``latest``: its root's
    latest committed step)."""
    what = f"step {step} is incomplete (missing {', '.join(missing)})"
    if latest is not None and step < latest:
        return (
            f"{what} and older than the latest step {latest}: most likely the process was "
            "killed while Orbax's cleanup (max_to_keep) was deleting it. The other steps are not "
            f"affected; deleting {path} clears this"
        )
    return f"{what} and is the latest step: restoring it fails; restore an earlier step"


def missing_file(path: epath.Path) -> str | None:
    """Why Orbax could not read the metadata of item ``path`` whose ``_METADATA`` is sound,
    when a file it needs is missing (the OCDBT manifest or a data file, or an array's zarr
    metadata); None when none is, or ``_METADATA`` itself is the problem."""
    doc = _steps.read_json(path / _steps.ORBAX_METADATA_FILE)
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        return None
    leaves = _claims.pytree_leaves(doc)
    if not set(leaves.values()) & _TENSORSTORE_VALUES:
        return None  # (no OCDBT or zarr files: no leaf is stored by TensorStore)
    storage = _steps.array_storage(path)
    if storage.use_ocdbt:
        try:
            _claims.OcdbtFiles(path).check("")
        except SafetensorsCheckpointError as e:
            return str(e)
        return None
    meta = "zarr.json" if storage.use_zarr3 else ".zarray"
    for array, value_type in leaves.items():
        plain = array and "/" not in array and "\\" not in array and array.strip(".")
        if value_type in _TENSORSTORE_VALUES and plain and not (path / array / meta).exists():
            return f"{path}: the zarr metadata of array {array!r} ({array}/{meta}) is missing"
    return None
