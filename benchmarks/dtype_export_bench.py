#!/usr/bin/env python
"""What a bf16 export of an f32 state costs through the CheckpointManager: a save-time dtype
policy (``SafetensorsSave(state, dtype=jnp.bfloat16)``) against a plain f32 save and against
casting first (``jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)``, then a plain save).

Each measurement is a fresh Python process (``--worker``): it builds the LLaMA-like float32
state of ``benchmarks/state.py``, makes an untimed warm-up save of a tiny tree through the
same manager, then times ``mngr.save(1, args=...)`` + ``wait_until_finished()`` + fsync of
every file written, with the peak extra resident memory (``VmHWM`` reset right before,
minus ``VmRSS`` before). The "cast first" method's casts are inside the timed region (a user
exporting pays for them; they include JAX's first-call compile per distinct shape). Rounds
rotate the method order; the report gives medians and ratios.

Run::

    python benchmarks/dtype_export_bench.py [--size 1G] [--rounds 5] [--modes async,sync]
        [--out benchmarks/results/dtype_export]
    python benchmarks/dtype_export_bench.py --from-json benchmarks/results/dtype_export/results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from benchmarks import procfs  # noqa: E402
from benchmarks.state import (  # noqa: E402
    format_size,
    llama_specs,
    make_state,
    parse_size,
    write_results,
)

METHODS = {
    "plain": "SafetensorsSave(state): float32 as is",
    "policy": "SafetensorsSave(state, dtype=jnp.bfloat16): cast tensor by tensor while saving",
    "cast_first": "SafetensorsSave(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))",
}
_MARKER = "@@DTYPE_EXPORT@@"


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    import orbax_safetensors as osf

    specs = llama_specs(job["size"], "float32")
    state = make_state(specs, seed=0)
    directory = Path(job["dir"])
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=job["mode"] == "async")
    mngr = ocp.CheckpointManager(directory, options=options)
    warm = {"w": jnp.ones((8, 8), jnp.float32)}
    dtype = jnp.bfloat16 if job["method"] == "policy" else None
    mngr.save(0, args=osf.SafetensorsSave(warm, dtype=dtype))  # Orbax's one-off setup
    mngr.wait_until_finished()
    marks: dict[str, float] = {}

    def args() -> Any:
        if job["method"] == "policy":
            return osf.SafetensorsSave(state, dtype=jnp.bfloat16)
        if job["method"] == "cast_first":
            return osf.SafetensorsSave(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
        return osf.SafetensorsSave(state)

    gc.collect()
    rss0 = procfs.rss_bytes()
    peak_reset = procfs.reset_peak()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    mngr.save(1, args=args())
    marks["call"] = time.perf_counter() - t0
    mngr.wait_until_finished()
    procfs.fsync_tree(directory / "1")
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    hwm = procfs.hwm_bytes()
    restored = mngr.restore(1, args=osf.SafetensorsRestore())  # untimed: check what was stored
    mngr.close()
    first = jax.tree.leaves(state)[0]
    got = jax.tree.leaves(restored)[0]
    want = np.asarray(first.astype(jnp.bfloat16) if job["method"] != "plain" else first)
    ok = got.dtype == want.dtype and np.array_equal(
        np.asarray(got).view(np.uint8), want.view(np.uint8)
    )
    state_bytes = sum(s.nbytes for s in specs)
    return {
        **job,
        "seconds": elapsed,
        "save_call_s": marks["call"],
        "cpu_seconds": cpu,
        "peak_extra": max(0, hwm - rss0),
        "peak_extra_x": max(0, hwm - rss0) / state_bytes,
        "peak_reset": peak_reset,
        "state_bytes": state_bytes,
        "largest_tensor": max(s.nbytes for s in specs),
        "disk_bytes": procfs.disk_usage(directory / "1")[0],
        "verified": "ok" if ok else "stored bytes differ from jnp astype",
        "loadavg_1m": os.getloadavg()[0],
    }


def _run(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.dtype_export_bench", "--worker", json.dumps(job)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])  # type: ignore[no-any-return]
    return {**job, "error": proc.stderr.strip().splitlines()[-5:]}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _report(results: list[dict[str, Any]], modes: list[str], size: int) -> str:
    lines = [
        f"bf16 export of a {format_size(size)} float32 LLaMA-like state through "
        "CheckpointManager (medians; each run a fresh process; time until durable)",
        "",
        "| mode | method | save s | save() call s | CPU s | peak extra | peak extra / state | "
        "on disk | time vs plain | time vs cast first | peak vs cast first |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        rows = {m: [r for r in results if r["mode"] == mode and r["method"] == m] for m in METHODS}
        rows = {m: [r for r in rs if "error" not in r] for m, rs in rows.items()}
        if not all(rows.values()):
            lines.append(f"| {mode} | (missing runs) | | | | | | | | | |")
            continue
        base = {k: _median(rows["plain"], k) for k in ("seconds", "peak_extra")}
        cast = {k: _median(rows["cast_first"], k) for k in ("seconds", "peak_extra")}
        for m, rs in rows.items():
            t, p = _median(rs, "seconds"), _median(rs, "peak_extra")
            lines.append(
                f"| {mode} | {m} | {t:.2f} | {_median(rs, 'save_call_s'):.2f} | "
                f"{_median(rs, 'cpu_seconds'):.2f} | {format_size(int(p))} | {p / rs[0]['state_bytes']:.2f}x | "
                f"{format_size(int(_median(rs, 'disk_bytes')))} | {t / base['seconds']:.2f} | "
                f"{t / cast['seconds']:.2f} | {p / max(cast['peak_extra'], 1):.2f} |"
            )
    spread = [
        (max(r["seconds"] for r in rs) - min(r["seconds"] for r in rs)) / _median(rs, "seconds")
        for mode in modes
        for m in METHODS
        if (
            rs := [
                r for r in results if r["mode"] == mode and r["method"] == m and "error" not in r
            ]
        )
    ]
    bad = [r for r in results if r.get("verified", "ok") != "ok" or "error" in r]
    lines += [
        "",
        f"largest time spread (max-min)/median: {max(spread, default=0):.2f}; "
        f"load average during runs: {statistics.median(r.get('loadavg_1m', 0) for r in results):.1f}; "
        f"problems: {len(bad)}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--out", default="")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", default="")
    parser.add_argument("--from-json", default="", help="re-render the report of a results.json")
    args = parser.parse_args()
    if args.worker:
        print(_MARKER + json.dumps(_worker(json.loads(args.worker))), flush=True)
        return
    size = parse_size(args.size)
    modes = [m for m in args.modes.split(",") if m]
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        print(_report(results, modes, results[0]["size"] if results else size))
        return
    work = Path(tempfile.mkdtemp(prefix="dtype_export_bench_"))
    results: list[dict[str, Any]] = []
    order = list(METHODS)
    try:
        for rnd in range(args.rounds):
            for mode in modes:
                for k in range(len(order)):
                    method = order[(k + rnd) % len(order)]  # rotate: drift hits all alike
                    directory = work / f"{mode}-{method}-{rnd}"
                    job = {"method": method, "mode": mode, "size": size, "dir": str(directory)}
                    r = _run(job, args.timeout)
                    r["round"] = rnd
                    results.append(r)
                    shutil.rmtree(directory, ignore_errors=True)
                    print(
                        f"round {rnd} {mode} {method}: "
                        + (
                            f"{r['seconds']:.2f} s, peak {format_size(int(r['peak_extra']))}, "
                            f"{r['verified']}"
                            if "error" not in r
                            else f"error {r['error']}"
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = _report(results, modes, size)
    print(text)
    write_results(args.out, results, text)


if __name__ == "__main__":
    main()
