"""Looking inside checkpoints: what a path is, which tensors it holds, and reading them.

Every tool (``inspect``, ``diff``, ``convert``, the Hugging Face loader) sees a checkpoint as a
:class:`TensorSource`: a table of :class:`TensorInfo` by dotted name plus ``read(names)``, which
returns host numpy arrays, a batch at a time, so no tool needs the whole checkpoint in memory.

What a path can be (:func:`classify`):

- ``file``: one ``.safetensors`` file (written by this library, PyTorch, anyone);
- ``item``: a checkpoint directory of this library (it has ``orbax_safetensors.json``);
- ``safetensors-dir``: plain safetensors files in a directory, Hugging Face style
  (``model.safetensors`` or shards listed in ``model.safetensors.index.json``);
- ``orbax``: an Orbax-native PyTree item (``StandardSave``/``PyTreeSave``, OCDBT or not);
- ``step``: a directory of items (one CheckpointManager step);
- ``root``: a directory of steps (a CheckpointManager root).

Example::

    source = open_source("/ckpt/100/state")
    source.tensors["params.w"].shape        # (512, 512)
    arrays = source.read(["params.w"])      # {"params.w": np.ndarray}
    report = inspect_path("/ckpt")          # JSON-able dict: the steps and their sizes
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import HeaderError, SafetensorsCheckpointError
from orbax_safetensors._src.pipeline import reader as _reader
from orbax_safetensors._src.storage import router as _router

ORBAX_METADATA_FILE = "_METADATA"
CHECKPOINT_METADATA_FILE = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS_FILE = "commit_success.txt"  # Orbax's commit marker (atomicity_types.py L31)
HANDLER_TYPESTR = "orbax_safetensors.SafetensorsCheckpointHandler"  # _handler.TYPESTR (no jax)
TENSOR_KINDS = ("file", "item", "safetensors-dir", "orbax")
_STEP_NAME = re.compile(r"^(?:.*?[_-])?(\d+)$")
_TMP_MARKER = ".orbax-checkpoint-tmp"
_TMP_STEP_NAME = re.compile(r"^(?:.*?[_-])?(\d+)\.orbax-checkpoint-tmp")  # step.py L50
_COMMIT_FILE_SCHEMES = ("gs://", "s3://")
_LEGACY_COMMIT_FILE_SCHEMES = ("gs://",)  # orbax-checkpoint < 0.12.3 (see scan_steps)
# What a damaged or half-deleted checkpoint may raise while being read (Orbax's readers raise
# ValueError subclasses too).
_UNREADABLE = (ValueError, OSError, EOFError)
_TMP_REASON = "temporary directory of a save that never finished (Orbax renames it on commit)"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: dotted name, safetensors dtype, shape, size and file (relative)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.nbytes,
            "file": self.file,
        }


class TensorSource(Protocol):
    """A readable set of tensors (one file, one checkpoint item, one Orbax item)."""

    path: epath.Path
    kind: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Host arrays of ``names`` (checksums verified where the files record them)."""
        ...


# --------------------------------------------------------------------------- classification


def absolute(path: epath.PathLike) -> epath.Path:
    """``path`` made absolute when it is a relative local path (Orbax refuses those)."""
    path = epath.Path(path)
    if "://" in str(path) or path.is_absolute():
        return path
    return epath.Path(os.path.abspath(os.fspath(path)))


def _is_orbax_item(path: epath.Path) -> bool:
    return (path / ORBAX_METADATA_FILE).exists()


def _safetensors_files(path: epath.Path) -> list[epath.Path]:
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("."))


def classify(path: epath.PathLike) -> str:
    """What ``path`` is: one of ``file``, ``item``, ``safetensors-dir``, ``orbax``, ``step``,
    ``root``, or ``other``.

    Raises:
      FileNotFoundError: when ``path`` does not exist.
    """
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        return "file"
    if (path / _metadata.METADATA_FILE).exists():
        return "item"
    if _is_orbax_item(path):
        return "orbax"
    if (path / _plan.INDEX_FILE_NAME).exists() or _safetensors_files(path):
        return "safetensors-dir"
    children = [c for c in path.iterdir() if c.is_dir() and _TMP_MARKER not in c.name]
    kinds = {c.name: _shallow_kind(c) for c in children}
    if any(k in TENSOR_KINDS for k in kinds.values()):
        return "step"
    if (path / CHECKPOINT_METADATA_FILE).exists():
        return "step"  # a step whose items hold no tensors (e.g. JSON only)
    if any(True for _ in _step_candidates(path)):
        return "root"
    return "other"


