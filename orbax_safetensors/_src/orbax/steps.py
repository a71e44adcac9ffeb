"""Orbax's directory conventions: what a path is, which steps of a root are committed, and
what an unfinished step lacks. The one owner of step listing and committedness (inspect,
verify, convert and the demo all ask here).

What a path can be (:func:`classify`):

- ``file``: one ``.safetensors`` file (written by this library, PyTorch, anyone);
- ``item``: a checkpoint directory of this library (it has ``orbax_safetensors.json``);
- ``safetensors-dir``: plain safetensors files in a directory, Hugging Face style
  (``model.safetensors`` or shards listed in ``model.safetensors.index.json``);
- ``orbax``: an Orbax-native PyTree item (``StandardSave``/``PyTreeSave``, OCDBT or not);
- ``step``: a directory of items (one CheckpointManager step);
- ``root``: a directory of steps (a CheckpointManager root).

Example::

    classify("/ckpt")                 # PathKind.ROOT
    [step for step, _ in list_steps("/ckpt")]   # the committed steps, as Orbax lists them
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Sequence
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
COMMIT_SUCCESS_FILE = "commit_success.txt"  # Orbax's commit marker (atomicity_types.py L31)
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
_STEP_NAME = re.compile(r"^(?:.*?[_-])?(\d+)$")
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_TMP_STEP_NAME = re.compile(rf"^(?:.*?[_-])?(\d+){re.escape(TMP_SUFFIX)}")  # step.py L50
_COMMIT_FILE_SCHEMES = ("gs://", "s3://")
_LEGACY_COMMIT_FILE_SCHEMES = ("gs://",)  # orbax-checkpoint < 0.12.3 (see scan_steps)
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
    doc = _read_json(path / ORBAX_METADATA_FILE)
    doc = doc if isinstance(doc, dict) else {}
    ocdbt = doc.get("use_ocdbt")
    return ArrayStorage(
        use_zarr3=doc.get("use_zarr3") is True,
        use_ocdbt=ocdbt if isinstance(ocdbt, bool) else (path / OCDBT_MANIFEST_FILE).exists(),
        fill_missing=doc.get("store_array_data_equal_to_fill_value") is not True,
    )


def check_orbax_item(path: epath.PathLike) -> None:
    """Refuses an Orbax-native item that a read through Orbax or TensorStore would leave or
    block in, before either opens a file of it: no entry of the item may be a symbolic link
    out of it or a special file (``confine.check_tree``), and every array name its
    ``_METADATA`` records (Orbax reads the array ``name`` at ``<item>/<name>``) must stay
    inside it (``confine.inside``). A ``_METADATA`` that cannot be parsed is left to Orbax,
    which reports it.

    Raises:
      UnsafePathError: naming ``_METADATA``, the name and the item.

    Example::

        check_orbax_item("/ckpt/100/state")   # before ocp.PyTreeCheckpointHandler().restore
    """
    path = epath.Path(path)
    where = path / ORBAX_METADATA_FILE
    _confine.check_tree(path, where=path)
    doc = _read_json(where)
    for name in orbax_array_names(doc):
        _confine.inside(path, name, where=where)


def orbax_array_names(doc: Any) -> list[str]:
    """The name of each leaf an Orbax ``_METADATA`` document records, as Orbax joins it
    (its keys, ``str`` of each, joined by ``.``: ``tree_utils.param_name_from_keypath``);
    entries that are not so shaped are skipped (Orbax refuses them itself).

    Example::

        orbax_array_names({"tree_metadata": {"('a', 'b')": {"key_metadata": [
            {"key": "a", "key_type": 2}, {"key": "b", "key_type": 2}]}}})   # ['a.b']
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

    Example::

        item_handler("/ckpt/200/meta")     # 'JsonCheckpointHandler'
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
    doc = _read_json(path / CHECKPOINT_METADATA_FILE)
    return doc.get("item_handlers") if isinstance(doc, dict) else None


def _other_handler(handler: object) -> bool:
    """Whether ``handler`` is a recorded typestr of a handler other than this library's."""
    return isinstance(handler, str) and handler != HANDLER_TYPESTR


