"""What each process of an export reads from a checkpoint, decided from global facts only
(shapes, stored chunks, rules), so that every process decides alike.

A tensor is either **read sharded**: every process reads its boxes of it under a sharding
over every device of the job (then written as sharded arrays are: ``sharded_export``), or
part of a link **read whole** by one process, its owner, which reads the link's tensors
whole and writes every piece of them, or part of a link **read in bands** (below). What a
source can read sharded:

- safetensors files (``chunks`` None): any box, as byte ranges; each tensor is split over the
  devices along the axis that becomes the PyTorch tensors' rows
  (``export_plan.spread_sharding``);
- an Orbax-native item (``chunks``: each tensor's stored chunk shape): a box of whole chunks
  only (a chunk is compressed: part of one costs all of it). A tensor is split along an axis
  where every process's box is made of whole chunks: over every device, else over the
  processes (each process's devices then share one box, read once), the rows' axis first;
  a multi-process save stores each device's shard as one chunk, so such an axis exists for
  the checkpoints of a sharded training job. A tensor with none (one chunk: a
  one-process save of a small or replicated array) is read whole;
- a source with no sharded reads (Flax msgpack) reads every link whole.

Links read whole (and those that merge LoRA adapters, which read the adapters beside the
kernel, or hold a dtype the devices would change: float64 without ``jax_enable_x64``) go
to owners largest first, each to the process with the fewest bytes so far: each
process reads and writes about its share, plus at most the largest such link.

**Bands** (:func:`plan_bands`, an Orbax-native item): a stacked link (MaxText's scanned
layers, ``(emb, L, heads, head_dim)``; experts, ``(experts, L, emb, mlp)``) is read a band
of slots at a time where its stored chunks allow it (in one process, only one larger than the
budget, half the export's ``batch_bytes``): a range of one Flax-side stacked placeholder's
values, cut at the stored chunks' boundaries along its axis in every Flax tensor of the link,
each process its own even share of the chunks; the process computes the band's PyTorch
tensors on the host alone (``Link.band``: any rule, one slot at a time) and writes them,
then drops the band. A band holds at most the budget, or one chunk along that axis where a
chunk is larger; no collective runs, and every process reads and writes its share of the
link. Where no stacked axis has chunk boundaries that split evenly over the processes (a
training job's FSDP save: each chunk is a device's shard of every layer), the link is read as
above, a process's whole share at once: a band of layers would read (and decompress) each
chunk once per band.

:func:`read_units` lists what one process reads, in order: batches of links of at most the
budget, and the bands of a banded link one by one, each with the bytes the process holds for
it; ``sharded_export.read_ahead`` reads one ahead while both fit in ``batch_bytes``. So what a
process holds of the source is at most ``batch_bytes``, except where the checkpoint's chunks
do not let a link be cut: a band one chunk thick larger than the budget, a link read sharded
(this process's whole share of it) or read whole (by its owner) larger than the budget; such
a unit is read with nothing ahead of it.

Example::

    reads = plan_reads(links, infos, chunks={"w": (8, 64)}, processes=2)
    reads.shardings["w"]          # split over the devices along a whole-chunk axis
    reads.owners.get("norm")      # the process that reads the norm whole
    bands = plan_bands(links, infos, chunks, processes=2, budget=64 << 20)
    bands["layers.w"].of_process[1]   # ((16, 24), (24, 32)): process 1's bands of layers
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.integrations import export_plan as _export_plan
from orbax_safetensors._src.integrations.links import Link

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

    def writer(self, link: Link, default: int) -> int:
        """The process that writes ``link``'s host values: its owner if it is read whole,
        else ``default``."""
        return self.owners.get(link.flax[0], default)


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
    if sharded and chunks is not None and budget is not None:
        bands = plan_bands(links, infos, chunks, processes=processes, budget=budget, whole=whole)
    for link in links:
        if link.flax[0] in bands:
            continue
        shapes = [tuple(infos[n].shape) for n in link.flax]
        first = _export_plan.row_axis(link, shapes)
        got = {}
        exact = all(device_exact(infos[n].dtype) for n in link.flax)
        if sharded and exact and not any(n in whole for n in link.flax):
            for n, shape in zip(link.flax, shapes):
                if chunks is None:
                    got[n] = _export_plan.spread_sharding(shape, first)
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
    ``whole`` (LoRA kernels) are not banded.

    Example::

        # (emb, layers, mlp) = (256, 16, 1024) float32, stored in chunks of 2 layers
        plan_bands([link], infos, {"w": (256, 2, 1024)}, processes=2, budget=4 << 20)
        # {"w": Bands("i", (((0, 4), (4, 8)), ((8, 12), (12, 16))))}
    """
    out: dict[str, Bands] = {}
    for link in links:
        stacks = link.flax_gather.stacks
        if not stacks or any(n in whole or n not in chunks for n in link.flax):
            continue
        shapes = [tuple(int(d) for d in infos[n].shape) for n in link.flax]
        total = sum(int(infos[n].nbytes) for n in link.flax)
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


@dataclasses.dataclass(frozen=True)
class ReadUnit:
    """One read of a process's share of an export, in :func:`read_units`' order.

    Attributes:
      links: the links written from it: a batch of the job's links, or one band of a banded
        link (``Link.band``).
      names: the Flax names it reads.
      boxes: for a band, the box of each name read; None: each name as the plan reads it
        (sharded, or whole by its owner).
      nbytes: the bytes this process holds for it.
      done: the job's links whose pieces are all out once it is written.
    """

    links: tuple[Link, ...]
    names: tuple[str, ...]
    boxes: Mapping[str, Box] | None
    nbytes: int
    done: tuple[Link, ...]


def read_units(
    links: Sequence[Link],
    infos: Mapping[str, Any],
    reads: ReadPlan,
    process: int,
    budget: int,
    held: Any,
) -> list[ReadUnit]:
    """What process ``process`` reads of ``links``, in order: the links not banded in batches
    of at most ``budget`` bytes of Flax tensors (a larger link alone; ``held(name)``: the
    bytes this process holds of one of them, as ``reads`` reads it), and each band of a
    banded link as a unit of its own (``reads.bands``: this process's bands only, none when
    it has none). Every process lists the units of the links not banded alike."""
    out: list[ReadUnit] = []
    group: list[Link] = []
    used = 0

    def flush() -> None:
        nonlocal group, used
        if group:
            names = tuple(sorted({n for link in group for n in link.flax}))
            nbytes = sum(int(held(n)) for n in names)
            out.append(ReadUnit(tuple(group), names, None, nbytes, tuple(group)))
        group, used = [], 0

    for link in links:
        bands = reads.bands.get(link.flax[0])
        if bands is None:
            size = sum(int(infos[n].nbytes) for n in link.flax)
            if group and used + size > budget:
                flush()
            group.append(link)
            used += size
            continue
        flush()
        shapes = [tuple(int(d) for d in infos[n].shape) for n in link.flax]
        mine = bands.of_process[process]
        if not mine:
            out.append(ReadUnit((), (), {}, 0, (link,)))
        for i, band in enumerate(mine):
            boxes = dict(zip(link.flax, bands.boxes(link, shapes, band)))
            nbytes = sum(
                _dtypes.nbytes(infos[n].dtype, tuple(s.stop - s.start for s in boxes[n]))
                for n in link.flax
            )
            done = (link,) if i == len(mine) - 1 else ()
            band_link = link.band(bands.placeholder, *band)
            out.append(ReadUnit((band_link,), link.flax, boxes, nbytes, done))
    flush()
    return out


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
    size = {id(link): sum(int(infos[n].nbytes) for n in link.flax) for link in links}
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
