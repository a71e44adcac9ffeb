#!/usr/bin/env python
"""Where a save's and a restore's time goes on the accelerator: variants of ours side by side
with the limits of the same bytes, each phase sampled thread by thread
(``benchmarks/studies/stack_sampler.py``). Not a scoreboard (``tpu_bench.py`` is): a diagnosis, run
once per question, in one process per case (one process at a time may hold a TPU).

``restore``: a LLaMA-shaped state (``benchmarks/state.py``) saved once by ours, then restored
``--reps`` times per variant (the default; ``verify=False``; a larger staging ring; no
staging), beside the host-to-device limits (``device_put`` of the host arrays as one list,
and of views into one reused buffer, wave by wave as the staged restore sends them) and the
read limit (the checkpoint's files into a reused buffer, ``tpu_bench.READ_THREADS``).

``save``: async saves through a ``CheckpointManager`` until durable (``wait_until_finished``
and an fsync of the step), per variant (direct I/O ``auto`` / ``never``, more write threads),
beside device-to-host copies of fresh device buffers (with the minor page faults they cost)
and file writes until durable (buffered and ``O_DIRECT``, 2 and 8 threads).

Every variant's times, and one sampled run's thread summary, go to ``--json``::

    python benchmarks/studies/tpu_probe.py restore --case 2G:bfloat16 --json probe_restore.json
    python benchmarks/studies/tpu_probe.py save --case 4G:float32 --json probe_save.json
    python benchmarks/studies/tpu_probe.py restore --smoke   # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from benchmarks import tpu_bench as tb  # noqa: E402
from benchmarks.state import llama_specs, make_state, parse_size  # noqa: E402
from benchmarks.studies.stack_sampler import StackSampler  # noqa: E402
from orbax_safetensors._src.pipeline import place as _place  # noqa: E402
from orbax_safetensors._src.storage import local as _local  # noqa: E402

log = tb.log


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextlib.contextmanager
def patched(module: Any, **values: Any) -> Iterator[None]:
    """Module attributes set for the block (the library's tunables read at each call)."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Recorder:
    """Times of each variant (``reps`` runs), one sampled run's summary, written as they come."""

    def __init__(self, path: Path | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"meta": meta, "times": {}, "profiles": {}, "notes": {}}

    def time(self, name: str, fn: Callable[[], Any], reps: int, profile: bool = True) -> None:
        times, faults = [], []
        for _ in range(reps):
            f0 = _faults()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            faults.append(_faults() - f0)
        self.doc["times"][name] = {
            "median": statistics.median(times),
            "all": [round(t, 4) for t in times],
            "minor_faults": faults,
        }
        log(f"{name}: median {statistics.median(times):.3f} s {[round(t, 3) for t in times]}")
        if profile:
            with StackSampler() as sampler:
                fn()
            self.doc["profiles"][name] = sampler.summary(top=8)
            log(sampler.report(top=6))
        self.flush()

    def note(self, name: str, value: Any) -> None:
        self.doc["notes"][name] = value
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.doc, indent=1, default=str))


