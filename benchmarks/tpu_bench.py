#!/usr/bin/env python
"""Saves and restores of a state on the accelerator, ours against Orbax's, in one process, with
the machine's transfer and file limits of the same bytes measured in the same run.

A LLaMA-shaped state (``--layers`` 16: 147 tensors) of each ``--cases`` size and dtype lives on
the default devices. Each round, in alternating order, ``ours`` (an async
``ocp.CheckpointManager`` with ``osf.SafetensorsSave`` / ``SafetensorsRestore``) and ``orbax``
(the same manager with Orbax's ``StandardSave`` / ``StandardRestore``) each:

- save fresh device buffers (a jitted copy of the state, untimed): ``save()`` blocking, and
  until durable (``wait_until_finished`` and an ``fsync`` of every file and directory of the
  step, for both alike);
- restore onto the devices with shardings (a ``NamedSharding`` over every device, the first
  axis split where it divides), until every array is ready; the first round compares every
  restored array with the state bit for bit;
- the host memory (RSS) and device memory (``bytes_in_use``) peaks above the level before
  each operation, sampled every 5 ms.

The training loop: a jitted step that donates the state (every tensor updated) after
``--step-matmuls`` products of ``--step-dim``-square matrices; ``--loop-saves`` saves, each
followed by enough steps for the slower method's save to be durable (``--spacing``, default
1.25x its durable save), the loop ending with ``wait_until_finished``. Extra wall time per
save: (loop time - as many steps without saves) / saves. ``--every-10`` adds the issue's tight loop (30 steps,
a save every 10), where the one-save-in-flight rule of Orbax's manager makes the loop wait for
the previous save's write (bound by the disk, not by the save's own cost).

The limits, of the same bytes, in the same run (each the best of the available paths, the
median of ``--rounds``):

- device-to-host: ``copy_to_host_async`` + ``np.asarray``; ``device_put`` to the
  ``pinned_host`` and ``unpinned_host`` memory kinds; ``np.from_dlpack`` (all of fresh
  device buffers; a path the backend refuses is reported as such; a path over twice the
  fastest in the first round is not measured again);
- host-to-device: ``jax.device_put`` of the host arrays (one list), and from ``pinned_host``;
- file write until durable: the state's bytes from one page-aligned buffer, 16 MiB
  ``pwrite``s on ``WRITE_THREADS`` threads, buffered then ``fsync``, or ``O_DIRECT``;
- file read: our checkpoint's data files read into a reused page-aligned buffer, 16 MiB
  reads on ``READ_THREADS`` threads, buffered or ``O_DIRECT``.

Run (``docs/performance.md``, "TPU")::

    python benchmarks/tpu_bench.py --cases 2G:bfloat16,4G:float32 --rounds 3 --every-10
    python benchmarks/tpu_bench.py --smoke      # CPU, seconds: CI's smoke test

``--direct-io never`` and ``--copies-ahead-mib N`` change our saves' write mode and how far
ahead an async save's copier starts transfers, to find where a save's time goes; ``--json``
is written as figures arrive (a run cut short keeps the limits and rounds it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from benchmarks.state import format_size, llama_specs, make_state, np_dtype, parse_size  # noqa: E402
from orbax_safetensors._src.pipeline import snapshots as _snapshots  # noqa: E402

CHUNK = 16 << 20
PAGE = 4096
WRITE_THREADS = max(4, min(8, os.cpu_count() or 1))
READ_THREADS = max(4, min(8, os.cpu_count() or 1))
METHODS = ("ours", "orbax")


def log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# -- memory peaks ------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_bytes() -> int:
    total = 0
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:
            stats = {}
        total += int(stats.get("bytes_in_use", 0))
    return total


class Peaks:
    """Host RSS and device ``bytes_in_use`` peaks above their levels at entry, sampled every
    5 ms on a thread while the block runs."""

    def __enter__(self) -> Peaks:
        self._host0, self._dev0 = _rss(), _device_bytes()
        self.host = self.device = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.host = max(self.host, _rss() - self._host0)
            self.device = max(self.device, _device_bytes() - self._dev0)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.host = max(self.host, _rss() - self._host0)
        self.device = max(self.device, _device_bytes() - self._dev0)


# -- the state ---------------------------------------------------------------------------------

_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def fresh(state: Any) -> Any:
    """New device buffers holding ``state``'s values (as a training step would produce)."""
    return jax.block_until_ready(_copy_tree(state))


