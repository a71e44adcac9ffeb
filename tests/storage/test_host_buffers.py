"""Issue 20 point 5: an async save's host copies land in buffers reused from the previous save.

Real CheckpointManager saves; the files are read back with the official safetensors reader, so
a buffer reused too early (while the previous step was still being written) would show up as
the wrong values on disk.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file as st_load_file

import orbax_safetensors as osf
from orbax_safetensors._src.storage import buffers as _buffers

LARGE = 1 << 20  # elements: 4 MiB of float32, well above the slab cut-off (512 KiB)


def _state(step: int) -> dict[str, jnp.ndarray]:
    return {
        "a": jnp.full((LARGE,), step, jnp.float32),
        "b": jnp.arange(LARGE // 2, dtype=jnp.float32) + step,
        "small": jnp.full((16,), step, jnp.int32),
    }


def _addresses(pool: _buffers.HostBufferPool) -> set[int]:
    return {b.ctypes.data for buffers in pool._free.values() for b in buffers}


def test_pool_reuses_the_same_memory_and_keeps_one_saves_worth() -> None:
    pool = _buffers.HostBufferPool()
    first = pool.arena()
    a = first.empty(3 << 20)
    b = first.empty(5 << 20)
    small = first.empty(1024)  # from a slab, not pooled
    assert a.ctypes.data % _buffers.ALIGNMENT == 0 and small.nbytes == 1024
    pool.release(first)
    assert pool.idle_bytes == (3 << 20) + (5 << 20)
    second = pool.arena()
    again = second.empty((3 << 20) - 100)  # same page-rounded capacity: reused
    other = second.empty(7 << 20)  # no such capacity free: new
    assert again.ctypes.data == a.ctypes.data and other.ctypes.data != b.ctypes.data
    pool.release(second)
    # b's buffer (not taken by the second save) is gone: one save's worth stays.
    assert pool.idle_bytes == (3 << 20) + (7 << 20)
    pool.clear()
    assert pool.idle_bytes == 0


@pytest.mark.parametrize("reuse", [True, False])
def test_async_saves_reuse_host_buffers_and_write_the_right_values(
    tmp_path: Path, reuse: bool
) -> None:
    handler = osf.SafetensorsCheckpointHandler(reuse_host_buffers=reuse)
    with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(_state(0)))
        mngr.wait_until_finished()
        pool = handler._host_buffers
        if not reuse:
            assert pool is None
        else:
            assert pool is not None
            kept = _addresses(pool)
            assert pool.idle_bytes >= 6 * LARGE  # a and b (4 MiB + 2 MiB)
        for step in (1, 2, 3):
            # Not waiting in between: Orbax waits for the previous step's writes before the
            # next save starts, and only then may its buffers be reused.
            mngr.save(step, args=osf.SafetensorsSave(_state(step)))
        mngr.wait_until_finished()
        if reuse:
            assert pool is not None and _addresses(pool) == kept  # the same memory every save
    for step in range(4):
        tensors = st_load_file(str(tmp_path / str(step) / "default" / "model.safetensors"))
        np.testing.assert_array_equal(tensors["a"], np.full(LARGE, step, np.float32))
        np.testing.assert_array_equal(tensors["b"], np.arange(LARGE // 2, dtype=np.float32) + step)
        np.testing.assert_array_equal(tensors["small"], np.full(16, step, np.int32))
    if reuse:
        assert pool is not None and pool.idle_bytes == 0  # the manager's close() frees them


def test_a_donated_state_after_save_returns_is_still_written_right(tmp_path: Path) -> None:
    """The copies are complete when save() returns, reused buffers included: deleting the
    arrays right away (as a training step donating them would) changes nothing on disk."""
    handler = osf.SafetensorsCheckpointHandler()
    with ocp.CheckpointManager(tmp_path, item_handlers=handler) as mngr:
        for step in range(3):
            state = _state(step)
            mngr.save(step, args=osf.SafetensorsSave(state))
            for leaf in state.values():
                leaf.delete()
        mngr.wait_until_finished()
    for step in range(3):
        tensors = st_load_file(str(tmp_path / str(step) / "default" / "model.safetensors"))
        np.testing.assert_array_equal(tensors["a"], np.full(LARGE, step, np.float32))