def _shallow_kind(path: epath.Path) -> str:
    if (path / _metadata.METADATA_FILE).exists():
        return "item"
    if _is_orbax_item(path):
        return "orbax"
    if (path / _plan.INDEX_FILE_NAME).exists() or _safetensors_files(path):
        return "safetensors-dir"
    return "other"


def list_items(step: epath.PathLike) -> dict[str, str]:
    """The items of a step directory by name, with their kind (``other`` for non-tensor items
    such as Orbax JSON items)."""
    step = epath.Path(step)
    out = {}
    for c in sorted(step.iterdir(), key=lambda p: p.name):
        if c.is_dir() and _TMP_MARKER not in c.name:
            out[c.name] = _shallow_kind(c)
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
        if _TMP_MARKER in child.name:
            tmp = _TMP_STEP_NAME.match(child.name)
            if tmp and child.is_dir():
                yield child, int(tmp.group(1))
            continue
        m = _STEP_NAME.match(child.name)
        if m and child.is_dir() and _looks_like_step(child):
            yield child, int(m.group(1))


def _looks_like_step(path: epath.Path) -> bool:
    """Whether a step-named directory holds a step (or is an item itself), not something else."""
    if _shallow_kind(path) != "other":
        return True
    if (path / CHECKPOINT_METADATA_FILE).exists() or (path / COMMIT_SUCCESS_FILE).exists():
        return True
    return any(g.is_dir() and _shallow_kind(g) != "other" for g in path.iterdir())


def uncommitted_reason(path: epath.PathLike) -> str | None:
    """Why Orbax does not count the directory ``path`` as a committed step; None when it does,
    or when ``path`` is not recognisably a step Orbax saved (no ``_CHECKPOINT_METADATA``, not a
    temporary directory). The rule is the comment above :class:`StepDir`.
    """
    path = epath.Path(path)
    if _TMP_MARKER not in path.name and not (path / CHECKPOINT_METADATA_FILE).exists():
        return None
    return _uncommitted(path)


def _uncommitted(step: epath.Path) -> str | None:
    """:func:`uncommitted_reason` of a directory known to be a step."""
    if _TMP_MARKER in step.name:
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
            if not _is_plain_name(name):
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
            if _is_plain_name(f) and not (item / f).exists():
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
        name = child.name.split(_TMP_MARKER, 1)[0]
        unfinished = name != child.name and _is_plain_name(name) and child.is_dir()
        if unfinished and not (step / name).is_dir():
            names.append(f"{name}/")
    return names


