"""The same save and restore, before and after a change: two checkouts of this repository run
alternately (A B A B ...), each round a fresh process, and the ratios are taken pair by pair,
so a drift of the shared machine's speed cancels out.

Each round (``workers/ab_worker.py``) saves a float32 state of ``--size`` bytes (16 tensors)
through an async ``CheckpointManager`` (``save()`` blocking, then until written), restores it
with its shardings, and reads the file with ``osf.load_file``. The first pair is a warm-up.

Run::

    python benchmarks/ab_bench.py --base 33ae7cf [--head HEAD] [--size 1G] [--rounds 9]

``--base`` / ``--head`` are git revisions, checked out into temporary worktrees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "workers" / "ab_worker.py"
PHASES = ("save_blocks", "save_total", "restore", "load_file")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _checkout(rev: str, where: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where), rev],
        check=True,
        capture_output=True,
    )
    return where


def _round(checkout: Path, size: int, workdir: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(WORKER), str(size), workdir],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=checkout,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row.pop("package").startswith(str(checkout)), "the worker imported another checkout"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision before the change")
    parser.add_argument("--head", default="HEAD", help="git revision after it (default HEAD)")
    parser.add_argument("--size", default="1G", help="state bytes (default 1G)")
    parser.add_argument("--rounds", type=int, default=9, help="counted pairs (default 9)")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: temp)")
    args = parser.parse_args()
    size = _size(args.size)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=args.dir) as work:
        a = _checkout(args.head, Path(tmp) / "head")
        b = _checkout(args.base, Path(tmp) / "base")
        try:
            pairs = [(_round(a, size, work), _round(b, size, work)) for _ in range(args.rounds + 1)]
        finally:
            for w in (a, b):
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(w)],
                    check=False,
                    capture_output=True,
                )
    pairs = pairs[1:]  # the warm-up pair
    print(f"{args.head} (A) against {args.base} (B), {args.size}, {len(pairs)} pairs")
    print(
        f"{'phase':<12} {'A median s':>10} {'B median s':>10} {'A/B median':>10} {'A/B min-max':>14}"
    )
    for phase in PHASES:
        ratios = [x[phase] / y[phase] for x, y in pairs]
        print(
            f"{phase:<12} {statistics.median(x[phase] for x, _ in pairs):>10.3f} "
            f"{statistics.median(y[phase] for _, y in pairs):>10.3f} "
            f"{statistics.median(ratios):>10.3f} {min(ratios):>6.2f}-{max(ratios):<6.2f}"
        )


if __name__ == "__main__":
    main()
