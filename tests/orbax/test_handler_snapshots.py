"""Saves snapshot unless told to write in place (``SafetensorsSave(snapshot=False)``): the
snapshot queue, donated arrays and the copying thread (issue 3).

Interop checks read our files with ``safetensors`` itself.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import handler_helpers as helpers  # (tests/orbax/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from traced_memory import traced_peak

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.pipeline.save_job import SaveMode

# --------------------------------------------------------------------------- host memory of saves


def _big_state() -> dict[str, Any]:
    return {f"w{i}": jnp.full((1 << 21,), float(i), jnp.float32) for i in range(4)}  # 4 x 8 MiB


@pytest.mark.parametrize(
    ("async_enabled", "reuse"),
    [(True, False), (True, True), (False, True)],
    ids=["async-fresh-buffers", "async-reused-buffers", "sync"],
)
def test_sync_saves_write_in_place_async_saves_snapshot(
    tmp_path: Path, async_enabled: bool, reuse: bool
) -> None:
    """A synchronous manager save with ``snapshot=False`` writes each tensor straight from its
    buffer (no host snapshot); an async one copies every owned byte to host before save()
    returns: into new memory, or (the default) into the buffers of the previous save,
    allocating nothing."""
    state = _big_state()
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    handler = osf.SafetensorsCheckpointHandler(reuse_host_buffers=reuse)
    mngr = helpers.manager(tmp_path, options=options, item_handlers=handler)
    mngr.save(0, args=osf.SafetensorsSave(state))  # warm-up: Orbax's one-off allocations
    mngr.wait_until_finished()

    def save() -> None:
        mngr.save(1, args=osf.SafetensorsSave(state, snapshot=async_enabled))
        mngr.wait_until_finished()

    peak = traced_peak(save)
    restored = mngr.restore(1, args=osf.SafetensorsRestore())
    mngr.close()
    helpers.assert_same_values(restored, state)
    if async_enabled and jax.devices()[0].platform != "cpu":
        # On an accelerator the host copies are JAX's own (of a device snapshot): fresh memory
        # whatever the pool, freed once written.
        assert 8 << 20 <= peak < (32 << 20) + (4 << 20), peak
    elif async_enabled and not reuse:
        assert peak >= 8 << 20, peak  # at least the largest tensor was snapshotted
    elif jax.devices()[0].platform != "cpu":  # sync: a tensor and the next one's host copies
        assert peak < (16 << 20) + (4 << 20), peak
    else:
        assert peak < 2 << 20, peak  # 32 MiB saved (or snapshotted) with < 2 MiB allocated


def test_a_direct_save_of_fresh_host_copies_holds_a_tensor_and_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A direct save whose host data are fresh copies (an accelerator's: here each tensor's
    host data is made a fresh copy, as ``np.asarray`` of a TPU array is) writes one batch at
    a time and lets go of each tensor once written: it holds the tensor being written and the
    next one, never the writes of a whole small state (32 MiB under the 64 MiB of writes a
    save of host views keeps under way), nor an earlier tensor while the next is copied."""
    state = {f"w{i}": np.full(1 << 21, float(i), np.float32) for i in range(6)}  # 6 x 8 MiB
    validated = _checkpoint_save.validate_save(state)
    assert _snapshots.host_views(validated.flat.arrays.values())  # (numpy: views)
    # As on a TPU: a transfer's host memory is taken when the transfer starts (the next
    # tensor's, started ahead), and the tensor's host data is that memory.
    started: dict[int, np.ndarray] = {}

    def start_copies(owned: list[Any]) -> None:
        for _, x, _, _ in owned:
            started[id(x)] = np.array(x, copy=True)

    def host_array(data: Any, on_cpu: bool, buffers: Any, dtype: Any = None) -> np.ndarray:
        return started.pop(id(data), None) if id(data) in started else np.array(data, copy=True)

    monkeypatch.setattr(_snapshots, "start_copies", start_copies)
    monkeypatch.setattr(_snapshots, "_host_array", host_array)
    monkeypatch.setattr(_snapshots, "host_views", lambda arrays: False)

    def save() -> None:
        prepared = _checkpoint_save.prepare(validated, _checkpoint_save.SaveLayout())
        assert prepared.max_in_flight < _checkpoint_save.IN_FLIGHT_BYTES
        _checkpoint_save.write_process_share(prepared, tmp_path, persist_share=False)

    peak = traced_peak(save)
    assert 8 << 20 <= peak < (16 << 20) + (2 << 20), peak
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize("checkpointer", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_checkpointer_with_the_handler_alone(tmp_path: Path, checkpointer: Any) -> None:
    """The handler under a bare Checkpointer (sync: handler.save, in place) and an
    AsyncCheckpointer (async_save: snapshot, then donation is safe)."""
    state = _big_state()
    expected = jax.tree.map(lambda x: np.array(x, copy=True), state)  # not a view: donatable
    ckptr = checkpointer(osf.SafetensorsCheckpointHandler())
    donate = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)

    def save() -> None:
        ckptr.save(tmp_path / "ck", args=osf.SafetensorsSave(state))
        if checkpointer is ocp.AsyncCheckpointer:
            donate(state)  # right after save() returns
            ckptr.wait_until_finished()

    peak = traced_peak(save)
    restored = ckptr.restore(tmp_path / "ck", args=osf.SafetensorsRestore())
    ckptr.close()
    for k in expected:
        np.testing.assert_array_equal(np.asarray(restored[k]), expected[k], err_msg=k)
    if checkpointer is ocp.Checkpointer and jax.devices()[0].platform != "cpu":
        assert peak < (16 << 20) + (4 << 20), peak  # a tensor and the next one's host copies
    elif checkpointer is ocp.Checkpointer:
        assert peak < 2 << 20, peak
    else:
        assert all(x.is_deleted() for x in state.values())


