"""The device's real limit, measured the way storage engineers measure it: ``fio``.

Two jobs over the same byte count as the checkpoint:

- **write until durable**: a sequential write of a new file, ``end_fsync=1`` (the time
  includes making it durable, as every method's save does);
- **O_DIRECT sequential read**: the same file read with ``direct=1`` (no page cache: the
  device, even when the file's pages are cached).

Which job settings give the best bandwidth depends on the machine (queue depth, block size,
direct or buffered writes), so :func:`calibrate` tries a small grid once per benchmark run and
keeps the fastest of each; the report states them. ``fio`` itself comes from the system's
package manager: :func:`ensure_fio` installs it (``apt-get install -y fio``) when it can.

Example::

    settings = calibrate(Path("/var/tmp/x"), 1 << 30)
    seconds = run_fio(Path("/var/tmp/x/device.bin"), 1 << 30, settings["write"], write=True)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

FIO_FILE = "device.bin"

# Candidate job settings (``fio`` option -> value); ``rw``, ``size`` and ``filename`` are added.
WRITE_CANDIDATES: list[dict[str, str]] = [
    {"ioengine": "libaio", "direct": "1", "iodepth": "16", "bs": "1M"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "4", "bs": "8M"},
    {"ioengine": "psync", "direct": "0", "bs": "1M"},
    {"ioengine": "psync", "direct": "0", "bs": "8M"},
]
READ_CANDIDATES: list[dict[str, str]] = [
    {"ioengine": "libaio", "direct": "1", "iodepth": "16", "bs": "1M"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "32", "bs": "256k"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "8", "bs": "4M"},
]


def ensure_fio() -> str | None:
    """Returns None when ``fio`` is on PATH (installing it with apt-get as root if needed),
    else the reason it is not."""
    if shutil.which("fio"):
        return None
    if shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "fio"],
            capture_output=True,
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if shutil.which("fio"):
            return None
    return "fio is not installed (apt-get install fio)"


def run_fio(path: Path, nbytes: int, settings: dict[str, str], *, write: bool) -> float:
    """Runs one fio job over ``nbytes`` of ``path``; returns its wall time in seconds
    (fio's own runtime plus, for writes, the end fsync)."""
    cmd = [
        "fio",
        "--name=device",
        f"--filename={path}",
        f"--size={nbytes}",
        f"--rw={'write' if write else 'read'}",
        "--output-format=json",
        "--numjobs=1",
        "--thread",
        *(["--end_fsync=1", "--fallocate=none"] if write else ["--invalidate=1"]),
        *(f"--{key}={value}" for key, value in settings.items()),
    ]
    # fio moves whole blocks (direct I/O needs them aligned): round up to the block size and
    # scale the time back to ``nbytes`` (under 1% at 256 MiB and up).
    block = _parse_bytes(settings.get("bs", "4k"))
    size = -(-nbytes // block) * block
    cmd[3] = f"--size={size}"
    if write and path.exists():
        path.unlink()  # a new file each time, as a checkpoint is
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    side = job["write" if write else "read"]
    if side["io_bytes"] < nbytes:
        raise RuntimeError(f"fio moved {side['io_bytes']} of {nbytes} bytes")
    # job_runtime (ms) covers the I/O and, with end_fsync, the final fsync.
    return float(job["job_runtime"]) / 1000.0 * nbytes / side["io_bytes"]


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def calibrate(directory: Path, nbytes: int, rounds: int = 2) -> dict[str, Any]:
    """Tries every candidate ``rounds`` times on ``nbytes`` (capped at 1 GiB) in
    ``directory`` and returns the fastest write and read settings with their bandwidths."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FIO_FILE
    size = min(nbytes, 1 << 30)
    best: dict[str, Any] = {}
    for kind, candidates in (("write", WRITE_CANDIDATES), ("read", READ_CANDIDATES)):
        timings: list[tuple[float, dict[str, str]]] = []
        for settings in candidates:
            seconds: list[float] = []
            for _ in range(rounds):
                if kind == "read" and not path.exists():
                    run_fio(path, size, WRITE_CANDIDATES[0], write=True)
                seconds.append(run_fio(path, size, settings, write=kind == "write"))
            timings.append((sorted(seconds)[len(seconds) // 2], settings))
        best[kind] = min(timings, key=lambda t: t[0])[1]
        best[f"{kind}_calibration"] = [{"settings": s, "gb_s": size / t / 1e9} for t, s in timings]
    path.unlink(missing_ok=True)
    return best


def describe(settings: dict[str, str]) -> str:
    """``ioengine=libaio direct=1 iodepth=16 bs=1M`` for the report."""
    return " ".join(f"{k}={v}" for k, v in settings.items())
