"""What each process of a multi-process export reads from a checkpoint, decided from global
facts only (shapes, stored chunks, rules), so that every process decides alike.

A tensor is either **read sharded**: every process reads its boxes of it under a sharding
over every device of the job (then written as sharded arrays are: ``sharded_export``), or
part of a link **read whole** by one process, its owner, which reads the link's tensors
whole and writes every piece of them. What a source can read sharded:

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

Example::

    reads = plan_reads(links, infos, chunks={"w": (8, 64)}, processes=2)
    reads.shardings["w"]          # split over the devices along a whole-chunk axis
    reads.owners.get("norm")      # the process that reads the norm whole
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.integrations import export_plan as _export_plan
from orbax_safetensors._src.integrations.links import Link

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """``shardings``: the Flax names read sharded, with the sharding each is read under;
    ``owners``: every other Flax name (of a link read whole) with the process that reads it
    and writes its link."""

    shardings: Mapping[str, Any]
    owners: Mapping[str, int]

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
) -> ReadPlan:
    """The :class:`ReadPlan` of ``links`` (``infos``: the Flax tensors' ``TensorInfo`` s) over
    ``processes``: ``chunks`` None for a source that reads any box, else each tensor's stored
    chunk shape; links with a name in ``whole`` (LoRA kernels) are read whole, so is every
    link when not ``sharded`` (see the module docstring)."""
    shardings: dict[str, Any] = {}
    read_whole: list[Link] = []
    for link in links:
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
    return ReadPlan(shardings, balanced_owners(read_whole, infos, processes))


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