def not_a_checkpoint(path: epath.PathLike) -> NotSafetensorsError:
    """The error for an existing directory that holds no checkpoint of tensors, saying what it
    holds instead: the one wording every tool uses for it.

    Example::

        raise not_a_checkpoint("/ckpt/200/meta")
        # /ckpt/200/meta: an Orbax item written by JsonCheckpointHandler, not a checkpoint of
        # tensors
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
# Which steps Orbax counts as committed (orbax-checkpoint 0.12.8, files under
# site-packages/orbax/checkpoint/_src/path/). CheckpointManager.all_steps() keeps a directory of
# the root when StandardNameFormat._build_metadata (step.py L357-387) finds it finalized with
# temporary_paths.is_path_finalized (temporary_paths.py L94-146) and its name matches
# ``^(prefix_)?(0|[1-9]\d*)$`` (step.py L380). is_path_finalized asks the manager's
# TemporaryPath class; without an explicit one, atomicity_defaults.py L98-127 picks
# CommitFileTemporaryPath on gs:// (gcs_utils.py L25-29) and AtomicRenameTemporaryPath anywhere
# else:
#
# - AtomicRenameTemporaryPath.validate_final (atomicity.py L431-442, L456-460): a directory
#   whose name does not contain ".orbax-checkpoint-tmp". Nothing inside it is looked at.
# - CommitFileTemporaryPath.validate_final (atomicity.py L583-592): a directory holding
#   commit_success.txt, whatever its name.
#
# Both write the same files in the same order: _CHECKPOINT_METADATA with a null
# commit_timestamp_nsecs when the step directory is created (atomicity.py L104-160), then, when
# the save is finalized, commit_timestamp_nsecs and commit_success.txt (atomicity.py L522-552,
# L656-681); atomic rename then renames <step>.orbax-checkpoint-tmp to <step>. A committed step
# looks the same in both modes and no file records the mode, so one cannot always tell which
# kind a final-named step without commit_success.txt is. The rule below agrees with Orbax's
# default on each filesystem, and with the manager that wrote the root in every state a crash
# can leave:
#
# 1. A name containing ".orbax-checkpoint-tmp" is not committed (both classes).
# 2. A directory holding commit_success.txt is committed (both classes).
# 3. Otherwise, on gs:// (Orbax's default there) and s3:// (manager_options_for selects
#    CommitFileTemporaryPath there) it is not committed.
# 4. Otherwise (local disk, other filesystems: atomic rename, the final name is the commit) it
#    is committed, unless its _CHECKPOINT_METADATA says Orbax started it and never finalized it
#    (init_timestamp_nsecs set, commit_timestamp_nsecs null): a commit-file step
#    (temporary_path_class=CommitFileTemporaryPath) interrupted before its commit. Atomic
#    rename never leaves that state under the final name: it records the commit time first.
#
# Rule 4 keeps, as a default manager does, the steps written before Orbax wrote
# commit_success.txt in atomic-rename mode, and an old step that Orbax was deleting file by file
# (deleter.py L152-173) when the process was killed, whatever file went first. The one state
# where a CommitFileTemporaryPath manager on local disk disagrees: commit time recorded but
# commit_success.txt missing (a kill between those two writes, or the file deleted); it looks
# exactly like such a half-deleted step, and is listed here as a default manager lists it.
#
# Orbax before 0.12.3 never asks the manager's TemporaryPath class (0.12.3 is the first release
# whose _build_metadata passes temporary_path_cls=self.temporary_path_cls; checked in the 0.12.2
# and 0.12.3 wheels):
#
# - 0.11.11: StandardNameFormat._build_metadata (step.py L324-333) keeps a directory when
#   is_checkpoint_finalized (step.py L638-685) does: not on gs:// (is_gcs_path, L570) without
#   commit_success.txt (L669), no ".orbax-checkpoint-tmp-" in its name (L39, L682). Temporary
#   directories are "<step>.orbax-checkpoint-tmp-<n>" (atomicity.py L165-170), and atomic
#   rename writes no commit_success.txt (atomicity.py L282-298).
# - 0.11.40: _build_metadata (step.py L349-354) calls is_path_finalized(step_path) without the
#   manager's class, so temporary_paths.is_path_finalized (L77-113) takes
#   atomicity_defaults.get_default_temporary_path_class(path) (L38-45): CommitFileTemporaryPath
#   on gs:// only, else AtomicRenameTemporaryPath (a name check, atomicity.py L436-445).
#
# With such an Orbax installed, rules 3 and 4 become: only on gs:// does a step need
# commit_success.txt; anywhere else (local disk, s3://) a final-named directory is committed,
# even a commit-file step killed before its commit, which that Orbax lists (and fails to
# restore). This depends on the Orbax that reads the root, not on the files (a 0.12.3+
# commit-file manager does not list that same directory), so it is keyed on the installed
# orbax-checkpoint version (:func:`_orbaxcompat.orbax_uses_legacy_commit_rule`).


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
        (:func:`missing_entries`).
    """

    step: int
    path: epath.Path
    committed: bool
    reason: str = ""
    siblings_recorded: bool = False


