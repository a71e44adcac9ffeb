"""The stacked layouts the multi-process stacked export test (``test_hf_stacked_multihost``)
exports, shared by the test process and its workers (issue 42 point 1): MaxText's experts
``(experts, L, emb, mlp)`` (layers on axis 1), a head-split query stacked on axis 1 (re-laid
out on the devices), norms ``(emb, L)``, Phi-3's fused per-layer ``qkv_proj`` from separate
stacked query/key kernels, and a PyTorch tensor stacking per-expert JAX kernels; each sharded
over the job's devices, stacked axes included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

L, X, E, M, H, D = 2, 4, 16, 8, 4, 4
T = osf.Transpose()
LAYER = "model.layers.{i}"
MOE = LAYER + ".block_sparse_moe"

MAPPING = osf.KeyMapping(
    [
        osf.Rule(MOE + ".experts.{e}.w1.weight", "moe.wi_0", T, stacked={"e": 0, "i": 1}),
        osf.Rule(MOE + ".experts.{e}.w2.weight", "moe.wo", T, stacked={"e": 0, "i": 1}),
        osf.Rule(LAYER + ".self_attn.q_proj.weight", "attn.query",
                 osf.Chain(T, osf.SplitHeads(head_dim=D)), stacked={"i": 1}),
        osf.Rule(LAYER + ".input_layernorm.weight", "norm", stacked={"i": 1}),
        osf.Rule(LAYER + ".phi.qkv_proj.weight", "phi.{p:query|key}", T, stacked={"i": 1},
                 fused="p", axis=0, sizes=(2 * M, M)),
        osf.Rule("experts.gate_up_proj", "experts.{e}.{p:gate|up}", T, stacked={"e": 0},
                 fused="p", axis=0),
    ]
)  # fmt: skip

SHAPES = {
    "moe.wi_0": (X, L, E, M),
    "moe.wo": (X, L, M, E),
    "attn.query": (E, L, H, D),
    "norm": (E, L),
    "phi.query": (E, L, 2 * M),
    "phi.key": (E, L, M),
    **{f"experts.{e}.{p}": (E, M) for e in range(X) for p in ("gate", "up")},
}

# Over a ("p", "l") mesh (processes, devices of a process).
SPECS: dict[str, Any] = {
    "moe.wi_0": P(None, None, None, ("p", "l")),  # mlp: the PyTorch weights' rows
    "moe.wo": P("p", "l"),  # experts over processes, layers over devices: stacked axes
    "attn.query": P(None, None, "p"),  # SplitHeads: re-laid out on the devices
    "norm": P(("p", "l")),
    "phi.query": P(None, "l", "p"),
    "phi.key": P("p"),  # emb: column stripes of the fused weight
    **{f"experts.{e}.{p}": P(None, "p") for e in range(X) for p in ("gate", "up")},
}

# name -> export_pytorch keyword arguments (the same in the test process and the workers)
EXPORTS: dict[str, dict[str, Any]] = {
    "f32_shards": {"max_file_size": 4_000},
    "bf16": {"dtype": "bfloat16"},
}


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
