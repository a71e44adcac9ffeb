"""Where each shard of a Flax tensor lands in the PyTorch tensors an export writes.

A multi-process export writes, on every process, only the shards that process owns. For a
:class:`~orbax_safetensors._src.integrations.links.Link` whose transform is an axis
permutation (``Transpose``, a ``Chain`` of them, or none), the export commutes with the
sharding: a shard's box (its slices inside the global Flax tensor) maps to boxes of the
PyTorch tensors, and its values to theirs, without any other shard:

- a rename keeps the box; ``Transpose`` permutes the box and transposes the shard;
- ``stacked``: a shard of ``[L, ...]`` covering layers ``a..b`` along axis 0 is a box of each
  of those layers' tensors;
- ``fused`` on the PyTorch side: the box is cut at the parts' boundaries along ``axis``, each
  piece a box of one part; ``fused`` on the Flax side: each part's box is shifted along
  ``axis`` by the sizes of the parts before it;
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


def _part_ndim(link: Link, flax_shapes: Sequence[Shape]) -> int:
    ndim = len(flax_shapes[0])
    return ndim - 1 if link.parts_on_torch and link.rule.stacked is not None else ndim


def commutes(link: Link, flax_shapes: Sequence[Shape]) -> bool:
    """Whether ``link`` maps each Flax shard on its own (see the module docstring)."""
    ndim = _part_ndim(link, flax_shapes)
    return ndim > 0 and axis_permutation(link.rule.transform, ndim) is not None


def _part_sizes(link: Link, total: int) -> list[int]:
    n = max(1, len(link.rule.parts))
    if link.rule.sizes is not None:
        return list(link.rule.sizes)
    return [total // n] * n  # (the shapes were checked to split: Link.torch_shapes)


def _permuted(box: Box, data: np.ndarray, perm: tuple[int, ...]) -> tuple[Box, np.ndarray]:
    if perm == tuple(range(len(perm))):
        return box, data
    return tuple(box[p] for p in perm), np.transpose(data, perm)


def _cut(box: Box, data: np.ndarray, axis: int, lo: int, hi: int) -> tuple[Box, np.ndarray]:
    # the part of (box, data) inside [lo, hi) along ``axis``, in coordinates relative to lo
    s = box[axis]
    start, stop = max(int(s.start), lo), min(int(s.stop), hi)
    if start >= stop:
        return (), data[:0]
    sub = [slice(None)] * data.ndim
    sub[axis] = slice(start - int(s.start), stop - int(s.start))
    cut = list(box)
    cut[axis] = slice(start - lo, stop - lo)
    return tuple(cut), data[tuple(sub)]


def shard_boxes(
    link: Link, k: int, box: Box, data: np.ndarray, flax_shapes: Sequence[Shape]
) -> list[tuple[int, Box, np.ndarray]]:
    """``(j, box, values)``: the pieces of ``link.torch[j]`` that the shard ``(box, data)``
    of the Flax tensor ``link.flax[k]`` holds (``flax_shapes``: the link's Flax shapes).
    Needs :func:`commutes`."""
    rule = link.rule
    perm = axis_permutation(rule.transform, _part_ndim(link, flax_shapes))
    if perm is None:
        raise ValueError(f"{link.flax[k]}: its transform does not map shards on their own")
    if rule.one_to_one:
        return [(0, *_permuted(box, data, perm))]
    if not link.parts_on_torch:  # several Flax parts joined into one PyTorch tensor
        tbox, tdata = _permuted(box, data, perm)
        axis = rule.axis % len(tbox)
        shift = sum(int(flax_shapes[i][perm[axis]]) for i in range(k))
        moved = list(tbox)
        moved[axis] = slice(int(tbox[axis].start) + shift, int(tbox[axis].stop) + shift)
        return [(0, tuple(moved), tdata)]
    n = max(1, len(rule.parts))
    if rule.stacked is not None:
        first = int(box[0].start)
        layers = [
            (i * n, box[1:], data[i - first]) for i in range(first, int(box[0].stop))
        ]  # fmt: skip
        layer_shape = tuple(flax_shapes[0][1:])
    else:
        layers, layer_shape = [(0, box, data)], tuple(flax_shapes[0])
    out: list[tuple[int, Box, np.ndarray]] = []
    for base, sub, values in layers:
        if rule.fused is None:
            out.append((base, *_permuted(sub, values, perm)))
            continue
        axis = rule.axis % len(layer_shape)
        lo = 0
        for p, size in enumerate(_part_sizes(link, layer_shape[axis])):
            part_box, part = _cut(sub, values, axis, lo, lo + size)
            lo += size
            if part_box:
                out.append((base + p, *_permuted(part_box, part, perm)))
    return out


def device_value(link: Link, arrays: Sequence[Any], j: int) -> Any:
    """``link.torch[j]`` computed from the Flax ``arrays`` with ``jax.numpy`` (traceable:
    jit it with an ``out_shardings`` to re-lay the tensor out on the devices)."""
    import jax

    t = link.rule.transform_or_identity
    rule = link.rule
    if rule.one_to_one:
        return t.to_torch(arrays[0])
    if not link.parts_on_torch:
        return jax.numpy.concatenate([t.to_torch(a) for a in arrays], axis=rule.axis)
    n = max(1, len(rule.parts))
    layer, p = divmod(j, n)
    y = arrays[0][layer] if rule.stacked is not None else arrays[0]
    if rule.fused is not None:
        axis = rule.axis % y.ndim
        sizes = _part_sizes(link, int(y.shape[axis]))
        lo = sum(sizes[:p])
        y = jax.lax.slice_in_dim(y, lo, lo + sizes[p], axis=axis)
    return t.to_torch(y)


def row_axis(link: Link, flax_shapes: Sequence[Shape]) -> int:
    """The axis of the Flax tensor(s) of ``link`` that becomes the PyTorch tensors' first axis
    (0 when the link does not commute): split there, each process's share of each PyTorch
    tensor is one contiguous byte range."""
    if not commutes(link, flax_shapes):
        return 0
    perm = axis_permutation(link.rule.transform, _part_ndim(link, flax_shapes))
    assert perm is not None
    stacked = link.parts_on_torch and link.rule.stacked is not None
    return perm[0] + 1 if stacked else perm[0]


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
