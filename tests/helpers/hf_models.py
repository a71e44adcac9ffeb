"""Reference NNX ports of Hugging Face causal LMs (LLaMA, Qwen 2, Qwen 3, GPT-2), named as
Hugging Face names its modules, so that ``osf.preset_mapping`` maps them: each computes the
same logits as the transformers model of the same config and weights."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NnxList = getattr(nnx, "List", list)  # nnx.List: flax >= 0.12

# What a model's outputs computed by JAX on an accelerator (OSF_TEST_PLATFORM=accelerator, e.g.
# a TPU) can differ from the same model's on the CPU (PyTorch's): even at the "highest" matmul
# precision that tests/conftest.py sets there, a TPU multiplies float32 in several bfloat16
# passes and computes exp and tanh with its own approximations. Only computed outputs (logits)
# are compared with it: stored values are compared bit for bit on every platform.
ACCELERATOR_OUTPUT_TOLERANCE = 1e-4


def assert_outputs_close(got, want, *, rtol, atol):
    """``np.testing.assert_allclose`` for a model's computed outputs: ``rtol`` and ``atol`` on
    the CPU, at least :data:`ACCELERATOR_OUTPUT_TOLERANCE` each where JAX runs on an
    accelerator."""
    if os.environ.get("OSF_TEST_PLATFORM") == "accelerator":
        rtol = max(rtol, ACCELERATOR_OUTPUT_TOLERANCE)
        atol = max(atol, ACCELERATOR_OUTPUT_TOLERANCE)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _rope(x, theta):
    # x: (batch, seq, heads, dim); Hugging Face's rotate_half convention
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv[None]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[None, :, None], jnp.sin(emb)[None, :, None]
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attend(q, k, v):
    # q: (b, t, h, d), k/v: (b, t, kv, d): causal grouped-query attention
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    t = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class SelfAttention(nnx.Module):
    def __init__(self, c, kind, rngs):
        dim, self.heads, self.kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or dim // self.heads
        bias = kind == "qwen2" or bool(getattr(c, "attention_bias", False))
        hd = self.head_dim
        self.q_proj = nnx.Linear(dim, self.heads * hd, use_bias=bias, rngs=rngs)
        self.k_proj = nnx.Linear(dim, self.kv * hd, use_bias=bias, rngs=rngs)
        self.v_proj = nnx.Linear(dim, self.kv * hd, use_bias=bias, rngs=rngs)
        self.o_proj = nnx.Linear(self.heads * hd, dim, use_bias=False, rngs=rngs)
        if kind == "qwen3":
            self.q_norm = nnx.RMSNorm(hd, epsilon=c.rms_norm_eps, rngs=rngs)
            self.k_norm = nnx.RMSNorm(hd, epsilon=c.rms_norm_eps, rngs=rngs)
        self.kind, self.theta = kind, c.rope_parameters["rope_theta"]

    def __call__(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.kv, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.kv, self.head_dim)
        if self.kind == "qwen3":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q, self.theta), _rope(k, self.theta)
        return self.o_proj(_attend(q, k, v).reshape(b, t, -1))


class Mlp(nnx.Module):
    def __init__(self, c, rngs):
        dim, hidden = c.hidden_size, c.intermediate_size
        self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c, kind, rngs):
        self.self_attn = SelfAttention(c, kind, rngs)
        self.mlp = Mlp(c, rngs)
        self.input_layernorm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(
            c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs
        )

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
    def __init__(self, c, kind, rngs):
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        self.layers = NnxList([DecoderLayer(c, kind, rngs) for _ in range(c.num_hidden_layers)])
        self.norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)

    def __call__(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(nnx.Module):
    """LLaMA (``kind="llama"``), Qwen 2 (``"qwen2"``: q/k/v biases) or Qwen 3 (``"qwen3"``:
    q/k norms); with ``config.tie_word_embeddings`` the logits come from the embedding."""

    def __init__(self, config, kind="llama", *, rngs):
        self.model = Decoder(config, kind, rngs)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nnx.Linear(
                config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs
            )

    def __call__(self, ids):
        x = self.model(ids)
        return self.model.embed_tokens.attend(x) if self.tied else self.lm_head(x)


class Gpt2Block(nnx.Module):
    def __init__(self, c, rngs):
        e, eps = c.n_embd, c.layer_norm_epsilon
        self.ln_1 = nnx.LayerNorm(e, epsilon=eps, rngs=rngs)
        self.attn = nnx.Module()
        self.attn.c_attn = nnx.Linear(e, 3 * e, rngs=rngs)  # Conv1D: kernel (in, out)
        self.attn.c_proj = nnx.Linear(e, e, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(e, epsilon=eps, rngs=rngs)
        self.mlp = nnx.Module()
        self.mlp.c_fc = nnx.Linear(e, 4 * e, rngs=rngs)
        self.mlp.c_proj = nnx.Linear(4 * e, e, rngs=rngs)
        self.heads = c.n_head

    def __call__(self, x):
        b, t, e = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).reshape(b, t, 3, self.heads, e // self.heads)
        att = _attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, t, e)
        x = x + self.attn.c_proj(att)
        h = jax.nn.gelu(self.mlp.c_fc(self.ln_2(x)), approximate=True)
        return x + self.mlp.c_proj(h)


class Gpt2(nnx.Module):
    def __init__(self, c, rngs):
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(c.n_positions, c.n_embd, rngs=rngs)
        self.h = NnxList([Gpt2Block(c, rngs) for _ in range(c.n_layer)])
        self.ln_f = nnx.LayerNorm(c.n_embd, epsilon=c.layer_norm_epsilon, rngs=rngs)


class Gpt2LM(nnx.Module):
    """GPT-2 with its ``lm_head`` tied to ``wte``."""

    def __init__(self, config, *, rngs):
        self.transformer = Gpt2(config, rngs)

    def __call__(self, ids):
        tr = self.transformer
        x = tr.wte(ids) + tr.wpe(jnp.arange(ids.shape[1]))[None]
        for block in tr.h:
            x = block(x)
        return tr.wte.attend(tr.ln_f(x))


# The tiny test models' dimensions: width, layers, heads, vocabulary, positions.
TINY = (32, 2, 4, 96, 64)
_TINY_NAMES = {  # what each config class calls them
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
    "llama": (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
    ),
}


# Hugging Face architectures that the presets map without a JAX port in this file: preset
# name -> (transformers config class, its extra arguments). Token ids inside the vocabulary.
_OTHERS = {
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", {}),  # (fused qkv_proj and gate_up_proj)
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 4}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
        },
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    ),
}
OTHER_KINDS = tuple(_OTHERS)


def tiny_config(kind="llama", tied=False):
    """A tiny transformers config of ``kind`` (``llama``, ``qwen2``, ``qwen3``, ``gpt2`` or one
    of :data:`OTHER_KINDS`) built in code, no hub download; ``tied``: input and output
    embeddings shared (not GPT-2)."""
    import transformers

    if kind == "gpt2":
        sizes = dict(zip(_TINY_NAMES["gpt2"], TINY))
        return transformers.GPT2Config(**sizes, bos_token_id=0, eos_token_id=0)
    sizes = dict(zip(_TINY_NAMES["llama"], TINY))
    common = dict(sizes, intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=tied)
    if kind in _OTHERS:
        name, extra = _OTHERS[kind]
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return getattr(transformers, name)(**common, **ids, **extra)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def stacked_fused_rule(pattern, flax, sizes=None):
    """A transposed rule of ``pattern``'s ``{i}`` layers stacked on axis 0 and its ``{p}``
    parts fused on the last axis (``sizes``: the parts' sizes, default equal)."""
    import orbax_safetensors as osf

    return osf.Rule(pattern, flax, osf.Transpose(), stacked="i", fused="p", axis=-1, sizes=sizes)


def scanned_llama_mapping(head="head", out=None, qkv_sizes=(32, 16, 16)):
    """``tiny_config()``'s LLaMA in a scanned layout: layers stacked on axis 0, QKV and gate/up
    fused on the last axis. ``head``: the Flax name of the LM head; ``out``: the o_proj
    transform (default a transpose); ``qkv_sizes``: the fused QKV rule's ``sizes=``."""
    import orbax_safetensors as osf

    layer = "model.layers.{i}"
    transpose = osf.Transpose()
    return osf.KeyMapping(
        [
            osf.Rule("model.embed_tokens.weight", "embed"),
            stacked_fused_rule(
                layer + ".self_attn.{p:q_proj|k_proj|v_proj}.weight", "qkv", qkv_sizes
            ),
            osf.Rule(layer + ".self_attn.o_proj.weight", "out", out or transpose, stacked="i"),
            stacked_fused_rule(layer + ".mlp.{p:gate_proj|up_proj}.weight", "gate_up"),
            osf.Rule(layer + ".mlp.down_proj.weight", "down", transpose, stacked="i"),
            osf.Rule(layer + ".input_layernorm.weight", "attn_norm", stacked="i"),
            osf.Rule(layer + ".post_attention_layernorm.weight", "mlp_norm", stacked="i"),
            osf.Rule("model.norm.weight", "norm"),
            osf.Rule("lm_head.weight", head, transpose),
        ]
    )


def tiny_tokenizer():
    """A tiny fast tokenizer of :data:`TINY`'s vocabulary (``<pad>``, ``<s>``, ``</s>``,
    ``w3`` ... ``w95``, split on whitespace) with a chat template, built in code."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY[3])}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}<s>{{ m.content }}</s>{% endfor %}"
    return fast


def randomize_torch(model, seed):
    """Every parameter of a transformers ``model`` moved off its initial value (norms of ones
    or zeros, zero biases), so that a mapping that drops, swaps or mis-lays a tensor cannot
    round-trip the same logits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def scanned_llama_abstract(config, head="head"):
    """The abstract JAX tree (float32 ``jax.ShapeDtypeStruct`` s) that
    :func:`scanned_llama_mapping` loads a LLaMA ``config`` into; ``head``: the dotted name of
    the LM head."""
    e, f, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or e // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "embed": (config.vocab_size, e),
        "qkv": (n, e, q + 2 * kv),
        "out": (n, q, e),
        "gate_up": (n, e, 2 * f),
        "down": (n, f, e),
        "attn_norm": (n, e),
        "mlp_norm": (n, e),
        "norm": (e,),
    }
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    *parents, leaf = head.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = jax.ShapeDtypeStruct((e, config.vocab_size), jnp.float32)
    return tree
