#!/usr/bin/env python
"""Publishing a training checkpoint as a Hugging Face directory: ``osf.export_pytorch``
against restore-then-gather-then-``safetensors`` ``save_file`` and against transformers'
``save_pretrained``, single process and N = 2 / 4 ``jax.distributed`` processes.

The training state is a LLaMA-shaped float32 tree (``model.layers.{i}.*_proj.kernel`` in
JAX's ``(in, out)`` layout, norms, embedding, head; ``--size`` bytes), saved once, untimed,
as a checkpoint directory (``osf.save_directory``). Every method starts from it and writes a
bfloat16 Hugging Face directory (``nn.Linear`` weights transposed to ``(out, in)``):

- ``ours``: ``osf.export_pytorch(ckpt, out, osf.preset_mapping("llama"),
  dtype=jnp.bfloat16, hf_config=config)``; at N > 1 every process calls it and writes only
  its bytes (each reads only its boxes of the checkpoint);
- ``gather``: ``osf.restore_directory`` (at N > 1 sharded over every device), each tensor
  gathered (``np.asarray``; at N > 1 ``multihost_utils.process_allgather``), transposed, cast
  to bfloat16, then ``safetensors.numpy.save_file`` of the whole dict by process 0;
- ``transformers`` (N = 1): the same restore and conversion into torch tensors, loaded into a
  ``LlamaForCausalLM`` built on the meta device (``load_state_dict(assign=True)``), then
  ``save_pretrained`` (its own time is reported too).

Time: until every file is written and fsynced (wall clock; at N > 1 the slowest process,
after a barrier). Peak host memory: ``VmHWM`` reset right before the method, minus ``VmRSS``
before it (per process; the largest). The device's write bandwidth is ``fio``'s (a
sequential write of the output's byte count with ``end_fsync=1``, the faster of direct and
buffered I/O, medians of 5) when fio is installed; an export from a checkpoint is bound by
the read of the checkpoint and the write of the output at once on the same disk (two fio
jobs at the same time). Each single-process measurement is a
fresh Python process; each multi-process round one launch running both methods (order
alternating). Medians of ``--rounds``.

A third source, ``servable`` (``ours`` alone, N = 1), exports the state already bfloat16
in the Hugging Face layout from host memory: nothing to transform, so it measures the
export's write path against the device's bandwidth.

Run::

    python benchmarks/hf_export_bench.py --size 1G --rounds 3 --procs 1,2,4
    python benchmarks/hf_export_bench.py --size 256M --rounds 3     # a smaller state
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

from benchmarks import procfs  # noqa: E402
from benchmarks.jobs import mib  # noqa: E402
from benchmarks.state import parse_size, unflatten, write_results  # noqa: E402
from orbax_safetensors._src.pipeline import pieces as _pieces  # noqa: E402

_MARKER = "@@HF_EXPORT@@"
E, F, HEAD_DIM = 1024, 2816, 64
METHODS = ("ours", "gather", "transformers")


def dims(size: int) -> tuple[int, int]:
    """``(layers, vocab)`` of a float32 state of about ``size`` bytes (E=1024, F=2816)."""
    layer = 4 * (4 * E * E + 3 * E * F + 2 * E)
    vocab = 32000 if size >= 1 << 30 else 8192
    layers = max(1, round((size - 4 * 2 * vocab * E) / layer))
    return layers, vocab


def shapes(size: int) -> dict[str, tuple[int, ...]]:
    """Dotted name -> shape of the training state (NNX names the ``llama`` preset maps)."""
    layers, vocab = dims(size)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.embedding": (vocab, E)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{proj}.kernel"] = (E, E)
        out[f"{p}.mlp.gate_proj.kernel"] = (E, F)
        out[f"{p}.mlp.up_proj.kernel"] = (E, F)
        out[f"{p}.mlp.down_proj.kernel"] = (F, E)
        out[f"{p}.input_layernorm.scale"] = (E,)
        out[f"{p}.post_attention_layernorm.scale"] = (E,)
    out["model.norm.scale"] = (E,)
    out["lm_head.kernel"] = (E, vocab)
    return out


def config(size: int) -> dict[str, Any]:
    layers, vocab = dims(size)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": E,
        "intermediate_size": F,
        "num_hidden_layers": layers,
        "num_attention_heads": E // HEAD_DIM,
        "num_key_value_heads": E // HEAD_DIM,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
    }


def torch_key(name: str) -> str:
    """The Hugging Face key of a state name (what the ``llama`` preset maps it to)."""
    if name.endswith(".embedding"):
        return name[: -len("embedding")] + "weight"
    if name.endswith(".kernel"):
        return name[: -len("kernel")] + "weight"
    return name[: -len("scale")] + "weight"


def to_torch_layout(name: str, value: Any) -> Any:
    """``value`` (numpy, float32) as the Hugging Face tensor, bfloat16."""
    import ml_dtypes
    import numpy as np

    if name.endswith(".kernel"):
        value = value.T
    return np.ascontiguousarray(value.astype(ml_dtypes.bfloat16))


def write_checkpoint(size: int, directory: Path) -> int:
    """Saves the float32 training state (random values); returns its bytes."""
    import numpy as np

    import orbax_safetensors as osf

    rng = np.random.default_rng(0)
    flat = {n: rng.random(s, dtype=np.float32) - 0.5 for n, s in shapes(size).items()}
    osf.save_directory(unflatten(flat), directory)
    return sum(v.nbytes for v in flat.values())


# ------------------------------------------------------------------- the methods


def load_state(ckpt: Path, size: int) -> Any:
    """The training state restored from ``ckpt``: whole in one process, sharded over every
    device (rows) at N > 1."""
    import jax
    import numpy as np

    import orbax_safetensors as osf

    if jax.process_count() == 1:
        return osf.restore_directory(ckpt)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    abstract = {
        n: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, P("d")))
        for n, s in shapes(size).items()
    }
    return osf.restore_directory(ckpt, unflatten(abstract))


def servable_state(state: Any, size: int) -> Any:
    """The state as the Hugging Face model it exports to (bfloat16, ``(out, in)`` kernels,
    torch names), in host memory: exporting it writes bytes and transforms nothing."""
    import numpy as np

    flat = {n: np.asarray(_leaf(state, n)) for n in shapes(size)}
    return unflatten({torch_key(n): to_torch_layout(n, v) for n, v in flat.items()})


def run_ours(source: Any, out: Path, size: int, *, servable: bool = False) -> None:
    """``source``: the checkpoint's path, or the state in memory (``servable``: already in
    the Hugging Face layout and dtype, exported under names and dtypes kept)."""
    import jax.numpy as jnp

    import orbax_safetensors as osf

    if servable:
        mapping, dtype = osf.KeyMapping([osf.Rule("{k:.+}", "{k}")]), None
    else:
        mapping, dtype = osf.preset_mapping("llama"), jnp.bfloat16
    report = osf.export_pytorch(source, out, mapping, hf_config=config(size), dtype=dtype)
    assert report.ok, report.problems()


def _gathered(source: Any, size: int) -> dict[str, Any]:
    """The state (restored first when ``source`` is a path) gathered to host (process 0 keeps
    it), in the torch layout."""
    import jax
    import numpy as np

    state = load_state(source, size) if isinstance(source, Path) else source
    names = shapes(size)
    if jax.process_count() == 1:
        flat = {n: np.asarray(_leaf(state, n)) for n in names}
        del state
        return {torch_key(n): to_torch_layout(n, v) for n, v in flat.items()}
    from jax.experimental import multihost_utils

    out = {}
    for n in names:
        whole = np.asarray(multihost_utils.process_allgather(_leaf(state, n), tiled=True))
        if jax.process_index() == 0:
            out[torch_key(n)] = to_torch_layout(n, whole)
        del whole
    return out


def _leaf(tree: Any, name: str) -> Any:
    for part in name.split("."):
        tree = tree[part]
    return tree


def run_gather(source: Any, out: Path, size: int) -> None:
    import jax
    from safetensors.numpy import save_file

    tensors = _gathered(source, size)
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config(size)))


def run_transformers(source: Any, out: Path, size: int) -> float:
    import torch
    import transformers

    tensors = _gathered(source, size)
    state = {k: torch.from_numpy(v.view("int16")).view(torch.bfloat16) for k, v in tensors.items()}
    del tensors
    cfg = transformers.LlamaConfig(**{k: v for k, v in config(size).items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.load_state_dict(state, assign=True, strict=True)
    del state
    t0 = time.perf_counter()
    model.save_pretrained(out, max_shard_size="100GB")
    return time.perf_counter() - t0


def measure(
    method: str, ckpt: Path, out: Path, size: int, source: str = "checkpoint"
) -> dict[str, Any]:
    """Runs one method in this process: seconds until durable, peak extra memory (imports
    made first, untimed: they are no part of an export). ``source``: ``checkpoint`` (the
    method reads it), ``memory`` (the state restored first, untimed: a training job's
    state, published from memory) or ``servable`` (ours only: the state already bfloat16 in
    the Hugging Face layout, in host memory, so that the export only writes: its write path
    against the device)."""
    import flax.nnx  # noqa: F401
    import ml_dtypes  # noqa: F401
    import safetensors.numpy  # noqa: F401

    import orbax_safetensors  # noqa: F401

    if method == "transformers":
        import transformers  # noqa: F401
    state: Any = ckpt if source == "checkpoint" else load_state(ckpt, size)
    if source == "servable":
        state = servable_state(state, size)
    gc.collect()
    rss0 = procfs.rss_bytes()
    reset = procfs.reset_peak()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if method == "ours":
        run_ours(state, out, size, servable=source == "servable")
    elif method == "gather":
        run_gather(state, out, size)
    else:
        extra["save_pretrained_s"] = run_transformers(state, out, size)
    if out.exists():
        procfs.fsync_tree(out)
    seconds = time.perf_counter() - t0
    return {
        "method": method,
        "source": source,
        "seconds": seconds,
        "peak_extra": max(0, procfs.hwm_bytes() - rss0),
        "peak_reset": reset,
        **extra,
    }


def tensors_equal(a: Path, b: Path) -> bool:
    """Whether two Hugging Face directories hold the same tensors (names, dtypes, bytes)."""
    from safetensors.numpy import load_file

    def load(d: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    x, y = load(a), load(b)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes() for k in x
    )


# ------------------------------------------------------------------- driver


def _single(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "benchmarks.hf_export_bench", "--worker", json.dumps(job)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])  # type: ignore[no-any-return]
    return {**job, "error": proc.stderr.strip().splitlines()[-8:]}


def _multi(n: int, job: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "tests"))
    from multihost.launcher import run_workers

    results = run_workers(
        HERE / "workers" / "hf_export_bench_worker.py",
        n,
        devices_per_process=1,
        args=job,
        timeout=timeout,
        check=False,
    )
    bad = [r for r in results if r.returncode or r.result is None]
    if bad:
        return [{"error": bad[0].stderr.strip().splitlines()[-8:]}]
    runs = []
    for method in job["methods"]:
        per = [r.result[method] for r in results]
        runs.append(
            {
                "method": method,
                "seconds": max(p["seconds"] for p in per),
                "peak_extra": max(p["peak_extra"] for p in per),
                "peak_extra_per_process": [p["peak_extra"] for p in per],
                "same_tensors": results[0].result.get("same_tensors"),
            }
        )
    return runs


def _best_of_modes(measure: Any, rounds: int) -> float:
    """The faster of direct and buffered I/O: ``measure(fio settings)`` (seconds) taken
    ``rounds`` times in turn for each, medians compared. A mode the filesystem refuses
    (direct I/O on tmpfs: fio fails) is left out."""
    times: dict[str, list[float]] = {"1": [], "0": []}
    for _ in range(rounds):
        for direct, runs in times.items():
            try:
                runs.append(measure({"ioengine": "psync", "direct": direct, "bs": "8M"}))
            except RuntimeError:
                continue
    return min(statistics.median(runs) for runs in times.values() if runs)


def _fio_seconds(directory: Path, nbytes: int, *, write: bool, rounds: int = 5) -> float | None:
    """The device's time to write (with end_fsync, a new file each time) or cold-read
    ``nbytes`` sequentially with fio: the faster of direct and buffered I/O, each the median
    of ``rounds`` runs taken in turn (a buffered write's end fsync varies ten-fold on a shared
    VM; the export writes direct where the filesystem allows)."""
    if shutil.which("fio") is None:
        return None
    from benchmarks import device

    path = directory / device.FIO_FILE
    seconds = _best_of_modes(
        lambda settings: device.run_fio(path, nbytes, settings, write=write), rounds
    )
    path.unlink(missing_ok=True)
    return seconds


def _fio_read_write_seconds(
    directory: Path, read: int, write: int, rounds: int = 5
) -> float | None:
    """The device's time to cold-read ``read`` bytes of one file while writing ``write`` bytes
    of another (with end_fsync), two fio jobs at once: what an export from a checkpoint on the
    same disk must move. The faster of direct and buffered I/O, each the median of ``rounds``
    wall-clock times."""
    if shutil.which("fio") is None:
        return None
    import concurrent.futures

    from benchmarks import device

    source, output = directory / "fio_source.bin", directory / device.FIO_FILE
    with concurrent.futures.ThreadPoolExecutor(2) as pool:

        def both(settings: dict[str, str]) -> float:
            device.run_fio(source, read, settings, write=True)  # the file to read
            t0 = time.perf_counter()
            jobs = [
                pool.submit(device.run_fio, source, read, settings, write=False),
                pool.submit(device.run_fio, output, write, settings, write=True),
            ]
            for job in jobs:
                job.result()
            return time.perf_counter() - t0

        seconds = _best_of_modes(both, rounds)
    source.unlink(missing_ok=True)
    output.unlink(missing_ok=True)
    return seconds


def transform_seconds(size: int, threads: int = 1) -> float:
    """The CPU's part: transposing and casting the whole float32 state to the bfloat16 PyTorch
    layout in memory, as the export does (``core/astype``), on ``threads`` threads (one tensor
    each at a time, as the export's ``pieces.ordered_map``), median of 3 (no disk)."""
    import concurrent.futures

    import ml_dtypes
    import numpy as np

    from orbax_safetensors._src.core import casting as _casting

    rng = np.random.default_rng(0)
    flat = {n: rng.random(s, dtype=np.float32) for n, s in shapes(size).items()}

    def one(item: tuple[str, Any]) -> None:
        n, v = item
        _casting.astype(v.T if n.endswith(".kernel") else v, ml_dtypes.bfloat16)

    times = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(one, flat.items()))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass
