"""The steps of saving a checkpoint directory (safetensors files, their index when split, and
``orbax_safetensors.json``), by one process or many, which ``save_job.SaveJob`` puts in order:
:func:`validate_save`, :class:`PreparedSave`, :func:`write_process_share` (each process its own
byte ranges; the primary also headers and index) and :func:`finalize` (one process: checksums
merged into the metadata file).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import relayout as _core_relayout
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    DeletedArrayError,
)
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import relayout as _relayout
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import router as _router


class ValidatedTree:
    """A tree :func:`validate_save` accepted: captured (structure copied, leaves checked), and
    named (``flat``, ``specs``) when first asked, on whatever thread asks (an async save's
    writer). Under a dtype policy it is named at once: ``casts`` maps the position in
    ``captured.arrays`` of each cast array to its stored dtype (None: nothing is cast)."""

    def __init__(
        self,
        captured: _tree.CapturedTree,
        policy: _casting.Policy | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.captured = captured
        self.user_metadata = user_metadata  # checked JSON-serialisable (validate_save)
        self.casts: dict[int, np.dtype] | None = None
        if policy is not None:
            captured, flat, casts = _casting.apply_policy(captured, policy)
            self.captured = captured
            self.__dict__["flat"] = flat  # the cached property, named once
            self.casts = {i: w for i, w in enumerate(casts) if w is not None} or None

    @functools.cached_property
    def flat(self) -> _tree.FlatTree:
        return self.captured.finish()

    @functools.cached_property
    def specs(self) -> list[_plan.TensorSpec]:
        dtypes = self.captured.dtypes
        if self.casts is not None:
            dtypes = [self.casts.get(i, d) for i, d in enumerate(dtypes)]
        return _plan.specs_of(zip(self.flat.arrays, dtypes, self.captured.shapes))

    def header_bound(self) -> int:
        """:func:`_plan.header_bound` of the files this tree may be planned into."""
        c = self.captured
        return _plan.header_bound(
            sum(map(len, c.names)),
            len(c.names),
            max(map(len, c.shapes), default=0),
            _metadata.HEADER_METADATA,
        )


@_pieces.gc_paused()
def validate_save(
    tree: Any,
    user_metadata: Mapping[str, Any] | None = None,
    *,
    dtype: _casting.DtypePolicy | None = None,
) -> ValidatedTree:
    """Checks that ``tree``, ``user_metadata`` and the dtype policy ``dtype`` can be saved,
    before any I/O is scheduled.

    Raises:
      UnsupportedLeafError: naming the first leaf (or dtype) that cannot be stored.
      DeletedArrayError (a ValueError): naming a ``jax.Array`` that has been deleted (donated).
      MetadataError (a TypeError): when ``user_metadata`` is not JSON-serialisable.
      ValueError: naming the pattern or value of a ``dtype`` policy that is not a dtype.
    """
    policy = _casting.parse_policy(dtype)
    captured = _tree.capture(tree)
    _metadata.check_user_metadata(user_metadata)
    return ValidatedTree(captured, policy, user_metadata)


def check_not_deleted(arrays: Iterable[tuple[str, Any]]) -> None:
    """Raises DeletedArrayError naming the first deleted (donated) ``jax.Array`` of ``(name,
    array)``."""
    for name, x in arrays:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise DeletedArrayError(_tree.deleted_message(name, x))


_BATCH_BYTES = 8 << 20
_BATCH_PIECES = 1024
IN_FLIGHT_BYTES = 64 << 20  # writes under way at most, by default (write_process_share)


@dataclasses.dataclass
class PreparedSave:
    """Everything a process needs to write its bytes of the checkpoint; ``pieces`` yields
    ``(file index, pieces)`` one tensor at a time."""

    plan: _plan.CheckpointPlan
    pieces: Iterable[tuple[int, list[_interface.Piece]]]
    metadata: dict[str, Any]  # the metadata file's content, less checksums
    sizes: dict[str, int]
    is_primary: bool
    process_index: int
    checksums: bool
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)  # (the primary)
    max_in_flight: int = IN_FLIGHT_BYTES  # see write_process_share


@dataclasses.dataclass(frozen=True)
class SaveLayout:
    """How a checkpoint directory's files are laid out."""

    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE  # bytes of data per file; None: one
    checksums: bool = True  # every tensor's CRC32C, computed while writing

    def __post_init__(self) -> None:
        if self.max_file_size is not None and self.max_file_size <= 0:
            raise ValueError(f"max_file_size must be positive or None, got {self.max_file_size}")


