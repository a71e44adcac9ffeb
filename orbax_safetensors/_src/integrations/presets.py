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

With ``tie_word_embeddings=True`` (LLaMA/Qwen), a directory without ``lm_head.weight`` loads a
model's ``lm_head.kernel`` from the embedding, and an export writes no ``lm_head.weight``.

Example::

    mapping = preset_mapping("llama")
    osf.export_pytorch(model, "/tmp/hf", mapping, hf_config=config)
"""

from __future__ import annotations

from orbax_safetensors._src.integrations.key_mapping import KeyMapping, Rule, Transpose

PRESETS = ("gpt2", "llama", "qwen2", "qwen3")


def preset_mapping(name: str, *, tie_word_embeddings: bool = False) -> KeyMapping:
    """The ready-made mapping ``name`` (one of :data:`PRESETS`).

    Raises:
      ValueError: for an unknown name.

    Example::

        osf.preset_mapping("qwen3", tie_word_embeddings=True)
    """
    if name in ("llama", "qwen2", "qwen3"):
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie_word_embeddings else None
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
