"""Local S3 and GCS object stores for tests (SeaweedFS and fake-gcs-server on 127.0.0.1).

``servers`` starts and stops them and configures clients; ``fixtures`` wraps that in pytest
fixtures (``s3_server``, ``gcs_server``, ``s3_bucket``, ``gcs_bucket``, ``store``, ``options``).
``servers`` builds on ``model`` (settings, the server handle), ``processes`` (spawning and
stopping) and ``launch`` (binaries, one start of each server). The tests' own helpers:
``buckets`` (plain-client access), ``trees`` (the sample tree and its comparison) and
``faultproxy`` (fault injection).
"""

from .servers import (
    ObjectStoreServer,
    ObjectStoreStartError,
    ObjectStoreUnavailableError,
    configure_fsspec,
    create_bucket,
    delete_bucket,
    missing_requirements,
    s3_client,
    start_server,
    stop_server,
    unique_bucket_name,
    use_server,
)

__all__ = [
    "ObjectStoreServer",
    "ObjectStoreStartError",
    "ObjectStoreUnavailableError",
    "configure_fsspec",
    "create_bucket",
    "delete_bucket",
    "missing_requirements",
    "s3_client",
    "start_server",
    "stop_server",
    "unique_bucket_name",
    "use_server",
]
