"""A key mapping applied to a table of names: the :class:`Link` s of a load or an export.
A link ties one or more Flax tensors to one or more PyTorch tensors through one :class:`Rule`
(one to one, or the tensors its ``stacked``/``fused`` placeholders gather: ``stacking.Gather``)
and carries their shape arithmetic (checked before any byte moves), their tensor arithmetic
(numpy or ``jax.numpy``) and that of one shard (:func:`shard_boxes`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport, Rule
from orbax_safetensors._src.integrations.stacking import Gather
from orbax_safetensors._src.integrations.transforms import IDENTITY, Chain, Transpose

Shape = tuple[int, ...]
Box = tuple[slice, ...]


def _probe_shape(fn: Any, shape: Shape, dtype: Any) -> Shape:
    probe = np.broadcast_to(np.zeros((), dtype), shape)  # no memory: zero strides
    return tuple(int(d) for d in np.shape(fn(probe)))


def gather_of(rule: Rule, counts: Mapping[str, int], *, flax: bool) -> Gather:
    """How a tensor of the Flax side (``flax``) or the PyTorch side of ``rule`` holds the
    other side's tensors, with ``counts`` values of each stacked placeholder."""
    names = rule.gathered_by(flax=flax)
    stacks = tuple((n, a, int(counts[n])) for n, a in rule.stacked or () if n in names)
    if rule.fused is None or rule.fused not in names:
        return Gather(stacks)
    return Gather(stacks, rule.fused, len(rule.parts), rule.axis, rule.sizes)


def _gathered_order(rule: Rule, *, flax: bool) -> list[str]:
    # The placeholders a tensor of that side gathers, in the order of its slots' positions.
    names = rule.gathered_by(flax=flax)
    fused = [rule.fused] if rule.fused in names else []
    return [n for n in rule.stacked_names if n in names] + fused


