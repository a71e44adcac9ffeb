"""Issue 27 point 1 at scale, measured at N = 2, 4 and 8 (slow): a state of many same-shape tensors whose
pieces are far smaller than an upload window (row- and column-sharded), saved to S3 and GCS by
real ``jax.distributed`` processes. The save joins same-shape tensors on the devices
(``core.relayout``, ``pipeline.relayout``), so each process uploads one contiguous range of each
group: its windows are its own (the bytes in mixed windows, most of the state for the same
save without joining, at most half of that here), each process moves at most 1.25 x its
share + 2 windows + metadata and sends at most 2x the mean requests, the simulation
(``benchmarks/scale_sim.plan_save``) plans exactly the bytes and requests each process sent,
the join compiles to all-to-all exchanges (no all-gather) with device buffers of a few times
a group's block, and restores (onto the saved and onto the other sharding) are exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# tests/ is on sys.path (as for tests/conftest.py).
from multihost.launcher import run_workers

from objstore.buckets import list_keys, pending_uploads
from objstore.trees import MiB

REPO = Path(__file__).resolve().parents[2]
PART_SIZE = 10 * MiB
METADATA_ALLOWANCE = 1 * MiB  # orbax_safetensors.json, index and Orbax's own files


@pytest.mark.multihost
@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_joined_groups_move_each_process_share(
    n: int, s3_server, gcs_server, s3_bucket, gcs_bucket
) -> None:
    roots = [f"{s3_bucket}/groups{n}", f"{gcs_bucket}/groups{n}"]
    results = run_workers(
        "objstore_groups_worker.py",
        n,
        args={
            "roots": roots,
            "part_size": PART_SIZE,
            "max_file_size": 128 * MiB,
            "repo": str(REPO),
            # (each process's share several windows: per-save requests, the primary's commit
            # record and a finisher's create and complete, against a mean of a few parts)
            "matrices": 80 if n < 8 else 320,
        },
        env=gcs_server.child_env(s3_server.child_env()),
        timeout=540,
    )
    reports = [r.result for r in results]
    join = reports[0]["join"]
    assert join["all_gather"] == 0 and join["all_to_all"] > 0, join
    block = join["group_bytes"] // join["devices"]
    assert join["output_bytes"] == block and join["temp_bytes"] <= 3 * block, join
    rows = []
    for k, first in enumerate(reports[0]["saves"]):
        per = [r["saves"][k] for r in reports]
        share = first["checkpoint_bytes"] / n
        requests = [
            sum(v for key, v in r["measured"].items() if key.endswith("_requests")) for r in per
        ]
        # No process, the primary included, sends more than 2x the mean requests.
        assert max(requests) <= 2 * sum(requests) / n, (first["root"], first["state"], requests)
        for process, p in enumerate(per):
            assert p["bad"] == [], (process, p["bad"])
            m = p["measured"]
            assert p["simulated"] == p["executed"], (process, p)
            # (mixed windows left: around the headers and the small groups written whole)
            mixed, unjoined = p["executed"]["mixed_bytes"], p["unjoined"]["mixed_bytes"]
            assert mixed * 2 <= unjoined, (process, p)
            if not m["retries"]:
                assert m["bytes_uploaded"] >= p["executed"]["bytes_uploaded"], (process, p)
                assert m["bytes_fetched"] == p["executed"]["bytes_fetched"], (process, p)
            moved = m["bytes_uploaded"] + m["bytes_fetched"]
            bound = 1.25 * share + 2 * PART_SIZE + METADATA_ALLOWANCE
            assert moved <= bound, (process, moved, bound, p)
            rows.append(
                (first["root"], first["state"], process, moved, share, mixed, unjoined, requests)
            )
    for root, server in zip(roots, (s3_server, gcs_server)):
        assert not any(".osf-parts" in key for key in list_keys(server, root)), root
        assert pending_uploads(server, root) == []
    print(rows)
