"""MaxText's parameter layout, written out here from the facts of MaxText 0.2.5's own
conversion (``maxtext/checkpoint_conversion/utils/param_mapping.py``: its
``*_MAXTEXT_TO_HF_PARAM_MAPPING`` names and ``*_PARAM_HOOK_FN`` value hooks; the stacking of
``to_maxtext.py``), independently of the library's presets: the tests' reference in both
directions.

- :func:`tiny_model`: a random tiny transformers model of each kind (two layers), built offline;
- :func:`to_maxtext`: its state dict as MaxText's ``params`` tree (``{"decoder": ...,
  "token_embedder": ...}``), scanned (layers on axis 1) or not (``layers_{i}``);
- :func:`to_hf`: a ``params`` tree back as Hugging Face tensors, as MaxText's
  ``to_huggingface.py`` writes them (hooks per layer and expert slice, then the dtype).

The facts, per layer (``E`` width, ``H``/``K`` query/key-value heads, ``D`` head_dim, ``M`` MLP
width, ``X`` experts, ``L`` layers; scanned tensors get ``L`` at axis 1, after the experts' axis):

- query ``(E, H, D)`` = ``q_proj.weight.T`` split in heads; key/value ``(E, K, D)``; out
  ``(H, D, E)`` = ``o_proj.weight.T`` split; norms ``(E,)``; ``wi_0``/``wi_1`` ``(E, M)`` =
  gate/up ``.T``; ``wo`` ``(M, E)`` = down ``.T``; Qwen 3's ``query_norm``/``key_norm`` ``(D,)``;
- MoE: gate ``(E, X)`` = router ``.T``; experts ``(X, E, M)`` / ``(X, M, E)``, each expert's
  projection ``.T`` (Mixtral ``MoeBlock_0`` from ``block_sparse_moe.experts.{e}.w1/w3/w2``,
  Qwen 3 MoE ``moe_block`` from ``mlp.experts.{e}.gate_proj/up_proj/down_proj``);
- LLaMA 3.1: query and key interleaved for RoPE (``out[2k] = in[k]``, ``out[2k + 1] = in[k +
  D/2]``); LLaMA, Mistral, Mixtral: query times ``float32(1/sqrt(D))`` in float32, rounded to
  the dtype (out: times ``float32(sqrt(D))``); Qwen 3: neither;
- embedding ``(V, E)``, ``logits_dense`` ``(E, V)`` (none when tied), both zero-padded past
  the config's vocabulary ``V`` (cut on the way out).
"""

from __future__ import annotations

import numpy as np

KINDS = ("llama3", "mistral", "mixtral", "qwen3", "qwen3-moe")
SCALED = ("llama3", "mistral", "mixtral")  # the query carries 1/sqrt(head_dim)
MOE = {"mixtral": "MoeBlock_0", "qwen3-moe": "moe_block"}  # MaxText's MoE block
# the Hugging Face module of the experts, and their gate, up and down weights
HF_MOE = {
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
    "qwen3-moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
}


def _experts(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def tiny_config(kind: str, *, tied: bool = False, head_dim: int | None = None):
    """A tiny transformers config of ``kind`` (two layers), built in code: LLaMA with head_dim
    8 (a query scale that does not round trip), Mistral and Mixtral with 16 (one that does;
    Mixtral's width is heads * head_dim, as MaxText's Mixtral hooks assume), Qwen 3 with 8 and
    Qwen 3 MoE with 16 (wider than the model)."""
    import transformers

    cls, heads, kv_heads, default_head_dim, extra = _CONFIGS[kind]
    return getattr(transformers, cls)(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or default_head_dim,
        vocab_size=96,
        intermediate_size=48,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        **extra,
    )


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_MOE_SIZES = {"num_experts_per_tok": 2}
# kind: (transformers config class, heads, key/value heads, head_dim, other settings)
_CONFIGS = {
    "llama3": ("LlamaConfig", 4, 2, 8, {"rope_parameters": _LLAMA3_ROPE}),
    "mistral": ("MistralConfig", 2, 1, 16, {"sliding_window": None}),
    "mixtral": (
        "MixtralConfig",
        2,
        1,
        16,
        {"sliding_window": None, "num_local_experts": 4, **_MOE_SIZES},
    ),
    "qwen3": ("Qwen3Config", 4, 2, 8, {}),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        4,
        2,
        16,
        {
            "moe_intermediate_size": 24,
            "num_experts": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            **_MOE_SIZES,
        },
    ),
}