_SINGLE_DEVICE = jax.sharding.SingleDeviceSharding


def plan_tree(
    validated: ValidatedTree,
    layout: SaveLayout,
    header_metadata: Mapping[str, str] = _metadata.HEADER_METADATA,
    *,
    grouped: bool = False,
) -> tuple[_plan.CheckpointPlan, dict[str, Any], dict[str, int]]:
    """The file plan of ``validated``, the metadata document (less checksums) and each
    tensor's stored size. ``grouped`` (object storage, several processes): the tensors a save
    joins on the devices are placed next to each other in the files."""
    flat, specs = validated.flat, validated.specs
    multi_process = jax.process_count() > 1
    ordered = specs
    if grouped and multi_process:
        keys = [_relayout.group_key(flat.arrays[s.name], s.dtype) for s in specs]
        ordered = [specs[i] for i in _core_relayout.file_order(keys)]
    # Headers depend only on names, dtypes and shapes: identical on every process.
    plan = _plan.plan_files(ordered, max_file_size=layout.max_file_size, metadata=header_metadata)
    # trees of many arrays share a few shardings
    described = _sharding.ShardingMemo(_sharding.sharding_to_json)
    shardings = {}
    for s in specs:
        x = flat.arrays[s.name]
        # Host-local leaves (numpy; in a multi-process job also jax.Arrays held whole by
        # each process) have no global sharding to reuse.
        shardings[s.name] = (
            described(x.sharding)
            if not _snapshots.is_host_local(x, multi_process)
            and isinstance(x.sharding, (jax.sharding.NamedSharding, _SINGLE_DEVICE))
            else None  # nothing to describe
        )
    user_metadata = validated.user_metadata
    metadata = _metadata.build_metadata(plan, specs, flat.schema, shardings, user_metadata)
    sizes = {s.name: plan.locate(s.name)[1].nbytes for s in specs}
    return plan, metadata, sizes


def prepare(
    validated: ValidatedTree,
    layout: SaveLayout,
    snapshots: Iterable[tuple[int, _snapshots.HostCopies]] | None = None,
    *,
    is_primary: bool = True,
    process_index: int = 0,
    row_blocks: bool = False,
) -> PreparedSave:
    """Plans ``validated``'s files. With ``snapshots`` (``snapshots.iter_snapshots`` over
    ``enumerate(validated.captured.arrays)``, or a queue it fills), ``pieces`` writes them and
    never reads the arrays; without, ``pieces`` views (or casts) each tensor as the writer
    reaches it: the caller's arrays must stay untouched until the write returns.
    ``row_blocks`` (object storage): as given to ``iter_snapshots``; without ``snapshots``
    (every process, on its main thread) the tensors it moves are moved and copied now."""
    plan, metadata, sizes = plan_tree(validated, layout, grouped=row_blocks)
    names = list(validated.flat.arrays)  # in the order of captured.arrays
    pieces: Iterable[tuple[int, list[_interface.Piece]]]
    max_in_flight = IN_FLIGHT_BYTES
    if snapshots is not None:
        pieces = (_pieces.tensor_pieces(plan, names[i], copies) for i, copies in snapshots)
    else:
        arrays = validated.flat.arrays
        check_not_deleted(arrays.items())
        ready = None
        if row_blocks:
            relaid = _snapshots.iter_snapshots(
                enumerate(validated.captured.arrays),
                is_primary=is_primary,
                casts=validated.casts,
                row_blocks=True,
                moved_only=True,
            )
            ready = {names[i]: copies for i, copies in relaid}
        pieces = _pieces.iter_host_pieces(plan, arrays, is_primary=is_primary, ready=ready)
        # Where the pieces are host views (CPU, numpy), writes under way hold no memory of
        # their own; where each is a fresh copy off an accelerator, they would hold up to
        # IN_FLIGHT_BYTES of copies (a small state whole): one batch is written at a time
        # instead, while the next tensor's transfer runs.
        if not _snapshots.host_views(arrays.values()):
            max_in_flight = _BATCH_BYTES
    return PreparedSave(
        plan,
        pieces,
        metadata,
        sizes,
        is_primary,
        process_index,
        layout.checksums,
        max_in_flight=max_in_flight,
    )


