"""N = 8 real ``jax.distributed`` processes (1 CPU device each) save through a real
CheckpointManager on local disk and on GCS (fake-gcs-server), and the checkpoints are restored
resharded at N = 8 and at N = 2 (issue 27, point 6).

Two launches, each checking many things (process start-up dominates):

1. N=8: async saves into a local directory and a ``gs://`` bucket (rows, column stripes, a
   2-D mesh, partly and fully replicated tensors, a host leaf, a scalar), then a restore of
   the local one onto other shardings over the devices in reverse order; every process checks
   every shard it holds.
2. N=2 (2 devices each): restores of both checkpoints onto the same kinds of shardings over
   its 4 devices, every shard checked.

Here, without ``jax.distributed``: the local file's tensors equal the global values, the
processes' written ranges tile its data exactly once, and the object is byte-identical to it.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import WORKERS_DIR, run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import WORKERS_DIR, run_workers
from objstore.buckets import download, list_keys

sys.path.insert(0, str(WORKERS_DIR))
import n8_values as V

pytestmark = [pytest.mark.multihost]
_ITEM = f"{V.STEP}/default"


@pytest.mark.timeout(400)
def test_eight_processes_save_locally_and_on_gcs_and_restore_resharded_at_8_and_2(
    gcs_server, gcs_bucket, tmp_path: Path
) -> None:
    local, remote = str(tmp_path / "run"), f"{gcs_bucket}/run"
    env = gcs_server.child_env()
    saved = run_workers(
        "n8_worker.py",
        8,
        devices_per_process=1,
        args={"saves": [local, remote], "restores": [local]},
        env=env,
        timeout=240,
    )
    restored = run_workers(
        "n8_worker.py", 2, args={"restores": [local, remote]}, env=env, timeout=120
    )
    for run in (saved, restored):
        for r in run:
            for root, rep in r.result["restores"].items():
                assert rep["bad"] == [], (len(run), r.process_id, root, rep)
    # The local file holds the global values; the processes wrote its data exactly once.
    path = tmp_path / "run" / _ITEM / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start = 8 + n
    for name in [*V.SHARDED, *V.HOST]:
        a, b = header[name]["data_offsets"]
        got = np.frombuffer(raw[start + a : start + b], V.value(name).dtype)
        assert np.array_equal(got.reshape(V.value(name).shape), V.value(name)), name
    assert len(raw) - start == V.data_bytes()
    for root in (local, remote):
        ranges = sorted(
            (off, size) for r in saved for _, off, size in r.result["saves"][root]["ranges"]
        )
        end = start
        for off, size in ranges:
            assert off == end, (root, off, end)  # no gap, no overlap across processes
            end += size
        assert end == len(raw), root
    # The object is the same file; nothing staged is left.
    assert download(gcs_server, f"{remote}/{_ITEM}/model.safetensors") == raw
    keys = list_keys(gcs_server, remote)
    assert not any(".osf-parts" in k for k in keys), keys
    assert f"{V.STEP}/commit_success.txt" in keys
    meta = json.loads((tmp_path / "run" / _ITEM / "orbax_safetensors.json").read_text())
    assert json.loads(download(gcs_server, f"{remote}/{_ITEM}/orbax_safetensors.json")) == meta
    assert meta["tensors"]["cols"]["sharding"]["spec"] == [None, "x"]  # the caller's sharding
