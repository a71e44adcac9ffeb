"""Disk full: a save that runs out of space fails clearly and leaves earlier steps intact.

Two real ways to fill a disk:
  * a small tmpfs mounted for the test (needs root; skipped otherwise): writes fail with ENOSPC
    in the middle of the data;
  * ``RLIMIT_FSIZE`` with SIGXFSZ ignored, in a subprocess: any file growing past the limit
    fails with EFBIG.

Either way the error surfaces from ``save()`` or ``wait_until_finished()`` naming the file, the
failed step is never listed, earlier steps restore bit for bit, and ``save_file`` leaves no
partial file at (or beside) its destination.

Run as a script, this file is the RLIMIT_FSIZE subprocess (``python tests/storage/test_disk_full.py``).
"""

from __future__ import annotations

import errno
import json
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from managers import script_env, state_manager  # (tests/: on sys.path, PYTHONPATH)

import orbax_safetensors as osf

pytestmark = pytest.mark.timeout(300)


def _state(step: int, nbytes: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.integers(0, 256, nbytes, dtype=np.uint8).reshape(-1, 1024),
        "step": step,
    }


def _save(mngr: ocp.CheckpointManager, step: int, nbytes: int) -> str:
    """Saves and waits; returns where an error surfaced ("" when none)."""
    args = ocp.args.Composite(state=osf.SafetensorsSave(_state(step, nbytes)))
    try:
        mngr.save(step, args=args)
    except OSError:
        return "save"
    try:
        mngr.wait_until_finished()
    except OSError:
        return "wait_until_finished"
    return ""


def _restore(root: Path, step: int) -> dict[str, Any]:
    with state_manager(root, read_only=True) as mngr:
        args = ocp.args.Composite(state=osf.SafetensorsRestore())
        return mngr.restore(step, args=args)["state"]


def _assert_intact(root: Path, steps: list[int], nbytes: int) -> None:
    with state_manager(root, read_only=True) as mngr:
        assert mngr.all_steps() == steps
    for step in steps:
        restored = _restore(root, step)
        assert np.array_equal(restored["w"], _state(step, nbytes)["w"]) and restored["step"] == step
    report = osf.verify(root)
    assert report.ok, report.problems


def _no_partial_files(directory: Path, name: str, old: dict[str, Any]) -> None:
    assert sorted(p.name for p in directory.iterdir() if name in p.name) == [name]
    assert np.array_equal(osf.load_file(directory / name)["w"], old["w"])


# --------------------------------------------------------------------------- tmpfs (ENOSPC)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs, or a skip when this process may not mount one."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_mid_write_on_a_full_tmpfs(small_tmpfs: Path) -> None:
    root = small_tmpfs / "ckpts"
    with state_manager(root) as mngr:
        assert _save(mngr, 1, 2 << 20) == ""
        with pytest.raises(OSError) as info:  # 32 MiB cannot fit: fails inside the data
            mngr.save(2, args=ocp.args.Composite(state=osf.SafetensorsSave(_state(2, 32 << 20))))
            mngr.wait_until_finished()
        assert info.value.errno == errno.ENOSPC
        assert "model.safetensors" in str(info.value) and "No space left" in str(info.value)
        assert mngr.all_steps() == [1]
    assert any(".orbax-checkpoint-tmp" in p.name for p in root.iterdir())  # uncommitted
    _assert_intact(root, [1], 2 << 20)

    # Once the partial step is cleaned up (Orbax does it at start-up when asked), saving works.
    with state_manager(root, cleanup_tmp_directories=True) as mngr:
        assert _save(mngr, 3, 2 << 20) == ""
    _assert_intact(root, [1, 3], 2 << 20)


def test_save_file_on_a_full_tmpfs_leaves_the_old_file(small_tmpfs: Path) -> None:
    old = _state(1, 1 << 20)
    osf.save_file(old, small_tmpfs / "model.safetensors")
    with pytest.raises(OSError) as info:
        osf.save_file(_state(2, 32 << 20), small_tmpfs / "model.safetensors")
    assert info.value.errno == errno.ENOSPC and ".model.safetensors.tmp-" in str(info.value)
    _no_partial_files(small_tmpfs, "model.safetensors", old)
    osf.save_file(_state(3, 1 << 20), small_tmpfs / "model.safetensors")  # space came back


# --------------------------------------------------------------------------- RLIMIT_FSIZE (EFBIG)

_LIMIT = 8 << 20


def _limited_child(root: Path) -> dict[str, Any]:
    """Runs in a subprocess whose files may not grow past ``_LIMIT`` bytes."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (_LIMIT, _LIMIT))
    out: dict[str, Any] = {}
    with state_manager(root / "ckpts") as mngr:
        out["step1"] = _save(mngr, 1, 1 << 20)
        args = ocp.args.Composite(state=osf.SafetensorsSave(_state(2, 16 << 20)))
        try:
            mngr.save(2, args=args)
            mngr.wait_until_finished()
        except OSError as e:
            out["step2"] = [e.errno, str(e)]
        out["step2_listed"] = 2 in mngr.all_steps()
        out["step3"] = _save(mngr, 3, 1 << 20)  # the manager keeps working
    osf.save_file(_state(1, 1 << 20), root / "model.safetensors")
    try:
        osf.save_file(_state(2, 16 << 20), root / "model.safetensors")
    except OSError as e:
        out["save_file"] = [e.errno, str(e)]
    return out


def test_rlimit_fsize_in_a_subprocess(tmp_path: Path) -> None:
    env = script_env(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["step1"] == "" and out["step3"] == ""
    code, message = out["step2"]
    assert code == errno.EFBIG and "File too large" in message and "model.safetensors" in message
    assert out["step2_listed"] is False
    _assert_intact(tmp_path / "ckpts", [1, 3], 1 << 20)

    code, message = out["save_file"]
    assert code == errno.EFBIG and ".model.safetensors.tmp-" in message
    _no_partial_files(tmp_path, "model.safetensors", _state(1, 1 << 20))


if __name__ == "__main__":
    print(json.dumps(_limited_child(Path(sys.argv[1]))))
