"""Multi-process save/restore benchmark: N real ``jax.distributed`` processes on 127.0.0.1.

Each process builds a LLaMA-like float32 state sharded ``P('data', None)`` over an ``(N, 2)``
mesh, saves it with an async ``ocp.CheckpointManager`` + ``osf.SafetensorsSave`` and restores
it with the same sharding and with ``P(None, 'model')`` on the transposed mesh (see
``benchmarks/workers/mh_bench_worker.py``). Prints one table row per process and phase
(medians over ``--repeats``) and writes every run to ``--out`` as JSON.

Example::

    python benchmarks/multihost_bench.py --procs 2 --size 64M --repeats 3

Restores read files that were just written (warm page cache); times are wall-clock per process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from multihost.launcher import run_workers  # noqa: E402

WORKER = HERE / "workers" / "mh_bench_worker.py"
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864; plain integers are bytes."""
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}M"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over repeats of one process's save and restore measurements."""
    saves = result["saves"]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out: dict[str, Any] = {
        "process": result["process_index"],
        "save": {
            "bytes_written": saves[-1]["bytes_written"],
            "header_bytes": saves[-1]["header_bytes"],
            "blocking_s": med(saves, "blocking_s"),
            "total_s": med(saves, "total_s"),
            "sync_s": med(saves, "sync_s"),
        },
    }
    for mode, rows in result["restores"].items():
        needed, read = rows[-1]["bytes_needed"], rows[-1]["bytes_read"]
        out[f"restore_{mode}"] = {
            "bytes_needed": needed,
            "bytes_read": read,
            "read_over_needed": read / needed if needed else None,
            "requests": rows[-1]["requests"],
            "time_s": med(rows, "time_s"),
            "bad_shards": sum(r["bad_shards"] for r in rows),
        }
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = "| proc | phase | written | needed | read | read/needed | requests | median s | notes |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        s = r["save"]
        lines.append(
            f"| {r['process']} | save | {mib(s['bytes_written'] + s['header_bytes'])} | | | | "
            f"| {s['total_s']:.3f} | blocking {s['blocking_s']:.3f} s, sync {s['sync_s']:.3f} s |"
        )
        for mode in ("same", "other"):
            x = r[f"restore_{mode}"]
            lines.append(
                f"| {r['process']} | restore {mode} | | {mib(x['bytes_needed'])} "
                f"| {mib(x['bytes_read'])} | {x['read_over_needed']:.3f} | {x['requests']} "
                f"| {x['time_s']:.3f} | bad shards {x['bad_shards']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--size", default="64M", help="total state bytes, e.g. 64M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "multihost.json"))
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    tmp = Path(tempfile.mkdtemp(prefix="mh_bench_", dir=a.dir))
    try:
        t0 = time.monotonic()
        results = run_workers(
            WORKER,
            a.procs,
            devices_per_process=2,
            args={"root": str(tmp / "ckpt"), "size": size, "repeats": a.repeats},
            timeout=a.timeout,
        )
        elapsed = time.monotonic() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [summarize(r.result) for r in results]
    first = results[0].result
    print(
        f"procs={a.procs} devices/proc=2 state={mib(first['total_bytes'])} "
        f"({len(first['shapes'])} float32 tensors) repeats={a.repeats} launch+run={elapsed:.1f} s"
    )
    print(table(rows))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {"procs": a.procs, "size": size, "repeats": a.repeats, "devices_per_process": 2},
        "shapes": first["shapes"],
        "total_bytes": first["total_bytes"],
        "summary": rows,
        "raw": [r.result for r in results],
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    bad = sum(r[f"restore_{m}"]["bad_shards"] for r in rows for m in ("same", "other"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
