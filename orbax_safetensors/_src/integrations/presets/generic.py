"""Presets for NNX ports that keep Hugging Face's module names (``nnx.Linear`` for
``nn.Linear``, ``nnx.Embed``, ``nnx.RMSNorm`` / ``nnx.LayerNorm``): a Hugging Face key
``model.layers.3.mlp.up_proj.weight`` is the JAX name ``model.layers.3.mlp.up_proj.kernel``,
transposed.
"""

from __future__ import annotations

from orbax_safetensors._src.integrations.key_mapping import KeyMapping, Rule
from orbax_safetensors._src.integrations.transforms import Transpose

# A tied head: a directory without lm_head.weight loads the model's head from the embedding,
# and an export writes none while the head equals the embedding.
_TIED = {"lm_head.weight": "model.embed_tokens.weight"}

# Every weight is an nn.Linear ending in _proj (Phi-3's fused qkv_proj and gate_up_proj too)
# or lm_head, an embedding, or a norm ending in norm (Gemma 3's pre/post feed-forward norms
# and q/k norms too).
_DENSE = [
    Rule("model.embed_tokens.weight", "model.embed_tokens.embedding"),
    Rule("{p:.*_proj|lm_head}.weight", "{p}.kernel", Transpose()),
    Rule("{p:.*_proj}.bias", "{p}.bias"),
    Rule("{p:.*norm}.weight", "{p}.scale"),
]

# Mixture-of-experts layers, in one JAX layout for every family: the experts' projections
# stacked on axis 0, ``model.layers.{i}.mlp.experts.{gate,up,down}_proj`` ``(experts, in,
# out)``, the router an ``nnx.Linear`` ``model.layers.{i}.mlp.gate`` (``kernel`` ``(embed,
# experts)``). transformers 5 holds the experts fused in memory (``mlp.experts.gate_up_proj``
# ``(experts, 2 * hidden, embed)``) but reads and writes them one tensor per expert, under
# the names below: the rules follow the files. They come before the dense rules, which would
# take the experts' ``*_proj`` keys one by one.
_LAYER = "model.layers.{i}"
_EXPERTS = _LAYER + ".mlp.experts"
_QWEN_MOE = [
    Rule(
        _EXPERTS + ".{e}.{p:gate_proj|up_proj|down_proj}.weight",
        _EXPERTS + ".{p}",
        Transpose(),
        stacked="e",
    ),
    Rule(_LAYER + ".mlp.gate.weight", _LAYER + ".mlp.gate.kernel", Transpose()),
    # Qwen 2 MoE's shared expert: mlp.shared_expert.*_proj (dense rules) and its gate
    Rule(
        _LAYER + ".mlp.shared_expert_gate.weight",
        _LAYER + ".mlp.shared_expert_gate.kernel",
        Transpose(),
    ),
]
# Mixtral's files keep its first names: block_sparse_moe, experts' w1 (gate), w3 (up), w2 (down)
_MIXTRAL_MOE = [
    *(
        Rule(
            _LAYER + f".block_sparse_moe.experts.{{e}}.{w}.weight",
            _EXPERTS + f".{proj}",
            Transpose(),
            stacked="e",
        )
        for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    ),
    Rule(_LAYER + ".block_sparse_moe.gate.weight", _LAYER + ".mlp.gate.kernel", Transpose()),
]


def dense(*, tie_word_embeddings: bool = False, lora_scale: float | None = None) -> KeyMapping:
    """The presets ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"`` and
    ``"gemma3"`` (``Gemma3ForCausalLM``): one set of rules for any causal LM whose port keeps
    Hugging Face's names: ``model.embed_tokens.embedding``; every ``*_proj`` and ``lm_head``
    as ``.kernel`` ``(in, out)``, their biases as ``.bias``; every ``*norm`` as ``.scale``.

    Args:
      tie_word_embeddings: the Hugging Face config's (Gemma 3 ties by default): a directory
        without ``lm_head.weight`` loads a model's own head from the embedding, and an export
        writes no ``lm_head.weight`` while the head equals the embedding.
      lora_scale: the scale of LoRA adapters merged on export (``KeyMapping.lora_scale``):
        qwix's ``alpha / rank``; None: flax's unscaled LoRA.

    Example::

        mapping = osf.hf.presets.generic.dense(tie_word_embeddings=True)
        mapping.to_torch("model.layers.0.mlp.up_proj.kernel")[0]
        # "model.layers.0.mlp.up_proj.weight"
    """
    return _mapping(_DENSE, tie_word_embeddings, lora_scale)


