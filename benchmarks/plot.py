"""The plots of ``docs/performance.md``, from the figures it quotes or from your own runs.

``benchmarks/figures.json`` holds the medians the page quotes, in the shapes the benchmarks
write them: ``cpu`` as ``benchmarks/run.py``'s ``results.json`` (``cases``, each method's
``summary``), ``tpu`` as a list of runs, each the cases of one ``benchmarks/tpu_bench.py
--json`` file. So ``--cpu`` takes a ``results.json`` of yours and ``--tpu`` one or more
``tpu_bench.py --json`` files, drawn the same way:

- ``cpu.png``: each method's bandwidth as a multiple of the device's (the ``device`` row's
  time over the method's: fio's durable write for saves, fio's ``O_DIRECT`` read for cold
  restores, a memory copy for warm ones; 1 = the device's limit), per state size;
- ``tpu.png``: seconds of ours, Orbax and the chip's limit for the same bytes (device-to-host
  copy; device-to-host + file write; the larger of file read and host-to-device), per run.

Run (matplotlib: ``pip install matplotlib``, or the ``bench`` extra)::

    python benchmarks/plot.py          # docs/img/cpu.png and docs/img/tpu.png, figures.json
    python benchmarks/plot.py --cpu results/results.json --tpu tpu2.json --out plots
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures.json"
IMG = HERE.parent / "docs" / "img"

#: the methods drawn, in this order, with their labels (others in a results.json are left out)
CPU_METHODS = {
    "ours.file": "ours: save_file / load_file",
    "ours.mngr.sync": "ours: CheckpointManager, sync",
    "ours.mngr.async": "ours: CheckpointManager, async",
    "floor": "plain write + fsync / aligned readinto",
    "safetensors.flax": "safetensors.flax",
    "orbax.standard": "Orbax StandardCheckpointer",
}
CPU_PANELS = (
    ("save_s", "save, until durable (1 = fio's best durable write)"),
    ("cold_s", "restore, cold (1 = fio's best O_DIRECT read)"),
    ("warm_s", "restore, warm (1 = a memory copy of the state)"),
)


def size_label(nbytes: float) -> str:
    """``256 MiB``, ``1 GiB``, ``4 GiB``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:g} GiB"
    return f"{nbytes / 2**20:g} MiB"


def cpu_groups(results: dict[str, Any]) -> list[tuple[str, dict[str, dict[str, float]]]]:
    """``(label, {method: summary})`` per LLaMA-like case of a ``run.py`` results document,
    by size; the dtype joins the label when the cases have several."""
    cases = [c for c in results["cases"] if c.get("kind") == "llama" and not c.get("partial")]
    dtypes = {c["dtype"] for c in cases}
    cases.sort(key=lambda c: (c["dtype"], c["spec"].get("size") or c["state_bytes"]))
    groups = []
    for c in cases:
        label = size_label(c["spec"].get("size") or c["state_bytes"])
        if len(dtypes) > 1:
            label += f"\n{c['dtype']}"
        summaries = {n: e.get("summary", {}) for n, e in c["methods"].items()}
        groups.append((label, summaries))
    return groups


