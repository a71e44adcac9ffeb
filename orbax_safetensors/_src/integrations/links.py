"""A key mapping applied to a table of names: the :class:`Link` s of a load or an export.

A link ties one or more Flax tensors to one or more PyTorch tensors through one :class:`Rule`:
one to one for a plain rule; one Flax tensor to L (``stacked``) or P (``fused`` on the PyTorch
side) or L * P PyTorch tensors; P Flax tensors to one PyTorch tensor (``fused`` on the Flax side).
Links carry the shape arithmetic (checked before any byte moves) and the tensor arithmetic
(host numpy arrays, one link at a time). The LoRA adapters an export folds into their kernels
are ``lora.py``'s.

Example::

    links, report = export_links(mapping, {"layers.mlp.kernel": (4, 8, 16)})
    links[0].torch      # ('layers.0.mlp.weight', ..., 'layers.3.mlp.weight')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport, Rule

Shape = tuple[int, ...]


def _probe_shape(fn: Any, shape: Shape, dtype: Any) -> Shape:
    probe = np.broadcast_to(np.zeros((), dtype), shape)  # no memory: zero strides
    return tuple(int(d) for d in np.shape(fn(probe)))


def _sizes(rule: Rule, total: int, n: int, where: str) -> list[int]:
    if rule.sizes is not None:
        if len(rule.sizes) != n or sum(rule.sizes) != total:
            raise ValueError(f"{where}: sizes {list(rule.sizes)} do not split {total} in {n}")
        return list(rule.sizes)
    if total % n:
        raise ValueError(f"{where}: {total} does not split into {n} equal parts (give sizes=)")
    return [total // n] * n


def _split_shape(shape: Shape, axis: int, sizes: list[int]) -> list[Shape]:
    axis %= len(shape)
    return [(*shape[:axis], s, *shape[axis + 1 :]) for s in sizes]


def _join_shape(shapes: Sequence[Shape], axis: int, where: str) -> Shape:
    first = shapes[0]
    ax = axis % len(first)
    for s in shapes[1:]:
        if len(s) != len(first) or s[:ax] + s[ax + 1 :] != first[:ax] + first[ax + 1 :]:
            raise ValueError(f"{where}: parts {[list(p) for p in shapes]} do not join on {axis}")
    return (*first[:ax], sum(s[ax] for s in shapes), *first[ax + 1 :])


@dataclasses.dataclass(frozen=True)
class Link:
    """Flax tensors ``flax`` <-> PyTorch tensors ``torch`` through ``rule``.

    With ``stacked``, ``layers`` is L and ``torch`` lists the layers' keys in order (each
    layer's fused parts in order). Arrays passed in and returned follow ``flax``/``torch``.
    """

    rule: Rule
    flax: tuple[str, ...]
    torch: tuple[str, ...]
    layers: int = 0

    @property
    def parts_on_torch(self) -> bool:
        """Whether one Flax tensor is several PyTorch tensors (stacked or fused there)."""
        return len(self.flax) == 1 and not self.rule.one_to_one

    def _n_parts(self) -> int:
        return max(1, len(self.rule.parts))

    def _where(self) -> str:
        return f"{', '.join(self.flax)} <-> {', '.join(self.torch[:3])}" + (
            ", ..." if len(self.torch) > 3 else ""
        )

    # ---- shapes and values: one to one (transformed), else joined or split on either side

    def torch_shapes(self, shapes: Sequence[Shape], dtype: Any) -> list[Shape]:
        """The PyTorch shapes of Flax tensors of ``shapes`` (see :meth:`shapes`)."""
        return self.shapes(shapes, dtype, to_torch=True)

    def flax_shapes(self, shapes: Sequence[Shape], dtype: Any) -> list[Shape]:
        """The Flax shapes of PyTorch tensors of ``shapes`` (see :meth:`shapes`)."""
        return self.shapes(shapes, dtype, to_torch=False)

    def shapes(self, shapes: Sequence[Shape], dtype: Any, *, to_torch: bool) -> list[Shape]:
        """The shapes on the PyTorch side (``to_torch``) or the Flax side of the other side's
        tensors of ``shapes``, of ``dtype``.

        Raises:
          ValueError: when they do not split, join or transform.
        """
        t = self.rule.transform_or_identity
        fn = t.to_torch if to_torch else t.to_flax
        if self.rule.one_to_one:
            return [_probe_shape(fn, shapes[0], dtype)]
        if to_torch:
            if self.parts_on_torch:
                return self._torch_parts_shapes(shapes[0], fn, dtype)
            parts = [_probe_shape(fn, s, dtype) for s in shapes]
            return [_join_shape(parts, self.rule.axis, self._where())]
        if self.parts_on_torch:
            return self._flax_whole_shape(shapes, fn, dtype)
        shape = shapes[0]
        total = shape[self.rule.axis % len(shape)] if shape else 0
        sizes = _sizes(self.rule, total, len(self.flax), self._where())
        return [_probe_shape(fn, s, dtype) for s in _split_shape(shape, self.rule.axis, sizes)]

    def _torch_parts_shapes(self, shape: Shape, fn: Any, dtype: Any) -> list[Shape]:
        # One Flax tensor, unstacked into layers and/or split into fused parts.
        if self.rule.stacked is not None:
            if not shape or shape[0] != self.layers:
                raise ValueError(f"{self._where()}: {list(shape)} has no {self.layers} layers")
            shape = shape[1:]
        layer = [shape]
        if self.rule.fused is not None:
            total = shape[self.rule.axis % len(shape)] if shape else 0
            sizes = _sizes(self.rule, total, self._n_parts(), self._where())
            layer = _split_shape(shape, self.rule.axis, sizes)
        per_layer = [_probe_shape(fn, s, dtype) for s in layer]
        return per_layer * max(1, self.layers)

    def _flax_whole_shape(self, shapes: Sequence[Shape], fn: Any, dtype: Any) -> list[Shape]:
        # Layers and/or fused parts on the PyTorch side, joined and stacked into one tensor.
        n = self._n_parts()
        layers = []
        for i in range(max(1, self.layers)):
            parts = [_probe_shape(fn, s, dtype) for s in shapes[i * n : (i + 1) * n]]
            layers.append(
                _join_shape(parts, self.rule.axis, self._where()) if self.rule.fused else parts[0]
            )
        if self.rule.stacked is None:
            return [layers[0]]
        if any(s != layers[0] for s in layers):
            raise ValueError(
                f"{self._where()}: layers of shapes {sorted(set(layers))} do not stack"
            )
        return [(len(layers), *layers[0])]

    def to_torch(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The PyTorch tensors of the Flax ``arrays``."""
        return self.values(arrays, to_torch=True)

    def to_flax(self, arrays: Sequence[Any], xp: Any = np) -> list[Any]:
        """The Flax tensors of the PyTorch ``arrays``; ``xp``: the array module the joins and
        splits use (``jax.numpy`` to run on device, under ``jit``)."""
        return self.values(arrays, to_torch=False, xp=xp)

    def values(self, arrays: Sequence[Any], *, to_torch: bool, xp: Any = np) -> list[Any]:
        """The tensors on the PyTorch side (``to_torch``) or the Flax side of the other side's
        ``arrays`` (host numpy arrays, as :meth:`shapes` has them; or ``xp`` arrays)."""
        t = self.rule.transform_or_identity
        fn = t.to_torch if to_torch else t.to_flax
        if self.rule.one_to_one:
            return [fn(arrays[0])]
        if to_torch and not self.parts_on_torch:
            return [np.concatenate([fn(a) for a in arrays], axis=self.rule.axis)]
        if to_torch:
            x = arrays[0]
            layers = [x[i] for i in range(self.layers)] if self.rule.stacked is not None else [x]
            out = []
            for y in layers:
                parts = [y]
                if self.rule.fused is not None:
                    parts = self._split(y, self._n_parts())
                out += [fn(p) for p in parts]
            return out
        if not self.parts_on_torch:
            return [fn(p) for p in self._split(arrays[0], len(self.flax), xp)]
        n = self._n_parts()
        joined = []
        for i in range(max(1, self.layers)):
            parts = [fn(a) for a in arrays[i * n : (i + 1) * n]]
            joined.append(
                xp.concatenate(parts, axis=self.rule.axis) if self.rule.fused else parts[0]
            )
        return [xp.stack(joined) if self.rule.stacked is not None else joined[0]]

    def _split(self, y: Any, n: int, xp: Any = np) -> list[Any]:
        axis = self.rule.axis % y.ndim
        sizes = _sizes(self.rule, y.shape[axis], n, self._where())
        return list(xp.split(y, [int(c) for c in np.cumsum(sizes)[:-1]], axis=axis))

    def pairs(self) -> list[tuple[str, str]]:
        """``(torch key, flax name)`` pairs of this link, for a report."""
        if len(self.flax) == 1:
            return [(k, self.flax[0]) for k in self.torch]
        return [(self.torch[0], n) for n in self.flax]


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
            values = rule.flax_groups(name) if flax_side else rule.torch_groups(name)
            if values is not None:
                yield name, r, rule, values
                break
        else:
            report.unmapped.append(name)


