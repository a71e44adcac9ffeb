"""Gather-free export of stacked layouts by real ``jax.distributed`` processes (issue 42 point
1): N = 2 processes (2 CPU devices each) export the tree of ``workers/hf_stacked_values.py``
(experts and layers stacked on axes 0 and 1 and sharded there, a head split re-laid out on the
devices, a fused per-layer PyTorch tensor from separate stacked JAX tensors, a PyTorch tensor
stacking per-expert JAX tensors) from memory and from a checkpoint this job saved.

- every file of every export is byte-identical to the one-process export of the same weights;
- each process wrote only its own bytes: the processes' counts add up to the tensor bytes
  exactly and the non-primary process wrote at most half of them.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import WORKERS_DIR, run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import WORKERS_DIR, run_workers

sys.path.insert(0, str(WORKERS_DIR))
import hf_stacked_values as V
from official_reader import tensor_bytes

import orbax_safetensors as osf

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]


def test_stacked_layouts_export_from_two_processes_byte_identical(tmp_path):
    weights = V.weights()
    np.savez(tmp_path / "weights.npz", **weights)
    out = tmp_path / "by_2"
    results = run_workers(
        "hf_stacked_worker.py",
        2,
        devices_per_process=2,
        args={"weights": str(tmp_path / "weights.npz"), "out": str(out)},
        timeout=240.0,
    )
    by_pid = {r.process_id: r.result for r in results}
    for name in [*V.EXPORTS, "from_ckpt"]:
        # the reference: one process exporting the same weights (the checkpoint the job saved)
        source, kwargs = weights, V.EXPORTS.get(name)
        if name == "from_ckpt":
            source, kwargs = out / "ckpt", dict(V.EXPORTS["f32_shards"], item="state")
        single = tmp_path / f"single_{name}"
        assert osf.export_pytorch(source, single, V.MAPPING, **kwargs).ok
        files = sorted(p.name for p in single.iterdir())
        assert sorted(p.name for p in (out / name).iterdir()) == files, name
        for f in files:
            assert (out / name / f).read_bytes() == (single / f).read_bytes(), f"{name}/{f}"
        total = tensor_bytes(single)
        written = [by_pid[i][name]["bytes_written"] for i in range(2)]
        assert sum(written) == total and 0 < written[1] <= total / 2, (name, written, total)
