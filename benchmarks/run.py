#!/usr/bin/env python
"""Benchmark harness: save / restore speed and memory of orbax-safetensors against its peers.

Examples::

    python benchmarks/run.py --sizes 256M,1G --dtypes float32,bfloat16 --repeats 3 \\
        --out benchmarks/results
    python benchmarks/run.py --quick                 # smoke test, < 90 s
    python benchmarks/run.py --many-small --partial  # 10,000 x 1 KiB; 1% of a 1 GiB checkpoint

Every save, cold restore and warm restore runs in a fresh Python subprocess
(``benchmarks/worker.py``); this process only orchestrates, aggregates and reports. Results go
to ``<out>/results.md``, ``<out>/results.json`` and ``<out>/plot.png``. See
``benchmarks/README.md`` for the protocol and how to read the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, sys.path[0] is benchmarks/ itself: drop it so our module names cannot shadow
# installed ones, and import the harness as the ``benchmarks`` package from the repo root.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from benchmarks import device, procfs, report  # noqa: E402
from benchmarks.methods import METHODS  # noqa: E402
from benchmarks.state import (  # noqa: E402
    SUPPORTED_DTYPES,
    case_specs,
    format_size,
    parse_size,
    partial_selection,
)
from benchmarks.worker import DONE, MARKER, RELEASE  # noqa: E402

_VERSIONED = (
    "jax",
    "jaxlib",
    "flax",
    "orbax-checkpoint",
    "safetensors",
    "numpy",
    "ml_dtypes",
    "orbax-safetensors",
)


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the final table)."""
    print(msg, file=sys.stderr, flush=True)


