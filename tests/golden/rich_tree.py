"""The rich tree whose saved schema JSON is kept in ``schema_rich*.json`` (a golden copy written
by the dict-based schema code, before the typed codec): saving it must give the same bytes."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

Point = namedtuple("Point", ["x", "y"])


@struct.dataclass
class Cfg:
    w: Any
    scale: float = struct.field(pytree_node=False, default=1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    a: Any
    b: Any


class Box:
    """A node registered without keys: its entries are flattened indices (``idx``)."""

    def __init__(self, *items: Any) -> None:
        self.items = items


jax.tree_util.register_pytree_node(Box, lambda b: (b.items, None), lambda _, c: Box(*c))


def rich_tree() -> Any:
    """A tree with every schema node kind: containers, custom nodes, NNX state and Variables,
    inline values, every array kind, a PRNG key, aliases and colliding names."""
    w = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    return {
        "layers": [{"w": w, "b": np.zeros(2, np.float16)}, {"w": jnp.ones(3, jnp.bfloat16)}],
        "head": w,  # tied: a ref
        "again": [w, w],
        "step": 10,
        "big": 2**80,
        "lr": 0.001,
        "floats": (float("nan"), float("inf"), float("-inf"), -0.0, 1.5),
        "flag": True,
        "name": "relu",
        "rng": jax.random.key(0),
        "rbg": jax.random.key(1, impl="rbg"),
        1: None,
        "1": np.float32(2.5),
        "a.b": np.int8(3),
        "a": {"b": np.ones(2, np.int32)},
        "__metadata__": np.zeros(1, np.uint8),
        "point": Point(np.ones(1, np.float32), None),
        "cfg": Cfg(np.ones(2, np.float64)),
        "pair": Pair([], {}),
        "empty": ((), [], {}),
        "opt": optax.adam(1e-3).init({"k": jnp.zeros(2)}),
        "masked": optax.MaskedNode(),
        "nnx": nnx.state(model),
        "var": nnx.Param(jnp.zeros(2)),
        "box": Box(np.ones(1, np.uint16), 7),
    }
