"""Run a worker script in N real OS processes joined by ``jax.distributed`` on 127.0.0.1.

Example::

    from multihost.launcher import run_workers

    results = run_workers("smoke_worker.py", 2, args={"shape": [8, 4]})
    assert [r.result["process_index"] for r in results] == [0, 1]

See ``worker_lib`` for the worker side and /work/shared/MULTIHOST.md for the recipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import worker_lib

MULTIHOST_DIR = Path(__file__).resolve().parent
WORKERS_DIR = MULTIHOST_DIR / "workers"
REPO_ROOT = MULTIHOST_DIR.parent.parent

# After the first worker fails, its peers get this long to exit on their own before SIGKILL.
FAILURE_GRACE_S = 3.0
# On timeout, hung workers get this long to dump their Python stacks (SIGUSR1) before SIGKILL.
STACK_DUMP_GRACE_S = 1.0
# A run whose live workers together use less than IDLE_CPU_S of CPU time in IDLE_HANG_S is
# stuck (a deadlock: nothing computes, nothing moves), and is ended then as at its timeout:
# the Orbax barrier hangs that COLLECTIVE_HANG retries show every worker idle from the start,
# and would otherwise cost the whole timeout (300 s for some tests). Workers at work, even on a
# machine busy with other runs, use far more.
IDLE_HANG_S = 40.0
IDLE_CPU_S = 0.5
PORT_ATTEMPTS = 3
_POLL_S = 0.05
_MAX_REPORT_LINES = 150

# How a taken coordinator port shows: jax 0.7/0.10 log "Failed to add port to server" (and the
# peers time out in RegisterTask); jax 0.6's gRPC logs "No address added out of total 1 resolved"
# with "Address already in use" and the coordinator process dies of SIGSEGV.
# (The last alternative: workers that reached another job's coordinator on the same port, as
# when two test runs share the machine, collide on its gloo keys; a new port fixes it too.)
PORT_CONFLICT = re.compile(
    r"(?s)Failed to add port to server|DEADLINE_EXCEEDED.*RegisterTask"
    r"|No address added out of total \d+ resolved.*Address already in use"
    r"|Gloo context initialization failed: ALREADY_EXISTS: Config key"
)
# A job that timed out with every worker's stack dump inside JAX's cross-process collectives
# (``sync_global_devices`` / ``broadcast_one_to_all``, which Orbax's barriers run on gloo): seen
# on the floor stack (jax 0.6.0) under load, all processes in the same barrier of Orbax's step
# directory creation and one of them never completing it, with none of this library's code on
# any stack. Retried once on a fresh port, like a port conflict; a second hang fails the test.
COLLECTIVE_HANG = re.compile(r"jax/experimental/multihost_utils\.py")
# A gloo context that one device of the job did not join within XLA's fixed 30 s (its first
# collective on a device set): seen on the floor stack in CI, with the two CI lanes sharing
# the cores, at the first re-layout of a 4-process export. Retried once, like a hang: a
# collective that some process never calls fails the same way again.
GLOO_JOIN_TIMEOUT = re.compile(r"Gloo context initialization failed: DEADLINE_EXCEEDED")
# gloo chatter and native stack-trace lines that bury the Python traceback in failure reports.
_NOISE = re.compile(
    r"^\s*(\[Gloo\]|\*\*\* Check failure stack trace|@\s+0x[0-9a-f]+\s|#\d+\s+0x[0-9a-f]+)"
)


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """The outcome of one worker process.

    Attributes:
        process_id: The JAX process id the worker was given.
        returncode: Exit status; negative for a signal (``-9`` when the launcher killed it).
        stdout: Everything the worker printed on stdout.
        stderr: Everything the worker printed on stderr (unfiltered).
        result: The JSON value of the last ``worker_lib.emit_result`` line, or None.
        killed_by_launcher: True when the launcher SIGKILLed it (after a peer failed or on
            timeout) rather than it exiting on its own.
    """

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    result: Any
    killed_by_launcher: bool = False


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((worker_lib.LOOPBACK, 0))
        return int(s.getsockname()[1])


def filter_noise(text: str) -> str:
    """Drop gloo chatter (``[Gloo] ...``) and native stack-trace lines from a worker's output."""
    return "\n".join(line for line in text.splitlines() if not _NOISE.search(line))


def resolve_worker(worker: str | os.PathLike[str]) -> Path:
    """Find a worker script: the path as given, else a file of that name in ``workers/``."""
    path = Path(worker)
    for candidate in (path, WORKERS_DIR / path):
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"worker script {worker!r} not found (also looked in {WORKERS_DIR})")


def _parse_result(stdout: str) -> Any:
    prefix = worker_lib.RESULT_MARKER + " "
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :])
    return None