def _is_plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _read_json(path: epath.Path) -> Any:
    """The JSON document at ``path``; None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
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


# --------------------------------------------------------------------------- safetensors sources


class SafetensorsSource:
    """Tensors stored in safetensors files: one file, one of our items, or an HF directory."""

    def __init__(
        self, path: epath.Path, kind: str, stored: Mapping[str, Any], metadata: dict[str, Any]
    ) -> None:
        self.path = path
        self.kind = kind
        self.stored = dict(stored)  # name -> _reader.StoredTensor
        self.metadata = metadata
        base = path if path.is_dir() else path.parent
        self.tensors = {
            name: TensorInfo(name, s.dtype, tuple(s.shape), s.nbytes, _relative(s.path, base))
            for name, s in self.stored.items()
        }

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        requests = [_reader.ReadRequest(self.stored[n], kind="numpy") for n in names]
        return dict(zip(names, _reader.read_tensors(requests)))


def _relative(path: epath.Path, base: epath.Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return path.name


def _open_file(path: epath.Path) -> SafetensorsSource:
    from orbax_safetensors._src.pipeline import standalone as _standalone

    header = _router.read_header(path)
    _, stored = _standalone.file_index(path, header, strict=False)
    user = {k: v for k, v in header.metadata.items() if k not in _metadata.RESERVED_KEYS}
    return SafetensorsSource(path, "file", stored, user)


def _open_item(path: epath.Path) -> SafetensorsSource:
    from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore

    meta = _checkpoint_restore.read_metadata(path)
    stored = _checkpoint_restore.locate_in_directory(path, meta)
    return SafetensorsSource(path, "item", stored, dict(meta.get("metadata") or {}))


def safetensors_dir_files(path: epath.Path) -> list[str]:
    """The files of a plain safetensors directory: those listed by the HF index, else every
    ``*.safetensors`` file."""
    index = path / _plan.INDEX_FILE_NAME
    if index.exists():
        try:
            doc = json.loads(index.read_text())
            weight_map = doc["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HeaderError(f"{index}: not a valid index file ({e})") from None
        for f in files:
            if not isinstance(f, str) or "/" in f or f.startswith("."):
                raise HeaderError(f"{index}: invalid file name {f!r}")
        return files
    return [p.name for p in _safetensors_files(path)]


def _open_safetensors_dir(path: epath.Path) -> SafetensorsSource:
    from orbax_safetensors._src.pipeline import standalone as _standalone

    stored: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    weight_map: dict[str, str] | None = None
    index = path / _plan.INDEX_FILE_NAME
    if index.exists():
        doc = json.loads(index.read_text())
        weight_map = doc["weight_map"]
        metadata = {"index": doc.get("metadata", {})}
    for filename in safetensors_dir_files(path):
        header = _router.read_header(path / filename)
        metadata.setdefault("format", header.metadata.get("format"))
        for name, st in _standalone.locate_in_file(path / filename, header, None).items():
            if name in stored:
                raise HeaderError(
                    f"{path}: tensor {name!r} appears in both {stored[name].path.name} and {filename}"
                )
            if weight_map is not None and weight_map.get(name) != filename:
                raise HeaderError(
                    f"{path / filename}: holds tensor {name!r}, which the index places in "
                    f"{weight_map.get(name)!r}"
                )
            stored[name] = st
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(stored))
        if lost:
            raise HeaderError(f"{index}: lists tensors found in no file: {lost[:10]}")
    return SafetensorsSource(path, "safetensors-dir", stored, metadata)


# --------------------------------------------------------------------------- Orbax-native sources


class OrbaxSource:
    """An Orbax-native PyTree item (``StandardSave``/``PyTreeSave``), read through Orbax.

    Tensors carry the dotted names of Orbax's own tree (dict keys and list indices joined by
    ``.``); Python scalars and strings are not tensors. ``read`` restores only the requested
    leaves (Orbax's ``partial_restore``), as host arrays.
    """

    def __init__(self, path: epath.Path) -> None:
        import jax

        self.path = path = absolute(path)
        self.kind = "orbax"
        self.tree = orbax_metadata_tree(path)
        flat, _ = jax.tree_util.tree_flatten_with_path(self.tree)
        names = _tree.assign_names([tuple(p) for p, _ in flat])
        self.leaves: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self.tensors = {}
        for name, (keypath, leaf) in zip(names, flat):
            self.leaves[name] = (tuple(keypath), leaf)
            if is_orbax_array(leaf):
                shape = tuple(int(d) for d in leaf.shape)
                dtype = _dtypes.from_numpy(np.dtype(leaf.dtype), key=name)
                self.tensors[name] = TensorInfo(
                    name, dtype, shape, _dtypes.nbytes(dtype, shape), "(orbax)"
                )
        self.metadata: dict[str, Any] = {}

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        import jax

        values = self.restore(names)
        return {
            n: np.asarray(jax.random.key_data(v) if _tree.is_prng_key(v) else v)
            for n, v in values.items()
        }

    def restore(self, names: Sequence[str], *, as_jax: bool = False) -> dict[str, Any]:
        """The leaves ``names`` as Orbax restores them (scalars, strings, arrays).

        With ``as_jax``, arrays saved as ``jax.Array`` come back as single-device jax arrays
        (typed PRNG keys keep their type); otherwise every array is a host numpy array.
        """
        import jax
        import orbax.checkpoint as ocp

        if not names:
            return {}
        wanted = set(names)
        device = jax.devices()[0]

        def restore_args(leaf: Any) -> Any:
            if is_orbax_array(leaf) and (not as_jax or leaf.sharding is None):
                return ocp.RestoreArgs(restore_type=np.ndarray)
            if is_orbax_array(leaf):
                return ocp.ArrayRestoreArgs(
                    sharding=jax.sharding.SingleDeviceSharding(device),
                    global_shape=tuple(leaf.shape),
                )
            return ocp.RestoreArgs()

        item = _select(self.tree, wanted, self.name_of_path(), lambda leaf: 0)
        args = _select(self.tree, wanted, self.name_of_path(), restore_args)
        restored = ocp.PyTreeCheckpointer().restore(
            self.path,
            args=_orbaxcompat.pytree_partial_restore(item, args),
        )
        out = {}
        flat, _ = jax.tree_util.tree_flatten_with_path(restored)
        by_path = {tuple(p): v for p, v in flat}
        for name in names:
            keypath, _ = self.leaves[name]
            out[name] = by_path[keypath]
        return out

    def name_of_path(self) -> dict[tuple[Any, ...], str]:
        """Each leaf's key path in ``self.tree`` mapped to its tensor name."""
        return {keypath: name for name, (keypath, _) in self.leaves.items()}


def orbax_metadata_tree(path: epath.PathLike) -> Any:
    """Orbax's metadata tree of a native PyTree item (``ArrayMetadata``/``ScalarMetadata``...)."""
    import orbax.checkpoint as ocp

    problem = (
        f"{path}: Orbax cannot read this item's metadata ({ORBAX_METADATA_FILE} is missing "
        "or damaged)"
    )
    try:
        meta = ocp.PyTreeCheckpointer().metadata(absolute(path))
    except (ValueError, TypeError, KeyError) as error:  # orbax < 0.12 raises on bad JSON
        raise SafetensorsCheckpointError(f"{problem}: {error}") from error
    meta = getattr(meta, "item_metadata", meta)
    tree = getattr(meta, "tree", meta)
    if tree is None:
        raise SafetensorsCheckpointError(problem)
    return tree


def is_orbax_array(leaf: Any) -> bool:
    """Whether an Orbax metadata leaf describes an array (jax or numpy), not a scalar/string."""
    from orbax.checkpoint import metadata as ocp_metadata

    return isinstance(leaf, ocp_metadata.ArrayMetadata) and not isinstance(
        leaf, ocp_metadata.ScalarMetadata
    )


def _select(tree: Any, wanted: set[str], names: Mapping[tuple[Any, ...], str], fn: Any) -> Any:
    """A copy of ``tree`` keeping only the leaves named in ``wanted`` (mapped through ``fn``):
    dicts drop other keys, lists keep their length with None in unwanted places."""
    from jax.tree_util import DictKey, SequenceKey

    def walk(node: Any, path: tuple[Any, ...]) -> tuple[bool, Any]:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                keep, sub = walk(v, (*path, DictKey(k)))
                if keep:
                    out[k] = sub
            return bool(out), out
        if isinstance(node, (list, tuple)):
            items = [walk(v, (*path, SequenceKey(i))) for i, v in enumerate(node)]
            seq = [sub if keep else None for keep, sub in items]
            return any(keep for keep, _ in items), type(node)(seq)
        if node is None:
            return False, None
        name = names.get(path)
        return (name in wanted), (fn(node) if name in wanted else None)

    return walk(tree, ())[1]


# --------------------------------------------------------------------------- opening


def open_source(path: epath.PathLike) -> TensorSource:
    """Opens a file, item, safetensors directory or Orbax item as a :class:`TensorSource`.

    A step with exactly one tensor item opens that item.

    Raises:
      SafetensorsCheckpointError: when ``path`` holds no tensors or several items.
    """
    path = epath.Path(path)
    kind = classify(path)
    if kind == "step":
        items = [n for n, k in list_items(path).items() if k in TENSOR_KINDS]
        if len(items) != 1:
            raise SafetensorsCheckpointError(
                f"{path} is a step with {len(items)} tensor items ({', '.join(items)}); "
                "name one item directory"
            )
        path, kind = path / items[0], _shallow_kind(path / items[0])
    if kind == "file":
        return _open_file(path)
    if kind == "item":
        return _open_item(path)
    if kind == "safetensors-dir":
        return _open_safetensors_dir(path)
    if kind == "orbax":
        return OrbaxSource(path)
    raise SafetensorsCheckpointError(
        f"{path} is a {kind}, not a safetensors file, checkpoint item or Orbax item"
    )


def batches(
    infos: Sequence[TensorInfo], max_bytes: int = 256 * 1024 * 1024
) -> list[list[TensorInfo]]:
    """Groups tensors into batches of at most ``max_bytes`` (a larger tensor goes alone)."""
    out: list[list[TensorInfo]] = []
    used = 0
    for t in infos:
        if not out or (out[-1] and used + t.nbytes > max_bytes):
            out.append([])
            used = 0
        out[-1].append(t)
        used += t.nbytes
    return out


# --------------------------------------------------------------------------- inspection


def _file_size(path: epath.Path) -> int:
    st = path.stat()
    return int(getattr(st, "st_size", getattr(st, "length", 0)))


def _disk_bytes(path: epath.Path) -> int:
    if not path.is_dir():
        return _file_size(path)
    return sum(_disk_bytes(p) for p in path.iterdir())


def _source_report(source: TensorSource) -> dict[str, Any]:
    tensors = list(source.tensors.values())
    return {
        "path": str(source.path),
        "kind": source.kind,
        "num_tensors": len(tensors),
        "total_bytes": sum(t.nbytes for t in tensors),
        "metadata": source.metadata,
        "tensors": [t.to_json() for t in tensors],
    }


def _step_report(path: epath.Path) -> dict[str, Any]:
    items: dict[str, Any] = {}
    other: list[str] = []
    for name, kind in list_items(path).items():
        if kind in TENSOR_KINDS:
            items[name] = _source_report(open_source(path / name))
        else:
            other.append(name)
    return {
        "path": str(path),
        "kind": "step",
        "items": items,
        "other_items": other,
        "num_tensors": sum(i["num_tensors"] for i in items.values()),
        "total_bytes": sum(i["total_bytes"] for i in items.values()),
    }


def _root_step(step: StepDir) -> dict[str, Any]:
    """One committed step of a root report; an incomplete or unreadable step says so."""
    entry: dict[str, Any] = {
        "step": step.step,
        "name": step.path.name,
        "path": str(step.path),
        "items": list(list_items(step.path)),
        "num_tensors": None,
        "tensor_bytes": None,
        "disk_bytes": _disk_bytes(step.path),
        "status": "ok",
        "problem": None,
        "missing": [],
    }
    missing = missing_entries(step.path)
    if missing:
        entry["status"] = "incomplete"
        entry["problem"] = f"missing {', '.join(missing)}"
        entry["missing"] = missing
        return entry
    try:
        if _shallow_kind(step.path) in TENSOR_KINDS:  # a step that is itself an item
            rep = _source_report(open_source(step.path))
            entry["items"] = [""]
        else:
            rep = _step_report(step.path)
            entry["items"] = [*rep["items"], *rep["other_items"]]
    except _UNREADABLE as e:
        entry["status"] = "unreadable"
        entry["problem"] = str(e)
        return entry
    entry["num_tensors"] = rep["num_tensors"]
    entry["tensor_bytes"] = rep["total_bytes"]
    return entry


def _root_report(path: epath.Path) -> dict[str, Any]:
    scanned = scan_steps(path)
    steps = [_root_step(s) for s in scanned if s.committed]
    latest = steps[-1]["step"] if steps else None
    warnings = []
    for s in steps:
        if s["status"] == "incomplete":
            warnings.append(incomplete_warning(s["step"], s["path"], s["missing"], latest))
        elif s["status"] == "unreadable":
            warnings.append(f"step {s['step']} cannot be read: {s['problem']}")
    return {
        "path": str(path),
        "kind": "root",
        "steps": steps,  # the steps mngr.all_steps() lists
        "latest_step": latest,
        "uncommitted": [
            {"step": s.step, "name": s.path.name, "path": str(s.path), "reason": s.reason}
            for s in scanned
            if not s.committed
        ],
        "warnings": warnings,
    }


def inspect_path(path: epath.PathLike) -> dict[str, Any]:
    """A JSON-able description of ``path`` (see the module docstring for the kinds).

    For a root: the committed steps (those ``mngr.all_steps()`` lists) with their items, tensor
    counts, tensor bytes and bytes on disk, each with a ``status`` (``ok``; ``incomplete`` when
    entries are missing, ``unreadable`` when a file is damaged, both with a ``problem``), the
    uncommitted step directories (``uncommitted``, with the reason) and ``warnings``.
    Otherwise every tensor's name, dtype, shape, bytes and file, with totals.

    Example::

        report = inspect_path("/ckpt")
        [s["step"] for s in report["steps"]]     # [100, 200]
    """
    path = epath.Path(path)
    kind = classify(path)
    if kind == "root":
        return _root_report(path)
    if kind == "step":
        reason = uncommitted_reason(path)
        try:
            report = _step_report(path)
        except _UNREADABLE as e:
            if reason is None:
                raise
            raise SafetensorsCheckpointError(f"{path}: uncommitted step ({reason}): {e}") from e
        if reason is not None:
            report["uncommitted"] = reason
        return report
    if kind == "other":
        raise SafetensorsCheckpointError(
            f"{path}: not a safetensors file, checkpoint item, Orbax item, step or root"
        )
    return _source_report(open_source(path))


# --------------------------------------------------------------------------- text output


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return [fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _tensor_lines(report: Mapping[str, Any], prefix: str = "") -> list[str]:
    rows = [
        [
            t["name"],
            t["dtype"],
            "("
            + ", ".join(str(d) for d in t["shape"])
            + ("," if len(t["shape"]) == 1 else "")
            + ")",
            str(t["bytes"]),
            prefix + t["file"],
        ]
        for t in report["tensors"]
    ]
    return _table(["name", "dtype", "shape", "bytes", "file"], rows, right={3})


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable table for a report from :func:`inspect_path`."""
    lines: list[str] = []
    kind = report["kind"]
    if kind == "root":
        lines.append(f"{report['path']}: CheckpointManager root, {len(report['steps'])} step(s)")
        headers = ["step", "items", "tensors", "tensor bytes", "on disk"]
        flagged = any(s["status"] != "ok" for s in report["steps"])
        rows = []
        for s in report["steps"]:
            row = [
                str(s["step"]),
                ",".join(s["items"]) or "-",
                "-" if s["num_tensors"] is None else str(s["num_tensors"]),
                "-" if s["tensor_bytes"] is None else str(s["tensor_bytes"]),
                human_bytes(s["disk_bytes"]),
            ]
            rows.append([*row, s["status"].upper()] if flagged else row)
        lines += _table([*headers, "status"] if flagged else headers, rows, {0, 2, 3, 4})
        if report["steps"]:
            lines.append(f"latest step: {report['latest_step']}")
        for u in report["uncommitted"]:
            lines.append(f"uncommitted (not listed by Orbax): {u['name']}: {u['reason']}")
        lines += [f"warning: {w}" for w in report["warnings"]]
        return "\n".join(lines)
    if kind == "step":
        if report.get("uncommitted"):
            lines.append(
                f"warning: uncommitted step, Orbax does not list it: {report['uncommitted']}"
            )
        lines.append(
            f"{report['path']}: step with item(s) {', '.join(report['items']) or '-'}"
            + (
                f"; other items: {', '.join(report['other_items'])}"
                if report["other_items"]
                else ""
            )
        )
        for name, item in report["items"].items():
            lines.append("")
            lines.append(f"[{name}] {item['kind']}")
            lines += _tensor_lines(item, prefix=f"{name}/")
        lines.append("")
        lines.append(_total_line(report))
        return "\n".join(lines)
    lines.append(f"{report['path']}: {kind}")
    meta = report.get("metadata") or {}
    if meta:
        lines.append("metadata: " + json.dumps(meta, sort_keys=True)[:400])
    lines += _tensor_lines(report)
    lines.append(_total_line(report))
    return "\n".join(lines)


def _total_line(report: Mapping[str, Any]) -> str:
    return (
        f"total: {report['num_tensors']} tensors, {report['total_bytes']} bytes "
        f"({human_bytes(report['total_bytes'])})"
    )


# --------------------------------------------------------------------------- diff


@dataclasses.dataclass
class DiffReport:
    """How two checkpoints differ, tensor by tensor.

    Attributes:
      only_a, only_b: tensor names present on one side only.
      mismatched: ``(name, a, b)`` where shape or dtype differ (``a``/``b`` read ``F32(4, 3)``),
        with the max abs difference appended when the shapes agree.
      values: ``(name, max_abs_difference)`` for tensors whose values differ.
      same: how many tensors are equal.
    """

    only_a: list[str] = dataclasses.field(default_factory=list)
    only_b: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    values: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched or self.values)

    def to_json(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": [{"name": n, "a": a, "b": b} for n, a, b in self.mismatched],
            "values": [{"name": n, "max_abs_diff": d} for n, d in self.values],
            "same": self.same,
        }

    def format(self) -> str:
        lines = []
        if self.only_a:
            lines.append(f"only in A ({len(self.only_a)}):")
            lines += [f"  {n}" for n in self.only_a]
        if self.only_b:
            lines.append(f"only in B ({len(self.only_b)}):")
            lines += [f"  {n}" for n in self.only_b]
        if self.mismatched:
            lines.append(f"shape or dtype differs ({len(self.mismatched)}):")
            lines += [f"  {n}: {a} vs {b}" for n, a, b in self.mismatched]
        if self.values:
            lines.append(f"values differ ({len(self.values)}):")
            lines += [f"  {n}: max abs difference {d:.6g}" for n, d in self.values]
        lines.append(
            f"{self.same} tensor(s) equal; "
            + ("checkpoints are identical" if self.identical else "checkpoints differ")
        )
        return "\n".join(lines)


def _sources_of(path: epath.Path) -> dict[str, TensorSource]:
    kind = classify(path)
    if kind == "step":
        items = [n for n, k in list_items(path).items() if k in TENSOR_KINDS]
        return {n: open_source(path / n) for n in items}
    return {"": open_source(path)}


def _dtype_shape(t: TensorInfo) -> str:
    return f"{t.dtype}{list(t.shape)}"


_CHUNK = 1 << 22


def max_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest ``|a - b|`` (0.0 for bitwise-equal arrays; NaN equals NaN; a NaN against a
    number, or infinities of opposite sign, give ``inf``)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.dtype == b.dtype:
        ra = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        rb = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        if np.array_equal(ra, rb):
            return 0.0
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, fa.size, _CHUNK):
        ca = _as_float(fa[start : start + _CHUNK])
        cb = _as_float(fb[start : start + _CHUNK])
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(ca - cb)
            d[(ca == cb) | (np.isnan(ca) & np.isnan(cb))] = 0.0
        d[np.isnan(d)] = np.inf
        if d.size:
            worst = max(worst, float(d.max()))
    return worst


def _as_float(x: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(x):
        return x.astype(np.complex128)
    if x.dtype == np.bool_:
        return x.astype(np.float64)
    return x.astype(np.float64)


def diff_paths(
    a: epath.PathLike, b: epath.PathLike, *, atol: float = 0.0, batch_bytes: int = 128 << 20
) -> DiffReport:
    """Compares the tensors of two checkpoints (files, items, Orbax items or steps).

    Steps are compared item by item (names read ``item/name``); a step with a single tensor
    item compares with a single item or file. Values are read a batch at a time.

    Example::

        report = diff_paths("run1/100/state", "run2/100/state")
        report.identical, report.values    # (False, [("params.w", 0.5)])
    """
    sa, sb = _sources_of(epath.Path(a)), _sources_of(epath.Path(b))
    if len(sa) == 1 and len(sb) == 1:
        pairs = [("", next(iter(sa.values())), next(iter(sb.values())))]
        only_items_a: list[str] = []
        only_items_b: list[str] = []
    else:
        pairs = [(f"{n}/", sa[n], sb[n]) for n in sa if n in sb]
        only_items_a = [n for n in sa if n not in sb]
        only_items_b = [n for n in sb if n not in sa]
    report = DiffReport()
    for n in only_items_a:
        report.only_a += [f"{n}/{t}" for t in sa[n].tensors]
    for n in only_items_b:
        report.only_b += [f"{n}/{t}" for t in sb[n].tensors]
    for prefix, x, y in pairs:
        report.only_a += [prefix + n for n in x.tensors if n not in y.tensors]
        report.only_b += [prefix + n for n in y.tensors if n not in x.tensors]
        common = [x.tensors[n] for n in x.tensors if n in y.tensors]
        comparable = []
        for t in common:
            u = y.tensors[t.name]
            if t.shape != u.shape:
                report.mismatched.append((prefix + t.name, _dtype_shape(t), _dtype_shape(u)))
            else:
                comparable.append(t)
        for group in batches(comparable, max_bytes=batch_bytes):
            names = [t.name for t in group]
            va, vb = x.read(names), y.read(names)
            for t in group:
                u = y.tensors[t.name]
                d = max_abs_difference(va[t.name], vb[t.name])
                if t.dtype != u.dtype:
                    report.mismatched.append(
                        (
                            prefix + t.name,
                            _dtype_shape(t),
                            f"{_dtype_shape(u)} (max abs difference {d:.6g})",
                        )
                    )
                elif d > atol:
                    report.values.append((prefix + t.name, d))
                else:
                    report.same += 1
            del va, vb
    return report
