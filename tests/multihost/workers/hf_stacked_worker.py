"""Multi-process export of stacked layouts (``hf_stacked_values``): every process exports the
same sharded tree and reports what it wrote.

Args (``ctx.args``): ``weights`` (an ``.npz`` of the global tensors, read whole by each process
only to build its shards), ``out`` (a directory every process sees).

Exports, each into ``out/<name>``: every entry of ``hf_stacked_values.EXPORTS`` from the
in-memory sharded tree, and ``from_ckpt``: the same tree saved by this job, exported from the
checkpoint (each process reads only its boxes). Reported per export: ``bytes_written``.
"""

import worker_lib

ctx = worker_lib.init()

from pathlib import Path  # noqa: E402

import hf_stacked_values as V  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

weights = dict(np.load(ctx.args["weights"]))
out = Path(ctx.args["out"])
mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("p", "l"))
tree = {}
for name, spec in V.SPECS.items():
    value = weights[name]
    sharding = NamedSharding(mesh, spec)
    tree[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    assert not tree[name].is_fully_addressable
del weights

result = {}


def export(name, source, **kwargs):
    report = osf.export_pytorch(source, out / name, V.MAPPING, **kwargs)
    assert report.ok, report.problems()
    result[name] = {"bytes_written": report.bytes_written}


for name, kwargs in V.EXPORTS.items():
    export(name, tree, **kwargs)
with ocp.CheckpointManager(out / "ckpt") as mngr:
    mngr.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(tree)))
    mngr.wait_until_finished()
export("from_ckpt", str(out / "ckpt"), item="state", **V.EXPORTS["f32_shards"])

worker_lib.emit_result(result)
worker_lib.finish()
