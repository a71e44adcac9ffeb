"""Multi-process worker of ``benchmarks/maxtext_export_bench.py``.

Started through ``tests/multihost/launcher.run_workers``. Args (``ctx.args``): ``action``
(``save``: every process saves its shards of a random MaxText-layout train state of ``dims``
at ``root``/``step`` as MaxText 0.2.5 does, ``layout`` ``fsdp`` or ``layers`` (scanned tensors
split on their layers axis, in chunks of at most ``chunk_bytes``); ``ours``: every process
exports the checkpoint's parameters to ``out``; ``whole``: one process restores the parameters
whole, then exports them from memory), ``root``, ``step``, ``out``, ``dims``, ``mapping``
(``hand``, or ``maxtext-llama3``: the preset, one PyTorch tensor per layer). Reports ``seconds`` (after a last
barrier, the output fsynced), ``peak_extra`` (``VmHWM`` growth) and ``bytes_written``.
"""

import worker_lib

ctx = worker_lib.init()

import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from benchmarks import procfs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))
import maxtext_checkpoints as M  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

args = ctx.args
dims = M.Dims(**args["dims"])
root = Path(args["root"])
item = root / str(args["step"]) / M.ITEM
result = {"process_index": jax.process_index()}

layers = args.get("layout") == "layers"
if args["action"] == "save":
    state = M.random_sharded_state(dims, step=args["step"], layers=layers)
    M.save_v1(root, args["step"], state, chunk_bytes=args.get("chunk_bytes"))
else:
    out = Path(args["out"])
    if args.get("mapping") == "maxtext-llama3":
        mapping = osf.preset_mapping("maxtext-llama3", hf_config=M.hf_config(dims))
    else:
        mapping = M.hand_mapping(dims)
    gc.collect()
    multihost_utils.sync_global_devices("bench.start")
    rss0 = procfs.rss_bytes()
    procfs.reset_peak()
    t0 = time.perf_counter()
    if args["action"] == "ours":
        report = osf.export_pytorch(item, out, mapping, dtype="bfloat16")
    else:  # whole: the parameters restored whole on this host, then exported
        tree = ocp.PyTreeCheckpointer().metadata(item)
        tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
        params = {"params": tree["params"]}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params)
        restored = ocp.PyTreeCheckpointer().restore(
            item,
            args=ocp.args.PyTreeRestore(
                item=params, restore_args=restore_args, partial_restore=True
            ),
        )
        report = osf.export_pytorch(restored, out, mapping, dtype="bfloat16")
        del restored
    assert report.ok, report.problems()
    multihost_utils.sync_global_devices("bench.written")
    if jax.process_index() == 0:
        procfs.fsync_tree(out)
    multihost_utils.sync_global_devices("bench.durable")
    result.update(
        seconds=time.perf_counter() - t0,
        peak_extra=max(0, procfs.hwm_bytes() - rss0),
        bytes_written=report.bytes_written,
    )

worker_lib.emit_result(result)
worker_lib.finish()