class Limits:
    """What the machine allows, in seconds: the device's write of the output and read of the
    checkpoint (fio; None without it), and the transform in memory on one thread and on
    the export's threads (every core it has, up to 4)."""

    write: float | None
    read: float | None
    transform: float
    transform_all: float
    read_write: float | None = None  # the read and the write at once, on the same disk

    def bound(self, source: str) -> float | None:
        """The slowest of what an export from ``source`` must do (from a checkpoint: the read
        and the write at once on the same disk, the transform; from memory: transform, write;
        servable: write): overlapping them, it cannot be faster."""
        if self.write is None or (source == "checkpoint" and self.read is None):
            return None
        reads = [self.read_write or self.read or 0.0] if source == "checkpoint" else []
        transforms = [] if source == "servable" else [self.transform_all]
        return max([self.write, *transforms, *reads])


def report(rows: list[dict[str, Any]], state_bytes: int, out_bytes: int, limits: Limits) -> str:
    fio = limits.write
    lines = [
        f"bf16 Hugging Face export of a {mib(state_bytes)} float32 LLaMA-shaped state "
        f"({mib(out_bytes)} written) from its checkpoint or from memory; medians; time until "
        "fsynced",
        "",
        "| source | N | method | s | peak extra host memory (max per process) | vs ours: time | "
        "vs ours: memory | x device write bandwidth | x bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for source, n in sorted({(r.get("source", "checkpoint"), r["n"]) for r in rows}):
        bound = limits.bound(source)
        by = {
            m: [
                r
                for r in rows
                if r["n"] == n and r["method"] == m and r.get("source", "checkpoint") == source
            ]
            for m in METHODS
        }
        if not by["ours"]:
            continue
        ours_t = statistics.median(r["seconds"] for r in by["ours"])
        ours_m = statistics.median(r["peak_extra"] for r in by["ours"])
        for m, rs in by.items():
            if not rs:
                continue
            t = statistics.median(r["seconds"] for r in rs)
            mem = statistics.median(r["peak_extra"] for r in rs)
            dev = f"{fio / t:.2f}" if fio else "n/a"
            of_bound = f"{bound / t:.2f}" if bound else "n/a"
            lines.append(
                f"| {source} | {n} | {m} | {t:.2f} | {mib(mem)} | {t / ours_t:.2f} | "
                f"{mem / max(ours_m, 1):.2f} | {dev} | {of_bound} |"
            )
        sp = [r["save_pretrained_s"] for r in by["transformers"] if "save_pretrained_s" in r]
        if sp:
            lines.append(
                f"| {source} | {n} | (save_pretrained alone) | {statistics.median(sp):.2f} "
                "| | | | | |"
            )
    lines.append("")
    if fio and limits.read:
        lines.append(
            f"device (fio, the faster of direct and buffered, medians of 5): sequential write "
            f"of {mib(out_bytes)} with end_fsync=1: "
            f"{fio:.2f} s ({out_bytes / fio / 1e6:,.0f} MB/s); cold read of "
            f"{mib(state_bytes)}: {limits.read:.2f} s ({state_bytes / limits.read / 1e6:,.0f} "
            "MB/s)"
            + (
                f"; both at once (two fio jobs, the read of a checkpoint and the write of its "
                f"export): {limits.read_write:.2f} s"
                if limits.read_write
                else ""
            )
        )
    else:
        lines.append("device: fio not installed (n/a)")
    lines.append(
        f"CPU: transposing and casting the state in memory: one thread {limits.transform:.2f} s "
        f"({state_bytes / limits.transform / 1e6:,.0f} MB/s of float32), the export's "
        f"{_pieces.TRANSFORM_THREADS} threads on {os.cpu_count()} cores "
        f"{limits.transform_all:.2f} s; bound = the slowest of write (from a checkpoint: read "
        "and write at once), transform (all threads)"
    )
    lines.append(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def _round(
    work: Path,
    ckpt: Path,
    size: int,
    source: str,
    n: int,
    order: list[str],
    rnd: int,
    timeout: float,
) -> list[dict[str, Any]]:
    """One round of the methods in ``order`` at N = ``n`` (one fresh process per method at
    N = 1, one launch at N > 1); at round 0 the outputs of ours and gather are compared."""
    rows: list[dict[str, Any]] = []
    base = {"ckpt": str(ckpt), "size": size, "source": source}
    if source == "servable":  # nothing to compare it with: the write path alone, one process
        if n > 1 or "ours" not in order:
            return rows
        order = ["ours"]
    if n == 1:
        for m in order:
            job = {**base, "method": m, "out": str(work / f"out_{m}")}
            rows.append({**_single(job, timeout), "n": 1, "round": rnd, "source": source})
            print(json.dumps(rows[-1]), file=sys.stderr)
        if rnd == 0 and {"ours", "gather"} <= set(order):
            same = tensors_equal(work / "out_ours", work / "out_gather")
            print(f"N=1 ({source}): ours and gather hold the same tensors: {same}", file=sys.stderr)
        for m in order:
            shutil.rmtree(work / f"out_{m}", ignore_errors=True)
        return rows
    job = {
        **base,
        "methods": [m for m in order if m != "transformers"],
        "out": str(work / "mh"),
        "check": rnd == 0,
    }
    for row in _multi(n, job, timeout):
        rows.append({**row, "n": n, "round": rnd, "source": source})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--sources",
        default="checkpoint,memory,servable",
        help="export from the checkpoint, from memory, from memory already servable",
    )
    parser.add_argument("--dir", default=None, help="where files go (default: a temp dir)")
    parser.add_argument("--out", default="", help="write results.json and results.md here")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", default="")
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        row = measure(
            job["method"], Path(job["ckpt"]), Path(job["out"]), job["size"], job["source"]
        )
        print(_MARKER + json.dumps(row))
        return
    size = parse_size(args.size)
    methods = [m for m in args.methods.split(",") if m]
    work = Path(tempfile.mkdtemp(prefix="hf_export_bench_", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        ckpt = work / "ckpt"
        state_bytes = write_checkpoint(size, ckpt)
        out_bytes = state_bytes // 2
        print(f"checkpoint: {mib(state_bytes)} in {ckpt}", file=sys.stderr)
        for rnd in range(args.rounds):
            for source in [x for x in args.sources.split(",") if x]:
                for n in [int(p) for p in args.procs.split(",") if p]:
                    order = methods if rnd % 2 == 0 else methods[::-1]
                    rows += _round(work, ckpt, size, source, n, order, rnd, args.timeout)
        limits = Limits(
            write=_fio_seconds(work, out_bytes, write=True),
            read=_fio_seconds(work, state_bytes, write=False),
            transform=transform_seconds(size),
            transform_all=transform_seconds(size, _pieces.TRANSFORM_THREADS),
            read_write=_fio_read_write_seconds(work, state_bytes, out_bytes),
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report([r for r in rows if "error" not in r], state_bytes, out_bytes, limits)
    errors = [r for r in rows if "error" in r]
    if errors:
        text += f"\nerrors: {json.dumps(errors[:3])}"
    print(text)
    write_results(args.out, rows, text)


if __name__ == "__main__":
    main()