@dataclasses.dataclass(frozen=True)
class Link:
    """Flax tensors ``flax`` <-> PyTorch tensors ``torch`` through ``rule``.

    Each Flax tensor holds one slot of every PyTorch tensor and the reverse
    (``stacking.Gather``): ``flax[k]`` is the slot ``k`` of each PyTorch tensor's gather, and
    ``torch[j]`` the slot ``j`` of each Flax tensor's gather. ``counts`` gives the number of
    values of each stacked placeholder. The rule's transform maps one slot (one layer of one
    expert, one part) on its own: towards PyTorch, each slot is taken out of its Flax tensor,
    transformed, and the PyTorch tensor assembled from its slots; towards Flax the reverse.
    Arrays passed in and returned follow ``flax``/``torch``.
    """

    rule: Rule
    flax: tuple[str, ...]
    torch: tuple[str, ...]
    counts: tuple[tuple[str, int], ...] = ()

    @functools.cached_property
    def flax_gather(self) -> Gather:
        """How each Flax tensor holds its slots of the PyTorch tensors."""
        return gather_of(self.rule, dict(self.counts), flax=True)

    @functools.cached_property
    def torch_gather(self) -> Gather:
        """How each PyTorch tensor holds its slots of the Flax tensors."""
        return gather_of(self.rule, dict(self.counts), flax=False)

    def _where(self) -> str:
        def few(names: Sequence[str]) -> str:
            return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")

        rule = self.rule
        return f"rule {rule.torch!r} -> {rule.flax!r}: {few(self.flax)} <-> {few(self.torch)}"

    def anonymous(self) -> Link:
        """This link without its names and a one-to-one rule's patterns: what its arithmetic
        depends on (links of one layout share a compiled function)."""
        rule = self.rule
        if rule.one_to_one:
            rule = Rule("x", "x", rule.transform)
        return Link(rule, ("",) * len(self.flax), ("",) * len(self.torch), self.counts)

    # ---- shapes and values: each slot transformed on its own, taken out and put together

    def _sides(self, to_torch: bool) -> tuple[Gather, Gather, Any]:
        t = self.rule.transform_or_identity
        if to_torch:
            return self.flax_gather, self.torch_gather, t.to_torch
        return self.torch_gather, self.flax_gather, t.to_flax

    def shapes(self, shapes: Sequence[Shape], dtype: Any, *, to_torch: bool) -> list[Shape]:
        """The shapes on the PyTorch side (``to_torch``) or the Flax side of the other side's
        tensors of ``shapes``, of ``dtype``.

        Raises:
          ValueError: naming the link, when they do not split, stack, join or transform.
        """
        source, dest, fn = self._sides(to_torch)
        probe = functools.cache(lambda shape: _probe_shape(fn, shape, dtype))  # (slots alike)
        try:
            slots = [source.slot_shapes(tuple(s)) for s in shapes]
            return [
                dest.whole_shape([probe(of[j]) for of in slots]) for j in range(len(source.slots))
            ]
        except ValueError as e:
            raise ValueError(f"{self._where()}: {e}") from None

    def values(self, arrays: Sequence[Any], *, to_torch: bool, xp: Any = np) -> list[Any]:
        """The tensors on the PyTorch side (``to_torch``) or the Flax side of the other side's
        ``arrays`` (host numpy arrays, as :meth:`shapes` has them; or ``xp`` arrays: ``jax.numpy``
        to run on device, under ``jit``)."""
        n = len(self.torch if to_torch else self.flax)
        return [self.value(arrays, j, to_torch=to_torch, xp=xp) for j in range(n)]

    def value(self, arrays: Sequence[Any], j: int, *, to_torch: bool, xp: Any = np) -> Any:
        """Tensor ``j`` of the PyTorch side (``to_torch``) or the Flax side, of the other
        side's ``arrays``: one at a time, an export of a stacked tensor holds one PyTorch
        tensor at a time (slices of numpy arrays are views)."""
        source, dest, fn = self._sides(to_torch)
        slot = source.slots[j]
        try:
            return dest.assemble([fn(source.take(a, slot)) for a in arrays], xp)
        except ValueError as e:
            raise ValueError(f"{self._where()}: {e}") from None

    def band(self, placeholder: str, start: int, stop: int) -> Link:
        """This link restricted to the values ``[start, stop)`` of ``placeholder`` (a Flax-side
        stack): its Flax tensors are the band of the whole ones along that stack, its PyTorch
        tensors those of the slots in the band, in order (``link.band("i", 8, 16).torch[0]``
        is ``link.torch[8]``)."""
        stacks = [name for name, _, _ in self.flax_gather.stacks]
        if placeholder not in stacks:
            raise ValueError(f"{self._where()}: no Flax-side stack {{{placeholder}}} to band")
        k = stacks.index(placeholder)
        torch = tuple(
            key for key, slot in zip(self.torch, self.flax_gather.slots) if start <= slot[k] < stop
        )
        counts = tuple((n, stop - start if n == placeholder else c) for n, c in self.counts)
        return Link(self.rule, self.flax, torch, counts)

    def pairs(self) -> list[tuple[str, str]]:
        """``(torch key, flax name)`` pairs of this link, for a report."""
        return [(k, n) for k in self.torch for n in self.flax]


def link_batches(
    links: Sequence[Link], nbytes: Any, max_bytes: int, *, torch_side: bool
) -> list[list[Link]]:
    """``links`` in batches of at most ``max_bytes`` (``nbytes(name)`` of each link's tensors
    on the PyTorch or the Flax side; a larger link is a batch alone)."""
    out: list[list[Link]] = []
    used = 0
    for link in links:
        size = sum(nbytes(k) for k in (link.torch if torch_side else link.flax))
        if not out or (out[-1] and used + size > max_bytes):
            out.append([])
            used = 0
        out[-1].append(link)
        used += size
    return out


