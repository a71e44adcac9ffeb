"""``verify``: every header, schema, metadata file and CRC32C checksum of a checkpoint, checked
as a restore would check them, without building arrays (the bytes are streamed through CRC32C
a bounded chunk at a time). In a CheckpointManager root, exactly the steps Orbax lists are
checked; a committed step with parts missing is damage like any other.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    NotSafetensorsError,
    SafetensorsCheckpointError,
    SchemaError,
)
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline.place import wrap_key
from orbax_safetensors._src.pipeline.read import StoredTensor
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import router as _router
from orbax_safetensors._src.tools.inspection import counted

CHUNK_BYTES = 16 << 20
# What a damaged or hostile checkpoint may raise while being read: our errors (ValueError
# subclasses), and the OS's when a listed file is missing or unreadable.
_READ_ERRORS = (SafetensorsCheckpointError, OSError, EOFError)


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
      ok: True when no problem was found.
      problems: one line per problem, naming the file and, for bytes, the tensor.
      files: safetensors files whose headers were read and validated.
      tensors: tensors whose headers were validated (checksummed or not).
      bytes: tensor bytes read and checksummed.
      unverified: tensors without a recorded checksum (``file: tensor``), not a problem:
        plain safetensors files have none.
      skipped: uncommitted steps (and Orbax temporary directories), not examined.
      incomplete: committed steps with entries missing (each is also in ``problems``).
      warnings: what the problems probably mean (e.g. an old step half-deleted by a crash).

    Example::

        report = verify("/ckpt")
        if not report.ok:
            print("\n".join(report.problems))
    """

    ok: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    unverified: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    incomplete: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)
        self.ok = False

    def format(self, path: object) -> str:
        """The report ``orbax-safetensors verify`` prints for ``path``."""
        if self.ok:
            checked = (counted(self.files, "file"), counted(self.tensors, "tensor"))
            lines = [f"{path}: OK ({', '.join(checked)}, {counted(self.bytes, 'byte')} checked)"]
        else:
            lines = [f"{path}: DAMAGED ({counted(len(self.problems), 'problem')})"]
            lines += [f"  {problem}" for problem in self.problems]
        if self.unverified:
            has = "has" if len(self.unverified) == 1 else "have"
            lines.append(
                f"  {counted(len(self.unverified), 'tensor')} {has} no recorded checksum "
                "(headers checked only)"
            )
        lines += [f"  skipped uncommitted {skipped}" for skipped in self.skipped]
        lines += [f"  warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def verify(path: epath.PathLike, *, chunk_bytes: int = CHUNK_BYTES) -> VerifyReport:
    """Checks a ``.safetensors`` file, checkpoint item, step or CheckpointManager root.

    Every header, schema and metadata file is validated as a restore validates it, and every
    tensor's bytes are compared with their recorded CRC32C, ``chunk_bytes`` held in memory at
    a time; no array is built. A file of a checkpoint item is checked against that item's
    metadata. In a root, the steps Orbax lists are checked: uncommitted ones are skipped
    (``skipped``), and a committed step lacking what its restore needs is ``incomplete`` and
    a problem (a warning says when it is most likely an old step half-deleted by a kill). A
    step named directly is judged as its root judges it.

    Returns:
      A :class:`VerifyReport`; ``report.ok`` is False when anything is malformed, missing or
      does not match its checksum.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      NotSafetensorsError: ``path`` is no checkpoint this function checks (something else, an
        empty or other directory, another handler's item, an Orbax-native checkpoint, which
        records no checksums); the message says what it is and what to run.
      HeaderError: ``path`` is one ``.safetensors`` file whose header cannot be read (a damaged
        file of a checkpoint item is a problem of the report instead).

    Example::

        report = osf.verify("ckpt.safetensors")
        assert report.ok, report.problems
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    report = VerifyReport()
    checker = _Checker(report, chunk_bytes)
    entry = _steps.step_entry(path)
    if not path.is_dir():
        if (path.parent / _metadata.METADATA_FILE).exists():
            checker.item(path.parent, only=path.name)  # one file of a checkpoint directory
        else:
            checker.file(path, unreadable_raises=True)
    elif entry is not None and not entry.committed:
        report.skipped.append(str(path))
        report._problem(
            f"{path}: uncommitted step, not checked ({entry.reason}); Orbax does not list it"
        )
    elif (path / _metadata.METADATA_FILE).exists() and entry is None:
        checker.item(path)
    elif not (
        checker.step(path, depth=0, listed=entry)  # one step directory
        if entry is not None
        else checker.tree(path, depth=0)
    ):
        if not report.skipped:
            raise _unverifiable(path)
        # A root whose every step is uncommitted: ours, with no save that finished.
        report._problem(f"{path}: no committed step to check (all skipped as uncommitted)")
    report.ok = not report.problems
    return report


def _unverifiable(path: epath.Path) -> NotSafetensorsError:
    """The error for a directory holding nothing :func:`verify` checks: Orbax-native items (no
    checksums), or no checkpoint at all."""
    kind = _steps.classify(path)
    orbax = kind is PathKind.ORBAX or (
        kind is PathKind.STEP and PathKind.ORBAX in _steps.list_items(path).values()
    )
    found = _sniff.sniff_directory([c.name for c in path.iterdir()], str(path))
    if found is None or not found.kind.is_orbax or not (orbax or kind is PathKind.ROOT):
        return _steps.not_a_checkpoint(path)
    what = found.description
    if kind is PathKind.ORBAX:
        what = f"an Orbax item written by {_steps.item_handler(path) or 'another handler'}"
    return NotSafetensorsError(
        f"{path}: {what}, which verify cannot check: an Orbax-native checkpoint records no "
        f"checksums. {found.suggestion}",
        found,
    )


def _natural(p: epath.Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


class _Checker:
    def __init__(self, report: VerifyReport, chunk_bytes: int) -> None:
        self.report = report
        self.chunk_bytes = chunk_bytes
        self.missing: dict[epath.Path, list[str]] = {}  # incomplete steps: their missing entries

    # ----------------------------------------------------------------- walking

    def tree(self, path: epath.Path, depth: int) -> bool:
        """A root (depth 0: its committed steps checked as steps, uncommitted ones skipped) or
        a step directory: checks what it holds; False if nothing."""
        steps: dict[str, _steps.StepDir] = {}
        if depth == 0 and not (path / _steps.CHECKPOINT_METADATA_FILE).exists():
            steps = {s.path.name: s for s in _steps.scan_steps(path)}
        found = False
        for child in sorted(path.iterdir(), key=_natural):
            try:
                _confine.inside(path, child.name)
            except _READ_ERRORS as e:  # (a symbolic link out of the directory: not read)
                self.report._problem(str(e))
                found = True
                continue
            step = steps.get(child.name)
            if _steps.TMP_SUFFIX in child.name or (step is not None and not step.committed):
                self.report.skipped.append(str(child))
            elif step is not None:
                found = self.step(child, listed=step) or found
            elif child.is_dir():
                if (child / _metadata.METADATA_FILE).exists():
                    self.item(child)
                    found = True
                elif depth == 0:
                    found = self.tree(child, depth + 1) or found
            elif depth == 0 and child.name.endswith(".safetensors"):
                self.file(child)
                found = True
        committed = [s for s in steps.values() if s.committed]
        latest = max((s.step for s in committed), default=None)
        for s in sorted(committed, key=lambda s: s.step):
            if s.path in self.missing:
                self.report.warnings.append(
                    _completeness.incomplete_warning(s.step, s.path, self.missing[s.path], latest)
                )
        return found

    def step(self, path: epath.Path, depth: int = 1, listed: _steps.StepDir | None = None) -> bool:
        """A committed step (``listed``: its entry in its root): that no part is missing, then
        its items (or itself, an item). False if it holds nothing of ours."""
        missing = _completeness.missing_entries(listed or path)
        if missing:
            self.missing[path] = missing
            self.report.incomplete.append(str(path))
            self.report._problem(_completeness.incomplete_problem(path, missing))
            return True
        if (path / _metadata.METADATA_FILE).exists():
            self.item(path)
            return True
        return self.tree(path, depth=depth)

    # ----------------------------------------------------------------- one file

    def file(self, path: epath.Path, unreadable_raises: bool = False) -> None:
        """A standalone ``.safetensors`` file; with ``unreadable_raises`` (the file named on its
        own), an unreadable header raises instead of being a problem."""
        header = self._header(path, unreadable_raises)
        if header is None:
            return
        try:
            schema, stored = _read.file_index(path, header)
        except SafetensorsCheckpointError as e:
            self.report._problem(str(e))
            return
        if schema is not None:
            self._schema(schema, stored, str(path))
        self._stream(stored)

    def _header(self, path: epath.Path, unreadable_raises: bool = False) -> _header.Header | None:
        try:
            header = _router.read_header(path)
        except _READ_ERRORS as e:
            if unreadable_raises:
                raise
            self.report._problem(_message(e, path))
            return None
        self.report.files += 1
        self.report.tensors += len(header.tensors)
        return header

    # ----------------------------------------------------------------- one directory

    def item(self, directory: epath.Path, only: str | None = None) -> None:
        """A checkpoint item: metadata, every file's header, index, schema and bytes; with
        ``only``, that one file (on its own where the metadata does not list it)."""
        try:
            metadata = _read.read_metadata(directory)
        except _READ_ERRORS as e:
            self.report._problem(_message(e, directory))
            return
        if only is not None:
            if only not in metadata["files"]:
                return self.file(directory / only)
            tensors = metadata["tensors"]
            mine = {
                n: t for n, t in tensors.items() if isinstance(t, dict) and t.get("file") == only
            }
            metadata = {**metadata, "files": [only], "tensors": mine}
        headers: dict[str, _header.Header] = {}
        for filename in metadata["files"]:
            if not _metadata.is_plain_filename(filename):
                self.report._problem(f"{directory}: lists an invalid file name {filename!r}")
            elif (header := self._header(directory / filename)) is not None:
                headers[filename] = header
        try:
            stored = _read.locate_in_directory(directory, metadata, check_headers=True)
        except _READ_ERRORS as e:
            self.report._problem(_message(e, directory))
            return
        for filename, header in headers.items():
            for name in header.tensors:
                if stored.get(name) is None or stored[name].path.name != filename:
                    self.report._problem(
                        f"{directory / filename}: holds tensor {name!r}, which "
                        f"{_metadata.METADATA_FILE} does not place in this file"
                    )
        if only is None:
            self._index(directory, metadata)
            self._schema(metadata["schema"], stored, str(directory / _metadata.METADATA_FILE))
        self._stream(stored)

    def _index(self, directory: epath.Path, metadata: Mapping[str, Any]) -> None:
        try:
            index = _sources.read_index(directory)
        except _READ_ERRORS as e:
            self.report._problem(_message(e, directory / _plan.INDEX_FILE_NAME))
            return
        if index is None:
            return
        path, weight_map = index[0], index[1]["weight_map"]
        expected = {n: t.get("file") for n, t in metadata["tensors"].items() if isinstance(t, dict)}
        if weight_map != expected:
            wrong = sorted(
                set(expected).symmetric_difference(weight_map)
                | {n for n in expected if weight_map.get(n) != expected[n]}
            )
            self.report._problem(
                f"{path}: weight_map disagrees with {_metadata.METADATA_FILE} for tensors "
                f"{wrong[:10]!r}"
            )

    # ----------------------------------------------------------------- schema and bytes

    def _schema(self, schema: object, stored: Mapping[str, StoredTensor], where: str) -> None:
        """The checks a restore makes of the schema, without reading any tensor."""
        try:
            leaves = _tree.validate_schema(schema)
            for leaf in leaves.values():
                if leaf.kind in _schema.INLINE_KINDS:
                    continue
                tensor = stored.get(leaf.tensor_name)
                if tensor is None:
                    raise SchemaError(
                        f"schema leaf {leaf.name!r} refers to tensor {leaf.tensor_name!r}, "
                        "which no file holds"
                    )
                original = leaves.get(leaf.tensor_name, leaf).node
                if isinstance(original, _tree.PrngKey):
                    abstract = jax.ShapeDtypeStruct(tensor.shape, _dtypes.to_numpy(tensor.dtype))
                    impl = original.impl
                    jax.eval_shape(functools.partial(wrap_key, leaf.name, impl=impl), abstract)
        except SafetensorsCheckpointError as e:
            self.report._problem(f"{where}: {e}")

    def _stream(self, stored: Mapping[str, StoredTensor]) -> None:
        by_file: dict[epath.Path, list[StoredTensor]] = {}
        for t in stored.values():
            if t.crc32c is None:
                self.report.unverified.append(f"{t.path}: {t.name}")
            else:
                by_file.setdefault(t.path, []).append(t)
        for path, tensors in by_file.items():
            tensors.sort(key=lambda t: t.offset)
            size = min(self.chunk_bytes, max(t.nbytes for t in tensors))
            buf = _buffers.aligned_empty(max(size, 1))
            try:
                with _router.open_reader(path) as reader:
                    for t in tensors:
                        self._stream_one(reader, t, buf)
            except _READ_ERRORS as e:
                self.report._problem(_message(e, path))

    def _stream_one(self, reader: Any, t: StoredTensor, buf: Any) -> None:
        crc, done, total = 0, 0, t.nbytes
        try:
            while done < total:
                n = min(buf.nbytes, total - done)
                reader.read_runs([(t.offset + done, buf[:n])])
                crc = _checksum.crc32c(buf[:n], crc)
                done += n
        except _READ_ERRORS as e:
            self.report._problem(f"{t.path}: tensor {t.name!r}: unreadable ({e})")
            return
        self.report.bytes += total
        assert t.crc32c is not None
        if crc != t.crc32c:
            self.report._problem(
                f"{t.path}: tensor {t.name!r}: CRC32C mismatch (recorded "
                f"{_checksum.to_hex(t.crc32c)}, read {_checksum.to_hex(crc)}); the bytes are damaged"
            )


def _message(e: BaseException, where: epath.Path) -> str:
    text = str(e)
    return text if str(where) in text else f"{where}: {text}"


__all__ = ["VerifyReport", "verify"]
