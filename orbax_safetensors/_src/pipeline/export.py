"""The export engine: an :class:`ExportPlan` (tensors computed from a tree's tensors, small files
beside them) written through ``checkpoint_save``'s writer by one process or several, each group
on the :class:`Route` global facts give it. :func:`write` reads a :class:`Unit` at a time, one
ahead, and owns the destination's life; ``export_item`` feeds a save job's snapshots through the
same groups (docs/architecture.md, "One export, followed through").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

Box = tuple[slice, ...]
Pieces = tuple[int, list[_interface.Piece]]
# (position in ExportGroup.sources, a shard's box, its host values, the whole sources by name
# or None for the boxes alone, the dtype to cast to first or None)
#   -> [(output name, box inside the output, values)]
PerShard = Callable[
    [int, Box, np.ndarray, Mapping[str, np.ndarray] | None, np.dtype | None],
    Iterable[tuple[str, Box, Any]],
]
# (the sources, the whole sources by name, the stored dtype, a band's bytes per process or
# None) -> (output name, its first row, a jax.Array over every device), one at a time
OnDevices = Callable[
    [Sequence[Any], Mapping[str, np.ndarray], np.dtype, int | None],
    Iterator[tuple[str, int, Any]],
]


@dataclasses.dataclass(frozen=True, eq=False)
class ExportGroup:
    """Outputs computed from sources (the tree's dotted names): ``apply`` maps host arrays in
    ``sources`` order to the outputs, one at a time (each is written before the next is asked
    for); ``whole``: sources every process needs whole (LoRA adapters). Sharded sources need
    ``per_shard`` or ``on_devices`` too."""

    sources: tuple[str, ...]
    outputs: tuple[str, ...]
    apply: Callable[[Sequence[np.ndarray]], Iterable[np.ndarray]]
    whole: tuple[str, ...] = ()
    per_shard: PerShard | None = None
    on_devices: OnDevices | None = None


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What an export writes: ``outputs`` (in file order), the ``groups`` computing them (each
    output in exactly one), every header's ``header_metadata``, the small ``files`` beside
    them (``{name: text or bytes}``) and a ``summary`` for ``repr``."""

    outputs: tuple[_plan.TensorSpec, ...]
    groups: tuple[ExportGroup, ...]
    header_metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    summary: str = ""

    def __post_init__(self) -> None:
        produced = [n for g in self.groups for n in g.outputs]
        if sorted(produced) != sorted(s.name for s in self.outputs):
            raise ValueError("internal: an export plan's groups must produce its outputs once")

    def probe_tree(self) -> dict[str, np.ndarray]:
        """The outputs as zero-stride arrays of their dtype and shape (no memory)."""
        return {
            s.name: np.broadcast_to(np.zeros((), _dtypes.to_numpy(s.dtype)), s.shape)
            for s in self.outputs
        }

    @property
    def sources(self) -> frozenset[str]:
        """The tree's tensors the plan reads."""
        return frozenset(n for g in self.groups for n in g.sources)

    @functools.cached_property
    def specs(self) -> dict[str, _plan.TensorSpec]:
        """The outputs by name."""
        return {s.name: s for s in self.outputs}


class ExportMapping(Protocol):
    """What ``SafetensorsSave(mapping=)`` and ``SafetensorsRestore(mapping=)`` take:
    ``export_plan`` raises naming every tensor that does not fit, before Orbax creates the
    step; ``restore`` fills ``target`` from the item."""

    def export_plan(
        self, validated: Any, dtype: Any, hf_config: Any, *, generation_config: Any = None
    ) -> ExportPlan: ...

    def restore(self, directory: epath.Path, target: Any, **options: Any) -> Any: ...


def check_mapping(mapping: Any) -> ExportMapping:
    """``mapping``, if it has the :class:`ExportMapping` methods; else a ``TypeError``."""
    if not all(callable(getattr(mapping, m, None)) for m in ("export_plan", "restore")):
        raise TypeError(
            "mapping= takes an osf.KeyMapping (or an object with export_plan and restore "
            f"methods), not {type(mapping).__name__}"
        )
    return mapping  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- routes


class Route(enum.Enum):
    """How the processes of a job share one group's outputs."""

    HOST = "host"  # sources held whole by each process: one process applies the group
    SHARDS = "shards"  # each process maps its own shards (ExportGroup.per_shard)
    DEVICES = "devices"  # re-laid-out on the devices, each process writes its own shards


def is_global(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` spread over several processes (not host-local)."""
    return isinstance(x, jax.Array) and not _snapshots.is_host_local(x, True)


def route(export: ExportPlan, group: ExportGroup, values: Mapping[str, Any], runs: bool) -> Route:
    """``group``'s :class:`Route` over ``values``; with ``runs``, shards that would be many
    short byte runs go to the devices. A ``ValueError`` names a group of sharded sources with
    neither way to share it."""
    sharded = [is_global(values[n]) for n in group.sources if n not in group.whole]
    if not any(sharded):
        return Route.HOST
    shards = all(sharded) and group.per_shard is not None
    if shards and not (runs and _small_runs(export, group, values)):
        return Route.SHARDS
    if group.on_devices is not None:
        return Route.DEVICES
    raise ValueError(
        f"{', '.join(group.sources)} -> {', '.join(group.outputs[:3])}: sharded over "
        "several processes, and its transform neither maps shards nor runs on devices"
    )


# A shard whose bytes in an output are many runs (MANY_RUNS or more) shorter than
# MIN_RUN_BYTES (a kernel sharded along its input axis is a column stripe of the transposed
# weight: one short run per row) is re-laid out on the devices instead: one collective, then
# one range per process, where each run would cost a piece, a write call and its bookkeeping.
MIN_RUN_BYTES = 64 << 10
MANY_RUNS = 256


def _small_runs(export: ExportPlan, group: ExportGroup, values: Mapping[str, Any]) -> bool:
    # From a shard of each source by its box (the same answer on every process, as the
    # collective of a re-layout needs), not from the owned shards.
    assert group.per_shard is not None
    for k, name in enumerate(group.sources):
        if name in group.whole:
            continue
        x = values[name]
        shape = tuple(int(d) for d in x.shape)
        box = _runs.normalize_index(
            next(iter(x.sharding.devices_indices_map(shape).values())), shape
        )
        no_data = np.broadcast_to(np.zeros((), np.uint8), tuple(s.stop - s.start for s in box))
        for out, out_box, _ in group.per_shard(k, box, no_data, None, None):
            spec = export.specs[out]
            try:
                offsets, length = _runs.byte_runs(spec.dtype, spec.shape, out_box, spec.name)
            except ValueError:  # (a sub-byte run off whole bytes: the devices re-lay it out)
                return True
            if length < MIN_RUN_BYTES and len(offsets) >= MANY_RUNS:
                return True
    return False


def _stored(export: ExportPlan, group: ExportGroup) -> np.dtype:
    # (a group's outputs share their stored dtype)
    return _dtypes.to_numpy(export.specs[group.outputs[0]].dtype)


def shard_pieces(
    plan: _plan.CheckpointPlan,
    export: ExportPlan,
    group: ExportGroup,
    k: int,
    copies: _snapshots.HostCopies,
    wholes: Mapping[str, np.ndarray],
) -> Iterator[Pieces]:
    """The pieces of each host shard of ``group``'s source ``k``, mapped alone by
    ``per_shard``, cast first (a transposed shard then moves in the stored dtype)."""
    assert group.per_shard is not None
    stored = _stored(export, group)
    for index, host in copies:
        box = tuple(index) if index is not None else tuple(slice(0, d) for d in host.shape)
        for out, out_box, values in group.per_shard(k, box, host, wholes, stored):
            yield _pieces.tensor_pieces(plan, out, [(out_box, np.asarray(values))])


def device_copies(
    export: ExportPlan,
    group: ExportGroup,
    values: Mapping[str, Any],
    wholes: Mapping[str, np.ndarray],
    band_bytes: int | None,
    buffers: _buffers.BufferArena | None,
) -> Iterator[tuple[str, _snapshots.HostCopies]]:
    """``group``'s outputs re-laid-out on the devices (collectives: every process alike), a
    band at a time, this process's shards copied to host (into ``buffers``) before the next."""
    assert group.on_devices is not None
    arrays = [values[n] for n in group.sources]
    for out, start, value in group.on_devices(arrays, wholes, _stored(export, group), band_bytes):
        # (done on every local device, those this process reads nothing from too, before
        # the next collective: compat.multihost says why)
        value.block_until_ready()
        copies = _snapshots.made_copies(value, buffers)
        if start:  # (a band's boxes placed in the whole output)
            copies = [(_shifted(index, start), host) for index, host in copies]
        del value
        if copies:
            yield out, copies


def _shifted(index: Any, start: int) -> Any:
    if not index:
        return index
    return (slice(index[0].start + start, index[0].stop + start), *index[1:])


def gathered(x: Any) -> np.ndarray:
    """``x`` whole on the host of every process (a collective when ``x`` is sharded over
    processes: for small arrays, such as LoRA adapters)."""
    return _jaxcompat.process_allgather(x) if is_global(x) else np.asarray(x)


# --------------------------------------------------------------------------- units


@dataclasses.dataclass(frozen=True)
class Unit:
    """One read: ``read()`` gives this process's values of the ``groups``' sources (None for
    another process's; no collective: it runs on a thread), ``nbytes`` of them; ``done``:
    the groups complete once this unit is written."""

    groups: tuple[ExportGroup, ...]
    read: Callable[[], dict[str, Any]]
    nbytes: int
    done: tuple[ExportGroup, ...]


def read_ahead(units: Sequence[Unit], budget: int) -> Iterator[dict[str, Any]]:
    """Each unit's values in turn, the next read on a thread while the caller works on this
    one (reads release the GIL) where both fit in ``budget``."""
    if len(units) <= 1:
        yield from (u.read() for u in units)
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="osf-export-read") as pool:
        future: concurrent.futures.Future[dict[str, Any]] | None = pool.submit(units[0].read)
        try:
            for i in range(len(units)):
                if future is None:  # (not read ahead: it did not fit beside the one before)
                    future = pool.submit(units[i].read)
                values: dict[str, Any] | None = future.result()
                future = None
                if i + 1 < len(units) and units[i].nbytes + units[i + 1].nbytes <= budget:
                    future = pool.submit(units[i + 1].read)
                yield values  # type: ignore[misc]
                values = None  # (the caller's to keep: none of it held here meanwhile)
        finally:
            if future is not None:
                future.cancel()  # the caller stopped early: a read under way is waited for


def _unit_items(
    export: ExportPlan,
    plan: _plan.CheckpointPlan,
    units: Sequence[Unit],
    batch_bytes: int,
    host_writes: bool,
    lent: _buffers.LentBuffers | None,
) -> Iterator[Any]:
    # This process's write items, unit by unit in the same order on every process: pieces,
    # host tensors to cast (name, value, rows or None), DRAIN, and each plan group once done.
    band = max(1, batch_bytes // 4)  # a re-layout holds its input, the blocks and its output
    values_of = read_ahead(units, batch_bytes)
    for i, unit in enumerate(units):
        if i and units[i - 1].nbytes + unit.nbytes > batch_bytes:
            # (not read ahead: every cast of the unit before is done before this one is
            # read, so that the arrays they view are freed first)
            yield _pieces.DRAIN
        values = next(values_of)
        for group in unit.groups:
            # (a generator of its own: nothing of a group, its last output included, outlives
            # its items, so that a unit's arrays are freed before the next unit is read)
            yield from _group_items(export, plan, group, values, band, host_writes, lent)
            for n in group.sources:
                values.pop(n, None)
            if any(g is group for g in unit.done):
                yield group
        del values
        yield from (g for g in unit.done if not any(g is u for u in unit.groups))


def _group_items(
    export: ExportPlan,
    plan: _plan.CheckpointPlan,
    group: ExportGroup,
    values: Mapping[str, Any],
    band: int,
    host_writes: bool,
    lent: _buffers.LentBuffers | None,
) -> Iterator[Any]:
    # ``group``'s write items over this unit's ``values``, on its route.
    wholes = {n: gathered(values[n]) for n in group.whole if values[n] is not None}
    kind = route(export, group, values, True)
    if kind is Route.SHARDS:
        for k, name in enumerate(group.sources):
            if name not in group.whole:
                owned = _snapshots.owned_shards(values[name])
                shards: _snapshots.HostCopies = [(b, np.asarray(d)) for b, d in owned]
                yield from shard_pieces(plan, export, group, k, shards, wholes)
    elif kind is Route.DEVICES:
        for out, copies in device_copies(export, group, values, wholes, band, None):
            yield _pieces.tensor_pieces(plan, out, copies)
    elif host_writes and all(values[n] is not None for n in group.sources):
        host = [wholes[n] if n in wholes else np.asarray(values[n]) for n in group.sources]
        for out, value in zip(group.outputs, group.apply(host)):
            value = np.asarray(value)  # one output at a time
            if lent is None or not _pieces.cast_in_bands(plan, out, value):
                yield out, value, None
                continue
            itemsize = _dtypes.to_numpy(plan.locate(out)[1].dtype).itemsize
            for rows in _pieces.band_rows(value.shape, itemsize, lent.capacity):
                yield out, value, rows


def _item_pieces(plan: _plan.CheckpointPlan, lent: _buffers.LentBuffers | None, item: Any) -> Any:
    # A host tensor's (or band's) pieces, cast and laid out; other items as they are.
    if not isinstance(item, tuple) or len(item) != 3:
        return item
    out, value, rows = item
    if rows is None or lent is None:
        return _pieces.tensor_pieces(plan, out, [(None, value)])
    return _pieces.band_piece(plan, out, value, rows, lent)


# --------------------------------------------------------------------------- destinations


def _barrier(name: str) -> None:
    _jaxcompat.barrier(f"orbax_safetensors.export.{name}")


def write(
    directory: epath.PathLike,
    export: ExportPlan,
    units: Sequence[Unit],
    *,
    batch_bytes: int,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    host_writes: bool = True,
) -> _pieces.WriteStats:
    """Writes ``export``'s files into ``directory`` from ``units`` (every process alike), then
    its index and small files, replacing earlier model files; returns what this process wrote.
    ``host_writes``: this process writes the ``HOST`` groups it reads (else the primary does).
    Several processes need a file system all see, or ``s3://`` / ``gs://`` (else ``ValueError``)."""
    directory = epath.Path(directory)
    meta = dict(export.header_metadata)
    plan = _plan.plan_files(list(export.outputs), max_file_size=max_file_size, metadata=meta)
    files = dict(export.files)
    if len(plan.files) > 1:
        files = {_plan.INDEX_FILE_NAME: json.dumps(plan.index_json(), indent=2), **files}
    one, primary = jax.process_count() == 1, jax.process_index() == 0
    # Writes under way: a checkpoint save's bound, or half a batch if smaller (their buffers
    # are memory touched afresh: on a virtual machine faulting pages in can cost as much as
    # the cast that fills them, and more would not write faster).
    max_in_flight = max(1, min(batch_bytes // 2, _checkpoint_save.IN_FLIGHT_BYTES))
    lent = None
    if one and _router.is_local(directory):
        # Large host tensors cast band by band into buffers reused once written: bands of a
        # share of the writes under way, a few at once, enough to keep a local device busy.
        band = max(1, min(_pieces.BAND_BYTES, max_in_flight // _pieces.BANDS_IN_FLIGHT))
        max_in_flight = band * _pieces.BANDS_IN_FLIGHT
        lent = _buffers.LentBuffers(band, _pieces.BANDS_IN_FLIGHT + _pieces.TRANSFORM_THREADS + 2)
    items = _unit_items(export, plan, units, batch_bytes, host_writes or primary, lent)
    # (one process casts on several cores at once; several keep each one's bounds)
    workers = _pieces.TRANSFORM_THREADS if one else 1
    mapped = _pieces.ordered_map(functools.partial(_item_pieces, plan, lent), items, workers)
    if not one and _router.is_object_url(directory):
        return _write_objects(directory, plan, export, mapped, files, batch_bytes)
    with _destination(directory, one, primary) as out:
        stats = _checkpoint_save.write_unchecksummed(
            plan,
            (p for p in mapped if not isinstance(p, ExportGroup)),
            out,
            jax.process_index(),
            primary=primary,
            max_in_flight=max_in_flight,
            written=None if lent is None else functools.partial(_give_back, lent),
        )
        if primary:
            _checkpoint_save.write_small_files(out, files)
    return stats


@contextlib.contextmanager
def _destination(directory: epath.Path, one: bool, primary: bool) -> Iterator[epath.Path]:
    # Where to write: one process replaces the directory's model files (storage/replace);
    # several write a staging directory beside it, which the primary swaps in once all wrote.
    if one:
        with _replace.replacing_directory(directory) as out:
            yield out
        return
    if not _router.is_local(directory):
        raise ValueError(
            f"{directory}: a multi-process export writes to a file system every process "
            "sees (local or network POSIX), s3:// or gs://; export to one of them and copy"
        )
    token = _jaxcompat.broadcast_bytes(
        uuid.uuid4().bytes[:8] if primary else None, is_source=primary
    )
    tmp = _replace.staging_path(directory, token.hex())  # (the primary's name, broadcast)
    if primary:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _barrier("staged")
    yield tmp
    _barrier("written")
    if primary:
        _replace.swap_in(tmp, directory)
    _barrier("done")


def _give_back(lent: _buffers.LentBuffers, written: list[_interface.Piece]) -> None:
    for piece in written:
        lent.give_back(piece.data)


def _write_objects(
    directory: epath.Path,
    plan: _plan.CheckpointPlan,
    export: ExportPlan,
    items: Iterator[Any],
    files: Mapping[str, str | bytes],
    batch_bytes: int,
) -> _pieces.WriteStats:
    # Object storage has no rename: the primary deletes the old export's model files and
    # index, then the files are uploaded a group of consecutive files at a time (each process
    # holds its share of one group: about batch_bytes), each group as one spread save of a
    # multi-process checkpoint (each process uploads its own bytes, each file appears whole
    # once complete), committed by the primary; the small files and the index come last: a
    # reader never follows them to a missing, old or partial file.
    primary = jax.process_index() == 0
    if primary:
        _replace.remove_owned(directory)
    _barrier("cleared")
    # The groups each file's tensors come from: a file is complete once they all are.
    waiting: list[set[int]] = [set() for _ in plan.files]
    for group in export.groups:
        for out in group.outputs:
            waiting[plan.file_of[out]].add(id(group))
    ahead: dict[int, list[Pieces]] = {}  # (pieces of a later file than the one written)

    def file_pieces(i: int) -> Iterator[list[_interface.Piece]]:
        yield from (p for _, p in ahead.pop(i, []))
        while waiting[i]:
            item = next(items)
            if isinstance(item, ExportGroup):  # all of this group's pieces are out
                for w in waiting:
                    w.discard(id(item))
            elif item[0] == i:
                yield item[1]
            else:
                ahead.setdefault(item[0], []).append(item)

    stats = _pieces.WriteStats()
    spread = batch_bytes * jax.process_count()  # (a group of consecutive files)
    file_groups = _plan.batched(range(len(plan.files)), lambda i: plan.files[i].size, spread)
    try:
        for g, members in enumerate(file_groups):
            parts = [plan.files[i] for i in members]
            sizes = [(f.filename, f.size) for f in parts]
            _router.prepare_directory(directory, sizes, is_primary=primary)  # every process
            part = _plan.CheckpointPlan(
                parts, {n: j for j, f in enumerate(parts) for n in f.entries}
            )
            pieces = ((j, p) for j, i in enumerate(members) for p in file_pieces(i))
            _checkpoint_save.write_unchecksummed(
                part, pieces, directory, jax.process_index(), primary=primary,
                stats=stats,
            )  # fmt: skip
            _barrier(f"group.{g}")  # (without JAX's key-value store, nothing else waits)
            if primary:
                _router.finalize_files(directory)  # (the commit record of its uploads deleted)
        for item in items:  # (nothing but the last marks: the reading thread ends)
            if not isinstance(item, ExportGroup):
                raise RuntimeError(f"internal: pieces of file {item[0]} after its upload")
    except BaseException as error:
        # The others stop waiting for this process; the primary removes what this group's
        # save uploaded (the files before it are complete; no index names them).
        _router.abandon_files(directory, error)
        raise
    _barrier("written")
    if primary:
        _checkpoint_save.write_small_files(directory, files)
    _barrier("done")
    return stats
