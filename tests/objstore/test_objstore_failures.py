"""Object storage under faults: retries, persistent errors and timeouts, a server stopped mid-save.

Faults are injected by stopping a server or through :class:`FaultProxy`, a small HTTP proxy on
127.0.0.1 in front of a server (``tests/objstore/faultproxy.py``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf

# tests/ is on sys.path (as for tests/conftest.py).
from objstore import servers
from objstore.buckets import download, list_keys, pending_uploads, split_url
from objstore.faultproxy import through_proxy
from objstore.fixtures import KINDS, require_object_store
from objstore.trees import MiB, check_tree, official_tensors, sample_tree
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import engine as _engine
from orbax_safetensors._src.storage.objstore import gcs as _gcs

# --------------------------------------------------------------------------- failures


def test_transient_failures_are_retried(store, options, monkeypatch) -> None:
    """The first attempt of every request fails (503, a reset, or a stall past the read
    timeout); bounded retries make the save and the load succeed anyway."""
    server, bucket = store
    options(max_attempts=3, backoff_initial=0.01, read_timeout=1.0, part_size=10 * MiB)

    distinct = iter(range(1_000_000))
    bucket_name = split_url(bucket)[0]

    def rule(method: str, path: str, headers: Any, seen: int) -> Any:
        bucket_request = not path.split("?")[0].split(bucket_name, 1)[-1].startswith("/o")
        if seen or (server.kind == "gcs" and bucket_request):
            return None  # retried requests, and bucket requests the GCS client makes itself
        if method == "GET" and headers.get("Range"):
            return ("stall", 2.0)
        return (503, "reset")[next(distinct) % 2]

    tree = sample_tree(big_rows=768)  # 12 MiB: two parts
    url = f"{bucket}/flaky.safetensors"
    with through_proxy(server, rule, monkeypatch) as proxy:
        osf.object_store_stats(reset=True)
        osf.save_file(tree, url)
        got = osf.load_file(url)
        stats = osf.object_store_stats()
    check_tree(got, tree)
    assert list_keys(server, bucket) == ["flaky.safetensors"]  # temporary parts deleted
    failed = [a for _, _, a in proxy.log if a is not None]
    # One retry per injected failure (a pooled connection the proxy dropped may add one).
    assert len(failed) <= stats.retries <= len(failed) + 2 and len(failed) >= 4
    assert {503, "reset"} <= set(failed) and ("stall", 2.0) in failed
    np.testing.assert_array_equal(
        official_tensors(download(server, url))["params.w"], tree["params"]["w"]
    )


def test_persistent_5xx_fails_clearly_and_commits_nothing(store, options, monkeypatch) -> None:
    server, bucket = store
    options(max_attempts=3, backoff_initial=0.01)
    root = f"{bucket}/run"

    def rule(method: str, path: str, headers: Any, seen: int) -> Any:
        # Only this library's requests pass the proxy; Orbax's own (fsspec) go straight through.
        return 503 if method in ("PUT", "POST") else None

    tree = sample_tree(big_rows=16)
    manager_options = osf.manager_options_for(root, max_to_keep=2)
    with (
        through_proxy(server, rule, monkeypatch),
        ocp.CheckpointManager(root, options=manager_options) as mngr,
    ):
        mngr.save(0, args=osf.SafetensorsSave(tree))
        with pytest.raises(Exception) as info:
            mngr.wait_until_finished()
    text = "".join(str(e) for e in _chain(info.value))
    assert "model.safetensors" in text and "failed after 3 attempts" in text and "503" in text
    with ocp.CheckpointManager(root, options=manager_options) as mngr:
        assert mngr.all_steps() == []
        assert not any(k.endswith("commit_success.txt") for k in list_keys(server, root))
        # The same step saves cleanly once the store behaves (the stale attempt is replaced).
        mngr.save(0, args=osf.SafetensorsSave(tree))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        check_tree(mngr.restore(0, args=osf.SafetensorsRestore()), tree)
    assert pending_uploads(server, bucket) == []


def test_persistent_timeout_fails_clearly(store, options, monkeypatch) -> None:
    server, bucket = store
    url = f"{bucket}/slow.safetensors"
    osf.save_file(sample_tree(big_rows=4), url)
    options(max_attempts=2, backoff_initial=0.01, read_timeout=0.5)

    def rule(method: str, path: str, headers: Any, seen: int) -> Any:
        return ("stall", 3.0) if method == "GET" and headers.get("Range") else None

    with through_proxy(server, rule, monkeypatch), pytest.raises(osf.ObjectStoreError) as info:
        osf.load_file(url)
    message = str(info.value)
    assert "slow.safetensors" in message and "GET bytes 0-65535" in message
    assert "failed after 2 attempts" in message
    assert re.search(r"time(d )?out", message, re.IGNORECASE), message


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


@pytest.mark.parametrize("kind", KINDS)
def test_server_stopped_mid_save_raises_clear_error(kind, options, monkeypatch) -> None:
    """A dedicated server is stopped (``stop_server``) when the first tensor bytes arrive."""
    require_object_store(kind)
    options(max_attempts=3, backoff_initial=0.05, connect_timeout=2.0, part_size=10 * MiB)
    server = servers.start_server(kind)
    try:
        with servers.use_server(server):
            bucket = servers.create_bucket(server)
            stopped = threading.Event()

            def rule(method: str, path: str, headers: Any, seen: int) -> Any:
                if method in ("PUT", "POST") and not stopped.is_set():
                    servers.stop_server(server)
                    stopped.set()
                return None  # forwarding now fails: the client sees dropped connections

            url = f"{bucket}/w.safetensors"
            with through_proxy(server, rule, monkeypatch):
                start = time.monotonic()
                with pytest.raises(osf.ObjectStoreError) as info:
                    osf.save_file(sample_tree(big_rows=768), url)
                elapsed = time.monotonic() - start
    finally:
        servers.stop_server(server)
    assert stopped.is_set()
    message = str(info.value)
    assert "w.safetensors" in message and "failed after 3 attempts" in message
    assert info.value.attempts == 3 and elapsed < 30


@pytest.mark.parametrize("fail", [False, True], ids=["composed", "last-compose-fails"])
def test_a_composite_upload_leaves_no_staged_object(
    gcs_server, gcs_bucket, options, monkeypatch, fail
):
    """A GCS parallel composite upload of 40 staged objects composes them in a tree (32
    sources per compose at most): the object is the bytes; and when the last compose fails for
    good, every object it staged is deleted, the tree's intermediate composites too."""
    options(max_attempts=2, backoff_initial=0.01)
    bucket, prefix = split_url(gcs_bucket)
    key = f"{prefix}/big.bin".lstrip("/")
    data = np.random.default_rng(0).integers(0, 256, 40 * 1000, dtype=np.uint8).tobytes()
    chunks = [(a, a + 1000) for a in range(0, len(data), 1000)]
    seg = _common.Segment(0, [memoryview(data)], len(data))

    def rule(method: str, path: str, headers: Any, seen: int) -> Any:
        final = path.split("?")[0].endswith("/o/" + key.replace("/", "%2F") + "/compose")
        return 503 if fail and final else None

    refused = pytest.raises(_common.ObjectStoreError, match="compose 2 objects into")
    with (
        through_proxy(gcs_server, rule, monkeypatch),
        refused if fail else contextlib.nullcontext(),
    ):
        st = _engine.store_for(f"gs://{bucket}", _config.resolve(None))
        _gcs.write_composed(st, f"gs://{bucket}/{key}", bucket, key, seg, chunks)
    if fail:
        assert list_keys(gcs_server, gcs_bucket) == []
    else:
        assert list_keys(gcs_server, gcs_bucket) == ["big.bin"]
        assert download(gcs_server, f"{gcs_bucket}/big.bin") == data
