"""Object storage (issue 8): ``s3://`` and ``gs://`` checkpoints against real local servers.

SeaweedFS (S3) and fake-gcs-server (GCS) run on 127.0.0.1 (``tests/objstore`` fixtures). The
files are checked with the official safetensors reader after a plain client download; faults
are injected by stopping a server or through :class:`FaultProxy`, a small HTTP proxy on
127.0.0.1 in front of a server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.orbax import object_storage as _object_storage
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import s3 as _s3

try:  # tests/ without __init__.py: pytest puts tests/ itself on sys.path.
    from multihost.launcher import run_workers
    from multihost.workers import objstore_values as vals
    from objstore import servers
    from objstore.fixtures import require_object_store
except ImportError:  # tests/ is a package: the repository root is on sys.path.
    from tests.multihost.launcher import run_workers  # type: ignore[no-redef]
    from tests.multihost.workers import objstore_values as vals  # type: ignore[no-redef]
    from tests.objstore import servers  # type: ignore[no-redef]
    from tests.objstore.fixtures import require_object_store  # type: ignore[no-redef]

MiB = 1 << 20
KINDS = ["s3", "gcs"]
BF16 = np.dtype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def options() -> Iterator[Callable[..., None]]:
    """Sets object-storage options for one test (restored afterwards)."""

    # The process defaults (what set_object_store_options, deprecated, changes), so that the
    # manager and handler paths inside each test see them too.
    def change(**kw: object) -> None:
        current = _config.default_object_store_options()
        _config.reset_object_store_defaults(dataclasses.replace(current, **kw))

    yield change
    _config.reset_object_store_defaults(None)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest) -> tuple[servers.ObjectStoreServer, str]:
    """(server, fresh bucket URL) for each kind."""
    kind = request.param
    return request.getfixturevalue(f"{kind}_server"), request.getfixturevalue(f"{kind}_bucket")


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def download(server: servers.ObjectStoreServer, url: str) -> bytes:
    """The object's bytes through the vendor client (boto3 / google-cloud-storage)."""
    bucket, key = _split(url)
    if server.kind == "s3":
        return servers.s3_client(server).get_object(Bucket=bucket, Key=key)["Body"].read()
    from google.cloud import storage

    return storage.Client().bucket(bucket).blob(key).download_as_bytes()


def upload(server: servers.ObjectStoreServer, url: str, data: bytes) -> None:
    """Writes an object through the vendor client."""
    bucket, key = _split(url)
    if server.kind == "s3":
        servers.s3_client(server).put_object(Bucket=bucket, Key=key, Body=data)
        return
    from google.cloud import storage

    storage.Client().bucket(bucket).blob(key).upload_from_string(data)


def list_keys(server: servers.ObjectStoreServer, url: str) -> list[str]:
    """Every object key under ``url`` (a bucket or a prefix), relative to it."""
    bucket, prefix = _split(url)
    prefix = f"{prefix.rstrip('/')}/" if prefix else ""
    if server.kind == "s3":
        pages = servers.s3_client(server).get_paginator("list_objects_v2")
        keys = [
            o["Key"]
            for p in pages.paginate(Bucket=bucket, Prefix=prefix)
            for o in p.get("Contents", [])
        ]
    else:
        from google.cloud import storage

        keys = [b.name for b in storage.Client().list_blobs(bucket, prefix=prefix)]
    return sorted(k[len(prefix) :] for k in keys)


