"""How long an async ``save()`` blocks the caller, against a bare device-to-host copy of the
same state, in one process over successive saves (issue 20: host buffers reused per save).

Each round times, interleaved: the bare copy (``copy_to_host_async()`` on every leaf, then
``np.array(x, copy=True)``: fresh host memory, as any copy that keeps no buffers gets), and
``mngr.save(step)`` of an async ``CheckpointManager`` with ``SafetensorsCheckpointHandler``
reusing its host buffers (the default) and not (``reuse_host_buffers=False``); each save is then
waited for, untimed. The first round warms the pool and is left out of the medians.

Run::

    python benchmarks/async_block_bench.py [--size 1G] [--rounds 7] [--dir /var/tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
import orbax.checkpoint as ocp

import orbax_safetensors as osf
from benchmarks.state import llama_specs, make_state, parse_size


def _bare_copy(leaves: list[Any]) -> float:
    t0 = time.perf_counter()
    for leaf in leaves:
        leaf.copy_to_host_async()
    copies = [np.array(leaf, copy=True) for leaf in leaves]
    elapsed = time.perf_counter() - t0
    del copies
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1G")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dir", type=Path, help="checkpoint directory (default: under /var/tmp)")
    args = p.parse_args()
    size = parse_size(args.size)
    state = make_state(llama_specs(size, "float32"), seed=0)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    base = args.dir or Path(tempfile.mkdtemp(prefix="osf-async-", dir="/var/tmp"))
    managers = {}
    for reuse in (True, False):
        handler = osf.SafetensorsCheckpointHandler(reuse_host_buffers=reuse)
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        managers[reuse] = ocp.CheckpointManager(
            base / f"reuse_{reuse}", item_handlers=handler, options=options
        )
    times: dict[str, list[float]] = {"bare copy": [], "save, reused": [], "save, fresh": []}
    try:
        for r in range(args.rounds + 1):
            order = [None, True, False] if r % 2 == 0 else [False, True, None]
            for what in order:
                if what is None:
                    seconds = _bare_copy(leaves)
                    key = "bare copy"
                else:
                    mngr = managers[what]
                    t0 = time.perf_counter()
                    mngr.save(r, args=osf.SafetensorsSave(state))
                    seconds = time.perf_counter() - t0
                    mngr.wait_until_finished()
                    key = "save, reused" if what else "save, fresh"
                if r > 0:  # round 0 fills the pool
                    times[key].append(seconds)
    finally:
        for mngr in managers.values():
            mngr.close()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    bare = statistics.median(times["bare copy"])
    print(
        f"state {nbytes / 2**20:.0f} MiB ({len(leaves)} tensors), medians of {args.rounds} rounds"
    )
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    print("| what | median s | GB/s | x bare copy |")
    print("|---|---|---|---|")
    for key, values in times.items():
        median = statistics.median(values)
        print(f"| {key} | {median:.4f} | {nbytes / median / 1e9:.2f} | {median / bare:.2f} |")


if __name__ == "__main__":
    main()
