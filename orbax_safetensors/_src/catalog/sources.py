"""Any checkpoint as a table of tensors that reads a batch at a time (:class:`TensorSource`:
:class:`TensorInfo` rows by dotted name, and ``read(names)`` giving host numpy arrays).
:func:`open_source` classifies a path once, descends from a root to a step and from a step to
its item, and opens the item with the one reader of its kind: :class:`SafetensorsSource` (a
``.safetensors`` file, this library's item, a Hugging Face directory), :class:`OrbaxSource`
or ``MsgpackSource`` (a legacy Flax msgpack file).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.catalog import listing as _listing
from orbax_safetensors._src.catalog.listing import SourceKind, TensorInfo
from orbax_safetensors._src.catalog.orbax_source import OrbaxSource
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import HeaderError, SafetensorsCheckpointError
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import router as _router

DEFAULT_BATCH_BYTES = 256 * 1024 * 1024  # host memory a tool reads at a time


class TensorSource(Protocol):
    """A readable set of tensors (one file, one checkpoint item, one Orbax item)."""

    path: epath.Path
    kind: SourceKind
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Host arrays of ``names`` (checksums verified where the files record them)."""
        ...


def open_source(
    path: epath.PathLike, *, step: int | None = None, item: str | None = None, latest: bool = False
) -> TensorSource:
    """Opens the tensors ``path`` names: a ``.safetensors`` or Flax msgpack file, a checkpoint
    item, a directory of safetensors files, an Orbax-native item, or a step's item of tensors
    (``item``: which, where it has several); a CheckpointManager root's committed ``step``, or
    with ``latest`` its latest one. Every file the checkpoint names is checked to lie inside
    it; a local FIFO or other special file is never opened.

    Raises:
      SafetensorsCheckpointError: no tensors there; a step of several items without ``item``;
        a root without ``step`` or ``latest``; a ``step`` or ``item`` it does not have.
      FileNotFoundError: ``path`` does not exist.
    """
    path, kind = _resolve(epath.Path(path), step, item, latest)
    return _READERS[kind](path)


def open_items(path: epath.PathLike) -> dict[str, TensorSource]:
    """The tables of every item of tensors ``path`` names: a step directory's by item name,
    anything else as ``{"": open_source(path)}``.
    """
    path = epath.Path(path)
    if _steps.classify(path) is not PathKind.STEP:
        return {"": open_source(path)}
    _completeness.refuse_incomplete(path)  # (as open_source does)
    items = {n: k for n, k in _steps.list_items(path).items() if k in _steps.TENSOR_KINDS}
    if not items:
        raise _steps.not_a_checkpoint(path)
    return {name: _READERS[kind](path / name) for name, kind in items.items()}


def _resolve(
    path: epath.Path, step: int | None, item: str | None, latest: bool
) -> tuple[epath.Path, PathKind]:
    # The item of tensors ``path`` names, and its kind (see open_source): the path classified
    # once, then a root's step and a step's item taken from Orbax's own listings.
    kind = _steps.classify(path)
    if kind is PathKind.ROOT and (latest or step is not None):
        steps = dict(_steps.list_steps(path))
        if not steps:
            raise SafetensorsCheckpointError(
                f"{path}: a CheckpointManager root with no committed step"
            )
        if step is not None and step not in steps:
            raise SafetensorsCheckpointError(
                f"{path}: no committed step {step} (steps: {', '.join(map(str, sorted(steps)))})"
            )
        path = steps[max(steps) if step is None else step]
        kind = _steps.classify(path)
    elif step is not None:
        raise SafetensorsCheckpointError(
            f"{path} is {kind.noun}, not a CheckpointManager root: step= does not apply"
        )
    if kind is PathKind.ROOT:
        if item is not None:
            raise SafetensorsCheckpointError(
                f"{path} is {kind.noun}, not a step: item= does not apply"
            )
        listed = ", ".join(str(s) for s, _ in _steps.list_steps(path)[-5:]) or "none committed"
        raise SafetensorsCheckpointError(
            f"{path}: a CheckpointManager root (steps: {listed}); name one step or item directory"
        )
    # An incomplete step is refused first (a step Orbax lists with parts gone is no checkpoint).
    _completeness.refuse_incomplete(path)
    if kind is not PathKind.STEP:
        if item is not None:
            raise SafetensorsCheckpointError(
                f"{path} is {kind.noun}, not a step: item= does not apply"
            )
        if kind not in _steps.TENSOR_KINDS:
            raise _steps.not_a_checkpoint(path)
        return path, kind
    items = _steps.list_items(path)
    tensors = [n for n, k in items.items() if k in _steps.TENSOR_KINDS]
    if item is not None and item not in tensors:
        raise SafetensorsCheckpointError(
            f"{path}: no tensor item {item!r} (items: {', '.join(items) or '-'})"
        )
    if item is None and not tensors:
        raise _steps.not_a_checkpoint(path)
    if item is None and len(tensors) > 1:
        raise SafetensorsCheckpointError(
            f"{path}: a step with {len(tensors)} items of tensors ({', '.join(tensors)}); "
            "name one item directory"
        )
    name = tensors[0] if item is None else item
    return path / name, items[name]


