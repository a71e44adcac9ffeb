"""One measurement in a fresh process: ``python -m benchmarks.worker '<job json>'``.

The job is a JSON object with ``op`` (``probe``, ``save`` or ``restore``), ``method``, ``case``
(see ``state.case_specs``), ``dir`` and, for restores, ``mode`` (``cold`` / ``warm``) and
optionally ``partial_fraction``. The result is printed as one line ``@@RESULT@@ <json>``.

Protocol of a timed operation: untimed setup (imports, JAX runtime start, state generation or
abstract tree, ``Method.open``), then for cold restores ``os.sync()`` + drop caches, then RSS is
sampled, the peak (``VmHWM``) is reset and I/O counters read; then the operation runs and is
timed; then the peak and counters are read again. Verification and extra measurements (the
device-to-host copy reference) come after, untimed.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import procfs
from benchmarks.methods import METHODS, Method
from benchmarks.state import (
    TensorSpec,
    case_specs,
    flatten,
    generate,
    make_abstract,
    make_state,
    np_dtype,
    partial_selection,
)

MARKER = "@@RESULT@@"
RELEASE = "@@RELEASE@@"
DONE = "@@DONE@@"

#: set from the job: ask the orchestrator to release its hot memory before timing
_HANDOFF = False


def _start_jax() -> None:
    """Starts the JAX CPU runtime so its one-off cost is not timed."""
    import jax

    jax.block_until_ready(jax.device_put(np.zeros(16, np.float32), jax.devices()[0]))


def _to_jax(tree: Any) -> tuple[Any, int]:
    """Converts non-``jax.Array`` leaves with ``jax.device_put``; returns (tree, converted)."""
    import jax

    converted = 0

    def convert(leaf: Any) -> Any:
        nonlocal converted
        if isinstance(leaf, jax.Array):
            return leaf
        converted += 1
        return jax.device_put(np.asarray(leaf))

    return jax.tree.map(convert, tree), converted


def _verify(tree: Any, specs: list[TensorSpec], seed: int) -> str:
    """Checks names, shapes and dtypes of every leaf and the exact bytes of a few.

    Returns:
      ``"ok"`` or a description of the first problems found.
    """
    flat = flatten(tree)
    expected = {s.name: s for s in specs}
    problems: list[str] = []
    missing = sorted(set(expected) - set(flat))
    extra = sorted(set(flat) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected (e.g. {extra[0]})")
    for name in sorted(set(expected) & set(flat)):
        spec, leaf = expected[name], flat[name]
        if tuple(leaf.shape) != spec.shape or np.dtype(leaf.dtype) != np_dtype(spec.dtype):
            problems.append(f"{name}: {leaf.shape} {leaf.dtype} != {spec.shape} {spec.dtype}")
            break
    by_size = sorted((s for s in specs if s.name in flat), key=lambda s: s.nbytes)
    sample = {by_size[0].name, by_size[len(by_size) // 2].name, by_size[-1].name} if by_size else ()
    for name in sorted(sample):
        got = np.asarray(flat[name]).reshape(-1).view(np.uint8)
        want = generate(expected[name], seed).reshape(-1).view(np.uint8)
        if got.shape != want.shape or not np.array_equal(got, want):
            problems.append(f"{name}: bytes differ")
    return "ok" if not problems else "; ".join(problems[:4])


def _measure(fn: Any) -> tuple[Any, dict[str, Any]]:
    """Runs ``fn()`` timed, with peak-RSS and I/O deltas."""
    gc.collect()
    if _HANDOFF:
        print(RELEASE, flush=True)
        sys.stdin.readline()
    load0 = os.getloadavg()[0]
    cpu0 = time.process_time()
    rss0 = procfs.rss_bytes()
    peak_reset = procfs.reset_peak()
    io0 = procfs.io_counters()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    hwm = procfs.hwm_bytes()
    io1 = procfs.io_counters()
    if _HANDOFF:
        print(DONE, flush=True)
    stats = {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "loadavg_1m": max(load0, os.getloadavg()[0]),
        "rss_before": rss0,
        "peak_extra": max(0, hwm - rss0),
        "peak_reset": peak_reset,
        **{f"io_{k}": io1[k] - io0.get(k, 0) for k in io1},
    }
    return out, stats


def _use_own_seconds(method: Method, stats: dict[str, Any]) -> None:
    """The method's own timing replaces the wall clock's where it has one (kept beside)."""
    own = method.own_seconds()
    if own is not None:
        stats["wall_seconds"], stats["seconds"] = stats["seconds"], own


def do_save(job: dict[str, Any], method: Method) -> dict[str, Any]:
    """Generates the state, saves it until durable, and (async methods) times a D2H copy."""
    import jax

    directory = Path(job["dir"])
    specs = case_specs(job["case"])
    state = make_state(specs, job["case"]["seed"])
    method.open(directory)
    marks: dict[str, float] = {}

    def run() -> None:
        t0 = time.perf_counter()
        method.save(state, directory)
        marks["call"] = time.perf_counter() - t0
        method.wait()
        marks["wait"] = time.perf_counter() - t0 - marks["call"]
        procfs.fsync_tree(directory)
        marks["sync"] = time.perf_counter() - t0 - marks["call"] - marks["wait"]

    _, stats = _measure(run)
    _use_own_seconds(method, stats)
    method.close()
    result: dict[str, Any] = {
        **stats,
        "save_call_s": marks["call"],
        "save_wait_s": marks["wait"],
        "save_sync_s": marks["sync"],
    }
    if method.is_async:
        # Reference for how long an async save() must block: a bare device-to-host copy of the
        # same state, measured like the save (own hot-memory hand-off, fresh buffers).
        leaves = jax.tree.leaves(state)

        def copy_to_host() -> list[np.ndarray]:
            for leaf in leaves:
                leaf.copy_to_host_async()
            return [np.array(leaf, copy=True) for leaf in leaves]

        copies, d2h = _measure(copy_to_host)
        result["d2h_copy_s"] = d2h["seconds"]
        result["d2h_peak_extra"] = d2h["peak_extra"]
        del copies
    result["disk_bytes"], result["disk_files"] = procfs.disk_usage(directory)
    result["notes"] = method.notes()
    return result


def do_restore(job: dict[str, Any], method: Method) -> dict[str, Any]:
    """Restores cold or warm (whole state, or a partial selection), timed, then verifies."""
    import jax

    directory = Path(job["dir"])
    seed = job["case"]["seed"]
    specs = case_specs(job["case"])
    fraction = job.get("partial_fraction")
    wanted = partial_selection(specs, fraction) if fraction else specs
    abstract = make_abstract(wanted)
    method.open(directory)
    result: dict[str, Any] = {
        "wanted_bytes": sum(s.nbytes for s in wanted),
        "n_wanted": len(wanted),
    }
    if job["mode"] == "warm":
        procfs.read_through(directory)
    else:
        reason = procfs.drop_caches()
        result["cache_dropped"] = reason is None
        if reason:
            result["cache_note"] = reason

    def run() -> tuple[Any, int]:
        if fraction:
            tree = method.restore_partial(directory, abstract)
        else:
            tree = method.restore(directory, abstract)
        tree, converted = _to_jax(tree)
        jax.block_until_ready(tree)
        return tree, converted

    (tree, converted), stats = _measure(run)
    _use_own_seconds(method, stats)
    result.update(stats)
    if job["mode"] == "cold":
        result["ckpt_cached_bytes"] = procfs.cached_bytes(directory)
    result["converted_to_jax"] = converted
    result["notes"] = method.notes()
    # The device row's cold read builds no arrays (fio moves the bytes): nothing to verify.
    result["verified"] = "n/a: bytes only" if tree is None else _verify(tree, wanted, seed)
    del tree
    method.close()
    return result


def main(argv: list[str]) -> int:
    """Runs the job given as JSON in ``argv[1]`` and prints its result line."""
    global _HANDOFF
    job = json.loads(argv[1])
    _HANDOFF = bool(job.get("handoff"))
    result: dict[str, Any]
    try:
        if job["op"] == "probe":
            result = {"unavailable": {n: cls().unavailable() for n, cls in METHODS.items()}}
        else:
            method = METHODS[job["method"]]()
            reason = method.unavailable()
            if reason:
                result = {"error": f"n/a: {reason}"}
            else:
                method.configure(job)
                method.prepare()
                _start_jax()
                result = do_save(job, method) if job["op"] == "save" else do_restore(job, method)
    except BaseException as e:
        tb = traceback.format_exc().strip().splitlines()
        result = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": tb[-12:]}
    sys.stdout.flush()
    print(MARKER, json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
