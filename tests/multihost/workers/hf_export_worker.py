"""Multi-process Hugging Face export worker: every process exports the same sharded scanned
LLaMA (``hf_export_values``) and reports what it wrote.

Args (``ctx.args``): ``config`` (the ``config.json`` dict), ``weights`` (an ``.npz`` of the global tensors, read whole by each
process only to build its shards), ``out`` (a directory every process sees).

Exports, each into ``out/<name>``: every entry of ``hf_export_values.EXPORTS`` from the
in-memory sharded tree, and ``from_ckpt``: the same tree saved by this job through a
CheckpointManager, exported from the manager root (read sharded: each process reads only its
boxes). Reported per export: ``bytes_written`` (the report's counter of tensor bytes this
process wrote), ``wchar`` (bytes this process passed to write system calls meanwhile, from
``/proc/self/io``) and seconds.
"""

import contextlib
import time

import worker_lib

_T0 = time.monotonic()
ctx = worker_lib.init()
_T_INIT = time.monotonic()

from pathlib import Path  # noqa: E402

import hf_export_values as V  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

# The export writes config.json and generation_config.json as transformers does, importing it
# (when installed) at the first export: imported here, before any write counter, because the
# import runs `ldconfig -p`, whose writes /proc/self/io adds to this process's wchar.
with contextlib.suppress(ImportError):
    import transformers.models.auto.modeling_auto  # noqa: F401


def wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


weights = dict(np.load(ctx.args["weights"]))
out = Path(ctx.args["out"])
devices = np.array(jax.devices()).reshape(jax.process_count(), -1)
mesh = Mesh(devices, ("p", "l"))
tree = {}
for name, spec in V.SPECS.items():
    value = weights[name]
    if spec is None:
        tree[name] = value
        continue
    sharding = NamedSharding(mesh, spec)
    tree[name] = jax.make_array_from_callback(value.shape, sharding, lambda i, v=value: v[i])
    assert not tree[name].is_fully_addressable
del weights

result = {"process_index": jax.process_index(), "init_s": round(_T_INIT - _T0, 2)}


def export(name, source, **kwargs):
    t0, w0 = time.monotonic(), wchar()
    report = osf.export_pytorch(
        source, out / name, V.MAPPING, hf_config=ctx.args["config"], **kwargs
    )
    assert report.ok, report.problems()
    result[name] = {
        "bytes_written": report.bytes_written,
        "wchar": wchar() - w0,
        "seconds": round(time.monotonic() - t0, 3),
        "moved": len(report.moved),
    }


for name, kwargs in V.EXPORTS.items():
    export(name, tree, **kwargs)

root = out / "ckpt"
with ocp.CheckpointManager(root) as mngr:
    mngr.save(7, args=ocp.args.Composite(state=osf.SafetensorsSave(tree)))
    mngr.wait_until_finished()
export("from_ckpt", str(root), item="state", **V.EXPORTS["f32_shards"])

worker_lib.emit_result(result)
worker_lib.finish()
