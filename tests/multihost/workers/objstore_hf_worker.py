"""Multi-process Hugging Face export and publish to object storage: every process exports
the same sharded scanned LLaMA with a LoRA head (``hf_export_values.sharded_tree``) with
``osf.export_pytorch`` into ``<root>/export``, over an earlier export of another layout
(bfloat16, more files), and saves it as a servable item (``SafetensorsSave(item, mapping=,
hf_config=)``) through a CheckpointManager whose root is on the store; with Orbax v1 also
through a ``SafetensorsHandler`` with a mapping.

Args (``ctx.args``): ``roots`` (``["s3://b/x", "gs://b/x"]``), ``weights`` (an ``.npz`` of the
global tensors plus ``lora_a`` / ``lora_b``), ``config`` (the ``config.json`` dict),
``max_file_size``, ``v1`` (whether to save through the v1 handler too).

Reported per root and write (``export``, ``publish``, ``v1``): ``bytes_written`` (this
process's tensor bytes, from the report or the handler's stats), ``uploaded`` and
``fetched`` (the object-store engine's counters over the write: bytes this process sent and
received) and ``seconds``.
"""

import time

import worker_lib

ctx = worker_lib.init()

import hf_export_values as V  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "l"))
tree = V.sharded_tree(dict(np.load(ctx.args["weights"])), mesh)
config, size = ctx.args["config"], ctx.args["max_file_size"]
result: dict = {"process_index": jax.process_index(), "roots": {}}


def measured(run, root):
    osf.object_store_stats(reset=True)
    t0 = time.monotonic()
    written = run(root)
    stats = osf.object_store_stats(reset=True)
    return {
        "bytes_written": written,
        "uploaded": stats.bytes_uploaded,
        "fetched": stats.bytes_fetched,
        "seconds": round(time.monotonic() - t0, 3),
    }


def old_export(root):
    # An earlier export of another layout: its files and index must not survive.
    old = osf.export_pytorch(
        tree, f"{root}/export", V.PUBLISH_MAPPING, dtype=jnp.bfloat16, max_file_size=size // 3
    )
    assert old.ok, old.problems()


def export(root):
    report = osf.export_pytorch(
        tree, f"{root}/export", V.PUBLISH_MAPPING, hf_config=config, max_file_size=size
    )
    assert report.ok, report.problems()
    return report.bytes_written


def publish(root):
    handler = osf.SafetensorsCheckpointHandler(max_file_size=size)
    options = osf.manager_options_for(f"{root}/run", enable_async_checkpointing=True)
    with ocp.CheckpointManager(
        f"{root}/run", options=options, item_handlers={"policy": handler}
    ) as mngr:
        item = osf.SafetensorsSave(tree, mapping=V.PUBLISH_MAPPING, hf_config=config)
        mngr.save(0, args=ocp.args.Composite(policy=item))
        mngr.wait_until_finished()
    return handler.last_write_stats.bytes_written


for root in ctx.args["roots"]:
    old_export(root)
    result["roots"][root] = {"export": measured(export, root)}
    result["roots"][root]["publish"] = measured(publish, root)

worker_lib.emit_result(result)
worker_lib.finish()
