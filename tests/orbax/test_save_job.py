"""Issues 25 and 26: a save is one ``SaveJob``; handlers hold no state of a save.

Real Orbax ``CheckpointManager`` (v0) and ``ocp.save`` (v1), real files: one handler instance
serves several items, several managers and concurrent saves; a ``save()`` whose host copies fail
raises, leaves no thread of ours writing and no file of the step, and the same step saves again
at once. The ``SaveJob`` steps are also driven directly, without Orbax.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from handler_helpers import needs_v1  # (tests/orbax/ is on sys.path)

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline import standalone as _standalone

# Tensors above BufferArena's slab threshold (512 KiB): async saves copy them into the
# handler's reused host buffers.
_BIG = 1 << 18  # float32 elements: 1 MiB


def _state(seed: int, big: int = _BIG) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal(big).astype(np.float32)),
        "layers": [jnp.full((3, 4), seed, jnp.bfloat16), np.arange(5, dtype=np.int32) + seed],
        "step": seed,
    }


def _assert_same(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.asarray(w).dtype


def _options(enable_async: bool, **kwargs: Any) -> ocp.CheckpointManagerOptions:
    return ocp.CheckpointManagerOptions(enable_async_checkpointing=enable_async, **kwargs)


def _our_files(root: Path) -> list[str]:
    """Files this library writes under ``root`` (Orbax's own step metadata left out)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and (
            p.name.endswith((".safetensors", ".index.json"))
            or p.name.startswith((_metadata.SHARE_FILE_PREFIX, "orbax_safetensors"))
        )
    )


def _save_threads() -> list[threading.Thread]:
    # The thread Orbax runs our commit future on is named after it.
    return [t for t in threading.enumerate() if t.name == "safetensors_save" and t.is_alive()]


def _assert_checksummed(item_dir: Path) -> None:
    doc = json.loads((item_dir / _metadata.METADATA_FILE).read_text())
    assert doc["tensors"] and all(t["crc32c"] for t in doc["tensors"].values())
    assert not list(item_dir.glob(f"{_metadata.SHARE_FILE_PREFIX}*"))
    assert not (item_dir / _metadata.DRAFT_FILE).exists()


