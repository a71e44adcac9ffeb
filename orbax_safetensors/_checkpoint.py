"""Directory checkpoints: standard safetensors files + one JSON metadata file, written by one
process or by many at once. Orbax-free: the Orbax handler is thin glue over this module.

Layout of a checkpoint directory::

    model.safetensors                      # or model-00001-of-0000N.safetensors + ...
    model.safetensors.index.json           # only when split into several files (HF convention)
    orbax_safetensors.json                 # schema, versions, per-tensor dtype/shape/file,
                                           # saved sharding, CRC32C, user metadata

Saving happens in three steps so that Orbax (or any driver) can put them where it needs:
:func:`prepare_save` (every process; plans, and copies owned shards to host, now or as the
writer reaches each tensor), :func:`write_process_share` (every process; its own byte ranges,
plus headers and index on the primary; a small per-process checksum file, which a
single-process save keeps in memory instead) and :func:`finalize` (one process, after all
wrote; merges checksums into the metadata file).

Example::

    save_directory(state, "/tmp/ckpt")                 # all three steps, one process
    state = restore_directory("/tmp/ckpt", target=abstract_state)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors import _gcpause, _writer
from orbax_safetensors._reader import ReadStats, StoredTensor
from orbax_safetensors._restore import is_restore_args, restore_args_sharding, restore_tree
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import memo as _memo
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    DeletedArrayError,
    HeaderError,
    SchemaError,
    TargetMismatchError,
)
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import router as _router


class ValidatedTree:
    """A tree :func:`validate_save` accepted: captured (structure copied, leaves checked), and
    named (``flat``, each stored tensor's ``specs``) when first asked, on whatever thread asks.

    An async save copies ``captured.arrays`` in the call and leaves naming and planning to its
    writer thread; the specs come from the dtypes and shapes read at capture.
    """

    def __init__(self, captured: _tree.CapturedTree) -> None:
        self.captured = captured

    @functools.cached_property
    def flat(self) -> _tree.FlatTree:
        return self.captured.finish()

    @functools.cached_property
    def specs(self) -> list[_plan.TensorSpec]:
        c = self.captured
        return _plan.specs_of(zip(self.flat.arrays, c.dtypes, c.shapes))

    def header_bound(self) -> int:
        """:func:`_plan.header_bound` of the files this tree may be planned into."""
        c = self.captured
        return _plan.header_bound(
            sum(map(len, c.names)),
            len(c.names),
            max(map(len, c.shapes), default=0),
            _metadata.HEADER_METADATA,
        )


@_gcpause.paused
def validate_save(tree: Any, user_metadata: Mapping[str, Any] | None = None) -> ValidatedTree:
    """Checks that ``tree`` and ``user_metadata`` can be saved, before any I/O is scheduled.

    Pass the result to :func:`prepare_save` (``validated=``) to skip flattening again.

    Raises:
      UnsupportedLeafError: naming the first leaf (or dtype) that cannot be stored.
      DeletedArrayError (a ValueError): naming a ``jax.Array`` that has been deleted (donated).
      MetadataError (a TypeError): when ``user_metadata`` is not JSON-serialisable.
    """
    captured = _tree.capture(tree)
    _metadata.check_user_metadata(user_metadata)
    return ValidatedTree(captured)


def check_not_deleted(arrays: Iterable[tuple[str, Any]]) -> None:
    """Raises DeletedArrayError naming the first deleted (donated) ``jax.Array`` of ``(name,
    array)``."""
    for name, x in arrays:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise DeletedArrayError(_tree.deleted_message(name, x))


@dataclasses.dataclass
class PreparedSave:
    """Everything a process needs to write its bytes of the checkpoint.

    ``pieces`` yields ``(file index, pieces)`` one tensor at a time: a list whose host copies
    are complete, a generator that copies each tensor when the writer reaches it, or one that
    takes them from a :class:`SnapshotQueue` filled by another thread.
    """

    plan: _plan.CheckpointPlan
    pieces: Iterable[tuple[int, list[_interface.Piece]]]
    metadata: dict[str, Any]  # the metadata file's content, less checksums
    sizes: dict[str, int]
    is_primary: bool
    process_index: int
    checksums: bool


def prepare_save(
    tree: Any,
    *,
    user_metadata: Mapping[str, Any] | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    is_primary: bool = True,
    process_index: int = 0,
    copy: bool = True,
    lazy: bool = False,
    checksums: bool = True,
    validated: ValidatedTree | None = None,
    snapshot: Iterable[tuple[int, _writer.HostCopies]] | None = None,
) -> PreparedSave:
    """Flattens ``tree``, plans its files and copies this process's owned bytes to host.

    With ``copy=True`` (and not ``lazy``) the caller may donate or overwrite its arrays as soon
    as this returns. With ``lazy=True`` nothing is copied yet: ``pieces`` is a generator that
    takes each tensor's bytes when the writer reaches it, so the arrays must stay untouched
    until :func:`write_process_share` returns (a synchronous save; host memory about one tensor).
    ``validated`` is :func:`validate_save`'s result for ``tree``, to skip flattening again.

    ``snapshot`` (with ``validated``): this process's host copies, from
    :func:`_writer.iter_snapshots` over ``enumerate(validated.captured.arrays)`` (or a
    :class:`SnapshotQueue` it fills); ``pieces`` then writes them and never reads the arrays'
    data, which may be donated or deleted by now (an async save that copied before planning).
    """
    if validated is None:
        if snapshot is not None:
            raise ValueError("prepare_save(snapshot=...) needs the validated tree it copied")
        validated = ValidatedTree(_tree.capture(tree))
    flat, specs = validated.flat, validated.specs
    # Headers depend only on names, dtypes and shapes: identical on every process.
    plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata=_metadata.HEADER_METADATA)
    multi_process = jax.process_count() > 1
    # trees of many arrays share a few shardings
    described = _memo.ShardingMemo(_sharding.sharding_to_json)
    shardings = {}
    for s in specs:
        x = flat.arrays[s.name]
        # Host-local leaves (numpy; in a multi-process job also jax.Arrays held whole by
        # each process) have no global sharding to reuse.
        shardings[s.name] = (
            described(x.sharding)
            if not _writer.is_host_local(x, multi_process)
            and isinstance(x.sharding, jax.sharding.NamedSharding)  # else nothing to describe
            else None
        )
    metadata = _metadata.build_metadata(plan, specs, flat.schema, shardings, user_metadata or {})
    _metadata.check_user_metadata(user_metadata)  # fail early (before any I/O)
    pieces: Iterable[tuple[int, list[_interface.Piece]]]
    if snapshot is not None:
        names = list(flat.arrays)  # snapshots are keyed by position in captured.arrays
        pieces = (_writer.tensor_pieces(plan, names[i], copies) for i, copies in snapshot)
    else:
        check_not_deleted(flat.arrays.items())
        pieces = _writer.iter_host_pieces(
            plan, flat.arrays, copy=copy, is_primary=is_primary, copies_ahead=None if copy else 1
        )
        if not lazy:
            pieces = list(pieces)
    return PreparedSave(
        plan,
        pieces,
        metadata,
        {s.name: plan.locate(s.name)[1].nbytes for s in specs},
        is_primary,
        process_index,
        checksums,
    )


class SnapshotQueue:
    """Hands host snapshots ``(index, copies)`` (see :func:`_writer.iter_snapshots`) from the
    thread that copies them to the thread that plans and writes them, so that writing a large
    state starts before its last tensor is copied.

    Example::

        queue = SnapshotQueue()
        writer = threading.Thread(target=lambda: write_process_share(
            prepare_save(tree, validated=v, snapshot=queue), directory))
        writer.start()
        for item in _writer.iter_snapshots(enumerate(v.captured.arrays)):
            queue.put(item)
        queue.close()
    """

    _END = object()
    # Items are handed over in groups of up to this many bytes or items: waking the writer
    # thread for each of 10,000 small tensors cost more than copying them (GIL ping-pong).
    _GROUP_BYTES = 4 << 20
    _GROUP_ITEMS = 256
    # The first group, on which the writer plans (Python work per tensor), waits for 16 MiB
    # of at most 256 tensors, else for 64 MiB, else for the end: a state of large tensors
    # starts writing after a few milliseconds of copying, and a small state of many tensors is
    # planned after the copy loop rather than against it for the GIL. (At 256 MiB, starting
    # after 16 MiB rather than 64 MiB saved 10% of the save.)
    _FIRST_GROUP_BYTES = 16 << 20
    _FIRST_GROUP_MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._group: list[tuple[int, _writer.HostCopies]] = []
        self._group_bytes = 0
        self._first = True
        self._started = threading.Event()
        self._done = False

    def put(self, item: tuple[int, _writer.HostCopies]) -> None:
        self._group.append(item)
        copies = item[1]
        self._group_bytes += (
            copies[0][1].nbytes if len(copies) == 1 else sum(h.nbytes for _, h in copies)
        )
        size, count = self._group_bytes, len(self._group)
        if self._first:
            if size >= self._FIRST_GROUP_MAX_BYTES or (
                size >= self._FIRST_GROUP_BYTES and count <= self._GROUP_ITEMS
            ):
                self._first = False
                self._flush()
        elif size >= self._GROUP_BYTES or count >= self._GROUP_ITEMS:
            self._flush()

    def _flush(self) -> None:
        if self._group:
            self._queue.put(self._group)
            self._group, self._group_bytes = [], 0
            self._started.set()

    def close(self) -> None:
        """No more snapshots: the writer finishes."""
        self._flush()
        self._queue.put(self._END)
        self._done = True
        self._started.set()

    def fail(self, error: BaseException) -> None:
        """The producer failed: the writer raises instead of finishing the checkpoint."""
        self._queue.put(error)
        self._done = True
        self._started.set()

    def complete(self) -> bool:
        """Whether the producer has closed the queue (every snapshot is in) or failed."""
        return self._done

    def wait_started(self, timeout: float | None = None) -> bool:
        """Blocks until the first group, the end or a failure is queued; False on timeout."""
        return self._started.wait(timeout)

    def __iter__(self) -> Iterator[tuple[int, _writer.HostCopies]]:
        while (group := self._queue.get()) is not self._END:
            if isinstance(group, BaseException):
                raise RuntimeError("copying the checkpoint's arrays to host failed") from group
            yield from group


_BATCH_BYTES = 8 << 20
_BATCH_PIECES = 1024
_IN_FLIGHT_BYTES = 64 << 20


def _batched(
    items: Iterable[tuple[int, list[_interface.Piece]]],
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    # Consecutive small tensors of one file go to the writer together (up to 8 MiB or 1024
    # pieces): one vectored write and one round of bookkeeping instead of one per tensor.
    batch: list[_interface.Piece] = []
    batch_file, size = -1, 0
    for file_index, pieces in items:
        nbytes = pieces[0].data.nbytes if len(pieces) == 1 else sum(p.data.nbytes for p in pieces)
        if batch and (
            file_index != batch_file
            or size + nbytes > _BATCH_BYTES
            or len(batch) + len(pieces) > _BATCH_PIECES
        ):
            yield batch_file, batch
            batch, size = [], 0
        batch_file = file_index
        batch.extend(pieces)
        size += nbytes
    if batch:
        yield batch_file, batch


def write_process_share(
    prepared: PreparedSave,
    directory: epath.PathLike,
    stats: _writer.WriteStats | None = None,
    *,
    persist_share: bool = True,
) -> dict[str, Any]:
    """Writes this process's bytes (and, on the primary, headers, index and metadata draft).

    Tensors are written as ``prepared.pieces`` yields them, each file opened when first needed
    and made durable at the end. ``stats``, when given, records the byte ranges written.

    Returns this process's checksum share (what :func:`finalize` merges). With
    ``persist_share=False`` neither the share nor the metadata draft is written to disk: the
    caller hands both to :func:`finalize` itself (a single-process save; saves the JSON round
    trip of two documents with an entry per tensor).
    """
    directory = epath.Path(directory)
    plan = prepared.plan
    runs: dict[str, list[tuple[int, int, int]]] = {}  # tensor -> (offset, nbytes, crc) written
    # Writes under way, oldest first: (file name, pieces, bytes, pending write).
    pending: collections.deque[tuple[str, list[_interface.Piece], int, _interface.PendingWrite]] = (
        collections.deque()
    )
    in_flight = 0

    def settle_oldest() -> None:
        nonlocal in_flight
        filename, pieces, nbytes, under_way = pending.popleft()
        for tag, n, crc in under_way.result():
            if tag is None:  # a header
                continue
            name, offset = tag  # type: ignore[misc]  # (str, int): see _writer.iter_host_pieces
            runs.setdefault(name, []).append((offset, n, crc))  # type: ignore[has-type]
        if stats is not None:
            stats.add(filename, pieces)
        in_flight -= nbytes

    with contextlib.ExitStack() as stack:
        writers: dict[int, _interface.Writer] = {}

        def write(file_index: int, pieces: list[_interface.Piece], checksums: bool = False) -> None:
            # Submitted, not awaited: the write threads go on with this batch while the next
            # one is produced (on accelerators: copied to host). At most _IN_FLIGHT_BYTES of
            # earlier batches stay under way, which bounds the host copies a lazy save holds.
            nonlocal in_flight
            fplan = plan.files[file_index]
            if file_index not in writers:
                path = directory / fplan.filename
                writers[file_index] = stack.enter_context(
                    _router.open_writer(path, size=fplan.size)
                )
            nbytes = sum(p.data.nbytes for p in pieces)
            submitted = writers[file_index].submit(pieces, checksums=checksums)
            pending.append((fplan.filename, pieces, nbytes, submitted))
            in_flight += nbytes
            while pending and in_flight > _IN_FLIGHT_BYTES:
                settle_oldest()

        if prepared.is_primary:
            for i, fplan in enumerate(plan.files):
                write(i, [_interface.header_piece(fplan.header)])
        for file_index, pieces in _batched(prepared.pieces):
            write(file_index, pieces, checksums=prepared.checksums)
        while pending:  # before the files are made durable and closed
            settle_oldest()
    if prepared.is_primary:
        if len(plan.files) > 1:
            (directory / _plan.INDEX_FILE_NAME).write_text(json.dumps(plan.index_json(), indent=1))
        if persist_share:
            (directory / _metadata.DRAFT_FILE).write_text(json.dumps(prepared.metadata))
    # One record per tensor this process wrote any of: bytes written and this process's share
    # of the tensor's CRC32C (see _checksum.share), however many strided runs it wrote.
    tensors = {
        name: [sum(n for _, n, _ in rs), _checksum.share(rs, prepared.sizes[name])]
        for name, rs in runs.items()
    }
    doc = {"checksums": prepared.checksums, "tensors": tensors}
    if persist_share:
        share_file = directory / f"{_metadata.SHARE_FILE_PREFIX}{prepared.process_index}.json"
        share_file.write_text(json.dumps(doc))
    return doc


def finalize(
    directory: epath.PathLike,
    draft_metadata: dict[str, Any] | None = None,
    shares: Sequence[dict[str, Any]] = (),
) -> None:
    """Merges every process's checksum share into the metadata file (run once, after all wrote).

    ``draft_metadata`` is the draft's content when this process wrote it (``PreparedSave.
    metadata``): it spares reading back and parsing the draft (~4 ms per 1,000 tensors); it is
    required when the draft was not persisted. ``shares`` are checksum shares held in memory (as
    :func:`write_process_share` returns them unpersisted), merged with those found on disk.
    """
    directory = epath.Path(directory)
    _router.finalize_files(directory)  # object storage: join what several processes staged
    draft = directory / _metadata.DRAFT_FILE
    metadata = draft_metadata if draft_metadata is not None else json.loads(draft.read_text())
    files = sorted(directory.glob(f"{_metadata.SHARE_FILE_PREFIX}*.json"))
    # One small file per process: read them concurrently (object storage latency adds up).
    with concurrent.futures.ThreadPoolExecutor(min(32, max(1, len(files)))) as pool:
        docs = [*shares, *pool.map(lambda f: json.loads(f.read_text()), files)]
    _metadata.add_checksums(metadata, docs, directory)
    (directory / _metadata.METADATA_FILE).write_text(json.dumps(metadata))
    if draft_metadata is None or draft.exists():
        draft.unlink()
    for f in files:
        f.unlink()


@_gcpause.paused
def save_directory(
    tree: Any,
    directory: epath.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
) -> None:
    """Saves ``tree`` as a checkpoint directory from one process (no Orbax involved)."""
    directory = epath.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prepared = prepare_save(tree, user_metadata=metadata, max_file_size=max_file_size, copy=False)
    share = write_process_share(prepared, directory, persist_share=False)
    finalize(directory, prepared.metadata, [share])


# --------------------------------------------------------------------------- reading


def read_metadata(directory: epath.PathLike) -> dict[str, Any]:
    """Reads and checks the metadata file of a checkpoint directory."""
    path = epath.Path(directory) / _metadata.METADATA_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{directory} is not an orbax-safetensors checkpoint: no {_metadata.METADATA_FILE}"
        )
    if not _router.is_regular_file(path):  # a FIFO would block the read below
        raise SchemaError(f"{path}: not a regular file")
    with path.open("rb") as f:  # in chunks: memory follows the real size, not the cap
        chunks: list[bytes] = []
        while sum(map(len, chunks)) <= _metadata.MAX_METADATA_BYTES and (chunk := f.read(1 << 20)):
            chunks.append(chunk)
        raw = b"".join(chunks)
    if len(raw) > _metadata.MAX_METADATA_BYTES:
        raise SchemaError(f"{path}: larger than {_metadata.MAX_METADATA_BYTES} bytes")
    return _metadata.parse_metadata(raw, path)


def locate_in_directory(
    directory: epath.PathLike, metadata: Mapping[str, Any]
) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint directory, cross-checked against the files' own headers."""
    directory = epath.Path(directory)
    headers: dict[str, _header.Header] = {}  # by file name, once the name has been checked
    paths: dict[str, epath.Path] = {}  # one Path object per file, shared by its tensors
    out: dict[str, StoredTensor] = {}
    for name, info in metadata["tensors"].items():
        filename = info.get("file") if isinstance(info, dict) else None
        if not isinstance(filename, str) or (
            filename not in headers
            and (not _metadata.is_plain_filename(filename) or filename not in metadata["files"])
        ):
            raise SchemaError(f"{directory}: tensor {name!r} names an invalid file {filename!r}")
        if filename not in headers:
            path = directory / filename
            if not _router.is_regular_file(path):
                raise SchemaError(
                    f"{directory}: tensor {name!r} is stored in {filename!r}, which does not "
                    "exist or is not a regular file"
                )
            headers[filename] = _router.read_header(path)
            paths[filename] = path
        entry = headers[filename].tensors.get(name)
        if entry is None:
            raise HeaderError(
                f"{directory / filename}: tensor {name!r} is listed in the metadata but not in the file"
            )
        if entry.dtype != info.get("dtype") or list(entry.shape) != info.get("shape"):
            raise HeaderError(
                f"{directory / filename}: tensor {name!r} is {entry.dtype}{list(entry.shape)} in the "
                f"file but {info.get('dtype')}{info.get('shape')} in the metadata"
            )
        crc_text = info.get("crc32c")
        crc = None
        if crc_text is not None:
            crc = _checksum.from_hex(crc_text)
            if crc is None:
                raise SchemaError(f"{directory}: checksum of {name!r} is malformed: {crc_text!r}")
        out[name] = StoredTensor(
            name,
            paths[filename],
            headers[filename].data_start + entry.begin,
            entry.dtype,
            entry.shape,
            crc,
        )
    return out


