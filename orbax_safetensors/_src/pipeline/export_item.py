"""An export plan written as a checkpoint item (``SafetensorsSave(item, mapping=...)``): the
engine's groups fed from a save job's host snapshots (:func:`snapshot_items`) and mapped on its
writer thread (:func:`prepare`), with checksums and metadata as any save.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.pipeline.export import ExportPlan, Route
from orbax_safetensors._src.storage import buffers as _buffers

Pieces = _export.Pieces


# Keys of the items a multi-process save's writer takes: (kind, name).
WHOLE, SOURCE, OUTPUT = "whole", "source", "output"


def snapshot_items(
    validated: _checkpoint_save.ValidatedTree,
    export: ExportPlan,
    is_primary: bool,
    buffers: _buffers.BufferArena | None,
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    """A multi-process save's host copies, on the caller's thread of every process: the
    collectives first, then this process's shards of the sources (into ``buffers``, default a
    fresh arena), keyed ``(WHOLE | OUTPUT | SOURCE, name)``."""
    arrays = validated.flat.arrays
    buffers = buffers if buffers is not None else _buffers.BufferArena()
    yield from _device_items(export, arrays, buffers)
    yield from _source_items(export, arrays, is_primary, buffers)


def _device_items(
    export: ExportPlan, arrays: Mapping[str, Any], buffers: _buffers.BufferArena
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    # In the same order on every process: the whole sources gathered (small adapters), then
    # each DEVICES output re-laid-out, its owned shards copied into buffers, one at a time.
    wholes: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(n for g in export.groups for n in g.whole):
        x = arrays[name]  # (copied: the caller may donate its arrays after save())
        wholes[name] = _jaxcompat.process_allgather(x) if _export.is_global(x) else np.array(x)
        yield (WHOLE, name), [(None, wholes[name])]
    for group in export.groups:
        if _export.route(export, group, arrays, False) is Route.DEVICES:
            for out, copies in _export.device_copies(export, group, arrays, wholes, None, buffers):
                yield (OUTPUT, out), copies


def _source_items(
    export: ExportPlan,
    arrays: Mapping[str, Any],
    is_primary: bool,
    buffers: _buffers.BufferArena | None,
) -> Iterator[tuple[tuple[str, str], _snapshots.HostCopies]]:
    # This process's shards of the HOST and SHARDS groups' sources (host-local ones on the
    # primary only): copies into buffers, or with None views read as the writer reaches them.
    wanted = dict.fromkeys(
        n
        for group in export.groups
        if _export.route(export, group, arrays, False) is not Route.DEVICES
        for n in group.sources
        if n not in group.whole
    )
    pairs = [((SOURCE, n), arrays[n]) for n in wanted]
    if buffers is not None:
        yield from _snapshots.iter_snapshots(pairs, is_primary=is_primary, buffers=buffers)
        return
    for owned in _snapshots.owned_tensors(pairs, is_primary):
        yield owned[0], _snapshots.host_copies(owned, None)


def whole(copies: _snapshots.HostCopies, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A tensor's host array from its host copies (one whole copy, or shards that tile it)."""
    if len(copies) == 1 and (copies[0][0] is None or tuple(copies[0][1].shape) == shape):
        return copies[0][1].reshape(shape)
    out = np.empty(shape, dtype)
    for index, host in copies:
        box = tuple(index) if index is not None else ()
        out[box] = host.reshape(out[box].shape)
    return out


def _snapshot_pieces(
    plan: _plan.CheckpointPlan,
    export: ExportPlan,
    arrays: Mapping[str, Any],
    items: Iterable[tuple[tuple[str, str], _snapshots.HostCopies]],
    is_primary: bool,
    wholes_first: bool,
) -> Iterator[Pieces]:
    # Pieces from host copies in any order: a SHARDS group maps each source shard as it comes
    # (the whole sources come first); a HOST group runs on the primary once its sources are
    # in (the whole ones too, unless wholes_first), each source dropped once no group left
    # needs it: host memory holds the copies not yet consumed and one group's results.
    kinds = [_export.route(export, g, arrays, False) for g in export.groups]
    users: dict[str, list[int]] = {}
    missing: dict[int, int] = {}
    for g, group in enumerate(export.groups):
        mine = [n for n in dict.fromkeys(group.sources) if not (wholes_first and n in group.whole)]
        for name in mine:
            users.setdefault(name, []).append(g)
        if kinds[g] is Route.HOST:
            missing[g] = len(mine)
    left = {n: sum(kinds[g] is Route.HOST for g in gs) for n, gs in users.items()}
    wholes: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}

    def run(g: int) -> Iterator[Pieces]:
        group = export.groups[g]
        values = group.apply([held[n] if n in held else wholes[n] for n in group.sources])
        for name in dict.fromkeys(n for n in group.sources if n in held):
            left[name] -= 1
            if not left[name]:
                del held[name]
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
        x = arrays[name]
        for g in users.get(name, ()):
            if kinds[g] is Route.SHARDS:
                k = export.groups[g].sources.index(name)
                yield from _export.shard_pieces(plan, export, export.groups[g], k, copies, wholes)
                continue
            if name not in held:
                held[name] = whole(copies, tuple(int(d) for d in x.shape), np.dtype(x.dtype))
            missing[g] -= 1
            if not missing[g] and is_primary:
                yield from run(g)
    never = [n for g, k in missing.items() if k for n in export.groups[g].outputs]
    if is_primary and never:
        raise RuntimeError(f"internal: export outputs never computed: {never[:5]}")


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
    """The ``PreparedSave`` of this process's bytes of ``export``'s outputs as a checkpoint
    item: from ``snapshots`` (one process: by position in ``validated.captured.arrays``;
    several: from :func:`snapshot_items`), or with None (a direct save: every process, on
    the caller's thread) from the arrays, the device steps made now."""
    outputs = _checkpoint_save.validate_save(export.probe_tree(), validated.user_metadata)
    plan, metadata, sizes = _checkpoint_save.plan_tree(outputs, layout, export.header_metadata)
    arrays = validated.flat.arrays
    names = list(arrays)
    missing = sorted(export.sources - set(names))
    if missing:
        raise ValueError(f"internal: the export plan reads tensors the tree lacks: {missing[:5]}")
    items: Iterable[tuple[tuple[str, str], _snapshots.HostCopies]]
    if snapshots is None:
        ready = list(_device_items(export, arrays, _buffers.BufferArena()))
        items = itertools.chain(ready, _source_items(export, arrays, is_primary, None))
    elif multi_process:
        items = snapshots
    else:
        items = (((SOURCE, names[i]), copies) for i, copies in snapshots)
    wholes_first = snapshots is None or multi_process
    pieces = _snapshot_pieces(plan, export, arrays, items, is_primary, wholes_first)
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
