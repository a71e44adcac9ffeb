"""Multi-process export of a MaxText checkpoint this job saved (``maxtext_checkpoints``):
every process builds the same train state, shards it as MaxText's FSDP does, saves it the
ways MaxText saves (``ctx.args["saves"]``), then exports each saved item's parameters with
``ctx.args["mapping"]`` and reports what it read and wrote.

Args: ``root`` (a directory every process sees), ``dims`` (``maxtext_checkpoints.Dims``
fields), ``saves`` (names among ``v1``, ``v0``, ``standard``), ``exports``
(``{name: {"source": relative path, **export_pytorch kwargs}}``, in order), ``preset``
(optional: ``osf.preset_mapping``'s keyword arguments, e.g. a MaxText preset and its
``hf_config``); optional, how the state is saved: ``params_only`` (``step`` and the
parameters, no optimizer state), ``fsdp``, ``layers`` (scanned tensors split on their layers
axis: ``maxtext_checkpoints.shard_state``), ``chunk_bytes`` (Orbax's ``chunk_byte_size``).

With ``lora`` (a directory), the job also saves ``maxtext_checkpoints.lora_tree()`` there as
a checkpoint of this library (``ours``) and an Orbax-native item (``orbax``) and exports each
with ``LORA_MAPPING`` to ``out_<kind>`` (reported: ``lora_<kind>``'s ``bytes_written``).

Reported per export: ``bytes_written`` (the report's counter), ``rchar`` / ``wchar`` (bytes
this process's read / write system calls moved meanwhile, from ``/proc/self/io``),
``ts_read`` (bytes TensorStore read from files meanwhile), ``peak`` (``VmHWM`` growth),
``seconds``, ``ignored``.
"""

import time

import worker_lib

ctx = worker_lib.init()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[2] / "helpers"))  # tests/helpers/

import jax  # noqa: E402
import maxtext_checkpoints as M  # noqa: E402
import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.pipeline import relayout  # noqa: E402


def counters() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        out["ts_read"] = int(m["values"][0]["value"])
    out.setdefault("ts_read", 0)
    return out


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


root = Path(ctx.args["root"])
dims = M.Dims(**ctx.args["dims"])
if ctx.args.get("params_only"):
    state = {"step": np.int32(7), "params": {"params": M.llama_params(dims)}}
else:
    state = M.train_state(M.llama_params(dims))
sharded = M.shard_state(state, ctx.args.get("fsdp"), layers=ctx.args.get("layers", False))
del state
chunk_bytes = ctx.args.get("chunk_bytes")
for how in ctx.args["saves"]:
    if how == "v1":
        M.save_v1(root / "v1", 7, sharded, chunk_bytes=chunk_bytes)
    else:
        kind = "pytree" if how == "v0" else how
        M.save_v0(root / how, 7, sharded, how=kind, chunk_bytes=chunk_bytes)
del sharded
# a preset (``ctx.args["preset"]``: preset_mapping's keyword arguments) or the hand mapping
preset = ctx.args.get("preset")
mapping = osf.preset_mapping(**preset) if preset else M.hand_mapping(dims)

result = {"process_index": jax.process_index()}
for name, spec in ctx.args["exports"].items():
    kwargs = dict(spec)
    source = root / kwargs.pop("source")
    before = counters()
    rss = vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.monotonic()
    report = osf.export_pytorch(source, root / "out" / name, mapping, **kwargs)
    seconds = time.monotonic() - t0
    after = counters()
    assert report.ok, report.problems()
    result[name] = {
        "bytes_written": report.bytes_written,
        "rchar": after["rchar"] - before["rchar"],
        "wchar": after["wchar"] - before["wchar"],
        "ts_read": after["ts_read"] - before["ts_read"],
        "peak": vm("VmHWM") - rss,
        "seconds": round(seconds, 3),
        "ignored": sorted(report.ignored),
        "moved": len(report.moved),
        # compiled re-layouts so far in this process (one per link and shape, not per layer)
        "relayouts": relayout.compiled.cache_info().currsize,
    }

if "lora" in ctx.args:  # a checkpoint with LoRA adapters, merged as the links are written
    import orbax.checkpoint as ocp

    lora_root = Path(ctx.args["lora"])
    tree = M.lora_tree()
    with ocp.CheckpointManager(lora_root / "ours") as manager:
        manager.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(tree)))
        manager.wait_until_finished()
    ocp.PyTreeCheckpointer().save((lora_root / "orbax").absolute(), tree)
    for kind in ("ours", "orbax"):
        report = osf.export_pytorch(lora_root / kind, lora_root / f"out_{kind}", M.LORA_MAPPING)
        result[f"lora_{kind}"] = {"bytes_written": report.bytes_written}

worker_lib.emit_result(result)
worker_lib.finish()
