"""Which steps are committed (issue 15, point 7): ``inspect``, ``verify`` and every step listing
agree with Orbax's ``mngr.all_steps()``.

Everything is real: an Orbax ``CheckpointManager`` writes real steps with ``osf.SafetensorsSave``;
a saver subprocess SIGKILLs itself in the middle of a save (commit-file and atomic-rename
steps); old steps are damaged the way a kill during Orbax's cleanup of old steps leaves them
(files deleted); object stores are the local S3 and GCS test servers. The command line runs
in-process (``cli.main``) and once as ``python -m orbax_safetensors.cli``.

Run as a script, this file is the saver (``python tests/orbax/test_committed_steps.py ROOT MODE``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.orbax import steps as _steps

COMMIT_FILE = "commit-file"
ATOMIC_RENAME = "atomic-rename"
# Orbax's temporary names: "<name>.orbax-checkpoint-tmp", or "<name>.orbax-checkpoint-tmp-<n>"
# (orbax-checkpoint 0.11.11 to 0.11.15 at least): match both with f"{name}{_TMP}*".
_TMP = ".orbax-checkpoint-tmp"
# Before orbax-checkpoint 0.12.3 all_steps() never asks the manager's temporary_path_class: a
# final-named step on local disk counts with or without commit_success.txt, so it lists a
# commit-file step killed before its commit (the rule in orbax_safetensors/_src/orbax/steps.py).
ORBAX_VERSION = tuple(int(n) for n in re.findall(r"\d+", ocp.__version__)[:3])
LEGACY_COMMIT_RULE = ORBAX_VERSION < (0, 12, 3)

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- helpers


def _options(mode: str, **kwargs: Any) -> ocp.CheckpointManagerOptions:
    """Orbax's options for a root of ``mode`` (atomic rename is Orbax's default on local disk)."""
    if mode == COMMIT_FILE:
        kwargs["temporary_path_class"] = ocp.path.atomicity.CommitFileTemporaryPath
    return ocp.CheckpointManagerOptions(**kwargs)


def _state(step: int) -> dict[str, Any]:
    return {
        "params": {"w": np.full((4, 3), step, np.float32), "b": np.arange(3, dtype=np.int32)},
        "count": np.int64(step),
    }


def _orbax_steps(root: Any, options: ocp.CheckpointManagerOptions) -> list[int]:
    """What a fresh Orbax manager on ``root`` lists."""
    with ocp.CheckpointManager(root, options=options) as mngr:
        return list(mngr.all_steps())


def _run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _inspect_json(capsys: pytest.CaptureFixture[str], root: Any) -> dict[str, Any]:
    code, out, err = _run(capsys, "inspect", root, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


def _verify_json(capsys: pytest.CaptureFixture[str], root: Any) -> tuple[int, dict[str, Any]]:
    code, out, _ = _run(capsys, "verify", root, "--json")
    doc: dict[str, Any] = json.loads(out)
    return code, doc


def _assert_tools_agree(
    capsys: pytest.CaptureFixture[str], root: Any, orbax_steps: list[int]
) -> dict[str, Any]:
    """inspect, verify and list_steps list exactly ``orbax_steps``; returns inspect's JSON."""
    assert [n for n, _ in _steps.list_steps(root)] == orbax_steps
    assert [s.step for s in _steps.scan_steps(root) if s.committed] == orbax_steps
    doc = _inspect_json(capsys, root)
    assert doc["kind"] == "root"
    assert [s["step"] for s in doc["steps"]] == orbax_steps
    assert doc["latest_step"] == (orbax_steps[-1] if orbax_steps else None)
    checked = {str(epath.Path(s["path"])) for s in doc["steps"]}
    report = osf.verify(root)
    assert not checked & set(report.skipped)  # nothing listed is skipped, nothing skipped listed
    uncommitted = {str(epath.Path(u["path"])) for u in doc["uncommitted"]}
    assert set(report.skipped) == uncommitted
    return doc


# --------------------------------------------------------------------------- the saver subprocess


def _save_then_crash(root: str, mode: str) -> None:
    """Commits steps 0 and 1, starts an async save of step 2 and SIGKILLs itself while step
    2's safetensors file is being written (its step directory and metadata exist)."""
    import jax.numpy as jnp

    mngr = ocp.CheckpointManager(root, options=_options(mode, max_to_keep=3))
    for step in (0, 1):
        mngr.save(step, args=osf.SafetensorsSave(_state(step)))
    mngr.wait_until_finished()
    # 64 MiB: writing and fsyncing it takes far longer than the kill below.
    big = {f"w{i}": jnp.full((1024, 1024), i, jnp.float32) for i in range(16)}
    mngr.save(2, args=osf.SafetensorsSave(big))
    step_dir = "2" if mode == COMMIT_FILE else f"2{_TMP}*"
    # The item is "default" or "default.orbax-checkpoint-tmp*" (Orbax < 0.12 uses the
    # temporary name in commit-file mode too).
    wanted = [
        os.path.join(root, step_dir, "default*", "model.safetensors"),
        os.path.join(root, step_dir, "_CHECKPOINT_METADATA"),
    ]
    deadline = time.monotonic() + 60
    while not all(glob.glob(p) for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_mid_save(root: Path, mode: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, __file__, str(root), mode], env=env, capture_output=True, timeout=240
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]