def pending_uploads(server: servers.ObjectStoreServer, url: str) -> list[Any]:
    if server.kind != "s3":
        return []
    bucket, _ = _split(url)
    return servers.s3_client(server).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def official_tensors(raw: bytes) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file read by the official reader (bfloat16 -> float32)."""
    import safetensors.torch  # (here: the object-store tests run where PyTorch is installed)
    import torch

    out = {}
    for name, t in safetensors.torch.load(raw).items():
        out[name] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


def as_comparable(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == BF16 else x


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to ``upstream`` unless ``rule`` says otherwise.

    ``rule(method, path, headers, seen)`` returns None (forward), an HTTP status (answer with
    it), ``"reset"`` (drop the connection with a TCP reset) or ``("stall", seconds)`` (say
    nothing for that long, then reset). ``seen`` counts earlier requests with the same method,
    path and Range header, so "fail the first attempt" rules are deterministic.
    """

    def __init__(self, upstream: str, rule: Callable[..., Any]) -> None:
        self.upstream = urllib.parse.urlparse(upstream)
        self.rule = rule
        self.seen: dict[tuple[str, str, str], int] = {}
        self.log: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        data += self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reset(self) -> None:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            def _handle(self) -> None:
                body = self._body()
                key = (self.command, self.path, self.headers.get("Range", ""))
                with proxy._lock:
                    seen = proxy.seen.get(key, 0)
                    proxy.seen[key] = seen + 1
                action = proxy.rule(
                    self.command, urllib.parse.unquote(self.path), self.headers, seen
                )
                with proxy._lock:
                    proxy.log.append((self.command, self.path, action))
                if isinstance(action, tuple) and action[0] == "stall":
                    time.sleep(action[1])
                    action = "reset"
                if action == "reset":
                    return self._reset()
                if isinstance(action, int):
                    payload = (
                        b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                        if "/storage/v1/" not in self.path
                        else json.dumps({"error": {"code": action, "message": "injected"}}).encode()
                    )
                    self.send_response(action)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return None
                try:
                    conn = http.client.HTTPConnection(
                        proxy.upstream.hostname, proxy.upstream.port, timeout=60
                    )
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("connection", "transfer-encoding", "content-length")
                    }
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    conn.close()
                except OSError:  # the server is gone: the client sees a dropped connection
                    return self._reset()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients that gave up (timeouts) or connections we reset on purpose

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def through_proxy(
    server: servers.ObjectStoreServer, rule: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> Iterator[FaultProxy]:
    """Points this library's object-storage clients (not fsspec/Orbax) at a FaultProxy."""
    proxy = FaultProxy(server.endpoint_url, rule)
    try:
        with monkeypatch.context() as m:
            if server.kind == "s3":
                m.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
                m.setenv("AWS_ENDPOINT_URL", proxy.url)
            else:
                m.setenv("STORAGE_EMULATOR_HOST", proxy.url)
            yield proxy
    finally:
        proxy.close()


def sample_tree(big_rows: int = 1024) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": rng.standard_normal((big_rows, 4096)).astype(np.float32),
            "b": jnp.arange(300, dtype=jnp.bfloat16),
            "emb": jnp.asarray(rng.integers(-5, 5, (64, 32)), jnp.int8),
        },
        "step": 7,
        "name": "run",
    }


def check_tree(got: Any, expected: dict[str, Any]) -> None:
    for leaf_got, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        if isinstance(leaf_want, (int, str)):
            assert leaf_got == leaf_want
        else:
            np.testing.assert_array_equal(as_comparable(leaf_got), as_comparable(leaf_want))


# --------------------------------------------------------------------------- S3 part planning


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=12),
    is_last=st.booleans(),
)
def test_s3_part_plan_respects_multipart_limits(sizes: list[int], is_last: bool) -> None:
    """Parts tile the region, copies stay inside one object, and every part but the file's
    last is >= the minimum part size (5 units here) and <= about part_size (12)."""
    min_part, part_size = 5, 12
    hypothesis.assume(is_last or sum(sizes) >= min_part)
    sources, pos = [], 100
    for i, n in enumerate(sizes):
        sources.append({"offset": pos, "size": n, "key": f"obj{i}", "key_offset": 3 * i})
        pos += n
    parts = _s3.part_recipes(sources, is_last, min_part, part_size)
    assert [p.start for p in parts] == [100] + [p.stop for p in parts[:-1]]
    assert parts[-1].stop == pos
    for k, part in enumerate(parts):
        assert part.size <= part_size
        if k < len(parts) - 1 or not is_last:
            assert part.size >= min_part, parts
        if part.copy is not None:
            (src,) = [s for s in sources if s["key"] == part.copy["key"]]
            shift = part.start - src["offset"]
            assert part.copy["key_offset"] == src["key_offset"] + shift >= src["key_offset"]
            assert shift + part.size <= src["size"]
        else:
            assert sum(p["size"] for p in part.ranges) == part.size
            assert part.ranges[0]["offset"] == part.start