def scan_steps(root: epath.PathLike) -> list[StepDir]:
    """Every step directory of a CheckpointManager root, committed or not, sorted by step.

    The one place that decides which directories of a root are steps and which of them Orbax
    counts as committed (see the rule above); ``inspect``, ``verify`` and ``convert`` use it.
    Temporary directories of unfinished saves (``<step>.orbax-checkpoint-tmp``, or
    ``<step>.orbax-checkpoint-tmp-<n>`` from older Orbax such as 0.11.11) are included, not
    committed. So is what a deletion of a step leaves (see :func:`_step_candidates`).

    Example::

        [(s.step, s.committed) for s in scan_steps("/ckpt")]   # [(100, True), (200, False)]
    """
    candidates = _step_candidates(epath.Path(root))
    recorded = {c.name for c, _ in candidates if (c / CHECKPOINT_METADATA_FILE).exists()}
    steps = []
    for child, number in candidates:
        reason = _uncommitted(child)
        siblings = bool(recorded - {child.name})
        steps.append(StepDir(number, child, reason is None, reason or "", siblings))
    return sorted(steps, key=lambda s: (s.step, s.path.name))


_NAME_PARTS = re.compile(r"^((?:.*?[_-])?)(\d+)$")


def _name_parts(name: str) -> tuple[str, str]:
    """The prefix and the digits of a step name (``"ckpt_0100"`` -> ``("ckpt_", "0100")``)."""
    m = _NAME_PARTS.match(name)
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
            (found if _looks_like_step(child) else unclear).append((child, int(m.group(1))))
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
    """The :class:`StepDir` of the directory ``path`` when it is a step directory of a
    CheckpointManager root (its parent), committed or not; None otherwise. For a step named
    directly, what its root tells about it (whether Orbax wrote ``_CHECKPOINT_METADATA`` for
    its other steps)."""
    path = epath.Path(path)
    if not _STEP_NAME.match(path.name) and TMP_SUFFIX not in path.name:
        return None
    try:
        steps = scan_steps(path.parent) if path.parent != path else []
    except OSError:  # a parent that cannot be listed is no root
        return None
    return next((s for s in steps if s.path.name == path.name), None)


def step_entry(path: epath.PathLike) -> StepDir | None:
    """What the directory ``path``, named on its own, is as a step: its root's entry when its
    parent is a root that holds it as a step (:func:`listed_step`); else, for a directory
    Orbax wrote as a step (``_CHECKPOINT_METADATA``, a temporary name) or one holding items,
    an entry of its own (step -1 where its name holds no number); None for anything else,
    such as one item of another handler saved by ``ocp.Checkpointer``. ``verify``,
    ``inspect`` and ``convert`` take a path so."""
    path = epath.Path(path)
    if not path.is_dir():
        return None
    listed = listed_step(path)
    if listed is not None:
        return listed
    if not (
        TMP_SUFFIX in path.name
        or (path / CHECKPOINT_METADATA_FILE).exists()
        or classify(path) is PathKind.STEP
    ):
        return None
    if _other_handler(_recorded_handlers(path)):
        return None  # one item of another handler (ocp.Checkpointer): an item, not a step
    reason = uncommitted_reason(path)
    m = _STEP_NAME.match(path.name.split(TMP_SUFFIX, 1)[0])
    return StepDir(int(m.group(1)) if m else -1, path, reason is None, reason or "")


def uncommitted_reason(path: epath.PathLike) -> str | None:
    """Why Orbax does not count the directory ``path`` as a committed step; None when it does,
    or when ``path`` is not recognisably a step Orbax saved (no ``_CHECKPOINT_METADATA``, not a
    temporary directory). The rule is the comment above :class:`StepDir`.
    """
    path = epath.Path(path)
    if TMP_SUFFIX not in path.name and not (path / CHECKPOINT_METADATA_FILE).exists():
        return None
    return _uncommitted(path)


