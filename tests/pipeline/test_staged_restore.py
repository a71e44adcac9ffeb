"""Restores through a staging ring (pipeline/place): on an accelerator each large tensor is
read into one reused host ring and transferred from it, in waves, instead of into fresh memory.

Off an accelerator the ring is never chosen by itself (``device_put`` shares CPU memory), so
these tests force it with ``place.MODE = "always"`` and a small ring: the same reads, waves,
wrap-arounds and waits, with each placed array copied off the ring. Every value must equal an
unstaged restore bit for bit, whatever the sharding, dtype or cast; a damaged tensor must still
be named; and a later restore reusing the ring must leave earlier results alone. On the TPU the
auto mode takes this path for every restore (docs/performance.md, "TPU").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import place as _place

MiB = 1 << 20


@pytest.fixture
def forced(monkeypatch):
    """Staging forced on CPU with a 4 MiB ring (waves of 1 MiB): every large tensor wraps it."""
    monkeypatch.setattr(_place, "MODE", "always")
    monkeypatch.setattr(_place, "RING_BYTES", 4 * MiB)
    _place.RINGS.clear()
    yield
    _place.RINGS.clear()


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    tree: dict[str, Any] = {
        f"layer{i}": jnp.asarray(
            rng.standard_normal((int(rng.integers(256, 700)), 512)), jnp.float32
        )
        for i in range(12)
    }
    tree["bf16"] = jnp.asarray(rng.standard_normal((1024, 700)), jnp.bfloat16)
    tree["big"] = jnp.asarray(rng.integers(0, 2**31, (3 * MiB) // 4, dtype=np.int32))  # 3 MiB
    tree["small"] = jnp.arange(7, dtype=jnp.int8)
    tree["host"] = rng.standard_normal((600, 600)).astype(np.float32)  # comes back as numpy
    return tree


def _equal(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_auto_mode_stages_on_accelerators_only(tmp_path: Path):
    device = jax.local_devices()[0]
    on_cpu = device.platform == "cpu"
    assert _place.aliases_host(device) == on_cpu  # CPU: device_put shares aligned buffers
    path = tmp_path / "m.safetensors"
    tree = _tree()
    osf.save_file(tree, path)
    _place.RINGS.clear()
    _equal(osf.load_file(path), jax.tree.map(np.asarray, tree))
    assert _place.RINGS.idle_bytes == (0 if on_cpu else _place.RING_BYTES)


def test_a_staged_file_restore_equals_an_unstaged_one(tmp_path: Path, forced, monkeypatch):
    tree = _tree()
    path = tmp_path / "m.safetensors"
    osf.save_file(tree, path)
    staged = osf.load_file(path)
    assert _place.RINGS.idle_bytes == 4 * MiB  # the ring was used and kept
    monkeypatch.setattr(_place, "MODE", "never")
    _equal(staged, osf.load_file(path))
    _equal(staged, jax.tree.map(np.asarray, tree) | {"host": tree["host"]})


def test_a_staged_restore_with_shardings_and_casts(tmp_path: Path, forced, monkeypatch):
    tree = _tree()
    osf.save_directory(tree, tmp_path / "ckpt", max_file_size=6 * MiB)  # several files
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def target(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        split = x.ndim and x.shape[0] % len(jax.devices()) == 0
        sharding = NamedSharding(mesh, PartitionSpec("d" if split else None))
        dtype = jnp.float16 if x.dtype == jnp.float32 and x.shape[0] % 2 else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)

    abstract = jax.tree.map(target, tree)
    staged = osf.restore_directory(tmp_path / "ckpt", target=abstract)
    monkeypatch.setattr(_place, "MODE", "never")
    plain = osf.restore_directory(tmp_path / "ckpt", target=abstract)
    _equal(staged, plain)
    for x, t in zip(jax.tree.leaves(staged), jax.tree.leaves(abstract)):
        if isinstance(t, jax.ShapeDtypeStruct):
            assert x.sharding == t.sharding and x.dtype == t.dtype


def test_results_do_not_share_the_ring_with_the_next_restore(tmp_path: Path, forced):
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    first = {"a": jnp.full((MiB,), 1.0, jnp.float32), "b": jnp.full((MiB,), 2.0, jnp.float32)}
    osf.save_file(first, one)
    osf.save_file({k: v + 10 for k, v in first.items()}, two)
    restored = osf.load_file(one)
    osf.load_file(two)  # reuses the ring that held one's bytes
    assert float(restored["a"][0]) == 1.0 and float(restored["b"][-1]) == 2.0


def test_a_damaged_tensor_is_named_and_the_ring_stays_usable(tmp_path: Path, forced):
    tree = {f"t{i}": jnp.full((300_000,), float(i), jnp.float32) for i in range(8)}
    path = tmp_path / "m.safetensors"
    osf.save_file(tree, path)
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:  # a byte inside the seventh tensor
        f.seek(header + 6 * 1_200_000 + 1_000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(osf.IntegrityError, match="CRC32C"):
        osf.load_file(path)
    good = tmp_path / "good.safetensors"
    osf.save_file(tree, good)
    _equal(osf.load_file(good), jax.tree.map(np.asarray, tree))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.int8, np.bool_, ml_dtypes.float8_e4m3fn])
def test_every_dtype_stages_bit_for_bit(tmp_path: Path, forced, dtype):
    rng = np.random.default_rng(1)
    values = rng.integers(0, 255, 3 * MiB, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        values = values & 1
    tree = {"x": jnp.asarray(values.view(dtype))}
    path = tmp_path / "m.safetensors"
    osf.save_file(tree, path)
    _equal(osf.load_file(path), jax.tree.map(np.asarray, tree))