class _RecordingHandler(osf.SafetensorsCheckpointHandler):
    """Records the mode of each save job it makes."""

    modes: list[SaveMode] = []

    @classmethod
    def typestr(cls) -> str:
        return "tests.test_handler_snapshots._RecordingHandler"

    def new_job(self, directory: Any, args: Any, mode: SaveMode) -> Any:
        _RecordingHandler.modes.append(mode)
        return super().new_job(directory, args, mode)


@ocp.args.register_with_handler(_RecordingHandler, for_save=True)
@dataclasses.dataclass
class _RecordingSave(osf.SafetensorsSave):
    pass


@ocp.args.register_with_handler(_RecordingHandler, for_restore=True)
@dataclasses.dataclass
class _RecordingRestore(osf.SafetensorsRestore):
    pass


@pytest.mark.parametrize("async_enabled", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "direct"])
def test_the_snapshot_option_alone_decides_how_a_manager_save_writes(
    tmp_path: Path, async_enabled: bool, snapshot: bool
) -> None:
    """Orbax tells a handler nothing of whether its save() waits for the writes: a manager
    save (either kind) snapshots unless ``SafetensorsSave(snapshot=False)`` says to write
    straight from the arrays, and writes the same values either way."""
    _RecordingHandler.modes = []
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_enabled)
    mngr = ocp.CheckpointManager(tmp_path, options=options)
    state = {"w": jnp.arange(6.0)}
    mngr.save(0, args=_RecordingSave(state, snapshot=snapshot))
    mngr.wait_until_finished()
    restored = mngr.restore(0, args=_RecordingRestore())
    mngr.close()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6.0))
    assert _RecordingHandler.modes == [SaveMode.SNAPSHOT if snapshot else SaveMode.DIRECT]


def test_an_async_checkpointer_snapshots_by_default(tmp_path: Path) -> None:
    _RecordingHandler.modes = []
    ckptr = ocp.AsyncCheckpointer(_RecordingHandler())
    ckptr.save(tmp_path / "ck", args=_RecordingSave({"w": jnp.ones(2)}))
    ckptr.wait_until_finished()
    ckptr.close()
    assert _RecordingHandler.modes == [SaveMode.SNAPSHOT]


def test_saving_a_donated_array_names_it(tmp_path: Path) -> None:
    state = {"layer": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}}
    jax.jit(lambda s: s, donate_argnums=0)(state["layer"]["w"])
    mngr = helpers.manager(tmp_path)
    with pytest.raises(ValueError, match=r"'layer\.w'.*deleted.*donated"):
        # Raised where the args are built, before Orbax starts any background work.
        mngr.save(1, args=osf.SafetensorsSave(state))
    assert mngr.all_steps() == []
    mngr.close()


