"""The vocabulary of a PyTorch <-> Flax key mapping: a :class:`Rule` (a PyTorch key pattern, a
Flax name pattern, a transform from ``transforms.py``; ``stacked``/``fused`` placeholders
gather several tensors into one), a :class:`KeyMapping` (ordered rules, the first match wins,
plus keys left out, tied keys and the LoRA scale) and the :class:`MappingReport` a load or an
export gives back. ``links.py`` applies rules to a table of names; ``stacking.py`` says how one
tensor holds the slices of another.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.integrations.transforms import (
    IDENTITY,
    Chain,
    SplitHeads,
    Transform,
    Transpose,
)

_PLACEHOLDER = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


# --------------------------------------------------------------------------- rules


@functools.lru_cache(maxsize=4096)
def _compile(
    pattern: str, regexes: tuple[tuple[str, str], ...] = ()
) -> tuple[re.Pattern[str], list[str]]:
    # ``regexes``: a placeholder's regex declared on the other side of its rule (or here).
    given = dict(regexes)
    parts: list[str] = []
    names: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[pos : m.start()]))
        name = m.group(1)
        regex = m.group(2) or given.get(name) or r"[^.]+"
        if name in names:
            parts.append(f"(?P={name})")
        else:
            parts.append(f"(?P<{name}>{regex})")
            names.append(name)
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), names


def _declared(pattern: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _PLACEHOLDER.finditer(pattern) if m.group(2)}


def _fill(pattern: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], pattern)


def _listed(regex: str | None) -> tuple[str, ...] | None:
    # The literal alternatives a placeholder's regex lists (``gate|up``), else None.
    parts = tuple((regex or "").split("|"))
    if not regex or any(not p or re.escape(p) != p for p in parts):
        return None
    return parts


def _alternatives(regex: str | None, where: str) -> tuple[str, ...]:
    parts = _listed(regex)
    if parts is None:
        raise ValueError(
            f"{where}: a fused placeholder lists its parts in order as literal alternatives, "
            "e.g. {p:q_proj|k_proj|v_proj}"
        )
    return parts


StackedSpec = str | Sequence[str | tuple[str, int]] | Mapping[str, int] | None


def _stack_axes(stacked: StackedSpec, where: str) -> tuple[tuple[str, int], ...] | None:
    # ``"i"``, ``("i", "e")`` (axes 0, 1), ``{"i": 1, "e": 0}`` or ``(("i", 1), ("e", 0))``
    # -> ``(("i", 0),)`` ...: each stacking placeholder with its axis in the stacked tensor.
    if stacked is None:
        return None
    if isinstance(stacked, str):
        entries: list[Any] = [stacked]
    elif isinstance(stacked, Mapping):
        entries = list(stacked.items())
    elif isinstance(stacked, Sequence):
        entries = list(stacked)
    else:
        entries = [None]  # (refused below)
    out: list[tuple[str, int]] = []
    for position, entry in enumerate(entries):
        if isinstance(entry, str):
            name, axis = entry, position
        elif (
            isinstance(entry, Sequence)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], (int, np.integer))
            and not isinstance(entry[1], bool)
        ):
            name, axis = entry[0], int(entry[1])
        else:
            raise ValueError(
                f"{where}: stacked= takes a placeholder name, names (axes 0, 1, ...), "
                f"{{name: axis}} or (name, axis) pairs; got {stacked!r}"
            )
        out.append((name, axis))
    names = [n for n, _ in out]
    if not out or len(set(names)) != len(names):
        raise ValueError(f"{where}: stacked={stacked!r} must name distinct placeholders")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rename rule: a PyTorch key pattern, a Flax name pattern and a transform.

    Attributes:
      torch: e.g. ``"layers.{i}.mlp.fc1.weight"``.
      flax: e.g. ``"layers.{i}.mlp.fc1.kernel"`` (the same placeholders). A placeholder's
        regex (``{p:q_proj|k_proj}``) is declared once, on either side, and holds on both.
      transform: applied to the tensor (default: none); with ``stacked`` or ``fused``, to each
        slice (one layer of one expert, one projection): see "Stacked layouts" in
        ``docs/huggingface.md``.
      stacked: placeholders that index axes of a stacked tensor, each on one side only: the
        tensor of the *other* side holds them all on its ``axis``. ``"i"`` (axis 0),
        ``("i", "e")`` (axes 0 and 1), ``{"i": 1, "e": 0}`` or ``(("i", 1), ("e", 0))``
        (any axes of the stacked tensor, negative ones counted from its end). ``{i}`` of the
        PyTorch side only: the Flax tensor is ``[..., L, ...]`` (scanned layers); of the Flax
        side only: the PyTorch tensor stacks the Flax tensors. A placeholder listing its
        values (``{p:gate|up}``) stacks them in that order; any other counts ``0..n-1``.
      fused: a placeholder on one side only, declared with its parts in order
        (``{p:q_proj|k_proj|v_proj}``): the tensor of the other side is its parts joined along
        ``axis`` (an axis of that tensor, in its own layout, with its ``stacked`` axes left
        out: ``-1`` for a kernel ``(in, q + k + v)``, ``0`` for a weight ``(q + k + v, in)``)
        and split back in ``sizes`` (required for parts of unequal sizes; default: equal).
      axis: see ``fused``.
      sizes: see ``fused``.

    Example::

        Rule("layers.{i}.fc.weight", "blocks.{i}.dense.kernel", Transpose())
        Rule("h.{i:\\d+}.ln.weight", "h.{i}.ln.scale")     # a placeholder with its own regex
        Rule("layers.{i}.mlp.fc.weight", "layers.mlp.fc.kernel", Transpose(), stacked="i")
        Rule("l.{i}.{p:q_proj|k_proj|v_proj}.weight", "l.{i}.qkv.kernel", Transpose(),
             fused="p", axis=-1, sizes=(64, 16, 16))
        # MaxText's MoE experts (experts, L, emb, mlp) from per-layer, per-expert nn.Linear
        Rule("layers.{i}.experts.{e}.w1.weight", "decoder.layers.moe.wi_0", Transpose(),
             stacked={"e": 0, "i": 1})
    """

    torch: str
    flax: str
    transform: Any = None
    stacked: Any = None
    fused: str | None = None
    axis: int = 0
    sizes: tuple[int, ...] | None = None
    _regexes: tuple[tuple[str, str], ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        where = f"rule {self.torch!r} -> {self.flax!r}"
        declared = _declared(self.torch)
        for name, regex in _declared(self.flax).items():
            if declared.setdefault(name, regex) != regex:
                raise ValueError(
                    f"{where}: placeholder {{{name}}} declares two regexes; declare it once"
                )
        object.__setattr__(self, "_regexes", tuple(sorted(declared.items())))
        object.__setattr__(self, "stacked", _stack_axes(self.stacked, where))
        torch_names, flax_names = set(self._pattern(False)[1]), set(self._pattern(True)[1])
        for name in self.stacked_names:
            if (name in torch_names) == (name in flax_names):
                raise ValueError(
                    f"{where}: stacked placeholder {{{name}}} must be on one side only (the "
                    "other side's tensor stacks its values); "
                    + (
                        "on both sides each value is its own tensor on both: a per-layer "
                        "rule, leave it out of stacked="
                        if name in torch_names
                        else "neither pattern has it"
                    )
                )
        for names in (torch_names, flax_names):  # (each side's stacks: one tensor's axes)
            axes = [a for n, a in self.stacked or () if n in names]
            if len(set(axes)) != len(axes):
                raise ValueError(
                    f"{where}: stacked={dict(self.stacked or ())} puts two placeholders of one "
                    "side on one axis"
                )
        if self.fused is not None:
            if (self.fused in torch_names) == (self.fused in flax_names):
                raise ValueError(
                    f"{where}: fused={self.fused!r} must be a placeholder of one side only"
                )
            if self.fused in self.stacked_names:
                raise ValueError(
                    f"{where}: {{{self.fused}}} is both stacked and fused; a placeholder "
                    "either stacks its values on a new axis or joins them along an axis"
                )
            _alternatives(declared.get(self.fused), where)
        collective = self.collective
        if torch_names - collective != flax_names - collective:
            raise ValueError(
                f"{where}: both sides need the same placeholders, except stacked and fused ones "
                f"(torch has {sorted(torch_names)}, flax has {sorted(flax_names)})"
            )
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))

    def _pattern(self, flax: bool) -> tuple[re.Pattern[str], list[str]]:
        return _compile(self.flax if flax else self.torch, self._regexes)

    @property
    def parts(self) -> tuple[str, ...]:
        """The fused placeholder's values, in order (empty without ``fused``)."""
        if self.fused is None:
            return ()
        return _alternatives(dict(self._regexes)[self.fused], self.torch)

    @property
    def stacked_names(self) -> tuple[str, ...]:
        """The stacking placeholders, in the order ``stacked`` gives them."""
        return tuple(n for n, _ in self.stacked or ())

    @property
    def collective(self) -> frozenset[str]:
        """The placeholders that gather several tensors into one (stacked and fused)."""
        return frozenset((*self.stacked_names, *([self.fused] if self.fused else [])))

    def gathered_by(self, *, flax: bool) -> frozenset[str]:
        """The collective placeholders a tensor of the Flax side (``flax``) or the PyTorch
        side gathers: those of the other side's pattern only."""
        other = self._pattern(not flax)[1]
        return frozenset(n for n in self.collective if n in other)

    def stack_values(self, name: str) -> tuple[str, ...] | None:
        """The values stacking placeholder ``name`` stacks, in order, when it lists them
        (``{p:gate|up}``); None when it counts ``0..n-1``."""
        return _listed(dict(self._regexes).get(name))

    def value_index(self, name: str, value: str) -> int | None:
        """The position of ``value`` along collective placeholder ``name`` (a fused part, a
        listed stacked value, or a count written ``0``, ``1``, ...), or None if it is none."""
        listed = self.parts if name == self.fused else self.stack_values(name)
        if listed is not None:
            return listed.index(value) if value in listed else None
        return int(value) if value.isdecimal() and str(int(value)) == value else None

    def value_at(self, name: str, index: int) -> str:
        """The value of collective placeholder ``name`` at position ``index``."""
        listed = self.parts if name == self.fused else self.stack_values(name)
        return listed[index] if listed is not None else str(index)

    @property
    def one_to_one(self) -> bool:
        """Whether one PyTorch key is one Flax name (no ``stacked``, no ``fused``)."""
        return self.stacked is None and self.fused is None

    def groups(self, name: str, *, flax: bool) -> dict[str, str] | None:
        """The placeholder values of Flax name (``flax``) or PyTorch key ``name``, or None if
        the rule does not apply."""
        m = self._pattern(flax)[0].fullmatch(name)
        return None if m is None else m.groupdict()

    def fill(self, values: dict[str, str], *, flax: bool) -> str:
        """The Flax name (``flax``) or the PyTorch key for placeholder ``values``."""
        return _fill(self.flax if flax else self.torch, values)

    def torch_groups(self, key: str) -> dict[str, str] | None:
        """The placeholder values of PyTorch ``key``, or None if the rule does not apply."""
        return self.groups(key, flax=False)

    def flax_groups(self, name: str) -> dict[str, str] | None:
        """The placeholder values of Flax ``name``, or None if the rule does not apply."""
        return self.groups(name, flax=True)

    def torch_key(self, values: dict[str, str]) -> str:
        """The PyTorch key for placeholder ``values``."""
        return self.fill(values, flax=False)

    def flax_name(self, values: dict[str, str]) -> str:
        """The Flax name for placeholder ``values``."""
        return self.fill(values, flax=True)

    def match_torch(self, key: str) -> str | None:
        """The Flax name for PyTorch ``key``, or None if the rule does not apply (with
        ``stacked``/``fused``: the tensor holding ``key``'s values, or the first of the
        Flax tensors ``key`` holds)."""
        return self.match(key, flax=False)

    def match_flax(self, name: str) -> str | None:
        """The PyTorch key for Flax ``name``, or None if the rule does not apply (with
        ``stacked``/``fused``: the first of the keys ``name`` holds, or the key holding it)."""
        return self.match(name, flax=True)

    def match(self, name: str, *, flax: bool) -> str | None:
        """:meth:`match_flax` of Flax name (``flax``) ``name``, else :meth:`match_torch`."""
        values = self.groups(name, flax=flax)
        if values is None:
            return None
        return self.fill(self._first_values(values), flax=not flax)

    def _first_values(self, values: dict[str, str]) -> dict[str, str]:
        # ``values`` with each collective placeholder they lack at its first value.
        return {**{n: self.value_at(n, 0) for n in self.collective}, **values}

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
    def conv1d(torch: str, flax: str) -> list[Rule]:
        """GPT-2 style ``Conv1D`` (``transformers.pytorch_utils.Conv1D``) ``{torch}.weight/bias``
        -> NNX ``{flax}.kernel/bias``: ``Conv1D`` already stores its weight ``(in, out)``, as
        the kernel, so nothing is transposed (``Rule.linear`` would be wrong here)."""
        return [Rule(f"{torch}.weight", f"{flax}.kernel"), Rule(f"{torch}.bias", f"{flax}.bias")]

    @staticmethod
    def layer_norm(torch: str, flax: str) -> list[Rule]:
        """``nn.LayerNorm`` ``weight/bias`` -> NNX ``LayerNorm`` ``scale/bias``."""
        return [Rule(f"{torch}.weight", f"{flax}.scale"), Rule(f"{torch}.bias", f"{flax}.bias")]

    @staticmethod
    def embedding(torch: str, flax: str) -> list[Rule]:
        """``nn.Embedding`` ``weight`` -> NNX ``Embed`` ``embedding``."""
        return [Rule(f"{torch}.weight", f"{flax}.embedding")]


