"""The vocabulary of a PyTorch <-> Flax key mapping: :class:`Rule` s (a PyTorch key pattern,
a Flax name pattern, an optional :class:`Transform`), their :class:`KeyMapping`, and the
:class:`MappingReport` a load or export gives back. ``integrations/pytorch.py`` moves tensors
with them.

- patterns are literal dotted names with placeholders: ``{i}`` matches one name component
  (``[^.]+``), ``{i:REGEX}`` matches ``REGEX``; both sides use the same placeholders, so every
  rule works in both directions;
- transforms have a ``to_flax`` and a ``to_torch`` side: :class:`Transpose` (``nn.Linear``
  weight ``(out, in)`` -> Flax kernel ``(in, out)``), :class:`SplitHeads` (``(heads * dim)``
  -> ``(heads, dim)`` for attention projections), :class:`Reshape` and :class:`Chain`.

The first rule that matches a key wins.

Example::

    mapping = KeyMapping([
        Rule("embed.weight", "embed.embedding"),
        *Rule.linear("layers.{i}.attn.q_proj", "layers.{i}.attn.query", heads=4),
    ], ignore_torch=[r".*\\.num_batches_tracked"])
    mapping.to_flax("layers.0.attn.q_proj.weight")   # ("layers.0.attn.query.kernel", ...)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

_PLACEHOLDER = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


# --------------------------------------------------------------------------- transforms


class Transform(Protocol):
    """A reversible tensor transform: ``to_flax(to_torch(x))`` gives ``x`` back."""

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        """The PyTorch tensor ``x`` as the Flax variable wants it."""
        ...

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        """The Flax value ``x`` as PyTorch stores it."""
        ...


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Permutes axes: ``Transpose()`` reverses them (``nn.Linear`` weight ``(out, in)`` ->
    kernel ``(in, out)``); ``Transpose((2, 3, 1, 0))`` turns a ``Conv2d`` weight
    ``(out, in, kh, kw)`` into an NNX ``Conv`` kernel ``(kh, kw, in, out)``."""

    axes: tuple[int, ...] | None = None

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.axes)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        if self.axes is None:
            return np.transpose(x)
        return np.transpose(x, np.argsort(self.axes))


@dataclasses.dataclass(frozen=True)
class SplitHeads:
    """Splits axis ``axis`` of size ``heads * dim`` into ``(heads, dim)`` (and merges it back
    for PyTorch), as NNX ``MultiHeadAttention`` stores its projections: query/key/value kernels
    ``(features, heads, dim)`` and biases ``(heads, dim)``, the output kernel
    ``(heads, dim, features)``."""

    heads: int
    axis: int = -1

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % x.ndim
        size = x.shape[axis]
        if size % self.heads:
            raise ValueError(f"axis {axis} of size {size} does not split into {self.heads} heads")
        return x.reshape(*x.shape[:axis], self.heads, size // self.heads, *x.shape[axis + 1 :])

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % (x.ndim - 1)
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Reshapes between two fixed shapes (``-1`` allowed on either side)."""

    flax_shape: tuple[int, ...]
    torch_shape: tuple[int, ...]

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.flax_shape)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.torch_shape)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Several transforms: applied in order towards Flax, in reverse order towards PyTorch."""

    transforms: tuple[Any, ...]

    def __init__(self, *transforms: Transform) -> None:
        object.__setattr__(self, "transforms", tuple(transforms))

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        for t in self.transforms:
            x = t.to_flax(x)
        return x

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        for t in reversed(self.transforms):
            x = t.to_torch(x)
        return x


@dataclasses.dataclass(frozen=True)
class _Identity:
    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return x


IDENTITY = _Identity()


# --------------------------------------------------------------------------- rules


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> tuple[re.Pattern[str], list[str]]:
    parts: list[str] = []
    names: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[pos : m.start()]))
        name, regex = m.group(1), m.group(2) or r"[^.]+"
        if name in names:
            parts.append(f"(?P={name})")
        else:
            parts.append(f"(?P<{name}>{regex})")
            names.append(name)
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), names