def tpu_groups(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(label, case)`` per case of every run (``{"label", "cases"}``)."""
    return [
        (f"{run['label']}\n{size_label(case['bytes'])} {case['dtype']}", case)
        for run in runs
        for case in run["cases"]
    ]


def _best(limits: dict[str, Any]) -> float:
    values = [v for v in limits.values() if isinstance(v, (int, float))]
    return min(values) if values else math.nan


def tpu_bars(case: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Per panel, ``(ours, Orbax, limit)`` seconds of one ``tpu_bench.py`` case."""
    ours, orbax = case["runs"]["ours"], case["runs"]["orbax"]
    d2h, h2d = _best(case["d2h"]), _best(case["h2d"])
    write, read = _best(case["write"]), _best(case["read"])
    return {
        "block": (ours["block"], orbax["block"], d2h),
        "durable": (ours["durable"], orbax["durable"], d2h + write),
        "restore": (ours["restore"], orbax["restore"], max(read, h2d)),
    }


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cpu(groups: list[tuple[str, dict[str, dict[str, float]]]], path: Path, note: str) -> None:
    """``cpu.png``: one panel per operation, bars per method and state size: the bandwidth as
    a multiple of the device's, or the median seconds where no case has a ``device`` row (a
    run without fio)."""
    plt = _pyplot()
    methods = [m for m in CPU_METHODS if any(m in g for _, g in groups)]
    ratio = any(s.get("device", {}).get("save_s") for _, s in groups)
    fig, axes = plt.subplots(1, len(CPU_PANELS), figsize=(15, 4.6), sharey=True)
    width = 0.8 / max(1, len(methods))
    for ax, (key, title) in zip(axes, CPU_PANELS):
        for i, method in enumerate(methods):
            xs, ys = [], []
            for g, (_, summaries) in enumerate(groups):
                limit = summaries.get("device", {}).get(key) if ratio else 1.0
                mine = summaries.get(method, {}).get(key)
                if limit and mine:
                    xs.append(g + (i - (len(methods) - 1) / 2) * width)
                    ys.append(limit / mine if ratio else mine)
            ax.bar(xs, ys, width, label=CPU_METHODS[method], color=f"C{i}")
        if ratio:
            ax.axhline(1.0, color="black", linewidth=1)
        else:
            ax.set_yscale("log")
            title = title.split(" (")[0]
        ax.set_xticks(range(len(groups)), [label for label, _ in groups])
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("bandwidth, x the device's" if ratio else "median seconds")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"CPU: {'higher' if ratio else 'lower'} is faster. {note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_tpu(groups: list[tuple[str, dict[str, Any]]], path: Path, note: str) -> None:
    """``tpu.png``: one panel per operation, ours / Orbax / the limit per run, log seconds."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    panels = (
        ("block", "save() blocks the caller\n(limit: device-to-host copy)"),
        ("durable", "save until durable\n(limit: device-to-host + file write)"),
        ("restore", "restore onto the chip\n(limit: max(file read, host-to-device))"),
    )
    names = ("ours", "Orbax", "the chip's limit")
    colors = ("C0", "C5", "0.6")
    bars = [tpu_bars(case) for _, case in groups]
    top = 2 * max(v for b in bars for triple in b.values() for v in triple)
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.6), sharey=True)
    for ax, (key, title) in zip(axes, panels):
        for i, (name, color) in enumerate(zip(names, colors)):
            xs = [g + (i - 1) * 0.27 for g in range(len(groups))]
            ys = [b[key][i] for b in bars]
            drawn = ax.bar(xs, ys, 0.27, label=name, color=color)
            ax.bar_label(drawn, [f"{y:.3g}" for y in ys], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(0.01, top)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("seconds (log scale)")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"TPU v5e: lower is faster. {note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", type=Path, help="a results.json of benchmarks/run.py")
    p.add_argument("--tpu", type=Path, nargs="+", help="benchmarks/tpu_bench.py --json files")
    p.add_argument("--out", type=Path, default=IMG, help=f"where the PNGs go (default {IMG})")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.cpu or args.tpu:
        if args.cpu:
            groups = cpu_groups(json.loads(args.cpu.read_text()))
            written.append(args.out / "cpu.png")
            plot_cpu(groups, written[-1], f"From {args.cpu}.")
        if args.tpu:
            runs = [{"label": f.stem, "cases": json.loads(f.read_text())} for f in args.tpu]
            written.append(args.out / "tpu.png")
            plot_tpu(tpu_groups(runs), written[-1], f"From {', '.join(map(str, args.tpu))}.")
    else:
        figures = json.loads(FIGURES.read_text())
        cpu, tpu = figures["cpu"], figures["tpu"]
        written += [args.out / "cpu.png", args.out / "tpu.png"]
        plot_cpu(cpu_groups(cpu), written[0], f"Measured with {cpu['measured']}.")
        plot_tpu(tpu_groups(tpu["runs"]), written[1], f"Measured on {tpu['measured']}.")
    print("wrote " + ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
