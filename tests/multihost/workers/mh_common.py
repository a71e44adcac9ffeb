"""Deterministic global arrays for the multi-host checkpoint tests, shared by the workers and
the single-process checks in ``tests/multihost/test_multihost.py``.

Every tensor's value is a pure function of its name, shape, dtype and the save step, so any
process (a worker holding a few shards, or the test process with no ``jax.distributed``) can
recompute the global array and compare. JAX is imported lazily: the test process imports this
module to recompute values without starting a JAX job.

Example::

    expected = global_arrays(step=3)            # {name: np.ndarray}, every tensor, whole
    layout = sharded_layout(num_processes=2)    # {name: (mesh kind, partition spec)}
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# name -> (global shape, dtype, mesh kind, partition spec). Mesh kinds: "2d" = (N, 2) mesh with
# axes ("data", "model"); "1d" = (2N,) mesh with axis "x". ``None`` spec entries replicate.
SHARDED: dict[str, tuple[tuple[int, ...], Any, str, tuple[Any, ...]]] = {
    # fully sharded over both axes (replica_id == 0 everywhere)
    "params.emb": ((16, 12), np.float32, "2d", ("data", "model")),
    # partially replicated: split over "model", replicated over "data"
    "params.w_col": ((8, 10), np.float32, "2d", (None, "model")),
    # partially replicated the other way, bfloat16
    "params.w_row": ((32, 6), BF16, "2d", ("data", None)),
    # fully replicated
    "params.bias": ((10,), np.float32, "2d", ()),
    # 1-D mesh, sharded
    "opt.count_vec": ((64,), np.int32, "1d", ("x",)),
    # 1-D mesh, bfloat16, 2-D tensor split on rows
    "opt.mu": ((24, 8), BF16, "1d", ("x", None)),
    # 3-D tensor with a middle replicated dimension: strided runs on save and restore
    "opt.deep": ((4, 8, 4), np.float32, "2d", ("model", None, "data")),
    # large enough that partial reads are visibly smaller than the file: row blocks...
    "big.rows": ((128, 1024), np.float32, "2d", ("data", None)),
    # ...and column halves whose gaps (8 KiB per row) are wider than the coalescing gap
    "big.cols": ((32, 4096), np.float32, "2d", (None, "model")),
}

# Host-local leaves: written by the primary only, returned on every process.
HOST_NUMPY: dict[str, tuple[tuple[int, ...], Any]] = {
    "host.table": ((5, 3), np.float64),
    "host.flags": ((7,), np.int8),
}
# A jax.Array held whole by every process (on its first local device): host-local too.
HOST_JAX: dict[str, tuple[tuple[int, ...], Any]] = {"host.jax_local": ((6,), np.float32)}
SCALARS = {"step_count": 7, "lr": 0.125, "name": "mh-test"}


def scalars(step: int) -> dict[str, Any]:
    """The Python scalar leaves at ``step`` (stored inline in the schema)."""
    return {**SCALARS, "step_count": SCALARS["step_count"] + step}


def value(name: str, shape: tuple[int, ...], dtype: Any, step: int) -> np.ndarray:
    """The global value of tensor ``name`` at ``step`` (exact in every dtype used here)."""
    seed = sum(ord(c) for c in name) % 97
    n = int(np.prod(shape))
    raw = (np.arange(n, dtype=np.int64) * 7 + seed + 1000 * step) % 251 - 125
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        raw = raw.astype(np.float64) / 4.0  # exact in bfloat16 (8 significant bits) and up
    return raw.astype(dtype).reshape(shape)


def global_arrays(step: int) -> dict[str, np.ndarray]:
    """Every tensor (sharded and host-local numpy) at ``step``, whole, by dotted name."""
    out = {n: value(n, s, d, step) for n, (s, d, _, _) in SHARDED.items()}
    out.update({n: value(n, s, d, step) for n, (s, d) in HOST_NUMPY.items()})
    out.update({n: value(n, s, d, step) for n, (s, d) in HOST_JAX.items()})
    return out


def tensor_dtypes() -> dict[str, np.dtype]:
    out = {n: np.dtype(d) for n, (_, d, _, _) in SHARDED.items()}
    out.update({n: np.dtype(d) for n, (_, d) in HOST_NUMPY.items()})
    out.update({n: np.dtype(d) for n, (_, d) in HOST_JAX.items()})
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}`` (the inverse of the library's naming rule)."""
    out: dict[str, Any] = {}
    for name, v in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def flatten_dict(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_dict(v, name + "."))
        else:
            out[name] = v
    return out


# ----------------------------------------------------------------------------- JAX side


def meshes() -> dict[str, Any]:
    """The save meshes over this job's devices: ``"2d"`` (N, D) and ``"1d"`` (N*D,)."""
    import jax
    from jax.sharding import Mesh

    devices = np.array(jax.devices())
    n = jax.process_count()
    return {
        "2d": Mesh(devices.reshape(n, -1), ("data", "model")),
        "1d": Mesh(devices.reshape(-1), ("x",)),
    }


def save_shardings() -> dict[str, Any]:
    from jax.sharding import NamedSharding, PartitionSpec

    m = meshes()
    return {
        n: NamedSharding(m[kind], PartitionSpec(*spec)) for n, (_, _, kind, spec) in SHARDED.items()
    }


def build_state(step: int) -> dict[str, Any]:
    """The state to save at ``step``: global jax.Arrays built shard by shard (each process
    materialises only its own shards), host-local numpy arrays and Python scalars."""
    import jax

    values = global_arrays(step)
    shardings = save_shardings()
    flat: dict[str, Any] = {}
    for name, sharding in shardings.items():
        full = values[name]
        flat[name] = jax.make_array_from_callback(full.shape, sharding, lambda idx, f=full: f[idx])
    for name in HOST_NUMPY:
        flat[name] = values[name]
    for name in HOST_JAX:
        flat[name] = jax.device_put(values[name], jax.local_devices()[0])
    flat.update(scalars(step))
    return nest(flat)


def check_array(name: str, arr: Any, step: int) -> list[str]:
    """Problems (empty when fine) with a restored leaf against the global value at ``step``."""
    import jax

    shape, dtype = tensor_shape_dtype(name)
    expected = value(name, shape, dtype, step)
    problems = []
    if tuple(arr.shape) != shape or np.dtype(arr.dtype) != np.dtype(dtype):
        return [f"{name}: got {arr.dtype}{tuple(arr.shape)}, want {np.dtype(dtype)}{shape}"]
    if isinstance(arr, jax.Array):
        if not arr.addressable_shards:
            problems.append(f"{name}: no shard on this process's devices ({arr.sharding})")
        for s in arr.addressable_shards:
            if not np.array_equal(np.asarray(s.data), expected[s.index]):
                problems.append(f"{name}: shard {s.index} on {s.device} differs")
    elif not np.array_equal(np.asarray(arr), expected):
        problems.append(f"{name}: host value differs")
    return problems


def tensor_shape_dtype(name: str) -> tuple[tuple[int, ...], np.dtype]:
    if name in SHARDED:
        shape, dtype, _, _ = SHARDED[name]
    else:
        shape, dtype = {**HOST_NUMPY, **HOST_JAX}[name]
    return tuple(shape), np.dtype(dtype)