def test_snapshot_queue_starts_the_writer_early_for_large_tensors() -> None:
    """A state of large tensors reaches the writer once 16 MiB is copied; 10,000 small tensors
    (10 MB) only at close, after the copy loop."""
    large = _snapshots.SnapshotQueue()
    for i in range(3):
        large.put((i, [(None, np.zeros(3 << 20, np.float32))]))  # 12 MiB each
        assert large.wait_started(timeout=0) == (i >= 1), i
    small = _snapshots.SnapshotQueue()
    for i in range(10_000):
        small.put((i, [(None, np.zeros(256, np.float32))]))
    assert not small.wait_started(timeout=0)
    small.close()
    assert small.wait_started(timeout=0) and small.complete()
    assert sum(1 for _ in small) == 10_000


def test_args_reused_after_a_donation_fail_naming_the_leaf(tmp_path: Path) -> None:
    """SafetensorsSave checks for deleted arrays when built; args kept and saved again after
    the arrays were donated fail in save() with the same message, not a bare JAX error."""
    state = {"layer": {"w": jnp.arange(8.0)}}
    args = osf.SafetensorsSave(state)
    mngr = helpers.manager(
        tmp_path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    )
    mngr.save(0, args=args)
    mngr.wait_until_finished()
    jax.jit(lambda s: s, donate_argnums=0)(state["layer"]["w"])
    with pytest.raises(ValueError, match=r"'layer\.w'.*deleted.*donated"):
        mngr.save(1, args=args)
    helpers.let_step_directory_creation_finish(tmp_path, 1)
    mngr.close()
    assert mngr.all_steps() == [0]


def test_writer_fails_when_the_copying_thread_fails(tmp_path: Path) -> None:
    """The async writer reads host copies from a queue as they are made; a failed copy makes
    the writer raise (the step is not committed) instead of waiting forever or finishing."""
    tree = {"w": np.ones(8, np.float32)}
    validated = _checkpoint_save.validate_save(tree)
    queue = _snapshots.SnapshotQueue()
    for item in _snapshots.iter_snapshots(enumerate(validated.captured.arrays)):
        queue.put(item)
    queue.fail(MemoryError("host copy failed"))
    assert queue.wait_started(timeout=0)
    prepared = _checkpoint_save.prepare(validated, _checkpoint_save.SaveLayout(), queue)
    with pytest.raises(RuntimeError, match=r"copying .* to host failed") as info:
        _checkpoint_save.write_process_share(prepared, tmp_path)
    assert isinstance(info.value.__cause__, MemoryError)
    assert not (tmp_path / "orbax_safetensors.json").exists()


def test_snapshot_queue_hands_over_every_item_in_order_across_groups(tmp_path):
    """Host copies go to the writer in groups (the first once 16 MiB of at most 256 tensors or
    64 MiB is copied, then by bytes and by count); none is lost, reordered or held back at
    close, whatever the mix of sizes."""
    rng = np.random.default_rng(0)
    tree = {f"s{i:04d}": rng.standard_normal(16).astype(np.float32) for i in range(600)}
    tree["big"] = rng.standard_normal(17 << 20).astype(np.float32)  # 68 MiB: ends group one
    tree.update({f"t{i:04d}": rng.standard_normal(16).astype(np.float32) for i in range(600)})
    tree["tail"] = np.arange(5, dtype=np.int32)
    validated = _checkpoint_save.validate_save(tree)
    items = list(_snapshots.iter_snapshots(enumerate(validated.captured.arrays)))
    queue = _snapshots.SnapshotQueue()
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(queue))
    reader.start()
    for k, item in enumerate(items):
        queue.put(item)
        # 600 small tensors and a large one: nothing reaches the writer before 64 MiB is
        # copied; then groups of <= 256 tensors.
        assert queue.wait_started(timeout=0) == (k >= 600), k
    queue.close()
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert [key for key, _ in got] == [key for key, _ in items] == list(range(len(tree)))
    assert all(a is b for (_, pa), (_, pb) in zip(got, items) for (_, a), (_, b) in zip(pa, pb))
    # and written through a queue, the checkpoint is whole
    queue = _snapshots.SnapshotQueue()
    for item in _snapshots.iter_snapshots(enumerate(validated.captured.arrays)):
        queue.put(item)
    queue.close()
    prepared = _checkpoint_save.prepare(validated, _checkpoint_save.SaveLayout(), queue)
    _checkpoint_save.write_process_share(prepared, tmp_path)
    _checkpoint_save.finalize(tmp_path)
    restored = osf.restore_directory(tmp_path)
    for name, value in tree.items():
        np.testing.assert_array_equal(restored[name], value)