def _uncommitted(step: epath.Path) -> str | None:
    """:func:`uncommitted_reason` of a directory known to be a step."""
    if TMP_SUFFIX in step.name:
        return _TMP_REASON
    if (step / COMMIT_SUCCESS_FILE).exists():
        return None
    url = str(step)
    legacy = _orbaxcompat.orbax_uses_legacy_commit_rule()
    if url.startswith(_LEGACY_COMMIT_FILE_SCHEMES if legacy else _COMMIT_FILE_SCHEMES):
        scheme = url.split("://", 1)[0]
        return (
            f"no {COMMIT_SUCCESS_FILE}: on {scheme}:// a step counts only once that file is "
            "written, last"
        )
    if legacy:
        return None
    doc = _read_json(step / CHECKPOINT_METADATA_FILE)
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


# --------------------------------------------------------------------------- complete steps
#
# What Orbax's restore of a step needs, and so what a step must hold to count as complete
# (checked against orbax-checkpoint 0.11.11 and 0.12.8: every file of a real step deleted in
# turn, tests/hostile/test_half_deleted_steps.py). Orbax deletes an old step (max_to_keep) file
# by file: 0.11.11, and 0.12.8 with one deletion thread, with shutil.rmtree (depth first, in
# directory listing order: any item, any file first); 0.12.8 with several threads deletes the
# files of every directory at once, in no order, then the empty directories
# (deleter.py, _ParallelDirectoryDeleter). A kill can leave any of those states, and Orbax keeps
# listing the step until its directory itself is gone. So completeness is judged file by file:
#
# - the step's _CHECKPOINT_METADATA: restore reads it when present; a step without one while
#   the root's other steps have one is being deleted (the file names the items, so which items
#   the step had is unknown): incomplete, whatever else it still holds;
# - every item it names: the directory, and in it what that item's restore reads:
#   - this library's item: orbax_safetensors.json and every file it lists;
#   - an Orbax PyTree item (StandardSave / PyTreeSave / v1's PyTree checkpointable):
#     _METADATA; _sharding when it records a jax.Array (restoring without a target needs
#     it); _strings.json when it records a string; with OCDBT, manifest.ocdbt and every data
#     file its latest version references (the B+tree nodes and the values, under d/ or
#     ocdbt.process_<n>/d/, found with TensorStore's ocdbt.dump, reading the nodes only);
#     without it, each array's .zarray / zarr.json and, unless the item predates Orbax's
#     storing of every chunk (store_array_data_equal_to_fill_value), each chunk file;
#   - another handler's item (JSON...): at least one file besides Orbax's commit marker.
# Items present but not named (no _CHECKPOINT_METADATA) are judged by what they hold.
# Not needed by any restore, so not required: commit_success.txt (a commit marker, checked by
# scan_steps where it is the commit), array_metadatas/, ocdbt.process_<n>/manifest.ocdbt and
# the per-process data files the merged manifest does not reference.

# This library's handlers by class name: v0's, and v1's (orbax/v1.HANDLER_TYPESTR).
_OUR_HANDLERS = frozenset((_OUR_HANDLER, "SafetensorsHandler"))
_PYTREE_HANDLERS = frozenset(
    ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")
)
_ORBAX_ITEM_ENTRIES = ("_sharding", "_strings.json", "d", "array_metadatas", OCDBT_MANIFEST_FILE)
SHARDING_FILE = "_sharding"
STRINGS_FILE = "_strings.json"
_TENSORSTORE_VALUES = frozenset(("jax.Array", "np.ndarray", "scalar"))
_LISTED = 4  # missing files of one kind named one by one; more are counted
_NAMED_CHUNKS = 4096  # beyond this many missing chunk files, a grid is counted, not listed


