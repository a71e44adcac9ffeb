"""Presets for Tunix's NNX models (``google-tunix`` 0.1.7), with the names and layouts of
Tunix's own ``params.py`` / ``params_safetensors.py``, both ways: ``tunix-llama3``,
``tunix-qwen2``, ``tunix-qwen3``, ``tunix-gemma`` (read from Hugging Face's Gemma 2),
``tunix-gemma3`` and ``tunix-gemma4``.

Tunix keeps its attention projections per head (LLaMA's and Qwen's ``(embed, heads,
head_dim)``, Gemma's heads first, its keys and values stacked in one ``kv_einsum``), so the
presets split and merge the heads and need ``head_dim``: one rule then fits the query heads and
the fewer key/value heads. Gemma's norms are ``w``, applied as ``1 + w`` as in Hugging Face.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, Rule, aliased
from orbax_safetensors._src.integrations.transforms import Chain, SplitHeads, Transpose

_HF_LAYER = "model.layers.{i}"
_MLP = Rule(
    _HF_LAYER + ".mlp.{p:gate_proj|up_proj|down_proj}.weight",
    "layers.{i}.mlp.{p}.kernel",
    Transpose(),
)

# Qwen 3 MoE (Tunix's MoELayer): the experts' projections stacked on axis 0, (experts, in, out)
_MOE = [
    Rule(
        _HF_LAYER + ".mlp.experts.{e}.{p:gate_proj|up_proj|down_proj}.weight",
        "layers.{i}.mlp.{p}",
        Transpose(),
        stacked="e",
    ),
    Rule(_HF_LAYER + ".mlp.gate.weight", "layers.{i}.mlp.router.kernel", Transpose()),
]


def llama3(
    *, head_dim: int, tie_word_embeddings: bool = False, lora_scale: float | None = None
) -> KeyMapping:
    """The preset ``"tunix-llama3"``: Tunix's ``Llama3``: ``layers.{i}.attn.{q,k,v}_proj.w``
    ``(embed, heads, head_dim)``, ``o_proj.w`` ``(heads, head_dim, embed)``, every norm as
    ``.w``, ``lm_head.w``.

    Args:
      head_dim: the attention head size (Tunix's ``ModelConfig.head_dim``).
      tie_word_embeddings: Tunix's ``use_tied_embedding``: a directory without
        ``lm_head.weight`` loads a model's head from the embedding, and an export writes none
        while they are equal.
      lora_scale: the scale of qwix's LoRA adapters merged on export (``alpha / rank``: rank
        4, alpha 8 give 2.0).

    Raises:
      ValueError: ``head_dim`` not a positive whole number.

    Example::

        mapping = osf.hf.presets.tunix.llama3(head_dim=64, lora_scale=8 / 4)
        mapping.to_flax("model.layers.0.self_attn.k_proj.weight")[0]  # "layers.0.attn.k_proj.w"
    """
    return _mapping("tunix-llama3", head_dim, [], tie_word_embeddings, lora_scale)


def qwen3(
    *, head_dim: int, tie_word_embeddings: bool = False, lora_scale: float | None = None
) -> KeyMapping:
    """The preset ``"tunix-qwen3"``: Tunix's ``Qwen3``, dense and MoE: :func:`llama3`'s
    layout, plus ``layers.{i}.attn.{q,k}_norm.w``, the experts stacked as
    ``layers.{i}.mlp.*_proj`` ``(experts, in, out)`` and the router as
    ``layers.{i}.mlp.router.kernel``. Its keyword arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.tunix.qwen3(head_dim=128, tie_word_embeddings=True)
        mapping.to_flax("model.layers.1.mlp.experts.3.up_proj.weight")[0]
        # "layers.1.mlp.up_proj" (expert 3 of the stacked kernel)
    """
    return _mapping("tunix-qwen3", head_dim, _MOE, tie_word_embeddings, lora_scale)


def qwen2(
    *, head_dim: int, tie_word_embeddings: bool = False, lora_scale: float | None = None
) -> KeyMapping:
    """The preset ``"tunix-qwen2"``: Tunix's ``Qwen2`` (Qwen 2 and 2.5): :func:`llama3`'s
    layout, plus the q/k/v biases, flat: ``layers.{i}.attn.{q,k,v}_bias`` ``(heads *
    head_dim,)``. Its keyword arguments are :func:`llama3`'s.

    Example::

        mapping = osf.hf.presets.tunix.qwen2(head_dim=128, tie_word_embeddings=True)
        mapping.to_flax("model.layers.0.self_attn.k_proj.bias")[0]  # "layers.0.attn.k_bias"
    """
    bias = Rule(_HF_LAYER + ".self_attn.{p:q|k|v}_proj.bias", "layers.{i}.attn.{p}_bias")
    return _mapping("tunix-qwen2", head_dim, [bias], tie_word_embeddings, lora_scale)


def _head_dim(name: str, head_dim: Any) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim <= 0:
        raise ValueError(
            f"preset {name!r} needs head_dim= (the Tunix ModelConfig's head_dim), got {head_dim!r}"
        )
    return int(head_dim)


def _mapping(
    name: str,
    head_dim: int,
    extra: list[Rule],
    tie_word_embeddings: bool,
    lora_scale: float | None,
) -> KeyMapping:
    # Tunix's llama3/params.py, qwen2/params.py and qwen3/params.py, both ways.
    heads = _head_dim(name, head_dim)
    layer = _HF_LAYER
    rules = [
        Rule("model.embed_tokens.weight", "embedder.input_embedding"),
        Rule(
            layer + ".self_attn.{p:q_proj|k_proj|v_proj}.weight",
            "layers.{i}.attn.{p}.w",
            Chain(Transpose(), SplitHeads(head_dim=heads, axis=-1)),
        ),
        Rule(
            layer + ".self_attn.o_proj.weight",
            "layers.{i}.attn.o_proj.w",
            Chain(Transpose(), SplitHeads(head_dim=heads, axis=0)),
        ),
        Rule(layer + ".self_attn.{n:q_norm|k_norm}.weight", "layers.{i}.attn.{n}.w"),
        _MLP,
        Rule(layer + ".{n:input_layernorm|post_attention_layernorm}.weight", "layers.{i}.{n}.w"),
        Rule("model.norm.weight", "final_norm.w"),
        Rule("lm_head.weight", "lm_head.w", Transpose()),
        *extra,
    ]
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie_word_embeddings else None
    return KeyMapping(rules, tied=tied, lora_scale=lora_scale)


# --------------------------------------------------------------------------- Gemma


def _heads_first(**split: int) -> Chain:
    # Hugging Face's (heads * head_dim, embed) <-> Tunix's einsum kernel (heads, embed, head_dim)
    return Chain(Transpose(), SplitHeads(axis=-1, **split), Transpose((1, 0, 2)))


def _stacked(layer: str, parts: str, kernel: str, **split: int) -> Rule:
    # Hugging Face's projections ``parts`` stacked on axis 0 of one Tunix kernel (kv_einsum)
    proj = f"{layer}.self_attn.{{p:{parts}}}.weight"
    return Rule(proj, f"layers.{{i}}.attn.{kernel}.w", _heads_first(**split), stacked={"p": 0})


def _gemma_rules(post_attention: str, **split: int) -> list[Rule]:
    # a Gemma layer's, its attention's heads split as ``split`` (Gemma 2 has no q/k norms)
    attn, layer = _HF_LAYER + ".self_attn.", _HF_LAYER + "."
    norms = {
        "input_layernorm": "pre_attention_norm",
        "post_attention_layernorm": post_attention,
        "pre_feedforward_layernorm": "pre_ffw_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    return [
        Rule(attn + "q_proj.weight", "layers.{i}.attn.q_einsum.w", _heads_first(**split)),
        Rule(attn + "o_proj.weight", "layers.{i}.attn.attn_vec_einsum.w",
             Chain(Transpose(), SplitHeads(axis=0, **split))),
        Rule(attn + "q_norm.weight", "layers.{i}.attn._query_norm.scale"),
        Rule(attn + "k_norm.weight", "layers.{i}.attn._key_norm.scale"),
        *(Rule(f"{layer}{hf}.weight", f"layers.{{i}}.{t}.scale") for hf, t in norms.items()),
        _MLP,
    ]  # fmt: skip


def _gemma_mapping(aliases: tuple[str, ...], layers: list[Rule], **kwargs: Any) -> KeyMapping:
    # Rules of Hugging Face's ``model.`` names, read under each of ``aliases`` too (an export
    # writes ``model.``'s); no lm_head: Tunix's Gemma computes its logits from the embedding.
    base = [
        Rule("model.embed_tokens.weight", "embedder.input_embedding"),
        Rule("model.norm.weight", "final_norm.scale"),
        *layers,
    ]
    rules = aliased(base, [("model.", aliases)])
    ignore = [r"(?:language_model\.)?lm_head\.weight", *kwargs.pop("ignore_torch", ())]
    return KeyMapping(rules, ignore_torch=ignore, **kwargs)


def _gemma(name: str, head_dim: int, fused_qkv: bool, post_attention: str) -> list[Rule]:
    # q_einsum and kv_einsum, or qkv_einsum: an export maps either; a load fills the one
    # ``fused_qkv`` puts first (the first rule matching a Hugging Face key wins).
    split = {"head_dim": _head_dim(name, head_dim)}
    kv = _stacked(_HF_LAYER, "k_proj|v_proj", "kv_einsum", **split)
    qkv = _stacked(_HF_LAYER, "q_proj|k_proj|v_proj", "qkv_einsum", **split)
    rules = _gemma_rules(post_attention, **split)
    return [qkv, *rules, kv] if fused_qkv else [*rules, kv, qkv]


def gemma(*, head_dim: int, fused_qkv: bool = False, lora_scale: float | None = None) -> KeyMapping:
    """The preset ``"tunix-gemma"``: Tunix's ``Gemma``, read from Hugging Face's Gemma 2:
    ``layers.{i}.attn.q_einsum.w`` ``(heads, embed, head_dim)``, ``kv_einsum.w`` ``(2,
    kv_heads, embed, head_dim)`` (or ``qkv_einsum.w`` ``(3, heads, embed, head_dim)``),
    ``attn_vec_einsum.w`` ``(heads, head_dim, embed)``, the norms' ``.scale``; no ``lm_head``
    (Tunix's logits come from the embedding).

    Args:
      head_dim: the attention head size (Tunix's and Hugging Face's ``head_dim``).
      fused_qkv: a load fills ``qkv_einsum`` (Tunix's layout where ``num_kv_heads ==
        num_heads``); an export maps either layout.
      lora_scale: as :func:`llama3`'s.

    Raises:
      ValueError: ``head_dim`` not a positive whole number.

    Example::

        mapping = osf.hf.presets.tunix.gemma(head_dim=256, lora_scale=16 / 8)
        mapping.to_torch("layers.3.post_attn_norm.scale")[0]
        # "model.layers.3.post_attention_layernorm.weight"
    """
    rules = _gemma("tunix-gemma", head_dim, fused_qkv, "post_attn_norm")
    return _gemma_mapping((), rules, lora_scale=lora_scale)


def gemma3(
    *, head_dim: int, fused_qkv: bool = False, lora_scale: float | None = None
) -> KeyMapping:
    """The preset ``"tunix-gemma3"``: Tunix's ``Gemma3``, its text model: :func:`gemma`'s
    layout with ``post_attention_norm`` and the q/k norms ``attn._query_norm.scale`` /
    ``_key_norm.scale``. An export writes ``Gemma3ForCausalLM``'s names; a load also reads a
    multimodal checkpoint's (``language_model.model.*``), its vision tower left out.
    Its keyword arguments are :func:`gemma`'s.

    Example::

        mapping = osf.hf.presets.tunix.gemma3(head_dim=256)
        mapping.to_flax("language_model.model.layers.0.self_attn.q_norm.weight")[0]
        # "layers.0.attn._query_norm.scale"
    """
    rules = _gemma("tunix-gemma3", head_dim, fused_qkv, "post_attention_norm")
    vision = r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..*"
    return _gemma_mapping(
        ("language_model.model.",), rules, ignore_torch=[vision], lora_scale=lora_scale
    )


def gemma4(hf_config: Any, *, lora_scale: float | None = None) -> KeyMapping:
    """The preset ``"tunix-gemma4"``: Tunix's ``Gemma4``, built from the Hugging Face config
    (``gemma4_text``, or ``gemma4``'s ``text_config``), whose global layers have other heads.
    :func:`gemma3`'s layout, and:

    - global layers with ``attention_k_eq_v`` have a key and no value: ``attn.k_einsum.w``;
    - the last ``num_kv_shared_layers`` layers reuse earlier keys and values: their unused
      ``kv_einsum`` and ``_key_norm`` are neither exported nor loaded;
    - an export writes ``Gemma4ForCausalLM``'s names; a load also reads
      ``Gemma4ForConditionalGeneration``'s, its vision and audio towers left out;
    - ``layer_scalar`` as ``skip_scale``, the per-layer inputs and the MoE block under
      Tunix's gemma4 loader's names.

    Args:
      hf_config: the model's Hugging Face config (a transformers config, a dict, a
        ``config.json`` or a directory holding one).
      lora_scale: as :func:`llama3`'s.

    Raises:
      ValueError: a config without heads, ``head_dim`` or its layers' ``layer_types``.
      ConfigError: an impossible size (``num_kv_shared_layers`` past the layers too), naming
        the key.

    Example::

        mapping = osf.hf.presets.tunix.gemma4("/models/gemma-4-E2B")
        mapping.to_torch("layers.0.skip_scale")[0]   # "model.layers.0.layer_scalar"
    """
    c = ConfigFacts.of(hf_config).language_model()
    attention, layers = c.attention(), c.count("num_hidden_layers")
    types = c.doc.get("layer_types")
    if attention is None or not isinstance(types, (list, tuple)) or len(types) != layers:
        raise ValueError(
            "preset 'tunix-gemma4' needs a Hugging Face Gemma 4 config with "
            "num_attention_heads, head_dim, num_hidden_layers and its layer_types; got keys "
            f"{sorted(c.doc)}"
        )
    heads, kv, _ = attention
    k_eq_v = c.flag("attention_k_eq_v")
    # the layers by their key and value kernels: (a key for both, key/value heads)
    kinds: dict[tuple[bool, int], list[str]] = {}
    for i, kind in enumerate(types):
        full = kind == "full_attention"
        kinds.setdefault((k_eq_v and full, _kv_heads(c, i, full, k_eq_v) or kv), []).append(str(i))
    rules = _gemma_rules("post_attention_norm", heads=heads) + _gemma4_extra(len(types))
    for (k_only, kv_heads), listed in kinds.items():
        layer = f"model.layers.{{i:{'|'.join(listed)}}}"
        key = Rule(f"{layer}.self_attn.k_proj.weight", "layers.{i}.attn.k_einsum.w",
                   _heads_first(heads=kv_heads))  # fmt: skip
        rules.append(
            key if k_only else _stacked(layer, "k_proj|v_proj", "kv_einsum", heads=kv_heads)
        )
    most = (len(types), f"{c.prefix}num_hidden_layers {len(types)}")
    shared_count = c.count("num_kv_shared_layers", most) or 0
    shared = range(len(types) - shared_count, len(types))
    unused = [rf"layers\.{i}\.attn\.(?:kv?_einsum\.w|_key_norm\.scale)" for i in shared]
    return _gemma_mapping(
        ("model.language_model.",),
        rules,
        ignore_torch=[r"model\.(?:vision_tower|embed_vision|audio_tower|embed_audio)\..*"],
        ignore_flax=unused,
        lora_scale=lora_scale,
    )


def _kv_heads(c: ConfigFacts, layer: int, full: bool, k_eq_v: bool) -> int | None:
    # A global layer's key/value heads where they are not the others': transformers 5 keeps
    # them in per_layer_config, the hub's configs as num_global_key_value_heads (which
    # transformers reads only with attention_k_eq_v).
    if not full:
        return None
    per_layer = c.doc.get("per_layer_config")
    if isinstance(per_layer, dict) and isinstance(per_layer.get(str(layer)), dict):
        where = f"{c.prefix}per_layer_config.{layer}."
        return ConfigFacts(per_layer[str(layer)], c.where, where).size("num_key_value_heads")
    return c.size("num_global_key_value_heads") if k_eq_v else None


def _gemma4_extra(layers: int) -> list[Rule]:
    # Gemma 4's layer scalar, per-layer inputs and MoE block (Tunix's gemma4 loader's names)
    layer, to = _HF_LAYER, "layers.{i}."
    per_layer = SplitHeads(heads=layers, axis=-1)  # (.., layers * dim) <-> (.., layers, dim)
    norms = {
        "pre_feedforward_layernorm_2": "moe_pre_ffw_norm",
        "post_feedforward_layernorm_1": "dense_post_ffw_norm",
        "post_feedforward_layernorm_2": "moe_post_ffw_norm",
        "post_per_layer_input_norm": "post_per_layer_input_norm",
    }
    return [
        Rule(layer + ".layer_scalar", to + "skip_scale"),
        *(Rule(f"{layer}.{hf}.weight", f"{to}{t}.scale") for hf, t in norms.items()),
        Rule("model.embed_tokens_per_layer.weight", "embedder.per_layer_input_embedding",
             per_layer),
        Rule("model.per_layer_model_projection.weight", "embedder.per_layer_model_projection.w",
             Chain(Transpose(), per_layer)),
        Rule("model.per_layer_projection_norm.weight", "embedder.per_layer_projection_norm.scale"),
        Rule(layer + ".{p:per_layer_input_gate|per_layer_projection}.weight", to + "{p}.w",
             Transpose()),
        Rule(layer + ".router.proj.weight", to + "moe.router_logits", Transpose()),
        Rule(layer + ".router.scale", to + "moe.router_scale"),
        Rule(layer + ".router.per_expert_scale", to + "moe.per_expert_scale"),
        Rule(layer + ".experts.gate_up_proj", to + "moe.gating_einsum", SplitHeads(heads=2, axis=1)),
        Rule(layer + ".experts.down_proj", to + "moe.linear", Transpose((0, 2, 1))),
    ]  # fmt: skip


# The preset names of this group: a Tunix model family is one more line here.
PRESETS: dict[str, Callable[..., KeyMapping]] = {
    "tunix-llama3": llama3,
    "tunix-qwen2": qwen2,
    "tunix-qwen3": qwen3,
    "tunix-gemma": gemma,
    "tunix-gemma3": gemma3,
    "tunix-gemma4": gemma4,
}