def abstract_tree(directory: epath.PathLike, metadata: Mapping[str, Any] | None = None) -> Any:
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (inline values as saved); reads no
    tensor bytes."""
    metadata = metadata or read_metadata(directory)
    tensors = metadata["tensors"]
    leaves = _tree.validate_schema(metadata["schema"])

    def get(leaf: _tree.SchemaLeaf) -> Any:
        info = tensors.get(leaf.tensor_name)
        if not isinstance(info, dict):
            raise SchemaError(
                f"schema leaf {leaf.name!r} refers to unknown tensor {leaf.tensor_name!r}"
            )
        original = leaves.get(leaf.tensor_name, leaf)
        if original.kind == "key":
            impl = original.node["impl"]
            return jax.eval_shape(
                lambda: jax.random.wrap_key_data(
                    jax.numpy.zeros(info["shape"], jax.numpy.uint32), impl=impl
                )
            )
        return jax.ShapeDtypeStruct(tuple(info["shape"]), _dtypes.to_numpy(info["dtype"]))

    return _tree.unflatten(metadata["schema"], get, leaves)


@_gcpause.paused
def restore_directory(
    directory: epath.PathLike,
    target: Any = None,
    *,
    strict: bool = True,
    verify: bool = True,
    stats: ReadStats | None = None,
) -> Any:
    """Restores a checkpoint directory (see :func:`orbax_safetensors.load_file` for ``target``).

    In a multi-process job, arrays without a target sharding (no target at all, or target
    leaves that are ``jax.ShapeDtypeStruct``/``ArrayRestoreArgs`` without one) are placed with
    their saved sharding when this job's devices allow it; otherwise a ``TargetMismatchError``
    asks for a target sharding. Arrays saved host-local come back on this process's first
    device.
    """
    directory = epath.Path(directory)
    metadata = read_metadata(directory)
    stored = locate_in_directory(directory, metadata)
    if jax.process_count() > 1:
        target = _saved_sharding_target(directory, metadata, target)
    return restore_tree(
        metadata["schema"], stored, target, strict=strict, verify=verify, stats=stats
    )


def _lacks_sharding(leaf: Any) -> bool:
    """Whether a target leaf asks for a jax.Array without saying where to place it."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.sharding is None
    if is_restore_args(leaf):
        restore_type = getattr(leaf, "restore_type", None)
        if restore_type in (bool, int, float, str) or (
            isinstance(restore_type, type) and issubclass(restore_type, np.ndarray)
        ):
            return False
        return restore_args_sharding(leaf) is None
    return False


