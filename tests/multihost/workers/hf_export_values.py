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
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

try:  # imported from tests/ (on sys.path under pytest)
    import hf_models
except ImportError:  # a worker process: tests/ is two folders up
    sys.path.append(str(Path(__file__).resolve().parents[2]))
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
