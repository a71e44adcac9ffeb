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
    {"ioengine": "libaio", "direct": "1", "iodepth": "4", "bs": "8M", "numjobs": "2"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "16", "bs": "1M", "numjobs": "4"},
    {"ioengine": "psync", "direct": "0", "bs": "1M"},
    {"ioengine": "psync", "direct": "0", "bs": "8M", "numjobs": "2"},
    # Buffered, with writeback started after every 8 MiB write (as our buffered writer does).
    {"ioengine": "psync", "direct": "0", "bs": "8M", "sync_file_range": "write:1"},
    {"ioengine": "psync", "direct": "0", "bs": "8M", "sync_file_range": "write:1", "numjobs": "2"},
]
READ_CANDIDATES: list[dict[str, str]] = [
    {"ioengine": "libaio", "direct": "1", "iodepth": "16", "bs": "1M"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "32", "bs": "256k"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "8", "bs": "4M"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "16", "bs": "1M", "numjobs": "2"},
    {"ioengine": "libaio", "direct": "1", "iodepth": "4", "bs": "16M", "numjobs": "4"},
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
    """Runs one fio job (or ``numjobs`` parallel jobs, each over its own slice of the file)
    over ``nbytes`` of ``path``; returns the time in seconds: fio's own runtime of the slowest
    job, including for writes each job's end fsync."""
    options = dict(settings)
    jobs = int(options.pop("numjobs", "1"))
    # fio moves whole blocks (direct I/O needs them aligned): each job's slice is rounded up
    # to the block size and the time scaled back to ``nbytes`` (under 1% at 256 MiB and up).
    block = _parse_bytes(options.get("bs", "4k"))
    part = -(-nbytes // (jobs * block)) * block
    cmd = [
        "fio",
        "--name=device",
        f"--filename={path}",
        f"--size={part}",
        f"--numjobs={jobs}",
        f"--offset_increment={part}",
        f"--rw={'write' if write else 'read'}",
        "--output-format=json",
        "--thread",
        *(["--end_fsync=1", "--fallocate=none"] if write else ["--invalidate=1"]),
        *(f"--{key}={value}" for key, value in options.items()),
    ]
    if write and path.exists():
        path.unlink()  # a new file each time, as a checkpoint is
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    results = json.loads(out.stdout[out.stdout.index("{") :])["jobs"]
    moved = sum(job["write" if write else "read"]["io_bytes"] for job in results)
    if moved < nbytes:
        raise RuntimeError(f"fio moved {moved} of {nbytes} bytes")
    # job_runtime (ms) covers the I/O and, with end_fsync, the final fsync; the jobs start
    # together, so the slowest one's is the run's.
    return max(float(job["job_runtime"]) for job in results) / 1000.0 * nbytes / moved


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
