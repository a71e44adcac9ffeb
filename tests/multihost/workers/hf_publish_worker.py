"""Multi-process publish worker: every process saves, per step, a training state and a
servable Hugging Face item (``SafetensorsSave(item, mapping=, hf_config=)``) in one
``ocp.args.Composite`` through an async ``CheckpointManager`` with retention, then restores the
servable item sharded (``SafetensorsRestore(target, mapping=)``).

Args (``ctx.args``): ``root`` (the manager's directory, seen by every process), ``weights``
(one ``.npz`` per step: the global tensors of ``hf_export_values`` plus ``lora_a`` /
``lora_b``), ``merged_head`` (an ``.npz`` of each kept step's expected merged LM head kernel),
``config`` (the ``config.json`` dict), ``max_to_keep``.

Reported: per step the servable item's ``bytes_written`` (this process's tensor bytes), the
training item's, ``wchar`` (bytes passed to write system calls during the step's save and
wait, from ``/proc/self/io``) and ``save_s`` (seconds save() blocked); the manager's steps;
per kept step whether every restored shard equals the expected values, and the restore's
bytes read and needed.
"""

import contextlib
import time

import worker_lib

ctx = worker_lib.init()

from pathlib import Path  # noqa: E402

import hf_export_values as V  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

# The export writes config.json and generation_config.json as transformers does, importing it
# (when installed) at the first export: imported here, before any write counter, because the
# import runs `ldconfig -p`, whose writes /proc/self/io adds to this process's wchar.
with contextlib.suppress(ImportError):
    import transformers.models.auto.modeling_auto  # noqa: F401


def wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "l"))
handlers = {
    "train": osf.SafetensorsCheckpointHandler(),
    "policy": osf.SafetensorsCheckpointHandler(max_file_size=40_000),  # shards + index
}
options = ocp.CheckpointManagerOptions(max_to_keep=ctx.args["max_to_keep"])
result: dict = {"process_index": jax.process_index(), "steps": {}}
weights = ctx.args["weights"]
with ocp.CheckpointManager(ctx.args["root"], options=options, item_handlers=handlers) as mngr:
    for step, path in enumerate(weights):
        tree = V.sharded_tree(dict(np.load(path)), mesh)
        train_state = {"params": tree, "opt": {"count": np.int32(step)}}
        w0, t0 = wchar(), time.monotonic()
        mngr.save(
            step,
            args=ocp.args.Composite(
                train=osf.SafetensorsSave(train_state),
                policy=osf.SafetensorsSave(
                    tree, mapping=V.PUBLISH_MAPPING, hf_config=ctx.args["config"]
                ),
            ),
        )
        save_s = time.monotonic() - t0
        stats = {k: h.last_write_stats for k, h in handlers.items()}
        mngr.wait_until_finished()
        result["steps"][step] = {
            "save_s": round(save_s, 3),
            "policy_bytes": stats["policy"].bytes_written,
            "train_bytes": stats["train"].bytes_written,
            "wchar": wchar() - w0,
        }
        del tree, train_state
    result["all_steps"] = list(mngr.all_steps())

    # The servable item restored into a sharded target, in every process (other shardings
    # than the save's): each reads the byte ranges of its shards.
    restore_specs = V.restore_specs()
    merged = dict(np.load(ctx.args["merged_head"]))
    result["restored"] = {}
    for step in result["all_steps"]:
        want = dict(np.load(weights[step]))
        want["head"] = merged[str(step)]
        abstract = {
            n: jax.ShapeDtypeStruct(
                want[n].shape, want[n].dtype, sharding=NamedSharding(mesh, restore_specs[n])
            )
            for n in V.SPECS
        }
        abstract["head"] = {"kernel": abstract["head"]}
        got = mngr.restore(
            step,
            args=ocp.args.Composite(
                policy=osf.SafetensorsRestore(abstract, mapping=V.PUBLISH_MAPPING)
            ),
        ).policy
        flat = dict(got, head=got["head"]["kernel"])
        exact = all(not x.is_fully_addressable for x in flat.values()) and all(
            np.array_equal(np.asarray(s.data), want[n][s.index])
            for n in flat
            for s in flat[n].addressable_shards
        )
        read = handlers["policy"].last_read_stats
        result["restored"][step] = {
            "exact": bool(exact),
            "bytes_read": read.bytes_read,
            "bytes_needed": read.bytes_needed,
        }

# The same LoRA merges through osf.export_pytorch of the sharded tree, and, in a synchronous
# save, through a rule that does not commute with a box (re-laid-out on the devices after the
# merge) beside one mapped shard by shard.
last = dict(np.load(weights[-1]))
report = osf.export_pytorch(
    V.sharded_tree(last, mesh),
    Path(ctx.args["root"]) / "export_lora",
    V.PUBLISH_MAPPING,
    hf_config=ctx.args["config"],
    max_file_size=40_000,
)
assert report.ok, report.problems()
result["export_bytes"] = report.bytes_written
sync = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)  # a direct save
with ocp.CheckpointManager(Path(ctx.args["root"]) / "reshaped", options=sync) as mngr:
    item = V.reshape_item(last, mesh)
    mngr.save(0, args=osf.SafetensorsSave(item, mapping=V.RESHAPE_MAPPING, snapshot=False))
    mngr.wait_until_finished()

worker_lib.emit_result(result)
worker_lib.finish()
