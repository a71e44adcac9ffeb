"""Ready-made key mappings between Hugging Face causal LMs and NNX ports that keep Hugging
Face's module names (``nnx.Linear`` for ``nn.Linear``, ``nnx.Embed``, ``nnx.RMSNorm`` /
``nnx.LayerNorm``), the layout of the reference models in the test suite
(``tests/hf_models.py``):

- ``"llama"``, ``"qwen2"``, ``"qwen3"``: ``model.embed_tokens.embedding``,
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj.kernel`` (and ``.bias`` for Qwen 2),
  ``model.layers.{i}.mlp.{gate,up,down}_proj.kernel``, every ``*norm`` (Qwen 3's
  ``q_norm``/``k_norm`` too) as ``.scale``, ``model.norm.scale``, ``lm_head.kernel``;
- ``"gpt2"``: ``transformer.wte.embedding``, ``transformer.wpe.embedding``,
  ``transformer.h.{i}.attn.c_attn.kernel`` (``Conv1D``: kept ``(in, out)``), ``ln_*`` as
  ``scale``/``bias``; ``lm_head`` tied to ``wte``.

- ``"tunix-llama3"``, ``"tunix-qwen3"``: the NNX models of Tunix (``google-tunix``:
  ``tunix.models.llama3.model.Llama3``, ``tunix.models.qwen3.model.Qwen3``, dense), the names
  and layouts of Tunix's own ``params.py``: ``embedder.input_embedding``,
  ``layers.{i}.attn.{q,k,v}_proj.w`` ``(embed, heads, head_dim)`` and ``o_proj.w``
  ``(heads, head_dim, embed)`` (``head_dim=`` is required: one rule fits query and key/value
  heads), ``layers.{i}.mlp.{gate,up,down}_proj.kernel``, every norm as ``.w``
  (``attn.q_norm``/``k_norm``, ``input_layernorm``, ``post_attention_layernorm``,
  ``final_norm``), ``lm_head.w`` (absent with Tunix's tied embeddings); ``tunix-qwen3`` also
  maps Qwen 3 MoE: ``mlp.experts.{e}.*_proj.weight`` stacked as ``layers.{i}.mlp.*_proj``
  ``(experts, in, out)``, the router ``mlp.gate.weight`` as ``layers.{i}.mlp.router.kernel``.

With ``tie_word_embeddings=True`` (LLaMA/Qwen), a directory without ``lm_head.weight`` loads a
model's ``lm_head.kernel`` from the embedding, and an export writes no ``lm_head.weight`` (a
head that differs from the embedding is written, untied: ``export_pytorch``). LoRA adapters
are merged on export with every preset (``lora_scale=``: ``integrations/lora.py``).

Example::

    mapping = preset_mapping("llama")
    osf.export_pytorch(model, "/tmp/hf", mapping, hf_config=config)
    tunix = preset_mapping("tunix-qwen3", head_dim=model.config.head_dim)
"""

from __future__ import annotations

import dataclasses

from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    Rule,
    SplitHeads,
    Transpose,
)