def _matched(
    mapping: KeyMapping, names: Iterable[str], report: MappingReport, *, flax_side: bool
) -> Iterator[tuple[str, int, Rule, dict[str, str]]]:
    """Each of ``names`` (Flax names, else PyTorch keys) that a rule maps, with the first such
    rule, its index and the placeholders' values; the ignored and unmapped ones go to
    ``report``."""
    ignored = mapping.flax_ignored if flax_side else mapping.torch_ignored
    for name in names:
        if ignored(name):
            report.ignored.append(name)
            continue
        for r, rule in enumerate(mapping.rules):
            values = rule.groups(name, flax=flax_side)
            if values is not None:
                yield name, r, rule, values
                break
        else:
            report.unmapped.append(name)


def find_links(
    mapping: KeyMapping, shapes: Mapping[str, Shape], *, flax_side: bool
) -> tuple[list[Link], MappingReport]:
    """The links of the tensors of ``shapes`` (Flax names for an export, ``flax_side``; else
    PyTorch keys for a load); the report lists the names ignored and unmapped, and tensors
    a link needs that are absent or do not agree on a stack's length (``mismatched``).

    Tensors of this side that one rule gathers into the same tensors of the other side
    (same rule, same values of the plain placeholders) form one link, each one slot of the
    other side's gather.
    """
    report = MappingReport()
    mapped = []
    order: list[Link | tuple[int, tuple[tuple[str, str], ...]]] = []
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[tuple[int, ...], str]] = {}
    for name, r, rule, values in _matched(mapping, shapes, report, flax_side=flax_side):
        mapped.append(name)
        if rule.one_to_one:
            other = rule.fill(values, flax=not flax_side)
            pair = ((name,), (other,)) if flax_side else ((other,), (name,))
            order.append(Link(rule, *pair))
            continue
        slot = []
        for n in _gathered_order(rule, flax=not flax_side):
            i = rule.value_index(n, values[n])
            if i is None:
                report.mismatched.append(
                    f"{name}: {{{n}}} is {values[n]!r}, not an index of the stack"
                )
                break
            slot.append(i)
        else:
            key = (r, tuple(sorted((k, v) for k, v in values.items() if k not in rule.collective)))
            if key not in groups:
                groups[key] = {}
                order.append(key)
            groups[key][tuple(slot)] = name
    if not flax_side:  # (a tensor a layer lacks makes no link, nor a slot of one: named here)
        report.mismatched += absent_in_layers(mapping, mapped)
    links = []
    for entry in order:
        if isinstance(entry, Link):
            links.append(entry)
            continue
        link = _group_link(mapping.rules[entry[0]], dict(entry[1]), groups[entry], shapes,
                           flax_side, report)  # fmt: skip
        if link is not None:
            links.append(link)
    return links, report


def _layer_of(key: str) -> tuple[str, int, str] | None:
    # ``key``'s first whole-number component, a layer by Hugging Face's naming:
    # (what comes before it, the number, what comes after it)
    parts = key.split(".")
    for p, part in enumerate(parts[:-1]):
        if part.isdecimal() and len(part) < 10 and str(int(part)) == part:
            return "".join(q + "." for q in parts[:p]), int(part), ".".join(parts[p + 1 :])
    return None


def _maps(mapping: KeyMapping, key: str) -> bool:
    if mapping.torch_ignored(key):
        return False
    for rule in mapping.rules:
        values = rule.groups(key, flax=False)
        if values is not None:
            gathered = _gathered_order(rule, flax=True)
            if any(rule.value_index(n, values[n]) is None for n in gathered):
                return False
            name = rule.match_torch(key)  # (a Flax name the mapping ignores wants no value)
            return name is not None and not mapping.flax_ignored(name)
    return False


_PROBE = 987654321  # a layer number no real model has: which placeholder takes it?


