"""The sizes a Hugging Face config claims, read in one place and never believed over the
tensors: :class:`ConfigFacts` reads every value that shapes a tensor (a positive whole number,
key/value heads dividing the heads...; else :class:`ConfigError` naming the key and value)
and checks an export's planned tensors against it (:meth:`ConfigFacts.tensor_problems`).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from collections.abc import Mapping
from typing import Any

from etils import epath

from orbax_safetensors._src.core.errors import ConfigError
from orbax_safetensors._src.integrations import model_files as _model_files

Shape = tuple[int, ...]

# The names of a causal LM's tensors that the checks know (Hugging Face's decoder layouts:
# LLaMA, Mistral, Qwen, Gemma, Mixtral, their multimodal wrappers' language model): other
# keys (a vision tower's, GPT-2's fused attention) are left to the shape arithmetic.
_LM = r"^(?:model\.(?:language_model\.)?|language_model\.model\.)"
_EMBEDDING = re.compile(_LM + r"embed_tokens\.weight$|^transformer\.wte\.weight$")
_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.weight$")
_LAYER = re.compile(_LM + r"layers\.(\d+)\.(.+)$")
_ATTENTION = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MLP = re.compile(r"mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT = re.compile(
    r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.weight$")
_INTO = frozenset({"gate_proj", "up_proj", "w1", "w3"})  # (out, in): out is the MLP's width
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # Mixtral, Qwen, DeepSeek
# Multi-head latent attention (DeepSeek V2, V3): its projections and their norms
_LATENT = re.compile(
    r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|q_a_layernorm"
    r"|kv_a_layernorm)\.weight$"
)


@dataclasses.dataclass(frozen=True)
class ConfigFacts:
    """The keys of a Hugging Face config (``doc``), read as validated sizes.

    Attributes:
      doc: the config's keys (a nested ``text_config``'s, for :meth:`language_model`).
      where: how messages name the config (``"hf_config"``, ``"hf_config /m/config.json"``).
      prefix: the keys' place in the config (``"text_config."`` for a nested one).
    """

    doc: Mapping[str, Any]
    where: str = "hf_config"
    prefix: str = ""

    @classmethod
    def of(cls, hf_config: Any) -> ConfigFacts:
        """The facts of ``hf_config``: a transformers config, a dict, a ``config.json`` or a
        directory holding one (``ValueError`` for a path without one; ``TypeError`` else)."""
        # A transformers config gives all its keys, defaults included, as the model it builds
        # has them; messages name a path's config.json.
        if isinstance(hf_config, ConfigFacts):
            return hf_config
        if isinstance(hf_config, Mapping):
            return cls(hf_config)
        doc = _model_files.config_keys(hf_config) or {}
        if not isinstance(hf_config, (str, os.PathLike)):
            return cls(doc)
        path = epath.Path(hf_config)
        config = path / _model_files.CONFIG_FILE_NAME if path.is_dir() else path
        return cls(doc, f"hf_config {config}")

    def language_model(self) -> ConfigFacts:
        """These facts, or those of a nested ``text_config`` (a multimodal model's language
        model: Gemma 3, LLaVA) when these name no heads."""
        text = self.doc.get("text_config")
        if self.doc.get("num_attention_heads") is None and isinstance(text, Mapping):
            return ConfigFacts(text, self.where, self.prefix + "text_config.")
        return self

    # ---- values, each validated as it is read

    def size(self, key: str, most: tuple[int, str] | None = None) -> int | None:
        """``key``'s value as a positive whole number; None where absent or null;
        ``ConfigError`` naming the key and value for any other value, or for one past
        ``most`` (the bound, and how the error names it)."""
        return self._whole(key, 1, "not positive", most)

    def count(self, key: str, most: tuple[int, str] | None = None) -> int | None:
        """As :meth:`size`, zero allowed."""
        return self._whole(key, 0, "negative", most)

    def _whole(self, key: str, least: int, below: str, most: tuple[int, str] | None) -> int | None:
        # (``below``: what a value under ``least`` is called in the error)
        value = self.doc.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{self.where}: {self.prefix}{key} is {value!r}, not a whole number")
        value = int(value)
        if value < least:
            raise ConfigError(f"{self.where}: {self.prefix}{key} is {value}, {below}")
        if most is not None and value > most[0]:
            raise ConfigError(f"{self.where}: {self.prefix}{key} is {value}, more than {most[1]}")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        """``key``'s value as a bool (``default`` where absent or null); ``ConfigError``
        naming the key for another value."""
        value = self.doc.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: {self.prefix}{key} is {value!r}, not true or false")
        return value

    def head_dim(self) -> int | None:
        """``head_dim``, or ``hidden_size / num_attention_heads`` where it is absent; None
        where neither is given; ``ConfigError`` where heads do not divide ``hidden_size``."""
        given = self.size("head_dim")
        if given is not None:
            return given
        heads, hidden = self.size("num_attention_heads"), self.size("hidden_size")
        if heads is None or hidden is None:
            return None
        if hidden % heads:
            raise ConfigError(
                f"{self.where}: {self.prefix}hidden_size {hidden} does not split into "
                f"{self.prefix}num_attention_heads {heads} heads (and no head_dim is given)"
            )
        return hidden // heads

    def attention(self) -> tuple[int, int, int] | None:
        """``(heads, key/value heads, head_dim)`` (key/value heads default to the heads);
        None where the config names no heads or no ``head_dim`` can be had; ``ConfigError``
        where key/value heads do not divide the heads."""
        heads = self.size("num_attention_heads")
        if heads is None:
            return None
        kv = self.size("num_key_value_heads") or heads
        if heads % kv:
            raise ConfigError(
                f"{self.where}: {self.prefix}num_key_value_heads {kv} does not divide "
                f"{self.prefix}num_attention_heads {heads}"
            )
        head_dim = self.head_dim()
        return None if head_dim is None else (heads, kv, head_dim)

    def width(self, key: str) -> int | None:
        """An MLP width (see :meth:`count`); None for a list of one per layer (Gemma 3n's),
        which the shape arithmetic checks."""
        return None if isinstance(self.doc.get(key), (list, tuple)) else self.count(key)

    def experts(self) -> tuple[str, int] | None:
        """``(key, number)`` of the experts a layer holds: ``num_local_experts`` (Mixtral),
        ``num_experts`` (Qwen MoE) or ``n_routed_experts`` (DeepSeek); None for a dense
        model."""
        for key in _EXPERT_COUNTS:
            n = self.count(key)
            if n is not None:
                return key, n
        return None

    # ---- against the tensors

    def tensor_problems(self, shapes: Mapping[str, Shape]) -> list[str]:
        """One line per claim of this config (its language model's: :meth:`language_model`)
        that the Hugging Face tensors of ``shapes`` (by key) contradict, naming the key, the
        number it claims and the one the tensors give: embedding and ``lm_head`` rows
        (``vocab_size``) and width (``hidden_size``), attention projections (heads,
        key/value heads times ``head_dim``), MLP widths (``intermediate_size``; experts':
        ``moe_intermediate_size`` where given), the layers (``num_hidden_layers``: exactly
        ``0 .. n - 1``) and the experts (``num_local_experts`` / ``num_experts`` /
        ``n_routed_experts``: each layer's, and the router's rows); DeepSeek's latent
        attention (:func:`_latent_sizes`). Keys of other layouts are not looked at.

        Raises:
          ConfigError: an impossible value (see :meth:`size`).
        """
        return _Claims(self.language_model()).problems(shapes)

    def validated(self) -> ConfigFacts:
        """These facts, once every size :meth:`tensor_problems` compares has been read
        (each checked as :meth:`size` checks it): an impossible config is refused before any
        tensor is read.

        Raises:
          ConfigError: naming the key and its value.
        """
        _Claims(self.language_model())
        return self


# Model types with DeepSeek's multi-head latent attention (:func:`_latent_sizes`)
_LATENT_ATTENTION = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})


def _latent_sizes(f: ConfigFacts) -> dict[str, tuple[tuple[str, int | None], ...]]:
    """What a DeepSeek config claims of each latent-attention tensor, by module: ``(what,
    size)`` of its rows, then of its columns (transformers' ``DeepseekV3Attention``; a size
    None where a key it needs is absent). Every key is read (validated) here."""
    heads, hidden = f.size("num_attention_heads"), f.size("hidden_size")
    q_rank, kv_rank = f.size("q_lora_rank"), f.size("kv_lora_rank")
    nope, rope, v = (f.count(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))

    def times(*dims: tuple[str, int | None]) -> tuple[str, int | None]:
        # ("num_attention_heads 4 x (qk_nope_head_dim 6 + qk_rope_head_dim 4) =", 40)
        sizes = [n for _, n in dims]
        words = " + ".join(f"{k} {n}" for k, n in dims)
        known = heads is not None and None not in sizes
        return f"num_attention_heads {heads} x ({words}) =", (
            heads * sum(n for n in sizes if n is not None) if known and heads else None
        )

    query = times(("qk_nope_head_dim", nope), ("qk_rope_head_dim", rope))
    kv_a_rows = None if kv_rank is None or rope is None else kv_rank + rope
    return {
        "q_proj": (query, ("hidden_size", hidden)),
        "q_a_proj": (("q_lora_rank", q_rank), ("hidden_size", hidden)),
        "q_a_layernorm": (("q_lora_rank", q_rank),),
        "q_b_proj": (query, ("q_lora_rank", q_rank)),
        "kv_a_proj_with_mqa": (
            (f"kv_lora_rank {kv_rank} + qk_rope_head_dim {rope} =", kv_a_rows),
            ("hidden_size", hidden),
        ),
        "kv_a_layernorm": (("kv_lora_rank", kv_rank),),
        "kv_b_proj": (
            times(("qk_nope_head_dim", nope), ("v_head_dim", v)),
            ("kv_lora_rank", kv_rank),
        ),
        "o_proj": (("hidden_size", hidden), times(("v_head_dim", v))),
    }


# Model types whose attention projections are plain: ``q_proj`` (heads * head_dim, hidden),
# ``k_proj``/``v_proj`` (key/value heads * head_dim, hidden), ``o_proj`` (hidden, heads *
# head_dim). Others (multi-head latent attention, gated queries) are left to the shape
# arithmetic; a config that names no model type is taken as plain.
_PLAIN_ATTENTION = frozenset(
    {
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
        "gemma2", "gemma3", "gemma3_text", "phi3", "olmo", "olmo2", "olmoe", "granite",
        "cohere", "cohere2", "starcoder2", "stablelm", "smollm3", "ministral", "helium",
    }
)  # fmt: skip


class _Claims:
    """The checks of :meth:`ConfigFacts.tensor_problems`: the first contradiction of each
    claim, and how many more tensors share it."""

    def __init__(self, facts: ConfigFacts) -> None:
        # Every size the checks compare, read (and validated) before any tensor is looked at.
        self.facts = f = facts
        self.found: dict[str, tuple[str, int]] = {}
        self.vocab, self.hidden = f.size("vocab_size"), f.size("hidden_size")
        plain = f.doc.get("model_type") in _PLAIN_ATTENTION | {None}
        self.attention = f.attention() if plain else None
        self.latent = _latent_sizes(f) if f.doc.get("model_type") in _LATENT_ATTENTION else {}
        # (Gemma 4's use_double_wide_mlp: its KV-shared layers' MLPs twice as wide)
        self.width = None if f.flag("use_double_wide_mlp") else f.width("intermediate_size")
        moe = f.width("moe_intermediate_size")
        self.expert_key = None if moe is None else "moe_intermediate_size"
        self.expert_width = self.width if moe is None else moe
        self.experts = f.experts()
        self.layers = f.count("num_hidden_layers")
        self.extra_layers = f.count("num_nextn_predict_layers") or 0  # (DeepSeek's, GLM's)

    def claim(self, what: str, claimed: int | None, key: str, shape: Shape, axis: int) -> None:
        """``what`` (a key, and how it makes a size) claims ``claimed`` rows (``axis`` 0) or
        columns (1) of tensor ``key`` of ``shape``."""
        have = shape[axis]
        if claimed is None or claimed == have:
            return
        if what in self.found:
            line, more = self.found[what]
            self.found[what] = (line, more + 1)
            return
        of = "columns" if axis else "rows"
        line = f"{self.facts.where}: {what} {claimed}, but {key} {list(shape)} has {have} {of}"
        self.found[what] = (line, 0)

    def problems(self, shapes: Mapping[str, Shape]) -> list[str]:
        p = self.facts.prefix
        vocab, hidden, attention, experts = self.vocab, self.hidden, self.attention, self.experts
        layers: set[int] = set()
        expert_ids: dict[int, set[int]] = {}
        for key, given in shapes.items():
            shape = tuple(int(d) for d in given)
            if (_EMBEDDING.match(key) or _HEAD.match(key)) and len(shape) == 2:
                self.claim(p + "vocab_size", vocab, key, shape, 0)
                self.claim(p + "hidden_size", hidden, key, shape, 1)
                continue
            m = _LAYER.match(key)
            if m is None:
                continue
            layer, rest = int(m.group(1)), m.group(2)
            layers.add(layer)
            if (a := _LATENT.search(rest)) and self.latent:
                self._latent(a.group(1), key, shape)
            elif (a := _ATTENTION.search(rest)) and attention is not None and shape:
                self._attention(a.group(1), a.group(2) == "weight", attention, key, shape, hidden)
            elif (e := _EXPERT.search(rest)) and len(shape) == 2:
                expert_ids.setdefault(layer, set()).add(int(e.group(1)))
                name = self.expert_key or "intermediate_size"
                self._mlp(e.group(2), p + name, self.expert_width, key, shape, hidden)
            elif (mlp := _MLP.search(rest)) and len(shape) == 2:
                self._mlp(mlp.group(1), p + "intermediate_size", self.width, key, shape, hidden)
            elif _ROUTER.search(rest) and experts is not None and len(shape) == 2:
                self.claim(p + experts[0], experts[1], key, shape, 0)
        self._counts(layers, expert_ids)
        return [
            line + (f" (and {more} more tensors)" if more else "")
            for line, more in self.found.values()
        ]

    def _attention(
        self,
        module: str,
        weight: bool,
        attention: tuple[int, int, int],
        key: str,
        shape: Shape,
        hidden: int | None,
    ) -> None:
        heads, kv, head_dim = attention
        p = self.facts.prefix
        query = module in ("q_proj", "o_proj")
        n, name = (heads, "num_attention_heads") if query else (kv, "num_key_value_heads")
        what = f"{p}{name} {n} x {p}head_dim {head_dim} ="
        if module != "o_proj":  # (out, in) and a bias (out,)
            self.claim(what, n * head_dim, key, shape, 0)
            if weight and len(shape) == 2:
                self.claim(p + "hidden_size", hidden, key, shape, 1)
        elif weight and len(shape) == 2:  # (hidden, heads * head_dim)
            self.claim(what, n * head_dim, key, shape, 1)
            self.claim(p + "hidden_size", hidden, key, shape, 0)

    def _latent(self, module: str, key: str, shape: Shape) -> None:
        # (out, in) weights and (width,) norms, each axis as _latent_sizes claims it
        for axis, (what, claimed) in enumerate(self.latent.get(module, ())):
            if axis < len(shape):
                self.claim(self.facts.prefix + what, claimed, key, shape, axis)

    def _mlp(
        self, module: str, what: str, width: int | None, key: str, shape: Shape, hidden: int | None
    ) -> None:
        into = module in _INTO  # gate and up: (width, hidden); down: (hidden, width)
        self.claim(what, width, key, shape, 0 if into else 1)
        self.claim(self.facts.prefix + "hidden_size", hidden, key, shape, 1 if into else 0)

    def _counts(self, layers: set[int], expert_ids: Mapping[int, set[int]]) -> None:
        # Compared by arithmetic over what the tensors hold: nothing is sized by a claim (a
        # config may claim 10**10 layers or experts).
        f, p, n, experts = self.facts, self.facts.prefix, self.layers, self.experts
        if n is not None and layers and not _exactly(layers, n, n + self.extra_layers):
            line = (
                f"{f.where}: {p}num_hidden_layers {n}, but the tensors hold layers "
                f"{_numbers(layers)} ({len(layers)})"
            )
            self.found[p + "num_hidden_layers"] = (line, 0)
        if experts is None:
            return
        for layer, ids in sorted(expert_ids.items()):
            if not _exactly(ids, experts[1], experts[1]):
                line = (
                    f"{f.where}: {p}{experts[0]} {experts[1]}, but layer {layer} holds experts "
                    f"{_numbers(ids)} ({len(ids)})"
                )
                self.found.setdefault(p + experts[0] + " per layer", (line, 0))


def _exactly(ids: set[int], least: int, most: int) -> bool:
    """Whether ``ids`` (whole numbers >= 0) hold every number below ``least`` and none from
    ``most`` on: counted, so that time and memory follow ``ids``, never the two bounds."""
    return max(ids, default=-1) < most and sum(1 for i in ids if i < least) == least


def _numbers(ids: set[int]) -> str:
    ordered = sorted(ids)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]} to {ordered[-1]}"
    shown = ", ".join(map(str, ordered[:6]))
    return shown + (", ..." if len(ordered) > 6 else "")
