"""The end of a spread object-store save by N processes, on S3 and GCS (issue 27's loose ends).

Args (``ctx.args``): ``roots`` (checkpoint root URLs), ``part_size``, ``max_file_size``,
``marker_dir`` (where the test's fault proxies look for ``armed-<scheme>``), ``proxy_env``
(process 1's endpoint variables: the proxies in front of the servers).

Per root, in one launch:
  * ``fresh``: every process saves through ``SafetensorsCheckpointHandler.save`` into
    ``<root>/fresh/default`` and nobody finalizes: the test finalizes it from its own process
    (a driver that never ran the save). Each process reports the key-value keys left.
  * ``fail``: a CheckpointManager saves step 0, then step 1 while process 1's requests go
    through a proxy that fails its writes after the first (process 1 arms it by creating
    the marker file). Each process reports the error, the steps Orbax lists, whether step 0
    still restores right, and the keys left.
  * ``abandoned``: process 1 aborts its save job before its writer runs (as a failed host
    copy does); process 0's write reports how soon it failed.
"""

import os
import pathlib
import threading
import time

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import objstore_values as vals  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.compat import jaxcompat  # noqa: E402
from orbax_safetensors._src.pipeline.save_job import SaveMode  # noqa: E402
from orbax_safetensors._src.storage.objstore import spread  # noqa: E402

# name -> (shape, dtype, spec): rows across processes (S3 multipart files shared by both),
# a column-sharded tensor (mixed windows: loose bundles, builders) and a replicated one.
STATE = {
    "a": ((1024, 4096), np.float32, ("data", None)),
    "b": ((2048, 1024), vals.BF16, ("model", "data")),
    "d": ((300, 128), np.float32, ()),
}
me = jax.process_index()
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
if me == 1:  # after the imports: Orbax's own clients keep the servers; ours use the proxies
    os.environ.update(ctx.args["proxy_env"])


def build(step: int) -> dict:
    tree = {}
    for name, (shape, dtype, spec) in STATE.items():
        value = vals.value(name, shape, dtype, step)
        sharding = NamedSharding(mesh, P(*spec))
        tree[name] = jax.make_array_from_callback(shape, sharding, lambda i, v=value: v[i])
    return tree


def keys_left() -> list:
    """The key-value keys of spread saves still in the coordination service (after a barrier:
    the primary deletes them once every process is done)."""
    multihost_utils.sync_global_devices("osf-keys-left")
    client = jaxcompat.distributed_kv()
    return [k for k, _ in client.key_value_dir_get("osf/")]


def restored_ok(restored: dict, step: int) -> bool:
    return all(
        np.array_equal(np.asarray(s.data), vals.value(name, shape, dtype, step)[s.index])
        for name, (shape, dtype, _) in STATE.items()
        for s in restored[name].addressable_shards
    )


io = osf.IOOptions(
    object_store=osf.ObjectStoreOptions(
        part_size=ctx.args["part_size"], max_attempts=2, backoff_initial=0.01
    )
)
report: dict = {"process": me, "roots": {}}
for root in ctx.args["roots"]:
    out = report["roots"][root] = {}
    scheme = root.split("://")[0]
    handler = osf.SafetensorsCheckpointHandler(
        max_file_size=ctx.args["max_file_size"], io_options=io
    )
    # 1. A save nobody finalizes here.
    handler.save(epath.Path(f"{root}/fresh/default"), osf.SafetensorsSave(build(0)))
    plan, _ = spread.last_plan()
    out["fresh_files"] = [f.name for f in plan.files]
    out["fresh_committed_by_primary"] = [
        f.name for f in plan.files if f.whole_owner < 0 and f.windows > 1
    ]
    out["fresh_keys_left"] = keys_left()

    # 2. Step 0 saves; step 1 fails on process 1 mid-upload.
    options = osf.manager_options_for(
        f"{root}/fail", max_to_keep=3, enable_async_checkpointing=False
    )
    with ocp.CheckpointManager(f"{root}/fail", options=options, item_handlers=handler) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(build(0)))
        multihost_utils.sync_global_devices("osf-step-0")
        marker = pathlib.Path(ctx.args["marker_dir"]) / f"armed-{scheme}"
        if me == 1:
            marker.touch()
        multihost_utils.sync_global_devices("osf-armed")
        try:
            mngr.save(1, args=osf.SafetensorsSave(build(1)))
            out["error"] = None
        except Exception as error:
            out["error"] = f"{type(error).__name__}: {error}"
        if me == 1:
            marker.unlink()
        out["fail_keys_left"] = keys_left()
        mngr.reload()
        out["steps"] = mngr.all_steps()
        target = {
            name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
            for name, (shape, dtype, spec) in STATE.items()
        }
        out["step0_ok"] = restored_ok(mngr.restore(0, args=osf.SafetensorsRestore(target)), 0)
    # 3. Process 1's save ends before its spread part (SaveJob.abort before its writer ran, as
    # a failed host copy does): the others stop waiting for it at once, nothing stays.
    directory = epath.Path(f"{root}/abandoned/default")
    job = handler.new_job(directory, osf.SafetensorsSave(build(2)), SaveMode.SNAPSHOT)
    start = time.monotonic()
    job.start()
    if me == 1:
        job.snapshot()  # (collectives: the column-sharded tensor's re-layout on the devices)
        job.abort(RuntimeError("host copy failed"))
        out["abandoned_error"] = None
    else:
        failure: list = []

        def write(job=job, failure=failure) -> None:
            try:
                job.write()
            except Exception as error:
                failure.append(f"{type(error).__name__}: {error}")

        writer = threading.Thread(target=write)
        writer.start()
        job.snapshot()
        writer.join()
        out["abandoned_error"] = failure[0] if failure else None
    out["abandoned_seconds"] = time.monotonic() - start
    out["abandoned_keys_left"] = keys_left()
worker_lib.emit_result(report)
worker_lib.finish()
