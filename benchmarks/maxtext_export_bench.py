#!/usr/bin/env python
"""Exporting a MaxText checkpoint to a Hugging Face directory: every process of a job
exporting its share, gather-free (``osf.export_pytorch`` at N = 1, 2, 4 ``jax.distributed``
processes), against the whole model through one host.

The checkpoint is a MaxText-layout train state (``tests/helpers/maxtext_checkpoints.py``: a llama's
``params.params.decoder...`` scanned on axis 1, optax ``mu`` / ``nu``, ``step``; float32, so
the parameters are a third of its bytes), saved once, untimed, as MaxText 0.2.5 saves (Orbax
v1 ``save_checkpointables``, OCDBT + zarr3) by a job of ``--save-procs`` processes of 2 CPU
devices, each parameter sharded on its ``embed`` axis (FSDP): each device's shard is one
stored chunk. Every method writes the same bfloat16 directory (``maxtext_checkpoints.
hand_mapping``: transposes, head splits, scanned layers first):

- ``ours`` (N processes of 2 devices): every process calls ``osf.export_pytorch(item, out,
  mapping, dtype=bfloat16)``; each reads its chunks of the parameters and writes its share;
- ``whole`` (one process): what MaxText's ``to_huggingface`` does, the parameters restored
  whole on one host (Orbax's restore of ``params``, as numpy), then exported from memory by
  ``osf.export_pytorch`` (the fastest writer we have: the baseline's cost is holding and
  moving the whole model through one host, not its writer).

With ``--layout layers`` the scanned tensors are saved split on their layers axis instead
(MaxText's ``["layers", "stage"]`` rule) in chunks of one layer (Orbax's ``chunk_byte_size``;
the layer count rounded up to a multiple of the saving devices), and every method exports
through the ``maxtext-llama3`` preset (one PyTorch tensor per layer): ours then reads the
stacked tensors a band of layers at a time (``export_reads.plan_bands``).

Time: wall clock until every file is written and fsynced (the slowest process, after a
barrier). Peak host memory: ``VmHWM`` reset right before the method, minus ``VmRSS`` before
it, per process (the largest, and the sum over the job). The outputs of every method and N
are checked to be byte-identical. Medians of ``--rounds``; each measurement is a fresh
launch (order alternating). The machine's load average is recorded beside each run.

Run::

    python benchmarks/maxtext_export_bench.py --size 4G --rounds 3 --procs 1,2,4
    python benchmarks/maxtext_export_bench.py --size 64M --rounds 1 --procs 1,2  # a smoke run
    python benchmarks/maxtext_export_bench.py --size 4G --rounds 3 --procs 1,2,4 --layout layers
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "helpers")]

import maxtext_checkpoints as M  # noqa: E402

from benchmarks.jobs import job_row, launch, median_table, mib  # noqa: E402
from benchmarks.state import parse_size  # noqa: E402

WORKER = HERE / "workers" / "maxtext_export_bench_worker.py"
STEP = 7


def bench_dims(size: int, multiple: int = 1) -> M.Dims:
    """A llama whose float32 train state (parameters, ``mu``, ``nu``) is about ``size``
    bytes: a 1B-class layer (E=2048) from 1 GiB up, a small one below; its layer count
    rounded up to a multiple of ``multiple``."""
    if size >= 1 << 30:
        base = M.Dims(layers=1, embed=2048, heads=16, kv_heads=8, head_dim=128, mlp=5632)
        base = M.Dims(**{**vars(base), "vocab": 32000})
    else:
        base = M.Dims(layers=1, embed=256, heads=4, kv_heads=2, head_dim=64, mlp=704, vocab=4096)
    one = _param_bytes(base)
    two = _param_bytes(M.Dims(**{**vars(base), "layers": 2}))
    per_layer, rest = two - one, 2 * one - two
    layers = max(1, round((size / 3 - rest) / per_layer))
    layers = -(-layers // multiple) * multiple
    return M.Dims(**{**vars(base), "layers": layers})


def _param_bytes(d: M.Dims) -> int:
    total = 0
    for shape in M.llama_shapes(d).values():
        n = 1
        for s in shape:
            n *= s
        total += 4 * n
    return total


def measure(
    method: str, n: int, base: Path, dims: M.Dims, out: Path, timeout: float, mapping: str
) -> dict:
    """One launch of ``method`` on ``n`` processes: seconds, peak memory, load average."""
    args = {"root": str(base / "ckpt"), "step": STEP, "out": str(out), "dims": vars(dims)}
    args["mapping"] = mapping
    return job_row(WORKER, method, n, args, timeout, per_process=("bytes_written",))


def same_files(a: Path, b: Path) -> bool:
    """Whether two Hugging Face directories hold the same files, byte for byte."""
    names = sorted(p.name for p in b.iterdir())
    if sorted(p.name for p in a.iterdir()) != names:
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def report(rows: list[dict[str, Any]], dims: M.Dims, ckpt_bytes: int, same: bool) -> str:
    params = _param_bytes(dims)
    lines = [
        f"MaxText-layout checkpoint: {mib(ckpt_bytes)} on disk, parameters {mib(params)} "
        f"float32 ({dims.layers} layers, E={dims.embed}, V={dims.vocab}); export to bfloat16 "
        f"({mib(params / 2)}). All outputs byte-identical: {same}.",
        "",
    ]
    return "\n".join(lines + median_table(rows, "whole"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4G", help="train state bytes on disk (about)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", default="1,2,4", help="process counts of ours")
    parser.add_argument("--save-procs", type=int, default=4, help="processes that save it")
    parser.add_argument("--dir", default=None, help="where the checkpoint and outputs go")
    parser.add_argument("--json", default=None, help="write every run here")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--layout",
        choices=("fsdp", "layers"),
        default="fsdp",
        help="how the scanned tensors are saved: on their embed axis, or their layers axis "
        "in chunks of one layer (then exported through maxtext-llama3)",
    )
    args = parser.parse_args()
    layers = args.layout == "layers"
    dims = bench_dims(parse_size(args.size), 2 * args.save_procs if layers else 1)
    mapping = "maxtext-llama3" if layers else "hand"
    procs = [int(p) for p in args.procs.split(",") if p]
    base = Path(tempfile.mkdtemp(prefix="osf-maxtext-bench-", dir=args.dir))
    try:
        t0 = time.monotonic()
        save = {"action": "save", "root": str(base / "ckpt"), "step": STEP, "dims": vars(dims)}
        if layers:  # (chunks of one layer of the largest stacked kernel)
            layer = max(4 * math.prod(s) // dims.layers for s in M.llama_shapes(dims).values())
            save.update(layout="layers", chunk_bytes=layer)
        launch(WORKER, args.save_procs, save, args.timeout)
        ckpt_bytes = sum(f.stat().st_size for f in (base / "ckpt").rglob("*") if f.is_file())
        print(f"saved {mib(ckpt_bytes)} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        plan = [("whole", 1)] + [("ours", n) for n in procs]
        rows: list[dict[str, Any]] = []
        same = True
        for r in range(args.rounds):
            order = plan if r % 2 == 0 else plan[::-1]
            for method, n in order:
                out = base / f"out_{method}_{n}"
                row = measure(method, n, base, dims, out, args.timeout, mapping)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
            if r == 0:
                first = base / "out_whole_1"
                same = all(same_files(base / f"out_ours_{n}", first) for n in procs)
            for method, n in plan:
                shutil.rmtree(base / f"out_{method}_{n}", ignore_errors=True)
        text = report(rows, dims, ckpt_bytes, same)
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps({"dims": vars(dims), "rows": rows}, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