def batched(
    items: Iterable[tuple[int, list[_interface.Piece]]], max_bytes: int = _BATCH_BYTES
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    """``(file index, pieces)`` of consecutive tensors of one file joined into batches of up
    to ``max_bytes`` or 1024 pieces, each yielded before the next tensor is produced."""
    # One vectored write and one round of bookkeeping instead of one per tensor. A full batch
    # goes at once, before the next tensor is produced (copied or cast): what a lazy save
    # holds beyond the writes under way is one tensor plus one part-filled batch.
    batch: list[_interface.Piece] = []
    batch_file, size = -1, 0
    for file_index, pieces in items:
        nbytes = pieces[0].data.nbytes if len(pieces) == 1 else sum(p.data.nbytes for p in pieces)
        if batch and (
            file_index != batch_file
            or size + nbytes > max_bytes
            or len(batch) + len(pieces) > _BATCH_PIECES
        ):
            yield batch_file, batch
            batch, size = [], 0
        batch_file = file_index
        batch.extend(pieces)
        size += nbytes
        del pieces  # (the batch holds what is unsent: nothing held while the next is produced)
        if size >= max_bytes:
            yield batch_file, batch
            batch, size = [], 0
    if batch:
        yield batch_file, batch


def write_process_share(
    prepared: PreparedSave,
    directory: epath.PathLike,
    stats: _pieces.WriteStats | None = None,
    *,
    persist_share: bool = True,
    max_in_flight: int | None = None,
    io: _config.IOOptions | None = None,
    index: bool = True,
    written: Callable[[list[_interface.Piece]], None] | None = None,
) -> dict[str, Any]:
    """Writes this process's bytes (the primary: headers, index and metadata draft too), each
    file made durable at the end; ``stats`` records the byte ranges written. Returns this
    process's checksum share for :func:`finalize`.

    ``persist_share=False``: neither the share nor the draft goes to disk (the caller hands
    both to :func:`finalize`). ``max_in_flight``: bytes of earlier pieces still being written
    while the next are produced, the part-filled batch included (default
    ``prepared.max_in_flight``). ``index=False``: no index file. ``written(pieces)`` is called
    with each batch once written (their buffers may then be reused).
    """
    directory = epath.Path(directory)
    plan = prepared.plan
    if max_in_flight is None:
        max_in_flight = prepared.max_in_flight
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
            name, offset = tag  # type: ignore[misc]  # (str, int): see _pieces.iter_host_pieces
            runs.setdefault(name, []).append((offset, n, crc))  # type: ignore[has-type]
        if stats is not None:
            stats.add(filename, pieces)
        if written is not None:
            written(pieces)
        in_flight -= nbytes

    batch_bytes = max(1, min(_BATCH_BYTES, max_in_flight))  # (a part-filled batch is held too)
    with contextlib.ExitStack() as stack:
        writers: dict[int, _interface.Writer] = {}

        def write(file_index: int, pieces: list[_interface.Piece], checksums: bool = False) -> None:
            # Submitted, not awaited: the write threads go on with this batch while the next
            # one is produced (on accelerators: copied to host). At most max_in_flight bytes of
            # earlier batches stay under way, which bounds the host copies a lazy save holds.
            nonlocal in_flight
            fplan = plan.files[file_index]
            if file_index not in writers:
                path = directory / fplan.filename
                writers[file_index] = stack.enter_context(
                    _router.open_writer(path, size=fplan.size, io=io)
                )
            nbytes = sum(p.data.nbytes for p in pieces)
            submitted = writers[file_index].submit(pieces, checksums=checksums)
            pending.append((fplan.filename, pieces, nbytes, submitted))
            in_flight += nbytes
            # (less one batch: the part-filled batch and the next tensor are held beside the
            # writes under way, so a lazy save's extra memory stays within the largest tensor
            # plus max_in_flight)
            while pending and in_flight > max(0, max_in_flight - batch_bytes):
                settle_oldest()

        if prepared.is_primary:
            for i, fplan in enumerate(plan.files):
                write(i, [_interface.header_piece(fplan.header)])
        for file_index, pieces in batched(prepared.pieces, batch_bytes):
            write(file_index, pieces, checksums=prepared.checksums)
            # (the next batch is produced without a hold on this one: a direct save of fresh
            # host copies holds the batch copied and the next transfer, once this is written)
            del pieces
        while pending:  # before the files are made durable and closed
            settle_oldest()
    # Object storage, several processes: this process's uploads (and the parts it builds).
    _router.finish_files(directory, io)
    if prepared.is_primary:
        if index and len(plan.files) > 1:
            (directory / _plan.INDEX_FILE_NAME).write_text(json.dumps(plan.index_json(), indent=1))
        write_small_files(directory, prepared.files)
        if persist_share:
            (directory / _metadata.DRAFT_FILE).write_text(json.dumps(prepared.metadata))
    # One record per tensor this process wrote any of: bytes written and this process's share
    # of the tensor's CRC32C (see _checksum.share; 0 unchecksummed), however many strided
    # runs it wrote.
    tensors = {
        name: [
            sum(n for _, n, _ in rs),
            _checksum.share(rs, prepared.sizes[name]) if prepared.checksums else 0,
        ]
        for name, rs in runs.items()
    }
    doc = {"checksums": prepared.checksums, "tensors": tensors}
    if persist_share:
        share_file = directory / f"{_metadata.SHARE_FILE_PREFIX}{prepared.process_index}.json"
        share_file.write_text(json.dumps(doc))
    return doc


def write_small_files(directory: epath.PathLike, files: Mapping[str, str | bytes]) -> None:
    """Writes ``files`` (``{relative name: text (UTF-8) or bytes}``) into ``directory``,
    making the folders a name has."""
    directory = epath.Path(directory)
    for name, content in files.items():
        path = directory / name
        if "/" in name:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


def write_unchecksummed(
    plan: _plan.CheckpointPlan,
    pieces: Iterable[tuple[int, list[_interface.Piece]]],
    directory: epath.PathLike,
    process_index: int,
    *,
    primary: bool,
    max_in_flight: int = IN_FLIGHT_BYTES,
    stats: _pieces.WriteStats | None = None,
    written: Callable[[list[_interface.Piece]], None] | None = None,
) -> _pieces.WriteStats:
    """Writes this process's ``pieces`` of ``plan``'s files (an export's: no checksums, no
    metadata file, no index) by :func:`write_process_share`; returns what it wrote, added to
    ``stats``."""
    stats = _pieces.WriteStats() if stats is None else stats
    prepared = PreparedSave(plan, pieces, {}, {}, primary, process_index, checksums=False)
    write_process_share(
        prepared,
        directory,
        stats,
        persist_share=False,
        max_in_flight=max_in_flight,
        index=False,
        written=written,
    )
    return stats


def finalize(
    directory: epath.PathLike,
    draft_metadata: dict[str, Any] | None = None,
    shares: Sequence[dict[str, Any]] = (),
    io: _config.IOOptions | None = None,
) -> None:
    """Merges every process's checksum share into the metadata file (once, after all wrote).
    ``draft_metadata``: the draft held in memory (required when it was not persisted);
    ``shares``: shares held in memory, merged with those found on disk."""
    directory = epath.Path(directory)
    _router.finalize_files(directory, io)  # object storage: join what several processes staged
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
