"""``benchmarks/scale_sim.py`` (issue 27 points 4 and 5): the real file planner and upload
planner for N virtual processes, without data. Small N for every store and sharding; the
targets at 1,024 processes for Llama-3-70B on both stores and both shardings, with the bound
of point 1 (bytes moved per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import scale_sim  # noqa: E402

KEYS = (
    "processes",
    "checkpoint_bytes",
    "files",
    "per_process_upload_bytes",
    "per_process_download_bytes",
    "per_process_requests",
    "total_requests",
    "parts_per_upload_max",
    "min_part_bytes",
    "compose_depth",
    "restore_header_bytes_per_process",
    "metadata_bytes",
    "plan_seconds_per_process",
)
MiB = 1 << 20


pytestmark = pytest.mark.main_env_only(
    "the planners of core and storage in pure Python and numpy arithmetic, no JAX or Orbax"
)


def test_the_command_prints_one_json_object() -> None:
    out = subprocess.run(
        [
            *(sys.executable, str(REPO / "benchmarks/scale_sim.py"), "--processes", "2"),
            *("--json", "--model", "llama3-70b", "--store", "s3", "--sharding", "fsdp,tp"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout)
    assert all(k in result for k in KEYS), result
    # The worked example of docs/multihost.md: 2,169 tensors, 706 GB, 154 files (150 on object
    # storage, where same-shape tensors are placed next to each other to be joined).
    assert result["tensors"] == 2169 and result["files"] == 150
    assert 705e9 < result["checkpoint_bytes"] < 706e9


@pytest.mark.parametrize("store", ["s3", "gs", "local"])
@pytest.mark.parametrize("sharding", ["fsdp,tp", "tp,fsdp"])
def test_small_jobs_are_balanced(store: str, sharding: str) -> None:
    r = scale_sim.simulate(8, "llama3-70b", store, sharding)
    share = r["checkpoint_bytes"] / 8
    up = r["per_process_upload_bytes"]
    assert up["max"] <= 1.3 * up["mean"]
    if store == "local":
        # every process writes exactly its bytes (plus the primary's headers)
        assert up["min"] >= share * 0.99 and r["per_process_download_bytes"]["max"] == 0
        return
    assert r["per_process_requests"]["max"] <= 2 * r["per_process_requests"]["mean"]
    assert r["min_part_bytes"] >= (5 * MiB if store == "s3" else 1)
    assert r["per_process_moved_over_share"] <= 1.25 + 2 * 64 * MiB / share


@pytest.mark.parametrize("store", ["gs", "s3"])
@pytest.mark.parametrize("sharding", ["fsdp,tp", "tp,fsdp"])
def test_targets_at_1024_processes(store: str, sharding: str) -> None:
    """Points 1 and 5 at 1,024 processes: the save joins same-shape tensors on the devices
    (``core.relayout``), so each process moves about its share."""
    r = scale_sim.simulate(1024, "llama3-70b", store, sharding)
    up, req = r["per_process_upload_bytes"], r["per_process_requests"]
    share = r["checkpoint_bytes"] / 1024
    bound = 1.25 * share + 2 * 64 * MiB + r["metadata_bytes"]
    assert r["share_bound_bytes"] == int(bound), r
    assert r["per_process_moved_bytes"]["max"] <= bound, r
    assert up["max"] <= 1.3 * up["mean"], r
    # Every process, the primary included, at most 2x the mean requests: each file's
    # completion (S3 create, list, complete; GCS top-level compose) is done by one of its
    # writers, its finisher, not by the primary.
    assert req["max"] <= 2 * req["mean"], r
    assert r["total_object_writes"] <= 200_000, r
    if store == "s3":
        assert r["min_part_bytes"] >= 5 * MiB and r["parts_per_upload_max"] <= 10_000, r
    else:
        assert r["compose_sources_max"] <= 32, r
    assert r["restore_header_bytes_per_process"] + r["metadata_bytes"] <= 2_000_000, r
    assert r["plan_seconds_per_process"] <= 10, r
