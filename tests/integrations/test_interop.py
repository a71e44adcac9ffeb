"""Our files read by other tools: the official safetensors package (numpy, flax, torch back ends).

Every check here reads with the other tool only; nothing goes through this library's reader.
"""

from __future__ import annotations

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file

try:
    import torch
    from safetensors.torch import load_file as torch_load_file
except ImportError:  # the supported-stack venvs of .ci/matrix have no PyTorch
    torch = None

import official_reader

import orbax_safetensors as osf

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch (in the main environment)")


def _values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
    values = rng.standard_normal(n) * 3
    values[: min(n, 3)] = [np.inf, -np.inf, np.nan][: min(n, 3)] if dtype.itemsize > 1 else 0
    return values.astype(dtype).reshape(shape)


NUMPY_READABLE = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.bfloat16,
]
# safetensors.numpy maps F8_* to np.float8_* attributes numpy does not have, and F4/F6 are
# sub-byte: those are read through torch below.
TORCH_ONLY = [
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e8m0fnu,
]


@pytest.fixture
def nested(tmp_path):
    tree = {
        "params": {
            "layers": [
                {
                    "kernel": _values(np.dtype(np.float32), (4, 3), i),
                    "bias": _values(np.dtype(np.float32), (3,), 10 + i),
                }
                for i in range(2)
            ],
            "embed": jnp.asarray(_values(np.dtype(ml_dtypes.bfloat16), (5, 4), 20)),
        },
        "opt": ({"count": np.int32(3)}, None),
        "step": 7,
        "dtypes": {
            np.dtype(dt).name: _values(np.dtype(dt), (2, 3), k)
            for k, dt in enumerate(NUMPY_READABLE)
            if official_reader.reads_numpy(dt)  # (safetensors 0.4.5 has no C64)
        },
    }
    path = tmp_path / "nested.safetensors"
    osf.save_file(tree, path, metadata={"run": "interop"})
    expected = {
        "params.layers.0.kernel": tree["params"]["layers"][0]["kernel"],
        "params.layers.0.bias": tree["params"]["layers"][0]["bias"],
        "params.layers.1.kernel": tree["params"]["layers"][1]["kernel"],
        "params.layers.1.bias": tree["params"]["layers"][1]["bias"],
        "params.embed": np.asarray(tree["params"]["embed"]),
        "opt.0.count": np.asarray(tree["opt"][0]["count"]),
        **{f"dtypes.{k}": v for k, v in tree["dtypes"].items()},
    }
    return path, expected


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_safe_open_numpy_reads_dotted_names_with_identical_values(nested):
    path, expected = nested
    with safe_open(path, "numpy") as f:
        assert set(f.keys()) == set(expected)
        for name, value in expected.items():
            _same_bits(f.get_tensor(name), value)
        meta = f.metadata()
    assert meta["format"] == "flax"
    assert meta["run"] == "interop"


def test_safe_open_flax_reads_jax_arrays_incl_bfloat16(nested):
    path, expected = nested
    with safe_open(path, "flax") as f:
        assert set(f.keys()) == set(expected)
        for name, value in expected.items():
            if value.dtype in (np.uint64, np.int64, np.float64):
                continue  # jax without x64 narrows these on its own; checked via numpy above
            t = f.get_tensor(name)
            assert isinstance(t, jax.Array)
            _same_bits(np.asarray(t), value)
        assert f.get_tensor("params.embed").dtype == jnp.bfloat16


def test_safetensors_numpy_load_file(nested):
    path, expected = nested
    loaded = np_load_file(str(path))
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        _same_bits(loaded[name], value)


def _torch_as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype.is_floating_point:
        return t.to(torch.float32).numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return (
            t.view(getattr(torch, f"int{t.element_size() * 8}"))
            .numpy()
            .view(f"u{t.element_size()}")
        )
    return t.numpy()


def _as_expected(value: np.ndarray) -> np.ndarray:
    if (
        value.dtype.kind == "f"
        or value.dtype in (np.dtype(ml_dtypes.bfloat16),)
        or value.dtype.name.startswith("float8")
    ):
        return value.astype(np.float32)
    return value


@needs_torch
def test_torch_load_file_reads_every_tensor_incl_bfloat16(nested):
    path, expected = nested
    loaded = torch_load_file(str(path))
    assert set(loaded) == set(expected)
    assert loaded["params.embed"].dtype == torch.bfloat16
    for name, value in expected.items():
        got = _torch_as_numpy(loaded[name])
        np.testing.assert_array_equal(got, _as_expected(value), err_msg=name)