# --------------------------------------------------------------------------- the rule


def test_handler_typestr_is_the_handlers() -> None:
    assert osf.SafetensorsCheckpointHandler.typestr() == _steps.HANDLER_TYPESTR


def test_the_commit_rule_follows_the_installed_orbax() -> None:
    assert _orbaxcompat.orbax_uses_legacy_commit_rule() == LEGACY_COMMIT_RULE, ocp.__version__


@pytest.mark.parametrize("mode", [COMMIT_FILE, ATOMIC_RENAME])
def test_a_step_killed_mid_save_is_uncommitted_everywhere(
    mode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A save killed mid-write leaves step 2 behind: under its final name without
    commit_success.txt (commit file) or as 2.orbax-checkpoint-tmp[-<n>] (atomic rename). Orbax
    lists [0, 1]; so do inspect and verify, which report step 2 as uncommitted and never check
    it. (Orbax < 0.12.3 lists the commit-file step 2: _check_listed_killed_step.)"""
    root = tmp_path / "run"
    _crash_mid_save(root, mode)
    [partial] = [root / "2"] if mode == COMMIT_FILE else root.glob(f"2{_TMP}*")
    assert partial.is_dir() and not (partial / "commit_success.txt").exists()
    if mode == COMMIT_FILE:
        assert not list(root.glob(f"2{_TMP}*"))  # the final name from the start

    orbax_steps = _orbax_steps(root, _options(mode, read_only=True))
    if mode == COMMIT_FILE and LEGACY_COMMIT_RULE:
        _check_listed_killed_step(capsys, root, partial, orbax_steps)
        return
    assert orbax_steps == [0, 1]
    doc = _assert_tools_agree(capsys, root, orbax_steps)
    [uncommitted] = doc["uncommitted"]
    assert uncommitted["step"] == 2 and uncommitted["name"] == partial.name
    expected = "never finalized" if mode == COMMIT_FILE else "temporary directory"
    assert expected in uncommitted["reason"]
    assert all(s["status"] == "ok" and s["num_tensors"] == 3 for s in doc["steps"])

    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0 and "2 steps" in out and "latest step: 1" in out
    assert f"uncommitted (not listed by Orbax): {partial.name}: " in out

    report = osf.verify(root)
    assert report.ok, report.problems
    assert report.skipped == [str(partial)] and report.incomplete == []
    assert report.files == 2 and report.tensors == 6  # steps 0 and 1 only
    code, out, _ = _run(capsys, "verify", root)
    assert code == 0 and f"skipped uncommitted {partial}" in out

    # Named directly, the uncommitted step is reported as such, not checked as complete.
    direct = osf.verify(partial)
    assert not direct.ok and direct.files == 0 and direct.skipped == [str(partial)]
    assert "uncommitted step" in direct.problems[0]
    code, out, err = _run(capsys, "inspect", partial)
    assert "uncommitted step" in out + err

    # Orbax itself restores the latest committed step.
    with ocp.CheckpointManager(root, options=_options(mode, read_only=True)) as mngr:
        restored = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore())
    assert int(restored["count"]) == 1


def _check_listed_killed_step(
    capsys: pytest.CaptureFixture[str], root: Path, partial: Path, orbax_steps: list[int]
) -> None:
    """Orbax < 0.12.3 lists the killed commit-file step 2 (on local disk it never looks for
    commit_success.txt); so do inspect and verify, as the incomplete latest step: its item
    never got its final name ("default.orbax-checkpoint-tmp*" only)."""
    assert orbax_steps == [0, 1, 2], ocp.__version__
    assert [p.name.startswith(f"default{_TMP}") for p in partial.iterdir() if p.is_dir()] == [True]
    doc = _assert_tools_agree(capsys, root, orbax_steps)
    assert doc["uncommitted"] == []
    assert [s["status"] for s in doc["steps"]] == ["ok", "ok", "incomplete"]
    assert doc["steps"][2]["missing"] == ["default/"]
    warning = (
        "step 2 is incomplete (missing default/) and is the latest step: restoring it fails; "
        "restore an earlier step"
    )
    assert doc["warnings"] == [warning]
    report = osf.verify(root)
    assert not report.ok and report.incomplete == [str(partial)]
    assert report.warnings == [warning] and report.files == 2 and report.tensors == 6
    code, out, _ = _run(capsys, "verify", root)
    assert code == 1 and f"{partial}: incomplete step, missing default/" in out
    # Steps 0 and 1 restore as saved.
    with ocp.CheckpointManager(root, options=_options(COMMIT_FILE, read_only=True)) as mngr:
        restored = mngr.restore(1, args=osf.SafetensorsRestore())
    assert int(restored["count"]) == 1


def test_a_local_commit_file_step_without_commit_time_or_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The two local-disk cases of rule 4 (see _src/orbax/steps.py): without its commit file a step
    whose _CHECKPOINT_METADATA has no commit time is uncommitted; with a commit time it is
    committed, as Orbax's default (atomic rename) manager counts it. Orbax < 0.12.3 counts
    both, whatever the manager's class, and so do the tools there."""
    root = tmp_path / "run"
    with ocp.CheckpointManager(root, options=_options(COMMIT_FILE)) as mngr:
        for step in (0, 1, 2):
            mngr.save(step, args=osf.SafetensorsSave(_state(step)))
        mngr.wait_until_finished()
    for step in (1, 2):
        (root / str(step) / "commit_success.txt").unlink()
    meta = root / "2" / "_CHECKPOINT_METADATA"
    doc = json.loads(meta.read_text())
    doc["commit_timestamp_nsecs"] = None  # as a kill before the commit leaves it
    meta.write_text(json.dumps(doc))

    commit_file_steps = _orbax_steps(root, _options(COMMIT_FILE, read_only=True))
    assert _orbax_steps(root, _options(ATOMIC_RENAME, read_only=True)) == [0, 1, 2]
    if LEGACY_COMMIT_RULE:
        assert commit_file_steps == [0, 1, 2], ocp.__version__
        inspected = _assert_tools_agree(capsys, root, [0, 1, 2])
        assert inspected["uncommitted"] == []
    else:
        assert commit_file_steps == [0]
        # Step 1 is ambiguous on local disk (see the rule in _src/orbax/steps.py): listed, like the
        # default manager does; step 2 cannot have been left by atomic rename under its final
        # name.
        inspected = _assert_tools_agree(capsys, root, [0, 1])
        assert [u["step"] for u in inspected["uncommitted"]] == [2]
    assert osf.verify(root).ok


# --------------------------------------------------------------------------- half-deleted steps


@pytest.fixture(scope="module")
def trained_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 0-3 of a training loop, every step a real CheckpointManager save."""
    root = tmp_path_factory.mktemp("trained") / "run"
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=4)) as mngr:
        for step in range(4):
            mngr.save(step, args=osf.SafetensorsSave(_state(step)))
        mngr.wait_until_finished()
    return root


# What a kill during Orbax's deletion of old step 0 can leave (it deletes file by file, in no
# fixed order), and what is then reported missing (every order, and steps of several items:
# tests/hostile/test_half_deleted_steps.py).
DAMAGE = {
    "data-file": (["default/model.safetensors"], ["default/model.safetensors"]),
    "metadata-file": (["default/orbax_safetensors.json"], ["default/orbax_safetensors.json"]),
    "whole-item": (["default"], ["default/"]),
    "step-files-first": (
        ["commit_success.txt", "_CHECKPOINT_METADATA", "default/model.safetensors"],
        ["_CHECKPOINT_METADATA", "default/model.safetensors"],
    ),
    # The step's metadata alone: restore could still read the item, but the step is being
    # deleted and which items it had is gone with that file.
    "step-metadata": (["_CHECKPOINT_METADATA"], ["_CHECKPOINT_METADATA"]),
    # All but the directory itself: Orbax lists the empty directory still.
    "emptied": (
        ["commit_success.txt", "_CHECKPOINT_METADATA", "default"],
        ["_CHECKPOINT_METADATA"],
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_half_deleted_old_step_is_incomplete_and_the_others_are_checked(
    damage: str, trained_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    shutil.copytree(trained_root, root)
    removed, missing = DAMAGE[damage]
    for name in removed:
        target = root / "0" / name
        if target.is_dir():
            shutil.rmtree(target)
        else:  # Orbax < 0.12.3 writes no commit_success.txt in atomic-rename mode
            target.unlink(missing_ok=name == "commit_success.txt")
    old = root / "0"

    options = ocp.CheckpointManagerOptions(read_only=True)
    orbax_steps = _orbax_steps(root, options)
    assert orbax_steps == [0, 1, 2, 3]  # Orbax still lists the half-deleted step
    with ocp.CheckpointManager(root, options=options) as mngr:
        restored = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore())
    assert int(restored["count"]) == 3

    # inspect: every step listed, step 0 marked incomplete, a warning line.
    doc = _assert_tools_agree(capsys, root, orbax_steps)
    assert doc["uncommitted"] == []
    first, *others = doc["steps"]
    assert first["status"] == "incomplete" and first["missing"] == missing
    assert first["num_tensors"] is None and "missing " + missing[0] in first["problem"]
    assert [(s["status"], s["num_tensors"]) for s in others] == [("ok", 3)] * 3
    [warning] = doc["warnings"]
    assert warning.startswith(f"step 0 is incomplete (missing {', '.join(missing)})")
    assert "older than the latest step 3" in warning and str(old) in warning
    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0 and "4 steps" in out and "latest step: 3" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows["0"].endswith("INCOMPLETE") and all(rows[s].endswith("OK") for s in "123")
    assert f"warning: {warning}" in out

    # verify: the three intact steps checked, step 0 a problem (exit 1) plus the warning.
    report = osf.verify(root)
    assert not report.ok and report.incomplete == [str(old)]
    [problem] = report.problems
    assert problem.startswith(f"{old}: incomplete step, missing {', '.join(missing)}")
    assert report.files == 3 and report.tensors == 9 and report.warnings == [warning]
    code, verified = _verify_json(capsys, root)
    assert code == 1 and verified["incomplete"] == [str(old)]
    assert verified["warnings"] == [warning] and verified["problems"] == [problem]
    code, out, _ = _run(capsys, "verify", root)
    assert code == 1 and "DAMAGED (1 problem)" in out and f"warning: {warning}" in out
    assert osf.verify(root / "1").ok

    # Orbax's next cleanup deletes the old step; then all is well.
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=3)) as mngr:
        mngr.save(4, args=osf.SafetensorsSave(_state(4)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3, 4]
    assert osf.verify(root).ok
    assert _inspect_json(capsys, root)["warnings"] == []


def test_the_issue_command_lists_the_other_steps(trained_root: Path, tmp_path: Path) -> None:
    """As reported: ``orbax-safetensors inspect ROOT`` exited 2 naming the missing file."""
    root = tmp_path / "run"
    shutil.copytree(trained_root, root)
    (root / "1" / "default" / "model.safetensors").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "orbax_safetensors.cli", "inspect", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "4 steps" in done.stdout and "latest step: 3" in done.stdout
    assert "warning: step 1 is incomplete (missing default/model.safetensors)" in done.stdout


def test_an_incomplete_latest_step(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(trained_root, root)
    (root / "3" / "default" / "orbax_safetensors.json").unlink()
    report = osf.verify(root)
    assert not report.ok and report.incomplete == [str(root / "3")]
    assert report.warnings == [
        "step 3 is incomplete (missing default/orbax_safetensors.json) and is the latest "
        "step: restoring it fails; restore an earlier step"
    ]
    direct = osf.verify(root / "3")  # the step named directly: the same problem
    assert direct.problems == report.problems and direct.incomplete == report.incomplete


# --------------------------------------------------------------------------- object stores


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_object_store_steps_need_their_commit_file(
    kind: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """On s3:// (manager_options_for) and gs:// (Orbax's default) a step counts only with
    commit_success.txt: a step without it is uncommitted for Orbax, inspect and verify."""
    bucket = request.getfixturevalue(f"{kind}_bucket")
    root = f"{bucket}/run"
    options = osf.manager_options_for(root, enable_async_checkpointing=False)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in (0, 1, 2):
            mngr.save(step, args=osf.SafetensorsSave(_state(step)))
    (epath.Path(root) / "2" / "commit_success.txt").unlink()  # as before its commit
    (epath.Path(root) / "0" / "default" / "model.safetensors").unlink()  # as a cleanup crash

    orbax_steps = _orbax_steps(root, osf.manager_options_for(root, read_only=True))
    assert orbax_steps == [0, 1]
    doc = _assert_tools_agree(capsys, root, orbax_steps)
    [uncommitted] = doc["uncommitted"]
    assert uncommitted["step"] == 2 and "no commit_success.txt" in uncommitted["reason"]
    assert [s["status"] for s in doc["steps"]] == ["incomplete", "ok"]
    report = osf.verify(root)
    assert not report.ok and report.files == 1 and report.tensors == 3
    assert report.incomplete == [f"{root}/0"] and report.skipped == [f"{root}/2"]


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _save_then_crash(sys.argv[1], sys.argv[2])
