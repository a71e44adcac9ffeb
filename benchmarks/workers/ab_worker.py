"""One round of ``benchmarks/ab_bench.py``: save a float32 state through an async
CheckpointManager, restore it with its shardings, read the file with ``osf.load_file``; prints
one JSON line of phase seconds. Imports whichever ``orbax_safetensors`` ``PYTHONPATH`` names."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

import orbax_safetensors as osf


def main(size: int, workdir: str) -> None:
    rng = np.random.default_rng(0)
    n = size // 4 // 16
    state = {
        f"layer{i}": {
            "w": jax.numpy.asarray(rng.standard_normal(n, dtype=np.float32)).reshape(-1, 256)
        }
        for i in range(16)
    }
    root = tempfile.mkdtemp(dir=workdir)
    try:
        t0 = time.perf_counter()
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
        with ocp.CheckpointManager(root, options=options) as mngr:
            mngr.save(0, args=osf.SafetensorsSave(state))
            t1 = time.perf_counter()
            mngr.wait_until_finished()
            t2 = time.perf_counter()
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            t3 = time.perf_counter()
            out = jax.block_until_ready(mngr.restore(0, args=osf.SafetensorsRestore(abstract)))
            t4 = time.perf_counter()
        for k in state:
            assert np.array_equal(out[k]["w"], state[k]["w"]), k
        t5 = time.perf_counter()
        osf.load_file(os.path.join(root, "0", "default", "model.safetensors"))
        t6 = time.perf_counter()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "save_blocks": t1 - t0,
                "save_total": t2 - t0,
                "restore": t4 - t3,
                "load_file": t6 - t5,
                "package": osf.__file__,
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