def missing_entries(step: epath.PathLike | StepDir) -> list[str]:
    """What a committed step lacks that restoring it needs, relative to the step; empty when
    nothing is missing. The one judgement of a step's completeness: ``verify``, ``inspect``
    and ``convert`` ask here (see the comment above for what is required).

    A step Orbax lists with entries missing cannot be restored: typically an old step whose
    deletion by Orbax's cleanup (``max_to_keep``) was interrupted by a kill. Pass the
    :class:`StepDir` from :func:`scan_steps` where there is one (it knows the root); a path is
    looked up in its parent directory.

    Example::

        missing_entries("/ckpt/100")   # ['_CHECKPOINT_METADATA', 'state/model.safetensors']
    """
    listed = step if isinstance(step, StepDir) else None
    path = step.path if isinstance(step, StepDir) else epath.Path(step)
    missing: list[str] = []
    recorded = (path / CHECKPOINT_METADATA_FILE).exists()
    if not recorded:
        listed = listed or listed_step(path)
        if listed is not None and listed.siblings_recorded:
            missing.append(CHECKPOINT_METADATA_FILE)
    doc = _read_json(path / CHECKPOINT_METADATA_FILE) if recorded else None
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    if handlers == HANDLER_TYPESTR or (path / _metadata.METADATA_FILE).exists():
        return missing + _missing_in_our_item(path, "")  # a step that is one item
    if isinstance(handlers, str):  # one item of another handler (ocp.Checkpointer)
        return missing + _missing_in_item(path, "", handlers.rsplit(".", 1)[-1], True)
    named = (
        {n: h for n, h in handlers.items() if _is_child_name(n)}
        if isinstance(handlers, dict)
        else {}
    )
    present = list_items(path)
    for name in sorted({*named, *present}):
        if not (path / name).is_dir():
            missing.append(f"{name}/")
            continue
        typestr = named.get(name)
        handler = typestr.rsplit(".", 1)[-1] if isinstance(typestr, str) else None
        missing += _missing_in_item(path / name, f"{name}/", handler, name in named or not recorded)
    if _orbaxcompat.orbax_uses_legacy_commit_rule():
        missing.extend(n for n in _unfinished_items(path) if n not in missing)
    if not named and not present and not missing:
        missing.append("every item (the step directory holds none)")
    return missing


def _missing_in_item(item: epath.Path, prefix: str, handler: str | None, named: bool) -> list[str]:
    """What the item directory ``item`` lacks for its restore, each as ``prefix`` + its path.

    ``handler``: the class name of the handler that wrote it, None where unrecorded: then it
    is judged by what it holds, and an item holding nothing recognisable lacks its files only
    when ``named`` (an item of the step, or a step whose list of items is gone)."""
    names = {c.name for c in item.iterdir()}
    ours = handler in _OUR_HANDLERS or _metadata.METADATA_FILE in names
    pytree = not ours and (handler in _PYTREE_HANDLERS or ORBAX_METADATA_FILE in names)
    if handler is None and not ours and not pytree:  # unrecorded: by what is left
        ours = any(n.endswith(".safetensors") for n in names)
        pytree = not ours and any(
            n in _ORBAX_ITEM_ENTRIES or n.startswith("ocdbt.process_") for n in names
        )
    if ours:
        return _missing_in_our_item(item, prefix)
    if pytree:
        return _missing_in_pytree_item(item, names, prefix)
    if named and not names - {COMMIT_SUCCESS_FILE}:
        return [f"the files of {prefix}"]  # an item of another handler, emptied
    return []


def _missing_in_our_item(item: epath.Path, prefix: str) -> list[str]:
    """This library's item: its metadata file and every file that lists."""
    if not (item / _metadata.METADATA_FILE).exists():
        return [prefix + _metadata.METADATA_FILE]
    meta = _read_json(item / _metadata.METADATA_FILE)
    files = meta.get("files") if isinstance(meta, dict) else None
    listed = files if isinstance(files, list) else []
    return [prefix + f for f in listed if _is_child_name(f) and not (item / f).exists()]


def _missing_in_pytree_item(item: epath.Path, names: set[str], prefix: str) -> list[str]:
    """What an Orbax PyTree item lacks for Orbax's restore (the comment above)."""
    if ORBAX_METADATA_FILE not in names:
        return [prefix + ORBAX_METADATA_FILE]
    doc = _read_json(item / ORBAX_METADATA_FILE)
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        return []  # damaged, not deleted: Orbax's restore (and inspect) report it
    leaves = _pytree_leaves(doc)
    missing = []
    kinds = set(leaves.values())
    if "jax.Array" in kinds and SHARDING_FILE not in names:
        missing.append(prefix + SHARDING_FILE)
    if "string" in kinds and STRINGS_FILE not in names:
        missing.append(prefix + STRINGS_FILE)
    storage = array_storage(item)
    # An OCDBT item names no array directory; Orbax before 0.12 records no use_ocdbt, and
    # tells OCDBT by manifest.ocdbt alone, which a deletion may have taken first.
    ocdbt_entries = {n for n in names if n.startswith("ocdbt.process_")} | ({"d"} - set(leaves))
    if storage.use_ocdbt or _orbax_ocdbt(item) or ocdbt_entries & names:
        return missing + _missing_ocdbt_files(item, prefix)
    for name, kind in sorted(leaves.items()):
        if kind in _TENSORSTORE_VALUES:
            missing += _missing_zarr_files(item / name, storage, f"{prefix}{name}/")
    return missing


