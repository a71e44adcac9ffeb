"""Issue 17 worker: one Orbax v1 save (``ocp.save`` through ``osf.SafetensorsHandler``) of a
globally sharded tree by every process, then one ``ocp.load`` onto a sharded abstract tree."""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from orbax.checkpoint import v1 as ocp  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

rows, cols = 8 * ctx.num_processes, 6
expected = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
sharding = NamedSharding(mesh, P("data", None))
arr = jax.make_array_from_callback(expected.shape, sharding, lambda index: expected[index])
tree = {"w": arr, "bias": np.arange(5, dtype=np.int32)}

context = ocp.Context()
context.checkpointables.registry = osf.local_registry()
with context:
    ocp.save(ctx.args["path"], tree)
    abstract = {
        "w": jax.ShapeDtypeStruct(expected.shape, expected.dtype, sharding=sharding),
        "bias": jax.ShapeDtypeStruct((5,), np.int32),
    }
    loaded = ocp.load(ctx.args["path"], abstract)

worker_lib.emit_result(
    {
        "shards_ok": all(
            np.array_equal(np.asarray(s.data), expected[s.index])
            for s in loaded["w"].addressable_shards
        ),
        "sharding_ok": loaded["w"].sharding == sharding,
        "bias_ok": np.array_equal(np.asarray(loaded["bias"]), np.arange(5, dtype=np.int32)),
    }
)
worker_lib.finish()
