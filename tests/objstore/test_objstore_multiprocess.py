"""Object storage with several ``jax.distributed`` processes: one checkpoint on S3 and GCS.

The files are downloaded with a plain client and checked whole against
``tests/multihost/workers/objstore_values.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

# tests/ is on sys.path (as for tests/conftest.py).
from multihost.launcher import run_workers
from multihost.workers import objstore_values as vals

import orbax_safetensors as osf
from objstore.buckets import download, list_keys, pending_uploads
from objstore.trees import MiB, as_comparable, official_tensors

# --------------------------------------------------------------------------- multi-process


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_two_processes_save_and_restore_on_s3_and_gcs(
    s3_server, gcs_server, s3_bucket, gcs_bucket
) -> None:
    """N=2 processes save through an async CheckpointManager to both stores; each uploads
    about its own share; the files are standard safetensors files; restores onto other
    shardings are right and fetch about half the bytes per process."""
    roots = [f"{s3_bucket}/run", f"{gcs_bucket}/run"]
    steps = 2
    results = run_workers(
        "objstore_worker.py",
        2,
        args={"roots": roots, "steps": steps, "max_file_size": 32 * MiB},
        env=gcs_server.child_env(s3_server.child_env()),
        timeout=240,
    )
    expected = vals.global_arrays(step=steps - 1)
    for root, server in zip(roots, (s3_server, gcs_server)):
        keys = list_keys(server, root)
        item = f"{steps - 1}/default"
        files = sorted(k for k in keys if k.startswith(item) and k.endswith(".safetensors"))
        assert len(files) == 2, keys  # split by max_file_size, plus the HF index
        assert f"{item}/model.safetensors.index.json" in keys
        assert f"{steps - 1}/commit_success.txt" in keys and not any(
            k.startswith("0/") for k in keys
        )
        assert not any(".osf-parts" in k for k in keys), keys
        assert pending_uploads(server, root) == []

        found: dict[str, np.ndarray] = {}
        total = 0
        for f in files:
            raw = download(server, f"{root}/{f}")
            total += len(raw)
            found.update(official_tensors(raw))
        assert sorted(found) == sorted(expected)
        for name, want in expected.items():
            np.testing.assert_array_equal(found[name], as_comparable(want), err_msg=name)
        # Saved over both processes' devices, which this process lacks: as Orbax, a restore
        # without a target sharding needs a fallback.
        first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        check = osf.restore_directory(f"{root}/{item}", fallback_sharding=first)
        for name, want in expected.items():
            np.testing.assert_array_equal(as_comparable(check[name]), as_comparable(want))

        reports = [r.result["roots"][root] for r in results]
        for process, report in enumerate(reports):
            assert report["bad"] == [] and report["steps"] == [steps - 1], (process, report)
            # Each process uploaded its own share only (no gather), about half of every step.
            assert 0.35 * total * steps < report["uploaded"] < 0.65 * total * steps, report
            # Its restore (reversed process order) fetched about half the bytes, at most 1.5x
            # what its shards need, through the engine's GETs only: no header was read.
            assert 0.35 * total < report["fetched"] < 0.65 * total, report
            read = report["read_stats"]
            assert read["header_reads"] == 0 and read["header_bytes"] == 0, report
            assert report["fetched"] == read["bytes_read"] <= 1.5 * read["bytes_needed"], report
            assert report["get_requests"] == read["requests"], report
            assert report["retries"] == 0
        primary, other = reports
        # The part building is spread over both processes (storage/objstore/spread.py,
        # measured per process in test_objstore_spread.py): each rebuilt a few windows only.
        for report in reports:
            assert report["reassembled"] < 0.25 * total * steps, report
        if server.kind == "s3":
            assert primary["multipart_parts"] > 0 and other["multipart_parts"] > 0
        else:  # composed by the files' writers (the primary only composes tops of trees)
            assert primary["compose_requests"] + other["compose_requests"] >= steps


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_manager_saves_on_s3_need_the_commit_file_on_every_process(s3_server, s3_bucket) -> None:
    """N=2 real jax.distributed processes (also after ``import orbax.checkpoint.multihost``):
    a default-options manager save is refused in ``save()`` on every process; with
    ``osf.manager_options_for`` the same save uploads parts from both processes and restores."""
    root = f"{s3_bucket}/run"
    results = run_workers(
        "objstore_manager_worker.py",
        2,
        args={"root": root},
        env=s3_server.child_env(),
        timeout=240,
    )
    reports = [r.result for r in results]
    for report in reports:
        default = report["default"]
        assert default is not None and default["type"] == "SafetensorsCheckpointError", report
        assert "osf.manager_options_for" in default["message"]
        assert report["restored_ok"], report
    _, other = reports
    assert other["multipart_parts"] > 0  # its own parts of the shared upload
    assert not any(k.endswith(".safetensors") for k in list_keys(s3_server, f"{root}-default"))
    assert pending_uploads(s3_server, s3_bucket) == []