PRESETS = ("gpt2", "llama", "qwen2", "qwen3", "tunix-llama3", "tunix-qwen3")
TUNIX_PRESETS = ("tunix-llama3", "tunix-qwen3")
_TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def preset_mapping(
    name: str,
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The ready-made mapping ``name`` (one of :data:`PRESETS`).

    Args:
      name: the preset.
      tie_word_embeddings: the Hugging Face config's: ``lm_head.weight`` is tied to the
        embedding (not written; a directory without it loads a model's own head from the
        embedding).
      head_dim: the attention head size, required by the Tunix presets (Tunix's
        ``ModelConfig.head_dim``; Hugging Face's ``head_dim``, or ``hidden_size //
        num_attention_heads``).
      lora_scale: the scale of LoRA adapters merged on export (``KeyMapping.lora_scale``):
        ``alpha / rank`` of qwix's ``LoraProvider``, as Tunix applies it (rank 4, alpha 8:
        2.0); None: flax's unscaled LoRA, 1.0.

    Raises:
      ValueError: for an unknown name, or a Tunix preset without ``head_dim``.

    Example::

        osf.preset_mapping("qwen3", tie_word_embeddings=True)
        osf.preset_mapping("tunix-llama3", head_dim=64)
        osf.preset_mapping("tunix-qwen3", head_dim=128, lora_scale=8 / 4)
    """
    mapping = _preset(name, tie_word_embeddings, head_dim)
    return mapping if lora_scale is None else dataclasses.replace(mapping, lora_scale=lora_scale)


def _preset(name: str, tie_word_embeddings: bool, head_dim: int | None) -> KeyMapping:
    if name in TUNIX_PRESETS:
        return _tunix(name, head_dim, tie_word_embeddings)
    if name in ("llama", "qwen2", "qwen3"):
        tied = _TIED if tie_word_embeddings else None
        return KeyMapping(
            [
                Rule("model.embed_tokens.weight", "model.embed_tokens.embedding"),
                Rule("{p:.*_proj|lm_head}.weight", "{p}.kernel", Transpose()),
                Rule("{p:.*_proj}.bias", "{p}.bias"),
                Rule("{p:.*norm}.weight", "{p}.scale"),
            ],
            tied=tied,
        )
    if name == "gpt2":
        return KeyMapping(
            [
                Rule("transformer.{e:wte|wpe}.weight", "transformer.{e}.embedding"),
                Rule("{p:.*\\.c_(attn|proj|fc)}.weight", "{p}.kernel"),  # Conv1D: (in, out)
                Rule("{p:.*\\.c_(attn|proj|fc)}.bias", "{p}.bias"),
                Rule("{p:.*ln_(1|2|f)}.weight", "{p}.scale"),
                Rule("{p:.*ln_(1|2|f)}.bias", "{p}.bias"),
            ],
            tied={"lm_head.weight": "transformer.wte.weight"},
        )
    raise ValueError(f"no preset mapping {name!r} (presets: {', '.join(PRESETS)})")


def _tunix(name: str, head_dim: int | None, tie_word_embeddings: bool) -> KeyMapping:
    # Tunix's llama3/params.py and qwen3/params.py, both ways. The query/key/value kernels
    # are (embed, heads, head_dim), the output kernel (heads, head_dim, embed).
    if head_dim is None or int(head_dim) <= 0:
        raise ValueError(
            f"preset {name!r} needs head_dim= (the Tunix ModelConfig's head_dim), got {head_dim!r}"
        )
    layer = "model.layers.{i}"
    return KeyMapping(
        [
            Rule("model.embed_tokens.weight", "embedder.input_embedding"),
            Rule(
                layer + ".self_attn.{p:q_proj|k_proj|v_proj}.weight",
                "layers.{i}.attn.{p}.w",
                Chain(Transpose(), SplitHeads(head_dim=int(head_dim), axis=-1)),
            ),
            Rule(
                layer + ".self_attn.o_proj.weight",
                "layers.{i}.attn.o_proj.w",
                Chain(Transpose(), SplitHeads(head_dim=int(head_dim), axis=0)),
            ),
            Rule(layer + ".self_attn.{n:q_norm|k_norm}.weight", "layers.{i}.attn.{n}.w"),
            Rule(
                layer + ".mlp.{p:gate_proj|up_proj|down_proj}.weight",
                "layers.{i}.mlp.{p}.kernel",
                Transpose(),
            ),
            Rule(
                layer + ".{n:input_layernorm|post_attention_layernorm}.weight",
                "layers.{i}.{n}.w",
            ),
            Rule("model.norm.weight", "final_norm.w"),
            Rule("lm_head.weight", "lm_head.w", Transpose()),
            *(_TUNIX_MOE if name == "tunix-qwen3" else []),
        ],
        tied=_TIED if tie_word_embeddings else None,
    )


# Qwen 3 MoE (Tunix's MoELayer): the experts' projections stacked on axis 0, (experts, in, out)
_TUNIX_MOE = [
    Rule(
        "model.layers.{i}.mlp.experts.{e}.{p:gate_proj|up_proj|down_proj}.weight",
        "layers.{i}.mlp.{p}",
        Transpose(),
        stacked="e",
    ),
    Rule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.kernel", Transpose()),
]
