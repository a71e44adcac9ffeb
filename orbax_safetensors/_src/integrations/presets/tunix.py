"""Presets for Tunix's NNX models (``google-tunix``: ``tunix.models.llama3.model.Llama3``,
``tunix.models.qwen3.model.Qwen3``), with the names and layouts of Tunix's own ``params.py``,
both ways.

Tunix keeps its attention projections per head: the query, key and value kernels are
``(embed, heads, head_dim)``, the output kernel ``(heads, head_dim, embed)``; so the presets
split and merge the heads after the transpose and need ``head_dim`` (one rule then fits the
query heads and the fewer key/value heads).

Example::

    mapping = llama3(head_dim=model.config.head_dim)
    osf.load_pytorch(model, "Llama-3.2-1B", mapping)
"""

from __future__ import annotations

import numbers

from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    Rule,
    SplitHeads,
    Transpose,
)

_HF_LAYER = "model.layers.{i}"

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
    """The preset ``"tunix-llama3"``: Tunix's ``Llama3``.

    The JAX layout: ``embedder.input_embedding``; ``layers.{i}.attn.{q,k,v}_proj.w``
    ``(embed, heads, head_dim)`` and ``layers.{i}.attn.o_proj.w`` ``(heads, head_dim,
    embed)``; ``layers.{i}.mlp.{gate,up,down}_proj.kernel``; every norm as ``.w``
    (``input_layernorm``, ``post_attention_layernorm``, ``final_norm``); ``lm_head.w``
    (absent with Tunix's tied embeddings).

    Args:
      head_dim: the attention head size (Tunix's ``ModelConfig.head_dim``; Hugging Face's
        ``head_dim``, or ``hidden_size // num_attention_heads``).
      tie_word_embeddings: Tunix's ``use_tied_embedding``: a directory without
        ``lm_head.weight`` loads a model's head from the embedding, and an export writes none
        while they are equal.
      lora_scale: the scale of qwix's LoRA adapters merged on export (``alpha / rank``, as
        Tunix applies them: rank 4, alpha 8 give 2.0); see ``KeyMapping.lora_scale``.

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
    """The preset ``"tunix-qwen3"``: Tunix's ``Qwen3``, dense and MoE.

    :func:`llama3`'s layout, plus Qwen 3's ``layers.{i}.attn.{q,k}_norm.w``, and Qwen 3
    MoE's experts ``mlp.experts.{e}.*_proj.weight`` stacked as ``layers.{i}.mlp.*_proj``
    ``(experts, in, out)``, the router ``mlp.gate.weight`` as ``layers.{i}.mlp.router.kernel``.

    Its keyword arguments are :func:`llama3`'s.

    Raises:
      ValueError: ``head_dim`` not a positive whole number.

    Example::

        mapping = osf.hf.presets.tunix.qwen3(head_dim=128, tie_word_embeddings=True)
        mapping.to_flax("model.layers.1.mlp.experts.3.up_proj.weight")[0]
        # "layers.1.mlp.up_proj" (expert 3 of the stacked kernel)
    """
    return _mapping("tunix-qwen3", head_dim, _MOE, tie_word_embeddings, lora_scale)


def _mapping(
    name: str,
    head_dim: int,
    extra: list[Rule],
    tie_word_embeddings: bool,
    lora_scale: float | None,
) -> KeyMapping:
    # Tunix's llama3/params.py and qwen3/params.py, both ways.
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim <= 0:
        raise ValueError(
            f"preset {name!r} needs head_dim= (the Tunix ModelConfig's head_dim), got {head_dim!r}"
        )
    heads = int(head_dim)
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
        Rule(
            layer + ".mlp.{p:gate_proj|up_proj|down_proj}.weight",
            "layers.{i}.mlp.{p}.kernel",
            Transpose(),
        ),
        Rule(layer + ".{n:input_layernorm|post_attention_layernorm}.weight", "layers.{i}.{n}.w"),
        Rule("model.norm.weight", "final_norm.w"),
        Rule("lm_head.weight", "lm_head.w", Transpose()),
        *extra,
    ]
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie_word_embeddings else None
    return KeyMapping(rules, tied=tied, lora_scale=lora_scale)


# The preset names of this group: a Tunix model family is one more line here.
PRESETS = {"tunix-llama3": llama3, "tunix-qwen3": qwen3}