def restore_case(state: Any, base: Path, rec: Recorder, reps: int) -> None:
    mngr = ocp.CheckpointManager(base / "ours")
    mngr.save(0, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    abstract = tb.abstract_of(state)

    item = base / "ours" / "0" / "default"

    def restore(verify: bool = True) -> Callable[[], Any]:
        if verify:  # through the manager, as tpu_bench restores
            return lambda: jax.block_until_ready(
                mngr.restore(0, args=osf.SafetensorsRestore(abstract))
            )
        return lambda: jax.block_until_ready(osf.restore_directory(item, abstract, verify=False))

    restore()()  # warm-up: compiles, the ring's first faults
    rec.time("restore", restore(), reps)
    rec.time("restore verify=False", restore(verify=False), reps, profile=False)
    with env(OSF_DIRECT_IO="never"):
        rec.time("restore (direct I/O never)", restore(), reps)
    with patched(_place, RING_BYTES=1 << 30, WAVES_IN_FLIGHT=8):
        restore()()
        rec.time("restore ring 1 GiB, 8 waves", restore(), reps, profile=False)
    with patched(_place, WAVES_IN_FLIGHT=2):
        rec.time("restore 2 waves", restore(), reps, profile=False)
    with patched(_place, RING_BYTES=512 << 20):
        restore()()
        rec.time("restore ring 512 MiB, 4 waves", restore(), reps, profile=False)
        with patched(_place, WAVES_IN_FLIGHT=8):
            rec.time("restore ring 512 MiB, 8 waves", restore(), reps, profile=False)
    with patched(_place, MODE="never"):
        rec.time("restore unstaged", restore(), reps, profile=False)
    out = restore()()
    rec.note("exact", tb.bit_equal(out, state))
    del out

    leaves = jax.tree.leaves(state)
    host = [np.asarray(x) for x in leaves]
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    rec.time(
        "h2d device_put(list)",
        lambda: jax.block_until_ready(jax.device_put(host, on_device)),
        reps,
        profile=False,
    )
    # The same bytes from views into one reused buffer, wave by wave (64 MiB), each wave's
    # transfers started before the next is sent, as the staged restore does without its reads.
    flat = tb.aligned(sum(h.nbytes for h in host) + 4096 * len(host))
    views, at = [], 0
    for h in host:
        v = flat[at : at + h.nbytes].view(h.dtype).reshape(h.shape)
        v[...] = h
        views.append(v)
        at += -(-h.nbytes // 4096) * 4096
    waves: list[list[np.ndarray]] = [[]]
    size = 0
    for v in views:
        if waves[-1] and size + v.nbytes > 64 << 20:
            waves.append([])
            size = 0
        waves[-1].append(v)
        size += v.nbytes

    def by_waves() -> None:
        placed = [jax.device_put(w, on_device) for w in waves]
        jax.block_until_ready(placed)

    rec.time("h2d device_put(views) by 64 MiB waves", by_waves, reps, profile=True)
    rec.time(
        "h2d device_put(views) one list",
        lambda: jax.block_until_ready(jax.device_put(views, on_device)),
        reps,
        profile=False,
    )
    files = sorted((base / "ours" / "0").rglob("*.safetensors"))
    need = sum(p.stat().st_size + 4096 for p in files)
    into = flat if flat.nbytes >= need else tb.aligned(need)
    rec.time("read limit (8 threads)", lambda: tb.read_files(files, into, False), reps, False)

    # Both at once, on separate memory: whether this machine overlaps reads and transfers at
    # all (a restore can be no faster than this, whatever its pipeline).
    other = tb.aligned(need)

    def at_once() -> None:
        reading = threading.Thread(target=tb.read_files, args=(files, other, False))
        reading.start()
        by_waves()
        reading.join()

    rec.time("read + h2d at once (separate memory)", at_once, reps, profile=False)
    mngr.close()


def save_case(state: Any, base: Path, rec: Recorder, reps: int) -> None:
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)

    def d2h() -> None:
        fresh = jax.tree.leaves(tb.fresh(state))
        f0 = _faults()
        t0 = time.perf_counter()
        for x in fresh:
            x.copy_to_host_async()
        _ = [np.asarray(x) for x in fresh]
        rec.doc["notes"].setdefault("d2h", []).append(
            {"s": round(time.perf_counter() - t0, 4), "minor_faults": _faults() - f0}
        )

    for _ in range(reps):
        d2h()
    log(f"d2h: {rec.doc['notes']['d2h']}")
    flat = tb.aligned(nbytes)
    at = 0
    for x in leaves:
        h = np.asarray(x)
        flat[at : at + h.nbytes] = h.reshape(-1).view(np.uint8)
        at += h.nbytes
    for threads, direct, name in (
        (2, False, "write buffered + fsync, 2 threads"),
        (8, False, "write buffered + fsync, 8 threads"),
        (8, True, "write O_DIRECT + fsync, 8 threads"),
    ):
        with patched(tb, WRITE_THREADS=threads):
            n = 1 if direct else min(reps, 2)
            rec.time(
                name,
                lambda d=direct, data=flat: tb.write_file(base / "limit.bin", data, d),
                n,
                False,
            )
    (base / "limit.bin").unlink(missing_ok=True)
    del flat

    mngr = ocp.CheckpointManager(
        base / "save",
        options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True),
    )
    step = [0]

    def save() -> None:
        fresh = tb.fresh(state)
        step[0] += 1
        mngr.save(step[0], args=osf.SafetensorsSave(fresh))
        del fresh
        mngr.wait_until_finished()
        tb.sync_tree(base / "save" / str(step[0]))

    save()  # warm-up
    rec.time("durable save (direct I/O auto)", save, reps)
    with env(OSF_DIRECT_IO="never"):
        rec.time("durable save (direct I/O never)", save, reps)
        with patched(_local, WRITE_THREADS=8):
            rec.time("durable save (never, 8 write threads)", save, reps)
    with patched(_local, DIRECT_WRITE_THREADS=8):
        rec.time("durable save (auto, 8 direct threads)", save, reps, profile=False)
    # Last (it cannot be undone): glibc serves large blocks from its heap, not fresh mmaps, and
    # keeps freed memory, so host copies land in pages faulted in by an earlier save.
    if _no_fresh_mmaps():
        for _ in range(reps):
            d2h()
        rec.note("d2h after mallopt", rec.doc["notes"]["d2h"][-reps:])
        save()
        rec.time("durable save (auto, mallopt: no mmap)", save, reps)
    mngr.close()


def _no_fresh_mmaps() -> bool:
    """``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, 1 << 40)`` where glibc
    has them; whether both took."""
    from orbax_safetensors._src.storage.direct import libc_function

    mallopt = libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("restore", "save"))
    p.add_argument("--case", default="2G:bfloat16", help="SIZE:DTYPE")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary dir)")
    p.add_argument("--smoke", action="store_true", help="16M float32, 1 rep, 2 layers (CPU)")
    args = p.parse_args()
    if args.smoke:
        args.case, args.reps, args.layers = "16M:float32", 1, 2
    size, dtype = args.case.split(":")
    specs = llama_specs(parse_size(size), dtype, layers=args.layers)
    state = make_state(specs, seed=0)
    meta = {
        "what": args.what,
        "case": args.case,
        "tensors": len(specs),
        "bytes": sum(s.nbytes for s in specs),
        "platform": jax.devices()[0].platform,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OSF_"))},
    }
    rec = Recorder(args.json, meta)
    base = Path(tempfile.mkdtemp(prefix="osf-tpu-probe-", dir=args.dir))
    try:
        (restore_case if args.what == "restore" else save_case)(state, base, rec, args.reps)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
