"""Where each shard of a Flax tensor lands in the PyTorch tensors an export writes.

A multi-process export writes, on every process, only the shards that process owns. For a
:class:`~orbax_safetensors._src.integrations.links.Link` whose transform is an axis
permutation (``Transpose``, a ``Chain`` of them, or none), the export commutes with the
sharding: a shard's box (its slices inside the global Flax tensor) maps to boxes of the
PyTorch tensors, and its values to theirs, without any other shard:

- a rename keeps the box; ``Transpose`` permutes the box and transposes the shard;
- ``stacked`` and ``fused``: the shard is cut into the slots it holds (each layer, expert or
  part it covers, along any stacked axis, cut at the parts' boundaries), each piece is
  permuted as its slot, and placed in its PyTorch tensor: shifted along ``axis`` by the parts
  before it, given a unit axis where the PyTorch tensor stacks it (``stacking.Gather``);
- a dtype cast applies per shard (done where the pieces are made).

Other transforms (``SplitHeads``, ``Reshape``, user transforms) do not commute with an
arbitrary box: :func:`device_value` computes one PyTorch tensor from the Flax arrays with
``jax.numpy`` so that a jitted call with an ``out_shardings`` (:func:`spread_sharding`)
re-lays it out on the devices. Everything here is decided from global facts (rules, shapes),
so every process decides alike.

Example::

    perm = axis_permutation(Transpose(), 2)          # (1, 0)
    shard_boxes(link, 0, (slice(0, 4), slice(0, 8)), data, [(8, 8)])
    # [(0, (slice(0, 8), slice(0, 4)), data.T)]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.integrations.key_mapping import IDENTITY, Chain, Transpose
from orbax_safetensors._src.integrations.links import Link

Box = tuple[slice, ...]
Shape = tuple[int, ...]


def axis_permutation(transform: Any, ndim: int) -> tuple[int, ...] | None:
    """``perm`` such that ``transform.to_torch(x) == np.transpose(x, perm)`` for every ``x``
    of ``ndim`` dimensions (PyTorch axis ``d`` is Flax axis ``perm[d]``), or None when the
    transform is not a pure axis permutation."""
    if transform is None or transform is IDENTITY:
        return tuple(range(ndim))
    if isinstance(transform, Transpose):
        if transform.axes is None:
            return tuple(reversed(range(ndim)))
        if len(transform.axes) != ndim:
            return None
        return tuple(int(a) for a in np.argsort(transform.axes))
    if isinstance(transform, Chain):
        perm = tuple(range(ndim))
        for t in reversed(transform.transforms):  # to_torch applies them last to first
            step = axis_permutation(t, ndim)
            if step is None:
                return None
            perm = tuple(perm[q] for q in step)
        return perm
    return None


def _slot_ndim(link: Link, flax_shapes: Sequence[Shape]) -> int:
    return len(flax_shapes[0]) - len(link.flax_gather.stacks)


def commutes(link: Link, flax_shapes: Sequence[Shape]) -> bool:
    """Whether ``link`` maps each Flax shard on its own (see the module docstring)."""
    ndim = _slot_ndim(link, flax_shapes)
    return ndim > 0 and axis_permutation(link.rule.transform, ndim) is not None


def _permuted(box: Box, data: np.ndarray, perm: tuple[int, ...]) -> tuple[Box, np.ndarray]:
    if perm == tuple(range(len(perm))):
        return box, data
    return tuple(box[p] for p in perm), np.transpose(data, perm)


def shard_boxes(
    link: Link, k: int, box: Box, data: np.ndarray, flax_shapes: Sequence[Shape]
) -> list[tuple[int, Box, np.ndarray]]:
    """``(j, box, values)``: the pieces of ``link.torch[j]`` that the shard ``(box, data)``
    of the Flax tensor ``link.flax[k]`` holds (``flax_shapes``: the link's Flax shapes): the
    shard cut into the slots it holds (``stacking.Gather.cut``), each piece permuted, then
    placed in its PyTorch tensor (``Gather.place``). Needs :func:`commutes`."""
    perm = axis_permutation(link.rule.transform, _slot_ndim(link, flax_shapes))
    if perm is None:
        raise ValueError(f"{link.flax[k]}: its transform does not map shards on their own")
    box = tuple(box)
    if link.rule.one_to_one:
        return [(0, *_permuted(box, data, perm))]
    torch_shapes = _torch_shapes(link, tuple(tuple(s) for s in flax_shapes))
    out: list[tuple[int, Box, np.ndarray]] = []
    for j, piece_box, values in link.flax_gather.cut(box, data, tuple(flax_shapes[k])):
        piece_box, values = _permuted(piece_box, values, perm)
        out.append((j, *link.torch_gather.place(k, piece_box, values, torch_shapes[j])))
    return out


@functools.lru_cache(maxsize=256)
def _torch_shapes(link: Link, flax_shapes: tuple[Shape, ...]) -> list[Shape]:
    # (every shard of a link asks: probed once; a commuting transform is hashable)
    return link.torch_shapes(flax_shapes, np.uint8)


def device_value(link: Link, arrays: Sequence[Any], j: int) -> Any:
    """``link.torch[j]`` computed from the Flax ``arrays`` with ``jax.numpy`` (traceable:
    jit it with an ``out_shardings`` to re-lay the tensor out on the devices)."""
    import jax

    return link.value(arrays, j, to_torch=True, xp=jax.numpy)


def row_axis(link: Link, flax_shapes: Sequence[Shape]) -> int:
    """The axis of the Flax tensor(s) of ``link`` that becomes the first axis of a slot of
    the PyTorch tensors (0 when the link does not commute): split there, each process's
    share of each PyTorch tensor is one contiguous byte range per slot."""
    if not commutes(link, flax_shapes):
        return 0
    perm = axis_permutation(link.rule.transform, _slot_ndim(link, flax_shapes))
    assert perm is not None
    return link.flax_gather.slot_axes(len(flax_shapes[0]))[perm[0]]


def spread_sharding(shape: Shape, first: int = 0) -> Any:
    """A sharding of a tensor of ``shape`` over every device of the job: axis ``first`` is
    split over all devices (in ``jax.devices()`` order) if the device count divides it, else
    the first axis it divides; replicated when none is."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("devices",))
    for axis in [first, *(a for a in range(len(shape)) if a != first)]:
        if axis < len(shape) and shape[axis] and shape[axis] % len(devices) == 0:
            return NamedSharding(mesh, PartitionSpec(*([None] * axis), "devices"))
    return NamedSharding(mesh, PartitionSpec())
