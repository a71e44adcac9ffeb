"""A save whose files hold other tensors than the tree's: an :class:`ExportPlan`, and the write
pieces it gives.

A save with an export plan (``SafetensorsSave(item, mapping=...)``: a Hugging Face model
directory) snapshots the tree's arrays as any save does, then, on the writer's thread, turns
them into the plan's output tensors one :class:`ExportGroup` at a time (renames, transposes,
stacked layers split, fused projections split, adapters merged: whatever the group's
``apply`` does to host arrays) and writes those, cast to their planned dtype as they are
written. The plan is neutral: it names no mapping type. ``integrations/`` compiles a
``KeyMapping`` into one (``integrations/publish.py``), and the save machinery below knows
only this module.

With several processes each writes only its own bytes, without gathering the tree: each
group takes the :class:`Route` that global facts give it (:func:`routes`): its ``per_shard``
maps each owned shard to boxes of the outputs on the writer's thread, or its ``on_devices``
re-lays the outputs out over the devices during the snapshot (a collective), or, for
host-local sources, the primary runs ``apply``. The snapshot (:func:`snapshot_items`) makes
the collective steps first, in the same order on every process.

Example::

    plan = ExportPlan(
        outputs=(TensorSpec("w.weight", "F32", (3, 2)),),
        groups=(ExportGroup(("w.kernel",), ("w.weight",), lambda xs: [xs[0].T]),),
        header_metadata={"format": "pt"},
    )
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.compat import multihost as _multihost
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import interface as _interface

Box = tuple[slice, ...]
# (source position in ExportGroup.sources, its shard's box, the shard's host values, the
# group's ``whole`` sources by name) -> [(output name, box inside the output, values)]
PerShard = Callable[
    [int, Box, np.ndarray, Mapping[str, np.ndarray]], Iterable[tuple[str, Box, Any]]
]


@dataclasses.dataclass(frozen=True)
class ExportGroup:
    """Output tensors ``outputs`` computed from the tree's tensors ``sources`` (dotted names)
    by ``apply`` (host arrays in ``sources`` order -> host arrays in ``outputs`` order, an
    iterator: each is written before the next is asked for).

    A save by several processes (each writes only its own bytes) also needs one of:

    - ``per_shard``: maps one shard of a source on its own to boxes of the outputs (renames,
      transposes, stacked layers, fused parts; see :data:`PerShard`); ``whole`` names the
      sources every process then needs whole (LoRA adapters: a rank's columns or rows);
    - ``on_devices``: ``(source arrays in sources order, the whole sources by name) ->``
      the outputs in order, each a ``jax.Array`` laid out over every device of the job, made
      when asked for (collectives: every process iterates them alike).
    """

    sources: tuple[str, ...]
    outputs: tuple[str, ...]
    apply: Callable[[Sequence[np.ndarray]], Iterable[np.ndarray]]
    whole: tuple[str, ...] = ()
    per_shard: PerShard | None = None
    on_devices: Callable[[Sequence[Any], Mapping[str, np.ndarray]], Iterator[Any]] | None = None


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What a save writes instead of the tree's own tensors.

    Attributes:
      outputs: the tensors written (name, stored safetensors dtype, shape), in file order.
      groups: how each output is computed; every output is in exactly one group.
      header_metadata: every file header's ``__metadata__`` (e.g. ``{"format": "pt"}``).
      files: small files the primary writes beside the tensors (``{name: text or bytes}``:
        ``config.json``, ``generation_config.json``, the tokenizer's).
      summary: a short description for ``repr``.
    """

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
        """The outputs as a flat dict of zero-stride arrays of their dtype and shape (no
        memory): what the metadata file's schema describes."""
        return {
            s.name: np.broadcast_to(np.zeros((), _dtypes.to_numpy(s.dtype)), s.shape)
            for s in self.outputs
        }

    @property
    def sources(self) -> frozenset[str]:
        """The tree's tensors the plan reads."""
        return frozenset(n for g in self.groups for n in g.sources)


def whole(copies: _snapshots.HostCopies, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A tensor's host array from its host copies (one whole copy, or shards that tile it)."""
    if len(copies) == 1 and (copies[0][0] is None or tuple(copies[0][1].shape) == shape):
        return copies[0][1].reshape(shape)
    out = np.empty(shape, dtype)
    for index, host in copies:
        box = tuple(index) if index is not None else ()
        out[box] = host.reshape(out[box].shape)
    return out


def export_pieces(
    plan: _plan.CheckpointPlan,
    export: ExportPlan,
    snapshots: Iterable[tuple[str, _snapshots.HostCopies]],
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, np.dtype],
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    """``(file index, pieces)`` of the export's outputs, one output tensor at a time.

    ``snapshots`` yields ``(source name, host copies)`` in any order; a group is applied as
    soon as all its sources are in, and each source's copies are dropped once no group left
    needs them: host memory holds the snapshots not yet consumed plus one group's results.
    """
    waiting: dict[str, list[int]] = {}
    for g, group in enumerate(export.groups):
        for name in group.sources:
            waiting.setdefault(name, []).append(g)
    missing = {g: len(set(group.sources)) for g, group in enumerate(export.groups)}
    users = {name: len(gs) for name, gs in waiting.items()}
    held: dict[str, np.ndarray] = {}

    def run(g: int) -> Iterator[tuple[int, list[_interface.Piece]]]:
        group = export.groups[g]
        values = group.apply([held[n] for n in group.sources])
        for name in set(group.sources):
            users[name] -= 1
            if not users[name]:
                del held[name]
        for name, value in zip(group.outputs, values):
            yield _pieces.tensor_pieces(plan, name, [(None, np.asarray(value))])

    for g, group in enumerate(export.groups):
        if not group.sources:  # (no sources: nothing to wait for)
            yield from run(g)
    for name, copies in snapshots:
        if name not in waiting:
            continue
        held[name] = whole(copies, shapes[name], dtypes[name])
        for g in waiting[name]:
            missing[g] -= 1
            if not missing[g]:
                yield from run(g)
    left = [n for g, k in missing.items() if k for n in export.groups[g].outputs]
    if left:
        raise RuntimeError(f"internal: export outputs never computed: {left[:5]}")


def prepare(
    validated: _checkpoint_save.ValidatedTree,
    export: ExportPlan,
    snapshots: Iterable[tuple[Any, _snapshots.HostCopies]] | None,
    layout: _checkpoint_save.SaveLayout,
    *,
    is_primary: bool = True,
    process_index: int = 0,
    multi_process: bool = False,
) -> _checkpoint_save.PreparedSave:
    """The :class:`~.checkpoint_save.PreparedSave` writing ``export``'s outputs from
    ``validated``'s arrays.

    One process: from ``snapshots`` (host copies by position in ``validated.captured.arrays``,
    as :meth:`PreparedSave.from_snapshots` takes them), or, with None, from the arrays
    themselves, read one group's sources at a time (a direct save).

    ``multi_process``: this process's bytes only (see :func:`sharded_pieces`), from
    ``snapshots`` as :func:`snapshot_items` gives them, or, with None (a direct save; call on
    the caller's thread of every process alike: the device steps are collectives), from the
    arrays' own shards, the device steps made now.
    """
    outputs = _checkpoint_save.validate_save(export.probe_tree(), validated.user_metadata)
    plan, metadata, sizes = _checkpoint_save.plan_tree(outputs, layout, export.header_metadata)
    arrays = validated.flat.arrays
    names = list(arrays)
    shapes = {n: tuple(int(d) for d in a.shape) for n, a in arrays.items()}
    dtypes = {n: np.dtype(a.dtype) for n, a in arrays.items()}
    missing = sorted(export.sources - set(names))
    if missing:
        raise ValueError(f"internal: the export plan reads tensors the tree lacks: {missing[:5]}")
    pieces: Iterable[tuple[int, list[_interface.Piece]]]
    if multi_process:
        if snapshots is None:
            ready = list(device_items(export, arrays, _buffers.BufferArena()))
            snapshots = itertools.chain(ready, source_items(export, arrays, is_primary, None))
        pieces = sharded_pieces(plan, export, arrays, snapshots, is_primary)
    else:
        if snapshots is None:
            order = [n for g in export.groups for n in g.sources]
            named: Iterable[tuple[str, _snapshots.HostCopies]] = (
                (n, [(None, np.asarray(arrays[n]))]) for n in dict.fromkeys(order)
            )
        else:
            named = ((names[i], copies) for i, copies in snapshots)
        pieces = export_pieces(plan, export, named, shapes, dtypes)
    return _checkpoint_save.PreparedSave(
        plan,
        pieces,
        metadata,
        sizes,
        is_primary,
        process_index,
        layout.checksums,
        dict(export.files) if is_primary else {},
    )


# -- several processes, each writing only its own bytes ---------------------------------------


class Route(enum.Enum):
    """How the processes of a job share one group's outputs (decided from global facts)."""

    PRIMARY = "primary"  # host-local sources: the primary computes and writes them whole
    SHARDS = "shards"  # each process maps its own shards (ExportGroup.per_shard)
    DEVICES = "devices"  # re-laid-out on the devices, each process writes its own shards


# Keys of the items a multi-process export's writer takes: (kind, name).
WHOLE, SOURCE, OUTPUT = "whole", "source", "output"


def is_global(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` spread over several processes (not host-local)."""
    return isinstance(x, jax.Array) and not _snapshots.is_host_local(x, True)


def routes(export: ExportPlan, arrays: Mapping[str, Any]) -> list[Route]:
    """Each group's :class:`Route` in a multi-process save of ``arrays``.

    Raises:
      ValueError: naming a group of sharded tensors that neither maps shards nor runs on
        the devices.
    """
    out = []
    for group in export.groups:
        sharded = [is_global(arrays[n]) for n in group.sources if n not in group.whole]
        if not any(sharded):
            out.append(Route.PRIMARY)
        elif all(sharded) and group.per_shard is not None:
            out.append(Route.SHARDS)
        elif group.on_devices is not None:
            out.append(Route.DEVICES)
        else:
            raise ValueError(
                f"{', '.join(group.sources)} -> {', '.join(group.outputs[:3])}: sharded over "
                "several processes, and its transform neither maps shards nor runs on devices"
            )
    return out


def device_items(
    export: ExportPlan, arrays: Mapping[str, Any], buffers: _buffers.BufferArena
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    """The collective steps of a multi-process export, in the same order on every process
    (call on the caller's thread): the ``whole`` sources gathered (small adapters), then each
    ``DEVICES`` output re-laid-out on the devices, one at a time, and its owned shards copied
    to host (``buffers``) before the next."""
    kinds = routes(export, arrays)
    wholes: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(n for g in export.groups for n in g.whole):
        x = arrays[name]
        if is_global(x):
            host = _multihost.process_allgather(x)
        else:
            host = np.array(x)  # (a copy: the caller may donate its arrays after save())
        wholes[name] = host
        yield (WHOLE, name), [(None, host)]
    for group, route in zip(export.groups, kinds):
        if route is not Route.DEVICES:
            continue
        assert group.on_devices is not None
        values = [arrays[n] for n in group.sources]
        for out, value in zip(group.outputs, group.on_devices(values, wholes)):
            on_cpu = any(d.platform == "cpu" for d in value.sharding.device_set)
            try:  # (on CPU a host view shares the buffer deleted below: copied into buffers)
                owned = (out, value, _snapshots.owned_shards(value), on_cpu)
                copies = _snapshots.host_copies(owned, buffers)
            finally:
                value.delete()
            if copies:
                yield (OUTPUT, out), copies


def source_items(
    export: ExportPlan,
    arrays: Mapping[str, Any],
    is_primary: bool,
    buffers: _buffers.BufferArena | None,
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    """The shards this process owns of the sources of ``PRIMARY`` and ``SHARDS`` groups (the
    host-local ones on the primary only): host copies into ``buffers``, or with None views
    read as the writer reaches them (a direct save)."""
    kinds = routes(export, arrays)
    wanted = dict.fromkeys(
        n
        for group, route in zip(export.groups, kinds)
        if route is not Route.DEVICES
        for n in group.sources
        if n not in group.whole
    )
    pairs = [((SOURCE, n), arrays[n]) for n in wanted]
    if buffers is not None:
        yield from _snapshots.iter_snapshots(pairs, is_primary=is_primary, buffers=buffers)
        return
    for owned in _snapshots.owned_tensors(pairs, is_primary):
        yield owned[0], _snapshots.host_copies(owned, None)


def snapshot_items(
    validated: _checkpoint_save.ValidatedTree,
    export: ExportPlan,
    is_primary: bool,
    buffers: _buffers.BufferArena | None,
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    """An async multi-process save's host copies (the caller's thread of every process): the
    device steps (:func:`device_items`), then this process's source shards."""
    arrays = validated.flat.arrays
    buffers = buffers if buffers is not None else _buffers.BufferArena()
    yield from device_items(export, arrays, buffers)
    yield from source_items(export, arrays, is_primary, buffers)


def sharded_pieces(
    plan: _plan.CheckpointPlan,
    export: ExportPlan,
    arrays: Mapping[str, Any],
    items: Iterable[tuple[tuple[str, str], _snapshots.HostCopies]],
    is_primary: bool,
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    """``(file index, pieces)`` of this process's bytes of ``export``'s outputs, from
    ``items`` (:func:`snapshot_items`): ``SHARDS`` groups map each source shard as it comes
    (after the ``whole`` sources, which come first); ``DEVICES`` outputs come as this
    process's shards; ``PRIMARY`` groups run, on the primary, once their sources are in."""
    kinds = routes(export, arrays)
    users: dict[str, list[int]] = {}
    for g, group in enumerate(export.groups):
        for name in dict.fromkeys(n for n in group.sources if n not in group.whole):
            users.setdefault(name, []).append(g)
    wholes: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}
    missing = {
        g: len({n for n in group.sources if n not in group.whole})
        for g, group in enumerate(export.groups)
        if kinds[g] is Route.PRIMARY
    }

    def run(g: int) -> Iterator[tuple[int, list[_interface.Piece]]]:
        group = export.groups[g]
        values = group.apply([held[n] if n in held else wholes[n] for n in group.sources])
        for name, value in zip(group.outputs, values):
            yield _pieces.tensor_pieces(plan, name, [(None, np.asarray(value))])

    if is_primary:
        for g in [g for g, k in missing.items() if not k]:
            yield from run(g)
    for (kind, name), copies in items:
        if kind == WHOLE:
            wholes[name] = copies[0][1]
            continue
        if kind == OUTPUT:
            yield _pieces.tensor_pieces(plan, name, copies)
            continue
        shape = tuple(int(d) for d in arrays[name].shape)
        for g in users.get(name, ()):
            group = export.groups[g]
            if kinds[g] is Route.SHARDS:
                assert group.per_shard is not None
                k = group.sources.index(name)
                for index, host in copies:
                    box = tuple(slice(0, d) for d in shape) if index is None else tuple(index)
                    for out, obox, values in group.per_shard(k, box, host, wholes):
                        piece: _snapshots.HostCopies = [(obox, np.asarray(values))]
                        yield _pieces.tensor_pieces(plan, out, piece)
                continue
            held[name] = whole(copies, shape, np.dtype(arrays[name].dtype))
            missing[g] -= 1
            if not missing[g]:
                yield from run(g)
                for n in export.groups[g].sources:
                    if not any(missing.get(u) for u in users.get(n, ())):
                        held.pop(n, None)  # no group left needs it
    left = [n for g, k in missing.items() if k for n in export.groups[g].outputs]
    if is_primary and left:
        raise RuntimeError(f"internal: export outputs never computed: {left[:5]}")