def export_links(
    mapping: KeyMapping, shapes: Mapping[str, Shape]
) -> tuple[list[Link], MappingReport]:
    """The links exporting Flax tensors of ``shapes`` (by name); the report lists the names
    ignored and unmapped, and fused parts left without their siblings (``mismatched``)."""
    report = MappingReport()
    links: list[Link] = []
    groups: dict[tuple[int, str], dict[str, str]] = {}
    for name, r, rule, values in _matched(mapping, shapes, report, flax_side=True):
        shape = shapes[name]
        if rule.one_to_one:
            links.append(Link(rule, (name,), (rule.torch_key(values),)))
        elif rule.fused is not None and rule.fused in values:  # a part of a joined torch key
            groups.setdefault((r, rule.torch_key(values)), {})[values[rule.fused]] = name
        else:
            layers = int(shape[0]) if rule.stacked is not None and shape else 0
            if rule.stacked is not None and not shape:
                report.mismatched.append(f"{name} is a scalar: nothing to unstack")
                continue
            keys = []
            for i in range(layers) if rule.stacked is not None else [None]:
                for p in rule.parts or [None]:
                    v = dict(values)
                    if i is not None:
                        v[str(rule.stacked)] = str(i)
                    if p is not None:
                        v[str(rule.fused)] = p
                    keys.append(rule.torch_key(v))
            links.append(Link(rule, (name,), tuple(keys), layers))
    for (r, key), parts in groups.items():
        rule = mapping.rules[r]
        lacking = [p for p in rule.parts if p not in parts]
        if lacking:
            report.mismatched.append(
                f"{key} joins {', '.join(rule.parts)} but no tensor is the part(s) "
                f"{', '.join(lacking)}"
            )
            continue
        links.append(Link(rule, tuple(parts[p] for p in rule.parts), (key,)))
    return links, report


