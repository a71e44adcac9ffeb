"""What a multi-host restore checks (docs/security.md, *What is verified, and when*), with one
flipped bit and 2 real processes: a process that reads only its own shards of a tensor cannot
check the whole tensor's CRC32C, so the damage reaches the process owning those bytes unnoticed
(``verify`` finds it); a process that reads the tensor whole checks it and names the damage."""

from __future__ import annotations

import numpy as np
import pytest

import orbax_safetensors as osf

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import run_workers

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]


def test_only_processes_reading_a_tensor_whole_check_it(tmp_path) -> None:
    directory = tmp_path / "ckpt"
    osf.save_directory({"w": np.zeros((8, 4), np.float32)}, directory)
    file = directory / "model.safetensors"
    header = osf.read_header(file)
    raw = bytearray(file.read_bytes())
    raw[header.data_start + header.tensors["w"].begin] ^= 1  # row 0: process 0's share
    file.write_bytes(bytes(raw))
    report = osf.verify(directory)
    assert not report.ok and "tensor 'w'" in report.problems[0]

    results = run_workers("integrity_worker.py", 2, args={"dir": str(directory)})
    first, second = (r.result for r in results)
    for res in (first, second):
        for whole in ("replicated", "replicated_file"):
            assert "tensor 'w' in model.safetensors: CRC32C mismatch" in res[whole]["error"], res
    # Not checked: the process owning the damaged row gets it, the other its intact rows.
    for own in ("own_rows", "own_rows_of_the_file"):
        assert first[own] == {"intact": False} and second[own] == {"intact": True}, results
