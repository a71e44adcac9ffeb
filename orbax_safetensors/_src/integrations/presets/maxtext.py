"""Presets for MaxText's train states and checkpoints: ``maxtext-llama3``,
``maxtext-mistral``, ``maxtext-mixtral``, ``maxtext-qwen3`` and ``maxtext-qwen3-moe``, each
built from the model's Hugging Face config (heads, head_dim, vocabulary, tied embeddings).

The facts are those of MaxText's own conversion (``maxtext`` 0.2.5,
``checkpoint_conversion/utils/param_mapping.py``: the ``*_MAXTEXT_TO_HF_PARAM_MAPPING`` names,
the ``*_PARAM_HOOK_FN`` value hooks), so that an export writes the tensors its
``to_huggingface.py`` writes:

- a train state's parameters sit under ``params.params`` (``{"step", "params": {"params":
  {"decoder", "token_embedder"}}, "opt_state"}``); the optimizer state and the step are left out;
- scanned layers (``decoder.layers.*``) hold the layers on axis 1: query ``(emb, L, heads,
  head_dim)``, key/value ``(emb, L, kv_heads, head_dim)``, out ``(heads, L, head_dim, emb)``,
  norms ``(emb, L)``, ``wi_0``/``wi_1`` ``(emb, L, mlp)``, ``wo`` ``(mlp, L, emb)``; MoE gate
  ``(emb, L, experts)``, experts ``(experts, L, emb, mlp)`` (``wo``: ``(experts, L, mlp, emb)``);
  unscanned layers are ``decoder.layers_{i}``, the same tensors without ``L``;
- ``token_embedder.embedding`` ``(vocab, emb)``, ``decoder.logits_dense.kernel`` ``(emb, vocab)``
  (none with tied embeddings), ``decoder.decoder_norm.scale``;
- LLaMA 3 (MaxText's LLaMA 3.1 entry): the query and key projections interleaved for RoPE and
  the query scaled by ``1 / sqrt(head_dim)`` (``Scale``, float32); Mistral and Mixtral: the
  query scaled; Qwen 3: neither (it has q/k norms);
- a vocabulary padded past the config's is cut to it on export (and padded back on a load into
  a tree of ``vocab_size`` rows).

A new MaxText family is a :class:`_Family` (what its layers hold), a factory, and a line in
:data:`PRESETS`.

Example::

    mapping = llama3("/models/Llama-3.1-8B")
    osf.export_pytorch("/ckpt/1000/items", "/tmp/hf", mapping, hf_config=config)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    Rule,
    SplitHeads,
    Transpose,
)
from orbax_safetensors._src.integrations.transforms import RopeInterleave, Scale, VocabRows

# Where a train state keeps its parameters: state.params = {"params": {decoder, token_embedder}}
_ROOT = "params.params."
_TRAINING_STATE = (r"opt_state(\..*)?", "step")  # left alone by a load into a train state
_HF_LAYER = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class _Family:
    """What one MaxText model family's layers hold, next to Hugging Face's."""

    preset: str
    model_type: str  # the Hugging Face model_type its config must have
    rope_interleave: bool = False  # query and key interleaved for RoPE (MaxText's LLaMA 3)
    scale_query: bool = False  # the query times 1 / sqrt(head_dim)
    qk_norm: bool = False  # query_norm and key_norm (Qwen 3)
    # MoE: the Hugging Face module, MaxText's block, the experts' gate, up and down weights
    moe: tuple[str, str, tuple[str, str, str]] | None = None


_LLAMA3 = _Family("maxtext-llama3", "llama", rope_interleave=True, scale_query=True)
_MISTRAL = _Family("maxtext-mistral", "mistral", scale_query=True)
_MIXTRAL = _Family(
    "maxtext-mixtral",
    "mixtral",
    scale_query=True,
    moe=("block_sparse_moe.", "MoeBlock_0.", ("w1", "w3", "w2")),
)
_QWEN3 = _Family("maxtext-qwen3", "qwen3", qk_norm=True)
_QWEN3_MOE = _Family(
    "maxtext-qwen3-moe",
    "qwen3_moe",
    qk_norm=True,
    moe=("mlp.", "moe_block.", ("gate_proj", "up_proj", "down_proj")),
)


def llama3(
    hf_config: Any,
    *,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
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
      ConfigError: a size that is not a positive whole number, or that does not divide what
        it must (key/value heads the heads, heads the hidden size), naming the key.

    Example::

        mapping = osf.hf.presets.maxtext.llama3("/models/Llama-3.1-8B", scan_layers=False)
        osf.export_pytorch("/ckpt/1000/items", "/tmp/hf", mapping)
    """
    return _mapping(_LLAMA3, hf_config, scan_layers, vocab_size, lora_scale)


