#!/usr/bin/env python
"""Importing a Hugging Face LLaMA into a MaxText checkpoint: ``osf.import_pytorch`` (the
``import`` command) at N = 1 and 2 ``jax.distributed`` processes against MaxText 0.2.5's own
``to_maxtext``, side by side in one run (docs/performance.md, "Hugging Face to MaxText").

The model is a random LLaMA of ``--size`` bytes of bfloat16 tensors in Hugging Face files of
at most 1 GiB (with their index and config.json), written once, untimed. Every method writes
a scanned bfloat16 train state (``{"step", "params", "opt_state": {}}`` in the checkpointable
``items``, OCDBT and zarr3, ``custom_metadata`` ``{"scan_layers": true}``), each process with
2 CPU devices:

- ``ours`` (N processes): every process calls ``osf.import_pytorch(hf, out, "maxtext-llama3",
  dtype="bfloat16")``: it reads its shards' bytes a batch at a time, transforms on the devices,
  and Orbax writes its shards;
- ``maxtext`` (one process): MaxText's ``to_maxtext`` cannot run here (its wheel needs Python
  >= 3.12 and its whole stack: ``maxtext.configs.pyconfig``, its models, ``huggingface_hub``
  downloads), so its own conversion functions run from the wheel (``$OSF_MAXTEXT_WHEEL``), as
  its ``main`` drives them for an eager safetensors load: ``load_hf_dict_from_safetensors``
  (every tensor into host memory), ``_get_hf_loading_function`` / ``_get_maxtext_weight``
  with ``PARAM_MAPPING`` / ``HOOK_FNS["llama3.1-8b"]`` (numpy hooks, ``np.stack`` of the
  layers), ``shard_jax_weights`` over the devices, then the Orbax v1 save its
  ``checkpointing.save_checkpoint`` makes. The model's abstract parameters are taken from the
  preset (the same names and shapes).

Time: wall clock until the step is written (the slowest process, after a barrier). Peak host
memory: ``VmHWM`` growth per process over its resident memory before (largest, and the sum
over the job; the CPU devices' arrays are host memory here, which a TPU holds in its own).
Bytes read: ``rchar`` per process. With ``--check`` (default below 1 GiB) the checkpoints are
restored and compared bit for bit. Medians of ``--rounds``; each run is a fresh launch.

Run::

    python benchmarks/maxtext_import_bench.py --size 4G --rounds 3 --procs 1,2
    python benchmarks/maxtext_import_bench.py --size 16M --rounds 1 --procs 1,2  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "helpers")]

from benchmarks.jobs import job_row, median_table, mib  # noqa: E402
from benchmarks.state import parse_size  # noqa: E402

WORKER = HERE / "workers" / "maxtext_import_bench_worker.py"
FILE_BYTES = 1 << 30


def config_for(size: int) -> dict[str, Any]:
    """A LLaMA config whose bfloat16 tensors are about ``size`` bytes: a 1B-class layer
    (E=2048) from 1 GiB up, a small one below."""
    if size >= 1 << 30:
        c = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000}  # fmt: skip
    else:
        c = {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}  # fmt: skip
    c |= {"model_type": "llama", "tie_word_embeddings": False, "num_hidden_layers": 1}
    per_layer = _bytes(shapes(c | {"num_hidden_layers": 2})) - _bytes(shapes(c))
    rest = _bytes(shapes(c)) - per_layer
    return c | {"num_hidden_layers": max(1, round((size - rest) / per_layer))}


def shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    e, m, d, v = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    h, k = c["num_attention_heads"], c["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,), "lm_head.weight": (v, e)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h * d, e), p + "self_attn.k_proj.weight": (k * d, e),
                p + "self_attn.v_proj.weight": (k * d, e), p + "self_attn.o_proj.weight": (e, h * d),
                p + "mlp.gate_proj.weight": (m, e), p + "mlp.up_proj.weight": (m, e),
                p + "mlp.down_proj.weight": (e, m), p + "input_layernorm.weight": (e,),
                p + "post_attention_layernorm.weight": (e,)}  # fmt: skip
    return out


def _bytes(table: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in table.values():
        n = 2
        for s in shape:
            n *= s
        total += n
    return total


def write_model(hf: Path, config: dict[str, Any]) -> int:
    """A random bfloat16 LLaMA of ``config`` in Hugging Face files of at most 1 GiB: its bytes."""
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    files: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes(config).items():
        n = _bytes({key: shape})
        if size and size + n > FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append(key)
        size += n
    table, weight_map = shapes(config), {}
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        part = {k: (rng.standard_normal(table[k], np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                for k in keys}  # fmt: skip
        safetensors.numpy.save_file(part, str(hf / name), {"format": "pt"})
        weight_map |= dict.fromkeys(keys, name)
        del part
    index = {"metadata": {}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    return _bytes(table)


def measure(method: str, n: int, hf: Path, out: Path, config: dict, timeout: float) -> dict:
    """One launch of ``method`` on ``n`` processes: seconds, peak memory, bytes read."""
    args = {"hf": str(hf), "out": str(out), "config": config}
    return job_row(WORKER, method, n, args, timeout, per_process=("rchar",))


def restored(root: Path) -> dict[str, Any]:
    """The parameters of step 0 of a MaxText checkpoint, as numpy, by dotted name."""
    import jax
    import numpy as np
    from orbax.checkpoint import v1 as ocp

    meta = ocp.metadata(root / "0", checkpointable_name="items").metadata["params"]
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    context = ocp.Context()
    context.pytree.loading.partial_load = True
    with context:
        got = ocp.load(root / "0", {"params": abstract}, checkpointable_name="items")["params"]
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def same_checkpoints(a: Path, b: Path) -> bool:
    x, y = restored(a), restored(b)
    return sorted(x) == sorted(y) and all(
        x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes() for k in x
    )


def report(rows: list[dict[str, Any]], config: dict, model_bytes: int, same: Any) -> str:
    lines = [
        f"Hugging Face LLaMA: {mib(model_bytes)} bfloat16 ({config['num_hidden_layers']} "
        f"layers, E={config['hidden_size']}, V={config['vocab_size']}) -> a scanned bfloat16 "
        f"MaxText checkpoint. Checkpoints bit-identical: {same}.",
        "",
    ]
    read = ("bytes read, largest process", lambda r: max(r["rchar"]))
    return "\n".join(lines + median_table(rows, "maxtext", [read]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4G", help="Hugging Face tensor bytes (about)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", default="1,2", help="process counts of ours")
    parser.add_argument("--dir", default=None, help="where the model and checkpoints go")
    parser.add_argument("--json", default=None, help="write every run here")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare the checkpoints bit for bit (default: below 1 GiB)",
    )
    args = parser.parse_args()
    size = parse_size(args.size)
    check = size < (1 << 30) if args.check is None else args.check
    config = config_for(size)
    procs = [int(p) for p in args.procs.split(",") if p]
    plan = [("ours", n) for n in procs]
    if os.environ.get("OSF_MAXTEXT_WHEEL"):
        plan.insert(0, ("maxtext", 1))
    else:
        print("maxtext: not run (set OSF_MAXTEXT_WHEEL to MaxText 0.2.5's wheel)", file=sys.stderr)
    base = Path(tempfile.mkdtemp(prefix="osf-maxtext-import-bench-", dir=args.dir))
    try:
        t0 = time.monotonic()
        model_bytes = write_model(base / "hf", config)
        print(f"wrote {mib(model_bytes)} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        same: Any = "not checked"
        for r in range(args.rounds):
            for method, n in plan if r % 2 == 0 else plan[::-1]:
                out = base / f"out_{method}_{n}"
                row = measure(method, n, base / "hf", out, config, args.timeout)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
            if r == 0 and check and len(plan) > 1:  # (one method: nothing to compare)
                first = base / f"out_{plan[0][0]}_{plan[0][1]}"
                same = all(same_checkpoints(base / f"out_{m}_{n}", first) for m, n in plan[1:])
            for method, n in plan:
                shutil.rmtree(base / f"out_{method}_{n}", ignore_errors=True)
        print(report(rows, config, model_bytes, same))
        if args.json:
            doc = {"config": config, "model_bytes": model_bytes, "same": same, "rows": rows}
            Path(args.json).write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