def _stacks_layer(mapping: KeyMapping, prefix: str, rest: str) -> bool:
    # Whether the rule of ``<prefix>N.<rest>`` stacks the layers N into one Flax tensor with a
    # count taken from the layers held (a placeholder listing its values counts them itself):
    # there a missing last layer reads as a shorter stack. Per-layer rules are left alone:
    # models whose layers differ (dense and MoE layers under one generic preset) hold them.
    probe = f"{prefix}{_PROBE}.{rest}"
    for rule in mapping.rules:
        values = rule.groups(probe, flax=False)
        if values is not None:
            layer = [n for n, v in values.items() if v == str(_PROBE)]
            return bool(layer) and layer[0] in _gathered_order(rule, flax=True)
    return False


# The most keys absent_in_layers tries (a real model's dense and MoE layers make a few
# thousand): bounded, whatever kinds and layers the files make up.
_ABSENT_TRIED = 1 << 16


def absent_in_layers(mapping: KeyMapping, keys: Iterable[str]) -> list[str]:
    """The PyTorch keys ``mapping`` stacks by layer that a layer of ``keys`` lacks while other
    layers of the same list hold them (``model.layers.1.mlp.down_proj.weight`` where
    ``model.layers.0.mlp.down_proj.weight`` and ``model.layers.1.*`` are held), one problem per
    kind of tensor. Links derived from the keys present cannot see them: a stacked rule counts
    the layers it holds, so a missing last layer reads as a shorter stack."""
    held: dict[tuple[str, str], set[int]] = {}
    layers: dict[str, set[int]] = {}
    for key in keys:
        at = _layer_of(key)
        if at is not None:
            held.setdefault((at[0], at[2]), set()).add(at[1])
            layers.setdefault(at[0], set()).add(at[1])
    problems, budget = [], _ABSENT_TRIED
    for (prefix, rest), have in held.items():
        if budget <= 0:
            break
        lacking = []
        for i in sorted(layers[prefix] - have)[:budget]:
            budget -= 1
            if _stacks_layer(mapping, prefix, rest) and _maps(mapping, f"{prefix}{i}.{rest}"):
                lacking.append(f"{prefix}{i}.{rest}")
        if lacking:
            more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
            problems.append(
                f"{', '.join(lacking[:3])}{more} absent: the files hold {prefix}N.{rest} for "
                f"{len(have)} of the {len(layers[prefix])} layers {prefix}N they hold"
            )
    return problems


# The most tensors one link makes of the other side's stacked axes: a stacked axis of a
# (hostile, or zero-size) tensor may be far longer than any model's layers times experts.
MAX_TENSORS = 1 << 20


def _group_link(
    rule: Rule,
    plain: dict[str, str],
    held: dict[tuple[int, ...], str],
    shapes: Mapping[str, Shape],
    flax_side: bool,
    report: MappingReport,
) -> Link | None:
    """The link of one group: ``held`` maps each slot to this side's tensor; the counts of
    this side's stacked placeholders come from the slots present, those of the other side's
    from the stacked axes of this side's tensors."""
    mine = _gathered_order(rule, flax=not flax_side)
    counts: dict[str, int] = {}
    for position, n in enumerate(mine):
        if n != rule.fused:
            listed = rule.stack_values(n)
            counts[n] = len(listed) if listed else 1 + max(s[position] for s in held)
    first = next(iter(held.values()))
    joined = rule.match(first, flax=flax_side)
    mine_gather = gather_of(rule, counts, flax=not flax_side)
    total = mine_gather.size
    if total > len(held):  # (every slot held is one of the total: indices below the counts)
        lacking = next(s for s in map(mine_gather.slot_at, range(total)) if s not in held)
        lacking_values = {n: rule.value_at(n, i) for n, i in zip(mine, lacking)}
        missing = rule.fill({**plain, **lacking_values}, flax=flax_side)
        report.mismatched.append(
            f"{joined} joins {total} tensors but {total - len(held)} are absent (e.g. {missing})"
        )
        return None
    here = [held[s] for s in mine_gather.slots]
    for n, axis in rule.stacked or ():
        if n in mine:
            continue
        lengths = {}
        for name in here:
            shape = shapes[name]
            if not -len(shape) <= axis < len(shape):
                what = f"{name} {list(shape)}" if shape else f"{name} is a scalar and"
                report.mismatched.append(
                    f"{what} has no axis {axis} that stacks {{{n}}} (rule {rule.torch!r} -> "
                    f"{rule.flax!r})"
                )
                return None
            lengths[name] = int(shape[axis])
        if len(set(lengths.values())) > 1:
            report.mismatched.append(
                f"{', '.join(here)} stack {{{n}}} on axis {axis} with different lengths "
                f"{sorted(set(lengths.values()))}"
            )
            return None
        counts[n] = next(iter(lengths.values()))
    theirs = _gathered_order(rule, flax=flax_side)
    theirs_gather = gather_of(rule, counts, flax=flax_side)
    if theirs_gather.size > MAX_TENSORS:
        report.mismatched.append(
            f"{', '.join(here[:3])}: stacked axes of lengths {[c for *_, c in theirs_gather.stacks]}"
            f" would make {theirs_gather.size} tensors (at most {MAX_TENSORS})"
        )
        return None
    others = tuple(
        rule.fill(
            {**plain, **{n: rule.value_at(n, i) for n, i in zip(theirs, slot)}}, flax=not flax_side
        )
        for slot in theirs_gather.slots
    )
    ordered = tuple((n, counts[n]) for n in rule.stacked_names)
    if flax_side:
        return Link(rule, tuple(here), others, ordered)
    return Link(rule, others, tuple(here), ordered)