def target_sharding(shape: tuple[int, ...]) -> jax.sharding.Sharding:
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("d",))
    split = bool(shape) and shape[0] % devices.size == 0
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d" if split else None))


def abstract_of(state: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target_sharding(x.shape)), state
    )


def bit_equal(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


# -- limits ------------------------------------------------------------------------------------


def d2h_limits(state: Any, rounds: int) -> dict[str, float | str]:
    """Median seconds of each device-to-host path over fresh device buffers (or why not)."""
    device = jax.devices()[0]

    def asarray(leaves: list[Any]) -> None:
        for x in leaves:
            x.copy_to_host_async()
        _ = [np.asarray(x) for x in leaves]

    def put_to(kind: str) -> Callable[[list[Any]], None]:
        def put(leaves: list[Any]) -> None:
            # (made here: a backend without this memory kind refuses it, reported as n/a)
            sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
            jax.block_until_ready(jax.device_put(leaves, sharding))

        return put

    def dlpack(leaves: list[Any]) -> None:
        _ = [np.from_dlpack(x) for x in leaves]

    paths: dict[str, Callable[[list[Any]], None]] = {
        "copy_to_host_async + np.asarray": asarray,
        "device_put pinned_host": put_to("pinned_host"),
        "device_put unpinned_host": put_to("unpinned_host"),
        "np.from_dlpack": dlpack,
    }
    out: dict[str, float | str] = {}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        fastest = min((v[0] for v in times.values() if v), default=math.inf)
        for name, path in paths.items():
            if name in out:
                continue  # refused
            if r and times[name] and times[name][0] > 2 * fastest:
                continue  # far from the best: one round is enough
            leaves = jax.tree.leaves(fresh(state))
            t0 = time.perf_counter()
            try:
                path(leaves)
            except Exception as e:  # the backend lacks this path
                out[name] = f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                continue
            times[name].append(time.perf_counter() - t0)
            del leaves
    for name, values in times.items():
        if values:
            out[name] = median(values)
    return out


def h2d_limits(host: list[np.ndarray], rounds: int) -> dict[str, float | str]:
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    out: dict[str, float | str] = {}
    times: dict[str, list[float]] = {"device_put numpy": [], "device_put from pinned_host": []}
    try:
        pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        staged = jax.block_until_ready(jax.device_put(host, pinned))
    except Exception as e:
        staged = None
        out["device_put from pinned_host"] = f"n/a ({type(e).__name__})"
    for _ in range(rounds):
        t0 = time.perf_counter()
        placed = jax.block_until_ready(jax.device_put(host, on_device))
        times["device_put numpy"].append(time.perf_counter() - t0)
        del placed
        if staged is not None:
            t0 = time.perf_counter()
            placed = jax.block_until_ready(jax.device_put(staged, on_device))
            times["device_put from pinned_host"].append(time.perf_counter() - t0)
            del placed
    for name, values in times.items():
        if values:
            out[name] = median(values)
    return out


def aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def _chunks(total: int) -> list[tuple[int, int]]:
    return [(o, min(CHUNK, total - o)) for o in range(0, total, CHUNK)]


def write_file(path: Path, data: np.ndarray, direct: bool) -> float:
    """Seconds to write ``data`` (page-aligned) to a new file and make it durable."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)

        def write(chunk: tuple[int, int]) -> None:
            offset, n = chunk
            done = 0
            while done < n:
                done += os.pwrite(fd, view[offset + done : offset + n], offset + done)

        whole = data.nbytes - (data.nbytes % PAGE if direct else 0)  # direct: whole blocks
        with ThreadPoolExecutor(WRITE_THREADS) as pool:
            list(pool.map(write, _chunks(whole)))
        if direct and data.nbytes % PAGE:  # the tail that is not a whole block: buffered
            tail = data.nbytes - data.nbytes % PAGE
            with open(path, "r+b") as f:
                f.seek(tail)
                f.write(view[tail:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def write_limits(data: np.ndarray, directory: Path, rounds: int) -> dict[str, float | str]:
    path = directory / "limit.bin"
    out: dict[str, float | str] = {}
    for direct, name in ((False, "buffered + fsync"), (True, "O_DIRECT + fsync")):
        values: list[float] = []
        for _ in range(rounds):
            fastest = min((v for v in out.values() if isinstance(v, float)), default=math.inf)
            if values and values[0] > 2 * fastest:
                break  # far from the best: one round is enough (as for d2h_limits)
            try:
                values.append(write_file(path, data, direct))
            except OSError as e:
                out[name] = f"n/a ({e})"
                break
        if values:
            out[name] = median(values)
    path.unlink(missing_ok=True)
    return out


def read_files(paths: list[Path], into: np.ndarray, direct: bool) -> float:
    """Seconds to read ``paths`` whole into ``into`` (page-aligned, reused)."""
    t0 = time.perf_counter()
    at = 0
    jobs = []
    fds = []
    try:
        for path in paths:
            size = path.stat().st_size
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            fds.append(fd)
            whole = size - size % PAGE if direct else size
            jobs += [(fd, o, at + o, n) for o, n in _chunks(whole)]
            at += size + (-size % PAGE)
        view = memoryview(into)

        def read(job: tuple[int, int, int, int]) -> None:
            fd, offset, dest, n = job
            done = 0
            while done < n:
                got = os.preadv(fd, [view[dest + done : dest + n]], offset + done)
                if got <= 0:
                    break
                done += got

        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(read, jobs))
    finally:
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0


# -- methods -----------------------------------------------------------------------------------


class Method:
    """An async CheckpointManager saving and restoring one kind of args."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory / name
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        self.mngr = ocp.CheckpointManager(self.directory, options=options)

    def save_args(self, state: Any) -> Any:
        return osf.SafetensorsSave(state) if self.name == "ours" else ocp.args.StandardSave(state)

    def restore_args(self, abstract: Any) -> Any:
        if self.name == "ours":
            return osf.SafetensorsRestore(abstract)
        return ocp.args.StandardRestore(abstract)

    def save(self, step: int, state: Any) -> tuple[float, float, Peaks]:
        """(save() blocking, until durable) seconds, and the memory peaks."""
        with Peaks() as peaks:
            t0 = time.perf_counter()
            self.mngr.save(step, args=self.save_args(state))
            blocked = time.perf_counter() - t0
            self.mngr.wait_until_finished()
            sync_tree(self.directory / str(step))
            durable = time.perf_counter() - t0
        return blocked, durable, peaks

    def restore(self, step: int, abstract: Any) -> tuple[float, Any, Peaks]:
        with Peaks() as peaks:
            t0 = time.perf_counter()
            out = jax.block_until_ready(self.mngr.restore(step, args=self.restore_args(abstract)))
            seconds = time.perf_counter() - t0
        return seconds, out, peaks

    def data_files(self, step: int) -> list[Path]:
        return sorted((self.directory / str(step)).rglob("*.safetensors"))

    def close(self) -> None:
        self.mngr.close()


def sync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (already durable ones cost little)."""
    for path in [root, *root.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- the training loop -------------------------------------------------------------------------


def make_step(dim: int, matmuls: int) -> tuple[Callable[..., Any], Any]:
    """A jitted training step donating the state: ``matmuls`` products of ``dim``-square
    bfloat16 matrices (the compute), then every tensor of the state updated."""
    key = jax.random.key(0)
    side = jax.random.normal(key, (dim, dim), jnp.bfloat16) / math.sqrt(dim)

    def step(state: Any, side: Any) -> Any:
        h = side
        for _ in range(matmuls):
            h = jnp.tanh(h @ side)
        scale = 1 + 1e-6 * jnp.mean(h).astype(jnp.float32)
        return jax.tree.map(lambda x: (x * scale.astype(x.dtype)).astype(x.dtype), state)

    return jax.jit(step, donate_argnums=0), side


def run_loop(
    state: Any,
    step: Callable[..., Any],
    side: Any,
    method: Method | None,
    steps: int,
    save_at: set[int],
    first: int,
    waits: list[float] | None = None,
) -> float:
    """Seconds for ``steps`` steps with a save after each step in ``save_at`` (and the final
    ``wait_until_finished``). ``waits``, when given, gets the seconds each ``save()`` call
    blocked the loop (a save waits there for the one before it to end), then the final
    ``wait_until_finished``'s."""
    state = step(fresh(state), side)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        state = step(state, side)
        if method is not None and i in save_at:
            t_save = time.perf_counter()
            method.mngr.save(first + i, args=method.save_args(state))
            if waits is not None:
                waits.append(time.perf_counter() - t_save)
    jax.block_until_ready(state)
    if method is not None:
        t_wait = time.perf_counter()
        method.mngr.wait_until_finished()
        if waits is not None:
            waits.append(time.perf_counter() - t_wait)
    return time.perf_counter() - t0


# -- one case ----------------------------------------------------------------------------------


def run_case(
    size: int,
    dtype: str,
    args: argparse.Namespace,
    base: Path,
    progress: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """One case's figures; ``progress(result)`` is called with what is measured so far after
    the limits and after the rounds (a run cut short keeps them)."""
    specs = llama_specs(size, dtype, layers=args.layers)
    state = make_state(specs, seed=0)
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    log(f"== {format_size(nbytes)} {dtype}, {len(leaves)} tensors on {jax.devices()[0].platform}")
    abstract = abstract_of(state)
    rounds = args.rounds
    result: dict[str, Any] = {
        "bytes": nbytes,
        "dtype": dtype,
        "tensors": len(leaves),
        "direct_io": os.environ.get("OSF_DIRECT_IO", "auto"),
        "copies_ahead_mib": _snapshots.COPIES_AHEAD_BYTES >> 20,
    }

    log("limits: device-to-host")
    result["d2h"] = d2h_limits(state, rounds)
    host = [np.asarray(x) for x in leaves]
    # (a host copy not in C order is re-laid out by the writer before it is written)
    result["host_copies_not_c_contiguous"] = sum(not h.flags.c_contiguous for h in host)
    log("limits: host-to-device")
    result["h2d"] = h2d_limits(host, rounds)
    log("limits: file write")
    flat = aligned(nbytes)
    at = 0
    for h in host:
        flat[at : at + h.nbytes] = h.reshape(-1).view(np.uint8)
        at += h.nbytes
    del host
    result["write"] = write_limits(flat, base, rounds)
    log(f"limits: {result['d2h']} {result['h2d']} {result['write']}")
    progress(result)

    methods = {name: Method(name, base) for name in METHODS}
    runs: dict[str, dict[str, list[float]]] = {
        m: {
            k: []
            for k in (
                "block",
                "durable",
                "restore",
                "save_host",
                "save_device",
                "restore_host",
                "restore_device",
            )
        }
        for m in METHODS
    }
    read_times: dict[str, list[float]] = {"buffered": [], "O_DIRECT": []}
    exact: dict[str, bool] = {}
    into = flat  # reused for the read limit (the checkpoint's data is about the state's size)
    try:
        for r in range(rounds + 1):  # round 0 warms up (compiles, first faults): left out
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            for name in order:
                method = methods[name]
                state_r = fresh(state)
                blocked, durable, save_peaks = method.save(r, state_r)
                del state_r
                seconds, out, restore_peaks = method.restore(r, abstract)
                if r == 0:
                    exact[name] = bit_equal(out, state)
                del out
                log(
                    f"round {r} {name}: save() {blocked:.3f} s, durable {durable:.3f} s, "
                    f"restore {seconds:.3f} s"
                )
                if r == 0:
                    continue
                row = runs[name]
                row["block"].append(blocked)
                row["durable"].append(durable)
                row["restore"].append(seconds)
                row["save_host"].append(save_peaks.host)
                row["save_device"].append(save_peaks.device)
                row["restore_host"].append(restore_peaks.host)
                row["restore_device"].append(restore_peaks.device)
                if name == "ours":
                    files = method.data_files(r)
                    need = sum(p.stat().st_size + PAGE for p in files)
                    if need > into.nbytes:
                        into = aligned(need)
                    for mode in read_times:
                        with contextlib.suppress(OSError):
                            read_times[mode].append(read_files(files, into, mode == "O_DIRECT"))
        result["runs"] = {m: {k: median(v) for k, v in row.items()} for m, row in runs.items()}
        result["exact"] = exact
        result["read"] = {m: median(v) for m, v in read_times.items() if v}
        progress(result)

        log("training loop")
        result["loop"] = run_loops(state, methods, result, args)
    finally:
        for method in methods.values():
            method.close()
    return result


def run_loops(
    state: Any, methods: dict[str, Method], result: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Both methods' loops space their saves by 1.25x the slower method's durable save
    (``--spacing`` if given), so that no save waits for the one before (Orbax's manager keeps
    one save in flight): what is left is what the save itself costs the loop. The loop
    without saves is measured per step each round and scaled to the loop's length."""
    step, side = make_step(args.step_dim, args.step_matmuls)
    run_loop(state, step, side, None, 10, set(), 0)  # compiles
    saves = args.loop_saves
    spacing_s = args.spacing or 1.25 * max(result["runs"][m]["durable"] for m in METHODS)
    every = dict.fromkeys(METHODS, max(1, math.ceil(spacing_s / _step_seconds(state, step, side))))
    log(f"loop: {saves} saves, every {every} steps")
    per_step: list[float] = []
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    first = 1000
    for r in range(args.rounds):
        per_step.append(_step_seconds(state, step, side))
        for name in METHODS if r % 2 == 0 else METHODS[::-1]:
            steps = every[name] * saves
            save_at = {every[name] * k for k in range(saves)}
            times[name].append(run_loop(state, step, side, methods[name], steps, save_at, first))
            first += steps + 1
            log(f"loop round {r} {name}: {times[name][-1]:.3f} s, {steps} steps")
    step_s = median(per_step)
    out: dict[str, Any] = {"step_s": step_s, "every": every, "saves": saves}
    out["extra_per_save"] = {
        m: (median(times[m]) - step_s * every[m] * saves) / saves for m in METHODS
    }
    if args.every_10:
        # The tight loop, ``--rounds`` rounds: each save's wait (in save(), for the save
        # before it, and at the end) is kept, the longest against the median durable save.
        extra: dict[str, list[float]] = {m: [] for m in METHODS}
        waits: dict[str, list[float]] = {m: [] for m in METHODS}
        for r in range(args.rounds):
            base10 = run_loop(state, step, side, None, 30, set(), first)
            for name in METHODS if r % 2 == 0 else METHODS[::-1]:
                first += 31
                seconds = run_loop(
                    state, step, side, methods[name], 30, {9, 19, 29}, first, waits[name]
                )
                extra[name].append((seconds - base10) / 3)
                log(
                    f"loop round {r}, a save every 10 steps, {name}: {seconds:.3f} s, "
                    f"waits {[round(w, 3) for w in waits[name][-4:]]}"
                )
        out["every_10_extra_per_save"] = {m: median(v) for m, v in extra.items()}
        out["every_10_longest_wait"] = {m: max(v) for m, v in waits.items()}
        out["every_10_waits"] = waits
    return out


def _step_seconds(state: Any, step: Callable[..., Any], side: Any, steps: int = 20) -> float:
    return max(run_loop(state, step, side, None, steps, set(), 0) / steps, 1e-5)


# -- report ------------------------------------------------------------------------------------


def best(limits: dict[str, float | str]) -> float:
    values = [v for v in limits.values() if isinstance(v, float)]
    return min(values) if values else math.nan


def fmt(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.3f}"


def report(case: dict[str, Any]) -> str:
    gib = case["bytes"] / 2**30
    runs, loop = case["runs"], case["loop"]
    d2h, h2d, write, read = (
        best(case["d2h"]),
        best(case["h2d"]),
        best(case["write"]),
        best(case["read"]),
    )
    ours, orbax = runs["ours"], runs["orbax"]
    lines = [
        f"### {gib:.2f} GiB {case['dtype']}, {case['tensors']} tensors",
        "",
        "| limit (same bytes) | path | seconds |",
        "|---|---|---|",
    ]
    for title, key in (
        ("device-to-host", "d2h"),
        ("host-to-device", "h2d"),
        ("file write until durable", "write"),
        ("file read", "read"),
    ):
        for path, value in case[key].items():
            lines.append(f"| {title} | {path} | {fmt(value)} |")
    restore_bound = max(read, h2d)
    save_bound = d2h + write
    lines += [
        "",
        "| | ours | orbax | ours / orbax | ours / limit |",
        "|---|---|---|---|---|",
        f"| save() blocks, s | {ours['block']:.3f} | {orbax['block']:.3f} | "
        f"{ours['block'] / orbax['block']:.2f} | {ours['block'] / d2h:.2f} (best d2h) |",
        f"| save until durable, s | {ours['durable']:.3f} | {orbax['durable']:.3f} | "
        f"{ours['durable'] / orbax['durable']:.2f} | {ours['durable'] / save_bound:.2f} "
        "(best d2h + write) |",
        f"| restore onto the devices, s | {ours['restore']:.3f} | {orbax['restore']:.3f} | "
        f"{ours['restore'] / orbax['restore']:.2f} | {ours['restore'] / restore_bound:.2f} "
        "(max(read, h2d)) |",
    ]
    extra = loop["extra_per_save"]
    lines.append(
        f"| training loop, extra s per save ({loop['saves']} per loop, every "
        f"{loop['every']['ours']} steps of {loop['step_s'] * 1000:.1f} ms) | "
        f"{extra['ours']:.3f} | {extra['orbax']:.3f} | "
        f"{extra['ours'] / extra['orbax']:.2f} | {extra['ours'] / d2h:.2f} (best d2h) |"
    )
    if "every_10_extra_per_save" in loop:
        tight, longest = loop["every_10_extra_per_save"], loop["every_10_longest_wait"]
        lines.append(
            f"| the same, 30 steps, a save every 10 (medians of rounds) | {tight['ours']:.3f} | "
            f"{tight['orbax']:.3f} | {tight['ours'] / tight['orbax']:.2f} | |"
        )
        lines.append(
            f"| tight loop: the longest wait for a save, s | {longest['ours']:.3f} | "
            f"{longest['orbax']:.3f} | | {longest['ours'] / ours['durable']:.2f} "
            "(median durable save) |"
        )
    mib = 2**20
    for what in ("save", "restore"):
        lines.append(
            f"| {what}: peak host / device memory, MiB | "
            f"{ours[what + '_host'] / mib:.0f} / {ours[what + '_device'] / mib:.0f} | "
            f"{orbax[what + '_host'] / mib:.0f} / {orbax[what + '_device'] / mib:.0f} | | |"
        )
    lines.append(f"\nRestored bit for bit: {case['exact']}.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="2G:bfloat16,4G:float32", help="SIZE:DTYPE,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--loop-saves", type=int, default=1)
    p.add_argument("--spacing", type=float, default=0.0, help="seconds between saves (0: auto)")
    p.add_argument("--every-10", action="store_true", help="also the 30-step, every-10 loop")
    p.add_argument("--step-dim", type=int, default=0, help="0: 4096 on accelerators, else 128")
    p.add_argument("--step-matmuls", type=int, default=0, help="0: 48 on accelerators, else 2")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary dir)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--smoke", action="store_true", help="16M float32, 1 round (CI)")
    p.add_argument(
        "--direct-io",
        choices=("auto", "never", "always"),
        help="our saves' and restores' direct I/O mode (default: OSF_DIRECT_IO, else auto)",
    )
    p.add_argument(
        "--copies-ahead-mib",
        type=int,
        help="how far ahead an async save's copier starts device-to-host transfers "
        "(snapshots.COPIES_AHEAD_BYTES; default 64)",
    )
    args = p.parse_args()
    if args.direct_io:
        os.environ["OSF_DIRECT_IO"] = args.direct_io  # (read at each save and restore)
    if args.copies_ahead_mib is not None:
        _snapshots.COPIES_AHEAD_BYTES = args.copies_ahead_mib << 20
    if args.smoke:
        args.cases, args.rounds, args.layers, args.loop_saves = "16M:float32", 1, 2, 1
        args.spacing = args.spacing or 0.05
    accelerator = jax.devices()[0].platform != "cpu"
    args.step_dim = args.step_dim or (4096 if accelerator else 128)
    args.step_matmuls = args.step_matmuls or (48 if accelerator else 2)
    base = Path(tempfile.mkdtemp(prefix="osf-tpu-bench-", dir=args.dir))
    results: list[dict[str, Any]] = []

    def save_json(partial: list[dict[str, Any]]) -> None:
        if args.json:  # as figures arrive: a run cut short keeps what it measured
            args.json.write_text(json.dumps(partial, indent=1, default=str))

    try:
        for case in args.cases.split(","):
            size, dtype = case.split(":")
            np_dtype(dtype)
            progress = lambda partial: save_json([*results, partial])  # noqa: E731
            results.append(run_case(parse_size(size), dtype, args, base, progress))
            print(report(results[-1]), flush=True)
            print(flush=True)
            save_json(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"jax {jax.__version__}, orbax-checkpoint {ocp.__version__ if hasattr(ocp, '__version__') else '?'}, "
        f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