def test_s3_part_numbers_follow_offsets() -> None:
    size = 200 * 1024 * MiB  # 200 GiB: parts must exceed 5 MiB to stay within 10,000
    min_part = _s3.s3_min_part(size)
    assert min_part > 5 * MiB
    starts = range(0, size - min_part, min_part)
    numbers = [_s3.part_number(s, size) for s in starts]
    assert numbers == sorted(set(numbers)) and numbers[0] == 1 and numbers[-1] <= 10_000


# --------------------------------------------------------------------------- single process


def test_save_file_load_file_urls(store, options) -> None:
    server, bucket = store
    options(part_size=10 * MiB)  # the 16 MiB tensor goes as parallel parts
    tree = sample_tree(big_rows=1024)
    url = f"{bucket}/models/w.safetensors"
    osf.object_store_stats(reset=True)
    osf.save_file(tree, url, metadata={"who": "test"})
    saved = osf.object_store_stats(reset=True)
    assert saved.put_requests >= 2  # multipart (S3) or staged objects + compose (GCS)
    assert list_keys(server, bucket) == ["models/w.safetensors"]  # no parts left behind
    assert pending_uploads(server, bucket) == []

    official = official_tensors(download(server, url))
    assert sorted(official) == ["params.b", "params.emb", "params.w"]
    np.testing.assert_array_equal(official["params.w"], tree["params"]["w"])
    np.testing.assert_array_equal(official["params.b"], as_comparable(tree["params"]["b"]))

    check_tree(osf.load_file(url), tree)
    assert osf.load_metadata(url)["who"] == "test"
    fetched = osf.object_store_stats(reset=True)
    file_size = len(download(server, url))
    # Header (one 64 KiB request) + the tensors: nothing is read twice.
    assert file_size <= fetched.bytes_fetched <= file_size + 2 * 64 * 1024
    assert fetched.retries == 0


