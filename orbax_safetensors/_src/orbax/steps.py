"""Orbax's directory conventions: what a path is (:func:`classify`: a file, an item of this
library, plain safetensors files, an Orbax-native item, a step, a root) and which steps of a
root Orbax lists as committed: the one owner of step listing and committedness (what a
committed step lacks: ``orbax/completeness``), and of how a step commits on object storage
(:func:`manager_options_for`). Importing it imports no Orbax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import re
from typing import Any

from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import (
    NotSafetensorsError,
    SafetensorsCheckpointError,
    UnsafePathError,
)
from orbax_safetensors._src.storage import confine as _confine

ORBAX_METADATA_FILE = "_METADATA"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS_FILE = "commit_success.txt"  # Orbax's commit marker
HANDLER_TYPESTR = "orbax_safetensors.SafetensorsCheckpointHandler"  # the v0 handler's typestr()
_OUR_HANDLER = HANDLER_TYPESTR.rsplit(".", 1)[-1]


class PathKind(enum.StrEnum):
    """What a path is (:func:`classify`; :func:`item_kind` gives the kinds of a directory on
    its own). String-valued: reports and messages show the value."""

    FILE = "file"  # a file (a .safetensors or another file)
    ITEM = "item"  # a safetensors checkpoint item (its metadata file present)
    SAFETENSORS_DIR = "safetensors-dir"  # plain safetensors files (Hugging Face style)
    ORBAX = "orbax"  # an Orbax-native item
    STEP = "step"  # a step directory of items
    ROOT = "root"  # a CheckpointManager root of steps
    OTHER = "other"  # none of these (e.g. an Orbax JSON item)

    @property
    def noun(self) -> str:
        """The kind as a noun phrase for messages (``"a CheckpointManager root"``)."""
        return _NOUNS[self]


_NOUNS = {
    PathKind.FILE: "a file",
    PathKind.ITEM: "an orbax-safetensors checkpoint item",
    PathKind.SAFETENSORS_DIR: "a directory of safetensors files",
    PathKind.ORBAX: "an Orbax-native item",
    PathKind.STEP: "a step directory",
    PathKind.ROOT: "a CheckpointManager root",
    PathKind.OTHER: "a directory that holds no checkpoint",
}


TENSOR_KINDS = frozenset((PathKind.FILE, PathKind.ITEM, PathKind.SAFETENSORS_DIR, PathKind.ORBAX))
_STEP_NAME = re.compile(r"^((?:.*?[_-])?)(\d+)$")  # (prefix, digits)
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TMP_STEP_NAME = re.compile(rf"^(?:.*?[_-])?(\d+){re.escape(TMP_SUFFIX)}")
_TMP_REASON = "temporary directory of a save that never finished (Orbax renames it on commit)"


def absolute(path: epath.PathLike) -> epath.Path:
    """``path`` made absolute when it is a relative local path (Orbax refuses those)."""
    path = epath.Path(path)
    if "://" in str(path) or path.is_absolute():
        return path
    return epath.Path(os.path.abspath(os.fspath(path)))


def _is_orbax_item(path: epath.Path) -> bool:
    return (path / ORBAX_METADATA_FILE).exists()


def safetensors_files(path: epath.Path) -> list[epath.Path]:
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))


def classify(path: epath.PathLike) -> PathKind:
    """What ``path`` is: one of ``file``, ``item``, ``safetensors-dir``, ``orbax``, ``step``,
    ``root``, or ``other``.

    Raises:
      FileNotFoundError: when ``path`` does not exist.
    """
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        return PathKind.FILE
    kind = item_kind(path)
    if kind is not PathKind.OTHER:
        return kind
    children = [c for c in path.iterdir() if c.is_dir() and TMP_SUFFIX not in c.name]
    kinds = {c.name: item_kind(c) for c in children}
    if any(k in TENSOR_KINDS for k in kinds.values()):
        return PathKind.STEP
    if (path / CHECKPOINT_METADATA_FILE).exists():
        if _other_handler(_recorded_handlers(path)):
            return PathKind.OTHER  # one item of another handler, saved by ocp.Checkpointer
        return PathKind.STEP  # a step whose items hold no tensors (e.g. JSON only)
    if _step_candidates(path):
        return PathKind.ROOT
    return PathKind.OTHER


def item_kind(path: epath.Path) -> PathKind:
    """What a directory is on its own, without looking into its children: ``item``, ``orbax``,
    ``safetensors-dir`` or ``other``."""
    if (path / _metadata.METADATA_FILE).exists():
        return PathKind.ITEM
    if _is_orbax_item(path):
        return PathKind.ORBAX
    if (path / _plan.INDEX_FILE_NAME).exists() or safetensors_files(path):
        return PathKind.SAFETENSORS_DIR
    return PathKind.OTHER


OCDBT_MANIFEST_FILE = "manifest.ocdbt"  # an item whose arrays live in one OCDBT store
OCDBT_PROCESS_PREFIX = "ocdbt.process_"  # a process's own OCDBT database: <prefix><i>/


@dataclasses.dataclass(frozen=True)
class ArrayStorage:
    """How an Orbax-native item stores its arrays, as its ``_METADATA`` records it (with
    Orbax's own defaults where an older Orbax left a field out, as its restore takes them).

    Attributes:
      use_zarr3: zarr v3 arrays (else zarr v2).
      use_ocdbt: every array in one OCDBT store (``manifest.ocdbt``), else a directory each.
      fill_missing: chunks that were never written read as the fill value (items saved
        before Orbax stored such chunks: ``store_array_data_equal_to_fill_value`` unset).
    """

    use_zarr3: bool
    use_ocdbt: bool
    fill_missing: bool


def array_storage(path: epath.PathLike) -> ArrayStorage:
    """The :class:`ArrayStorage` of the Orbax-native item ``path`` (a damaged or missing
    ``_METADATA`` gives Orbax's defaults: its own restore then reports the damage)."""
    path = epath.Path(path)
    doc = read_json(path / ORBAX_METADATA_FILE)
    doc = doc if isinstance(doc, dict) else {}
    ocdbt = doc.get("use_ocdbt")
    return ArrayStorage(
        use_zarr3=doc.get("use_zarr3") is True,
        use_ocdbt=ocdbt if isinstance(ocdbt, bool) else _ocdbt_files_present(path),
        fill_missing=doc.get("store_array_data_equal_to_fill_value") is not True,
    )


def _ocdbt_files_present(path: epath.Path) -> bool:
    # An older Orbax records no ``use_ocdbt``: as its own restore judges, an OCDBT item is one
    # with a manifest, its own or one process's (then its own missing is damage, not zarr).
    if (path / OCDBT_MANIFEST_FILE).exists():
        return True
    return any((p / OCDBT_MANIFEST_FILE).exists() for p in path.glob(f"{OCDBT_PROCESS_PREFIX}*"))


def check_orbax_item(path: epath.PathLike) -> None:
    """Refuses an Orbax-native item that a read through Orbax or TensorStore would leave or
    block in, before either opens a file of it: no entry may be a symbolic link out of it or
    a special file, and every array name its ``_METADATA`` records (Orbax reads the array
    ``name`` at ``<item>/<name>``) must stay inside it. A ``_METADATA`` that cannot be parsed
    is left to Orbax, which reports it.

    Raises:
      UnsafePathError: naming ``_METADATA``, the name and the item.
    """
    path = epath.Path(path)
    where = path / ORBAX_METADATA_FILE
    _confine.check_tree(path, where=path)
    doc = read_json(where)
    for name in orbax_array_names(doc):
        orbax_array_path(path, name, where=where)


def orbax_array_path(item: epath.Path, name: str, *, where: object = None) -> epath.Path:
    """Where Orbax reads the array ``name`` of the Orbax-native ``item``: ``<item>/<name>``,
    once checked to stay inside it (``where``: the file that names it); the item itself for
    the name ``""`` (a top-level empty-string key: Orbax's zarr array in the item's own
    directory, or under the OCDBT path ``""``), which leaves nothing.

    Raises:
      UnsafePathError: naming ``where``, the name and the item.
    """
    if name == "":
        return item
    return _confine.inside(item, name, where=where)


def orbax_array_names(doc: Any) -> list[str]:
    """The name of each leaf an Orbax ``_METADATA`` document records, as Orbax joins it
    (its keys, ``str`` of each, joined by ``.``: ``tree_utils.param_name_from_keypath``);
    entries that are not so shaped are skipped (Orbax refuses them itself).
    """
    tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
    names = []
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list) and all(isinstance(k, dict) and "key" in k for k in keys):
            names.append(".".join(str(k["key"]) for k in keys))
    return names


def item_handler(path: epath.PathLike) -> str | None:
    """The class name of the Orbax handler that wrote the item ``path``, as Orbax records it:
    in the item's own ``_CHECKPOINT_METADATA`` (a checkpoint of one item, ``ocp.Checkpointer``)
    or in its step's (``item_handlers`` by item name); None where neither names one.
    """
    path = epath.Path(path)
    handler = _recorded_handlers(path)
    if not isinstance(handler, str):
        step = _recorded_handlers(path.parent)
        handler = step.get(path.name) if isinstance(step, dict) else None
    return handler.rsplit(".", 1)[-1] if isinstance(handler, str) else None


def _recorded_handlers(path: epath.Path) -> Any:
    """The ``item_handlers`` entry of ``path``'s ``_CHECKPOINT_METADATA`` (a typestr for a
    checkpoint of one item, a dict by item name for a step), or None."""
    doc = read_json(path / CHECKPOINT_METADATA_FILE)
    return doc.get("item_handlers") if isinstance(doc, dict) else None


def _other_handler(handler: object) -> bool:
    """Whether ``handler`` is a recorded typestr of a handler other than this library's."""
    return isinstance(handler, str) and handler != HANDLER_TYPESTR


def not_a_checkpoint(path: epath.PathLike) -> NotSafetensorsError:
    """The error for an existing directory that holds no checkpoint of tensors, saying what it
    holds instead: the one wording every tool uses for it.
    """
    path = epath.Path(path)
    handler = item_handler(path)
    if handler is not None and handler != _OUR_HANDLER:
        return NotSafetensorsError(
            f"{path}: an Orbax item written by {handler}, not a checkpoint of tensors"
        )
    names = [c.name for c in path.iterdir()] if path.is_dir() else []
    if not names:
        what = "an empty directory" if path.is_dir() else "not a directory"
    elif CHECKPOINT_METADATA_FILE in names:
        items = list(list_items(path))
        what = "a step with no item of tensors" + (f" (items: {', '.join(items)})" if items else "")
    else:
        what = "no safetensors file, checkpoint item, Orbax item or step in this directory"
    return NotSafetensorsError(f"{path}: not a checkpoint: {what}")


def list_items(step: epath.PathLike) -> dict[str, PathKind]:
    """The items of a step directory by name, with their kind (``other`` for non-tensor items
    such as Orbax JSON items).

    Raises:
      UnsafePathError: an item is a symbolic link out of the step (``confine.inside``).
    """
    step = epath.Path(step)
    out = {}
    for c in sorted(step.iterdir(), key=lambda p: p.name):
        if c.is_dir() and TMP_SUFFIX not in c.name:
            out[c.name] = item_kind(_confine.inside(step, c.name))
    return out


# --------------------------------------------------------------------------- steps of a root
#
# Which steps a CheckpointManager lists (all_steps()): a directory of the root whose name has
# the manager's step format and that Orbax finds finalized for the manager's TemporaryPath
# class: atomic rename (Orbax's default, but on gs://) is finalized by its final name, a commit
# file (gs://, and s3:// through manager_options_for) by commit_success.txt. The class is
# recorded nowhere, so a tool reading a root asks Orbax's own judgement with its default class
# for the path (ocp.path.step.is_checkpoint_finalized), and adds what that cannot see:
#
# - s3:// needs the commit file (manager_options_for's class there);
# - on local disk, a step whose _CHECKPOINT_METADATA records a start and no commit time was
#   started by a commit-file manager and never finalized (atomic rename records the commit
#   time before the final name appears). One state stays ambiguous: a commit time but no
#   commit file (a kill between the two writes, or a half-deleted step); it is listed, as a
#   default manager lists it.
#
# Orbax before 0.12.3 lists every final-named step but on gs:// without the commit file,
# whatever the manager's class (its all_steps() does not ask it): Orbax's judgement alone
# (orbaxcompat.orbax_uses_legacy_commit_rule).


@dataclasses.dataclass(frozen=True)
class StepDir:
    """One step directory of a CheckpointManager root.

    Attributes:
      step: the step number.
      path: the directory.
      committed: whether Orbax counts it (lists it in ``mngr.all_steps()``).
      reason: why it is not committed (``""`` when it is).
      siblings_recorded: whether Orbax wrote ``_CHECKPOINT_METADATA`` in another step
        directory of the root: then this step lacking one is a step being deleted
        (``orbax/completeness``).
    """

    step: int
    path: epath.Path
    committed: bool
    reason: str = ""
    siblings_recorded: bool = False


def scan_steps(root: epath.PathLike) -> list[StepDir]:
    """Every step directory of a CheckpointManager root, committed or not (the rule above),
    sorted by step; temporary directories of unfinished saves and what a deletion of a step
    leaves (:func:`_step_candidates`) included.
    """
    candidates = _step_candidates(epath.Path(root))
    recorded = _recorded(candidates)
    steps = [_step_dir(child, number, recorded) for child, number in candidates]
    return sorted(steps, key=lambda s: (s.step, s.path.name))


def _recorded(candidates: list[tuple[epath.Path, int]]) -> set[str]:
    """The names of the step directories that hold Orbax's ``_CHECKPOINT_METADATA``."""
    return {c.name for c, _ in candidates if (c / CHECKPOINT_METADATA_FILE).exists()}


def _step_dir(child: epath.Path, number: int, recorded: set[str]) -> StepDir:
    reason = _uncommitted(child)
    # Only a step of the same manager vouches for the rule: one root's steps share one name
    # prefix (its ``step_prefix``); another prefix is another root's or no step at all.
    prefix = _name_parts(_base_name(child.name))[0]
    siblings = any(_name_parts(_base_name(n))[0] == prefix for n in recorded - {child.name})
    return StepDir(number, child, reason is None, reason or "", siblings)


def _base_name(name: str) -> str:
    """A step directory's name without the suffix of a save in progress."""
    return name.split(TMP_SUFFIX, 1)[0]


def _name_parts(name: str) -> tuple[str, str]:
    """The prefix and the digits of a step name (``"ckpt_0100"`` -> ``("ckpt_", "0100")``)."""
    m = _STEP_NAME.match(name)
    return (m.group(1), m.group(2)) if m else (name, "")


def _step_candidates(root: epath.Path) -> list[tuple[epath.Path, int]]:
    """The step directories of ``root`` (committed or not) with their step numbers.

    A step-named directory counts when it holds a step (:func:`_looks_like_step`), and also,
    whatever it holds, when its name has the form of such a step's (the same prefix; digits
    written as Orbax writes them): Orbax lists every directory whose name matches its step
    format, and deleting a step (``max_to_keep``) empties it file by file, its items and
    metadata first, so what a kill leaves may hold nothing recognisable, or nothing at all.
    """
    found: list[tuple[epath.Path, int]] = []
    unclear: list[tuple[epath.Path, int]] = []
    for child in root.iterdir():
        if TMP_SUFFIX in child.name:
            tmp = _TMP_STEP_NAME.match(child.name)
            if tmp and child.is_dir():
                found.append((child, int(tmp.group(1))))
            continue
        m = _STEP_NAME.match(child.name)
        if m and child.is_dir():
            child = _confine.inside(root, child.name)  # (a step linked out of the root: refused)
            (found if _looks_like_step(child) else unclear).append((child, int(m.group(2))))
    formats = {_name_parts(c.name) for c, _ in found if TMP_SUFFIX not in c.name}
    for child, number in unclear:
        prefix, digits = _name_parts(child.name)
        canonical = digits == str(int(digits))
        padded = any(p == prefix and len(d) == len(digits) and d[0] == "0" for p, d in formats)
        if (canonical or padded) and any(p == prefix for p, _ in formats):
            found.append((child, number))
    return found


def _looks_like_step(path: epath.Path) -> bool:
    """Whether a step-named directory holds a step (or is an item itself), not something else."""
    if item_kind(path) is not PathKind.OTHER:
        return True
    if (path / CHECKPOINT_METADATA_FILE).exists() or (path / COMMIT_SUCCESS_FILE).exists():
        return True
    return any(g.is_dir() and item_kind(g) is not PathKind.OTHER for g in path.iterdir())


def listed_step(path: epath.PathLike) -> StepDir | None:
    """The :class:`StepDir` of the directory ``path`` in the CheckpointManager root that is
    its parent, committed or not; None when it is not a step there."""
    path = epath.Path(path)
    if not _STEP_NAME.match(path.name) and TMP_SUFFIX not in path.name:
        return None
    # Only the parent's listing and which siblings hold Orbax's metadata file: the content of a
    # sibling is never read (it lies outside what the user named).
    try:
        candidates = _step_candidates(path.parent) if path.parent != path else []
    except OSError:  # a parent that cannot be listed is no root
        return None
    for child, number in candidates:
        if child.name == path.name:
            return _step_dir(child, number, _recorded(candidates))
    return None


def step_entry(path: epath.PathLike) -> StepDir | None:
    """What the directory ``path``, named on its own, is as a step: its root's entry
    (:func:`listed_step`); else, for a directory Orbax wrote as a step or one holding items,
    an entry of its own (step -1 where its name holds no number); None for anything else,
    such as one committed item of another handler saved by ``ocp.Checkpointer``. Every tool
    judges a path named directly by this entry."""
    path = epath.Path(path)
    if not path.is_dir():
        return None
    listed = listed_step(path)
    if listed is not None:
        return listed
    saved = TMP_SUFFIX in path.name or (path / CHECKPOINT_METADATA_FILE).exists()
    if not (saved or classify(path) is PathKind.STEP):
        return None
    reason = _uncommitted(path) if saved else None
    if reason is None and _other_handler(_recorded_handlers(path)):
        return None  # one item of another handler (ocp.Checkpointer): an item, not a step
    m = _STEP_NAME.match(_base_name(path.name))
    return StepDir(int(m.group(2)) if m else -1, path, reason is None, reason or "")


def _uncommitted(step: epath.Path) -> str | None:
    """Why Orbax does not count the step directory ``step`` as committed (the rule above
    :class:`StepDir`); None when it does."""
    if TMP_SUFFIX in step.name:
        return _TMP_REASON
    if (step / COMMIT_SUCCESS_FILE).exists():
        return None
    url = str(step)
    legacy = _orbaxcompat.orbax_uses_legacy_commit_rule()
    scheme = url.split("://", 1)[0] if "://" in url else ""
    finalized = _orbax_finalized(step)  # (False on local disk: the directory went meanwhile)
    if scheme and (not finalized or (scheme == "s3" and not legacy)):
        return (
            f"no {COMMIT_SUCCESS_FILE}: on {scheme}:// a step counts only once that file is "
            "written, last"
        )
    if legacy:
        return None
    doc = read_json(step / CHECKPOINT_METADATA_FILE)
    if (
        isinstance(doc, dict)
        and doc.get("init_timestamp_nsecs") is not None
        and doc.get("commit_timestamp_nsecs") is None
    ):
        return (
            f"no {COMMIT_SUCCESS_FILE} and no commit time in {CHECKPOINT_METADATA_FILE}: Orbax "
            "started this step and never finalized it"
        )
    return None


def _orbax_finalized(step: epath.Path) -> bool:
    """Whether Orbax takes the step directory for finalized, with its default TemporaryPath
    class for the path (see the comment above :class:`StepDir`)."""
    import orbax.checkpoint as ocp  # (here: classify and inspect FILE need no Orbax)

    try:
        return bool(ocp.path.step.is_checkpoint_finalized(step))
    except ValueError:  # (gone meanwhile: not a directory any more)
        return False


def is_child_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def read_json(path: epath.Path) -> Any:
    """The JSON document at ``path``; None when it is missing or unreadable.

    Raises:
      UnsafePathError: ``path`` is a FIFO or another special file (``confine.read_file``
        refuses it without blocking): planted, not damaged.
    """
    try:
        return json.loads(_confine.read_file(path))
    except UnsafePathError:
        raise
    except (OSError, ValueError, RecursionError):
        return None


def list_steps(root: epath.PathLike) -> list[tuple[int, epath.Path]]:
    """The committed steps of a CheckpointManager root, as ``(step number, path)``, sorted: the
    steps ``mngr.all_steps()`` lists (see :func:`scan_steps`)."""
    return [(s.step, s.path) for s in scan_steps(root) if s.committed]


# ------------------------------------------------------------ Orbax's commit on object storage


def check_commit_scheme(directory: str) -> None:
    """Raises if Orbax will commit the save into ``directory`` by renaming it on ``s3://``:
    S3 has no rename, so the save would upload everything and then fail in Orbax's background
    commit. Orbax's default ``AtomicRenameTemporaryPath`` writes into a temporary name
    (``<step>.orbax-checkpoint-tmp``, or such an item directory) and renames it;
    ``CommitFileTemporaryPath`` writes ``<root>/<step>/<item>`` in place."""
    directory = os.fspath(directory).rstrip("/")
    if not directory.startswith("s3://"):
        return
    parts = directory.split("/")
    flagged = [i for i in range(max(3, len(parts) - 2), len(parts)) if TMP_SUFFIX in parts[i]]
    if not flagged:
        return
    root = "/".join(parts[: flagged[0]])
    raise SafetensorsCheckpointError(
        f"{directory}: Orbax is saving this step into a temporary directory that it renames "
        "when done (its default AtomicRenameTemporaryPath), and S3 cannot rename: the commit "
        "would fail after every upload. Create the manager with "
        f"ocp.CheckpointManager({root!r}, options=osf.manager_options_for({root!r}, ...)) "
        "(for an ocp.Checkpointer: temporary_path_class="
        "ocp.path.atomicity.CommitFileTemporaryPath). No tensor data was uploaded."
    )


def refuse_renaming_commit(directory: Any) -> None:
    """Raises (see :func:`check_commit_scheme`) if Orbax would commit a save into ``directory``
    by renaming it on ``s3://``, after letting Orbax create this save's directories."""
    try:
        check_commit_scheme(directory)  # the same answer on every process
    except SafetensorsCheckpointError:
        # Wait (at most a minute) until Orbax has created them, for the same signals the
        # handler's own writes wait for: Orbax creates them in a background thread before it
        # calls the handler. A save() that raises before they exist leaves that thread racing
        # close(), which shuts down the executor it writes the step metadata with; it then
        # dies before signalling, and a thread waiting for its signal keeps the process from
        # exiting until Orbax's coordination timeout.
        from orbax.checkpoint import future as ocp_future

        async def nothing() -> None:
            return None

        with contextlib.suppress(Exception):  # best effort: the caller's error matters more
            ocp_future.CommitFutureAwaitingContractedSignals(
                nothing(), name="osf_refused_save", timeout_secs=60
            ).result(timeout=60)
        raise


def manager_options_for(path: Any, **kwargs: Any) -> Any:
    """``ocp.CheckpointManagerOptions(**kwargs)`` that work for ``path``'s storage.

    On ``s3://`` Orbax's default atomic rename does not work; a step is committed instead by
    writing ``commit_success.txt`` last (``CommitFileTemporaryPath``, Orbax's default on
    ``gs://``), and a step without it is never listed. Other paths keep Orbax's defaults.

    Example::

        options = osf.manager_options_for("s3://bucket/run", max_to_keep=3)
        mngr = ocp.CheckpointManager("s3://bucket/run", options=options)
    """
    import orbax.checkpoint as ocp

    if os.fspath(path).startswith("s3://") and "temporary_path_class" not in kwargs:
        kwargs["temporary_path_class"] = ocp.path.atomicity.CommitFileTemporaryPath
    return ocp.CheckpointManagerOptions(**kwargs)
