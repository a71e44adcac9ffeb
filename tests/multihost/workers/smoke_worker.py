"""Smoke test worker: a globally sharded array, a barrier and an all-gather across processes."""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rows, cols = ctx.args.get("shape", [8, 4])
expected = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
arr = jax.make_array_from_callback(expected.shape, sharding, lambda index: expected[index])

shards_ok = all(
    np.array_equal(np.asarray(s.data), expected[s.index]) for s in arr.addressable_shards
)
total = jax.jit(lambda x: x.sum())(arr)  # a cross-process computation; output is replicated
multihost_utils.sync_global_devices("smoke")
ids = multihost_utils.process_allgather(np.array([ctx.process_id, 10 * ctx.process_id]))
gathered = multihost_utils.process_allgather(arr, tiled=True)

worker_lib.emit_result(
    {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "local_device_processes": [d.process_index for d in jax.local_devices()],
        "is_fully_addressable": arr.is_fully_addressable,
        "num_addressable_shards": len(arr.addressable_shards),
        "replica_ids": [s.replica_id for s in arr.addressable_shards],
        "shards_ok": shards_ok,
        "total": float(total.addressable_data(0)),
        "expected_total": float(expected.sum()),
        "allgathered_ids": np.asarray(ids).tolist(),
        "gathered_equals_global": bool(np.array_equal(np.asarray(gathered), expected)),
    }
)
worker_lib.finish()
