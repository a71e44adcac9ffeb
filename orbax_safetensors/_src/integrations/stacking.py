"""How one tensor holds several tensors of the other side of a rule: a :class:`Gather`.
Each stacked placeholder is an axis of its own; the fused one is a run of parts joined along
``axis`` (stacked axes left out). A *slot* is one combination of gathered values (one layer
of one expert, one part), written as positions: the stacked indices, then the part.

Example::

    experts = Gather(stacks=(("e", 0, 4), ("i", 1, 2)))    # (experts, layers, emb, mlp)
    x = np.zeros((4, 2, 8, 16))
    experts.take(x, (3, 1)).shape                            # (8, 16): expert 3 of layer 1
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Shape = tuple[int, ...]
Box = tuple[slice, ...]
Slot = tuple[int, ...]


def _split_shape(shape: Shape, axis: int, sizes: Sequence[int]) -> list[Shape]:
    axis %= len(shape)
    return [(*shape[:axis], s, *shape[axis + 1 :]) for s in sizes]


def _join_shape(shapes: Sequence[Shape], axis: int) -> Shape:
    first = shapes[0]
    if not first or not -len(first) <= axis < len(first):
        raise ValueError(f"parts {[list(p) for p in shapes]} have no axis {axis} to join on")
    ax = axis % len(first)
    for s in shapes[1:]:
        if len(s) != len(first) or s[:ax] + s[ax + 1 :] != first[:ax] + first[ax + 1 :]:
            raise ValueError(f"parts {[list(p) for p in shapes]} do not join on axis {axis}")
    return (*first[:ax], sum(s[ax] for s in shapes), *first[ax + 1 :])


@dataclasses.dataclass(frozen=True)
class Gather:
    """The slots one tensor holds (see the module docstring).

    Attributes:
      stacks: ``(placeholder, axis, count)`` of each stacked axis; ``axis`` counts in the
        whole tensor (negative: from its end).
      fused: the fused placeholder this tensor joins, or None.
      parts: how many parts it joins (with ``fused``).
      axis: the axis of a slice the parts are joined along.
      sizes: the parts' sizes along ``axis`` (None: equal parts).
    """

    stacks: tuple[tuple[str, int, int], ...] = ()
    fused: str | None = None
    parts: int = 0
    axis: int = 0
    sizes: tuple[int, ...] | None = None

    @property
    def trivial(self) -> bool:
        """Whether the tensor is one slot as it is (nothing stacked, nothing joined)."""
        return not self.stacks and self.fused is None

    @property
    def ranges(self) -> list[range]:
        """The range of each position of a slot."""
        ranges = [range(count) for _, _, count in self.stacks]
        return ranges + ([range(self.parts)] if self.fused is not None else [])

    @property
    def size(self) -> int:
        """How many slots the tensor holds (without listing them)."""
        return math.prod(len(r) for r in self.ranges)

    def slot_at(self, k: int) -> Slot:
        """``slots[k]``, without listing the slots."""
        out = []
        for r in reversed(self.ranges):
            k, i = divmod(k, len(r))
            out.append(i)
        return tuple(reversed(out))

    def position(self, slot: Slot) -> int:
        """The position of ``slot`` in :attr:`slots` (``slot_at``'s inverse)."""
        k = 0
        for r, i in zip(self.ranges, slot):
            k = k * len(r) + i
        return k

    @functools.cached_property
    def slots(self) -> list[Slot]:
        """Every slot, in order: the stacked indices (the first stack outermost), then the
        part (innermost)."""
        return list(itertools.product(*self.ranges))

    def stack_axes(self, ndim: int) -> list[int]:
        """The stacked axes of a whole tensor of ``ndim`` dimensions, in ``stacks`` order.

        Raises:
          ValueError: an axis out of range, or two stacks on one axis.
        """
        axes = []
        for name, axis, _ in self.stacks:
            if not -ndim <= axis < ndim:
                raise ValueError(f"a tensor of {ndim} dimensions has no axis {axis} for {{{name}}}")
            axes.append(axis % ndim)
        if len(set(axes)) != len(axes):
            given = [axis for _, axis, _ in self.stacks]
            raise ValueError(f"stacked axes {given} are one axis of a tensor of {ndim} dimensions")
        return axes

    def part_sizes(self, total: int) -> list[int]:
        """The parts' sizes along ``axis`` of a slice ``total`` long there.

        Raises:
          ValueError: ``sizes`` that do not add up to ``total``, or no equal split.
        """
        if self.sizes is not None:
            if len(self.sizes) != self.parts or sum(self.sizes) != total:
                raise ValueError(f"sizes {list(self.sizes)} do not split {total} in {self.parts}")
            return list(self.sizes)
        if total % self.parts:
            raise ValueError(f"{total} does not split into {self.parts} equal parts (give sizes=)")
        return [total // self.parts] * self.parts

    def slot_axes(self, ndim: int) -> list[int]:
        """The axes of a whole tensor of ``ndim`` dimensions that its slots keep, in order
        (its stacked axes left out)."""
        stacked = set(self.stack_axes(ndim))
        return [a for a in range(ndim) if a not in stacked]

    def _part_bounds(self, rest: Shape) -> tuple[int, list[int]]:
        # the fused axis of a slice of shape ``rest``, and where each part starts along it
        if not rest or not -len(rest) <= self.axis < len(rest):
            raise ValueError(f"a slice of shape {list(rest)} has no axis {self.axis} to split")
        axis = self.axis % len(rest)
        starts = [0]
        for size in self.part_sizes(rest[axis]):
            starts.append(starts[-1] + size)
        return axis, starts

    # ---- shapes

    def slot_shapes(self, shape: Shape) -> list[Shape]:
        """The shape of each slot (in :attr:`slots` order) of a whole tensor of ``shape``.

        Raises:
          ValueError: a stacked axis of another length than its count, parts that do not
            split.
        """
        axes = self.stack_axes(len(shape))
        for (name, _, count), axis in zip(self.stacks, axes):
            if shape[axis] != count:
                raise ValueError(
                    f"axis {axis} of {list(shape)} is {shape[axis]} long, not the {count} "
                    f"values of {{{name}}}"
                )
        rest = tuple(shape[a] for a in self.slot_axes(len(shape)))
        if self.fused is None:
            return [rest] * len(self.slots)
        axis, starts = self._part_bounds(rest)
        parts = _split_shape(rest, axis, [b - a for a, b in itertools.pairwise(starts)])
        return [parts[slot[-1]] for slot in self.slots]

    def whole_shape(self, shapes: Sequence[Shape]) -> Shape:
        """The shape of the tensor holding slots of ``shapes`` (in :attr:`slots` order).

        Raises:
          ValueError: parts that do not join, or slices of different shapes.
        """
        n = self.parts if self.fused is not None else 1
        rests = [
            self._joined(shapes[g : g + n]) if self.fused is not None else shapes[g]
            for g in range(0, len(shapes), n)
        ]
        if any(r != rests[0] for r in rests):
            raise ValueError(f"slices of shapes {sorted(set(rests))} do not stack")
        rest = iter(rests[0])
        ndim = len(rests[0]) + len(self.stacks)
        count_at = {a: c for a, (_, _, c) in zip(self.stack_axes(ndim), self.stacks)}
        return tuple(count_at[a] if a in count_at else next(rest) for a in range(ndim))

    def _joined(self, parts: Sequence[Shape]) -> Shape:
        # The slice of ``parts`` joined, if it splits back into them (``sizes``, or equal).
        joined = _join_shape(parts, self.axis)
        axis = self.axis % len(joined)
        sizes = [p[axis] for p in parts]
        if self.sizes is None and len(set(sizes)) > 1:
            raise ValueError(
                f"parts of sizes {sizes} along axis {self.axis}, which a rule without sizes= "
                f"splits into equal parts: give sizes={tuple(sizes)}"
            )
        self.part_sizes(joined[axis])  # (given sizes that do not match: the error)
        if self.sizes is not None and list(self.sizes) != sizes:
            raise ValueError(
                f"parts of sizes {sizes} along axis {self.axis}, not the rule's "
                f"sizes={tuple(self.sizes)}: give sizes={tuple(sizes)}"
            )
        return joined

    # ---- values

    def index(self, slot: Slot, shape: Shape) -> tuple[Any, ...]:
        """The index of ``slot`` in a whole tensor of ``shape`` (``x[index]`` is the slot)."""
        index: list[Any] = [slice(None)] * len(shape)
        axes = self.stack_axes(len(shape))
        for axis, i in zip(axes, slot):
            index[axis] = i
        if self.fused is not None:
            rest_axes = self.slot_axes(len(shape))
            axis, starts = self._part_bounds(tuple(shape[a] for a in rest_axes))
            p = slot[-1]
            index[rest_axes[axis]] = slice(starts[p], starts[p + 1])
        return tuple(index)

    def take(self, x: Any, slot: Slot) -> Any:
        """Slot ``slot`` of the whole tensor ``x`` (numpy: a view)."""
        if self.trivial:
            return x
        return x[self.index(slot, tuple(x.shape))]

    def assemble(self, slots: Sequence[Any], xp: Any = np) -> Any:
        """The whole tensor of ``slots`` (in :attr:`slots` order): numpy arrays are copied
        into one C-contiguous array; other ``xp`` (``jax.numpy``) arrays are joined and
        stacked with ``xp`` (traceable).

        Raises:
          ValueError: slots whose shapes do not join or stack.
        """
        if self.trivial:
            return slots[0]
        shape = self.whole_shape([tuple(int(d) for d in s.shape) for s in slots])
        if xp is np:
            out = np.empty(shape, np.result_type(*slots))
            for slot, value in zip(self.slots, slots):
                out[self.index(slot, shape)] = value
            return out
        n = self.parts if self.fused is not None else 1
        rests = [
            xp.concatenate(list(slots[g : g + n]), axis=self.axis)
            if self.fused is not None
            else slots[g]
            for g in range(0, len(slots), n)
        ]
        if not self.stacks:
            return rests[0]
        counts = [c for _, _, c in self.stacks]
        stacked = xp.stack(rests).reshape(*counts, *rests[0].shape)
        return xp.moveaxis(stacked, list(range(len(counts))), self.stack_axes(len(shape)))

    # ---- boxes of shards

    def cut(self, box: Box, data: Any, shape: Shape) -> list[tuple[int, Box, Any]]:
        """The pieces of the shard ``(box, data)`` of a whole tensor of ``shape``: ``(slot
        position in :attr:`slots`, the piece's box inside that slot, its values)``."""
        if self.trivial:
            return [(0, tuple(box), data)]
        ndim = len(shape)
        axes = self.stack_axes(ndim)
        rest_axes = self.slot_axes(ndim)
        out: list[tuple[int, Box, Any]] = []
        for held in itertools.product(*(range(box[a].start, box[a].stop) for a in axes)):
            sub: list[Any] = [slice(None)] * ndim
            for axis, i in zip(axes, held):
                sub[axis] = i - box[axis].start
            values = data[tuple(sub)] if axes else data
            rest_box = tuple(box[a] for a in rest_axes)
            if self.fused is None:
                out.append((self.position(held), rest_box, values))
                continue
            axis, starts = self._part_bounds(tuple(shape[a] for a in rest_axes))
            s = rest_box[axis]
            for p, (lo, hi) in enumerate(itertools.pairwise(starts)):
                start, stop = max(int(s.start), lo), min(int(s.stop), hi)
                if start >= stop:
                    continue
                piece_box = list(rest_box)
                piece_box[axis] = slice(start - lo, stop - lo)
                inside: list[Any] = [slice(None)] * len(rest_box)
                inside[axis] = slice(start - int(s.start), stop - int(s.start))
                out.append((self.position((*held, p)), tuple(piece_box), values[tuple(inside)]))
        return out

    def place(self, k: int, box: Box, data: Any, shape: Shape) -> tuple[Box, Any]:
        """The piece ``(box, data)`` of slot ``slots[k]`` as a box of the whole tensor of
        ``shape`` and its values (unit axes added where the slot is one index of a stack)."""
        if self.trivial:
            return tuple(box), data
        ndim = len(shape)
        slot = self.slots[k]
        rest = list(box)
        if self.fused is not None:
            axis, starts = self._part_bounds(tuple(shape[a] for a in self.slot_axes(ndim)))
            shift = starts[slot[-1]]
            rest[axis] = slice(int(rest[axis].start) + shift, int(rest[axis].stop) + shift)
        axes = self.stack_axes(ndim)
        index_at = dict(zip(axes, slot))
        pieces = iter(rest)
        whole = tuple(
            slice(index_at[a], index_at[a] + 1) if a in index_at else next(pieces)
            for a in range(ndim)
        )
        return whole, (np.expand_dims(data, sorted(axes)) if axes else data)
