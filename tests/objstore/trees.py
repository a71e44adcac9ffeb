"""The sample tree of the object-storage tests, its comparison, and the official reader's view
of a downloaded file.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

MiB = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)


def official_tensors(raw: bytes) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file read by the official reader (bfloat16 -> float32)."""
    import safetensors.torch  # (here: the object-store tests run where PyTorch is installed)
    import torch

    out = {}
    for name, t in safetensors.torch.load(raw).items():
        out[name] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


def as_comparable(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == BF16 else x


def sample_tree(big_rows: int = 1024) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": rng.standard_normal((big_rows, 4096)).astype(np.float32),
            "b": jnp.arange(300, dtype=jnp.bfloat16),
            "emb": jnp.asarray(rng.integers(-5, 5, (64, 32)), jnp.int8),
        },
        "step": 7,
        "name": "run",
    }


def check_tree(got: Any, expected: dict[str, Any]) -> None:
    for leaf_got, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        if isinstance(leaf_want, (int, str)):
            assert leaf_got == leaf_want
        else:
            np.testing.assert_array_equal(as_comparable(leaf_got), as_comparable(leaf_want))
