#!/usr/bin/env python
"""How long the command line takes to answer: ``orbax-safetensors --help`` and ``inspect`` of
a ``.safetensors`` file, each a fresh process timed from its start to its exit, as a user
waits for it.

Cases (each ``--runs`` times, in turn, after one untimed warm-up round):

- ``python -c pass``: the interpreter's own start, the floor under every other row;
- ``import orbax_safetensors``: the package (its public names are imported when first used);
- ``--help``: ``python -m orbax_safetensors.cli --help`` (target: under 0.5 s);
- ``inspect FILE``: ``python -m orbax_safetensors.cli inspect model.safetensors`` of a file
  of ``--tensors`` tensors written by ``osf.save_file`` (target: under 1 s);
- the same two through the ``orbax-safetensors`` console script when it is on PATH (a
  wrapper such as pyenv's shim adds its own start).

Reported: the median, min and max wall seconds and the median CPU seconds (user + system of
the child) of each case, the 1-minute load average before and after (other processes slow
every row), and, from one ``python -X importtime`` run of each command, the modules that took
the most time and whether JAX, Orbax, Flax, ml_dtypes or NumPy were imported at all.

Run (``docs/performance.md``, "Command-line start")::

    python benchmarks/cli_startup_bench.py --runs 15
    python benchmarks/cli_startup_bench.py --smoke      # 3 runs, seconds: CI's smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = {"--help": 0.5, "inspect FILE": 1.0}  # seconds, the bars for the median
HEAVY = ("jax", "jaxlib", "orbax", "flax", "ml_dtypes", "tensorstore", "numpy")


def _environment() -> dict[str, str]:
    """The children import this checkout's package (as the tests do)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p)}


def _cases(file: Path) -> dict[str, list[str]]:
    python = [sys.executable]
    cases = {
        "python -c pass": [*python, "-c", "pass"],
        "import orbax_safetensors": [*python, "-c", "import orbax_safetensors"],
        "--help": [*python, "-m", "orbax_safetensors.cli", "--help"],
        "inspect FILE": [*python, "-m", "orbax_safetensors.cli", "inspect", str(file)],
    }
    script = shutil.which("orbax-safetensors")
    if script is not None:
        cases["console script --help"] = [script, "--help"]
        cases["console script inspect FILE"] = [script, "inspect", str(file)]
    return cases


def _run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one run; the command must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]!r}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def import_profile(argv: list[str], env: dict[str, str], top: int = 5) -> dict[str, Any]:
    """What one run of ``argv`` (a ``python ...`` command) imports, from ``-X importtime``:
    the ``top`` modules by cumulative time among those imported at the top level, and which
    of :data:`HEAVY` were imported."""
    done = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]], env=env, capture_output=True, text=True
    )
    rows = []
    for line in done.stderr.splitlines():
        m = _IMPORT_LINE.match(line)
        if m:
            rows.append((int(m.group(2)), len(m.group(3)) // 2, m.group(4)))
    imported = {name for _, _, name in rows}
    firsts = sorted((r for r in rows if r[1] == 0), reverse=True)[:top]
    return {
        "heavy_imported": sorted(h for h in HEAVY if h in imported),
        "top_level_imports": [{"module": n, "cumulative_s": us / 1e6} for us, _, n in firsts],
        "total_import_s": sum(us for us, depth, _ in rows if depth == 0) / 1e6,
    }


def measure(cases: dict[str, list[str]], runs: int, env: dict[str, str]) -> dict[str, Any]:
    """Every case ``runs`` times, in turn (so a drift in the machine's speed hits all alike),
    after one untimed round."""
    for argv in cases.values():
        _run_once(argv, env)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, argv in cases.items():
            samples[name].append(_run_once(argv, env))
    out = {}
    for name, runs_of in samples.items():
        walls = [w for w, _ in runs_of]
        out[name] = {
            "median_s": statistics.median(walls),
            "min_s": min(walls),
            "max_s": max(walls),
            "cpu_median_s": statistics.median(c for _, c in runs_of),
            "runs": len(walls),
        }
    return out


def _write_file(path: Path, tensors: int) -> None:
    code = (
        "import sys, numpy as np, orbax_safetensors as osf\n"
        "n = int(sys.argv[2])\n"
        "tree = {'layers': {f'l{i:04d}': {'kernel': np.ones((64, 64), np.float32),\n"
        "        'bias': np.zeros(64, np.float32)} for i in range(n // 2)}}\n"
        "osf.save_file(tree, sys.argv[1])\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path), str(tensors)], env=_environment(), check=True
    )


def report(result: dict[str, Any]) -> str:
    lines = [
        f"load average (1 min): {result['load_before']:.2f} before, {result['load_after']:.2f} "
        f"after; {result['cpus']} CPUs; {result['runs']} runs per case",
        f"{'case':30s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'cpu s':>7s}  target",
    ]
    for name, row in result["cases"].items():
        target = TARGETS.get(name.removeprefix("console script "))
        verdict = (
            ""
            if target is None
            else f"< {target} s: " + ("yes" if row["median_s"] < target else "NO")
        )
        lines.append(
            f"{name:30s} {row['median_s']:9.3f} {row['min_s']:7.3f} {row['max_s']:7.3f} "
            f"{row['cpu_median_s']:7.3f}  {verdict}"
        )
    for name, profile in result["imports"].items():
        heavy = ", ".join(profile["heavy_imported"]) or "none"
        top = ", ".join(
            f"{t['module']} {t['cumulative_s']:.3f}" for t in profile["top_level_imports"]
        )
        lines.append(f"imports of {name}: JAX/Orbax/Flax/ml_dtypes/NumPy: {heavy}; slowest: {top}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=15, help="timed runs of each case (default 15)")
    p.add_argument("--tensors", type=int, default=200, help="tensors of the inspected file")
    p.add_argument("--smoke", action="store_true", help="3 runs, 20 tensors (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.tensors = 3, 20
    env = _environment()
    with tempfile.TemporaryDirectory(prefix="osf-cli-bench-") as tmp:
        file = Path(tmp) / "model.safetensors"
        _write_file(file, args.tensors)
        cases = _cases(file)
        load_before = os.getloadavg()[0]
        figures = measure(cases, args.runs, env)
        load_after = os.getloadavg()[0]
        imports = {
            name: import_profile(cases[name], env)
            for name in ("import orbax_safetensors", "--help", "inspect FILE")
        }
    result = {
        "runs": args.runs,
        "tensors": args.tensors,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "cases": figures,
        "imports": imports,
    }
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
