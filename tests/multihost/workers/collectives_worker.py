"""Back-to-back barriers, broadcasts of other sizes and gathers (``compat.jaxcompat``), as an
export runs them: every value right and no process aborted. (With
``jax.experimental.multihost_utils``, which waits for the first local device only, jax 0.6's
gloo aborted a process here within seconds on a busy machine.)"""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from orbax_safetensors._src.compat import jaxcompat  # noqa: E402

primary = jax.process_index() == 0
flat = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
whole = np.arange(8 * len(jax.devices()), dtype=np.float32)
ok = True
for i in range(ctx.args["n"]):
    mine = (np.arange(8, dtype=np.uint8) + i % 7).tobytes() if primary else None
    got = np.frombuffer(jaxcompat.broadcast_bytes(mine, is_source=primary), np.uint8)
    ok &= bool(np.array_equal(got, np.arange(8) + i % 7))
    # (right after, a broadcast of another size: the pattern gloo aborted on)
    four = i.to_bytes(4, "little") if primary else None
    ok &= int.from_bytes(jaxcompat.broadcast_bytes(four, is_source=primary), "little") == i
    text = jaxcompat.broadcast_bytes(b"x" * (i % 13) if primary else None, is_source=primary)
    ok &= text == b"x" * (i % 13)
    jaxcompat.barrier(f"collectives.{i}")
    if i % 10 == 0:
        x = jax.make_array_from_callback(whole.shape, flat, lambda idx, i=i: whole[idx] + i)
        ok &= bool(np.array_equal(jaxcompat.process_allgather(x), whole + i))
worker_lib.emit_result({"ok": ok})
worker_lib.finish()