def tiny_model(kind: str, *, tied: bool = False, seed: int = 0, head_dim: int | None = None):
    """A random tiny transformers causal LM of ``kind`` (float32, eval mode), its norms random
    too (their ones would hide a swapped norm)."""
    import torch
    import transformers

    classes = {
        "llama3": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3-moe": transformers.Qwen3MoeForCausalLM,
    }
    torch.manual_seed(seed)
    model = classes[kind](tiny_config(kind, tied=tied, head_dim=head_dim)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def hf_tensors(directory) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory, by key (as ``save_pretrained`` writes it)."""
    from pathlib import Path

    import safetensors.numpy

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(str(f)))
    return out


# --------------------------------------------------------------------------- the two hooks


def _interleave(x: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    order = np.empty(d, int)
    order[0::2] = np.arange(d // 2)
    order[1::2] = np.arange(d // 2) + d // 2
    return x[..., order]


def _halves(x: np.ndarray) -> np.ndarray:
    d = x.shape[-1]
    return x[..., np.r_[0:d:2, 1:d:2]]


def _times(x: np.ndarray, factor: float) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


# --------------------------------------------------------------------------- HF -> MaxText


def _dims(config):
    heads = config.num_attention_heads
    return config.hidden_size, heads, config.num_key_value_heads, config.head_dim


def _layer(kind: str, sd: dict, i: int, config) -> dict:
    e, h, k, d = _dims(config)
    p = f"model.layers.{i}."
    q = sd[p + "self_attn.q_proj.weight"].T.reshape(e, h, d)
    key = sd[p + "self_attn.k_proj.weight"].T.reshape(e, k, d)
    if kind == "llama3":
        q, key = _interleave(q), _interleave(key)
    if kind in SCALED:
        q = _times(q, 1 / np.sqrt(d))
    attention = {
        "query": {"kernel": q},
        "key": {"kernel": key},
        "value": {"kernel": sd[p + "self_attn.v_proj.weight"].T.reshape(e, k, d)},
        "out": {"kernel": sd[p + "self_attn.o_proj.weight"].T.reshape(h, d, e)},
    }
    if kind.startswith("qwen3"):
        attention["query_norm"] = {"scale": sd[p + "self_attn.q_norm.weight"]}
        attention["key_norm"] = {"scale": sd[p + "self_attn.k_norm.weight"]}
    layer = {
        "self_attention": attention,
        "pre_self_attention_layer_norm": {"scale": sd[p + "input_layernorm.weight"]},
        "post_self_attention_layer_norm": {"scale": sd[p + "post_attention_layernorm.weight"]},
    }
    if kind in MOE:
        hf_moe, (gate, up, down) = HF_MOE[kind]
        experts = [
            {w: sd[f"{p}{hf_moe}experts.{x}.{w}.weight"].T for w in (gate, up, down)}
            for x in range(_experts(config))
        ]
        layer[MOE[kind]] = {
            "gate": {"kernel": sd[f"{p}{hf_moe}gate.weight"].T},
            "wi_0": np.stack([x[gate] for x in experts]),
            "wi_1": np.stack([x[up] for x in experts]),
            "wo": np.stack([x[down] for x in experts]),
        }
    else:
        layer["mlp"] = {
            "wi_0": {"kernel": sd[p + "mlp.gate_proj.weight"].T},
            "wi_1": {"kernel": sd[p + "mlp.up_proj.weight"].T},
            "wo": {"kernel": sd[p + "mlp.down_proj.weight"].T},
        }
    return layer


def _map_leaves(fn, *trees):
    first = trees[0]
    if isinstance(first, dict):
        return {k: _map_leaves(fn, *(t[k] for t in trees)) for k in first}
    return fn(*trees)


def _pad_rows(x: np.ndarray, rows: int, axis: int) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, rows - x.shape[axis])
    return np.pad(x, widths)


def to_maxtext(
    kind: str, sd: dict, config, *, scan_layers: bool, vocab: int | None = None, dtype=None
) -> dict:
    """MaxText's ``params`` tree (the ``params`` collection's content: ``decoder`` and
    ``token_embedder``) of a Hugging Face state dict ``sd`` (numpy, by key), the layers
    stacked on axis 1 with ``scan_layers`` (else ``layers_{i}``), the vocabulary padded to
    ``vocab`` rows, every leaf then cast to ``dtype`` (MaxText's ``weight_dtype``: its
    ``to_maxtext.py`` casts after the hooks)."""
    vocab = vocab or config.vocab_size
    layers = [_layer(kind, sd, i, config) for i in range(config.num_hidden_layers)]
    decoder: dict = {"decoder_norm": {"scale": sd["model.norm.weight"]}}
    if scan_layers:
        decoder["layers"] = _map_leaves(lambda *xs: np.stack(xs, axis=1), *layers)
    else:
        decoder.update({f"layers_{i}": layer for i, layer in enumerate(layers)})
    if not config.tie_word_embeddings:
        decoder["logits_dense"] = {"kernel": _pad_rows(sd["lm_head.weight"].T, vocab, 1)}
    embedding = _pad_rows(sd["model.embed_tokens.weight"], vocab, 0)
    params = {"decoder": decoder, "token_embedder": {"embedding": embedding}}
    return params if dtype is None else _map_leaves(lambda x: x.astype(dtype), params)


# --------------------------------------------------------------------------- MaxText -> HF


def _layer_to_hf(kind: str, layer: dict, i: int, config, out: dict) -> None:
    e, h, k, d = _dims(config)
    p = f"model.layers.{i}."
    att = layer["self_attention"]
    q, key = att["query"]["kernel"], att["key"]["kernel"]
    if kind in SCALED:
        q = _times(q, np.sqrt(d))
    if kind == "llama3":
        q, key = _halves(q), _halves(key)
    out[p + "self_attn.q_proj.weight"] = q.reshape(e, h * d).T
    out[p + "self_attn.k_proj.weight"] = key.reshape(e, k * d).T
    out[p + "self_attn.v_proj.weight"] = att["value"]["kernel"].reshape(e, k * d).T
    out[p + "self_attn.o_proj.weight"] = att["out"]["kernel"].reshape(h * d, e).T
    if kind.startswith("qwen3"):
        out[p + "self_attn.q_norm.weight"] = att["query_norm"]["scale"]
        out[p + "self_attn.k_norm.weight"] = att["key_norm"]["scale"]
    out[p + "input_layernorm.weight"] = layer["pre_self_attention_layer_norm"]["scale"]
    out[p + "post_attention_layernorm.weight"] = layer["post_self_attention_layer_norm"]["scale"]
    if kind in MOE:
        hf_moe, names = HF_MOE[kind]
        moe = layer[MOE[kind]]
        out[f"{p}{hf_moe}gate.weight"] = moe["gate"]["kernel"].T
        for x in range(moe["wi_0"].shape[0]):
            for ours, theirs in zip(("wi_0", "wi_1", "wo"), names):
                out[f"{p}{hf_moe}experts.{x}.{theirs}.weight"] = moe[ours][x].T
    else:
        mlp = layer["mlp"]
        out[p + "mlp.gate_proj.weight"] = mlp["wi_0"]["kernel"].T
        out[p + "mlp.up_proj.weight"] = mlp["wi_1"]["kernel"].T
        out[p + "mlp.down_proj.weight"] = mlp["wo"]["kernel"].T


def to_hf(kind: str, params: dict, config, *, dtype=None) -> dict[str, np.ndarray]:
    """The Hugging Face tensors MaxText's conversion writes from ``params`` (scanned or not):
    each layer's (and expert's) slice through the hooks, then cast to ``dtype`` (MaxText's
    ``weight_dtype``; default: as stored), contiguous."""
    decoder = params["decoder"]
    n = config.num_hidden_layers
    if "layers" in decoder:
        layers = [
            _map_leaves(lambda x, i=i: np.take(x, i, axis=1), decoder["layers"]) for i in range(n)
        ]
    else:
        layers = [decoder[f"layers_{i}"] for i in range(n)]
    out: dict[str, np.ndarray] = {}
    for i, layer in enumerate(layers):
        _layer_to_hf(kind, layer, i, config, out)
    vocab = config.vocab_size
    out["model.norm.weight"] = decoder["decoder_norm"]["scale"]
    out["model.embed_tokens.weight"] = params["token_embedder"]["embedding"][:vocab]
    if "logits_dense" in decoder:
        out["lm_head.weight"] = decoder["logits_dense"]["kernel"][:, :vocab].T
    return {
        k: np.ascontiguousarray(v if dtype is None else np.asarray(v).astype(dtype))
        for k, v in out.items()
    }
