"""The end of a spread object-store save (issue 27's loose ends), on S3 and GCS.

* A spread save is finalized by a driver that did not run it (Orbax's finalize on a fresh
  handler, here the test's own process after the savers exited): each file several processes
  wrote was completed by its finisher during the save, and the primary persisted the commit
  record (``storage/objstore/engine.py``), which the finalize finds and deletes; a
  record that still lists S3 uploads or GCS tops to complete is completed from it, and one
  that does not match the store fails clearly, naming the file, and leaves no file.
* The key-value keys of each save are deleted once every process is done.
* A save that fails on one process mid-upload leaves no safetensors file, staged object or
  multipart upload behind, fails on every process, and the earlier step stays intact; one
  whose process fails before its spread part (an aborted job) fails at once on the others.
* Only the multipart uploads the plan needs are created (none spare to abort).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from etils import epath

# tests/ is on sys.path (as for tests/conftest.py).
from multihost.launcher import run_workers
from multihost.workers import objstore_values as vals

import orbax_safetensors as osf
from objstore.buckets import download, list_keys, pending_uploads
from objstore.faultproxy import FaultProxy
from objstore.trees import MiB
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import engine as _engine
from orbax_safetensors._src.storage.objstore import spread as _spread

STATE = {  # as in tests/multihost/workers/objstore_spread_end_worker.py
    "a": ((1024, 4096), np.float32),
    "b": ((2048, 1024), vals.BF16),
    "d": ((300, 128), np.float32),
}


def _store(kind: str):  # this library's client of the test server
    scheme = "s3" if kind == "s3" else "gs"
    return _engine.store_for(f"{scheme}://bucket", _config.resolve(None))


def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_commit_from_a_persisted_record(store) -> None:
    """A fresh driver completes the S3 multipart upload / composes the GCS top from the record
    alone, then deletes the record and the sources."""
    server, bucket = store
    st = _store(server.kind)
    directory = f"{bucket}/ckpt/3/default"
    name, base = "model.safetensors", "ckpt/3/default/"
    blobs = [_data(5 * MiB, 1), _data(5 * MiB, 2), _data(123, 3)]
    key = base + name
    if server.kind == "s3":
        upload_id = st.create_upload(name_of(bucket), key)
        for number, blob in enumerate(blobs, start=1):
            st.upload_part(name_of(bucket), key, upload_id, number, [memoryview(blob)])
        files = ({"name": name, "size": sum(map(len, blobs)), "parts": 3, "upload_id": upload_id},)
    else:
        for g, blob in enumerate(blobs):
            st.put(name_of(bucket), _spread.compose_key(key, 0, g), [memoryview(blob)])
        files = ({"name": name, "size": sum(map(len, blobs)), "level": 0, "sources": 3},)
    record = _engine.CommitRecord("s3" if server.kind == "s3" else "gs", files)
    data = [memoryview(record.to_json().encode())]
    st.put(name_of(bucket), _engine.record_key(directory), data)  # as the primary persisted it
    _engine.finalize_directory(st, directory)
    assert download(server, f"{directory}/{name}") == b"".join(blobs)
    assert list_keys(server, bucket) == [key]  # record and composites gone
    assert pending_uploads(server, bucket) == []


def test_a_record_the_store_contradicts_fails_clearly(store) -> None:
    """A part (S3) or composite (GCS) the record lists is missing: the finalize raises naming
    the file and what is missing, and writes no file."""
    server, bucket = store
    st = _store(server.kind)
    directory = f"{bucket}/ckpt/4/default"
    name, key = "model.safetensors", "ckpt/4/default/model.safetensors"
    if server.kind == "s3":
        upload_id = st.create_upload(name_of(bucket), key)
        st.upload_part(name_of(bucket), key, upload_id, 1, [memoryview(_data(5 * MiB, 1))])
        files = ({"name": name, "size": 6 * MiB, "parts": 2, "upload_id": upload_id},)
    else:
        st.put(name_of(bucket), _spread.compose_key(key, 0, 0), [memoryview(_data(99, 1))])
        files = ({"name": name, "size": 198, "level": 0, "sources": 2},)
    record = _engine.CommitRecord("s3" if server.kind == "s3" else "gs", files)
    data = [memoryview(record.to_json().encode())]
    st.put(name_of(bucket), _engine.record_key(directory), data)
    with pytest.raises(_common.ObjectStoreError) as info:
        _engine.finalize_directory(st, directory)
    assert name in str(info.value)
    if server.kind == "s3":
        assert "parts [2] were never uploaded" in str(info.value)
    assert not any(k.endswith(".safetensors") for k in list_keys(server, bucket))
    assert pending_uploads(server, bucket) == []


def name_of(bucket: str) -> str:
    return bucket.split("://")[1]


def _proxy_rule(marker: epath.Path, passed: list, method: str, path: str, headers, seen: int):
    """Process 1's proxy: once armed, lets one write through, then answers 403 to every
    write (a process failing mid-upload)."""
    if method not in ("PUT", "POST") or not marker.exists():
        return None
    passed.append(path)
    return None if len(passed) <= 1 else 403


@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_spread_save_end(s3_server, gcs_server, s3_bucket, gcs_bucket, tmp_path) -> None:
    """N=2 real processes on S3 and GCS: finalize by a fresh driver; no key left behind; a
    save failing on one process mid-upload leaves nothing a reader could follow."""
    roots = [f"{s3_bucket}/end", f"{gcs_bucket}/end"]
    servers = dict(zip(roots, (s3_server, gcs_server)))
    proxies = {
        kind: FaultProxy(
            server.endpoint_url,
            functools.partial(_proxy_rule, epath.Path(tmp_path) / f"armed-{kind}", []),
        )
        for kind, server in (("s3", s3_server), ("gs", gcs_server))
    }
    proxy_env = {
        "AWS_ENDPOINT_URL_S3": proxies["s3"].url,
        "AWS_ENDPOINT_URL": proxies["s3"].url,
        "STORAGE_EMULATOR_HOST": proxies["gs"].url,
    }
    try:
        results = run_workers(
            "objstore_spread_end_worker.py",
            2,
            args={
                "roots": roots,
                "part_size": 10 * MiB,
                "max_file_size": 12 * MiB,
                "marker_dir": str(tmp_path),
                "proxy_env": proxy_env,
            },
            env=gcs_server.child_env(s3_server.child_env()),
            timeout=540,
        )
    finally:
        for proxy in proxies.values():
            proxy.close()
    reports = [r.result["roots"] for r in results]
    for root, server in servers.items():
        primary, other = (r[root] for r in reports)
        # Fresh-driver finalize: nothing readable before it, everything after it.
        item = f"{root}/fresh/default"
        keys = list_keys(server, item)
        assert ".osf-parts/spread.json" in keys and "orbax_safetensors.json" not in keys, keys
        # The files several processes wrote were completed (S3) or composed (GCS) whole by
        # their finishers during the save: no upload is left for the finalize.
        shared = primary["fresh_committed_by_primary"]
        assert shared and set(shared) <= set(keys), (shared, keys)
        assert pending_uploads(server, root) == []
        osf.SafetensorsCheckpointHandler().finalize(epath.Path(item))  # no job held here
        keys = list_keys(server, item)
        assert not any(".osf-parts" in k or "crc32c" in k or ".draft" in k for k in keys), keys
        assert set(primary["fresh_files"]) <= set(keys) and "orbax_safetensors.json" in keys
        assert pending_uploads(server, root) == []
        first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        got = osf.restore_directory(item, fallback_sharding=first)
        for name, (shape, dtype) in STATE.items():
            want = vals.value(name, shape, dtype, 0)
            np.testing.assert_array_equal(
                np.asarray(got[name]).view(np.uint8), want.view(np.uint8), err_msg=name
            )
        # Keys: none left after either save, on any process.
        for report in (primary, other):
            assert report["fresh_keys_left"] == [] and report["fail_keys_left"] == [], report
        # The failed step: every process raised, naming process 1's failure.
        assert primary["error"] and other["error"], (primary, other)
        assert "403" in other["error"], other
        assert "process 1" in primary["error"], primary
        for report in (primary, other):
            assert report["steps"] == [0] and report["step0_ok"], report
        keys = list_keys(server, f"{root}/fail")
        assert not any(k.startswith("1/") and k.endswith(".safetensors") for k in keys), keys
        assert not any(".osf-parts" in k for k in keys), keys
        assert any(k.startswith("0/") and k.endswith(".safetensors") for k in keys), keys
        assert pending_uploads(server, root) == []
        # A process that never reached its spread part: the primary fails at once (not after
        # the 600 s wait), naming it; nothing stays, no key either.
        error = primary["abandoned_error"]
        assert error and "process 1" in error and "host copy failed" in error, primary
        assert primary["abandoned_seconds"] < 120, primary
        assert primary["abandoned_keys_left"] == other["abandoned_keys_left"] == []
        assert list_keys(server, f"{root}/abandoned") == []
        assert pending_uploads(server, root) == []