def load_links(mapping: KeyMapping, keys: Iterable[str]) -> tuple[list[Link], MappingReport]:
    """The links loading PyTorch tensors ``keys``; the report lists the keys ignored and
    unmapped, and stacked or fused groups with a part absent (``mismatched``)."""
    report = MappingReport()
    links: list[Link] = []
    groups: dict[tuple[int, str], dict[tuple[int, str], str]] = {}
    for key, r, rule, values in _matched(mapping, keys, report, flax_side=False):
        if rule.one_to_one:
            links.append(Link(rule, (rule.flax_name(values),), (key,)))
        elif rule.fused is not None and rule.fused not in values:  # one torch key, fused parts
            names = tuple(rule.flax_name({**values, rule.fused: p}) for p in rule.parts)
            links.append(Link(rule, names, (key,)))
        else:
            i = -1
            if rule.stacked is not None:
                index = values[rule.stacked]
                if not index.isdecimal():
                    report.mismatched.append(f"{key}: layer index {index!r} is not a number")
                    continue
                i = int(index)
            p = values[rule.fused] if rule.fused is not None else ""
            rest = {k: v for k, v in values.items() if k not in (rule.stacked, rule.fused)}
            groups.setdefault((r, rule.flax_name(rest)), {})[(i, p)] = key
    for (r, name), got in groups.items():
        rule = mapping.rules[r]
        layers = 1 + max(i for i, _ in got) if rule.stacked is not None else 0
        want = [
            (i, p)
            for i in (range(layers) if rule.stacked is not None else [-1])
            for p in (rule.parts or ("",))
        ]
        lacking = [w for w in want if w not in got]
        if lacking:
            report.mismatched.append(
                f"{name} joins {len(want)} tensors but {len(lacking)} are absent (e.g. layer "
                f"{lacking[0][0]} {lacking[0][1]})".replace("layer -1 ", "")
            )
            continue
        links.append(Link(rule, (name,), tuple(got[w] for w in want), layers))
    return links, report
