"""load into an abstract sharded target across processes: each process reads its own rows of
a Hugging Face tensor (through a transpose), and a stacked tensor joins correctly."""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

weight = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)  # PyTorch (out, in)
layers = [np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 1000 * i for i in range(2)]
mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("p", "d"))
mapping = osf.KeyMapping(
    [
        osf.Rule("l.weight", "kernel", osf.Transpose()),
        osf.Rule("s.{i}.weight", "stack", osf.Transpose(), stacked="i"),
    ]
)
kernel_only = {
    "kernel": jax.ShapeDtypeStruct((32, 64), np.float32, sharding=NamedSharding(mesh, P(None, "p")))
}
handler = osf.SafetensorsCheckpointHandler()
got = handler.restore(
    ctx.args["dir"], osf.SafetensorsRestore(kernel_only, mapping=mapping, partial_restore=True)
)
stats = handler.last_read_stats
want = weight.T
kernel_ok = all(
    np.array_equal(np.asarray(s.data), want[s.index]) for s in got["kernel"].addressable_shards
)
stacked = {
    "stack": jax.ShapeDtypeStruct(
        (2, 8, 16), np.float32, sharding=NamedSharding(mesh, P(None, "d", "p"))
    )
}
got2 = osf.load_pytorch(stacked, ctx.args["dir"], mapping, strict=False)
want2 = np.stack([x.T for x in layers])
stack_ok = all(
    np.array_equal(np.asarray(s.data), want2[s.index]) for s in got2["stack"].addressable_shards
)
worker_lib.emit_result(
    {
        "kernel_ok": kernel_ok,
        "stack_ok": stack_ok,
        "bytes_read": stats.bytes_read,
        "bytes_needed": stats.bytes_needed,
        "kernel_bytes": weight.nbytes,
        "fully_addressable": got["kernel"].is_fully_addressable,
    }
)
worker_lib.finish()
