"""A Hugging Face export written by every process of a multi-process JAX job, gather-free.

Every process calls ``export_pytorch`` with the same arguments. Each one plans the same files
(names, shapes, dtypes, offsets: from global facts only, ``core/plan``) and writes only the
bytes of the shards it owns (``replica_id == 0``), through the writer a checkpoint save uses
(``pipeline/checkpoint_save.write_process_share``):

1. the primary creates a staging directory beside ``directory`` (its name broadcast to every
   process), then a barrier;
2. every process writes its pieces, link by link in the same order:
   - Flax tensors sharded over processes whose link commutes with the sharding
     (``export_plan.commutes``: renames, transposes, stacked layers, fused parts): each owned
     shard is transformed on its own and written at its boxes' offsets;
   - other links of sharded tensors: each PyTorch tensor is re-laid-out on the devices by one
     jitted transform with ``export_plan.spread_sharding`` as ``out_shardings`` (a collective
     every process issues in the same order), a band of rows at a time where the link maps
     boxes on its own (:func:`relaid_rows`: a quarter of ``batch_bytes`` per process), and
     its owned shards written;
   - host-local tensors (numpy, a ``jax.Array`` each process holds whole): the primary writes
     them, as a one-process export does;
   - a checkpoint path: what each process reads is planned by ``export_reads`` and read one
     unit ahead on a thread (:func:`read_ahead`, while both fit in ``batch_bytes``): batches
     of links of at most half ``batch_bytes``, read sharded over the devices (byte ranges of
     safetensors files through ``pipeline/read.read_tensors``, whole chunks of an
     Orbax-native item through ``OrbaxSource.read_sharded``: each process reads only its
     boxes) and written as above, or, for a link read whole, by its owner process alone, as
     host-local tensors; and the stacked links of an Orbax-native item whose chunks allow it
     a band of layers at a time (``export_reads.plan_bands``), each process its own layers,
     their PyTorch tensors computed and written on its host (no collective);

   Host memory per process: two units read (one written, one read ahead; each at most half
   ``batch_bytes``), the writes under way (:func:`in_flight`: at most half ``batch_bytes``),
   a band of a re-layout with its exchanged blocks, the PyTorch tensor being cast, and a
   constant (pieces of stored chunks being decoded: ``sources.READ_PIECE_BYTES``; thread
   pools; what the allocator keeps). A unit is larger than half the batch only where the
   checkpoint does not let it be cut: a band is at least one stored chunk thick, and a
   tensor whose every chunk spans all its layers and rows (an FSDP save: each chunk is a
   device's shard of every layer) is read as this process's whole share of it, and then
   read alone (nothing read ahead beside it);
3. a barrier; the primary writes the index and the small files (``config.json``,
   ``generation_config.json``, the tokenizer's: ``model_files``) and swaps the staging
   directory in (``storage/replace.swap_in``); a last barrier, so that every process returns
   once the directory is complete.

On ``s3://`` and ``gs://`` (no rename) the primary first deletes the old export's model files
and index, and the pieces go straight into ``directory``, a group of files at a time (each
process holds its share of one group: about ``batch_bytes``), through the uploads of a
multi-process checkpoint save (``storage/objstore/spread``: each process uploads its own
bytes, each file appears whole once complete); the index and the small files come last.

The files are byte-identical to a one-process export of the same values, LoRA merges included
(the small adapters are gathered to every process and each kernel shard merged on the host:
``lora.merge_lora_block``).

Example::

    # on every process of the job, with params sharded over the job's devices
    osf.export_pytorch(params, "/shared/hf", mapping, hf_config=config)
    osf.export_pytorch(params, "gs://bucket/hf", mapping, hf_config=config)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import multihost as _multihost
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.integrations import export_plan as _export_plan
from orbax_safetensors._src.integrations import export_reads as _export_reads
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import lora as _lora
from orbax_safetensors._src.integrations import object_export as _object_export
from orbax_safetensors._src.integrations.key_mapping import MappingReport
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import read as _reader
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

_PRIMARY = 0

Pieces = tuple[int, list[_interface.Piece]]


@dataclasses.dataclass(frozen=True)
class Lora:
    """The LoRA adapters an export merges: ``{kernel: (lora_a, lora_b)}`` and the scale."""

    merges: Mapping[str, tuple[str, str]]
    scale: float


@dataclasses.dataclass(frozen=True)
class ExportJob:
    """What an export writes: ``plan``'s files, the ``links`` that compute their tensors
    from ``table``, the ``tied`` PyTorch keys left out.

    Example::

        job = ExportJob(plan, links, table, dict(mapping.tied))
        report.moved += job.moved()
    """

    plan: _plan.CheckpointPlan
    links: Sequence[_links.Link]
    table: _flax_tables.FlaxTable
    tied: Mapping[str, str]

    def moved(self, links: Sequence[_links.Link] | None = None) -> list[tuple[str, str]]:
        """The ``(flax name, torch key)`` pairs ``links`` (default: all) write."""
        links = self.links if links is None else links
        return [(n, k) for link in links for k, n in link.pairs() if k not in self.tied]


def is_global(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` sharded over several processes (not host-local)."""
    return isinstance(x, jax.Array) and not _snapshots.is_host_local(x, True)