def test_one_percent_of_tensors_fetches_one_percent_of_bytes(store) -> None:
    server, bucket = store
    rng = np.random.default_rng(1)
    tree = {f"t{i:03d}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(100)}
    url = f"{bucket}/many.safetensors"
    osf.save_file(tree, url)
    file_size = len(download(server, url))

    wanted = {"t042": jax.ShapeDtypeStruct((256, 256), jnp.float32)}  # 1 of 100 tensors
    osf.object_store_stats(reset=True)
    got = osf.load_file(url, target=wanted, strict=False)
    stats = osf.object_store_stats()
    np.testing.assert_array_equal(np.asarray(got["t042"]), tree["t042"])
    # 256 KiB of tensor + the 64 KiB header request, in 2 requests: about 1.25 % of the file.
    assert stats.get_requests == 2
    assert 0.01 * file_size <= stats.bytes_fetched <= 0.015 * file_size


def test_checkpoint_manager_async_max_to_keep_atomic(store) -> None:
    server, bucket = store
    root = f"{bucket}/run"
    tree = sample_tree(big_rows=64)
    options = osf.manager_options_for(root, max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in range(3):
            tree["step"] = step
            mngr.save(step, args=osf.SafetensorsSave(tree, metadata={"step": step}))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        restored = mngr.restore(2, args=osf.SafetensorsRestore())
    check_tree(restored, tree)
    keys = list_keys(server, root)
    assert "2/commit_success.txt" in keys and not any(k.startswith("0/") for k in keys)
    assert not any("/.osf-parts/" in k for k in keys)

    # A step whose files are all there but whose commit marker is not is never listed.
    for key in list_keys(server, f"{root}/2"):
        if key != "commit_success.txt":
            upload(server, f"{root}/5/{key}", download(server, f"{root}/2/{key}"))
    with ocp.CheckpointManager(root, options=options) as mngr:
        assert mngr.all_steps() == [1, 2]
        assert mngr.latest_step() == 2

    # Direct use of the same directory layout, no Orbax: restore_directory reads it.
    check_tree(osf.restore_directory(f"{root}/2/default"), tree)


def test_manager_options_for() -> None:
    s3 = osf.manager_options_for("s3://b/run", max_to_keep=3)
    assert s3.temporary_path_class is ocp.path.atomicity.CommitFileTemporaryPath
    assert s3.max_to_keep == 3
    assert osf.manager_options_for("/tmp/run").temporary_path_class is None


@pytest.mark.parametrize(
    "directory",
    [
        "s3://b/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",  # CheckpointManager
        "s3://b/run/0.orbax-checkpoint-tmp/default",  # a rename only at the step level
        "s3://b/ckpt.orbax-checkpoint-tmp",  # ocp.Checkpointer(handler).save("s3://b/ckpt")
        "s3://b/run/ckpt_3.orbax-checkpoint-tmp-1700000000/default/",  # older Orbax, a prefix
    ],
)
def test_rename_commit_on_s3_is_refused_naming_the_fix(directory: str) -> None:
    with pytest.raises(osf.SafetensorsCheckpointError, match=r"osf\.manager_options_for"):
        _object_storage.check_commit_scheme(directory)


@pytest.mark.parametrize(
    "directory",
    [
        "s3://b/run/0/default",  # CommitFileTemporaryPath (osf.manager_options_for)
        "s3://b.orbax-checkpoint-tmp/run/0/default",  # only the last two levels count
        "gs://b/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",  # gcsfs can rename
        "/tmp/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",
    ],
)
def test_commit_file_and_other_stores_pass_the_check(directory: str) -> None:
    _object_storage.check_commit_scheme(directory)


_DEFAULT_OPTIONS_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import numpy as np
    import orbax.checkpoint as ocp
    import orbax_safetensors as osf

    report = {}
    for mode, root in zip(("async", "sync"), sys.argv[1:3]):
        tree = {"w": np.arange(4 << 20, dtype=np.float32), "step": 0}  # 16 MiB: multipart
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=mode == "async")
        with ocp.CheckpointManager(root, options=options) as mngr:
            try:
                mngr.save(0, args=osf.SafetensorsSave(tree))
            except Exception as error:
                report[mode] = {
                    "raised_in_save": True,
                    "is_osf_error": isinstance(error, osf.SafetensorsCheckpointError),
                    "message": str(error),
                    "thread": threading.current_thread().name,
                }
            else:
                report[mode] = {"raised_in_save": False}
                try:
                    mngr.wait_until_finished()
                except Exception as error:
                    report[mode]["later"] = repr(error)[:500]
    report["done_at"] = time.time()
    print(json.dumps(report), flush=True)
    """
)


@pytest.mark.timeout(240)
def test_default_manager_options_on_s3_fail_in_save_naming_the_fix(s3_server, s3_bucket) -> None:
    """Orbax's default options rename the step directory at commit, which S3 cannot do: the
    save is refused inside ``mngr.save()`` (async and sync), on the caller's thread, before any
    upload, with the fix in the message; the process then exits at once (no hang)."""
    roots = [f"{s3_bucket}/async", f"{s3_bucket}/sync"]
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _DEFAULT_OPTIONS_CHILD, *roots],
        capture_output=True,
        text=True,
        env=s3_server.child_env(),
        timeout=180,
        check=False,
    )
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended - report["done_at"] < 15, f"exit took {ended - report['done_at']:.1f} s"
    assert ended - start < 150
    for mode, root in zip(("async", "sync"), roots):
        result = report[mode]
        assert result["raised_in_save"], result
        assert result["is_osf_error"] and result["thread"] == "MainThread"
        message = result["message"]
        assert "osf.manager_options_for" in message and f"manager_options_for('{root}'" in message
        # Nothing of ours was uploaded; Orbax itself may have written its step metadata file
        # into the temporary step directory before the handler ran.
        keys = list_keys(s3_server, root)
        assert set(keys) <= {"0.orbax-checkpoint-tmp/_CHECKPOINT_METADATA"}, keys
    assert pending_uploads(s3_server, s3_bucket) == []

    # The fix the message names works on the same root, and the refused attempt is not a step.
    root = roots[0]
    tree = sample_tree(big_rows=16)
    with ocp.CheckpointManager(root, options=osf.manager_options_for(root)) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(tree))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        check_tree(mngr.restore(0, args=osf.SafetensorsRestore()), tree)


_BLOCKED_IMPORT_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules[sys.argv[1]] = None  # as if the package were not installed
    import numpy as np
    import orbax_safetensors as osf

    url = sys.argv[2]
    results = []
    for call in (
        lambda: osf.load_file(url),
        lambda: osf.save_file({"w": np.zeros(4, np.float32)}, url),
    ):
        try:
            call()
            results.append(None)
        except BaseException as error:
            cause = error.__cause__
            results.append(
                {
                    "type": type(error).__name__,
                    "is_import_error": isinstance(error, ImportError),
                    "message": str(error),
                    "cause": type(cause).__name__ if cause is not None else None,
                }
            )
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize(
    ("module", "url", "extra"),
    [
        ("boto3", "s3://no-bucket/w.safetensors", "s3"),
        ("google.cloud.storage", "gs://no-bucket/w.safetensors", "gcs"),
    ],
)
def test_missing_client_library_names_the_extra(module: str, url: str, extra: str) -> None:
    """A real ImportError in a child process (the module blocked in ``sys.modules``): loads and
    saves fail with an ImportError that says which extra to install, chaining the original."""
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT_CHILD, module, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for result in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert result is not None
        assert result["is_import_error"], result
        assert f"pip install 'orbax-safetensors[{extra}]'" in result["message"], result
        assert result["cause"] in ("ImportError", "ModuleNotFoundError"), result


def test_missing_object_is_file_not_found(store) -> None:
    _, bucket = store
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        osf.load_file(f"{bucket}/nope.safetensors")


# --------------------------------------------------------------------------- failures


def test_transient_failures_are_retried(store, options, monkeypatch) -> None:
    """The first attempt of every request fails (503, a reset, or a stall past the read
    timeout); bounded retries make the save and the load succeed anyway."""
    server, bucket = store
    options(max_attempts=3, backoff_initial=0.01, read_timeout=1.0, part_size=10 * MiB)

    distinct = iter(range(1_000_000))
    bucket_name = _split(bucket)[0]

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


# --------------------------------------------------------------------------- multi-process


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_two_processes_save_and_restore_on_s3_and_gcs(
    s3_server, gcs_server, s3_bucket, gcs_bucket
) -> None:
    """N=2 processes save through an async CheckpointManager to both stores; each uploads
    only its own bytes; the files are standard safetensors files; restores onto other
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
        assert other["reassembled"] == 0
        # The primary rebuilt only the interleaved column-sharded tensor and small ranges.
        assert primary["reassembled"] < 0.1 * total * steps, primary
        if server.kind == "s3":
            assert primary["copy_requests"] > 0 and other["multipart_parts"] > 0
        else:
            assert primary["compose_requests"] >= 2 * steps


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_s3_upload_ids_reach_every_process_and_failures_are_symmetric(s3_server, s3_bucket) -> None:
    """N=2 real jax.distributed processes: the primary's multipart upload ids reach every
    process through a public JAX collective (also after ``import orbax.checkpoint.multihost``);
    when the primary cannot create them, every process raises and none hangs; a default-options
    manager save is refused in ``save()`` on every process; ``osf.manager_options_for`` works."""
    root = f"{s3_bucket}/run"
    results = run_workers(
        "objstore_handoff_worker.py",
        2,
        args={
            "bucket": s3_bucket,
            "missing_bucket": f"s3://{servers.unique_bucket_name('osf-missing')}",
            "root": root,
        },
        env=s3_server.child_env(),
        timeout=240,
    )
    reports = [r.result for r in results]
    for report in reports:
        failed = report["failed"]
        assert failed is not None and failed["type"] == "ObjectStoreError", report
        assert "NoSuchBucket" in failed["message"], failed
        default = report["default"]
        assert default is not None and default["type"] == "SafetensorsCheckpointError", report
        assert "osf.manager_options_for" in default["message"]
        assert report["restored_ok"], report
    primary, other = reports
    assert "starting the multipart uploads (primary)" in other["failed"]["message"]
    assert primary["ids"] == other["ids"] and sorted(primary["ids"]) == ["model.safetensors"]
    assert other["multipart_parts"] > 0  # parts sent straight into the primary's upload
    assert list_keys(s3_server, f"{s3_bucket}/handoff") == []
    assert not any(k.endswith(".safetensors") for k in list_keys(s3_server, f"{root}-default"))
    assert pending_uploads(s3_server, s3_bucket) == []