def _pytree_leaves(doc: dict[str, Any]) -> dict[str, str]:
    """The stored leaves an Orbax ``_METADATA`` records: Orbax's parameter name (its keys
    joined with ``.``, the name of the array's directory or OCDBT key) -> its value type."""
    tree = doc.get("tree_metadata")
    leaves = {}
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not isinstance(value, dict):
            continue
        if value.get("skip_deserialize") is True or not isinstance(value.get("value_type"), str):
            continue
        name = ".".join(str(k.get("key")) for k in keys if isinstance(k, dict))
        leaves[name] = value["value_type"]
    return leaves


def _orbax_ocdbt(item: epath.Path) -> bool:
    """Whether Orbax takes the item for an OCDBT one (its own test, where it has one)."""
    try:
        import orbax.checkpoint as ocp

        return bool(ocp.type_handlers.is_ocdbt_checkpoint(item))
    except (ImportError, AttributeError):
        return (item / OCDBT_MANIFEST_FILE).exists()


def _missing_ocdbt_files(item: epath.Path, prefix: str) -> list[str]:
    """``manifest.ocdbt`` and the data files of the latest version of the item's OCDBT
    database that are missing: the B+tree is walked with ``tensorstore.ocdbt.dump`` (the
    nodes are read, the values only located), and each file a node or value lives in is
    checked. A node that cannot be read for another reason (damage, not deletion) ends the
    walk of its subtree: restore reports such damage."""
    if not (item / OCDBT_MANIFEST_FILE).exists():
        return [prefix + OCDBT_MANIFEST_FILE]
    import tensorstore as ts

    context = ts.Context()
    spec = _orbaxcompat.array_read_spec(
        item, "_", use_zarr3=False, use_ocdbt=True, fill_missing=False, context=context
    )
    # Orbax's own spec of the item's directory (local disk, gs://); where it gives none (s3://
    # in orbax-checkpoint 0.12), TensorStore cannot open the path and nothing is walked.
    base_spec = spec.get("kvstore", {}).get("base") if isinstance(spec, dict) else None
    if not isinstance(base_spec, dict):
        base_spec = {"driver": "file", "path": str(item)}
    path = base_spec.get("path")
    if isinstance(path, str) and not path.endswith("/"):
        base_spec = {**base_spec, "path": path + "/"}  # a directory: its files are its keys
    try:
        base = ts.KvStore.open(base_spec, context=context).result()
        manifest = ts.ocdbt.dump(base, context=context).result()
    except (ValueError, TypeError):
        return []
    versions = manifest.get("versions") if isinstance(manifest, dict) else None
    if not isinstance(versions, list) or not versions:
        return []
    latest = max(
        versions, key=lambda v: v.get("generation_number", 0) if isinstance(v, dict) else 0
    )
    files: set[str] = set()
    missing: set[str] = set()
    nodes = list(_locations(latest))
    seen: set[str] = set()  # each node read once, whatever a forged tree references
    while nodes:
        location = nodes.pop()
        file = _location_file(location)
        if file is None or location in seen:
            continue
        seen.add(location)
        files.add(file)
        if not (item / file).exists():
            missing.add(file)
        elif location.startswith("btreenode:"):
            try:
                nodes.extend(_locations(ts.ocdbt.dump(base, location, context=context).result()))
            except (ValueError, TypeError):
                continue
    return _counted(prefix, sorted(missing), len(files), "OCDBT data files")


def _locations(node: Any) -> list[str]:
    """The node and value locations (``"btreenode:..."``, ``"value:..."``) anywhere in a
    dumped OCDBT manifest, version or node."""
    if isinstance(node, str):
        return [node] if node.startswith(("btreenode:", "value:")) else []
    if isinstance(node, dict):
        return [loc for v in node.values() for loc in _locations(v)]
    if isinstance(node, list):
        return [loc for v in node for loc in _locations(v)]
    return []


