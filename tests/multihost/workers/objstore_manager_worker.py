"""A multi-process S3 save through a CheckpointManager (the spread save over
``jax.distributed``'s key-value store).

Args (``ctx.args``): ``root`` (a CheckpointManager root in an existing bucket).

Checks, in one launch:
  * ``import orbax.checkpoint.multihost`` (which rebinds ``ocp.multihost`` to the public package)
    does not break the save.
  * A default-options CheckpointManager save raises inside ``save()`` on every process, naming
    ``osf.manager_options_for``; one with ``osf.manager_options_for`` then saves and restores.
"""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import orbax.checkpoint.multihost  # noqa: E402, F401  (rebinds ocp.multihost: must not matter)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

report: dict = {"process": jax.process_index()}

# 1. Orbax's default options on S3: refused in save() on every process.
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
# 32 MiB: each process's 16 MiB of rows is large enough for parts of its own.
value = np.arange(8192 * 1024, dtype=np.float32).reshape(8192, 1024)
tree = {
    "w": jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, P("data", None)), lambda i: value[i]
    )
}
root = ctx.args["root"]
try:
    with ocp.CheckpointManager(f"{root}-default") as mngr:
        mngr.save(0, args=osf.SafetensorsSave(tree))
    report["default"] = None
except Exception as error:
    report["default"] = {"type": type(error).__name__, "message": str(error)}

# 2. With osf.manager_options_for, the same save works (parts from both processes).
options = osf.manager_options_for(root, enable_async_checkpointing=True)
osf.object_store_stats(reset=True)
with ocp.CheckpointManager(root, options=options) as mngr:
    mngr.save(0, args=osf.SafetensorsSave(tree))
    mngr.wait_until_finished()
    report["multipart_parts"] = osf.object_store_stats().multipart_parts
    restored = mngr.restore(0, args=osf.SafetensorsRestore())
report["restored_ok"] = all(
    np.array_equal(np.asarray(shard.data), value[shard.index])
    for shard in restored["w"].addressable_shards
)
worker_lib.emit_result(report)
worker_lib.finish()