def mistral(
    hf_config: Any,
    *,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The preset ``"maxtext-mistral"``: MaxText's Mistral, for a ``mistral`` config; the
    query scaled by ``1 / sqrt(head_dim)``.

    Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.mistral("/models/Mistral-7B-v0.3")
    """
    return _mapping(_MISTRAL, hf_config, scan_layers, vocab_size, lora_scale)


def mixtral(
    hf_config: Any,
    *,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The preset ``"maxtext-mixtral"``: MaxText's Mixtral, for a ``mixtral`` config; the
    query scaled by ``1 / sqrt(head_dim)``, the experts of ``MoeBlock_0`` (``wi_0``, ``wi_1``,
    ``wo``: ``(experts, L, emb, mlp)``) as the files' ``block_sparse_moe.experts.{e}.w1``,
    ``w3``, ``w2``.

    Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.mixtral("/models/Mixtral-8x7B-v0.1")
    """
    return _mapping(_MIXTRAL, hf_config, scan_layers, vocab_size, lora_scale)


def qwen3(
    hf_config: Any,
    *,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The preset ``"maxtext-qwen3"``: MaxText's Qwen 3, for a ``qwen3`` config, with its
    ``query_norm`` and ``key_norm``; no value changes.

    Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.qwen3("/models/Qwen3-0.6B")
    """
    return _mapping(_QWEN3, hf_config, scan_layers, vocab_size, lora_scale)


def qwen3_moe(
    hf_config: Any,
    *,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The preset ``"maxtext-qwen3-moe"``: MaxText's Qwen 3 MoE, for a ``qwen3_moe`` config;
    :func:`qwen3`'s layers with the experts of ``moe_block`` as the files'
    ``mlp.experts.{e}.{gate,up,down}_proj``.

    Its arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.maxtext.qwen3_moe("/models/Qwen3-30B-A3B")
    """
    return _mapping(_QWEN3_MOE, hf_config, scan_layers, vocab_size, lora_scale)


def _mapping(
    family: _Family,
    hf_config: Any,
    scan_layers: bool | None,
    vocab_size: int | None,
    lora_scale: float | None,
) -> KeyMapping:
    config = ConfigFacts.of(hf_config)
    model_type = config.doc.get("model_type")
    if model_type is not None and model_type != family.model_type:
        raise ValueError(
            f"preset {family.preset!r} maps {family.model_type!r} models; the config is a "
            f"{model_type!r} model's"
        )
    dims = _Dims.of(family.preset, config)
    layers = []
    if scan_layers in (None, True):
        layers += _layer_rules(family, dims, _ROOT + "decoder.layers.", {"i": 1})
    if scan_layers in (None, False):
        layers += _layer_rules(family, dims, _ROOT + "decoder.layers_{i}.", None)
    padded = None if vocab_size is None else _padded(vocab_size)
    rules = [
        Rule(
            "model.embed_tokens.weight",
            _ROOT + "token_embedder.embedding",
            VocabRows(dims.vocab, padded),
        ),
        Rule("model.norm.weight", _ROOT + "decoder.decoder_norm.scale"),
        *layers,
    ]
    if not dims.tied:
        head = Chain(Transpose(), VocabRows(dims.vocab, padded, axis=-1))
        rules.append(Rule("lm_head.weight", _ROOT + "decoder.logits_dense.kernel", head))
    return KeyMapping(
        rules,
        # tied: MaxText has no logits_dense (logits_via_embedding); a file's lm_head is the
        # embedding's copy. A checkpoint with a logits_dense has no rule: an export refuses it.
        ignore_torch=["lm_head.weight"] if dims.tied else [],
        ignore_flax=_TRAINING_STATE,
        lora_scale=lora_scale,
    )


def _padded(vocab_size: Any) -> int:
    whole = isinstance(vocab_size, numbers.Integral) and not isinstance(vocab_size, bool)
    if not whole or vocab_size <= 0:
        raise ValueError(f"vocab_size= must be a positive whole number, got {vocab_size!r}")
    return int(vocab_size)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """What the rules need of a config: heads (None: not given), key/value heads, head_dim,
    the vocabulary, tied embeddings; read through ``ConfigFacts`` (validated)."""

    heads: int | None
    kv_heads: int | None
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, name: str, config: ConfigFacts) -> _Dims:
        attention = config.attention()
        heads, kv = (attention[0], attention[1]) if attention else (None, None)
        head_dim = attention[2] if attention else config.size("head_dim")
        vocab = config.vocab_size()
        if head_dim is None or vocab is None:
            raise ValueError(
                f"preset {name!r} needs a Hugging Face config with vocab_size and head_dim (or "
                f"hidden_size and num_attention_heads); got keys {sorted(config.doc)}"
            )
        return cls(heads, kv, head_dim, vocab, config.flag("tie_word_embeddings"))


def _layer_rules(
    family: _Family, dims: _Dims, layer: str, stacked: dict[str, int] | None
) -> list[Rule]:
    """The rules of one decoder layer's tensors under ``layer`` (``...decoder.layers.``
    scanned with ``stacked={"i": 1}``, or ``...decoder.layers_{i}.``)."""
    # (emb, heads, head_dim): exactly the config's heads (key/value heads) of its head_dim
    query: list[Any] = [Transpose(), SplitHeads(dims.heads, -1, dims.head_dim)]
    key: list[Any] = [Transpose(), SplitHeads(dims.kv_heads, -1, dims.head_dim)]
    value = list(key)
    if family.rope_interleave:
        query.append(RopeInterleave())
        key.append(RopeInterleave())
    if family.scale_query:
        query.append(Scale.attention_query(dims.head_dim))
    hf, att = _HF_LAYER, layer + "self_attention."

    def rule(torch: str, flax: str, transform: Any = None) -> Rule:
        return Rule(hf + torch, flax, transform, stacked=stacked)

    out = Chain(Transpose(), SplitHeads(dims.heads, 0, dims.head_dim))  # (heads, head_dim, emb)
    rules = [
        rule("self_attn.q_proj.weight", att + "query.kernel", Chain(*query)),
        rule("self_attn.k_proj.weight", att + "key.kernel", Chain(*key)),
        rule("self_attn.v_proj.weight", att + "value.kernel", Chain(*value)),
        rule("self_attn.o_proj.weight", att + "out.kernel", out),
        rule("input_layernorm.weight", layer + "pre_self_attention_layer_norm.scale"),
        rule("post_attention_layernorm.weight", layer + "post_self_attention_layer_norm.scale"),
    ]
    if family.qk_norm:
        rules += [
            rule("self_attn.q_norm.weight", att + "query_norm.scale"),
            rule("self_attn.k_norm.weight", att + "key_norm.scale"),
        ]
    if family.moe is None:
        for theirs, ours in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
            rules.append(rule(f"mlp.{theirs}.weight", layer + f"mlp.{ours}.kernel", Transpose()))
        return rules
    hf_moe, block, (gate, up, down) = family.moe
    rules.append(rule(hf_moe + "gate.weight", layer + block + "gate.kernel", Transpose()))
    experts = {"e": 0, **({"i": 1} if stacked else {})}  # the experts' axis before the layers'
    for theirs, ours in ((gate, "wi_0"), (up, "wi_1"), (down, "wo")):
        torch = hf + hf_moe + f"experts.{{e}}.{theirs}.weight"
        rules.append(Rule(torch, layer + block + ours, Transpose(), stacked=experts))
    return rules


# The preset names of this group.
PRESETS = {
    "maxtext-llama3": llama3,
    "maxtext-mistral": mistral,
    "maxtext-mixtral": mixtral,
    "maxtext-qwen3": qwen3,
    "maxtext-qwen3-moe": qwen3_moe,
}