def _location_file(location: str) -> str | None:
    """The file of an OCDBT location ``"<kind>:<base path>:<relative path>:<offset>:<length>"``,
    relative to the database's directory; None for one that does not stay inside it."""
    parts = location.split(":", 1)[-1].rsplit(":", 2)[0].split(":", 1)
    if len(parts) != 2:
        return None
    base, relative = parts
    file = f"{base.rstrip('/')}/{relative}" if base else relative
    names = file.split("/")
    if file.startswith("/") or any(n in ("", ".", "..") for n in names) or "\\" in file:
        return None
    return file


def _missing_zarr_files(array: epath.Path, storage: ArrayStorage, prefix: str) -> list[str]:
    """What a zarr array directory of a PyTree item (without OCDBT) lacks: its metadata file,
    and, where Orbax stored every chunk, the chunk files of its chunk grid."""
    meta_name = "zarr.json" if storage.use_zarr3 else ".zarray"
    meta = _read_json(array / meta_name)
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
    """The chunk grid of a zarr array (v2 ``.zarray`` or v3 ``zarr.json``, with the key
    encodings Orbax writes): the number of chunks along each axis, and the key of a chunk
    from its index; None where the metadata is not of that form."""
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
    """``missing`` (relative to ``prefix``) named when few; else the first few, then how many
    more of the ``total`` ``what`` of ``prefix`` are missing."""
    named = [
        prefix + m for m in missing[: len(missing) if len(missing) <= _LISTED else _LISTED - 1]
    ]
    if len(named) == len(missing):
        return named
    rest = len(missing) - len(named)
    return [*named, f"{rest} more of the {total} {what} of {prefix or './'}"]


def _unfinished_items(step: epath.Path) -> list[str]:
    """``"<item>/"`` for each item of ``step`` present only under its temporary name
    (``<item>.orbax-checkpoint-tmp[-<n>]``): its save never finished. Orbax < 0.12.3 lists such
    a step on local disk (a commit-file save killed before its commit; 0.11.11 gives items
    temporary names in both modes), and restoring it fails.
    """
    names = []
    for child in sorted(step.iterdir(), key=lambda p: p.name):
        name = child.name.split(TMP_SUFFIX, 1)[0]
        unfinished = name != child.name and _is_child_name(name) and child.is_dir()
        if unfinished and not (step / name).is_dir():
            names.append(f"{name}/")
    return names


def _is_child_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _read_json(path: epath.Path) -> Any:
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


def incomplete_problem(path: epath.PathLike, missing: Sequence[str]) -> str:
    """The problem line for a committed step with ``missing`` entries."""
    return (
        f"{path}: incomplete step, missing {', '.join(missing)} (Orbax lists this step but "
        "cannot restore it)"
    )


def require_complete(step: epath.PathLike | StepDir) -> None:
    """Raises when the committed step ``step`` lacks what restoring it needs
    (:func:`missing_entries`): for the tools that would otherwise carry such a step on as if
    whole (``convert``).

    Raises:
      SafetensorsCheckpointError: naming the step and what it lacks.
    """
    missing = missing_entries(step)
    if missing:
        path = step.path if isinstance(step, StepDir) else step
        raise SafetensorsCheckpointError(
            f"{incomplete_problem(path, missing)}; most likely the process was killed while "
            "Orbax's cleanup (max_to_keep) was deleting it: delete it, or name the other steps "
            "one by one"
        )


def incomplete_warning(
    step: int, path: epath.PathLike, missing: Sequence[str], latest: int | None
) -> str:
    """The warning line for a committed step with ``missing`` entries (``latest``: the latest
    committed step of its root)."""
    what = f"step {step} is incomplete (missing {', '.join(missing)})"
    if latest is not None and step < latest:
        return (
            f"{what} and older than the latest step {latest}: most likely the process was "
            "killed while Orbax's cleanup (max_to_keep) was deleting it. The other steps are not "
            f"affected; deleting {path} clears this"
        )
    return f"{what} and is the latest step: restoring it fails; restore an earlier step"


def list_steps(root: epath.PathLike) -> list[tuple[int, epath.Path]]:
    """The committed steps of a CheckpointManager root, as ``(step number, path)``, sorted: the
    steps ``mngr.all_steps()`` lists (see :func:`scan_steps`)."""
    return [(s.step, s.path) for s in scan_steps(root) if s.committed]