def _barrier(name: str) -> None:
    _multihost.barrier(f"orbax_safetensors.export.{name}")


def _staging_token(is_primary: bool) -> str:
    # The primary's random token, as every process gets it (one broadcast).
    mine = uuid.uuid4().bytes[:8] if is_primary else None
    return _multihost.broadcast_bytes(mine, is_source=is_primary).hex()


def write_processes(
    directory: epath.Path,
    job: ExportJob,
    report: MappingReport,
    extra_files: Mapping[str, str | bytes],
    *,
    lora: Lora,
    batch_bytes: int,
) -> _pieces.WriteStats:
    """Writes ``job``'s files into ``directory`` from every process of the job (see the
    module docstring); ``extra_files`` (``{name: text or bytes}``: the index, ``config.json``
    and the other small files) are written by the primary, last (on ``s3://`` and ``gs://``:
    ``object_export``). Returns what this process wrote.

    Raises:
      ValueError: ``directory`` is neither on a local (POSIX, shared) file system nor on
        ``s3://`` or ``gs://``.
    """
    if _router.is_object_url(directory):  # a group of files at a time (object_export)
        items = _process_pieces(job, lora, batch_bytes, jax.process_index() == _PRIMARY, True)
        stats = _object_export.write_objects(
            directory, job.plan, job.links, job.tied, items, extra_files, batch_bytes=batch_bytes
        )
        report.moved += job.moved()
        return stats
    if not _router.is_local(directory):
        raise ValueError(
            f"{directory}: a multi-process export writes to a file system every process "
            "sees (local or network POSIX), s3:// or gs://; export to one of them and copy"
        )
    primary = jax.process_index() == _PRIMARY
    tmp = _replace.staging_path(directory, _staging_token(primary))
    if primary:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _barrier("staged")
    pieces = _process_pieces(job, lora, batch_bytes, primary)
    stats = write_pieces(job.plan, pieces, tmp, batch_bytes, primary=primary)
    report.moved += job.moved()
    _barrier("written")
    if primary:
        index = tmp / _plan.INDEX_FILE_NAME
        if index.exists():
            index.unlink()  # (written by write_process_share; extra_files has the export's own)
        _checkpoint_save.write_small_files(tmp, extra_files)
        _replace.swap_in(tmp, directory)
    _barrier("done")
    return stats


def write_pieces(
    plan: _plan.CheckpointPlan,
    pieces: Iterator[Pieces],
    directory: epath.Path,
    batch_bytes: int,
    *,
    primary: bool,
    lent: _buffers.LentBuffers | None = None,
    max_in_flight: int | None = None,
) -> _pieces.WriteStats:
    """Writes this process's ``pieces`` of an export's files (headers and index too on the
    primary) with ``checkpoint_save.write_process_share``'s threads, :func:`in_flight` bytes
    (or ``max_in_flight``) of writes under way at most; returns what it wrote. Unchecksummed:
    no metadata file. Pieces whose buffers ``lent`` lent (``pieces.band_piece``) are given
    back once written."""
    return _checkpoint_save.write_unchecksummed(
        plan,
        pieces,
        directory,
        jax.process_index(),
        primary=primary,
        max_in_flight=in_flight(batch_bytes) if max_in_flight is None else max_in_flight,
        written=None if lent is None else functools.partial(_give_back, lent),
    )


def _give_back(lent: _buffers.LentBuffers, written: list[_interface.Piece]) -> None:
    for piece in written:
        lent.give_back(piece.data)