def aliased(rules: Sequence[Rule], aliases: Iterable[tuple[str, Sequence[str]]]) -> list[Rule]:
    """``rules``, then each rule whose PyTorch pattern starts with a prefix of ``aliases``
    (``(prefix, its other spellings)``) under each other spelling: a load reads every
    spelling, an export writes the first (the first rule matching wins)."""
    return [
        *rules,
        *(
            dataclasses.replace(r, torch=alias + r.torch[len(prefix) :])
            for prefix, others in aliases
            for r in rules
            if r.torch.startswith(prefix)
            for alias in others
        ),
    ]


@dataclasses.dataclass(frozen=True)
class KeyMapping:
    """An ordered list of rules plus keys deliberately left out.

    Attributes:
      rules: tried in order; the first match wins.
      ignore_torch: regexes (full match) of PyTorch keys that are not loaded and not reported,
        e.g. ``r".*\\.num_batches_tracked"``.
      ignore_flax: regexes of Flax names that are neither loaded nor exported.
      tied: ``{tied PyTorch key: the key it is tied to}``, e.g. ``{"lm_head.weight":
        "model.embed_tokens.weight"}``: an export writes nothing for the tied key when its
        value is the other key's (a model whose head has diverged from its embedding gets
        it written, untied, with a warning: see ``export_pytorch``), and a file without it
        loads it from the other key (through the tied key's own rule).
      lora_scale: the scale of the LoRA adapters merged into their kernels on export,
        ``kernel + lora_a @ lora_b * lora_scale`` in the kernel's dtype (flax's
        ``nnx.LoRALinear`` and ``nnx.LoRA(base_module=...)``, and qwix's
        ``W_lora_a``/``W_lora_b`` next to ``W``, which Tunix applies). None (the default):
        1.0 for flax's adapters, whose forward pass is unscaled; qwix scales by
        ``alpha / rank`` on the forward pass, which its tensors do not record, so an export
        of qwix adapters needs it given (``LoraProvider(rank=4, alpha=8)``: 2.0).

    Example::

        KeyMapping([Rule("fc.weight", "fc.kernel", Transpose())], ignore_flax=["step"])
    """

    rules: tuple[Rule, ...]
    ignore_torch: tuple[str, ...] = ()
    ignore_flax: tuple[str, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    lora_scale: float | None = None

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        ignore_torch: Iterable[str] = (),
        ignore_flax: Iterable[str] = (),
        tied: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        lora_scale: float | None = None,
    ) -> None:
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "ignore_torch", tuple(ignore_torch))
        object.__setattr__(self, "ignore_flax", tuple(ignore_flax))
        # (a dict, or the pairs ``tied`` holds: ``dataclasses.replace`` passes those back)
        object.__setattr__(self, "tied", tuple(dict(tied or {}).items()))
        object.__setattr__(self, "lora_scale", None if lora_scale is None else float(lora_scale))
        if self.lora_scale is not None and not math.isfinite(self.lora_scale):
            raise ValueError(f"lora_scale must be a finite number, not {lora_scale!r}")
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"KeyMapping takes Rule objects, got {r!r}")
        for key, source in self.tied:
            if key == source or key in dict(self.tied).values():
                raise ValueError(f"tied={{{key!r}: {source!r}}}: a key cannot be tied to itself")

    def torch_ignored(self, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignore_torch)

    def flax_ignored(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignore_flax)

    def to_flax(self, key: str) -> tuple[str, Transform] | None:
        """``(flax name, transform)`` for a PyTorch key, or None when no rule matches."""
        for rule in self.rules:
            name = rule.match_torch(key)
            if name is not None:  # (the joined tensor with stacked/fused: see links.py)
                return name, rule.transform_or_identity
        return None

    def to_torch(self, name: str) -> tuple[str, Transform] | None:
        """``(PyTorch key, transform)`` for a Flax name, or None when no rule matches."""
        for rule in self.rules:
            key = rule.match_flax(name)
            if key is not None:
                return key, rule.transform_or_identity
        return None

    # The mapping protocol of SafetensorsSave(mapping=) / SafetensorsRestore(mapping=): the
    # work is the export's and the load's, which build on this module (imported when called).

    def export_plan(
        self, validated: Any, dtype: Any, hf_config: Any, *, generation_config: Any = None
    ) -> Any:
        """What ``SafetensorsSave(item, mapping=self)`` writes instead of the item's."""
        from orbax_safetensors._src.integrations import export

        return export.export_plan(
            self, validated, dtype, hf_config, generation_config=generation_config
        )

    def restore(self, directory: Any, target: Any, **options: Any) -> Any:
        """``target`` filled from the item ``SafetensorsSave(mapping=self)`` wrote."""
        from orbax_safetensors._src.integrations import export

        return export.restore_item(directory, target, self, **options)


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
      merged: ``(LoRA adapter, kernel)`` pairs: adapters an export merged into their kernel
        (written as part of it, see ``KeyMapping.lora_scale``).
      refused: LoRA adapters an export would have left out (``ignore_flax`` matches them,
        or they fit no kernel): the files would hold the base model without its
        fine-tune.
      untied: tied PyTorch keys (``KeyMapping.tied``) an export wrote all the same, since
        their value differs from the key they are tied to.
      bytes_written: tensor data bytes this process wrote (an export; in a multi-process
        export, its own share).
      bytes_read: tensor data bytes this process read from safetensors files (a load or an
        import; in a multi-process job, its own share: ``ReadStats.bytes_read``).

    Example::

        report = osf.load_pytorch(model, "hf_dir", mapping)
        assert report.ok, (report.unmapped, report.missing, report.mismatched)
    """

    moved: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unmapped: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)
    bytes_written: int = 0
    merged: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    untied: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        """True when every key was mapped, every model variable received a value and no
        LoRA adapter was left out."""
        return not (
            self.unmapped or self.unexpected or self.missing or self.mismatched or self.refused
        )

    def problems(self) -> str:
        """One readable block listing every problem (empty when :attr:`ok`): a heading per kind
        of problem, with its count, then its keys, one per indented line.

        Example::

            print(report.problems())
            # no rule maps these keys (2):
            #   params.w
            #   params.b
        """
        lines = []
        for title, keys in (
            ("no rule maps these keys", self.unmapped),
            ("mapped to names the model does not have", self.unexpected),
            ("model variables nothing maps to", self.missing),
            ("shapes that do not fit", self.mismatched),
            (
                "LoRA adapters the export would drop (the files would lose the fine-tune)",
                self.refused,
            ),
        ):
            if keys:
                lines.append(f"{title} ({len(keys)}):")
                lines += [f"  {k}" for k in keys]
        return "\n".join(lines)
