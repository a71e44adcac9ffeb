"""S3 multipart upload ids handed from the primary to every process (a JAX collective): the
path of jobs without a ``jax.distributed`` key-value store (a spread save creates its uploads
once the plan is known, see ``storage/objstore/spread.py``), called here directly.

Args (``ctx.args``): ``bucket`` (``s3://...``, exists), ``missing_bucket`` (``s3://...``, does not
exist), ``root`` (a CheckpointManager root under ``bucket``).

Checks, in one launch:
  * ``import orbax.checkpoint.multihost`` (which rebinds ``ocp.multihost`` to the public package)
    does not break the hand-off: it uses only public JAX API.
  * When the primary cannot create the uploads (a real NoSuchBucket), every process raises and
    none hangs; every process then takes the next hand-off normally.
  * Every process receives the same upload ids; the primary aborts them in finalize.
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
from orbax_safetensors._src.storage import config as _config  # noqa: E402
from orbax_safetensors._src.storage import router as _router  # noqa: E402
from orbax_safetensors._src.storage.objstore import engine as _engine  # noqa: E402
from orbax_safetensors._src.storage.objstore import s3_uploads as _s3_uploads  # noqa: E402

MiB = 1 << 20
primary = jax.process_index() == 0
report: dict = {"process": jax.process_index()}
big = [("model.safetensors", 64 * MiB), ("small.safetensors", MiB)]
store = _engine.S3.store(_config.resolve(None))

# 1. The primary fails to create the uploads: every process raises.
try:
    _s3_uploads.prepare_directory(
        store, f"{ctx.args['missing_bucket']}/run/0/default", big, is_primary=primary
    )
    report["failed"] = None
except Exception as error:
    report["failed"] = {"type": type(error).__name__, "message": str(error)}

# 2. The next hand-off works, and every process gets the same ids.
directory = f"{ctx.args['bucket']}/handoff/0/default"
_s3_uploads.prepare_directory(store, directory, big, is_primary=primary)
report["ids"] = _s3_uploads.upload_ids(directory)
if primary:
    _router.finalize_files(directory)  # nothing was uploaded: aborts the uploads

# 3. Orbax's default options on S3: refused in save() on every process.
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
# 32 MiB: each process's 16 MiB of rows is large enough for parts sent straight into the upload.
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

# 4. With osf.manager_options_for, the same save works (through the shared upload).
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
