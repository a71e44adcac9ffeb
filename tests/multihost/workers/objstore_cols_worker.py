"""N processes restore a column-sharded tensor from S3 and GCS (issue 27, must-hold 2).

Args (``ctx.args``): ``roots`` (checkpoint root URLs). The tensor is saved row-sharded and
restored with ``P(None, "data")``: each process needs a stripe of columns of every row. Each
process reports whether its shards are right, the engine's GETs and bytes, and its read stats.
"""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

SHAPE = (512, 4096)
value = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
saved = jax.make_array_from_callback(
    SHAPE, NamedSharding(mesh, P("data", None)), lambda i: value[i]
)
target = {
    "cols": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, P(None, "data")))
}
report: dict = {"process": jax.process_index(), "roots": {}}
handler = osf.SafetensorsCheckpointHandler()
for root in ctx.args["roots"]:
    options = osf.manager_options_for(root, max_to_keep=1)
    with ocp.CheckpointManager(root, options=options, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave({"cols": saved}))
        mngr.wait_until_finished()
        osf.object_store_stats(reset=True)
        restored = mngr.restore(0, args=osf.SafetensorsRestore(target))["cols"]
        engine = osf.object_store_stats(reset=True)
    report["roots"][root] = {
        "ok": restored.sharding == target["cols"].sharding
        and all(
            np.array_equal(np.asarray(s.data), value[s.index]) for s in restored.addressable_shards
        ),
        "fetched": engine.bytes_fetched,
        "get_requests": engine.get_requests,
        "needed": value.nbytes // ctx.num_processes,  # a stripe of 1/N of the columns
        "read_stats": vars(handler.last_read_stats),
    }
worker_lib.emit_result(report)
worker_lib.finish()
