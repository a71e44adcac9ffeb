"""Kernels sharded along their input axis (each process's share of the PyTorch weight is a
column stripe: one short run per row), exported by every process: re-laid out on the devices
into row blocks (``export.MIN_RUN_BYTES`` / ``MANY_RUNS``), cast there when the policy
asks for bfloat16.

Args (``ctx.args``): ``out`` (a directory every process sees), ``dtype`` (``"keep"`` or
``"bfloat16"``), ``rows`` / ``cols`` (the kernels' ``(in, out)`` shape).
"""

import worker_lib

ctx = worker_lib.init()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.pipeline import relayout  # noqa: E402

args = ctx.args
mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(0)
shape = (args["rows"], args["cols"])
weights = {f"l{i}.kernel": rng.standard_normal(shape, dtype=np.float32) for i in range(3)}
tree = {
    n: jax.make_array_from_callback(shape, NamedSharding(mesh, P("d")), lambda i, v=v: v[i])
    for n, v in weights.items()
}
mapping = osf.KeyMapping([osf.Rule("layers.{i}.weight", "l{i}.kernel", osf.Transpose())])
dtype = None if args["dtype"] == "keep" else jnp.bfloat16
batch = {"batch_bytes": args["batch_bytes"]} if "batch_bytes" in args else {}
report = osf.export_pytorch(tree, Path(args["out"]), mapping, dtype=dtype, **batch)
assert report.ok, report.problems()
relayouts = relayout.compiled.cache_info().currsize  # compiled re-layouts
worker_lib.emit_result({"bytes_written": report.bytes_written, "relayouts": relayouts})
worker_lib.finish()