class SafetensorsSource:
    """Tensors in safetensors files (one file, one of our items, or an HF directory);
    ``stored``: where each one's bytes lie, with its checksum where recorded; ``origins``:
    each cast tensor's dtype before the cast; ``aliases``: the other names of a tied tensor
    (``{alias: tensor}``, as the schema records them)."""

    def __init__(
        self,
        path: epath.Path,
        kind: SourceKind,
        stored: Mapping[str, _read.StoredTensor],
        metadata: dict[str, Any],
        origins: Mapping[str, str] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self.kind = kind
        self.stored = dict(stored)
        self.metadata = metadata
        self.aliases = {a: t for a, t in (aliases or {}).items() if t in self.stored}
        base = path if path.is_dir() else path.parent
        origins = origins or {}
        self.tensors = {
            name: TensorInfo(
                name, s.dtype, tuple(s.shape), s.nbytes, _relative(s.path, base), origins.get(name)
            )
            for name, s in self.stored.items()
        }

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        requests = [_read.ReadRequest(self.stored[n], kind=_read.ReadKind.NUMPY) for n in names]
        return dict(zip(names, _read.read_tensors(requests)))


def _relative(path: epath.Path, base: epath.Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return path.name


def _open_file(path: epath.Path) -> TensorSource:
    # A Flax msgpack file, else a .safetensors file; a file of a checkpoint item is read
    # against the checksums its item records.
    if _flax_msgpack.is_flax_msgpack(path):
        return _flax_msgpack.MsgpackSource(path)
    header = _router.read_header(path)
    _, stored = _read.file_index(path, header, strict=False, directory_checksums=True)
    user, origins, aliases = _listing.header_facts(header, str(path))
    return SafetensorsSource(path, SourceKind.FILE, stored, user, origins, aliases)


def _open_item(path: epath.Path) -> SafetensorsSource:
    meta = _read.read_metadata(path)
    stored = _read.locate_in_directory(path, meta)
    user = dict(meta.get("metadata") or {})
    origins, aliases = _listing.schema_facts(meta.get("schema"))
    return SafetensorsSource(path, SourceKind.ITEM, stored, user, origins, aliases)


def _open_safetensors_dir(path: epath.Path) -> SafetensorsSource:
    # The files the Hugging Face index lists (each tensor in the file it names), else every
    # ``*.safetensors`` file; each with the checksums it records, if any.
    index = read_index(path)
    if index is None:
        where, weight_map, metadata = path, None, {}
        names = [p.name for p in _steps.safetensors_files(path)]
    else:
        where, doc = index
        for name in set(doc["weight_map"].values()):  # as written: a URL or "/..." refused
            _confine.inside(path, name, where=where)
        # (one shard may be named two ways, "./a.safetensors" and "a.safetensors", as
        # transformers reads them: compared and opened by one normal name)
        weight_map = {k: posixpath.normpath(v) for k, v in doc["weight_map"].items()}
        metadata = {"index": doc.get("metadata", {})}
        names = sorted(set(weight_map.values()))
    files = {name: _confine.inside(path, name, where=where) for name in names}
    stored: dict[str, _read.StoredTensor] = {}
    for filename, file in files.items():
        header = _router.read_header(file)
        metadata.setdefault("format", header.metadata.get("format"))
        _, in_file = _read.file_index(file, header, strict=False)
        for name, st in in_file.items():
            if name in stored:
                raise HeaderError(
                    f"{path}: tensor {name!r} appears in both {stored[name].path.name} and {filename}"
                )
            if weight_map is not None and weight_map.get(name) != filename:
                raise HeaderError(
                    f"{file}: holds tensor {name!r}, which the index places in "
                    f"{weight_map.get(name)!r}"
                )
            stored[name] = st
    lost = sorted(set(weight_map or ()) - set(stored))
    if lost:
        raise HeaderError(f"{where}: lists tensors found in no file: {lost[:10]}")
    return SafetensorsSource(path, SourceKind.SAFETENSORS_DIR, stored, metadata)


def read_index(path: epath.Path) -> tuple[epath.Path, dict[str, Any]] | None:
    """The Hugging Face index of the directory ``path`` (its path and document, its
    ``weight_map`` a dict of file names), or None; ``HeaderError`` when it is malformed."""
    if not (path / _plan.INDEX_FILE_NAME).exists():
        return None
    index = _confine.inside(path, _plan.INDEX_FILE_NAME)
    raw = _confine.read_file(index)  # (outside the try: its errors are not the index's)
    try:
        doc = json.loads(raw)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        for file in weight_map.values():
            if not isinstance(file, str):
                raise TypeError(f"a file name {file!r} is not a string")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise HeaderError(f"{index}: not a valid index file ({type(e).__name__}: {e})") from None
    return index, doc


# The one reader of each kind of item (what ``_resolve`` gives).
_READERS: dict[PathKind, Callable[[epath.Path], TensorSource]] = {
    PathKind.FILE: _open_file,
    PathKind.ITEM: _open_item,
    PathKind.SAFETENSORS_DIR: _open_safetensors_dir,
    PathKind.ORBAX: OrbaxSource,
}