def _fill(pattern: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], pattern)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rename rule: a PyTorch key pattern, a Flax name pattern and a transform.

    Attributes:
      torch: e.g. ``"layers.{i}.mlp.fc1.weight"``.
      flax: e.g. ``"layers.{i}.mlp.fc1.kernel"`` (the same placeholders).
      transform: applied to the tensor (default: none).

    Example::

        Rule("layers.{i}.fc.weight", "blocks.{i}.dense.kernel", Transpose())
        Rule("h.{i:\\d+}.ln.weight", "h.{i}.ln.scale")     # a placeholder with its own regex
    """

    torch: str
    flax: str
    transform: Any = None

    def __post_init__(self) -> None:
        (_, torch_names), (_, flax_names) = _compile(self.torch), _compile(self.flax)
        if set(torch_names) != set(flax_names):
            raise ValueError(
                f"rule {self.torch!r} -> {self.flax!r}: both sides need the same placeholders "
                f"(torch has {sorted(torch_names)}, flax has {sorted(flax_names)})"
            )

    def match_torch(self, key: str) -> str | None:
        """The Flax name for PyTorch ``key``, or None if the rule does not apply."""
        m = _compile(self.torch)[0].fullmatch(key)
        return None if m is None else _fill(self.flax, m.groupdict())

    def match_flax(self, name: str) -> str | None:
        """The PyTorch key for Flax ``name``, or None if the rule does not apply."""
        m = _compile(self.flax)[0].fullmatch(name)
        return None if m is None else _fill(self.torch, m.groupdict())

    @property
    def transform_or_identity(self) -> Transform:
        return self.transform if self.transform is not None else IDENTITY

    # ---- rules for common layers

    @staticmethod
    def linear(
        torch: str, flax: str, *, heads: int | None = None, heads_on: str = "output"
    ) -> list[Rule]:
        """``nn.Linear`` ``{torch}.weight/bias`` -> NNX ``{flax}.kernel/bias``.

        With ``heads``, the head split of NNX ``MultiHeadAttention``: ``heads_on="output"`` for
        the query/key/value projections (kernel ``(in, heads, dim)``, bias ``(heads, dim)``),
        ``"input"`` for the output projection (kernel ``(heads, dim, out)``).
        """
        if heads is None:
            return [
                Rule(f"{torch}.weight", f"{flax}.kernel", Transpose()),
                Rule(f"{torch}.bias", f"{flax}.bias"),
            ]
        if heads_on == "output":
            return [
                Rule(
                    f"{torch}.weight", f"{flax}.kernel", Chain(Transpose(), SplitHeads(heads, -1))
                ),
                Rule(f"{torch}.bias", f"{flax}.bias", SplitHeads(heads, 0)),
            ]
        if heads_on == "input":
            return [
                Rule(f"{torch}.weight", f"{flax}.kernel", Chain(Transpose(), SplitHeads(heads, 0))),
                Rule(f"{torch}.bias", f"{flax}.bias"),
            ]
        raise ValueError(f"heads_on must be 'output' or 'input', not {heads_on!r}")

    @staticmethod
    def layer_norm(torch: str, flax: str) -> list[Rule]:
        """``nn.LayerNorm`` ``weight/bias`` -> NNX ``LayerNorm`` ``scale/bias``."""
        return [Rule(f"{torch}.weight", f"{flax}.scale"), Rule(f"{torch}.bias", f"{flax}.bias")]

    @staticmethod
    def embedding(torch: str, flax: str) -> list[Rule]:
        """``nn.Embedding`` ``weight`` -> NNX ``Embed`` ``embedding``."""
        return [Rule(f"{torch}.weight", f"{flax}.embedding")]


@dataclasses.dataclass(frozen=True)
class KeyMapping:
    """An ordered list of rules plus keys deliberately left out.

    Attributes:
      rules: tried in order; the first match wins.
      ignore_torch: regexes (full match) of PyTorch keys that are not loaded and not reported,
        e.g. ``r".*\\.num_batches_tracked"``.
      ignore_flax: regexes of Flax names that are neither loaded nor exported.
    """

    rules: tuple[Rule, ...]
    ignore_torch: tuple[str, ...] = ()
    ignore_flax: tuple[str, ...] = ()

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        ignore_torch: Iterable[str] = (),
        ignore_flax: Iterable[str] = (),
    ) -> None:
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "ignore_torch", tuple(ignore_torch))
        object.__setattr__(self, "ignore_flax", tuple(ignore_flax))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"KeyMapping takes Rule objects, got {r!r}")

    def torch_ignored(self, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignore_torch)

    def flax_ignored(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignore_flax)

    def to_flax(self, key: str) -> tuple[str, Transform] | None:
        """``(flax name, transform)`` for a PyTorch key, or None when no rule matches."""
        for rule in self.rules:
            name = rule.match_torch(key)
            if name is not None:
                return name, rule.transform_or_identity
        return None

    def to_torch(self, name: str) -> tuple[str, Transform] | None:
        """``(PyTorch key, transform)`` for a Flax name, or None when no rule matches."""
        for rule in self.rules:
            key = rule.match_flax(name)
            if key is not None:
                return key, rule.transform_or_identity
        return None


# --------------------------------------------------------------------------- reports


@dataclasses.dataclass
class MappingReport:
    """What a load or export moved, and what it could not.

    Attributes:
      moved: ``(source key, destination key)`` pairs written.
      unmapped: source keys that no rule maps (PyTorch keys on load, Flax names on export).
      unexpected: ``"source -> destination"`` where the destination does not exist in the
        model (load only).
      missing: model variables that received no value (load only).
      mismatched: shape problems, each naming both keys and both shapes.
      ignored: keys skipped on purpose (``ignore_torch``/``ignore_flax``).
    """

    moved: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unmapped: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every key was mapped and every model variable received a value."""
        return not (self.unmapped or self.unexpected or self.missing or self.mismatched)

    def problems(self) -> str:
        """One readable block listing every problem (empty when :attr:`ok`)."""
        lines = []
        for title, keys in (
            ("no rule maps these keys", self.unmapped),
            ("mapped to names the model does not have", self.unexpected),
            ("model variables nothing maps to", self.missing),
            ("shapes that do not fit", self.mismatched),
        ):
            if keys:
                lines.append(f"{title} ({len(keys)}):")
                lines += [f"  {k}" for k in keys]
        return "\n".join(lines)
