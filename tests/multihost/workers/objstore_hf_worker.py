"""Multi-process Hugging Face export and publish to object storage: every process exports
the same sharded scanned LLaMA with a LoRA head (``hf_export_values.sharded_tree``) with
``osf.export_pytorch`` into ``<root>/export``, over an earlier export of another layout
(bfloat16, more files), and again with a ``batch_bytes`` under a file (``grouped``: one
upload per file), and saves it as a servable item (``SafetensorsSave(item, mapping=,
hf_config=)``) through a CheckpointManager whose root is on the store; with Orbax v1 (on
``gs://``) also through a ``SafetensorsHandler`` with a mapping, loaded back sharded.

Args (``ctx.args``): ``roots`` (``["s3://b/x", "gs://b/x"]``), ``weights`` (an ``.npz`` of the
global tensors plus ``lora_a`` / ``lora_b``), ``config`` (the ``hf_config``: a model directory),
``max_file_size``, ``v1`` (whether to save through the v1 handler too).

Reported per root and write (``export``, ``grouped``, ``publish``, ``v1``): ``bytes_written`` (this
process's tensor bytes, from the report or the handler's stats), ``uploaded`` and
``fetched`` (the object-store engine's counters over the write: bytes this process sent and
received; for ``v1`` during its save only) and ``seconds``; for ``v1`` also ``loaded`` (the sharded load was exact), and
``v1_skipped`` (why, on an Orbax without v1).
"""

import time

import worker_lib

ctx = worker_lib.init()

import hf_export_values as V  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "l"))
weights = dict(np.load(ctx.args["weights"]))
tree = V.sharded_tree(weights, mesh)
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


def grouped(root):
    # batch_bytes under a file: each file its own upload, one after the other
    report = osf.export_pytorch(
        tree,
        f"{root}/grouped",
        V.PUBLISH_MAPPING,
        hf_config=config,
        max_file_size=size,
        batch_bytes=size // 4,
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


def v1_publish(root):
    # Orbax v1: a handler with a mapping saves the tree as a servable item, and loads it into
    # a sharded abstract tree (other shardings than the save's).
    from orbax.checkpoint import v1 as ocp_v1

    v0 = osf.SafetensorsCheckpointHandler(max_file_size=size)

    class Servable(osf.SafetensorsHandler):
        def __init__(self):
            super().__init__(v0, mapping=V.PUBLISH_MAPPING, hf_config=config)

    context = ocp_v1.Context()
    context.checkpointables.registry = osf.local_registry(Servable)
    specs = V.restore_specs()  # (as hf_publish_worker restores)
    abstract = {
        n: jax.ShapeDtypeStruct(
            weights[n].shape, weights[n].dtype, sharding=NamedSharding(mesh, specs[n])
        )
        for n in V.SPECS
        if n != "head"
    }
    abstract["head"] = {"kernel": jax.ShapeDtypeStruct(weights["head"].shape, np.float32)}
    with context:
        osf.object_store_stats(reset=True)
        ocp_v1.save(f"{root}/v1", tree)
        saved = osf.object_store_stats(reset=True)  # (the save's alone)
        loaded = ocp_v1.load(f"{root}/v1", abstract)
    merged = weights["head"] + V.LORA_SCALE * (weights["lora_a"] @ weights["lora_b"])
    v1_loaded[root] = bool(
        all(
            np.array_equal(np.asarray(s.data), weights[n][s.index])
            for n in abstract
            if n != "head"
            for s in loaded[n].addressable_shards
        )
        and np.allclose(np.asarray(loaded["head"]["kernel"]), merged, atol=1e-6, rtol=0)
    )
    v1_saved[root] = saved
    return v0.last_write_stats.bytes_written


try:
    osf.local_registry()  # ImportError naming the version on an Orbax without v1
    v1_skipped = None
except ImportError as e:
    v1_skipped = str(e)
v1_loaded: dict = {}
v1_saved: dict = {}
for root in ctx.args["roots"]:
    old_export(root)
    result["roots"][root] = {"export": measured(export, root)}
    result["roots"][root]["grouped"] = measured(grouped, root)
    result["roots"][root]["publish"] = measured(publish, root)
    # (v1 on gs:// only: Orbax v1 commits by renaming, which s3:// cannot do)
    if v1_skipped is None and root.startswith("gs://"):
        result["roots"][root]["v1"] = measured(v1_publish, root)
        v1 = result["roots"][root]["v1"]
        v1.update(uploaded=v1_saved[root].bytes_uploaded, fetched=v1_saved[root].bytes_fetched)
        v1["loaded"] = v1_loaded[root]
result["v1_skipped"] = v1_skipped

worker_lib.emit_result(result)
worker_lib.finish()
