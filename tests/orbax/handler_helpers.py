"""Shared helpers of the handler tests (tests/orbax/test_handler_*.py and the v1 tests): a
mesh, a state, managers, file offsets, whether Orbax's v1 API is installed."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh

from orbax_safetensors._src.compat import orbaxcompat

SCRIPTS = Path(__file__).parents[1] / "scripts"
OUR_FILES = {"model.safetensors", "orbax_safetensors.json"}
ORBAX_MARKERS = {"commit_success.txt"}  # Orbax's own per-item commit marker on local disks


HAS_V1 = (
    orbaxcompat.has_orbax_v1()
)  # the installed orbax-checkpoint has the v1 API this package uses
needs_v1 = pytest.mark.skipif(
    not HAS_V1, reason="this orbax-checkpoint lacks the v1 API (ocp.v1.save/load)"
)

# --------------------------------------------------------------------------- helpers


def mesh() -> Mesh:
    return devices.mesh((2, 4), ("x", "y"))


def state() -> dict[str, Any]:
    """A mixed tree: jax arrays of several dtypes, a numpy leaf, a list, Python scalars."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "params": {
            "dense": {
                "kernel": jax.random.normal(k1, (8, 16), jnp.float32),
                "bias": jax.random.normal(k2, (16,), jnp.float32).astype(jnp.bfloat16),
            },
        },
        "layers": [jnp.arange(6, dtype=jnp.int8).reshape(2, 3), jnp.array([True, False, True])],
        "host": np.linspace(0.0, 1.0, 10),
        "step": 7,
        "lr": 0.25,
    }


# The dotted names of every array leaf of state() (Python scalars are inline, not tensors).
STATE_TENSORS = {"params.dense.kernel", "params.dense.bias", "layers.0", "layers.1", "host"}


def abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def assert_same_values(got: Any, want: Any) -> None:
    """Same tree structure; every leaf equal in value and dtype."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, (jax.Array, np.ndarray)):
            assert np.asarray(g).dtype == np.asarray(w).dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        else:
            assert type(g) is type(w) and g == w


def item_dir(root: Path, step: int, item: str = "default") -> Path:
    return root / str(step) / item


def manager(root: Path, **kwargs: Any) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(root, **kwargs)


def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
    time.sleep(0.2)  # let the thread that made it true finish


def let_step_directory_creation_finish(root: Path, step: int) -> None:
    # Orbax starts creating the step directory in a background thread before it calls the
    # handler; after a save() that raised, let that finish, or interpreter exit races it and
    # hangs until Orbax's coordination timeout.
    # (Orbax < 0.12 adds a suffix to both names: "0.orbax-checkpoint-tmp-0/default...-1".)
    wait_until(
        lambda: any(root.glob(f"{step}.orbax-checkpoint-tmp*/default.orbax-checkpoint-tmp*"))
    )


def data_region(path: Path) -> tuple[int, int]:
    """(start, end) of a safetensors file's tensor bytes, from the standard 8-byte prefix."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, path.stat().st_size


def tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute byte range of every tensor, parsed from the header with plain json."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


# --------------------------------------------------------------------------- point 1: wiring
