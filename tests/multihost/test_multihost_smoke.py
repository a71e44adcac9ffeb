"""Real multi-process JAX: the launcher and worker_lib, checked end to end (no mocks)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost import launcher
    from multihost.launcher import FAILURE_GRACE_S, PORT_CONFLICT, run_workers
except ImportError:  # tests/ became a package
    from tests.multihost import launcher  # type: ignore[no-redef]
    from tests.multihost.launcher import FAILURE_GRACE_S, PORT_CONFLICT, run_workers

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def stolen_port_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """One 2-process smoke launch whose first coordinator port is taken: the retry on a fresh
    port runs the whole smoke worker, so it serves both tests below (one launch, not two)."""
    log_dir = tmp_path_factory.mktemp("stolen_port")
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        stolen = thief.getsockname()[1]
        results = run_workers(
            "smoke_worker.py",
            2,
            devices_per_process=2,
            args={"shape": [8, 4]},
            port=stolen,
            log_dir=log_dir,
        )
    return results, log_dir


def test_two_processes_share_a_global_array(stolen_port_run: tuple[list[Any], Path]) -> None:
    results, _ = stolen_port_run

    assert [r.returncode for r in results] == [0, 0]
    for pid, r in enumerate(results):
        res = r.result
        assert res["process_index"] == pid
        assert res["process_count"] == 2
        assert res["device_count"] == 4
        assert res["local_device_count"] == 2
        assert res["local_device_processes"] == [pid, pid]
        assert res["is_fully_addressable"] is False
        assert res["num_addressable_shards"] == 2
        assert res["replica_ids"] == [0, 0]
        assert res["shards_ok"] is True
        assert res["total"] == res["expected_total"] == sum(range(32))
        assert res["allgathered_ids"] == [[0, 0], [1, 10]]
        assert res["gathered_equals_global"] is True


def test_failing_worker_fails_fast_with_its_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as excinfo:
        run_workers("fail_worker.py", 2, args={"fail_process": 1}, log_dir=tmp_path)
    elapsed = time.monotonic() - start
    # The failing worker's last write is its traceback, just before it exits: time from there,
    # not from the start (starting two JAX processes on 2 busy cores alone can take 10 s).
    failed_at = (tmp_path / "attempt1" / "worker1.stderr").stat().st_mtime
    after_failure = time.time() - failed_at

    message = str(excinfo.value)
    # Without the fail-fast hook and the launcher's kill, the peer would wait in a barrier for
    # the 60 s distributed timeouts (or 100 s, jax 0.6's heartbeat).
    assert after_failure < FAILURE_GRACE_S + 5, (
        f"{after_failure:.1f} s after the failure:\n{message}"
    )
    assert elapsed < 45, f"took {elapsed:.1f} s:\n{message}"
    assert "Traceback (most recent call last)" in message
    assert "ValueError: intentional failure in process 1" in message
    assert "worker 0: killed by the launcher after a peer failed" in message
    assert "[Gloo]" not in message


def _hung_run(tmp_path: Path, timeout: float) -> tuple[float, str]:
    # hang_worker.py in 2 processes: seconds until the launcher gave up, and its message
    start = time.monotonic()
    with pytest.raises(AssertionError) as excinfo:
        run_workers("hang_worker.py", 2, timeout=timeout, log_dir=tmp_path)
    message = str(excinfo.value)
    assert 'hang_worker.py", line' in message  # faulthandler's dump of the sleeping frame
    # A hang outside JAX's collectives is not retried (see launcher.COLLECTIVE_HANG).
    assert not (tmp_path / "attempt2").exists()
    return time.monotonic() - start, message


def test_hung_worker_is_killed_at_timeout_with_its_stack(tmp_path: Path) -> None:
    elapsed, message = _hung_run(tmp_path, timeout=2.0)
    assert elapsed < 10, f"took {elapsed:.1f} s:\n{message}"
    assert "timed out" in message


def test_workers_idle_together_are_ended_before_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a window of 3 s instead of launcher.IDLE_HANG_S: the same watch, in a few seconds)
    monkeypatch.setattr(launcher, "IDLE_HANG_S", 3.0)
    elapsed, message = _hung_run(tmp_path, timeout=120.0)
    assert elapsed < 40, f"took {elapsed:.1f} s:\n{message}"
    assert "every worker idle for 3 s" in message


def test_a_gloo_context_that_timed_out_is_told_apart() -> None:
    # (the line jax 0.6's workers printed in CI; a run with it is retried once, as a hang)
    line = (
        "jaxlib.xla_extension.XlaRuntimeError: UNKNOWN: Buffer Definition Event: Gloo context "
        "initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out with key: "
        "cpu:gloo/0,1,131072,131073/1 and duration: 29.99999996s"
    )
    failed = launcher.WorkerResult(0, 1, "", line, None, False)
    other = launcher.WorkerResult(1, 1, "", "ValueError: intentional failure", None, False)
    assert launcher._is_gloo_join_timeout(launcher._Run([failed, other], 1, 40.0, False))
    assert not launcher._is_gloo_join_timeout(launcher._Run([other], 1, 40.0, False))


def test_stolen_coordinator_port_is_retried(stolen_port_run: tuple[list[Any], Path]) -> None:
    results, tmp_path = stolen_port_run

    assert all(r.result["is_fully_addressable"] is False for r in results)
    first_try = (tmp_path / "attempt1" / "worker0.stderr").read_text()
    # "Failed to add port to server" (jax >= 0.7) or gRPC's "Address already in use" (jax 0.6).
    assert PORT_CONFLICT.search(first_try), first_try[-2000:]
    assert "Failed to add port to server" in first_try or "Address already in use" in first_try
    assert (tmp_path / "attempt2").is_dir()
