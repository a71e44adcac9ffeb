"""_place.put: the direct single-device entry gives what jax.device_put gives, zero-copy included."""

from __future__ import annotations

import devices  # (tests/ is on sys.path)
import jax
import ml_dtypes
import numpy as np
import pytest

from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.storage import buffers as _buffers


def _aligned(values: np.ndarray) -> np.ndarray:
    buf = _buffers.aligned_empty(values.nbytes).view(values.dtype).reshape(values.shape)
    buf[...] = values
    return buf


def _same(a: jax.Array, b: jax.Array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.sharding == b.sharding and a.committed == b.committed
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture
def direct_only():
    """Makes sure the direct entry is loaded (and so in use) for the test."""
    _place.put([np.zeros(1, np.float32)], [jax.local_devices()[0]])
    assert callable(_place._direct_put), "the direct entry did not load with this JAX"
    return _place._direct_put


DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int8,
    np.uint16,
    np.int32,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    np.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_direct_put_matches_device_put(direct_only, dtype):
    local = devices.take(3)
    values = [
        _aligned((np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)),
        _aligned(np.array(3, dtype)),  # a 0-d array
        _aligned(np.zeros((0, 5), dtype)),  # an empty one
    ]
    targets = [local[1], jax.sharding.SingleDeviceSharding(local[2]), local[0]]
    got = _place.put(values, targets)
    want = jax.device_put(values, targets, may_alias=True)
    for g, w in zip(got, want):
        _same(g, w)


def test_direct_put_shares_aligned_buffers(direct_only):
    device = jax.local_devices()[0]
    if not _place.aliases_host(device):
        pytest.skip(f"device_put onto {device.platform} copies: no buffer to share")
    host = _aligned(np.arange(1 << 16, dtype=np.float32))
    (got,) = _place.put([host], [jax.local_devices()[0]])
    assert got.unsafe_buffer_pointer() == host.ctypes.data  # zero-copy, as device_put
    # A strided view is copied into a fresh buffer, as device_put does.
    view = host.reshape(256, 256)[:, ::2]
    (strided,) = _place.put([view], [jax.local_devices()[0]])
    np.testing.assert_array_equal(np.asarray(strided), view)


def test_multi_device_and_64_bit_values_take_device_put(direct_only):
    mesh = devices.mesh((4,), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = [np.arange(8, dtype=np.float32), np.arange(4, dtype=np.int64)]
    targets = [sharded, jax.local_devices()[0]]
    got = _place.put(values, targets)
    want = jax.device_put(values, targets, may_alias=True)
    for g, w in zip(got, want):
        _same(g, w)
    assert got[0].sharding == sharded and len(got[0].addressable_shards) == 4
    assert got[1].dtype == jax.numpy.asarray(np.int64(0)).dtype  # canonicalised as JAX does


def test_without_the_direct_entry_everything_takes_device_put(monkeypatch):
    monkeypatch.setattr(_place, "_direct_put", None)  # as on a JAX that lacks the entry
    values = [_aligned(np.arange(6, dtype=np.float32)), np.ones((2, 2), ml_dtypes.bfloat16)]
    targets = [devices.take(4)[3], jax.local_devices()[0]]
    got = _place.put(values, targets)
    for g, w in zip(got, jax.device_put(values, targets, may_alias=True)):
        _same(g, w)
