"""Ready-made key mappings between Hugging Face causal LMs and NNX ports that keep Hugging
Face's module names (``nnx.Linear`` for ``nn.Linear``, ``nnx.Embed``, ``nnx.RMSNorm`` /
``nnx.LayerNorm``), the layout of the reference models in the test suite
(``tests/helpers/hf_models.py``):

- ``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"``, ``"gemma3"`` (one set of
  rules: :data:`DENSE_PRESETS`): ``model.embed_tokens.embedding``,
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj.kernel`` (and ``.bias`` for Qwen 2),
  ``model.layers.{i}.mlp.{gate,up,down}_proj.kernel`` (Phi-3's fused ``qkv_proj`` and
  ``gate_up_proj`` as Phi-3 has them), every ``*norm`` (Qwen 3's and Gemma 3's
  ``q_norm``/``k_norm``, Gemma 3's ``pre``/``post_feedforward_layernorm`` too) as ``.scale``,
  ``model.norm.scale``, ``lm_head.kernel``; Gemma 3 is its text model, ``Gemma3ForCausalLM``;
- ``"mixtral"``, ``"qwen2-moe"``, ``"qwen3-moe"``: the dense rules, and the experts stacked
  on axis 0, ``model.layers.{i}.mlp.experts.{gate,up,down}_proj`` ``(experts, in, out)``,
  the router ``model.layers.{i}.mlp.gate.kernel`` (Qwen 2 MoE's shared expert is dense, its
  gate ``mlp.shared_expert_gate.kernel``), from the names the files hold (Mixtral's
  ``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``; transformers 5 renames and fuses them
  in memory only);
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

With ``tie_word_embeddings=True`` (Gemma 3's default, small LLaMA and Qwen models), a
directory without ``lm_head.weight`` loads a model's ``lm_head.kernel`` from the embedding,
and an export writes no ``lm_head.weight`` (a head that differs from the embedding is
written, untied: ``export_pytorch``). LoRA adapters are merged on export with every preset
(``lora_scale=``: ``integrations/lora.py``).

Example::

    mapping = preset_mapping("llama")
    osf.export_pytorch(model, "/tmp/hf", mapping, hf_config=config)
    moe = preset_mapping("qwen3-moe", tie_word_embeddings=config.tie_word_embeddings)
    tunix = preset_mapping("tunix-qwen3", head_dim=model.config.head_dim)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from orbax_safetensors._src.integrations import maxtext as _maxtext
from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    Rule,
    SplitHeads,
    Transpose,
)

# Hugging Face model types whose causal LMs (``*ForCausalLM``) a port keeping Hugging Face's
# module names maps with the same rules as LLaMA: every weight is an ``nn.Linear`` ending in
# ``_proj`` (Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` too), an embedding, or a norm
# ending in ``norm`` (Gemma 3's pre/post feed-forward norms and q/k norms too).
DENSE_PRESETS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
MOE_PRESETS = ("mixtral", "qwen2-moe", "qwen3-moe")
MAXTEXT_PRESETS = tuple(_maxtext.MAXTEXT_PRESETS)
TUNIX_PRESETS = ("tunix-llama3", "tunix-qwen3")
PRESETS = (*DENSE_PRESETS, *MOE_PRESETS, "gpt2", *TUNIX_PRESETS, *MAXTEXT_PRESETS)
_TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def preset_mapping(
    name: str,
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    hf_config: Any = None,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    lora_scale: float | None = None,
) -> KeyMapping:
    """The ready-made mapping ``name`` (one of :data:`PRESETS`).

    Args:
      name: the preset.
      tie_word_embeddings: the Hugging Face config's: ``lm_head.weight`` is tied to the
        embedding (not written; a directory without it loads a model's own head from the
        embedding). Gemma 3's configs tie by default.
      head_dim: the attention head size, required by the Tunix presets (Tunix's
        ``ModelConfig.head_dim``; Hugging Face's ``head_dim``, or ``hidden_size //
        num_attention_heads``).
      hf_config: the MaxText presets' (``maxtext-*``, required there): the model's Hugging
        Face config (a transformers config, a dict, a ``config.json`` or the model's
        directory), which gives them heads, ``head_dim``, the vocabulary and tied embeddings
        (see ``integrations/maxtext.py``).
      scan_layers: the MaxText presets': True (layers stacked on axis 1), False (one
        ``layers_{i}`` subtree a layer), None (both: an export reads either, a load fills
        the scanned layout).
      vocab_size: the MaxText presets': the model's vocabulary when padded past the
        config's (a load pads the embedding and ``logits_dense`` to it; by a padding at
        most, ``transforms.PADDING_ROWS`` rows and a quarter of the larger count).
      lora_scale: the scale of LoRA adapters merged on export (``KeyMapping.lora_scale``):
        ``alpha / rank`` of qwix's ``LoraProvider``, as Tunix applies it (rank 4, alpha 8:
        2.0); None: flax's unscaled LoRA, 1.0.

    Raises:
      ValueError: for an unknown name, a Tunix preset without ``head_dim``, a MaxText preset
        without ``hf_config`` (or with ``head_dim``/``tie_word_embeddings``, which come from
        the config).
      ConfigError: a MaxText preset's ``hf_config`` with an impossible size (zero,
        negative, not a whole number, key/value heads that do not divide the heads), naming
        the key (``integrations/config_facts.py``).

    Example::

        osf.preset_mapping("qwen3", tie_word_embeddings=True)
        osf.preset_mapping("mixtral")
        osf.preset_mapping("tunix-llama3", head_dim=64)
        osf.preset_mapping("maxtext-llama3", hf_config="/models/Llama-3.1-8B")
        osf.preset_mapping("tunix-qwen3", head_dim=128, lora_scale=8 / 4)
    """
    if name in MAXTEXT_PRESETS:
        if hf_config is None or head_dim is not None or tie_word_embeddings:
            raise ValueError(
                f"preset {name!r} takes hf_config= (the model's Hugging Face config, which "
                "gives head_dim and tie_word_embeddings), and neither head_dim= nor "
                "tie_word_embeddings="
            )
        mapping = _maxtext.maxtext_mapping(
            name, hf_config, scan_layers=scan_layers, vocab_size=vocab_size
        )
    else:
        mapping = _preset(name, tie_word_embeddings, head_dim)
    return mapping if lora_scale is None else dataclasses.replace(mapping, lora_scale=lora_scale)


def _preset(name: str, tie_word_embeddings: bool, head_dim: int | None) -> KeyMapping:
    if name in TUNIX_PRESETS:
        return _tunix(name, head_dim, tie_word_embeddings)
    tied = _TIED if tie_word_embeddings else None
    if name in DENSE_PRESETS:
        return KeyMapping(_DENSE, tied=tied)
    if name == "mixtral":
        return KeyMapping([*_MIXTRAL_MOE, *_DENSE], tied=tied)
    if name in ("qwen2-moe", "qwen3-moe"):
        return KeyMapping([*_QWEN_MOE, *_DENSE], tied=tied)
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


# Ports that keep Hugging Face's module names: nnx.Embed, nnx.Linear (kernel (in, out)),
# nnx.RMSNorm / nnx.LayerNorm (scale).
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


def _tunix(name: str, head_dim: int | None, tie_word_embeddings: bool) -> KeyMapping:
    # Tunix's llama3/params.py and qwen3/params.py, both ways. The query/key/value kernels
    # are (embed, heads, head_dim), the output kernel (heads, head_dim, embed).
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim <= 0:
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
