"""LoRA adapters trained to non-zero values, for the export tests: flax's ``nnx.LoRA`` and
``nnx.LoRALinear`` start with ``lora_b`` zero (a no-op), as qwix's adapters do, so a test
that exported untrained adapters could not tell a merge from a drop.

qwix (``pip install --no-deps qwix opt_einsum``, as ``.ci/run`` installs it) is imported
through :func:`qwix_or_skip`, inside a test or fixture: where it is absent, does not import,
or this flax is older than qwix requires (flax 0.12: CI's older stacks), the test skips naming
why.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optional_deps  # (tests/ is on sys.path)
import pytest
from flax import nnx
from packaging.requirements import Requirement

QWIX_INSTALL = "pip install --no-deps qwix opt_einsum"


def qwix_or_skip() -> ModuleType:
    """``qwix``, or a skip naming why it is not there: not installed, not importable, or this
    flax older than qwix requires (qwix 0.1.8 imports on flax 0.11 but cannot apply LoRA)."""
    import flax

    try:
        import qwix
    except ImportError as e:
        if getattr(e, "name", None) == "qwix":
            optional_deps.missing("qwix", QWIX_INSTALL)
        pytest.skip(
            f"qwix does not import with jax {jax.__version__}, flax {flax.__version__}: {e}"
        )
    for requirement in map(Requirement, importlib.metadata.requires("qwix") or []):
        if requirement.name == "flax" and flax.__version__ not in requirement.specifier:
            pytest.skip(f"qwix needs {requirement}, this is flax {flax.__version__}")
    return qwix


def train_adapters(
    model: nnx.Module, logits: Callable[[nnx.Module], Any], *, steps: int = 3, lr: float = 0.05
) -> None:
    """A few steps of gradient descent on ``model``'s ``nnx.LoRAParam`` s alone (the base
    weights frozen, as LoRA trains), towards predicting token 3 everywhere; checks that every
    adapter then holds non-zero values."""
    diff = nnx.DiffState(0, nnx.LoRAParam)

    def loss(m: nnx.Module) -> jax.Array:
        return -jnp.mean(jax.nn.log_softmax(logits(m).astype(jnp.float32))[..., 3])

    grad = nnx.jit(nnx.grad(loss, argnums=diff))  # (compiled once: eager steps are slow)
    for _ in range(steps):
        grads = grad(model)
        state = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, state, grads))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = np.asarray(var.value if not hasattr(type(var), "get_value") else var.get_value())
        assert np.abs(value).max() > 0, f"adapter {path} is still zero"
