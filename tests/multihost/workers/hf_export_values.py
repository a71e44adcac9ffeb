"""The scanned tiny LLaMA that the multi-process export test (``test_hf_export_multihost``)
exports, shared by the test process and its workers: the mapping (stacked layers, fused QKV
and gate/up, a head-split output projection that is re-laid-out on the devices), the export
arguments (the config is the test's ``LlamaConfig`` as a dict), and how each tensor is sharded over the job's devices.

Shapes: L=2 layers, E=32, 4 heads and 2 key/value heads of 8, F=64, V=96.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

try:  # imported from tests/ (on sys.path under pytest)
    import hf_models
except ImportError:  # a worker process: tests/helpers/ is beside tests/multihost/
    sys.path.append(str(Path(__file__).resolve().parents[2] / "helpers"))
    import hf_models

L, E, H, KV_HEADS, D, F, V = 2, 32, 4, 2, 8, 64, 96
Q, KV = H * D, KV_HEADS * D

SHAPES = {
    "embed": (V, E),
    "qkv": (L, E, Q + 2 * KV),
    "out": (L, H, D, E),  # heads split: SplitHeads does not commute with a box
    "gate_up": (L, E, 2 * F),
    "down": (L, F, E),
    "attn_norm": (L, E),
    "mlp_norm": (L, E),
    "norm": (E,),
    "head": (E, V),
}

# Over a ("p", "l") mesh (processes, devices of a process); None: a host-local numpy leaf.
SPECS: dict[str, Any] = {
    "embed": P(("p", "l")),  # leading rows: one contiguous range per process
    "qkv": P(None, "p", "l"),  # E across processes: strided runs, fused parts cut
    "out": P(None, "p"),
    "gate_up": P(None, None, ("p", "l")),  # the fused gate/up boundary inside a shard
    "down": P(None, ("p", "l")),
    "attn_norm": P(),  # replicated: written once, by the holder of replica 0
    "mlp_norm": P(None, "p"),
    "norm": None,
    "head": P("p", "l"),
}

# The output projection split by heads: SplitHeads does not commute with a box.
MAPPING = hf_models.scanned_llama_mapping(out=osf.Chain(osf.Transpose(), osf.SplitHeads(H, 0)))

# name -> export_pytorch keyword arguments (the same in the test process and the workers)
EXPORTS: dict[str, dict[str, Any]] = {
    "f32_shards": {"max_file_size": 40_000},
    "bf16": {"dtype": {"*norm*": "keep", "*": jnp.bfloat16}},
}


def scanned_weights(model: Any) -> dict[str, np.ndarray]:
    """The weights of ``hf_models.CausalLM`` ``model`` in this module's scanned layout."""
    m = model.model
    layers = list(m.layers)

    def stack(f):
        return np.stack([np.asarray(f(x)) for x in layers])

    def kernel(lin):
        return np.asarray(lin.kernel[...])

    return {
        "embed": np.asarray(m.embed_tokens.embedding[...]),
        "qkv": stack(
            lambda x: np.concatenate(
                [
                    kernel(x.self_attn.q_proj),
                    kernel(x.self_attn.k_proj),
                    kernel(x.self_attn.v_proj),
                ],
                axis=-1,
            )
        ),
        "out": stack(lambda x: kernel(x.self_attn.o_proj).reshape(H, D, E)),
        "gate_up": stack(
            lambda x: np.concatenate([kernel(x.mlp.gate_proj), kernel(x.mlp.up_proj)], axis=-1)
        ),
        "down": stack(lambda x: kernel(x.mlp.down_proj)),
        "attn_norm": stack(lambda x: x.input_layernorm.scale[...]),
        "mlp_norm": stack(lambda x: x.post_attention_layernorm.scale[...]),
        "norm": np.asarray(m.norm.scale[...]),
        "head": kernel(model.lm_head),
    }


# The servable item of the publish test (test_hf_publish_multihost): the same model with a
# LoRA adapter of rank 2 on the LM head ({"head": {"kernel", "lora": {"lora_a", "lora_b"}}}),
# merged into lm_head.weight as the item is written.
RANK, LORA_SCALE = 2, 0.5


# Shardings of a servable item restored in the workers (others than the save's): each process
# reads the byte ranges of its shards. ``P`` is jax.sharding.PartitionSpec.
def restore_specs() -> dict[str, Any]:
    from jax.sharding import PartitionSpec as P

    return {
        "embed": P(None, ("p", "l")),
        "qkv": P(None, "p", "l"),
        "out": P(None, None, None, "p"),
        "gate_up": P(None, "p"),
        "down": P(None, None, ("p", "l")),
        "attn_norm": P(None, "p"),
        "mlp_norm": P(),
        "norm": P(),
        "head": P(None, ("p", "l")),
    }


PUBLISH_MAPPING = osf.KeyMapping(
    hf_models.scanned_llama_mapping(
        head="head.kernel", out=osf.Chain(osf.Transpose(), osf.SplitHeads(H, 0))
    ).rules,
    lora_scale=LORA_SCALE,
)
LORA_SPECS: dict[str, Any] = {
    "lora_a": P("p"),  # (E, RANK): rows across processes
    "lora_b": P(None, "l"),  # (RANK, V): columns across each process's devices
}


def sharded_tree(weights: dict[str, np.ndarray], mesh: Any) -> dict[str, Any]:
    """The publish test's item: ``weights`` (with ``lora_a`` / ``lora_b``) as global arrays
    over ``mesh`` (``("p", "l")``) by :data:`SPECS` and :data:`LORA_SPECS` (``norm``: a
    host-local numpy leaf)."""
    import jax
    from jax.sharding import NamedSharding

    def put(value: np.ndarray, spec: Any) -> Any:
        if spec is None:
            return value
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])

    tree: dict[str, Any] = {n: put(weights[n], s) for n, s in SPECS.items() if n != "head"}
    lora = {n: put(weights[n], s) for n, s in LORA_SPECS.items()}
    tree["head"] = {"kernel": put(weights["head"], SPECS["head"]), "lora": lora}
    return tree


# A LoRA kernel whose rule does not commute with a box (a reshape): re-laid-out on the
# devices after a shard-by-shard merge; beside it a stacked, transposed tensor mapped shard by
# shard. Item: {"x": {"kernel": (E, V), "lora": {...}}, "down": (L, F, E)}.
RESHAPE_MAPPING = osf.KeyMapping(
    [
        osf.Rule("x.weight", "x.kernel", osf.Reshape((E, V), (E * V,))),
        osf.Rule("d.{i}.weight", "down", osf.Transpose(), stacked="i"),
    ],
    lora_scale=LORA_SCALE,
)


def reshape_item(weights: dict[str, np.ndarray], mesh: Any = None) -> dict[str, Any]:
    """The item of :data:`RESHAPE_MAPPING` from ``weights`` (sharded over ``mesh`` as the
    publish item's head and ``down``, or numpy without one)."""
    if mesh is not None:
        tree = sharded_tree(weights, mesh)
        return {"x": tree["head"], "down": tree["down"]}
    lora = {"lora_a": weights["lora_a"], "lora_b": weights["lora_b"]}
    return {"x": {"kernel": weights["head"], "lora": lora}, "down": weights["down"]}
