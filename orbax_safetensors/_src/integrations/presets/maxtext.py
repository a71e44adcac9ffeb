"""Presets for MaxText's train states (``maxtext-llama3``, ``-mistral``, ``-mixtral``,
``-qwen3``, ``-qwen3-moe``, ``-qwen2``, ``-gemma2``, ``-gemma3``, ``-deepseek3``), each built
from the model's Hugging Face config. The facts are those of MaxText 0.2.5's own conversion
(``checkpoint_conversion/utils/param_mapping.py``), so that an export writes the tensors its
``to_huggingface.py`` writes. Parameters sit under ``params.params``; scanned layers
(``decoder.layers``) hold the layers on axis 1, unscanned ones are ``decoder.layers_{i}``.
A new family is one :func:`_preset` call, which enters it in :data:`PRESETS`.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from orbax_safetensors._src.core.errors import ConfigError
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, Rule, aliased
from orbax_safetensors._src.integrations.transforms import (
    Chain,
    Offset,
    Reshape,
    RopeInterleave,
    Scale,
    SplitHeads,
    Transpose,
    VocabRows,
)

# Where a train state keeps its parameters: state.params = {"params": {decoder, token_embedder}}
_ROOT = "params.params."
_TRAINING_STATE = (r"opt_state(\..*)?", "step")  # left alone by a load into a train state
_LAYER_NORMS = (
    ("input_layernorm", "pre_self_attention_layer_norm"),
    ("post_attention_layernorm", "post_self_attention_layer_norm"),
)
_GEMMA_NORMS = (  # each stored 1 + w
    ("input_layernorm", "pre_self_attention_norm"),
    ("post_attention_layernorm", "post_self_attention_norm"),
    ("pre_feedforward_layernorm", "pre_ffw_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
)
_MLP = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
_BLOCK = "DeepSeekMoeBlock_0."
# The most layers a preset naming each layer lays out: past any model's, a forged count's bound
MOST_LAYERS = 1024


@dataclasses.dataclass(frozen=True)
class _Family:
    """What one MaxText model family's layers hold, next to Hugging Face's."""

    preset: str
    model_type: str | tuple[str, ...]  # the Hugging Face model_type(s) its config may have
    rope_interleave: bool = False  # query and key interleaved for RoPE (MaxText's LLaMA 3)
    scale_query: bool = False  # the query times 1 / sqrt(head_dim)
    qk_norm: bool = False  # query_norm and key_norm (Qwen 3, Gemma 3)
    # MoE: the Hugging Face module, MaxText's block, the experts' gate, up and down weights
    moe: tuple[str, str, tuple[str, str, str]] | None = None
    qkv_bias: bool = False  # q/k/v biases (heads, head_dim) (Qwen 2.5)
    norms: tuple[tuple[str, str], ...] = _LAYER_NORMS  # (Hugging Face, MaxText) of a layer
    offset: bool = False  # norms stored 1 + w (Gemma)
    embedding_scale: Any = None  # the embedding times sqrt(hidden_size) rounded to this type
    # how the layers sit: "plain", "pairs" (Gemma 2), "six" (Gemma 3), "dense_moe" (DeepSeek)
    layout: str = "plain"

    def norm(self) -> Offset | None:
        return Offset(1.0) if self.offset else None


class MaxTextPreset(Protocol):  # what every MaxText preset takes (see llama3)
    def __call__(
        self,
        hf_config: Any,
        *,
        scan_layers: bool | None = None,
        vocab_size: int | None = None,
        lora_scale: float | None = None,
    ) -> KeyMapping: ...


# The preset names of this group, each entered by its _preset call.
PRESETS: dict[str, MaxTextPreset] = {}


def _preset(family: _Family, doc: str) -> MaxTextPreset:
    """The factory of ``family``'s preset (``maxtext-qwen3-moe``: ``qwen3_moe``), entered in
    :data:`PRESETS`; every family takes the same arguments, documented by :func:`llama3`."""

    def factory(
        hf_config: Any,
        *,
        scan_layers: bool | None = None,
        vocab_size: int | None = None,
        lora_scale: float | None = None,
    ) -> KeyMapping:
        return _mapping(family, hf_config, scan_layers, vocab_size, lora_scale)

    name = family.preset.removeprefix("maxtext-").replace("-", "_")
    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    PRESETS[family.preset] = factory
    return factory


llama3 = _preset(
    _Family("maxtext-llama3", "llama", rope_interleave=True, scale_query=True),
    """The preset ``"maxtext-llama3"``: MaxText's LLaMA 3 (3.1), for a ``llama`` config. The
    query and key are interleaved for RoPE and the query scaled by ``1 / sqrt(head_dim)``,
    as MaxText's conversion hooks do.

    Args:
      hf_config: the model's Hugging Face config (a transformers config, a dict, a
        ``config.json`` or the model's directory): heads, key/value heads, ``head_dim``,
        ``vocab_size`` and ``tie_word_embeddings`` come from it, each checked when read and
        against the tensors when a load or an export plans.
      scan_layers: MaxText's ``scan_layers``: True, the layers stacked on axis 1
        (``decoder.layers``); False, one subtree a layer (``decoder.layers_{i}``); None (the
        default), both: an export reads either, a load fills the scanned layout.
      vocab_size: the MaxText model's vocabulary when padded past the config's: a load pads
        the embedding and ``logits_dense`` with zero rows to it (an export always writes the
        config's rows). Either way by a padding at most (see ``VocabRows``).
      lora_scale: the scale of LoRA adapters merged on export (``KeyMapping.lora_scale``).

    The names start at a train state's top (``params.params.decoder...``); a load leaves its
    ``opt_state`` and ``step`` alone.

    Raises:
      ValueError: a config of another model type, or without the sizes the preset needs.
      ConfigError: naming the key: a size that is not a positive whole number, that does
        not divide what it must (key/value heads the heads, heads the hidden size), or a
        layer count past what the preset lays out (:data:`MOST_LAYERS`).

    Example::

        mapping = osf.hf.presets.maxtext.llama3("/models/Llama-3.1-8B", scan_layers=False)
        osf.export_pytorch("/ckpt/1000/items", "/tmp/hf", mapping)
    """,
)
mistral = _preset(
    _Family("maxtext-mistral", "mistral", scale_query=True),
    """The preset ``"maxtext-mistral"``: MaxText's Mistral, for a ``mistral`` config; the
    query scaled by ``1 / sqrt(head_dim)``. Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.mistral("/models/Mistral-7B-v0.3")
    """,
)
mixtral = _preset(
    _Family(
        "maxtext-mixtral",
        "mixtral",
        scale_query=True,
        moe=("block_sparse_moe.", "MoeBlock_0.", ("w1", "w3", "w2")),
    ),
    """The preset ``"maxtext-mixtral"``: MaxText's Mixtral, for a ``mixtral`` config; the
    query scaled by ``1 / sqrt(head_dim)``, the experts of ``MoeBlock_0`` (``wi_0``, ``wi_1``,
    ``wo``: ``(experts, L, emb, mlp)``) as the files' ``block_sparse_moe.experts.{e}.w1``,
    ``w3``, ``w2``. Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.mixtral("/models/Mixtral-8x7B-v0.1")
    """,
)
qwen3 = _preset(
    _Family("maxtext-qwen3", "qwen3", qk_norm=True),
    """The preset ``"maxtext-qwen3"``: MaxText's Qwen 3, for a ``qwen3`` config, with its
    ``query_norm`` and ``key_norm``; no value changes. Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.qwen3("/models/Qwen3-0.6B")
    """,
)
qwen3_moe = _preset(
    _Family(
        "maxtext-qwen3-moe",
        "qwen3_moe",
        qk_norm=True,
        moe=("mlp.", "moe_block.", ("gate_proj", "up_proj", "down_proj")),
    ),
    """The preset ``"maxtext-qwen3-moe"``: MaxText's Qwen 3 MoE, for a ``qwen3_moe`` config;
    :func:`qwen3`'s layers with the experts of ``moe_block`` as the files'
    ``mlp.experts.{e}.{gate,up,down}_proj``. Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.qwen3_moe("/models/Qwen3-30B-A3B")
    """,
)
qwen2 = _preset(
    _Family("maxtext-qwen2", "qwen2", qkv_bias=True),
    """The preset ``"maxtext-qwen2"``: MaxText's Qwen 2.5, for a ``qwen2`` config: Qwen 3's
    layers without q/k norms, with the q/k/v biases ``(heads, head_dim)`` (scanned ``(heads,
    L, head_dim)``); no value changes. Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.qwen2("/models/Qwen2.5-7B")
    """,
)
gemma2 = _preset(
    _Family(
        "maxtext-gemma2",
        "gemma2",
        scale_query=True,
        norms=_GEMMA_NORMS,
        offset=True,
        embedding_scale=np.float32,
        layout="pairs",
    ),
    """The preset ``"maxtext-gemma2"``: MaxText's Gemma 2, for a ``gemma2`` config (an even
    ``num_hidden_layers``). MaxText's layer ``j`` holds Hugging Face's layers ``2j``
    (``self_attention_local``, ``mlp_local``, ``*_norm_local``) and ``2j + 1`` (``*_global``);
    norms ``1 + w``, the query scaled, the embedding times float32 ``sqrt(hidden_size)``; tied.
    Its arguments are :func:`llama3`'s (MaxText's vocabulary: ``vocab_size=256128``).

    Example::

        mapping = osf.hf.presets.maxtext.gemma2("/models/gemma-2-9b", vocab_size=256128)
    """,
)
gemma3 = _preset(
    _Family(
        "maxtext-gemma3",
        ("gemma3", "gemma3_text"),
        qk_norm=True,
        norms=_GEMMA_NORMS,
        offset=True,
        embedding_scale=ml_dtypes.bfloat16,
        layout="six",
    ),
    """The preset ``"maxtext-gemma3"``: MaxText's Gemma 3, for a ``gemma3`` config
    (``Gemma3ForConditionalGeneration``, with its vision encoder and projector) or a
    ``gemma3_text`` one (the language model alone). Scanned, MaxText holds layer ``i`` at
    position ``i // 6`` of ``decoder.layers.layers_{i % 6}`` and the layers past the last
    multiple of six as ``decoder.layers_remainder.layers_{r}``; norms (q/k norms too) are
    ``1 + w``, the embedding times bfloat16 ``sqrt(hidden_size)``; the query is not scaled.
    An export writes the names every reader loads (``language_model.model.*``...); a load
    reads transformers 5's too. Its arguments are :func:`llama3`'s (MaxText's vocabulary is
    262,144).

    Example::

        mapping = osf.hf.presets.maxtext.gemma3("/models/gemma-3-4b-it", vocab_size=262144)
    """,
)
deepseek3 = _preset(
    _Family(
        "maxtext-deepseek3",
        "deepseek_v3",
        moe=("mlp.", _BLOCK + "MoeBlock_0.", ("gate_proj", "up_proj", "down_proj")),
        layout="dense_moe",
    ),
    """The preset ``"maxtext-deepseek3"``: MaxText's DeepSeek V3, for a ``deepseek_v3``
    config: the first ``first_k_dense_replace`` layers in ``decoder.dense_layers``, the others
    in ``decoder.moe_layers``, with the latent attention, ``DeepSeekMoeBlock_0``'s shared
    experts and ``MoeBlock_0``, and the router's ``e_score_correction_bias`` where MaxText
    0.2.5 keeps it (``params.MoEBiasVar``; an export also reads it from ``params.params``).
    No value changes; a file's multi-token prediction layers are left out.
    Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.deepseek3("/models/DeepSeek-V3", scan_layers=True)
    """,
)


def _mapping(
    family: _Family,
    hf_config: Any,
    scan_layers: bool | None,
    vocab_size: int | None,
    lora_scale: float | None,
) -> KeyMapping:
    config = ConfigFacts.of(hf_config)
    model_type = config.doc.get("model_type")
    types = (family.model_type,) if isinstance(family.model_type, str) else family.model_type
    if model_type is not None and model_type not in types:
        raise ValueError(
            f"preset {family.preset!r} maps {' or '.join(map(repr, types))} models; the config "
            f"is a {model_type!r} model's"
        )
    text = config.language_model()
    dims = _Dims.of(family, text, config)
    lm = "model." if text is config else "language_model.model."  # (a multimodal model's)
    layers = []
    for scanned in (True, False):
        if scan_layers in (None, scanned):
            layers += _placed(_layers(family, dims, lm + "layers.", scanned))
    whole = isinstance(vocab_size, numbers.Integral) and not isinstance(vocab_size, bool)
    if vocab_size is not None and (not whole or vocab_size <= 0):
        raise ValueError(f"vocab_size= must be a positive whole number, got {vocab_size!r}")
    padded = None if vocab_size is None else int(vocab_size)
    rules = [
        Rule(
            lm + "embed_tokens.weight", _ROOT + "token_embedder.embedding", dims.embedding(padded)
        ),
        Rule(lm + "norm.weight", _ROOT + "decoder.decoder_norm.scale", family.norm()),
        *layers,
        *_vision(dims.vision),
    ]
    if not dims.tied:
        head = Chain(Transpose(), VocabRows(dims.vocab, padded, axis=-1))
        rules.append(Rule("lm_head.weight", _ROOT + "decoder.logits_dense.kernel", head))
    # A load also reads the names of transformers 4 and 5 for a multimodal Gemma 3's parts;
    # an export writes the first (what the published checkpoints hold)
    rules = aliased(rules, _ALIASES)
    extra = [str(dims.layers + k) for k in range(dims.extra)]  # DeepSeek's multi-token layers
    return KeyMapping(
        rules,
        # tied: MaxText has no logits_dense (logits_via_embedding); a file's lm_head is the
        # embedding's copy. A checkpoint with a logits_dense has no rule: an export refuses it.
        ignore_torch=(["lm_head.weight", "language_model.lm_head.weight"] if dims.tied else [])
        + ([rf"model\.layers\.({'|'.join(extra)})\..*"] if extra else []),
        ignore_flax=_TRAINING_STATE,
        lora_scale=lora_scale,
    )


_ALIASES = (
    ("language_model.model.", ("model.language_model.",)),
    (
        "vision_tower.vision_model.",
        ("vision_tower.", "model.vision_tower.vision_model.", "model.vision_tower."),
    ),
    ("multi_modal_projector.", ("model.multi_modal_projector.",)),
)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """What the rules need of a config (read through ``ConfigFacts``, so validated); heads
    None where the config gives none, ``layers`` 0 where the layout needs none."""

    heads: int | None
    kv_heads: int | None
    head_dim: int
    vocab: int
    tied: bool
    layers: int = 0
    dense: int = 0
    extra: int = 0
    scale: float | None = None
    vision: tuple[int, ...] | None = None
    # DeepSeek's latent attention: qk_nope_head_dim, qk_rope_head_dim, v_head_dim (None absent)
    latent: tuple[int | None, ...] = (None, None, None)

    @classmethod
    def of(cls, family: _Family, config: ConfigFacts, top: ConfigFacts) -> _Dims:
        name = family.preset
        attention = config.attention()
        heads, kv = (attention[0], attention[1]) if attention else (None, None)
        head_dim = attention[2] if attention else config.size("head_dim")
        vocab = config.size("vocab_size")
        if head_dim is None or vocab is None:
            raise ValueError(
                f"preset {name!r} needs a Hugging Face config with vocab_size and head_dim (or "
                f"hidden_size and num_attention_heads); got keys {sorted(config.doc)}"
            )
        tied = top.flag("tie_word_embeddings", config.flag("tie_word_embeddings"))
        dims = cls(heads, kv, head_dim, vocab, tied)
        if family.layout == "plain":
            return dims
        most = (MOST_LAYERS, f"the {MOST_LAYERS} layers preset {name!r} lays out")
        layers = _needs(name, "num_hidden_layers", config.size("num_hidden_layers", most))
        dense, most = 0, (layers, f"{config.prefix}num_hidden_layers {layers}")
        if family.layout == "dense_moe":
            dense = _needs(
                name, "first_k_dense_replace", config.count("first_k_dense_replace", most)
            )
        if family.layout == "pairs" and layers % 2:
            raise ConfigError(
                f"{config.where}: {config.prefix}num_hidden_layers is {layers}, not an even "
                f"number (preset {name!r})"
            )
        scale = None
        if family.embedding_scale is not None:
            hidden = _needs(name, "hidden_size", config.size("hidden_size"))
            scale = float(family.embedding_scale(hidden**0.5))
        vision, doc = None, top.doc.get("vision_config") if config is not top else None
        if isinstance(doc, Mapping):  # Gemma 3's vision encoder: its heads and width
            facts = ConfigFacts(doc, top.where, "vision_config.")
            keys = ("num_attention_heads", "hidden_size")
            vision = tuple(_needs(name, f"vision_config.{k}", facts.size(k)) for k in keys)
        extra = config.count("num_nextn_predict_layers", most) or 0  # (names left out)
        latent = tuple(map(config.count, ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")))
        return dataclasses.replace(
            dims, layers=layers, dense=dense, extra=extra, scale=scale, vision=vision, latent=latent
        )

    def embedding(self, padded: int | None) -> Any:
        """The embedding's transform: its rows, times the scale (Gemma's) into MaxText, times
        the scale's float32 reciprocal out of it (MaxText divides on jax arrays, which XLA
        computes as that product)."""
        rows = VocabRows(self.vocab, padded)
        if self.scale is None:
            return rows
        reciprocal = float(np.float32(1) / np.float32(self.scale))
        return Chain(Scale(self.scale, reciprocal), rows)


def _needs(name: str, key: str, value: int | None) -> int:
    if value is None:
        raise ValueError(f"preset {name!r} needs a Hugging Face config with {key}")
    return value


# (HF name within a layer, MaxText name within a layer, transform); "{e}": the experts
_Entry = tuple[str, str, Any]
# (HF layer prefix, MaxText layer prefix, stacked placeholder and axis or None, entries)
_Placement = tuple[str, str, "dict[str, int] | None", list[_Entry]]
_SCANNED = {"i": 1}  # MaxText's param_scan_axis


def _listed(layers: range) -> str:
    """A placeholder listing ``layers``: it stacks them in that order."""
    return "{i:" + "|".join(map(str, layers)) + "}."


def _layers(family: _Family, dims: _Dims, hf: str, scanned: bool) -> list[_Placement]:
    """Where each Hugging Face layer sits in MaxText's decoder, scanned or not."""
    mt, n = _ROOT + "decoder.", dims.layers
    scan = _SCANNED if scanned else None
    if family.layout == "pairs":  # layer j: HF 2j as the *_local sub-block, 2j + 1 as *_global
        subs = [(h, _layer(family, dims, sub)) for h, sub in ((0, "_local"), (1, "_global"))]
        if scanned:
            return [(hf + _listed(range(h, n, 2)), mt + "layers.", scan, t) for h, t in subs]
        return [
            (f"{hf}{2 * j + h}.", f"{mt}layers_{j}.", None, t)
            for j in range(n // 2)
            for h, t in subs
        ]
    if family.layout == "six":  # layer i at i // 6 of stack i % 6, the rest unscanned
        t, whole = _layer(family, dims), n - n % 6
        if not scanned:
            return [(hf + "{i}.", mt + "layers_{i}.", None, t)]
        stacks = [
            (hf + _listed(range(b, whole, 6)), f"{mt}layers.layers_{b}.", scan, t)
            for b in range(6)
            if whole
        ]
        return stacks + [
            (f"{hf}{whole + r}.", f"{mt}layers_remainder.layers_{r}.", None, t)
            for r in range(n - whole)
        ]
    if family.layout == "dense_moe":  # the first layers dense, then the MoE layers
        k, moe, var = dims.dense, _layer(family, dims), "params.MoEBiasVar.decoder."
        places: list[_Placement]
        # the router's bias: in MaxText 0.2.5's MoEBiasVar collection, its layers on axis 0
        bias: list[_Entry] = [
            ("mlp.gate.e_score_correction_bias", _BLOCK + "MoeBlock_0.gate.bias", None)
        ]
        at, places = hf + _listed(range(k, n)), []
        if not scanned:
            places = [
                (f"{hf}{k + j}.", f"{root}moe_layers_{j}.", None, t)
                for j in range(n - k)
                for root, t in ((var, bias), (mt, moe))
            ]
        elif n > k:
            places = [
                (at, var + "moe_layers.", {"i": 0}, bias),
                (at, mt + "moe_layers.", scan, moe),
            ]
        dense = mt + ("dense_layers." if scanned else "dense_layers_{i}.")
        dense_layers = (hf + _listed(range(k)), dense, scan, _layer(family, dims, dense=True))
        return [dense_layers] * bool(k) + places
    t = _layer(family, dims)
    return [(hf + "{i}.", mt + ("layers." if scanned else "layers_{i}."), scan, t)]


def _placed(placements: list[_Placement]) -> list[Rule]:
    rules = []
    for hf, mt, stacked, entries in placements:
        for torch, flax, transform in entries:
            # the experts' axis before the layers'
            stack = {"e": 0, **(stacked or {})} if "{e}" in torch else stacked
            rules.append(Rule(hf + torch, mt + flax, transform, stacked=stack))
    return rules


def _layer(family: _Family, dims: _Dims, sub: str = "", dense: bool = False) -> list[_Entry]:
    """The tensors of one decoder layer (``sub``: Gemma 2's ``_local`` or ``_global``
    sub-block; ``dense``: a DeepSeek dense layer)."""
    att, offset = f"self_attention{sub}.", family.norm()
    entries = _mla(dims, att) if family.layout == "dense_moe" else _attention(family, dims, att)
    entries += [(f"{h}.weight", f"{m}{sub}.scale", offset) for h, m in family.norms]
    t = Transpose()
    if family.moe is None or dense:
        return entries + [(f"mlp.{h}.weight", f"mlp{sub}.{m}.kernel", t) for h, m in _MLP]
    hf_moe, block, names = family.moe
    entries.append((hf_moe + "gate.weight", block + "gate.kernel", t))
    for theirs, (_, ours) in zip(names, _MLP):
        entries.append((f"{hf_moe}experts.{{e}}.{theirs}.weight", block + ours, t))
    if family.layout == "dense_moe":  # DeepSeek's shared experts; its router's bias
        shared = _BLOCK + "shared_experts."
        entries += [(f"mlp.shared_experts.{h}.weight", f"{shared}{m}.kernel", t) for h, m in _MLP]
        entries.append(("mlp.gate.e_score_correction_bias", block + "gate.bias", None))
    return entries


def _attention(family: _Family, dims: _Dims, att: str) -> list[_Entry]:
    # (emb, heads, head_dim): exactly the config's heads (key/value heads) of its head_dim
    query: list[Any] = [Transpose(), SplitHeads(dims.heads, -1, dims.head_dim)]
    key: list[Any] = [Transpose(), SplitHeads(dims.kv_heads, -1, dims.head_dim)]
    value = list(key)
    if family.rope_interleave:
        query.append(RopeInterleave())
        key.append(RopeInterleave())
    if family.scale_query:
        query.append(Scale.attention_query(dims.head_dim))
    out = Chain(Transpose(), SplitHeads(dims.heads, 0, dims.head_dim))  # (heads, head_dim, emb)
    entries: list[_Entry] = [
        ("self_attn.q_proj.weight", att + "query.kernel", Chain(*query)),
        ("self_attn.k_proj.weight", att + "key.kernel", Chain(*key)),
        ("self_attn.v_proj.weight", att + "value.kernel", Chain(*value)),
        ("self_attn.o_proj.weight", att + "out.kernel", out),
    ]
    if family.qkv_bias:  # (heads, head_dim)
        kv = dims.kv_heads
        for p, m, n in (("q", "query", dims.heads), ("k", "key", kv), ("v", "value", kv)):
            bias = SplitHeads(n, 0, dims.head_dim)
            entries.append((f"self_attn.{p}_proj.bias", f"{att}{m}.bias", bias))
    if family.qk_norm:
        entries += [
            ("self_attn.q_norm.weight", att + "query_norm.scale", family.norm()),
            ("self_attn.k_norm.weight", att + "key_norm.scale", family.norm()),
        ]
    return entries


def _mla(dims: _Dims, att: str) -> list[_Entry]:
    """DeepSeek's latent attention (``query``: V2's), in heads of the config's head sizes."""
    nope, rope, v = dims.latent

    def heads(axis: int, *sizes: int | None) -> Chain:
        size = None if None in sizes else sum(s for s in sizes if s is not None)
        return Chain(Transpose(), SplitHeads(dims.heads, axis, size or None))

    return [
        ("self_attn.q_a_proj.weight", att + "wq_a.kernel", Transpose()),
        ("self_attn.q_a_layernorm.weight", att + "q_norm.scale", None),
        ("self_attn.q_b_proj.weight", att + "wq_b.kernel", heads(-1, nope, rope)),
        ("self_attn.q_proj.weight", att + "query.kernel", heads(-1, nope, rope)),
        ("self_attn.kv_a_proj_with_mqa.weight", att + "wkv_a.kernel", Transpose()),
        ("self_attn.kv_a_layernorm.weight", att + "kv_norm.scale", None),
        ("self_attn.kv_b_proj.weight", att + "wkv_b.kernel", heads(-1, nope, v)),
        ("self_attn.o_proj.weight", att + "out.kernel", heads(0, v)),
    ]


def _vision(sizes: tuple[int, ...] | None) -> list[Rule]:
    """Gemma 3's vision encoder (SigLIP, never scanned) and projector, of ``(heads, width)``."""
    if sizes is None:
        return []
    heads, width = sizes
    t, split, att = Transpose(), SplitHeads(heads, 0), "MultiHeadDotProductAttention_0."
    encoder: list[_Entry] = [
        ("embeddings.patch_embedding.weight", "embedding.kernel", Transpose((2, 3, 1, 0))),
        ("embeddings.patch_embedding.bias", "embedding.bias", None),
        (
            "embeddings.position_embedding.weight",
            "pos_embedding",
            Reshape((1, -1, width), (-1, width)),
        ),
        ("post_layernorm.weight", "Transformer.encoder_norm.scale", None),
        ("post_layernorm.bias", "Transformer.encoder_norm.bias", None),
    ]
    block: list[_Entry] = [
        ("self_attn.out_proj.weight", att + "out.kernel", Chain(t, split)),
        ("self_attn.out_proj.bias", att + "out.bias", None),
    ]
    for p, m in (("q", "query"), ("k", "key"), ("v", "value")):
        block.append(
            (f"self_attn.{p}_proj.weight", f"{att}{m}.kernel", Chain(t, SplitHeads(heads, -1)))
        )
        block.append((f"self_attn.{p}_proj.bias", f"{att}{m}.bias", split))
    for n in (0, 1):  # layer_norm1/2, fc1/2
        block.append((f"layer_norm{n + 1}.weight", f"LayerNorm_{n}.scale", None))
        block.append((f"layer_norm{n + 1}.bias", f"LayerNorm_{n}.bias", None))
        block.append((f"mlp.fc{n + 1}.weight", f"MlpBlockViT_0.Dense_{n}.kernel", t))
        block.append((f"mlp.fc{n + 1}.bias", f"MlpBlockViT_0.Dense_{n}.bias", None))
    projector: list[_Entry] = [
        ("mm_input_projection_weight", "mm_input_projection.w", None),
        ("mm_soft_emb_norm.weight", "mm_soft_embedding_norm.scale", Offset(1.0)),
    ]
    hf, mt = "vision_tower.vision_model.", _ROOT + "vision_encoder.Gemma3VisionEncoderLayer_0."
    return _placed([
        (hf, mt, None, encoder),
        (hf + "encoder.layers.{i}.", mt + "Transformer.encoderblock_{i}.", None, block),
        ("multi_modal_projector.", _ROOT + "vision_encoder.VisionEmbedder_0.", None, projector),
    ])  # fmt: skip
