"""Aggregation (medians, spreads, ratios), Markdown tables and the plot."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.device import describe
from benchmarks.state import GIB, format_size

#: per-op metrics kept from each run: (summary key, op, field in the worker result)
_METRICS: tuple[tuple[str, str, str], ...] = (
    ("save_s", "save", "seconds"),
    ("save_call_s", "save", "save_call_s"),
    ("save_wait_s", "save", "save_wait_s"),
    ("save_sync_s", "save", "save_sync_s"),
    ("d2h_copy_s", "save", "d2h_copy_s"),
    ("save_peak", "save", "peak_extra"),
    ("disk_bytes", "save", "disk_bytes"),
    ("disk_files", "save", "disk_files"),
    ("cold_s", "cold", "seconds"),
    ("cold_peak", "cold", "peak_extra"),
    ("cold_read_bytes", "cold", "io_read_bytes"),
    ("cold_rchar", "cold", "io_rchar"),
    ("cold_ckpt_read", "cold", "ckpt_cached_bytes"),
    ("warm_s", "warm", "seconds"),
    ("warm_peak", "warm", "peak_extra"),
    ("warm_rchar", "warm", "io_rchar"),
    ("save_cpu_s", "save", "cpu_seconds"),
    ("cold_cpu_s", "cold", "cpu_seconds"),
    ("warm_cpu_s", "warm", "cpu_seconds"),
)

_TIMES = (("save", "save_s"), ("cold", "cold_s"), ("warm", "warm_s"))


def summarize_method(entry: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    """Medians (and spreads of the times) over the measured, successful runs of one method."""
    runs = [r for r in entry.get("runs", []) if not r.get("warmup")]
    summary: dict[str, Any] = {}
    for key, op, field in _METRICS:
        values = [r[op][field] for r in runs if field in r.get(op, {}) and "error" not in r[op]]
        if not values:
            continue
        med = statistics.median(values)
        summary[key] = med
        summary[f"{key}_n"] = len(values)
        if key.endswith("_s") and med > 0:
            summary[f"{key}_spread"] = (max(values) - min(values)) / med
    for key in ("save_peak", "cold_peak", "warm_peak"):
        if key in summary:
            summary[f"{key}_x"] = summary[key] / state_bytes
    errors = [
        r[op]["error"] for r in runs for op in ("save", "cold", "warm") if "error" in r.get(op, {})
    ]
    verdicts = [r[op].get("verified") for r in runs for op in ("cold", "warm") if op in r]
    bad = [v for v in verdicts if v and v != "ok"]
    summary["verified"] = bad[0] if bad else ("ok" if verdicts else "-")
    zero_copy = [
        r[op]["notes"]["zero_copy_leaves"]
        for r in runs
        for op in ("cold", "warm")
        if "zero_copy_leaves" in r.get(op, {}).get("notes", {})
    ]
    if zero_copy:
        summary["zero_copy_leaves"] = zero_copy[-1]
    converted = [
        r[op].get("converted_to_jax", 0) for r in runs for op in ("cold", "warm") if op in r
    ]
    if any(converted):
        summary["converted_to_jax"] = max(converted)
    if errors:
        summary["errors"] = sorted(set(errors))[:3]
    return summary


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(text: str, limit: int = 160) -> str:
    """One line, no pipes, at most ``limit`` characters: safe inside a Markdown table cell."""
    line = " ".join(str(text).split()).replace("|", "/")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _status(entry: dict[str, Any]) -> str:
    return _cell(entry.get("status", "ok"))


def case_table(case: dict[str, Any]) -> str:
    """The main table of one (non-partial) case."""
    state_bytes = case["state_bytes"]
    gib = state_bytes / GIB
    methods = case["methods"]
    floor = methods.get("floor", {}).get("summary", {})
    limit = methods.get("device", {}).get("summary", {})
    head = (
        "| method | save s | restore cold s | restore warm s "
        "| x device bandwidth save / cold / warm "
        "| save GB/s | cold GB/s | warm GB/s "
        "| save s/GiB | cold s/GiB | warm s/GiB | CPU s save / cold / warm "
        "| peak extra mem save / cold / warm (x state) "
        "| vs floor save / cold / warm | spread max | verified |"
    )
    ncols = head.count("|") - 1
    lines = [head, "|" + "---|" * ncols]
    for name, entry in methods.items():
        status = _status(entry)
        s = entry.get("summary", {})
        if status != "ok" and not any(k in s for _, k in _TIMES):
            lines.append(f"| {name} | {status} |" + " |" * (ncols - 2))
            continue
        times = [s.get(k) for _, k in _TIMES]
        rates = [state_bytes / 1e9 / t if t else None for t in times]
        per_gib = [t / gib if t else None for t in times]
        mem = " / ".join(_fmt(s.get(f"{op}_peak_x"), 2) for op in ("save", "cold", "warm"))
        vs_floor = " / ".join(_fmt(_ratio(s.get(k), floor.get(k)), 2) for _, k in _TIMES)
        # Bandwidth as a fraction of the device's (1.0 = at the limit): device time / time.
        vs_device = " / ".join(_fmt(_ratio(limit.get(k), s.get(k)), 2) for _, k in _TIMES)
        spreads = [s.get(f"{k}_spread") for _, k in _TIMES if s.get(f"{k}_spread") is not None]
        cells = [
            name if status == "ok" else f"{name} ({status})",
            *(_fmt(t) for t in times),
            vs_device,
            *(_fmt(r) for r in rates),
            *(_fmt(p) for p in per_gib),
            " / ".join(_fmt(s.get(f"{op}_cpu_s"), 2) for op in ("save", "cold", "warm")),
            mem,
            vs_floor,
            _fmt(max(spreads), 2) if spreads else "-",
            _cell(s.get("verified", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_tensor_table(case: dict[str, Any]) -> str:
    """Time per tensor (microseconds) of each method: the fixed cost that dominates trees of
    many small tensors, and the memory, bandwidth-free part of every save and restore."""
    n = case["n_tensors"]
    lines = [
        "| method | save µs/tensor | cold µs/tensor | warm µs/tensor |",
        "|---|---|---|---|",
    ]
    for name, entry in case["methods"].items():
        s = entry.get("summary", {})
        cells = [_fmt(s[k] / n * 1e6, 3) if s.get(k) else "-" for _, k in _TIMES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_table(case: dict[str, Any]) -> str:
    """Row method time / column method time, for save / cold / warm (< 1: row is faster)."""
    ok = {
        n: e["summary"]
        for n, e in case["methods"].items()
        if any(k in e.get("summary", {}) for _, k in _TIMES)
    }
    names = list(ok)
    if len(names) < 2:
        return ""
    head = "| row ÷ column (save / cold / warm) | " + " | ".join(names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for row in names:
        cells = []
        for col in names:
            if row == col:
                cells.append("1")
                continue
            cells.append(
                " / ".join(_fmt(_ratio(ok[row].get(k), ok[col].get(k)), 2) for _, k in _TIMES)
            )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def async_table(case: dict[str, Any]) -> str:
    """How long each method's ``save()`` call blocks, next to a bare device-to-host copy."""
    lines = [
        "| method | save() blocks s | wait for write s | fsync s | total s | bare D2H copy s | blocks ÷ D2H | on disk MB (files) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in case["methods"].items():
        s = entry.get("summary", {})
        if "save_s" not in s:
            continue
        d2h = s.get("d2h_copy_s")
        disk = s.get("disk_bytes")
        files = s.get("disk_files")
        lines.append(
            f"| {name} | {_fmt(s.get('save_call_s'))} | {_fmt(s.get('save_wait_s'))} "
            f"| {_fmt(s.get('save_sync_s'))} | {_fmt(s.get('save_s'))} | {_fmt(d2h)} "
            f"| {_fmt(_ratio(s.get('save_call_s'), d2h), 2)} "
            f"| {_fmt(disk / 1e6 if disk else None, 4)} ({_fmt(files)}) |"
        )
    return "\n".join(lines)


def partial_table(case: dict[str, Any]) -> str:
    """Partial restores: time, what was asked for and what was actually read."""
    lines = [
        "| method | partial restore cold s | tensors | wanted MB | checkpoint MB read (page cache) "
        "| read_bytes MB (process, disk) | rchar MB (syscalls) | checkpoint read ÷ wanted "
        "| peak extra MB | full-state cold restore read MB | verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in case["methods"].items():
        status = _status(entry)
        s = entry.get("summary", {})
        if "cold_s" not in s:
            lines.append(f"| {name} | {status if status != 'ok' else 'no result'} |" + " |" * 9)
            continue
        wanted = case["wanted_bytes"]
        full = case.get("full_read_bytes", {}).get(name)
        ckpt = s.get("cold_ckpt_read")
        ckpt = ckpt if ckpt is not None and ckpt >= 0 else None
        lines.append(
            f"| {name} | {_fmt(s['cold_s'])} | {case['n_wanted']}/{case['n_tensors']} "
            f"| {_fmt(wanted / 1e6)} | {_fmt(ckpt / 1e6 if ckpt is not None else None)} "
            f"| {_fmt(s.get('cold_read_bytes', 0) / 1e6)} "
            f"| {_fmt(s.get('cold_rchar', 0) / 1e6)} "
            f"| {_fmt(_ratio(ckpt, wanted), 2)} "
            f"| {_fmt(s.get('cold_peak', 0) / 1e6)} | {_fmt(full / 1e6 if full else None)} "
            f"| {_cell(s.get('verified', '-'))} |"
        )
    return "\n".join(lines)


def load_summary(results: dict[str, Any]) -> tuple[float, float] | None:
    """(median, max) of the 1-minute load average sampled around every timed operation."""
    loads = [
        op["loadavg_1m"]
        for case in results["cases"]
        for entry in case["methods"].values()
        for run in entry.get("runs", [])
        for op in run.values()
        if isinstance(op, dict) and "loadavg_1m" in op
    ]
    return (statistics.median(loads), max(loads)) if loads else None


def markdown(results: dict[str, Any]) -> str:
    """The whole report."""
    meta = results["meta"]
    out = ["# orbax-safetensors benchmark results", ""]
    out.append(f"- command: `{meta['command']}`")
    out.append(f"- when: {meta['started']} (total {meta.get('elapsed_s', 0):.0f} s)")
    out.append(f"- machine: {meta['machine']}")
    ra = meta.get("read_ahead_kib")
    out.append(
        f"- checkpoint dir: `{meta['workdir']}` on {meta['filesystem']}"
        + (f" (read-ahead {ra} KiB)" if ra is not None else "")
    )
    out.append(f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}")
    out.append(f"- cold restores: {meta['cold_note']}")
    load = load_summary(results)
    if load:
        busy = load[1] > 0.75 * (os.cpu_count() or 1)
        out.append(
            f"- machine load (1-min load average around each timed operation): median "
            f"{load[0]:.2f}, max {load[1]:.2f}"
            + (" -- **other processes were competing for the CPUs: expect noise**" if busy else "")
        )
    hot = meta.get("hot_memory", 0)
    out.append(
        f"- hot memory hand-off: {hot:g}x state (memory kept faulted in by the orchestrator and "
        "released just before each timed operation; see README)"
        if hot
        else "- hot memory hand-off: off (first touches of memory pay this VM's reclaim cost)"
    )
    out.append(
        f"- protocol: each number is the median of {meta['repeats']} runs"
        f"{' after one warm-up round' if meta['warmup'] else ' (no warm-up round)'}; every save, "
        "cold restore and warm restore runs in a fresh Python process; methods alternate "
        "round-robin (the order rotates each round). Saves are timed until durable (method "
        "save, wait for async completion, fsync of every file and directory written). Restores "
        "produce jax.Arrays (block_until_ready). Peak extra memory = peak RSS during the "
        "operation (VmHWM after a reset) minus RSS before it, as a multiple of the state size. "
        "GB/s uses 10^9 bytes; s/GiB uses 2^30. Read differences under ~20% as noise."
    )
    fio = meta.get("fio")
    if fio:

        def grid(kind: str) -> str:
            return "; ".join(
                f"{describe(c['settings'])}: {c['gb_s']:.2f} GB/s"
                for c in fio.get(f"{kind}_calibration", [])
            )

        out.append(
            f"- device row (fio, fastest of a calibration grid on up to 1 GiB): write until "
            f"durable `{describe(fio['write'])}` (grid: {grid('write')}); O_DIRECT read "
            f"`{describe(fio['read'])}` (grid: {grid('read')}). "
            "`x device bandwidth` = device time / method time (1.00 = at the device's limit; "
            "warm: against a numpy copy of the state, i.e. memory bandwidth)"
        )
    for name, reason in meta.get("unavailable", {}).items():
        out.append(f"- {name}: n/a: {reason}")
    out.append("")
    out.append("Methods: " + "; ".join(f"**{n}**: {d}" for n, d in meta["methods"].items()))
    for case in results["cases"]:
        out += ["", f"## {case['title']}", ""]
        out.append(
            f"{case['n_tensors']} tensors, {case['state_bytes'] / 1e6:.1f} MB "
            f"({case['state_bytes'] / 2**20:.1f} MiB), dtype {case['dtype']}."
        )
        out.append("")
        if case.get("partial"):
            out.append(partial_table(case))
            continue
        out.append(case_table(case))
        if case["n_tensors"] >= 1000:
            out += ["", "Per-tensor cost (time ÷ number of tensors):", "", per_tensor_table(case)]
        peers = peer_table(case)
        if peers:
            out += [
                "",
                "Ratios between methods (row time ÷ column time; below 1 the row is faster):",
                "",
                peers,
            ]
        out += [
            "",
            "Save breakdown (the async methods' `save()` call vs. a bare device-to-host copy of the state):",
            "",
        ]
        out.append(async_table(case))
        errs = [
            (n, e["summary"]["errors"])
            for n, e in case["methods"].items()
            if e.get("summary", {}).get("errors")
        ]
        for n, es in errs:
            out.append(f"\n- {n} errors: " + "; ".join(f"`{_cell(x, 300)}`" for x in es))
    out.append("")
    return "\n".join(out)


def _requested(case: dict[str, Any]) -> int:
    """The requested state size of a case (the generated one is a few rows smaller)."""
    return int(case["spec"].get("size") or case["state_bytes"])


def plot(results: dict[str, Any], path: Path) -> str | None:
    """Per method against state size (save, cold, warm panels): with a ``device`` row, the
    bandwidth as a multiple of the device's (top row; 1 = the limit) above the median
    seconds (bottom row); without one, the seconds alone. Returns an error or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError as e:
        return f"matplotlib missing ({e}); pip install matplotlib"
    cases = [c for c in results["cases"] if c["kind"] == "llama" and not c.get("partial")]
    if not cases:
        return "no LLaMA-like cases to plot"
    has_device = any("device" in c["methods"] for c in cases)
    rows = 2 if has_device else 1
    fig, grid = plt.subplots(rows, 3, figsize=(16, 5 * rows), squeeze=False)
    styles = ["-", "--", ":", "-."]
    dtypes = sorted({c["dtype"] for c in cases})
    method_names = list(dict.fromkeys(n for c in cases for n in c["methods"]))
    colors = {n: f"C{i}" for i, n in enumerate(method_names)}
    sizes = sorted({_requested(c) for c in cases})

    def point(c: dict[str, Any], name: str, key: str, ratio: bool) -> float | None:
        s = c["methods"].get(name, {}).get("summary", {})
        if key not in s or not s[key]:
            return None
        if not ratio:
            return float(s[key])
        limit = c["methods"].get("device", {}).get("summary", {}).get(key)
        return float(limit) / float(s[key]) if limit else None

    for row, ratio in enumerate([True, False] if has_device else [False]):
        for ax, (op, key) in zip(grid[row], _TIMES):
            for name in method_names:
                if ratio and name == "device":
                    continue
                for di, dtype in enumerate(dtypes):
                    pts = []
                    for c in cases:
                        y = point(c, name, key, ratio) if c["dtype"] == dtype else None
                        if y is not None:
                            pts.append((_requested(c) / 2**20, y))
                    if not pts:
                        continue
                    pts.sort()
                    xs, ys = zip(*pts)
                    ax.plot(
                        xs,
                        ys,
                        styles[di % len(styles)],
                        marker="o",
                        color=colors[name],
                        label=f"{name} {dtype}",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xticks([x / 2**20 for x in sizes], [format_size(x) for x in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            if not ratio:
                ax.set_yscale("log")
            ax.set_xlabel("state size (MiB)")
            title = {
                "save": "save (until durable)",
                "cold": "restore, cold cache",
                "warm": "restore, warm cache",
            }[op]
            if ratio:
                ax.axhline(1.0, color="black", linewidth=1)
                ax.set_ylim(bottom=0)
                limit = "memory copy" if op == "warm" else "fio"
                title += f": x device bandwidth (1 = {limit})"
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        grid[row][0].set_ylabel("x device bandwidth" if ratio else "median seconds")
        grid[row][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
