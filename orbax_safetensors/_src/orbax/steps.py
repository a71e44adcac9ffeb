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
import json
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import NotSafetensorsError, UnsafePathError
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
    if any(True for _ in _step_candidates(path)):
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
    """

    step: int
    path: epath.Path
    committed: bool
    reason: str = ""


def scan_steps(root: epath.PathLike) -> list[StepDir]:
    """Every step directory of a CheckpointManager root, committed or not, sorted by step.

    The one place that decides which directories of a root are steps and which of them Orbax
    counts as committed (see the rule above); ``inspect``, ``verify`` and ``convert`` use it.
    Temporary directories of unfinished saves (``<step>.orbax-checkpoint-tmp``, or
    ``<step>.orbax-checkpoint-tmp-<n>`` from older Orbax such as 0.11.11) are included, not
    committed.

    Example::

        [(s.step, s.committed) for s in scan_steps("/ckpt")]   # [(100, True), (200, False)]
    """
    steps = []
    for child, number in _step_candidates(epath.Path(root)):
        reason = _uncommitted(child)
        steps.append(StepDir(number, child, reason is None, reason or ""))
    return sorted(steps, key=lambda s: (s.step, s.path.name))


def _step_candidates(root: epath.Path) -> Iterator[tuple[epath.Path, int]]:
    """The step directories of ``root`` (committed or not) with their step numbers."""
    for child in root.iterdir():
        if TMP_SUFFIX in child.name:
            tmp = _TMP_STEP_NAME.match(child.name)
            if tmp and child.is_dir():
                yield child, int(tmp.group(1))
            continue
        m = _STEP_NAME.match(child.name)
        if m and child.is_dir() and _looks_like_step(child):
            yield _confine.inside(root, child.name), int(m.group(1))


def _looks_like_step(path: epath.Path) -> bool:
    """Whether a step-named directory holds a step (or is an item itself), not something else."""
    if item_kind(path) is not PathKind.OTHER:
        return True
    if (path / CHECKPOINT_METADATA_FILE).exists() or (path / COMMIT_SUCCESS_FILE).exists():
        return True
    return any(g.is_dir() and item_kind(g) is not PathKind.OTHER for g in path.iterdir())


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


def missing_entries(step: epath.PathLike) -> list[str]:
    """What a committed step directory lacks, relative to it; empty when nothing is missing.

    Checks the items its ``_CHECKPOINT_METADATA`` lists, this library's metadata file in those
    of its items, and every file that metadata lists; with Orbax < 0.12.3 installed, also items
    present only under a temporary name (:func:`_unfinished_items`). A step Orbax lists with entries missing
    cannot be restored: typically an old step whose deletion by Orbax's cleanup (``max_to_keep``)
    was interrupted by a crash.
    """
    step = epath.Path(step)
    missing: list[str] = []
    doc = _read_json(step / CHECKPOINT_METADATA_FILE)
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    if isinstance(handlers, dict):
        for name, typestr in sorted(handlers.items()):
            if not _is_child_name(name):
                continue
            if not (step / name).is_dir():
                missing.append(f"{name}/")
            elif (
                typestr == HANDLER_TYPESTR and not (step / name / _metadata.METADATA_FILE).exists()
            ):
                missing.append(f"{name}/{_metadata.METADATA_FILE}")
    elif handlers == HANDLER_TYPESTR and not (step / _metadata.METADATA_FILE).exists():
        missing.append(_metadata.METADATA_FILE)  # a step that is itself one item (ocp.Checkpointer)
    if _orbaxcompat.orbax_uses_legacy_commit_rule():
        missing.extend(n for n in _unfinished_items(step) if n not in missing)
    items = [("", step)] + [(f"{n}/", step / n) for n in list_items(step)]
    for prefix, item in items:
        meta = _read_json(item / _metadata.METADATA_FILE)
        files = meta.get("files") if isinstance(meta, dict) else None
        for f in files if isinstance(files, list) else []:
            if _is_child_name(f) and not (item / f).exists():
                missing.append(prefix + f)
    return missing


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