def in_flight(batch_bytes: int) -> int:
    """Bytes of an export's writes under way at most: a checkpoint save's bound, or half a
    batch if smaller: their host buffers are memory the export touches afresh (on a virtual
    machine, faulting in fresh pages can cost as much as the cast that fills them), and more
    would not write faster."""
    return max(1, min(batch_bytes // 2, _checkpoint_save.IN_FLIGHT_BYTES))


def half_batches(job: ExportJob, batch_bytes: int) -> list[tuple[list[_links.Link], list[str]]]:
    """``job``'s links in batches of half ``batch_bytes`` of Flax tensors (one batch is read
    while the one before is written: :func:`read_ahead`), each with its Flax names, sorted."""
    infos = job.table.infos
    groups = _links.link_batches(
        job.links, lambda n: infos[n].nbytes, max(1, batch_bytes // 2), torch_side=False
    )
    return [(group, sorted({n for link in group for n in link.flax})) for group in groups]


def _process_pieces(
    job: ExportJob, lora: Lora, batch_bytes: int, primary: bool, marks: bool = False
) -> Iterator[Any]:
    """This process's pieces, link by link in the same order on every process; with
    ``marks``, each link too, once its pieces are out."""
    plan, table, tied = job.plan, job.table, job.tied
    me = jax.process_index()
    band = relayout_band(batch_bytes)
    if table.source is None:  # in memory; a LoRA merge is a collective: on this thread
        for group, names in half_batches(job, batch_bytes):
            values = {n: merged_value(table.values, n, lora) for n in names}
            for link in group:
                arrays = [values[n] for n in link.flax]
                yield from _link_pieces(plan, link, arrays, tied, primary, band)
                for n in link.flax:
                    values.pop(n, None)
                if marks:
                    yield link
        return
    reads = plan_reads(job, lora, batch_bytes)
    units = _export_reads.read_units(
        job.links, table.infos, reads, me, max(1, batch_bytes // 2), _held(table, reads, me)
    )
    read = functools.partial(read_unit, table, reads, me)
    values_of = read_ahead(read, units, [u.nbytes for u in units], batch_bytes)
    for unit, values in zip(units, values_of):
        for link in unit.links:
            # (a band: this process's slots, written by it; else the owner of a link read
            # whole, or every process its shards of one read sharded)
            writes = unit.boxes is not None or reads.writer(link, _PRIMARY) == me
            # (popped: nothing here holds a unit's arrays once its pieces are out)
            arrays = [values.pop(n) for n in link.flax]
            yield from _link_pieces(plan, link, arrays, tied, writes, band)
            del arrays
        if marks:
            yield from unit.done


def plan_reads(
    job: ExportJob, lora: Lora, batch_bytes: int | None = None
) -> _export_reads.ReadPlan:
    """What each process reads of ``job``'s checkpoint source (``export_reads``): byte
    ranges of safetensors files, whole chunks of an Orbax-native item (with ``batch_bytes``,
    a stacked link whose chunks allow it in bands of slots of at most half of it, each
    process its own); links that merge LoRA adapters, and every link of another source, read
    whole by one process each."""
    source = job.table.source
    prefix = job.table.prefix
    chunks: dict[str, tuple[int, ...]] | None = None
    if isinstance(source, _sources.OrbaxSource):
        chunks = {n: source.chunks[prefix + n] for n in job.table.infos}
    return _export_reads.plan_reads(
        job.links,
        job.table.infos,
        chunks=chunks,
        processes=jax.process_count(),
        whole=lora.merges,
        sharded=isinstance(source, (_sources.SafetensorsSource, _sources.OrbaxSource)),
        budget=None if batch_bytes is None else max(1, batch_bytes // 2),
    )


def host_reads(
    job: ExportJob, batch_bytes: int, whole: Collection[str] = ()
) -> _export_reads.ReadPlan:
    """What a one-process export reads of ``job``'s checkpoint source: a stacked link of an
    Orbax-native item larger than half ``batch_bytes`` in bands of slots
    (``export_reads.plan_bands``; not one of ``whole``: the kernels LoRA adapters merge
    into), every other link whole."""
    source, prefix, infos = job.table.source, job.table.prefix, job.table.infos
    bands: dict[str, _export_reads.Bands] = {}
    if isinstance(source, _sources.OrbaxSource):
        chunks = {n: source.chunks[prefix + n] for n in infos}
        bands = _export_reads.plan_bands(
            job.links, infos, chunks, processes=1, budget=max(1, batch_bytes // 2), whole=whole
        )
    owners = {n: _PRIMARY for link in job.links if link.flax[0] not in bands for n in link.flax}
    return _export_reads.ReadPlan({}, owners, bands)


def host_units(
    job: ExportJob, reads: _export_reads.ReadPlan, batch_bytes: int
) -> list[_export_reads.ReadUnit]:
    """The reads of a one-process export (``reads``: :func:`host_reads`), in order."""
    infos = job.table.infos
    return _export_reads.read_units(
        job.links, infos, reads, _PRIMARY, max(1, batch_bytes // 2), lambda n: infos[n].nbytes
    )


def _held(table: _flax_tables.FlaxTable, reads: _export_reads.ReadPlan, me: int) -> Any:
    # The bytes this process holds of a Flax tensor read as ``reads`` plans: its devices'
    # distinct boxes of one read sharded, the whole tensor if it reads it whole, else none.
    def held(name: str) -> int:
        info = table.infos[name]
        sharding = reads.shardings.get(name)
        if sharding is None:
            return int(info.nbytes) if reads.owners.get(name) == me else 0
        boxes = {
            tuple((s.start, s.stop) for s in _runs.normalize_index(index, info.shape))
            for index in sharding.addressable_devices_indices_map(info.shape).values()
        }
        return sum(_dtypes.nbytes(info.dtype, tuple(b - a for a, b in box)) for box in boxes)

    return held


def read_unit(
    table: _flax_tables.FlaxTable,
    reads: _export_reads.ReadPlan,
    me: int,
    unit: _export_reads.ReadUnit,
) -> dict[str, Any]:
    """This process's values of ``unit``'s Flax names: a band's boxes as host arrays
    (``OrbaxSource.read_box``), else as :func:`plan_reads` reads them (no collective: a
    reading thread's)."""
    if unit.boxes is None:
        return _read(table, reads, me, unit.names)
    source, prefix = table.source, table.prefix
    return {n: source.read_box(prefix + n, unit.boxes[n]) for n in unit.names}


def _read(
    table: _flax_tables.FlaxTable,
    reads: _export_reads.ReadPlan,
    me: int,
    names: Sequence[str],
) -> dict[str, Any]:
    # This process's values of ``names``: global arrays of those read sharded, host arrays
    # of those it reads whole, None for the others' (no collective: a reading thread's).
    sharded = [n for n in names if n in reads.shardings]
    mine = [n for n in names if reads.owners.get(n) == me]
    out: dict[str, Any] = dict.fromkeys(names)
    if sharded:
        out.update(_read_sharded(table, sharded, reads.shardings))
    if mine:
        out.update(table.read(mine))
    return out


def read_ahead(
    read: Callable[[Any], dict[str, Any]],
    batches: Sequence[Any],
    sizes: Sequence[int] | None = None,
    budget: int | None = None,
) -> Iterator[dict[str, Any]]:
    """``read(batch)`` for each of ``batches`` in turn, the next batch read on a thread while
    the caller works on the one yielded (reads release the GIL: the transforms and writes of
    one batch overlap the reading of the next). With ``sizes`` (the bytes each batch holds)
    and ``budget``, the next is read ahead only while both fit in ``budget``; else once the
    caller is done with the one before. ``read`` must not run collectives.

    Example::

        for values in read_ahead(table.read, [["a", "b"], ["c"]]):
            ...
    """
    if len(batches) <= 1:
        yield from (read(b) for b in batches)
        return

    def ahead(i: int) -> bool:
        return sizes is None or budget is None or sizes[i] + sizes[i + 1] <= budget

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="osf-export-read") as pool:
        future: concurrent.futures.Future[dict[str, Any]] | None = pool.submit(read, batches[0])
        try:
            for i in range(len(batches)):
                if future is None:  # (not read ahead: it did not fit beside the one before)
                    future = pool.submit(read, batches[i])
                values: dict[str, Any] | None = future.result()
                future = None
                if i + 1 < len(batches) and ahead(i):
                    future = pool.submit(read, batches[i + 1])
                yield values  # type: ignore[misc]
                values = None  # (the caller's to keep: none of it held here meanwhile)
        finally:
            if future is not None:
                future.cancel()  # the caller stopped early: a read under way is waited for


def _read_sharded(
    table: _flax_tables.FlaxTable, names: Sequence[str], shardings: Mapping[str, Any]
) -> dict[str, Any]:
    # Global arrays of ``names`` under their planned shardings: this process reads its boxes
    # (byte ranges of safetensors files, whole chunks of an Orbax-native item).
    source, prefix = table.source, table.prefix
    if isinstance(source, _sources.OrbaxSource):
        got = source.read_sharded(
            [prefix + n for n in names], {prefix + n: shardings[n] for n in names}
        )
        return {n: got[prefix + n] for n in names}
    requests = [
        _reader.ReadRequest(
            source.stored[prefix + n], kind=_reader.ReadKind.JAX, sharding=shardings[n]
        )
        for n in names
    ]
    return dict(zip(names, _reader.read_tensors(requests)))


def merged_value(values: Mapping[str, Any], name: str, lora: Lora) -> Any:
    """``values[name]``, merged with its LoRA adapters where ``lora`` names them (a
    collective when they are sharded over processes: every process calls it alike)."""
    x = values[name]
    if name not in lora.merges:
        return x
    a, b = (gathered(values[n]) for n in lora.merges[name])  # (in every process, in order)
    return merged(x, a, b, lora.scale)


def gathered(x: Any) -> np.ndarray:
    """``x`` whole on the host of every process (a collective when ``x`` is sharded over
    processes: for small arrays, such as LoRA adapters)."""
    if is_global(x):
        return _multihost.process_allgather(x)
    return np.asarray(x)


def merged(kernel: Any, a: np.ndarray, b: np.ndarray, scale: float) -> Any:
    """``lora.merge_lora(kernel, a, b, scale)`` with ``kernel``'s sharding: a sharded
    ``jax.Array`` is merged shard by shard on the host (``lora.merge_lora_block``, from the
    whole adapters ``a`` and ``b``) and put back on its devices, bit-identical to the merge of
    the whole kernel in one process; other kernels are merged whole."""
    if not is_global(kernel):
        return _lora.merge_lora(np.asarray(kernel), a, b, scale)
    blocks = []
    for shard in kernel.addressable_shards:
        box = _runs.normalize_index(shard.index, kernel.shape)
        block = _lora.merge_lora_block(np.asarray(shard.data), box, a, b, scale, kernel.shape)
        blocks.append(jax.device_put(block, shard.device))
    return jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, blocks)


def _link_pieces(
    plan: _plan.CheckpointPlan,
    link: _links.Link,
    arrays: list[Any],
    tied: Mapping[str, str],
    primary: bool,
    band_bytes: int | None = None,
) -> Iterator[Pieces]:
    glob = [is_global(a) for a in arrays]
    if not any(glob):  # host-local values: the primary writes them whole
        if not primary:
            return
        flax = [np.asarray(a) for a in arrays]
        for j, key in enumerate(link.torch):  # one PyTorch tensor at a time
            if key not in tied:
                value = link.value(flax, j, to_torch=True)
                yield _pieces.tensor_pieces(plan, key, [(None, np.asarray(value))])
        return
    shapes = [tuple(int(d) for d in a.shape) for a in arrays]
    if (
        all(glob)
        and _export_plan.commutes(link, shapes)
        and not _small_runs(plan, link, arrays, shapes, tied)
    ):
        # Cast first (contiguous, as pieces.tensor_pieces would): a transposed shard is then
        # moved in the stored dtype, and the cast reads memory in order.
        kept = next(k for k in link.torch if k not in tied)
        stored = _dtypes.to_numpy(plan.locate(kept)[1].dtype)
        for k, x in enumerate(arrays):
            for index, data in _snapshots.owned_shards(x):
                host = np.asarray(data)
                if host.dtype != stored:
                    host = _casting.astype(host, stored)
                for j, box, values in _export_plan.shard_boxes(link, k, index, host, shapes):
                    key = link.torch[j]
                    if key not in tied:
                        yield _pieces.tensor_pieces(plan, key, [(box, values)])
        return
    for j, key in enumerate(link.torch):  # re-laid-out on the devices, one tensor at a time
        if key in tied:
            continue
        entry = plan.locate(key)[1]
        shape, dtype = tuple(entry.shape), _dtypes.to_numpy(entry.dtype)
        for start, value in relaid_rows(link, arrays, j, shape, dtype, band_bytes):
            # (done on every local device, those this process reads nothing from too, before
            # the next collective: compat.multihost says why)
            value.block_until_ready()
            owned: _snapshots.HostCopies = []
            for index, data in _snapshots.owned_shards(value):
                if index:  # (rows start..: the band's boxes placed in the whole tensor)
                    first = slice(index[0].start + start, index[0].stop + start)
                    index = (first, *index[1:])
                owned.append((index, np.asarray(data)))
            if owned:
                yield _pieces.tensor_pieces(plan, key, owned)
            del value, owned


def relayout_band(batch_bytes: int) -> int:
    """Bytes of a PyTorch tensor per process that one re-layout on the devices moves at most
    (:func:`relaid_rows`): a quarter of the batch, since a re-layout holds its input, the
    exchanged blocks and its output at once."""
    return max(1, batch_bytes // 4)


def relaid_rows(
    link: _links.Link,
    arrays: Sequence[Any],
    j: int,
    shape: tuple[int, ...],
    dtype: np.dtype | None = None,
    band_bytes: int | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(first row, value)``: ``link.torch[j]`` (of ``shape``) re-laid out on the devices
    (:func:`relaid`). Where the link has one Flax tensor, one slot per PyTorch tensor and the
    Flax tensor is not split along its stacked axes, from that slot alone (a slice of each
    device's shard): every slot of the link then shares one compiled re-layout, where
    :func:`relaid` compiles one per slot. And with ``band_bytes``, where the link maps boxes
    on their own (``export_plan.commutes``) and the slot is not split along its rows either,
    a band of rows at a time, about ``band_bytes`` per process: the re-layout holds its input,
    the exchanged blocks and its output at once, of a band rather than of the whole tensor.
    Every process calls it alike (collectives)."""
    rows = _slot_rows(link, arrays, shape, dtype, band_bytes)
    if rows is None:
        yield 0, relaid(link, arrays, j, shape, dtype)
        return
    (x,) = arrays
    fshape = tuple(int(d) for d in x.shape)
    box = [slice(0, d) for d in fshape]
    gather = link.flax_gather
    for axis, i in zip(gather.stack_axes(len(fshape)), gather.slots[j]):
        box[axis] = slice(i, i + 1)
    one = _links.Link(link.rule, link.flax, (link.torch[j],), tuple((n, 1) for n, _ in link.counts))
    if not shape or rows >= shape[0]:
        yield 0, relaid(one, [_band_array(x, tuple(box))], 0, shape, dtype)
        return
    row_axis = _export_plan.row_axis(link, [fshape])
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        box[row_axis] = slice(start, stop)
        band = _band_array(x, tuple(box))
        yield start, relaid(one, [band], 0, (stop - start, *shape[1:]), dtype)


def _slot_rows(
    link: _links.Link,
    arrays: Sequence[Any],
    shape: tuple[int, ...],
    dtype: np.dtype | None,
    band_bytes: int | None,
) -> int | None:
    # Rows of ``link``'s PyTorch tensor of ``shape`` per band, from the slot alone (all of
    # them: the slot whole), or None to re-lay out the whole link's arrays (see relaid_rows).
    # Bands of rows divide the rows evenly (one shape: one compiled re-layout), a multiple of
    # the device count where one does (each band split over every device by its rows). From
    # global facts only: every process decides alike.
    if len(arrays) != 1 or not link.torch_gather.trivial or link.flax_gather.fused is not None:
        return None
    (x,) = arrays
    fshape = tuple(int(d) for d in x.shape)
    held = x.sharding.shard_shape(fshape)
    stacked = link.flax_gather.stack_axes(len(fshape))
    if any(held[a] != fshape[a] for a in stacked):  # (split there: a slot is not a global array)
        return None
    whole = shape[0] if shape else 0
    rows = whole
    if band_bytes is not None and whole and _export_plan.commutes(link, [fshape]):
        row_axis = _export_plan.row_axis(link, [fshape])
        if held[row_axis] == fshape[row_axis]:
            itemsize = max(np.dtype(x.dtype).itemsize, (dtype or np.dtype(x.dtype)).itemsize)
            most = max(1, band_bytes * jax.process_count() // (itemsize * math.prod(shape[1:])))
            rows = _even_rows(whole, most, len(jax.devices()))
    if rows >= whole and not stacked:  # (nothing to cut: the link's arrays as they are)
        return None
    return rows


def _even_rows(total: int, most: int, devices: int) -> int:
    # At most ``most`` rows of ``total``, dividing it (one shape: one compiled re-layout): the
    # largest multiple of ``devices`` that does, else the largest divisor.
    if most >= total:
        return total
    for rows in range(most - most % devices, 0, -devices):
        if total % rows == 0:
            return rows
    return next(rows for rows in range(most, 0, -1) if total % rows == 0)


def _band_array(x: jax.Array, box: tuple[slice, ...]) -> jax.Array:
    # ``x[box]`` as a global array sharded as ``x`` is, from slices of this process's shards
    # (``box`` cuts only axes ``x`` is not split along).
    shape = tuple(s.stop - s.start for s in box)
    pieces = []
    for shard in x.addressable_shards:
        index = _runs.normalize_index(shard.index, x.shape)
        starts = [max(b.start, i.start) - i.start for b, i in zip(box, index)]
        sizes = [min(b.stop, i.stop) - max(b.start, i.start) for b, i in zip(box, index)]
        # (start indices as operands: one compiled slice serves every slot and band)
        pieces.append(jax.lax.dynamic_slice(shard.data, starts, sizes))
    return jax.make_array_from_single_device_arrays(shape, x.sharding, pieces)


# A shard whose bytes in the PyTorch tensor are many runs (MANY_RUNS or more) shorter than
# MIN_RUN_BYTES (a kernel sharded along its input axis is a column stripe of the transposed
# weight: one short run per row) is re-laid out on the devices into row blocks instead: one
# collective, then one range per process, where each run would cost a piece, a write call and
# its bookkeeping. A few runs cost less than a collective's round trip.
MIN_RUN_BYTES = 64 << 10
MANY_RUNS = 256


def _small_runs(
    plan: _plan.CheckpointPlan,
    link: _links.Link,
    arrays: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    tied: Mapping[str, str],
) -> bool:
    # Decided from the arrays' shardings (a shard of each, by its box: the same answer on
    # every process, as the collective of a re-layout needs), not from the owned shards.
    for k, x in enumerate(arrays):
        index = next(iter(x.sharding.devices_indices_map(shapes[k]).values()))
        box = _runs.normalize_index(index, shapes[k])
        no_data = np.broadcast_to(np.zeros((), np.uint8), tuple(s.stop - s.start for s in box))
        for j, torch_box, _ in _export_plan.shard_boxes(link, k, box, no_data, shapes):
            key = link.torch[j]
            if key in tied:
                continue
            entry = plan.locate(key)[1]
            try:
                offsets, length = _runs.byte_runs(entry.dtype, entry.shape, torch_box)
            except ValueError:  # (a sub-byte run off whole bytes: the devices re-lay it out)
                return True
            if length < MIN_RUN_BYTES and len(offsets) >= MANY_RUNS:
                return True
    return False


def relaid(
    link: _links.Link,
    arrays: Sequence[Any],
    j: int,
    shape: tuple[int, ...],
    dtype: np.dtype | None = None,
) -> Any:
    """``link.torch[j]`` (of ``shape``) computed from the Flax ``arrays`` on the devices and
    laid out over every device of the job (``export_plan.spread_sharding``): a collective,
    which every process calls in the same order. With ``dtype``, a float cast between
    float32, bfloat16 and float16 is made first, on the devices (XLA's conversion, the one
    ``core/astype`` reproduces on the host): narrower tensors move between processes.

    Raises:
      ValueError: naming the link when its transform does not run on ``jax.Array``s.
    """
    sources = {np.dtype(a.dtype) for a in arrays}
    cast = dtype if dtype is not None and sources | {dtype} <= _DEVICE_CASTS else None
    try:
        return _relayout(link.anonymous(), j, shape, cast)(list(arrays))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{', '.join(link.flax)} -> {link.torch[j]}: the rule's transform "
            f"{link.rule.transform!r} does not run on sharded jax.Arrays ({e}); "
            "use Transpose, Reshape, SplitHeads or Chain of them"
        ) from e


_DEVICE_CASTS = frozenset(np.dtype(d) for d in ("float32", "float16", ml_dtypes.bfloat16))


@functools.lru_cache(maxsize=1024)
def _relayout(
    link: _links.Link, j: int, shape: tuple[int, ...], cast: np.dtype | None = None
) -> Any:
    # One jitted function per link output, shape and cast, kept across calls: a save that
    # publishes every step compiles each re-layout once, not at every step.
    def value(arrays: list[Any]) -> Any:
        if cast is not None:
            arrays = [a.astype(cast) for a in arrays]
        return _export_plan.device_value(link, arrays, j=j)

    return jax.jit(value, out_shardings=_export_plan.spread_sharding(shape))
