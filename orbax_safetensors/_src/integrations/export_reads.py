"""What each process of an export reads of a checkpoint, decided from global facts only
(shapes, stored chunks, rules) so that every process decides alike: a tensor read sharded,
read whole by its owner, or read in bands of layers (:func:`plan_reads`,
:func:`plan_bands`), and the reads themselves (:meth:`TableReads.units`, as the engine's units).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations.links import Link
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import relayout as _relayout

Shape = tuple[int, ...]
Box = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class Bands:
    """A link read in bands: ``placeholder`` (one of its Flax-side stacked placeholders) and,
    for each process, its bands: ranges ``[start, stop)`` of the placeholder's values, each
    made of whole stored chunks along the placeholder's axis in every Flax tensor of the
    link."""

    placeholder: str
    of_process: tuple[tuple[tuple[int, int], ...], ...]

    def boxes(self, link: Link, shapes: Sequence[Shape], band: tuple[int, int]) -> list[Box]:
        """The box of the band ``band`` in each Flax tensor of ``link`` (of ``shapes``)."""
        axis = next(a for n, a, _ in link.flax_gather.stacks if n == self.placeholder)
        out = []
        for shape in shapes:
            box = [slice(0, int(d)) for d in shape]
            box[axis % len(shape)] = slice(*band)
            out.append(tuple(box))
        return out


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """``shardings``: the Flax names read sharded, with the sharding each is read under;
    ``owners``: every Flax name of a link read whole, with the process that reads it and
    writes its link; ``bands``: the links read in bands, by their first Flax name."""

    shardings: Mapping[str, Any]
    owners: Mapping[str, int]
    bands: Mapping[str, Bands] = dataclasses.field(default_factory=dict)


def plan_reads(
    links: Sequence[Link],
    infos: Mapping[str, Any],
    *,
    chunks: Mapping[str, Shape] | None,
    processes: int,
    whole: Collection[str] = (),
    sharded: bool = True,
    budget: int | None = None,
) -> ReadPlan:
    """The :class:`ReadPlan` of ``links`` (``infos``: the Flax tensors' ``TensorInfo`` s) over
    ``processes``: ``chunks`` None for a source that reads any box, else each tensor's stored
    chunk shape; links with a name in ``whole`` (LoRA kernels) are read whole, so is every
    link when not ``sharded``; with ``budget`` and ``chunks``, the links :func:`plan_bands`
    bands are read in bands (see the module docstring)."""
    shardings: dict[str, Any] = {}
    read_whole: list[Link] = []
    bands: dict[str, Bands] = {}
    if chunks is not None and budget is not None:
        bands = plan_bands(links, infos, chunks, processes=processes, budget=budget, whole=whole)
    for link in links:
        if link.flax[0] in bands:
            continue
        shapes = [tuple(infos[n].shape) for n in link.flax]
        first = _links.row_axis(link, shapes)
        got = {}
        exact = all(device_exact(infos[n].dtype) for n in link.flax)
        if sharded and exact and not any(n in whole for n in link.flax):
            for n, shape in zip(link.flax, shapes):
                if chunks is None:
                    got[n] = _relayout.spread_sharding(shape, first)
                else:
                    got[n] = chunk_aligned_sharding(shape, chunks.get(n, shape), first)
        if got and all(s is not None for s in got.values()):
            shardings.update(got)
        else:
            read_whole.append(link)
    return ReadPlan(shardings, balanced_owners(read_whole, infos, processes), bands)


def plan_bands(
    links: Sequence[Link],
    infos: Mapping[str, Any],
    chunks: Mapping[str, Shape],
    *,
    processes: int,
    budget: int,
    whole: Collection[str] = (),
) -> dict[str, Bands]:
    """The links of ``links`` read in bands (by first Flax name) and their :class:`Bands`:
    those with a Flax-side stack (of more than ``budget`` bytes for one process), banded along
    the first stacked placeholder whose axis has chunk boundaries (``chunks``: each Flax
    tensor's stored chunk shape) that split it evenly over the ``processes``; each band of
    whole chunks of at most ``budget`` bytes where a chunk is not larger. Links with a name in
    ``whole`` (LoRA kernels) are not banded."""
    out: dict[str, Bands] = {}
    for link in links:
        stacks = link.flax_gather.stacks
        if not stacks or any(n in whole or n not in chunks for n in link.flax):
            continue
        shapes = [tuple(int(d) for d in infos[n].shape) for n in link.flax]
        total = _flax_bytes(link, infos)
        if processes == 1 and total <= budget:  # it fits a band: read as the others are
            continue
        for placeholder, axis, count in stacks:
            unit = 1  # the slots of one stored chunk along the axis, in every Flax tensor
            for n, shape in zip(link.flax, shapes):
                if not -len(shape) <= axis < len(shape):
                    break
                unit = math.lcm(unit, int(chunks[n][axis % len(shape)]))
            else:
                units = -(-count // unit) if count else 0
                if units == 0 or units % processes:
                    continue
                per = units // processes
                unit_bytes = -(-total * unit // count)
                step = max(1, budget // max(1, unit_bytes))  # chunks along the axis per band
                out[link.flax[0]] = Bands(
                    placeholder,
                    tuple(
                        tuple(
                            (u * unit, min(count, min(u + step, (p + 1) * per) * unit))
                            for u in range(p * per, (p + 1) * per, step)
                        )
                        for p in range(processes)
                    ),
                )
                break
    return out


def _flax_bytes(link: Link, infos: Mapping[str, Any]) -> int:
    return sum(int(infos[n].nbytes) for n in link.flax)


def device_exact(dtype: str) -> bool:
    """Whether arrays of the safetensors ``dtype`` go onto this JAX's devices unchanged (not
    float64 or int64 canonicalised to 32 bits without ``jax_enable_x64``, not an ml_dtypes
    type the devices lack): else a tensor is read whole, as host values."""
    import jax

    np_dtype = _dtypes.to_numpy(dtype)
    return bool(
        jax.dtypes.canonicalize_dtype(np_dtype) == np_dtype and _jaxcompat.device_holds(np_dtype)
    )


def balanced_owners(
    links: Sequence[Link], infos: Mapping[str, Any], processes: int
) -> dict[str, int]:
    """Each Flax name of ``links`` with the process that reads its link whole: links largest
    first (ties in order), each to the process with the fewest bytes so far (ties: the lowest
    index)."""
    load = [0] * max(1, processes)
    owners: dict[str, int] = {}
    size = {id(link): _flax_bytes(link, infos) for link in links}
    for link in sorted(links, key=lambda link: -size[id(link)]):  # (a stable sort)
        p = load.index(min(load))
        load[p] += size[id(link)]
        owners.update(dict.fromkeys(link.flax, p))
    return owners


def chunk_aligned_sharding(shape: Shape, chunk: Shape, first: int = 0) -> Any:
    """A sharding of a tensor of ``shape`` stored in chunks of ``chunk`` that splits one axis
    over the job so that every process's box is made of whole chunks, or None when no axis
    does: axis ``first``, then the others in order; over every device (``jax.devices()``
    order), else over the processes (a process's devices share its box)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if not shape or 0 in shape or len(chunk) != len(shape):
        return None
    devices = jax.devices()
    meshes = [(Mesh(np.array(devices), ("devices",)), "devices")]
    grid = _process_grid(devices)
    if grid is not None:
        meshes.append((Mesh(grid, ("processes", "local")), "processes"))
    for axis in [first, *(a for a in range(len(shape)) if a != first)]:
        if axis >= len(shape):
            continue
        for mesh, name in meshes:
            count = mesh.shape[name]
            if count > 1 and shape[axis] % count == 0 and (shape[axis] // count) % chunk[axis] == 0:
                return NamedSharding(mesh, PartitionSpec(*([None] * axis), name))
    return None


def _process_grid(devices: Sequence[Any]) -> Any:
    # The devices as a (processes, devices of each) array, by process index; None when the
    # processes hold different numbers of devices.
    by_process: dict[int, list[Any]] = {}
    for d in devices:
        by_process.setdefault(int(d.process_index), []).append(d)
    rows = [by_process[p] for p in sorted(by_process)]
    if len({len(r) for r in rows}) != 1:
        return None
    return np.array(rows)


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class TableReads:
    """What process ``me`` reads of ``table`` as ``plan`` plans (``host``: a lone process's
    in-memory values made host arrays), each LoRA kernel of ``merges`` with its adapters."""

    table: _flax_tables.FlaxTable
    plan: ReadPlan
    me: int
    host: bool
    merges: Mapping[str, tuple[str, str]]

    def held(self, name: str) -> int:
        """The bytes this process holds of Flax tensor ``name``: its devices' distinct boxes
        of one read sharded, the whole tensor if it reads it whole (in memory: every
        process), else none."""
        info = self.table.infos[name]
        sharding = self.plan.shardings.get(name)
        if sharding is None:
            mine = self.table.source is None or self.plan.owners.get(name) == self.me
            return int(info.nbytes) if mine else 0
        boxes = {
            tuple((s.start, s.stop) for s in _runs.normalize_index(index, info.shape))
            for index in sharding.addressable_devices_indices_map(info.shape).values()
        }
        return sum(_dtypes.nbytes(info.dtype, tuple(b - a for a, b in box)) for box in boxes)

    def read(self, names: Sequence[str], boxes: Mapping[str, Box] | None) -> dict[str, Any]:
        """This process's values of ``names`` and their LoRA adapters (no collective: a
        reading thread's): a band's ``boxes`` as host arrays (``OrbaxSource.read_box``);
        global arrays of those read sharded; host arrays of those it reads whole (in memory:
        the values, host arrays with ``host``); None for the others'."""
        table, plan = self.table, self.plan
        names = [*names, *(a for n in names if n in self.merges for a in self.merges[n])]
        if table.source is None:
            return table.read(names) if self.host else {n: table.values[n] for n in names}
        source, prefix = table.source, table.prefix
        if boxes is not None:
            return {n: source.read_box(prefix + n, boxes[n]) for n in names}
        sharded = [n for n in names if n in plan.shardings]
        mine = [n for n in names if plan.owners.get(n) == self.me]
        out: dict[str, Any] = dict.fromkeys(names)
        if sharded and isinstance(source, _sources.OrbaxSource):
            got = source.read_sharded(
                [prefix + n for n in sharded], {prefix + n: plan.shardings[n] for n in sharded}
            )
            out.update({n: got[prefix + n] for n in sharded})
        elif sharded:
            requests = [
                _read.ReadRequest(
                    source.stored[prefix + n], kind=_read.ReadKind.JAX, sharding=plan.shardings[n]
                )
                for n in sharded
            ]
            out.update(zip(sharded, _read.read_tensors(requests)))
        if mine:
            out.update(table.read(mine))
        return out

    def units(
        self, links: Sequence[Link], budget: int, group_of: Callable[[Link], _export.ExportGroup]
    ) -> list[_export.Unit]:
        """What this process reads of ``links``, in order, as the export engine's units: the
        links not banded in batches of at most ``budget`` bytes of Flax tensors (a larger link
        alone; every process lists them alike), and each of this process's bands of a banded
        link; ``group_of(link)``: a link's group (a band's too)."""
        infos, read, held = self.table.infos, self.read, self.held
        out: list[_export.Unit] = []
        group: list[Link] = []
        used = 0

        def flush() -> None:
            nonlocal group, used
            if group:
                names = tuple(sorted({n for link in group for n in link.flax}))
                groups = tuple(group_of(link) for link in group)
                unit = functools.partial(read, names, None)
                out.append(_export.Unit(groups, unit, sum(int(held(n)) for n in names), groups))
            group, used = [], 0

        for link in links:
            bands = self.plan.bands.get(link.flax[0])
            if bands is None:
                size = _flax_bytes(link, infos)
                if group and used + size > budget:
                    flush()
                group.append(link)
                used += size
                continue
            flush()
            shapes = [tuple(int(d) for d in infos[n].shape) for n in link.flax]
            mine = bands.of_process[self.me]
            if not mine:
                out.append(_export.Unit((), dict, 0, (group_of(link),)))
            for i, band in enumerate(mine):
                boxes = dict(zip(link.flax, bands.boxes(link, shapes, band)))
                nbytes = sum(
                    _dtypes.nbytes(infos[n].dtype, tuple(s.stop - s.start for s in boxes[n]))
                    for n in link.flax
                )
                done = (group_of(link),) if i == len(mine) - 1 else ()
                band_group = group_of(link.band(bands.placeholder, *band))
                unit = functools.partial(read, link.flax, boxes)
                out.append(_export.Unit((band_group,), unit, nbytes, done))
        flush()
        return out


def table_reads(
    table: _flax_tables.FlaxTable,
    links: Sequence[Link],
    *,
    merges: Mapping[str, tuple[str, str]],
    budget: int,
) -> TableReads:
    """What this process reads of ``table``'s ``links``: in memory, its own values; of a
    checkpoint, :func:`plan_reads` (one process reads every link whole, a stacked link of an
    Orbax-native item larger than ``budget`` in bands), the LoRA kernels of ``merges`` whole
    and their adapters by the kernel's reader."""
    import jax

    me, processes = jax.process_index(), jax.process_count()
    source, prefix = table.source, table.prefix
    plan = ReadPlan({}, {})
    if source is not None:
        chunks = None
        if isinstance(source, _sources.OrbaxSource):
            chunks = {n: source.chunks[prefix + n] for n in table.infos}
        sharded = processes > 1 and isinstance(
            source, (_sources.SafetensorsSource, _sources.OrbaxSource)
        )
        plan = plan_reads(
            links, table.infos, chunks=chunks, processes=processes, whole=merges,
            sharded=sharded, budget=budget,
        )  # fmt: skip
        owners = dict(plan.owners)  # (an adapter is read by its kernel's reader)
        for kernel, pair in merges.items():
            if kernel in owners:
                owners.update(dict.fromkeys(pair, owners[kernel]))
        plan = dataclasses.replace(plan, owners=owners)
    return TableReads(table, plan, me, processes == 1, merges)