@needs_torch
@pytest.mark.parametrize("dtype", TORCH_ONLY, ids=lambda d: np.dtype(d).name)
def test_torch_reads_float8_values(tmp_path, dtype):
    value = _values(np.dtype(dtype), (3, 5), 4)
    if np.dtype(dtype) == np.dtype(ml_dtypes.float8_e8m0fnu):
        value = np.exp2(np.arange(-7, 8, dtype=np.float32)).reshape(3, 5).astype(dtype)
    path = tmp_path / "f8.safetensors"
    osf.save_file({"group": [value]}, path)
    loaded = torch_load_file(str(path))
    assert list(loaded) == ["group.0"]
    np.testing.assert_array_equal(
        loaded["group.0"].to(torch.float32).numpy(), value.astype(np.float32)
    )


@needs_torch
def test_sharded_jax_array_is_one_plain_tensor_for_other_readers(tmp_path):
    mesh = devices.mesh((4, 2), ("x", "y"))
    value = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    tree = {
        "row": jax.device_put(value, NamedSharding(mesh, PartitionSpec("x"))),
        "col": jax.device_put(value, NamedSharding(mesh, PartitionSpec(None, "y"))),
        "both": jax.device_put(value, NamedSharding(mesh, PartitionSpec("y", "x"))),
        "replicated": jax.device_put(value, NamedSharding(mesh, PartitionSpec())),
    }
    path = tmp_path / "sharded.safetensors"
    osf.save_file(tree, path)
    loaded = torch_load_file(str(path))
    for name in tree:
        np.testing.assert_array_equal(loaded[name].numpy(), value, err_msg=name)


@pytest.fixture
def aligned(tmp_path):
    """A file laid out for direct I/O: sizes that are and are not multiples of 64 bytes, so
    the header is padded to 4 KiB and tensors are reordered."""
    tree = {
        "bias": _values(np.dtype(np.float32), (7,), 1),
        "w": _values(np.dtype(np.float32), (96, 80), 2),
        "ids": _values(np.dtype(np.int8), (5, 3), 3),
        "emb": _values(np.dtype(ml_dtypes.bfloat16), (33, 65), 4),
        "f64": _values(np.dtype(np.float64), (3,), 5),
        "big": _values(np.dtype(np.float32), (512, 515), 6),
    }
    path = tmp_path / "aligned.safetensors"
    osf.save_file(tree, path)
    return path, tree


def test_aligned_layout_reads_with_every_official_api(aligned):
    import json
    import struct

    path, tree = aligned
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0  # the data section starts on a 4 KiB boundary
    doc = json.loads(raw[8 : 8 + n])
    assert list(doc)[1:] != list(tree)  # reordered by size alignment
    with safe_open(path, "numpy") as f:
        for name, value in tree.items():
            _same_bits(f.get_tensor(name), value)
        _same_bits(f.get_slice("w")[3:17, 10:70], tree["w"][3:17, 10:70])
        _same_bits(f.get_slice("big")[500:], tree["big"][500:])
        _same_bits(f.get_slice("emb")[:, 1:64], tree["emb"][:, 1:64])
        _same_bits(f.get_slice("bias")[2:5], tree["bias"][2:5])
    loaded = np_load_file(str(path))
    for name, value in tree.items():
        _same_bits(loaded[name], value)
    with safe_open(path, "flax") as f:
        for name in ("w", "emb", "big", "ids"):
            _same_bits(np.asarray(f.get_tensor(name)), tree[name])


@needs_torch
def test_aligned_layout_reads_with_torch(aligned):
    path, tree = aligned
    loaded = torch_load_file(str(path))
    for name, value in tree.items():
        np.testing.assert_array_equal(_torch_as_numpy(loaded[name]), _as_expected(value))
    with safe_open(path, "pt") as f:
        part = f.get_slice("big")[7:300, 5:9]
        np.testing.assert_array_equal(part.numpy(), tree["big"][7:300, 5:9])


def test_header_is_plain_json_other_readers_can_list(nested):
    import json
    import struct

    path, expected = nested
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + n])
    assert set(doc) - {"__metadata__"} == set(expected)
    meta = doc["__metadata__"]
    assert all(isinstance(v, str) for v in meta.values())
    assert json.loads(meta["orbax_safetensors.tree"])["format"] == "orbax-safetensors/tree"
    crcs = json.loads(meta["orbax_safetensors.crc32c"])
    assert set(crcs) == set(expected)
