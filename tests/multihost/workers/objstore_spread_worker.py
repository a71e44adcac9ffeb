"""N processes save row- and column-sharded states to S3 and GCS through an Orbax
CheckpointManager; each reports what its object-store engine sent during each save beside
what the upload plan (``storage/objstore/upload_plan``) says it sends, and checks a restore.

Args (``ctx.args``): ``roots`` (checkpoint root URLs), ``part_size``, ``max_file_size``.
"""

import worker_lib

ctx = worker_lib.init()

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import objstore_values as vals  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import upload_requests  # noqa: E402  (tests/helpers)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from upload_requests import RequestKind as K  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.storage.objstore import spread  # noqa: E402

n = ctx.num_processes
mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
# name -> (shape, dtype, spec); rows: the across-host axis first; cols: second.
STATES = {
    "rows": {
        "a": ((1024, 4096), np.float32, ("data", None)),
        "b": ((2048, 1024), vals.BF16, ("data", "model")),
        "c": ((4096,), np.float32, ("data",)),
        "d": ((300, 128), np.float32, ()),
    },
    "cols": {
        "a": ((1024, 4096), np.float32, (None, "data")),
        "b": ((2048, 1024), vals.BF16, ("model", "data")),
        "d": ((300, 128), np.float32, ()),
    },
}


def build(state: dict) -> dict:
    tree = {}
    for name, (shape, dtype, spec) in state.items():
        value = vals.value(name, shape, dtype, 0)
        sharding = NamedSharding(mesh, P(*spec))
        tree[name] = jax.make_array_from_callback(shape, sharding, lambda i, v=value: v[i])
    return tree


def planned(plan, me: int) -> dict:
    mine = upload_requests.requests_of(plan, me)
    count = {k: sum(r.kind is k for r in mine) for k in K}
    return {
        "put_requests": sum(
            count[k] for k in (K.PUT_OBJECT, K.PUT_STAGED, K.PUT_LOOSE, K.PUT_FILLER, K.UPLOAD_PART)
        ),
        "multipart_parts": count[K.UPLOAD_PART],
        "get_requests": count[K.GET_RANGE],
        "compose_requests": count[K.COMPOSE],
        "delete_requests": count[K.DELETE],
        "other_requests": count[K.CREATE_UPLOAD] + count[K.COMPLETE_UPLOAD],
        "list_requests": count[K.LIST_PARTS],
        "bytes_uploaded": sum(r.upload for r in mine),
        "bytes_fetched": sum(r.download for r in mine),
        "windows": sum(f.windows for f in plan.files),
        # owners of the most shared window: its builder sends one GET per other owner
        "window_owners_max": max(
            [int(np.bincount(f.pair_window).max()) for f in plan.files if len(f.pair_window)],
            default=1,
        ),
        "mixed_target": plan.mixed_target,
    }


io = osf.IOOptions(object_store=osf.ObjectStoreOptions(part_size=ctx.args["part_size"]))
handler = osf.SafetensorsCheckpointHandler(max_file_size=ctx.args["max_file_size"], io_options=io)
report: dict = {"process": jax.process_index(), "saves": []}
for root in ctx.args["roots"]:
    for label, state in STATES.items():
        options = osf.manager_options_for(root, max_to_keep=1, enable_async_checkpointing=True)
        with ocp.CheckpointManager(
            f"{root}/{label}", options=options, item_handlers=handler
        ) as mngr:
            osf.object_store_stats(reset=True)
            mngr.save(0, args=osf.SafetensorsSave(build(state)))
            mngr.wait_until_finished()
            measured = dataclasses.asdict(osf.object_store_stats(reset=True))
            plan, me = spread.last_plan()
            target = {
                name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
                for name, (shape, dtype, spec) in state.items()
            }
            restored = mngr.restore(0, args=osf.SafetensorsRestore(target))
            bad = [
                name
                for name, (shape, dtype, _) in state.items()
                if not all(
                    np.array_equal(np.asarray(s.data), vals.value(name, shape, dtype, 0)[s.index])
                    for s in restored[name].addressable_shards
                )
            ]
        report["saves"].append(
            {
                "root": root,
                "state": label,
                "measured": measured,
                "planned": planned(plan, me),
                "checkpoint_bytes": sum(f.size for f in plan.files),
                "bad": bad,
            }
        )
worker_lib.emit_result(report)
worker_lib.finish()
