"""Process plumbing for the local object stores: free loopback ports, spawning a server in its
own session with a watchdog, waiting until it answers, stopping its process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .model import LOOPBACK, ObjectStoreServer, ObjectStoreStartError

_WATCHDOG_SOURCE = """
import os, shutil, signal, sys, time
parent, pgid, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
while os.getppid() == parent and alive(pgid):
    time.sleep(0.5)
if alive(pgid):
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass
"""


# --------------------------------------------------------------------------- processes


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int, *, pair_offset: int | None = None) -> list[int]:
    """Returns ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets are held open together so the ports are distinct; a small race with other
    processes remains, which :func:`start_server` absorbs by retrying.

    Args:
      count: Number of ports.
      pair_offset: If given, the first two ports are ``p`` and ``p + pair_offset``.
    """
    sockets: list[socket.socket] = []
    try:
        if pair_offset is not None:
            for _ in range(200):
                first = _bind(0)
                assert first is not None
                port = first.getsockname()[1]
                second = _bind(port + pair_offset) if port + pair_offset < 65536 else None
                if second is not None:
                    sockets += [first, second]
                    break
                first.close()
            else:
                raise ObjectStoreStartError(f"No free port pair {pair_offset} apart.")
        while len(sockets) < count:
            sock = _bind(0)
            assert sock is not None
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def spawn(argv: Sequence[str], workdir: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Starts ``argv`` in a new session with output going to ``workdir/server.log``."""
    with open(workdir / "server.log", "wb") as log:
        return subprocess.Popen(
            list(argv),
            cwd=workdir,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def spawn_watchdog(pgid: int, paths: Sequence[Path]) -> subprocess.Popen[bytes]:
    """Starts a process that stops ``pgid`` and removes ``paths`` if this process dies."""
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG_SOURCE, str(os.getpid()), str(pgid), *map(str, paths)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def kill_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group of ``process``; SIGKILL it after ``timeout`` seconds."""
    if process.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # stray children, if any
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def remove_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def stop_server(server: ObjectStoreServer, timeout: float = 15.0) -> None:
    """Stops ``server`` by process group id and removes its temporary files.

    Safe to call more than once.
    """
    if server.watchdog is not None and server.watchdog.poll() is None:
        server.watchdog.kill()
        server.watchdog.wait()
    kill_group(server.process, timeout)
    remove_paths(server.cleanup_paths)


def http_status(url: str, *, method: str = "GET", timeout: float = 2.0) -> int | None:
    """HTTP status of ``url`` on the loopback interface, or None if nothing answered."""
    request = urllib.request.Request(url, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(
    process: subprocess.Popen[bytes],
    probe: Any,
    *,
    name: str,
    deadline: float,
    log_path: Path,
) -> None:
    """Polls ``probe()`` until it returns True, the process exits, or ``deadline`` passes."""
    last_error: BaseException | None = None
    while True:
        if process.poll() is not None:
            raise ObjectStoreStartError(
                f"{name} exited with code {process.returncode} during startup.\n"
                f"Log ({log_path}):\n{_tail(log_path)}"
            )
        try:
            if probe():
                return
        except Exception as error:
            last_error = error
        if time.monotonic() > deadline:
            raise ObjectStoreStartError(
                f"{name} did not become ready in time (last probe error: {last_error!r}).\n"
                f"Log ({log_path}):\n{_tail(log_path)}"
            )
        time.sleep(0.1)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def no_proxy_env() -> dict[str, str]:
    """NO_PROXY/no_proxy extended with the loopback names, so no proxy sees test traffic."""
    current = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    hosts = [h for h in current.split(",") if h.strip()]
    hosts += [h for h in (LOOPBACK, "localhost") if h not in hosts]
    value = ",".join(hosts)
    return {"NO_PROXY": value, "no_proxy": value}