# --------------------------------------------------------------------------- one shard at a time


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


def _permutation(link: Link, flax_shapes: Sequence[Shape]) -> tuple[int, ...] | None:
    ndim = len(flax_shapes[0]) - len(link.flax_gather.stacks)  # (a slot's dimensions)
    return axis_permutation(link.rule.transform, ndim)


def commutes(link: Link, flax_shapes: Sequence[Shape]) -> bool:
    """Whether ``link`` (of Flax tensors of ``flax_shapes``) maps each shard on its own."""
    ndim = len(flax_shapes[0]) - len(link.flax_gather.stacks)
    return ndim > 0 and _permutation(link, flax_shapes) is not None


def shard_boxes(
    link: Link, k: int, box: Box, data: np.ndarray, flax_shapes: Sequence[Shape]
) -> list[tuple[int, Box, np.ndarray]]:
    """``(j, box, values)``: the pieces of ``link.torch[j]`` that the shard ``(box, data)`` of
    ``link.flax[k]`` holds: cut into the slots it holds, each permuted and placed. Needs
    :func:`commutes`.
    """
    perm = _permutation(link, flax_shapes)
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


def _permuted(box: Box, data: np.ndarray, perm: tuple[int, ...]) -> tuple[Box, np.ndarray]:
    if perm == tuple(range(len(perm))):
        return box, data
    return tuple(box[p] for p in perm), np.transpose(data, perm)


@functools.lru_cache(maxsize=256)
def _torch_shapes(link: Link, flax_shapes: tuple[Shape, ...]) -> list[Shape]:
    # (every shard of a link asks: probed once; a commuting transform is hashable)
    return link.shapes(flax_shapes, np.uint8, to_torch=True)


def row_axis(link: Link, flax_shapes: Sequence[Shape]) -> int:
    """The axis of ``link``'s Flax tensors that becomes a PyTorch slot's first axis (0 when
    the link does not commute): split there, a process's share is one byte range per slot."""
    perm = _permutation(link, flax_shapes)
    if perm is None or not commutes(link, flax_shapes):
        return 0
    return link.flax_gather.slot_axes(len(flax_shapes[0]))[perm[0]]


def device_value(link: Link, arrays: Sequence[Any], j: int) -> Any:
    """``link.torch[j]`` of the Flax ``arrays`` with ``jax.numpy`` (traceable)."""
    import jax

    return link.value(arrays, j, to_torch=True, xp=jax.numpy)
