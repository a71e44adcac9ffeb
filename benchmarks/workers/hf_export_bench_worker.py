"""Multi-process worker of ``benchmarks/hf_export_bench.py``: every process runs each method
on the same checkpoint (barriers around each) and reports its time and peak extra memory.

Started through ``tests/multihost/launcher.run_workers``. Args (``ctx.args``): ``methods``
(``ours`` / ``gather``, in order), ``ckpt``, ``out`` (a directory every process sees; each
method writes ``out/<method>``), ``size``, ``source`` (``checkpoint`` or ``memory``, see
``hf_export_bench.measure``), ``check`` (compare the two outputs' tensors).
"""

import worker_lib

ctx = worker_lib.init()

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from benchmarks import hf_export_bench as B  # noqa: E402

args = ctx.args
base = Path(args["out"])
result = {}
for method in args["methods"]:
    out = base / method
    multihost_utils.sync_global_devices(f"bench.{method}.start")
    result[method] = B.measure(
        method, Path(args["ckpt"]), out, args["size"], args.get("source", "checkpoint")
    )
    multihost_utils.sync_global_devices(f"bench.{method}.end")
if args.get("check") and jax.process_index() == 0 and len(args["methods"]) == 2:
    result["same_tensors"] = B.tensors_equal(base / "ours", base / "gather")
multihost_utils.sync_global_devices("bench.checked")
if jax.process_index() == 0:
    shutil.rmtree(base, ignore_errors=True)
worker_lib.emit_result(result)
worker_lib.finish()
