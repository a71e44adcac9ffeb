"""load_pytorch / SafetensorsRestore(target, mapping=) into an abstract sharded target in 2 real
processes: each reads the byte ranges of its own shards (issue 28 point 4)."""

from __future__ import annotations

import numpy as np
import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import run_workers

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]


def test_each_process_reads_its_own_rows(tmp_path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    weight = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    tensors = {"l.weight": weight}
    for i in range(2):
        tensors[f"s.{i}.weight"] = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + 1000 * i
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    results = run_workers("hf_load_worker.py", 2, args={"dir": str(tmp_path)})
    for r in results:
        res = r.result
        assert res["kernel_ok"] and res["stack_ok"], res
        assert res["fully_addressable"] is False
        # the kernel (in, out) is split over processes on its out axis: each process reads
        # its own half of the PyTorch weight's rows, not the whole tensor
        assert res["bytes_needed"] == res["kernel_bytes"] // 2, res
        assert res["bytes_read"] <= res["kernel_bytes"] // 2 + 4096, res
