"""Many row-block -> column-stripe moves in a row (a restore of many column-sharded tensors
from object storage): every value right, and no hang."""

import worker_lib

ctx = worker_lib.init()
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from orbax_safetensors._src.pipeline import relayout  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("data", "model"))
rows = NamedSharding(Mesh(np.array(jax.devices()), ("rows",)), P("rows"))
cols = NamedSharding(mesh, P(None, "data"))
n = ctx.args["n"]
x = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
t0 = time.time()
vals = []
for i in range(n):
    a = jax.make_array_from_callback(x.shape, rows, lambda idx, i=i: x[idx] + i)
    vals.append(relayout.move(a, cols))
ok = all(
    np.array_equal(np.asarray(s.data), (x + i)[s.index])
    for i, v in enumerate(vals)
    for s in v.addressable_shards
)
worker_lib.emit_result({"ok": ok, "s": time.time() - t0})
worker_lib.finish()
