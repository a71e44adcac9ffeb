"""The local object stores' fixed settings (loopback address, test credentials) and
:class:`ObjectStoreServer`, the handle of one running server; :mod:`.servers` starts them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Mapping
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
DEAD_ENDPOINT = "127.0.0.1:9"

# Variables that would override the test configuration if inherited from the caller.
S3_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
GCS_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG")


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
