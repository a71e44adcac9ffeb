"""N processes save column-sharded tensors to S3, GCS and local disk (issue 27, point 2).

Args (``ctx.args``): ``saves``: ``[[root URL or directory, async?], ...]``. Each root gets one
Orbax ``CheckpointManager`` save of step 0 (async: host copies on the caller's thread, written
in the background; sync: written from the arrays), then a restore onto the same shardings.

Each process reports, per root: the object-store counters of its save (requests, bytes) and of
its restore, and whether every restored shard is exact. The values are ``VALUES`` below, so the
test process can compare the files with a local save's.
"""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

N = ctx.num_processes
# name -> (shape, dtype, spec) on the (N, devices per process) mesh ("data", "model"):
# "data" spans processes. "cols" and "tiles" cut a later dimension with "data" (re-laid out
# on object storage); "rows" cuts the first; "short" has too few rows to be worth it.
TENSORS = {
    "cols": ((512, 4096), np.float32, (None, "data")),
    "tiles": ((256, 1024), ml_dtypes.bfloat16, ("model", "data")),
    "rows": ((512, 1024), np.float32, ("data", None)),
    "short": ((8, 4096), np.float32, (None, "data")),
}
mesh = Mesh(np.array(jax.devices()).reshape(N, -1), ("data", "model"))


def value(name: str) -> np.ndarray:
    shape, dtype, _ = TENSORS[name]
    seed = sum(map(ord, name))
    return (np.arange(np.prod(shape), dtype=np.float64) * 0.25 + seed).astype(dtype).reshape(shape)


def sharding(name: str) -> NamedSharding:
    return NamedSharding(mesh, P(*TENSORS[name][2]))


values = {name: value(name) for name in TENSORS}
state = {
    name: jax.make_array_from_callback(v.shape, sharding(name), lambda i, v=v: v[i])
    for name, v in values.items()
}
state["step"] = 3
target = {
    name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(name))
    for name, (shape, dtype, _) in TENSORS.items()
}
target["step"] = 0


def counters(stats: osf.ObjectStoreStats) -> dict:
    return {**vars(stats), "requests": stats.requests}


report: dict = {"process": jax.process_index(), "roots": {}}
handler = osf.SafetensorsCheckpointHandler()
for root, use_async in ctx.args["saves"]:
    options = osf.manager_options_for(root, max_to_keep=1, enable_async_checkpointing=use_async)
    osf.object_store_stats(reset=True)
    with ocp.CheckpointManager(root, options=options, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(state))
        mngr.wait_until_finished()
        saved = osf.object_store_stats(reset=True)
        restored = mngr.restore(0, args=osf.SafetensorsRestore(target))
        fetched = osf.object_store_stats(reset=True)
        # The column stripes alone: each process needs half of every row.
        cols = mngr.restore(
            0, args=osf.SafetensorsRestore({"cols": target["cols"]}, partial_restore=True)
        )["cols"]
        cols_fetched = osf.object_store_stats(reset=True)
        cols_read = vars(handler.last_read_stats)
    bad = [
        name
        for name in TENSORS
        if restored[name].sharding != target[name].sharding
        or not all(
            np.array_equal(np.asarray(s.data), value(name)[s.index])
            for s in restored[name].addressable_shards
        )
    ]
    report["roots"][root] = {
        "bad": bad + ([] if restored["step"] == 3 else ["step"]),
        "save": counters(saved),
        "ranges": [r[1:] for r in handler.last_write_stats.ranges],  # (offset, size)
        "restore": counters(fetched),
        "cols_ok": cols.sharding == target["cols"].sharding
        and all(
            np.array_equal(np.asarray(s.data), values["cols"][s.index])
            for s in cols.addressable_shards
        ),
        "cols_restore": counters(cols_fetched),
        "cols_read_stats": cols_read,
    }
worker_lib.emit_result(report)
worker_lib.finish()