# -- one handler instance, many items, managers and concurrent saves -------------------------


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
def test_one_handler_serves_two_items_of_a_composite(tmp_path: Path, enable_async: bool) -> None:
    """Issue 25.1: ``item_handlers={"a": h, "b": h}`` with one handler ``h``: each item's
    finalize finds its own save (both committed, checksummed, restorable), step after step."""
    handler = osf.SafetensorsCheckpointHandler()
    with ocp.CheckpointManager(
        tmp_path, item_handlers={"a": handler, "b": handler}, options=_options(enable_async)
    ) as mngr:
        for step in range(2):
            args = ocp.args.Composite(
                a=osf.SafetensorsSave(_state(step), custom_metadata={"item": "a"}),
                b=osf.SafetensorsSave(_state(step + 10, big=_BIG // 2)),
            )
            mngr.save(step, args=args)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1]
        for step in range(2):
            got = mngr.restore(
                step,
                args=ocp.args.Composite(a=osf.SafetensorsRestore(), b=osf.SafetensorsRestore()),
            )
            _assert_same(got["a"], _state(step))
            _assert_same(got["b"], _state(step + 10, big=_BIG // 2))
            for item in ("a", "b"):
                _assert_checksummed(tmp_path / str(step) / item)
        assert handler.metadata(tmp_path / "1" / "a").custom_metadata == {"item": "a"}
    assert len(handler._pending) == 0  # every job finalized and forgotten


def test_two_managers_share_one_handler_saving_concurrently(tmp_path: Path) -> None:
    """Issue 25.1: two async managers, one handler, two threads: each save's writes and
    finalize run while the other manager's are in flight, and every step of both is committed
    and restores to the values saved (the host buffers the handler reuses never serve two
    saves at once).

    The ``save()`` calls themselves take turns: Orbax keys its directory-creation signals by
    a process-wide operation id, and two ``save()`` calls at the same instant from two threads
    fail with Orbax's own ``StandardCheckpointHandler`` too (``FileExistsError`` on the step's
    temporary directory).
    """
    handler = osf.SafetensorsCheckpointHandler()
    steps = 4
    errors: list[BaseException] = []
    start = threading.Barrier(2)
    turns = threading.Lock()  # one save() call at a time; the writes overlap

    def run(root: Path, offset: int) -> None:
        try:
            with ocp.CheckpointManager(root, item_handlers=handler, options=_options(True)) as m:
                start.wait(timeout=60)
                for step in range(steps):
                    args = osf.SafetensorsSave(_state(offset + step))
                    with turns:
                        m.save(step, args=args)
                m.wait_until_finished()
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    roots = [tmp_path / "one", tmp_path / "two"]
    threads = [threading.Thread(target=run, args=(r, 100 * i)) for i, r in enumerate(roots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for i, root in enumerate(roots):
        with ocp.CheckpointManager(root, item_handlers=handler) as mngr:
            assert mngr.all_steps() == list(range(steps))
            for step in range(steps):
                got = mngr.restore(step, args=osf.SafetensorsRestore())
                _assert_same(got, _state(100 * i + step))
                _assert_checksummed(root / str(step) / "default")
    assert len(handler._pending) == 0


def test_a_mixed_root_routes_each_directory_to_the_handler_that_saved_it(tmp_path: Path) -> None:
    """One handler (``handler_registry``) for Orbax's args and ours in one Composite: each
    item directory is finalized by the handler that saved it."""
    handler = osf.SafetensorsCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("ours", "orbax"):
        for args_type in (osf.SafetensorsSave, osf.SafetensorsRestore, ocp.args.StandardSave):
            registry.add(item, args_type, handler)
        registry.add(item, ocp.args.StandardRestore, handler)
    with ocp.CheckpointManager(tmp_path, handler_registry=registry) as mngr:
        mngr.save(
            0,
            args=ocp.args.Composite(
                ours=osf.SafetensorsSave(_state(1)),
                orbax=ocp.args.StandardSave({"x": jnp.arange(4.0)}),
            ),
        )
        mngr.wait_until_finished()
        got = mngr.restore(
            0,
            args=ocp.args.Composite(
                ours=osf.SafetensorsRestore(),
                orbax=ocp.args.StandardRestore({"x": jnp.zeros(4)}),
            ),
        )
    _assert_same(got["ours"], _state(1))
    np.testing.assert_array_equal(got["orbax"]["x"], np.arange(4.0))
    _assert_checksummed(tmp_path / "0" / "ours")
    assert not list((tmp_path / "0" / "orbax").glob("*.safetensors"))


# -- a save() that raised leaves nothing writing ---------------------------------------------


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("first", ["deleted", "large"], ids=["deleted_first", "large_first"])
def test_a_save_whose_host_copy_fails_leaves_nothing_writing(
    tmp_path: Path, enable_async: bool, first: str
) -> None:
    """Issue 25.2: a leaf deleted between building ``SafetensorsSave`` and ``mngr.save``:
    ``save()`` raises naming it; no thread of ours is left and no file of ours appears
    afterwards (also when the writer had started on a large leaf before the copy failed);
    the same step saves at once with valid state."""
    large = jnp.arange(6 << 20, dtype=jnp.float32)  # 24 MiB: the writer starts on it
    leaves = {"a_large": large} if first == "large" else {}
    state = {**leaves, "b_doomed": jnp.arange(10.0), "c": jnp.ones(3)}
    with ocp.CheckpointManager(tmp_path, options=_options(enable_async)) as mngr:
        args = osf.SafetensorsSave(state)
        state["b_doomed"].delete()
        with pytest.raises(ValueError, match=r"'b_doomed'.*deleted"):
            mngr.save(0, args=args)
        assert _save_threads() == []
        after_raise = _our_files(tmp_path)
        assert after_raise == [], after_raise
        time.sleep(1.5)
        assert _our_files(tmp_path) == [] and _save_threads() == []
        good = {**leaves, "b_doomed": jnp.arange(10.0) + 1, "c": jnp.ones(3)}
        mngr.save(0, args=osf.SafetensorsSave(good))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        _assert_same(mngr.restore(0, args=osf.SafetensorsRestore()), good)
    _assert_checksummed(tmp_path / "0" / "default")


@needs_v1
def test_v1_saves_share_one_handler_concurrently_and_retry_after_a_raise(tmp_path: Path) -> None:
    """Through Orbax v1: one v0 handler behind every ``SafetensorsHandler`` the registry
    makes; two threads save at once (each save finalizes its own job), and a save that
    raised leaves nothing, so the same path saves at once."""
    ocp_v1 = orbaxcompat.orbax_v1()
    shared = osf.SafetensorsCheckpointHandler()

    class Shared(osf.SafetensorsHandler):
        def __init__(self) -> None:
            super().__init__(shared)

    def context() -> Any:
        ctx = ocp_v1.Context()
        ctx.checkpointables.registry = osf.local_registry(Shared)
        return ctx

    errors: list[BaseException] = []
    turns = threading.Lock()  # save_async() calls take turns (see the v0 test); writes overlap

    def run(i: int) -> None:
        try:
            with context():
                for k in range(2):
                    with turns:
                        response = ocp_v1.save_async(tmp_path / f"t{i}_{k}", _state(10 * i + k))
                    response.result()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    with context():
        for i in range(2):
            for k in range(2):
                got = ocp_v1.load(tmp_path / f"t{i}_{k}", jax.eval_shape(lambda: _state(0)))
                want = _state(10 * i + k)
                got["step"] = want["step"]  # a Python scalar target keeps the target's value
                _assert_same(got, want)
        state = _state(5)
        state["w"].delete()
        with pytest.raises(ValueError, match=r"'w'.*deleted"):
            ocp_v1.save(tmp_path / "retry", state)
        assert _save_threads() == [] and _our_files(tmp_path / "retry") == []
        ocp_v1.save(tmp_path / "retry", _state(6), overwrite=True)
        got = ocp_v1.load(tmp_path / "retry")
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_state(6)["w"]))
    assert len(shared._pending) == 0


# -- the job's steps, without Orbax ----------------------------------------------------------


def test_save_job_steps_run_in_order_and_keep_finalize_in_memory(tmp_path: Path) -> None:
    """A ``SNAPSHOT`` job: start, a writer thread, snapshot, finalize; the one-process draft
    and checksum share never touch the disk; writing twice or finalizing early is refused."""
    state = {"w": jnp.arange(8.0), "n": np.ones(3, np.int16)}
    validated = _checkpoint_save.validate_save(state, {"note": "x"})
    job = _save_job.SaveJob(validated, tmp_path, mode=_save_job.SaveMode.SNAPSHOT)
    with pytest.raises(RuntimeError, match="finalize needs a written save"):
        job.finalize()
    job.start()
    writer = threading.Thread(target=job.write)
    writer.start()
    job.snapshot()
    state["w"].delete()  # the copies are made: the caller may donate now
    writer.join(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with pytest.raises(RuntimeError, match="written twice"):
        job.write()
    job.finalize()
    restored = osf.restore_directory(tmp_path)
    np.testing.assert_array_equal(restored["w"], np.arange(8.0, dtype=np.float32))
    np.testing.assert_array_equal(restored["n"], np.ones(3, np.int16))
    _assert_checksummed(tmp_path)
    assert job.stats.bytes_written == 8 * 4 + 3 * 2


def test_an_aborted_job_writes_nothing_and_removes_what_it_wrote(tmp_path: Path) -> None:
    """``abort`` before the writer starts: it returns at once, writing nothing; during the
    write (a large first tensor already handed over): it ends and removes the files."""
    state = {"w": jnp.ones(4)}
    job = _save_job.SaveJob(
        _checkpoint_save.validate_save(state), tmp_path, mode=_save_job.SaveMode.SNAPSHOT
    )
    job.abort(RuntimeError("stop"))
    job.write()
    assert list(tmp_path.iterdir()) == []

    state = {"a": jnp.arange(6 << 20, dtype=jnp.float32), "b": jnp.ones(4)}
    validated = _checkpoint_save.validate_save(state)
    job = _save_job.SaveJob(validated, tmp_path, mode=_save_job.SaveMode.SNAPSHOT)
    failures: list[BaseException] = []

    def write() -> None:
        try:
            job.write()
        except BaseException as e:
            failures.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    # The writer must be writing before the abort (else write() returns at once, unwritten,
    # which the first half checks): it waits for the first host copy once it has begun.
    deadline = time.monotonic() + 60
    while job._state is not _save_job._State.WRITING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert job._state is _save_job._State.WRITING
    state["b"].delete()  # its copy fails after the large one went to the writer
    with pytest.raises(ValueError, match=r"'b'.*deleted"):
        job.snapshot()
    # abort waited for the writer: it writes nothing more and its files are already gone
    # (the thread itself may still be returning from write(): CI once saw it alive here)
    assert job._state is _save_job._State.ABORTED and list(tmp_path.iterdir()) == []
    writer.join(timeout=60)
    assert not writer.is_alive()
    # the writer ended quietly (snapshot() raised the error), leaving nothing
    assert failures == [] and list(tmp_path.iterdir()) == []


def test_pending_saves_finds_each_job_by_directory(tmp_path: Path) -> None:
    """The registry a handler keeps: one job per directory, a failed job forgotten only if it
    is still the one registered."""
    pending = _save_job.PendingSaves()
    validated = _checkpoint_save.validate_save({"x": np.ones(2)})
    jobs = [
        _save_job.SaveJob(validated, tmp_path / name, mode=_save_job.SaveMode.DIRECT)
        for name in ("a", "b", "a")
    ]
    for job in jobs:
        pending.add(job)
    assert len(pending) == 2
    pending.discard(jobs[0])  # replaced by jobs[2]: stays
    assert pending.pop(tmp_path / "a") is jobs[2]
    assert pending.pop(tmp_path / "a") is None
    pending.discard(jobs[1])
    assert len(pending) == 0


def test_save_directory_is_a_direct_job(tmp_path: Path) -> None:
    """``osf.save_directory`` runs one ``DIRECT`` job: the same files as a manager's save."""
    state = _state(3)
    osf.save_directory(state, tmp_path / "d", metadata={"k": 1}, max_file_size=1 << 19)
    names = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert "model.safetensors.index.json" in names and _metadata.METADATA_FILE in names
    _assert_same(osf.restore_directory(tmp_path / "d"), state)
    _assert_checksummed(tmp_path / "d")


def test_save_file_is_write_file(tmp_path: Path) -> None:
    """``osf.save_file`` is ``standalone.write_file``: called by hand it writes the same bytes
    (data, then the header with the checksums) and leaves no temporary file; a failing write
    leaves nothing at the path."""
    state = {**_state(4), "step": 7}
    policy = {"w": jnp.bfloat16}
    osf.save_file(state, tmp_path / "a.safetensors", {"k": "v"}, dtype=policy)
    validated = _checkpoint_save.validate_save(state, dtype=policy)
    _standalone.write_file(validated, tmp_path / "b.safetensors", metadata={"k": "v"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]
    data = (tmp_path / "b.safetensors").read_bytes()
    assert data == (tmp_path / "a.safetensors").read_bytes()
    _assert_same(
        osf.load_file(tmp_path / "b.safetensors"), {**state, "w": state["w"].astype(jnp.bfloat16)}
    )
    doomed = _checkpoint_save.validate_save({"x": jnp.ones((64, 64))})
    doomed.captured.arrays[0].delete()  # (donated after validation: the write raises)
    with pytest.raises(RuntimeError, match="deleted"):
        _standalone.write_file(doomed, tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]


def test_a_process_whose_save_raised_exits_cleanly(tmp_path: Path) -> None:
    """Issue 25.2 at interpreter exit: a script whose async ``save()`` raised (a leaf deleted
    after the args were built) and that exits at once ends with status 0, no traceback from a
    writer still running, and no file of the step."""
    script = textwrap.dedent(
        f"""
        import jax.numpy as jnp
        import orbax.checkpoint as ocp
        import orbax_safetensors as osf

        mngr = ocp.CheckpointManager({str(tmp_path / "root")!r})
        state = {{"a": jnp.arange(6 << 20, dtype=jnp.float32), "b": jnp.ones(4)}}
        args = osf.SafetensorsSave(state)
        state["b"].delete()
        try:
            mngr.save(0, args=args)
        except ValueError as e:
            print("raised:", e)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "raised: cannot save 'b'" in run.stdout, run.stdout
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert _our_files(tmp_path / "root") == []
