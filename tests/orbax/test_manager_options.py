"""CheckpointManager options with safetensors items (issue 3, point 4).

Every test drives a real ``ocp.CheckpointManager`` whose steps are written by
``SafetensorsCheckpointHandler`` and checks what is kept on disk, what a manager lists and that
each kept step restores to the values saved at that step. The crash test SIGKILLs a real
subprocess during an async save.

Run as a script, this file is that subprocess (``python tests/orbax/test_manager_options.py ROOT
MODE``, see :func:`_save_then_kill`).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as policies

import orbax_safetensors as osf
from orbax_safetensors._src.orbax import steps as _steps

LOSSES = [5.0, 1.0, 4.0, 0.5, 3.0, 2.0, 7.0, 6.0]  # metric of step i
# Orbax's temporary directories: "2.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp", or with
# a per-save counter appended, "2.orbax-checkpoint-tmp-0/default.orbax-checkpoint-tmp-1"
# (orbax-checkpoint 0.11.11; Orbax's public ocp.path.step.TMP_DIR_SUFFIX then ends in "-").
_TMP = ".orbax-checkpoint-tmp"
TMP_NAMES_COUNTED = ocp.path.step.TMP_DIR_SUFFIX.endswith("-")
# Preservation policies (ocp.checkpoint_managers.LatestN, ...) appeared in orbax-checkpoint
# 0.11.14 (absent from the 0.11.13 wheel).
needs_preservation_policies = pytest.mark.skipif(
    not hasattr(policies, "LatestN"),
    reason=f"needs orbax-checkpoint >= 0.11.14 (preservation policies); this is {ocp.__version__}",
)


def _state(step: int) -> dict[str, Any]:
    return {"w": jnp.full((3, 2), step, jnp.float32), "n": np.arange(4, dtype=np.int64) + step}


def _save_steps(
    root: Path, steps: range = range(8), metrics: bool = False, **options: Any
) -> tuple[ocp.CheckpointManager, list[int]]:
    """Saves _state(step) at each step; returns the manager and the steps save() accepted."""
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(**options))
    accepted = []
    for step in steps:
        kwargs = {"metrics": {"loss": LOSSES[step]}} if metrics else {}
        if mngr.save(step, args=osf.SafetensorsSave(_state(step)), **kwargs):
            accepted.append(step)
    mngr.wait_until_finished()
    return mngr, accepted


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def _assert_restores(mngr: ocp.CheckpointManager, steps: list[int]) -> None:
    for step in steps:
        restored = mngr.restore(step, args=osf.SafetensorsRestore())
        np.testing.assert_array_equal(restored["w"], np.full((3, 2), step, np.float32))
        np.testing.assert_array_equal(restored["n"], np.arange(4) + step)


def test_max_to_keep(tmp_path: Path) -> None:
    mngr, accepted = _save_steps(tmp_path, max_to_keep=2)
    assert accepted == list(range(8))
    assert mngr.all_steps() == [6, 7] and _dirs(tmp_path) == ["6", "7"]
    _assert_restores(mngr, [6, 7])
    mngr.close()


def test_keep_period(tmp_path: Path) -> None:
    mngr, _ = _save_steps(tmp_path, max_to_keep=2, keep_period=3)
    # The two latest, plus every multiple of keep_period, kept forever.
    assert mngr.all_steps() == [0, 3, 6, 7] and _dirs(tmp_path) == ["0", "3", "6", "7"]
    _assert_restores(mngr, [0, 3, 6, 7])
    mngr.close()


@pytest.mark.parametrize(("mode", "kept", "best"), [("min", [1, 3], 3), ("max", [6, 7], 6)])
def test_best_fn_and_best_mode(tmp_path: Path, mode: str, kept: list[int], best: int) -> None:
    mngr, _ = _save_steps(
        tmp_path, metrics=True, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode
    )
    assert mngr.all_steps() == kept
    assert mngr.best_step() == best
    _assert_restores(mngr, kept)
    mngr.close()
    # A fresh manager reads the metrics back and agrees on the best step.
    fresh = ocp.CheckpointManager(
        tmp_path,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, best_fn=lambda m: m["loss"], best_mode=mode
        ),
    )
    assert fresh.best_step() == best
    _assert_restores(fresh, [best])
    fresh.close()


def test_save_interval_steps(tmp_path: Path) -> None:
    mngr, accepted = _save_steps(tmp_path, save_interval_steps=3)
    assert accepted == [0, 3, 6]
    assert mngr.all_steps() == [0, 3, 6]
    _assert_restores(mngr, [0, 3, 6])
    mngr.close()


@needs_preservation_policies
def test_preservation_policy_latest_n(tmp_path: Path) -> None:
    mngr, _ = _save_steps(tmp_path, preservation_policy=policies.LatestN(n=2))
    assert mngr.all_steps() == [6, 7] and _dirs(tmp_path) == ["6", "7"]
    _assert_restores(mngr, [6, 7])
    mngr.close()


@needs_preservation_policies
def test_preservation_policy_combined(tmp_path: Path) -> None:
    policy = policies.AnyPreservationPolicy(
        [
            policies.LatestN(n=1),
            policies.EveryNSteps(interval_steps=5),
            # reverse=True: lower loss is better; step 3 has the lowest loss.
            policies.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1),
        ]
    )
    mngr, _ = _save_steps(tmp_path, metrics=True, preservation_policy=policy)
    assert mngr.all_steps() == [0, 3, 5, 7]
    _assert_restores(mngr, [0, 3, 5, 7])
    mngr.close()


def test_step_name_format(tmp_path: Path) -> None:
    def name_format() -> Any:
        return ocp.step.standard_name_format(step_prefix="ckpt", step_format_fixed_length=5)

    mngr, _ = _save_steps(tmp_path, range(3), max_to_keep=2, step_name_format=name_format())
    assert _dirs(tmp_path) == ["ckpt_00001", "ckpt_00002"]
    assert (tmp_path / "ckpt_00002" / "default" / "model.safetensors").is_file()
    mngr.close()
    fresh = ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(step_name_format=name_format())
    )
    assert fresh.all_steps() == [1, 2] and fresh.latest_step() == 2
    _assert_restores(fresh, [1, 2])
    fresh.close()


@pytest.mark.parametrize("enabled", [True, False], ids=["async", "sync"])
def test_enable_async_checkpointing(tmp_path: Path, enabled: bool) -> None:
    mngr = ocp.CheckpointManager(
        tmp_path,
        options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=enabled),
    )
    for step in range(3):
        mngr.save(step, args=osf.SafetensorsSave(_state(step)))
        if not enabled:
            # Synchronous: the step is committed by the time save() returns.
            item = tmp_path / str(step) / "default"
            assert (item / "orbax_safetensors.json").is_file()
            assert not list(tmp_path.glob(f"*{_TMP}*"))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2]
    _assert_restores(mngr, [1, 2])
    mngr.close()


@pytest.mark.parametrize("mode", ["after-save", "mid-write"])
def test_sigkill_during_async_save_leaves_earlier_steps(tmp_path: Path, mode: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    for attempt in range(3):  # mid-write: on a starved machine the write may finish first
        root = tmp_path / f"attempt{attempt}"
        proc = subprocess.run(
            [sys.executable, __file__, str(root), mode],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        if proc.returncode != _TOO_LATE:
            break
    tmp_path = root
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert proc.stdout.strip() == "killing"
    # Orbax's temporary step directory is what the crash left behind; step 2 never committed.
    [tmp_step] = tmp_path.glob(f"2{_TMP}*")
    assert tmp_step.is_dir()
    assert not (tmp_path / "2").exists()
    if mode == "mid-write":
        [partial] = tmp_step.glob(f"default{_TMP}*")
        assert (partial / "model.safetensors").is_file()
        assert not (partial / "orbax_safetensors.json").exists()  # finalize never ran
    # The library skips it, whichever form its name has.
    assert [(s.step, s.committed) for s in _steps.scan_steps(tmp_path)] == [(1, True), (2, False)]

    fresh = ocp.CheckpointManager(tmp_path)
    assert fresh.all_steps() == [1] and fresh.latest_step() == 1
    restored = fresh.restore(1, args=osf.SafetensorsRestore())
    np.testing.assert_array_equal(restored["w"], np.arange(6.0, dtype=np.float32))
    np.testing.assert_array_equal(restored["b"], np.ones((2, 3), np.float32))
    fresh.close()
    assert tmp_step.is_dir()  # left alone without the option

    cleaning = ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)
    )
    assert cleaning.all_steps() == [1]
    # The clean-up runs in the background; Orbax awaits it at the next save.
    cleaning.save(3, args=osf.SafetensorsSave(_state(3)))
    cleaning.wait_until_finished()
    assert not list(tmp_path.glob(f"*{_TMP}*"))
    assert cleaning.all_steps() == [1, 3] and _dirs(tmp_path) == ["1", "3"]
    _assert_restores(cleaning, [3])
    cleaning.close()


def test_resaving_over_a_stale_tmp_dir_without_cleanup(tmp_path: Path) -> None:
    mngr, _ = _save_steps(tmp_path, range(2))
    mngr.close()
    # Debris of a crashed save, named as this Orbax names its temporary directories.
    counter = "-0" if TMP_NAMES_COUNTED else ""
    stale_step = tmp_path / f"2{_TMP}{counter}"
    stale = stale_step / f"default{_TMP}{counter}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    again = ocp.CheckpointManager(tmp_path)
    assert again.all_steps() == [0, 1]
    again.save(2, args=osf.SafetensorsSave(_state(2)))
    again.wait_until_finished()
    assert again.all_steps() == [0, 1, 2]
    leftovers = [p.name for p in tmp_path.glob(f"*{_TMP}*")]
    if TMP_NAMES_COUNTED:
        # Each save takes a fresh "-<n>" name (a per-process counter), so the debris stays,
        # ignored by Orbax and by the library, until cleanup_tmp_directories removes it.
        assert leftovers == [stale_step.name]
        assert [s.committed for s in _steps.scan_steps(tmp_path)] == [True, True, True, False]
    else:
        assert leftovers == []  # the save of step 2 replaced its stale temporary directory
    _assert_restores(again, [0, 1, 2])
    again.close()


_TOO_LATE = 3  # the child's exit status when its save had finished before the kill


def _save_then_kill(root: str, mode: str) -> None:
    """Saves step 1 (committed), starts an async save of step 2, then SIGKILLs itself.

    MODE ``after-save`` kills right after ``save()`` returns; ``mid-write`` waits until the
    step's safetensors file exists (its bytes are being written), then kills. Either way the
    process never reaches ``wait_until_finished()``.
    """
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(1, args=osf.SafetensorsSave({"w": jnp.arange(6.0), "b": jnp.ones((2, 3))}))
    mngr.wait_until_finished()
    # 64 MiB: writing and fsyncing it usually takes far longer than the kill below.
    big = {f"w{i}": jnp.full((1024, 1024), i, jnp.float32) for i in range(16)}
    mngr.save(2, args=osf.SafetensorsSave(big))
    if mode == "mid-write":
        target = os.path.join(root, f"2{_TMP}*", f"default{_TMP}*", "model.safetensors")
        deadline = time.monotonic() + 60
        while not glob.glob(target) and time.monotonic() < deadline:
            time.sleep(0.0005)
        done = os.path.join(root, f"2{_TMP}*", f"default{_TMP}*", "orbax_safetensors.json")
        if glob.glob(done) or os.path.isdir(os.path.join(root, "2")):
            os._exit(_TOO_LATE)  # the save finished before the kill: not mid-write, try again
    print("killing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _save_then_kill(sys.argv[1], sys.argv[2])