def _child_env(
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int,
    args: Mapping[str, Any],
    extra: Mapping[str, str] | None,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    # A device count forced through XLA_FLAGS (common in single-process test setups) would
    # fight JAX_NUM_CPU_DEVICES.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    extra = dict(extra or {})
    pythonpath = [str(MULTIHOST_DIR), str(MULTIHOST_DIR.parent / "helpers"), str(REPO_ROOT)]
    # A PYTHONPATH in ``extra`` (often a copy of os.environ's) is kept, after the workers' own.
    for given in (extra.pop("PYTHONPATH", None), env.get("PYTHONPATH")):
        if given and given not in pythonpath:
            pythonpath.append(given)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "PYTHONUNBUFFERED": "1",
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(devices_per_process),
            worker_lib.ENV_COORDINATOR: f"{worker_lib.LOOPBACK}:{port}",
            worker_lib.ENV_PROCESS_ID: str(process_id),
            worker_lib.ENV_NUM_PROCESSES: str(num_processes),
            worker_lib.ENV_DEVICES_PER_PROCESS: str(devices_per_process),
            worker_lib.ENV_ARGS: json.dumps(dict(args)),
        }
    )
    env.update(extra)
    return env


def _die_with_parent_preexec() -> Any:
    """A ``preexec_fn`` giving the child PR_SET_PDEATHSIG=SIGKILL (no orphans if we die)."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclasses.dataclass
class _Run:
    results: list[WorkerResult]
    port: int
    elapsed: float
    timed_out: bool
    stuck: bool = False  # ended early, every worker idle (_IdleWatch): timed_out too


def _launch_once(
    script: Path,
    num_processes: int,
    port: int,
    devices_per_process: int,
    args: Mapping[str, Any],
    timeout: float,
    env: Mapping[str, str] | None,
    log_dir: Path,
) -> _Run:
    """Start the N workers on ``port``, supervise them and collect their output."""
    preexec = _die_with_parent_preexec()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[tuple[Path, Path]] = []
    killed: set[int] = set()
    start = time.monotonic()
    try:
        for i in range(num_processes):
            out_path, err_path = log_dir / f"worker{i}.stdout", log_dir / f"worker{i}.stderr"
            logs.append((out_path, err_path))
            with out_path.open("wb") as out, err_path.open("wb") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script)],
                        env=_child_env(i, num_processes, port, devices_per_process, args, env),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        preexec_fn=preexec,
                    )
                )
        first_failure: float | None = None
        grace = FAILURE_GRACE_S
        timed_out = False
        idle = _IdleWatch([p.pid for p in procs], start)
        while [p.poll() for p in procs].count(None):  # poll every process each round
            now = time.monotonic()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
                # A port conflict dooms the peers too: no point waiting for them.
                grace = 0.0 if _logs_show_port_conflict(logs) else FAILURE_GRACE_S
            if first_failure is not None and now - first_failure > grace:
                break
            if now - start > timeout or idle.stuck(now):
                timed_out = True
                for p in procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(worker_lib.DUMP_STACKS_SIGNAL)
                time.sleep(STACK_DUMP_GRACE_S)
                break
            time.sleep(_POLL_S)
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                killed.add(i)
        for p in procs:
            p.wait()
    elapsed = time.monotonic() - start
    results = []
    for i, (p, (out_path, err_path)) in enumerate(zip(procs, logs)):
        stdout = out_path.read_text(errors="replace")
        results.append(
            WorkerResult(
                process_id=i,
                returncode=p.returncode,
                stdout=stdout,
                stderr=err_path.read_text(errors="replace"),
                result=_parse_result(stdout),
                killed_by_launcher=i in killed,
            )
        )
    return _Run(
        results=results, port=port, elapsed=elapsed, timed_out=timed_out, stuck=idle.verdict
    )


class _IdleWatch:
    """Whether the workers ``pids`` have together used less than ``IDLE_CPU_S`` of CPU time
    in the last ``IDLE_HANG_S`` (sampled once a second from ``/proc/PID/stat``; a worker that
    has exited counts with its last reading, so its end takes nothing off the sum)."""

    def __init__(self, pids: list[int], start: float) -> None:
        self.pids = pids
        self.last: dict[int, float] = {}  # pid -> its CPU seconds at its latest reading
        self.samples: list[tuple[float, float]] = [(start, self._cpu())]
        self.verdict = False

    def _cpu(self) -> float:
        for pid in self.pids:
            try:  # utime and stime: fields 14 and 15, after the command's parenthesis
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # (exited: its last reading stands)
            self.last[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return sum(self.last.values())

    def stuck(self, now: float) -> bool:
        if self.verdict or now - self.samples[-1][0] < 1.0:
            return self.verdict
        self.samples.append((now, self._cpu()))
        while len(self.samples) > 2 and now - self.samples[1][0] >= IDLE_HANG_S:
            self.samples.pop(0)  # (the oldest sample still IDLE_HANG_S back stays first)
        then, cpu = self.samples[0]
        self.verdict = now - then >= IDLE_HANG_S and self.samples[-1][1] - cpu < IDLE_CPU_S
        return self.verdict


def _is_port_conflict(run: _Run) -> bool:
    return any(PORT_CONFLICT.search(r.stderr + r.stdout) for r in run.results)


def _is_collective_hang(run: _Run) -> bool:
    return run.timed_out and all(COLLECTIVE_HANG.search(r.stderr) for r in run.results)


def _is_gloo_join_timeout(run: _Run) -> bool:
    return any(GLOO_JOIN_TIMEOUT.search(r.stderr) for r in run.results)


def _logs_show_port_conflict(logs: list[tuple[Path, Path]]) -> bool:
    return any(
        PORT_CONFLICT.search(path.read_text(errors="replace")) for pair in logs for path in pair
    )


def _tail(text: str, n: int = _MAX_REPORT_LINES) -> str:
    lines = filter_noise(text).splitlines()
    if len(lines) > n:
        lines = [f"... ({len(lines) - n} earlier lines omitted)", *lines[-n:]]
    return "\n".join(lines)


def _failure_report(script: Path, num_processes: int, run: _Run, log_dir: Path) -> str:
    """Describe a failed run: each failing worker's filtered stderr, brief notes on the rest."""
    head = f"{script.name} with {num_processes} processes (port {run.port})"
    if run.stuck:
        head += f" timed out after {run.elapsed:.1f} s, every worker idle for {IDLE_HANG_S:.0f} s"
    elif run.timed_out:
        head += f" timed out after {run.elapsed:.1f} s"
    else:
        head += f" failed after {run.elapsed:.1f} s"
    parts = [f"{head}; logs in {log_dir}"]
    for r in run.results:
        if r.killed_by_launcher and not run.timed_out:
            status = "killed by the launcher after a peer failed"
        elif r.killed_by_launcher:
            status = "killed by the launcher on timeout (Python stacks dumped below)"
        else:
            status = f"exit code {r.returncode}"
        parts.append(f"--- worker {r.process_id}: {status}")
        own_failure = r.returncode != 0 and not r.killed_by_launcher
        if own_failure or run.timed_out:
            parts.append(f"[stderr]\n{_tail(r.stderr)}")
            if r.stdout.strip():
                parts.append(f"[stdout]\n{_tail(r.stdout, 30)}")
        elif r.returncode != 0 and r.stderr.strip():
            parts.append(f"[stderr, last lines]\n{_tail(r.stderr, 10)}")
    return "\n".join(parts)


