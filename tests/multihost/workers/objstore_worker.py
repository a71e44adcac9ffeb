"""N processes save and restore through an async Orbax CheckpointManager on S3 and GCS.

Args (``ctx.args``): ``roots`` (checkpoint root URLs, e.g. ``["s3://b/run", "gs://b/run"]``),
``steps`` (steps to save; ``max_to_keep=1``), ``max_file_size`` (handler option).

Every process holds only its shards; the global values are ``objstore_values.value(...)`` so the
test process can check the files it downloads. Each process reports what it uploaded, the other
processes' bytes it downloaded to build part windows, whether the values it restored onto other shardings (on a
mesh with the process order reversed) are right, and the bytes it fetched for that restore.
"""

import time

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import objstore_values as vals  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
restore_mesh = Mesh(np.array(jax.devices())[::-1].reshape(ctx.num_processes, -1), ("data", "model"))


def build(step: int) -> dict:
    tree: dict = {}
    for name, (shape, dtype, spec) in vals.TENSORS.items():
        value = vals.value(name, shape, dtype, step)
        sharding = NamedSharding(mesh, P(*spec))
        tree[name] = jax.make_array_from_callback(shape, sharding, lambda i, v=value: v[i])
    for name, (shape, dtype) in vals.HOST.items():
        tree[name] = vals.value(name, shape, dtype, step)
    tree["step"] = step
    return tree


def check(restored: dict, step: int) -> list[str]:
    bad = []
    for name, (shape, dtype, _) in {
        **vals.TENSORS,
        **{k: (*v, None) for k, v in vals.HOST.items()},
    }.items():
        expected = vals.value(name, shape, dtype, step)
        got = restored[name]
        if isinstance(got, jax.Array):
            ok = all(
                np.array_equal(np.asarray(s.data), expected[s.index])
                for s in got.addressable_shards
            )
        else:
            ok = np.array_equal(np.asarray(got), expected)
        if not ok:
            bad.append(name)
    if restored["step"] != step:
        bad.append("step")
    return bad


report: dict = {"process": jax.process_index(), "roots": {}}
handler = osf.SafetensorsCheckpointHandler(max_file_size=ctx.args.get("max_file_size"))
for root in ctx.args["roots"]:
    options = osf.manager_options_for(root, max_to_keep=1, enable_async_checkpointing=True)
    osf.object_store_stats(reset=True)
    start = time.perf_counter()
    with ocp.CheckpointManager(root, options=options, item_handlers=handler) as mngr:
        for step in range(ctx.args["steps"]):
            mngr.save(step, args=osf.SafetensorsSave(build(step), metadata={"step": step}))
        mngr.wait_until_finished()
        save_seconds = time.perf_counter() - start
        saved = osf.object_store_stats(reset=True)
        steps = mngr.all_steps()
        last = mngr.latest_step()
        # Restore onto other shardings, on a mesh whose process order is reversed: each process
        # now needs the bytes the other one wrote.
        target = {}
        for name, (shape, dtype, _) in vals.TENSORS.items():
            spec = vals.RESTORE_SPECS.get(name, ())
            target[name] = jax.ShapeDtypeStruct(
                shape, dtype, sharding=NamedSharding(restore_mesh, P(*spec))
            )
        for name, (shape, dtype) in vals.HOST.items():
            target[name] = np.zeros(shape, dtype)
        target["step"] = 0
        start = time.perf_counter()
        restored = mngr.restore(last, args=osf.SafetensorsRestore(target))
        restore_seconds = time.perf_counter() - start
        fetched = osf.object_store_stats(reset=True)
        report["roots"][root] = {
            "steps": steps,
            "save_seconds": round(save_seconds, 2),
            "restore_seconds": round(restore_seconds, 2),
            "bad": check(restored, last),
            "uploaded": saved.bytes_uploaded,
            "put_requests": saved.put_requests,
            "multipart_parts": saved.multipart_parts,
            "copy_requests": saved.copy_requests,
            "compose_requests": saved.compose_requests,
            "reassembled": saved.bytes_reassembled,
            "retries": saved.retries,
            "fetched": fetched.bytes_fetched,
            "get_requests": fetched.get_requests,
            "read_stats": vars(handler.last_read_stats),
        }
worker_lib.emit_result(report)
worker_lib.finish()
