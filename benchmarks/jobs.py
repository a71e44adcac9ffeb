"""What the multi-process benchmarks share: launching a ``jax.distributed`` job of workers,
one row per launch, and the table of medians.

A job's row is what its slowest process saw (the job is done when the last process is):
``seconds`` the largest, ``peak_max`` / ``peak_sum`` the largest and the summed peak extra host
memory, and the machine's load average when it started (these machines are shared: a row
measured under load says so).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def mib(n: float) -> str:
    """``n`` bytes as whole MiB, e.g. ``"1,024 MiB"``."""
    return f"{n / (1 << 20):,.0f} MiB"


def launch(worker: Path, n: int, args: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Runs ``worker`` as ``n`` ``jax.distributed`` processes of 2 CPU devices each; returns
    each process's result, by process id."""
    from multihost.launcher import run_workers  # (tests/ is on sys.path of the benchmarks)

    results = run_workers(worker, n, devices_per_process=2, args=args, timeout=timeout)
    return [r.result for r in sorted(results, key=lambda r: r.process_id)]


def job_row(
    worker: Path,
    method: str,
    n: int,
    args: dict[str, Any],
    timeout: float,
    *,
    per_process: Sequence[str] = (),
) -> dict[str, Any]:
    """One launch of ``method`` on ``n`` processes as one row; ``per_process`` names result
    fields kept as a list, one entry a process (e.g. bytes read)."""
    load = os.getloadavg()[0]
    per = launch(worker, n, {"action": method, **args}, timeout)
    peaks = [p["peak_extra"] for p in per]
    row = {
        "method": method,
        "n": n,
        "seconds": max(p["seconds"] for p in per),
        "peak_max": max(peaks),
        "peak_sum": sum(peaks),
        "peaks": peaks,
        "load": round(load, 2),
    }
    row.update({field: [p.get(field, 0) for p in per] for field in per_process})
    return row


def median_table(
    rows: list[dict[str, Any]],
    baseline: str,
    extra: Sequence[tuple[str, Callable[[dict[str, Any]], float]]] = (),
) -> list[str]:
    """A Markdown table of the median of every (method, processes): seconds, the largest and
    the summed peak host memory, then each ``extra`` column (a title and the figure of one row,
    in bytes), then the load averages. ``baseline``'s rows come first."""
    titles = ["method", "processes", "seconds (median)", "peak host memory, largest process"]
    titles += ["peak, all processes", *(title for title, _ in extra), "load average"]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    keys = sorted({(r["method"], r["n"]) for r in rows}, key=lambda k: (k[0] != baseline, k[1]))
    for method, n in keys:
        runs = [r for r in rows if (r["method"], r["n"]) == (method, n)]
        cells = [method, str(n), f"{statistics.median(r['seconds'] for r in runs):.2f}"]
        cells += [mib(statistics.median(r[k] for r in runs)) for k in ("peak_max", "peak_sum")]
        cells += [mib(statistics.median(figure(r) for r in runs)) for _, figure in extra]
        cells.append(", ".join(f"{r['load']:.1f}" for r in runs))
        lines.append("| " + " | ".join(cells) + " |")
    return lines