def run_workers(
    worker: str | os.PathLike[str],
    num_processes: int,
    *,
    devices_per_process: int = 2,
    args: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    log_dir: str | os.PathLike[str] | None = None,
    port: int | None = None,
) -> list[WorkerResult]:
    """Run ``python <worker>`` in ``num_processes`` processes forming one JAX job on 127.0.0.1.

    Each worker calls ``worker_lib.init()``, which reads the coordinator address, its process id,
    the process count, ``devices_per_process`` CPU devices and ``args`` (as JSON) from the
    environment. When a worker fails, its peers are SIGKILLed ``FAILURE_GRACE_S`` later; after
    ``timeout`` seconds all are dumped (SIGUSR1) and SIGKILLed. A run whose coordinator port was
    taken by another program is retried on a new port, up to ``PORT_ATTEMPTS`` times; so, once,
    is a run that timed out with every worker inside JAX's collectives (``COLLECTIVE_HANG``) or
    where a worker's gloo context timed out (``GLOO_JOIN_TIMEOUT``).

    Args:
        worker: Path of the worker script, or the name of a file in ``tests/multihost/workers/``.
        num_processes: Number of OS processes (JAX processes).
        devices_per_process: CPU devices per process (``JAX_NUM_CPU_DEVICES``).
        args: JSON-serialisable values handed to every worker as ``ctx.args``.
        timeout: Seconds for the whole run (per port attempt) before every worker is killed.
        env: Extra environment variables for the workers (applied last).
        check: Raise AssertionError unless every worker exits with 0.
        log_dir: Where the workers' stdout/stderr files go; default a temporary directory that is
            deleted after a successful run.
        port: Coordinator port for the first attempt (default: a free one); retries after a port
            conflict always pick a fresh port.

    Returns:
        One WorkerResult per process, in process-id order.

    Raises:
        AssertionError: ``check`` is set and a worker failed or the run timed out; the message
            holds each failing worker's traceback with gloo noise removed.
    """
    script = resolve_worker(worker)
    json.dumps(dict(args or {}))  # fail here, not in the children, on non-JSON args
    own_dir = log_dir is None
    base_dir = Path(tempfile.mkdtemp(prefix="multihost-")) if own_dir else Path(log_dir)
    hangs_retried = 0
    for attempt in range(1, PORT_ATTEMPTS + 1):
        run_dir = base_dir / f"attempt{attempt}"
        run_dir.mkdir(parents=True, exist_ok=True)
        run = _launch_once(
            script,
            num_processes,
            port if port is not None and attempt == 1 else free_port(),
            devices_per_process,
            args or {},
            timeout,
            env,
            run_dir,
        )
        ok = not run.timed_out and all(r.returncode == 0 for r in run.results)
        if ok or attempt == PORT_ATTEMPTS:
            break
        if (_is_collective_hang(run) or _is_gloo_join_timeout(run)) and not hangs_retried:
            hangs_retried += 1
            continue
        if not _is_port_conflict(run):
            break
    if ok and own_dir:
        shutil.rmtree(base_dir, ignore_errors=True)
    if check and not ok:
        raise AssertionError(_failure_report(script, num_processes, run, run_dir))
    return run.results