def mixtral(*, tie_word_embeddings: bool = False, lora_scale: float | None = None) -> KeyMapping:
    """The preset ``"mixtral"``: :func:`dense`'s rules, and Mixtral's experts
    (``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``) stacked as
    ``model.layers.{i}.mlp.experts.{gate,up,down}_proj`` ``(experts, in, out)``, its router as
    ``model.layers.{i}.mlp.gate.kernel``. Its keyword arguments are :func:`dense`'s.

    Example::

        mixtral().to_flax("model.layers.1.block_sparse_moe.experts.3.w1.weight")[0]
        # "model.layers.1.mlp.experts.gate_proj" (expert 3 of the stacked kernel)
    """
    return _mapping([*_MIXTRAL_MOE, *_DENSE], tie_word_embeddings, lora_scale)


def qwen_moe(*, tie_word_embeddings: bool = False, lora_scale: float | None = None) -> KeyMapping:
    """The presets ``"qwen2-moe"`` and ``"qwen3-moe"``: :func:`dense`'s rules, and the experts
    stacked as ``model.layers.{i}.mlp.experts.{gate,up,down}_proj`` ``(experts, in, out)``,
    the router ``mlp.gate.kernel`` and Qwen 2 MoE's ``mlp.shared_expert_gate.kernel``.
    Its keyword arguments are :func:`dense`'s.

    Example::

        qwen_moe().to_flax("model.layers.0.mlp.experts.2.down_proj.weight")[0]
        # "model.layers.0.mlp.experts.down_proj"
    """
    return _mapping([*_QWEN_MOE, *_DENSE], tie_word_embeddings, lora_scale)


def gpt2(*, tie_word_embeddings: bool = True, lora_scale: float | None = None) -> KeyMapping:
    """The preset ``"gpt2"`` (``GPT2LMHeadModel``): ``transformer.wte.embedding``,
    ``transformer.wpe.embedding``, ``transformer.h.{i}.attn.c_attn.kernel`` (``Conv1D``: kept
    ``(in, out)``, as stored) and its bias, ``ln_*`` as ``.scale`` / ``.bias``.

    Args:
      tie_word_embeddings: GPT-2's head is its ``wte`` (True, the default): no ``lm_head``
        is written while the head equals the embedding, and a directory without it loads a
        model's head from ``wte``. False: ``lm_head.weight`` is ``lm_head.kernel``,
        transposed, like :func:`dense`'s.
      lora_scale: as :func:`dense`'s.

    Example::

        gpt2().to_torch("transformer.h.0.attn.c_attn.kernel")[0]
        # "transformer.h.0.attn.c_attn.weight"
    """
    rules = [
        Rule("transformer.{e:wte|wpe}.weight", "transformer.{e}.embedding"),
        Rule("{p:.*\\.c_(attn|proj|fc)}.weight", "{p}.kernel"),  # Conv1D: (in, out)
        Rule("{p:.*\\.c_(attn|proj|fc)}.bias", "{p}.bias"),
        Rule("{p:.*ln_(1|2|f)}.weight", "{p}.scale"),
        Rule("{p:.*ln_(1|2|f)}.bias", "{p}.bias"),
    ]
    if tie_word_embeddings:
        tied = {"lm_head.weight": "transformer.wte.weight"}
        return KeyMapping(rules, tied=tied, lora_scale=lora_scale)
    rules.append(Rule("lm_head.weight", "lm_head.kernel", Transpose()))
    return KeyMapping(rules, lora_scale=lora_scale)


def _mapping(rules: list[Rule], tie_word_embeddings: bool, lora_scale: float | None) -> KeyMapping:
    tied = _TIED if tie_word_embeddings else None
    return KeyMapping(rules, tied=tied, lora_scale=lora_scale)


# The preset names of this group: a family whose port keeps these names is one more line here.
PRESETS = {
    "llama": dense,
    "mistral": dense,
    "qwen2": dense,
    "qwen3": dense,
    "phi3": dense,
    "gemma3": dense,
    "mixtral": mixtral,
    "qwen2-moe": qwen_moe,
    "qwen3-moe": qwen_moe,
    "gpt2": gpt2,
}
