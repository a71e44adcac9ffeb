"""Google Cloud Storage through google-cloud-storage: the client (:class:`GcsStore`) and
parallel composite uploads (:func:`write_composed`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import common as _common

GCS_MAX_COMPOSE = 32


def _import_gcs() -> Any:
    # google.cloud.storage, or an ImportError naming the [gcs] extra.
    try:
        from google.cloud import storage
    except ImportError as error:
        raise _common.missing_client("gs", "google-cloud-storage", "gcs", error) from error
    return storage


class GcsStore(_common.Store):
    """Google Cloud Storage through google-cloud-storage: one client per thread."""

    scheme = "gs"
    _local = threading.local()

    def client(self) -> Any:
        env = tuple(
            _config.env_var(k)
            for k in (
                "STORAGE_EMULATOR_HOST",
                "GOOGLE_CLOUD_PROJECT",
                "GOOGLE_APPLICATION_CREDENTIALS",
            )
        )
        cached = getattr(self._local, "client", None)
        if cached is not None and cached[0] == env:
            return cached[1]
        storage = _import_gcs()
        client = storage.Client()
        # google-cloud-storage >= 3.15 fetches every bucket's metadata in a background thread
        # per client, for tracing attributes only: an extra request per thread and bucket.
        if getattr(client, "_bucket_metadata_cache", None) is not None:
            client._bucket_metadata_cache = None
        self._local.client = (env, client)
        return client

    def _blob(self, bucket: str, key: str) -> Any:
        return self.client().bucket(bucket).blob(key)

    def _timeout(self) -> tuple[float, float]:
        options = self.options
        return (options.connect_timeout, options.read_timeout)

    def size(self, bucket: str, key: str) -> int:
        _common.count(head_requests=1)
        blob = self.client().bucket(bucket).get_blob(key, retry=None, timeout=self._timeout())
        if blob is None:
            raise FileNotFoundError(f"gs://{bucket}/{key}: no such object")
        return int(blob.size)

    def _download(self, bucket: str, key: str, start: int, n: int, sink: Any) -> bool:
        # Streams up to n bytes from start into the file sink (one GET, without the client's
        # own retries and checksums); False if the object has no byte at start.
        _common.count(get_requests=1, bytes_fetched=n)
        try:
            self._blob(bucket, key).download_to_file(
                sink,
                start=start,
                end=start + n - 1,
                raw_download=True,
                checksum=None,
                retry=None,
                timeout=self._timeout(),
                single_shot_download=True,
            )
        except Exception as error:
            if _common.http_status(error) == 416:
                return False
            raise
        return True

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        n = sum(len(v) for v in views)
        sink = _buffers.ViewsWriter(views)
        if not self._download(bucket, key, start, n, sink):
            raise EOFError(f"gs://{bucket}/{key}: no bytes at offset {start}")
        if sink.written < n:
            raise EOFError(
                f"gs://{bucket}/{key}: needs bytes up to {start + n}, "
                f"file has {start + sink.written}"
            )
        return None

    def get_upto(self, bucket: str, key: str, start: int, n: int) -> tuple[bytes, int | None]:
        sink = io.BytesIO()
        if not self._download(bucket, key, start, n, sink):
            return b"", None
        data = sink.getvalue()
        return data, (start + len(data) if len(data) < n else None)

    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        body = _buffers.ViewsReader(views)
        _common.count(put_requests=1, bytes_uploaded=len(body))
        self._blob(bucket, key).upload_from_file(
            body,
            size=len(body),
            content_type="application/octet-stream",
            checksum="crc32c",
            retry=None,
            timeout=self._timeout(),
        )

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        from google.api_core import exceptions

        for key in keys:
            _common.count(delete_requests=1)
            with contextlib.suppress(exceptions.NotFound):
                self._blob(bucket, key).delete(retry=None, timeout=self._timeout())

    def list(self, bucket: str, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        pages = (
            self.client()
            .list_blobs(bucket, prefix=prefix, retry=None, timeout=self._timeout())
            .pages
        )
        for page in pages:
            _common.count(list_requests=1)
            for blob in page:
                out[blob.name] = int(blob.size)
        return out

    def compose(self, bucket: str, key: str, sources: Sequence[str]) -> None:
        if not 1 <= len(sources) <= GCS_MAX_COMPOSE:
            raise ValueError(f"compose takes 1..{GCS_MAX_COMPOSE} sources, got {len(sources)}")
        _common.count(compose_requests=1)
        b = self.client().bucket(bucket)
        blob = b.blob(key)
        blob.content_type = "application/octet-stream"
        blob.compose([b.blob(s) for s in sources], retry=None, timeout=self._timeout())


def write_composed(
    store: GcsStore,
    url: str,
    bucket: str,
    key: str,
    seg: _common.Segment,
    chunks: Sequence[tuple[int, int]],
) -> None:
    """Writes the object ``key`` from ``seg``: one staged object per chunk (in parallel),
    composed into ``key`` (32 sources per call at most, in a tree), then deleted."""
    prefix = _common.staging_prefix(key)
    token = uuid.uuid4().hex[:12]
    names = [f"{prefix}w-{token}-{i:05d}" for i in range(len(chunks))]
    doomed = list(names)
    try:

        def put(name: str, a: int, b: int) -> None:
            store.call(url, f"PUT part object {name}", store.put, bucket, name, seg.slice(a, b))

        store.run_all([functools.partial(put, n, a, b) for n, (a, b) in zip(names, chunks)])
        level = 0
        while len(names) > GCS_MAX_COMPOSE:
            groups = [names[i : i + GCS_MAX_COMPOSE] for i in range(0, len(names), GCS_MAX_COMPOSE)]
            names = [f"{prefix}c-{token}-{level}-{i:05d}" for i in range(len(groups))]
            doomed += names  # the tree's intermediate composites: deleted whatever happens next
            compose = functools.partial(compose_into, store, url, bucket)
            store.run_all([functools.partial(compose, t, g) for t, g in zip(names, groups)])
            level += 1
        compose_into(store, url, bucket, key, names)
    finally:
        _common.delete_quietly(store, bucket, doomed)


def compose_into(store: GcsStore, url: str, bucket: str, target: str, sources: list[str]) -> None:
    """Composes the objects ``sources`` (in order) into ``target``: one request, retried."""
    store.call(
        url, f"compose {len(sources)} objects into {target}", store.compose, bucket, target, sources
    )
