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

Example::

    plan = ExportPlan(
        outputs=(TensorSpec("w.weight", "F32", (3, 2)),),
        groups=(ExportGroup(("w.kernel",), ("w.weight",), lambda xs: [xs[0].T]),),
        header_metadata={"format": "pt"},
    )
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import interface as _interface


@dataclasses.dataclass(frozen=True)
class ExportGroup:
    """Output tensors ``outputs`` computed from the tree's tensors ``sources`` (dotted names)
    by ``apply`` (host arrays in ``sources`` order -> host arrays in ``outputs`` order)."""

    sources: tuple[str, ...]
    outputs: tuple[str, ...]
    apply: Callable[[Sequence[np.ndarray]], Sequence[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What a save writes instead of the tree's own tensors.

    Attributes:
      outputs: the tensors written (name, stored safetensors dtype, shape), in file order.
      groups: how each output is computed; every output is in exactly one group.
      header_metadata: every file header's ``__metadata__`` (e.g. ``{"format": "pt"}``).
      files: small text files the primary writes beside the tensors (``config.json``).
      summary: a short description for ``repr``.
    """

    outputs: tuple[_plan.TensorSpec, ...]
    groups: tuple[ExportGroup, ...]
    header_metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
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
            yield _pieces.tensor_pieces(plan, name, [(None, np.ascontiguousarray(value))])

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
    snapshots: Iterable[tuple[int, _snapshots.HostCopies]] | None,
    layout: _checkpoint_save.SaveLayout,
) -> _checkpoint_save.PreparedSave:
    """The :class:`~.checkpoint_save.PreparedSave` writing ``export``'s outputs (one process)
    from ``validated``'s arrays: from ``snapshots`` (host copies by position in
    ``validated.captured.arrays``, as :meth:`PreparedSave.from_snapshots` takes them), or, with
    None, from the arrays themselves, read one group's sources at a time (a direct save)."""
    outputs = _checkpoint_save.validate_save(export.probe_tree(), validated.user_metadata)
    plan, metadata, sizes = _checkpoint_save.plan_tree(outputs, layout, export.header_metadata)
    arrays = validated.flat.arrays
    names = list(arrays)
    shapes = {n: tuple(int(d) for d in a.shape) for n, a in arrays.items()}
    dtypes = {n: np.dtype(a.dtype) for n, a in arrays.items()}
    missing = sorted(export.sources - set(names))
    if missing:
        raise ValueError(f"internal: the export plan reads tensors the tree lacks: {missing[:5]}")
    if snapshots is None:
        order = [n for g in export.groups for n in g.sources]
        named: Iterable[tuple[str, _snapshots.HostCopies]] = (
            (n, [(None, np.asarray(arrays[n]))]) for n in dict.fromkeys(order)
        )
    else:
        named = ((names[i], copies) for i, copies in snapshots)
    pieces = export_pieces(plan, export, named, shapes, dtypes)
    return _checkpoint_save.PreparedSave(
        plan, pieces, metadata, sizes, True, 0, layout.checksums, dict(export.files)
    )