def _saved_sharding_target(
    directory: epath.Path, metadata: Mapping[str, Any], target: Any = None
) -> Any:
    """``target`` (None: the saved tree) with every jax leaf that lacks a sharding given its
    saved sharding rebuilt over this job's devices (multi-process restores)."""
    untargeted = target is None
    if untargeted:
        target = abstract_tree(directory, metadata)
    flat = _tree.flatten_target(target, is_leaf=is_restore_args)
    leaves = _tree.validate_schema(metadata["schema"])
    out = []
    for name, leaf in zip(flat.names, flat.leaves):
        saved = leaves.get(name)
        if saved is None or not _lacks_sharding(leaf):
            out.append(leaf)
            continue
        original = leaves.get(saved.tensor_name, saved)
        info = metadata["tensors"].get(saved.tensor_name)
        if original.kind == "tensor" and original.node.get("array") != "jax":
            if untargeted:  # a host-local numpy leaf: every process reads it in full
                host = np.zeros(leaf.shape, leaf.dtype)
                out.append(host[()] if original.node.get("array") == "scalar" else host)
            else:
                out.append(leaf)
            continue
        desc = info.get("sharding") if isinstance(info, dict) else None
        if desc is None:  # saved host-local (or not a NamedSharding): this process's device
            out.append(leaf)
            continue
        sharding = _sharding.sharding_from_json(desc)
        if sharding is None:
            saved_devices = int(np.prod(desc.get("mesh_shape") or [0]))
            raise TargetMismatchError(
                f"{directory}: tensor {saved.tensor_name!r} was saved with sharding {desc!r} "
                f"(a mesh of {saved_devices} devices), which this job's {len(jax.devices())} "
                "devices cannot reproduce; pass a restore target whose leaves are "
                "jax.ShapeDtypeStruct with the sharding you want"
            )
        if isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
        else:
            out.append(dataclasses.replace(leaf, sharding=sharding))
    return flat.rebuild(out)
