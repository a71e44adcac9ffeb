"""Smoke tests of benchmarks that have no other test: they run end to end on CPU in seconds.

``benchmarks/tpu_bench.py`` measures saves, restores and a training loop against Orbax and
the machine's transfer and file limits on an accelerator (docs/performance.md, "TPU"); its
``--smoke`` run on CPU must finish, restore both methods' checkpoints bit for bit and print
every row of its report. ``benchmarks/cli_startup_bench.py`` times the command line's start
(docs/performance.md, "Command-line start"); its ``--smoke`` run must time every case and find
that neither ``--help`` nor ``inspect`` of a file imports JAX, Orbax, Flax, ml_dtypes or NumPy.
``benchmarks/maxtext_import_bench.py`` (docs/performance.md, "Hugging Face to MaxText") runs
at a tiny size, ours beside MaxText's conversion (with its wheel), the checkpoints
bit-identical. ``benchmarks/studies/tpu_probe.py`` runs its variants, and ``benchmarks/plot.py`` reads the
figures the page quotes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, *args: str, devices: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``benchmarks/SCRIPT ARGS`` in a fresh Python (on CPU with ``devices`` CPU devices when
    given), asserted to succeed."""
    env = dict(os.environ)
    if devices is not None:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_tpu_bench_smoke_run(tmp_path: Path):
    out = tmp_path / "results.json"
    done = run_benchmark(
        "tpu_bench.py", "--smoke", "--every-10", "--json", str(out), "--dir", str(tmp_path),
        devices=2,
    )  # fmt: skip
    report = done.stdout
    for row in (
        "save() blocks",
        "save until durable",
        "restore onto the devices",
        "training loop, extra s per save",
        "tight loop: the longest wait for a save",
        "device-to-host",
        "host-to-device",
        "file write until durable",
        "file read",
    ):
        assert row in report, row
    assert "Restored bit for bit: {'ours': True, 'orbax': True}" in report
    (case,) = json.loads(out.read_text())
    assert case["tensors"] == 21 and case["exact"] == {"ours": True, "orbax": True}
    for method in ("ours", "orbax"):
        run = case["runs"][method]
        assert 0 < run["block"] <= run["durable"] and run["restore"] > 0
    assert set(case["loop"]["extra_per_save"]) == {"ours", "orbax"}
    for method in ("ours", "orbax"):  # each save's wait: 3 in-loop saves and the final wait
        assert len(case["loop"]["every_10_waits"][method]) == 4
    assert list(tmp_path.glob("osf-tpu-bench-*")) == []  # its checkpoints are removed


def test_tpu_probe_smoke_runs(tmp_path: Path):
    """``benchmarks/studies/tpu_probe.py`` (the diagnosis behind docs/performance.md, "TPU")
    runs its restore and save variants end to end, each with a thread profile where it takes
    one."""
    for what, variant in (
        ("restore", "restore unstaged"),
        ("save", "durable save (direct I/O never)"),
    ):
        out = tmp_path / f"{what}.json"
        run_benchmark(
            "studies/tpu_probe.py",
            what,
            "--smoke",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
            devices=1,
        )
        doc = json.loads(out.read_text())
        assert doc["times"][variant]["median"] > 0
        assert doc["profiles"] and all(p["samples"] >= 0 for p in doc["profiles"].values())
    assert list(tmp_path.glob("osf-tpu-probe-*")) == []


def test_cli_startup_bench_smoke_run(tmp_path: Path):
    out = tmp_path / "startup.json"
    done = run_benchmark("cli_startup_bench.py", "--smoke", "--json", str(out), timeout=600)
    for row in (
        "python -c pass",
        "import orbax_safetensors",
        "--help",
        "inspect FILE",
        "load average",
    ):
        assert row in done.stdout, row
    result = json.loads(out.read_text())
    assert result["runs"] == 3
    for case in ("python -c pass", "import orbax_safetensors", "--help", "inspect FILE"):
        row = result["cases"][case]
        assert row["runs"] == 3 and 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
    for command in ("import orbax_safetensors", "--help", "inspect FILE"):
        assert result["imports"][command]["heavy_imported"] == [], command


def test_maxtext_import_bench_smoke_run(tmp_path: Path):
    import maxtext_checkpoints

    if not maxtext_checkpoints.can_import():  # (the older stacks' Orbax)
        pytest.skip(maxtext_checkpoints.NO_IMPORT)
    out = tmp_path / "import.json"
    done = run_benchmark(
        "maxtext_import_bench.py", "--size", "1M", "--rounds", "1", "--procs", "1",
        "--json", str(out), "--dir", str(tmp_path),
    )  # fmt: skip
    doc = json.loads(out.read_text())
    methods = {(r["method"], r["n"]) for r in doc["rows"]}
    wheel = bool(os.environ.get("OSF_MAXTEXT_WHEEL"))
    assert methods == ({("maxtext", 1)} if wheel else set()) | {("ours", 1)}
    assert doc["same"] is True if wheel else doc["same"] == "not checked"
    assert all(r["seconds"] > 0 and len(r["peaks"]) == r["n"] for r in doc["rows"])
    assert "| ours | 1 |" in done.stdout
    assert list(tmp_path.glob("osf-maxtext-import-bench-*")) == []


def test_plot_draws_the_recorded_figures(tmp_path: Path):
    """``benchmarks/plot.py`` reads ``benchmarks/figures.json`` (the medians
    docs/performance.md quotes, in the shapes ``run.py`` and ``tpu_bench.py`` write) and, where
    matplotlib is installed (the ``bench`` extra), draws the page's two plots from it."""
    spec = importlib.util.spec_from_file_location("plot", ROOT / "benchmarks" / "plot.py")
    assert spec is not None and spec.loader is not None
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    figures = json.loads(plot.FIGURES.read_text())
    groups = plot.cpu_groups(figures["cpu"])
    assert [label for label, _ in groups] == ["256 MiB", "1 GiB", "4 GiB"]
    for _, summaries in groups:
        assert {"device", *plot.CPU_METHODS} <= set(summaries)
        assert all(s[k] > 0 for s in summaries.values() for k in ("save_s", "cold_s", "warm_s"))
    for _, case in plot.tpu_groups(figures["tpu"]["runs"]):
        assert all(0 < v < 60 for bars in plot.tpu_bars(case).values() for v in bars)
    if importlib.util.find_spec("matplotlib") is None:
        return  # the drawing needs the bench extra
    run_benchmark("plot.py", "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.png", "tpu.png"]
