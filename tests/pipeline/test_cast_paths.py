"""Dtype policies store ``jnp.astype``'s bits through every save path (issue 25, point 5).

One tree holds a leaf per (source, target) pair of the dtypes JAX holds, with edge values
(NaN, +-inf, -0.0, max/min, out of range, subnormals, x.5) and one leaf large enough to take
the pooled-buffer cast; a callable policy maps each leaf to its target. ``save_file`` and a
``CheckpointManager`` (sync and async) store it; the stored bytes, read raw from the files,
must equal ``np.asarray(jnp.asarray(x).astype(target))`` bit for bit. The exhaustive
per-pair comparison is in ``tests/core/test_astype.py``.
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax_casts import EDGES as _EDGES
from jax_casts import OLD_JAX as _OLD_JAX
from jax_casts import bits, jax_dtypes, x64
from jax_casts import small_float as _small_float

import orbax_safetensors as osf
from orbax_safetensors._src.core import dtypes as _dtypes

_TARGETS = ["int8", "uint8", "int32", "uint32", "int64", "bool", "float16", "bfloat16",
            "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float32"]  # fmt: skip


def _values(dt: np.dtype) -> np.ndarray:
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([0, 1, -1 % (info.max + 1) if info.min == 0 else -1, info.max, info.min,
                         info.max // 3], dt)  # fmt: skip
    if dt == np.bool_:
        return np.array([True, False])
    with np.errstate(all="ignore"):
        real = np.array(_EDGES, np.float64).astype(np.float32 if dt.kind == "c" else dt)
    return real.astype(dt) if dt.kind == "c" else real


@functools.cache
def _tree_and_expected() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    tree: dict = {}
    want: dict = {}
    for src in jax_dtypes():
        for name in _TARGETS:
            dst = _dtypes.to_numpy(_dtypes.from_numpy(np.dtype(getattr(jnp, name))))
            if src == dst or src.kind == "c":
                continue
            if _OLD_JAX and (_small_float(src) or _small_float(dst)):
                continue  # see test_astype
            key = f"{src}__{name}"
            x = _values(src)
            if x.size % 2:
                x = np.concatenate([x, x[:1]])  # float4 tensors fill whole bytes
            tree[key] = x
            want[key] = (x, dst)
    with x64():  # one compiled function for all references
        outs = jax.jit(lambda xs: {k: v.astype(want[k][1]) for k, v in xs.items()})(
            {k: jnp.asarray(x) for k, (x, _) in want.items()}
        )
        want = {k: np.asarray(v) for k, v in outs.items()}
    rng = np.random.default_rng(0)  # large: cast into pooled buffers, in several chunks
    big = (rng.standard_normal(300_000) * 300).astype(np.float32)
    big[::7] = np.nan
    big[::11] = np.inf
    tree["big__int8"] = big
    tree["big_device__uint8"] = jnp.asarray(big)  # a jax.Array: the device-copy path
    with x64():
        want["big__int8"] = np.asarray(jnp.asarray(big).astype(jnp.int8))
        want["big_device__uint8"] = np.asarray(jnp.asarray(big).astype(jnp.uint8))
    return tree, want


def _policy(name: str, leaf: object) -> str:
    return name.rsplit("__", 1)[1]


def _raw_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in ``directory``, read from the bytes."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            raw = np.frombuffer(data, np.uint8, end - begin, 8 + n + begin)
            out[name] = _dtypes.unpack(raw, info["dtype"], info["shape"])
    return out


def _check(stored: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(want) <= set(stored)
    for key, expected in want.items():
        got = stored[key]
        assert got.dtype == expected.dtype, key
        same = bits(got).reshape(got.size, -1) == bits(expected).reshape(got.size, -1)
        bad = np.flatnonzero(~same.all(axis=1))
        assert bad.size == 0, (key, [(got[i], expected[i]) for i in bad[:6]])


def test_save_file_stores_jax_casts(tmp_path: Path) -> None:
    tree, want = _tree_and_expected()
    osf.save_file(tree, tmp_path / "m.safetensors", dtype=_policy)
    _check(_raw_tensors(tmp_path), want)


def test_issue_example_int8(tmp_path: Path) -> None:
    x = jnp.asarray([300, -1, np.nan, np.inf, 255.5, 1e10], jnp.float32)
    osf.save_file({"x": x, "n": np.array([np.nan])}, tmp_path / "m.safetensors",
                  dtype={"x": jnp.int8, "n": jnp.int32})  # fmt: skip
    stored = _raw_tensors(tmp_path)
    assert stored["x"].tolist() == [127, -1, 0, 127, 127, 127]
    assert stored["n"].tolist() == [0]


@pytest.mark.parametrize("async_enabled", [False, True])
def test_manager_stores_jax_casts(tmp_path: Path, async_enabled: bool) -> None:
    tree, want = _tree_and_expected()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(tree, dtype=_policy))
        mngr.wait_until_finished()
    item = next(p for p in (tmp_path / "0").rglob("*.safetensors")).parent
    _check(_raw_tensors(item), want)


# --------------------------------------------------------------------------- restore-time casts


@pytest.mark.parametrize("how", ["load_file", "restore_directory", "manager"])
def test_restore_onto_another_dtype_gives_jax_casts(tmp_path: Path, how: str) -> None:
    # Saved as they are, restored onto targets of the other dtype: the same bits as the
    # save-time cast (jax's), not numpy's platform-defined out-of-range float -> int.
    tree, want = _tree_and_expected()
    target = {k: np.zeros(v.shape, v.dtype) for k, v in want.items()}
    if how == "load_file":
        osf.save_file(tree, tmp_path / "m.safetensors")
        got = osf.load_file(tmp_path / "m.safetensors", target=target)
    elif how == "restore_directory":
        osf.save_directory(tree, tmp_path / "d")
        got = osf.restore_directory(tmp_path / "d", target)
    else:
        with ocp.CheckpointManager(tmp_path / "m") as mngr:
            mngr.save(0, args=osf.SafetensorsSave(tree))
            mngr.wait_until_finished()
            got = mngr.restore(0, args=osf.SafetensorsRestore(target))
    _check({k: np.asarray(v) for k, v in got.items()}, want)
