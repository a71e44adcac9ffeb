"""What pausing the cyclic garbage collector buys a save or restore of many small tensors.

``orbax_safetensors`` pauses Python's cyclic GC only while the caller's thread waits for it
(``save_file``, ``load_file``, restores, the host copies inside an async ``save()``, a
synchronous save's write; see ``orbax_safetensors/_src/pipeline/pieces.py`` (``gc_paused``)). This runs the same operations
on a tree of many small tensors with the pause on and off (``_pieces.gc_pause_enabled``), interleaved
round by round in one process, and prints medians and the ratio off / on. The tree lives
alongside a heap of long-lived objects, as a training job's does, since each collection rescans
the live objects.

Run::

    python benchmarks/studies/gc_pause_bench.py [--tensors 10000] [--rounds 7] [--heap 500000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import pieces as _pieces


def _tree(count: int) -> dict[str, dict[str, jax.Array]]:
    rng = np.random.default_rng(0)
    groups: dict[str, dict[str, jax.Array]] = {}
    for i in range(count):
        group = groups.setdefault(f"g{i // 100:03d}", {})
        group[f"t{i % 100:02d}"] = jnp.asarray(rng.standard_normal(256, dtype=np.float32))
    return groups


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heap", type=int, default=500_000, help="long-lived objects kept")
    args = parser.parse_args()

    heap = [{"i": i} for i in range(args.heap)]  # a training job's live objects
    tree = _tree(args.tensors)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    work = tempfile.mkdtemp(prefix="gc_pause_bench_")
    path = os.path.join(work, "file.safetensors")
    sync_mngr = ocp.CheckpointManager(
        os.path.join(work, "sync"),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, max_to_keep=1),
    )
    async_mngr = ocp.CheckpointManager(
        os.path.join(work, "async"), options=ocp.CheckpointManagerOptions(max_to_keep=1)
    )
    step = 0

    def manager_save(mngr: ocp.CheckpointManager) -> tuple[float, float]:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        mngr.save(step, args=osf.SafetensorsSave(tree))
        blocked = time.perf_counter() - t0
        mngr.wait_until_finished()
        return blocked, time.perf_counter() - t0

    cases: dict[str, dict[bool, list[float]]] = {}

    def record(name: str, on: bool, seconds: float) -> None:
        cases.setdefault(name, {True: [], False: []})[on].append(seconds)

    for round_index in range(args.rounds + 1):  # round 0 warms up, not recorded
        for on in (True, False) if round_index % 2 else (False, True):
            _pieces.gc_pause_enabled = on
            results = {
                "save_file": _timed(lambda: osf.save_file(tree, path)),
                "load_file": _timed(lambda: osf.load_file(path)),
            }
            results["manager save, sync"] = manager_save(sync_mngr)[1]
            blocked, total = manager_save(async_mngr)
            results["manager save, async: save() blocked"] = blocked
            results["manager save, async: until written"] = total
            results["manager restore"] = _timed(
                lambda: async_mngr.restore(step, args=osf.SafetensorsRestore(abstract))
            )
            if round_index:
                for name, seconds in results.items():
                    record(name, on, seconds)
    _pieces.gc_pause_enabled = True
    sync_mngr.close()
    async_mngr.close()
    shutil.rmtree(work)
    del heap

    print(
        f"{args.tensors} tensors of 1 KiB, {args.heap:,} other live objects, "
        f"medians of {args.rounds} rounds (jax {jax.__version__}, "
        f"orbax-checkpoint {ocp.__version__})"
    )
    print(f"{'operation':42} {'GC paused':>10} {'GC on':>10} {'on/paused':>10}")
    for name, runs in cases.items():
        paused, unpaused = statistics.median(runs[True]), statistics.median(runs[False])
        print(f"{name:42} {paused:9.3f}s {unpaused:9.3f}s {unpaused / paused:9.2f}x")


if __name__ == "__main__":
    main()
