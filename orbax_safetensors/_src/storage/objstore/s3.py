"""Amazon S3 (and S3-compatible servers) through boto3: the client (:class:`S3Store`) and
multipart uploads (:func:`write_multipart`, :func:`complete`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import common as _common

S3_MAX_PARTS = 10_000
_lock = threading.Lock()  # guards S3Store._clients


def _fsspec_conf(protocol: str) -> dict[str, Any]:
    try:
        import fsspec.config
    except ImportError:  # pragma: no cover - fsspec comes with etils[epath]
        return {}
    conf = fsspec.config.conf.get(protocol)
    return dict(conf) if isinstance(conf, Mapping) else {}


def _import_boto3() -> tuple[Any, Any]:
    # (boto3, botocore.config.Config), or an ImportError naming the [s3] extra.
    try:
        import boto3
        from botocore.config import Config
    except ImportError as error:
        raise _common.missing_client("s3", "boto3", "s3", error) from error
    return boto3, Config


class S3Store(_common.Store):
    """S3 (or an S3-compatible server) through boto3: one thread-safe client per configuration."""

    scheme = "s3"
    _clients: dict[tuple[Any, ...], Any] = {}

    def client(self) -> Any:
        options = self.options
        env = tuple(
            _config.env_var(k)
            for k in (
                "AWS_ENDPOINT_URL_S3",
                "AWS_ENDPOINT_URL",
                "AWS_ACCESS_KEY_ID",
                "AWS_DEFAULT_REGION",
                "AWS_REGION",
                "AWS_PROFILE",
            )
        )
        conf = _fsspec_conf("s3")
        key = (env, json.dumps(conf, sort_keys=True, default=str), options)
        with _lock:
            client = self._clients.get(key)
        if client is not None:
            return client
        boto3, Config = _import_boto3()

        kwargs: dict[str, Any] = {}
        client_kwargs = conf.get("client_kwargs") or {}
        if not (_config.env_var("AWS_ENDPOINT_URL_S3") or _config.env_var("AWS_ENDPOINT_URL")):
            endpoint = conf.get("endpoint_url") or client_kwargs.get("endpoint_url")
            if endpoint:
                kwargs["endpoint_url"] = endpoint
        if not _config.env_var("AWS_ACCESS_KEY_ID") and conf.get("key") and conf.get("secret"):
            kwargs["aws_access_key_id"] = conf["key"]
            kwargs["aws_secret_access_key"] = conf["secret"]
        session = boto3.session.Session()
        if session.region_name is None:
            kwargs["region_name"] = client_kwargs.get("region_name") or "us-east-1"
        client = session.client(
            "s3",
            config=Config(
                retries={"total_max_attempts": 1},  # retries are ours (calls.call)
                connect_timeout=options.connect_timeout,
                read_timeout=options.read_timeout,
                max_pool_connections=options.max_in_flight * 2 + 2,
            ),
            **kwargs,
        )
        with _lock:
            self._clients[key] = client
        return client

    # reads
    def size(self, bucket: str, key: str) -> int:
        _common.count(head_requests=1)
        return int(self.client().head_object(Bucket=bucket, Key=key)["ContentLength"])

    def _get_range(self, bucket: str, key: str, start: int, n: int) -> Any:
        # The GetObject response for up to n bytes from start (its Body not read yet); None if
        # the object has no byte at start.
        _common.count(get_requests=1, bytes_fetched=n)
        try:
            return self.client().get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}"
            )
        except Exception as error:
            if _common.http_status(error) == 416:
                return None
            raise

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        n = sum(len(v) for v in views)
        response = self._get_range(bucket, key, start, n)
        if response is None:
            raise EOFError(f"s3://{bucket}/{key}: no bytes at offset {start}")
        total = _total_from_content_range(response.get("ContentRange"))
        body = response["Body"]
        try:
            got = 0
            for view in views:
                off = 0
                while off < len(view):
                    k = body.readinto(view[off:])
                    if not k:
                        raise EOFError(
                            f"s3://{bucket}/{key}: needs bytes up to {start + n}, "
                            f"file has {total if total is not None else start + got}"
                        )
                    off += k
                    got += k
        finally:
            body.close()
        return total

    def get_upto(self, bucket: str, key: str, start: int, n: int) -> tuple[bytes, int | None]:
        response = self._get_range(bucket, key, start, n)
        if response is None:
            return b"", None
        body = response["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        return data, _total_from_content_range(response.get("ContentRange"))

    # writes
    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        body = _buffers.ViewsReader(views)
        _common.count(put_requests=1, bytes_uploaded=len(body))
        self.client().put_object(Bucket=bucket, Key=key, Body=body, ContentLength=len(body))

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        for k in range(0, len(keys), 1000):
            batch = keys[k : k + 1000]
            _common.count(delete_requests=1)
            response = self.client().delete_objects(
                Bucket=bucket, Delete={"Objects": [{"Key": x} for x in batch], "Quiet": True}
            )
            errors = response.get("Errors") or []
            if errors:
                raise RuntimeError(f"could not delete {len(errors)} objects, e.g. {errors[0]}")

    def list(self, bucket: str, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        token: str | None = None
        while True:
            _common.count(list_requests=1)
            kwargs = {"ContinuationToken": token} if token else {}
            page = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix, **kwargs)
            for item in page.get("Contents", []):
                out[item["Key"]] = int(item["Size"])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    # multipart
    def create_upload(self, bucket: str, key: str) -> str:
        _common.count(other_requests=1)
        return str(self.client().create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, views: Sequence[memoryview]
    ) -> str:
        body = _buffers.ViewsReader(views)
        _common.count(put_requests=1, bytes_uploaded=len(body), multipart_parts=1)
        response = self.client().upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ContentLength=len(body),
        )
        return str(response["ETag"])

    def complete_upload(
        self, bucket: str, key: str, upload_id: str, parts: Sequence[tuple[int, str]]
    ) -> None:
        _common.count(other_requests=1)
        self.client().complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in sorted(parts)]},
        )

    def list_parts(self, bucket: str, key: str, upload_id: str) -> builtins.list[tuple[int, str]]:
        """``(part number, ETag)`` of every part uploaded so far (one request per 1,000)."""
        out: builtins.list[tuple[int, str]] = []
        marker = 0
        while True:
            _common.count(list_requests=1)
            page = self.client().list_parts(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
            )
            out += [(int(p["PartNumber"]), str(p["ETag"])) for p in page.get("Parts", [])]
            if not page.get("IsTruncated"):
                return out
            marker = int(page["NextPartNumberMarker"])

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> None:
        _common.count(other_requests=1)
        with contextlib.suppress(Exception):
            self.client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def _total_from_content_range(text: str | None) -> int | None:
    if not text or "/" not in text:
        return None
    total = text.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def write_multipart(
    store: S3Store,
    url: str,
    bucket: str,
    key: str,
    seg: _common.Segment,
    chunks: Sequence[tuple[int, int]],
) -> None:
    """Writes the object ``key`` from ``seg`` as a multipart upload, one part per chunk (in
    parallel), aborted if any request fails."""
    upload_id = store.call(url, "CreateMultipartUpload", store.create_upload, bucket, key)
    try:

        def upload(n: int, a: int, b: int) -> tuple[int, str]:
            etag = store.call(
                url,
                f"UploadPart {n} (bytes {a}-{b - 1})",
                lambda: store.upload_part(bucket, key, upload_id, n, seg.slice(a, b)),
            )
            return n, etag

        etags = store.run_all(
            [functools.partial(upload, n, a, b) for n, (a, b) in enumerate(chunks, start=1)]
        )
        complete(store, url, bucket, key, upload_id, etags, seg.size)
    except BaseException:
        store.abort_upload(bucket, key, upload_id)
        raise


def complete(
    store: S3Store,
    url: str,
    bucket: str,
    key: str,
    upload_id: str,
    parts: Sequence[tuple[int, str]],
    size: int,
) -> None:
    """Completes the multipart upload ``upload_id`` of ``key`` from ``parts`` (number, ETag)."""

    def request() -> None:
        try:
            store.complete_upload(bucket, key, upload_id, parts)
        except Exception as error:
            # A retried Complete after a lost response: the object is there already.
            response = getattr(error, "response", None)
            code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
            if code == "NoSuchUpload" and _common.existing_size(store, bucket, key) == size:
                return
            raise

    store.call(url, f"CompleteMultipartUpload ({len(parts)} parts)", request)