def run_worker(
    job: dict[str, Any], timeout: float, hot: procfs.HotMemory | None = None
) -> dict[str, Any]:
    """Runs one job in a fresh interpreter and returns its result dict (or ``{"error": ...}``).

    With ``hot``, the worker announces (``@@RELEASE@@`` on stdout) that its timed operation is
    about to start; the hot memory is released and the worker told to go on; when it reports the
    operation done (``@@DONE@@``) the memory is taken back (see ``procfs.HotMemory``).
    """
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    job = {**job, "handoff": hot is not None and hot.nbytes > 0}
    cmd = [sys.executable, "-m", "benchmarks.worker", json.dumps(job)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drain.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    result: dict[str, Any] | None = None
    try:
        for line in proc.stdout:
            if line.startswith(RELEASE):
                if hot is not None:
                    hot.release()
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif line.startswith(DONE):
                if hot is not None:
                    # now, while the pages the operation left free are still hot
                    hot.warm(background=True)
            elif line.startswith(MARKER):
                result = json.loads(line[len(MARKER) :])
        proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode not in (0, None)
        timer.cancel()
        if hot is not None:
            hot.warm(background=True)
        drain.join(timeout=5)
    if result is not None:
        return result
    if timed_out:
        return {"error": f"timeout after {timeout:.0f} s"}
    tail = " | ".join("".join(stderr).strip().splitlines()[-5:])
    return {"error": f"worker exited {proc.returncode} without a result: {tail}"[:800]}


def fresh_dir(path: Path) -> None:
    """Empties ``path`` and flushes the deletion, so it does not land in the next timing."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()


def _short(result: dict[str, Any]) -> str:
    if "error" in result:
        return result["error"].splitlines()[0][:160]
    return f"{result['seconds']:.3f}s"


def run_full_case(
    case: dict[str, Any], names: list[str], args: argparse.Namespace, workdir: Path
) -> None:
    """Save / cold restore / warm restore for each method, rounds rotated, results in ``case``."""
    spec = case["spec"]
    hot = procfs.HotMemory(int(args.hot_memory * case["state_bytes"]))
    hot.warm()
    rounds = int(args.warmup) + args.repeats
    for r in range(rounds):
        warm_up = r < int(args.warmup)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            entry = case["methods"][name]
            directory = workdir / case["id"] / name.replace(".", "_")
            fresh_dir(directory)
            job = {"method": name, "case": spec, "dir": str(directory), "fio": args.fio}
            run: dict[str, Any] = {"round": r, "warmup": warm_up}
            run["save"] = run_worker({**job, "op": "save"}, args.timeout, hot)
            if "error" not in run["save"]:
                for mode in ("cold", "warm"):
                    run[mode] = run_worker(
                        {**job, "op": "restore", "mode": mode}, args.timeout, hot
                    )
            entry["runs"].append(run)
            label = "warm-up" if warm_up else f"round {r - int(args.warmup) + 1}/{args.repeats}"
            log(
                f"  [{case['title']}] {label} {name}: save {_short(run['save'])}"
                + "".join(f", {m} {_short(run[m])}" for m in ("cold", "warm") if m in run)
            )
    hot.release()
    case["hot_memory_warm_s"] = hot.warm_seconds
    for entry in case["methods"].values():
        entry["summary"] = report.summarize_method(entry, case["state_bytes"])
        if not entry["summary"].get("save_s") and entry["runs"]:
            first = entry["runs"][0]["save"].get("error", "no successful run")
            entry["status"] = first if first.startswith("n/a") else f"error: {first}"


def run_partial_case(
    case: dict[str, Any], names: list[str], args: argparse.Namespace, workdir: Path
) -> None:
    """Saves once per method, then times cold restores of a partial selection, rotated."""
    spec = case["spec"]
    hot = procfs.HotMemory(int(args.hot_memory * case["state_bytes"]))
    hot.warm()
    ready: list[str] = []
    for name in names:
        if name == "device":  # fio reads whole files: no partial row
            case["methods"][name]["status"] = "n/a: whole-file device limit"
            continue
        directory = workdir / case["id"] / name.replace(".", "_")
        fresh_dir(directory)
        save = run_worker(
            {"op": "save", "method": name, "case": spec, "dir": str(directory)}, args.timeout, hot
        )
        case["methods"][name]["save"] = save
        log(f"  [{case['title']}] {name}: save {_short(save)}")
        if "error" in save:
            case["methods"][name]["status"] = f"error: {save['error']}"
        else:
            ready.append(name)
    rounds = int(args.warmup) + args.repeats
    for r in range(rounds):
        order = ready[r % max(1, len(ready)) :] + ready[: r % max(1, len(ready))]
        for name in order:
            directory = workdir / case["id"] / name.replace(".", "_")
            job = {
                "op": "restore",
                "mode": "cold",
                "method": name,
                "case": spec,
                "dir": str(directory),
                "partial_fraction": args.partial_fraction,
            }
            result = run_worker(job, args.timeout, hot)
            case["methods"][name]["runs"].append(
                {"round": r, "warmup": r < int(args.warmup), "cold": result}
            )
            log(f"  [{case['title']}] round {r} {name}: partial cold {_short(result)}")
    hot.release()
    case["hot_memory_warm_s"] = hot.warm_seconds
    for name, entry in case["methods"].items():
        entry["summary"] = report.summarize_method(entry, case["state_bytes"])
        if "cold_s" not in entry["summary"] and entry.get("status", "ok") == "ok" and entry["runs"]:
            err = entry["runs"][-1]["cold"].get("error", "no successful run")
            entry["status"] = err if err.startswith("n/a") else f"error: {err}"
        elif name not in ready and entry.get("status", "ok") == "ok":
            entry["status"] = "not run"


def make_case(
    kind: str, dtype: str, args: argparse.Namespace, *, size: int = 0, partial: bool = False
) -> dict[str, Any]:
    """A case record: its spec (passed to workers) and descriptive fields."""
    if kind == "llama":
        spec: dict[str, Any] = {
            "kind": kind,
            "size": size,
            "dtype": dtype,
            "layers": args.layers,
            "seed": args.seed,
            "hot_memory": args.hot_memory,
        }
        label = format_size(size)
        title = f"LLaMA-like {label} {dtype}"
    else:
        spec = {
            "kind": kind,
            "count": args.small_count,
            "tensor_bytes": args.small_bytes,
            "dtype": dtype,
            "seed": args.seed,
            "hot_memory": args.hot_memory,
        }
        label = f"{args.small_count}x{format_size(args.small_bytes)}"
        title = f"{args.small_count:,} tensors of {format_size(args.small_bytes)} {dtype}"
    specs = case_specs(spec)
    case: dict[str, Any] = {
        "id": f"{kind}-{label}-{dtype}" + ("-partial" if partial else ""),
        "kind": kind,
        "title": title,
        "size_label": label,
        "dtype": dtype,
        "spec": spec,
        "state_bytes": sum(s.nbytes for s in specs),
        "n_tensors": len(specs),
        "partial": partial,
        "methods": {},
    }
    if partial:
        wanted = partial_selection(specs, args.partial_fraction)
        case["title"] = (
            f"Partial restore: {len(wanted)} of {len(specs)} tensors "
            f"({args.partial_fraction:.0%}) of a {label} {dtype} checkpoint, cold cache"
        )
        case["wanted_bytes"] = sum(s.nbytes for s in wanted)
        case["n_wanted"] = len(wanted)
        case["wanted_names"] = [s.name for s in wanted]
    return case


def versions() -> dict[str, str]:
    """Installed versions of the packages that matter (without importing them)."""
    out = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed" if dist != "orbax-safetensors" else "from repo"
    return out


def machine() -> str:
    """CPU model, core count, memory and kernel."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
            )
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except (OSError, ValueError):
        mem_kib = 0
    return f"{os.cpu_count()} CPUs ({model}), {mem_kib / 2**20:.1f} GiB RAM, {platform.platform()}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="256M", help="comma-separated state sizes (default 256M)")
    p.add_argument(
        "--dtypes",
        help=f"comma-separated, of {SUPPORTED_DTYPES} (default float32)",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured runs per method (>= 3)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    p.add_argument("--many-small", action="store_true", help="add 10,000 tensors of 1 KiB")
    p.add_argument("--small-count", type=int, default=10_000, help=argparse.SUPPRESS)
    p.add_argument("--small-bytes", type=parse_size, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--partial", action="store_true", help="add: restore 1%% of a 1 GiB checkpoint")
    p.add_argument("--partial-size", default="1G", help="checkpoint size for --partial")
    p.add_argument("--partial-fraction", type=float, default=0.01, help="fraction of tensors")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 8M, float32, 1 run, no warm-up"
    )
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip warm-up round")
    p.add_argument("--layers", type=int, default=12, help="decoder blocks (9 tensors each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where checkpoints go (default: under /var/tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument(
        "--hot-memory",
        type=float,
        default=3.0,
        help="memory kept faulted in and handed to each worker, as a multiple of the state "
        "size (0: off; see procfs.HotMemory)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        help="only re-render results.md and plot.png (into --out) from an existing results.json",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = "8M", 1, False
        args.small_count = min(args.small_count, 1000)
        args.partial_size = "8M"
    elif args.repeats < 3:
        log(f"warning: --repeats {args.repeats} < 3; medians of fewer than 3 runs are fragile")
    args.dtypes = args.dtypes or "float32"
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtype_list:
        if d not in SUPPORTED_DTYPES:
            p.error(f"unsupported dtype {d!r}; choose from {SUPPORTED_DTYPES}")
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.method_list:
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {list(METHODS)}")
    return args


def write_outputs(results: dict[str, Any], out: Path) -> str:
    """Writes results.json, results.md and plot.png; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = report.markdown(results)
    (out / "results.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args.from_json:
        loaded: dict[str, Any] = json.loads(args.from_json.read_text())
        md = write_outputs(loaded, args.out)
        plot_error = report.plot(loaded, args.out / "plot.png")
        print(md)
        log(
            f"re-rendered into {args.out}"
            + (f" (plot skipped: {plot_error})" if plot_error else "")
        )
        return 0
    t_start = time.perf_counter()
    own_workdir = args.workdir is None
    base = Path("/var/tmp") if Path("/var/tmp").is_dir() else None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="osf-bench-", dir=base))
    workdir.mkdir(parents=True, exist_ok=True)
    fs = procfs.filesystem_of(workdir)
    if fs.startswith(("tmpfs", "ramfs")):
        log(f"warning: {workdir} is on {fs}: 'disk' numbers will be memory numbers")

    probe = run_worker({"op": "probe"}, 300)
    if "error" in probe:
        log(f"probe failed: {probe['error']}")
        return 1
    unavailable = {n: r for n, r in probe["unavailable"].items() if r and n in args.method_list}
    names = [n for n in args.method_list if n not in unavailable]
    for n, r in unavailable.items():
        log(f"{n}: n/a: {r}")
    args.fio = None
    if "device" in names:
        fio_error = device.ensure_fio()
        if fio_error:
            log(f"device: n/a: {fio_error}")
            unavailable["device"] = fio_error
            names.remove("device")
        else:
            largest = max(args.size_list, default=parse_size(args.partial_size))
            log("device: calibrating fio job settings (fastest of a small grid)...")
            args.fio = device.calibrate(workdir / "fio-calibration", largest)
            log(
                f"device: write {device.describe(args.fio['write'])}; "
                f"read {device.describe(args.fio['read'])}"
            )
    drop_error = procfs.drop_caches()
    cold_note = (
        "page cache dropped before each (os.sync(); echo 3 > /proc/sys/vm/drop_caches)"
        if drop_error is None
        else f"NOT cold, the page cache could not be dropped ({drop_error}): 'cold' = warm"
    )
    if drop_error:
        log(f"warning: {cold_note}")

    results: dict[str, Any] = {
        "meta": {
            "command": " ".join(
                [Path(sys.executable).name, *(sys.argv if argv is None else ["run.py", *argv])]
            ),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(),
            "workdir": str(workdir),
            "filesystem": fs,
            "read_ahead_kib": procfs.read_ahead_kib(fs),
            "versions": versions(),
            "cold_note": cold_note,
            "cache_dropped": drop_error is None,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "hot_memory": args.hot_memory,
            "methods": {n: METHODS[n].description for n in args.method_list},
            "unavailable": unavailable,
            "fio": args.fio,
        },
        "cases": [],
    }

    cases: list[dict[str, Any]] = []
    for size in args.size_list:
        for dtype in args.dtype_list:
            cases.append(make_case("llama", dtype, args, size=size))
    if args.many_small:
        cases.append(make_case("many_small", args.dtype_list[0], args))
    if args.partial:
        cases.append(
            make_case(
                "llama", args.dtype_list[0], args, size=parse_size(args.partial_size), partial=True
            )
        )
    try:
        for case in cases:
            log(f"== {case['title']} ({case['n_tensors']} tensors, {case['state_bytes']:,} B)")
            for n in args.method_list:
                case["methods"][n] = {"description": METHODS[n].description, "runs": []}
                if n in unavailable:
                    case["methods"][n]["status"] = f"n/a: {unavailable[n]}"
            if case["partial"]:
                run_partial_case(case, names, args, workdir)
                full = next(
                    (c for c in results["cases"] if not c["partial"] and c["spec"] == case["spec"]),
                    None,
                )
                if full:
                    case["full_read_bytes"] = {
                        n: e["summary"].get("cold_ckpt_read", e["summary"].get("cold_read_bytes"))
                        for n, e in full["methods"].items()
                        if "summary" in e
                    }
            else:
                run_full_case(case, names, args, workdir)
            results["cases"].append(case)
            results["meta"]["elapsed_s"] = time.perf_counter() - t_start
            write_outputs(results, args.out)
            if not args.keep:
                shutil.rmtree(workdir / case["id"], ignore_errors=True)
    finally:
        if own_workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    results["meta"]["elapsed_s"] = time.perf_counter() - t_start
    md = write_outputs(results, args.out)
    plot_error = report.plot(results, args.out / "plot.png")
    if plot_error:
        log(f"plot skipped: {plot_error}")
    print(md)
    log(f"wrote {args.out}/results.md, results.json" + ("" if plot_error else ", plot.png"))
    log(f"total {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
