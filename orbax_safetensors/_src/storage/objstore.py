"""Object storage (``s3://``, ``gs://``): write engines and a ranged-read engine behind
:mod:`.router`.

:mod:`orbax_safetensors._src.storage.router` stays the single entry point: it hands every
non-local path whose scheme is ``s3`` or ``gs`` to this module (``write_file``, ``ObjectReader``
for ``router.open_reader``, and the two checkpoint hooks ``prepare_directory`` /
``finalize_directory``). Orbax's rules for object storage (the commit scheme, manager options)
are :mod:`orbax_safetensors._src.orbax.object_storage`.

Clients: boto3 for S3 and google-cloud-storage for GCS, used directly (not fsspec). They speak
every request the engines need as public API (multipart upload with caller-chosen part numbers
under a shared UploadId, UploadPartCopy with a byte range, GCS compose), are thread-safe enough to
run a bounded pool of requests in flight, and let this module own retries and byte counting.
They read the same configuration as ``etils.epath`` (environment variables; for S3 also the
endpoint and keys in ``fsspec.config.conf["s3"]``).

Writes:
  * One writer holding every byte of a file (``save_file``, single-process checkpoints): the final
    object is written directly and appears whole or not at all (S3: one PUT, or a multipart
    upload of ``part_size`` parts in parallel; GCS: one upload, or parallel staged objects
    composed into the final object).
  * Several processes filling one file (multi-host checkpoints, no bytes move between hosts):
    each process uploads only its own contiguous byte ranges under the hidden prefix
    ``<dir>/.osf-parts/<file>/`` plus a small manifest; the primary's ``finalize_directory``
    joins them. GCS: ranges are staged objects, composed in offset order (<= 32 sources per call,
    in a tree). S3: one multipart upload per file, created by the primary before anyone writes
    (ids broadcast to every process with ``jax.experimental.multihost_utils``); each process
    uploads the interior of its large ranges straight into that upload as parts numbered by
    offset; its small ranges and the first and last 5 MiB of each large range go into one
    "loose" object, from which the primary builds the remaining parts (UploadPartCopy when a
    range is >= 5 MiB, download and upload otherwise) so that every part but the last is
    >= 5 MiB. See ``docs/object-storage.md``.

Reads: ``ObjectReader.read_runs`` coalesces runs whose gaps are <= ``max_gap`` (as the local
reader does), splits the result into HTTP range requests of <= ``max_request_bytes`` and runs at
most ``max_in_flight`` of them at once, streaming each body into the caller's buffers.

Every request is retried on transient failures (HTTP 5xx/429/408, timeouts, connection resets)
up to ``max_attempts`` times with exponential backoff; other failures raise ``ObjectStoreError``
at once, naming the URL and the operation.

Example::

    with router.open_reader("s3://bucket/ckpt/model.safetensors") as r:
        head = r.pread(0, 8)
    print(object_store_stats().bytes_fetched)
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.storage import interface as _interface

MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # every part of a multipart upload but the last
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000
GCS_MAX_COMPOSE = 32
STAGING_DIR = ".osf-parts"
_HEAD_PREFETCH = 64 * 1024  # first GET of a file: enough for most safetensors headers
_T = TypeVar("_T")


# --------------------------------------------------------------------------- options, stats


@dataclasses.dataclass(frozen=True)
class ObjectStoreOptions:
    """Tuning for the object-storage engines (defaults suit a real bucket and the test servers).

    Every field can also be set for a whole job through an environment variable
    ``OSF_OBJSTORE_<FIELD>`` (e.g. ``OSF_OBJSTORE_MAX_IN_FLIGHT=32``), read at first use, or in
    one process with :func:`set_object_store_options`.

    Attributes:
      max_in_flight: HTTP requests one reader or writer runs at once (its thread pool size).
      part_size: target bytes per uploaded part / staged object / copied part.
      max_request_bytes: largest ranged GET; longer coalesced reads are split.
      max_gap: reads of runs closer than this are merged into one request (the gap is read and
        dropped); object-storage requests cost far more than a few hundred KiB of transfer.
      max_attempts: tries per request (1 = no retry) on transient failures.
      backoff_initial: first retry delay in seconds; doubles per try, with jitter.
      backoff_max: longest retry delay in seconds.
      connect_timeout: seconds to open a connection.
      read_timeout: seconds without data before a request counts as failed (and is retried).
      gcs_min_object: a process's contiguous range shorter than this goes into its loose object
        instead of a staged object of its own (GCS multi-process writes).
      coordination_timeout: no longer used (the S3 upload ids now travel in a JAX collective,
        under JAX's own timeouts); kept so that existing settings still load.
    """

    max_in_flight: int = 8
    part_size: int = 64 * MiB
    max_request_bytes: int = 16 * MiB
    max_gap: int = 1 * MiB
    max_attempts: int = 5
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    gcs_min_object: int = 1 * MiB
    coordination_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("max_in_flight and max_attempts must be >= 1")
        if not 2 * S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size must be in [{2 * S3_MIN_PART}, {S3_MAX_PART}]")
        if self.max_request_bytes < 1 or self.max_gap < 0:
            raise ValueError("max_request_bytes must be >= 1 and max_gap >= 0")


def _options_from_env() -> ObjectStoreOptions:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ObjectStoreOptions):
        text = os.environ.get(f"OSF_OBJSTORE_{f.name.upper()}")
        if text is not None:
            kwargs[f.name] = float(text) if f.type == "float" else int(text)
    return ObjectStoreOptions(**kwargs)


_options: ObjectStoreOptions | None = None
_lock = threading.Lock()


def get_object_store_options() -> ObjectStoreOptions:
    """The options in force in this process."""
    global _options
    if _options is None:
        _options = _options_from_env()
    return _options


def set_object_store_options(**changes: Any) -> ObjectStoreOptions:
    """Changes object-storage options in this process; returns the previous options.

    Example::

        old = osf.set_object_store_options(max_in_flight=32, part_size=128 << 20)
    """
    global _options
    previous = get_object_store_options()
    _options = dataclasses.replace(previous, **changes)
    return previous


@dataclasses.dataclass
class ObjectStoreStats:
    """Requests and bytes this process sent to object storage (cumulative, all threads).

    ``bytes_fetched`` counts every byte requested by ranged GETs (coalesced gaps included);
    ``bytes_uploaded`` every byte sent in PUTs and parts (``put_requests`` counts both,
    ``multipart_parts`` the S3 UploadPart requests among them); ``bytes_copied`` bytes copied
    server-side (UploadPartCopy); ``bytes_reassembled`` bytes the primary downloaded again to
    build S3 parts or GCS filler objects from other processes' loose ranges.
    """

    get_requests: int = 0
    bytes_fetched: int = 0
    put_requests: int = 0
    bytes_uploaded: int = 0
    multipart_parts: int = 0
    copy_requests: int = 0
    bytes_copied: int = 0
    compose_requests: int = 0
    head_requests: int = 0
    list_requests: int = 0
    delete_requests: int = 0
    other_requests: int = 0
    retries: int = 0
    bytes_reassembled: int = 0

    @property
    def requests(self) -> int:
        """All requests sent (retries included)."""
        return (
            self.get_requests
            + self.put_requests
            + self.copy_requests
            + self.compose_requests
            + self.head_requests
            + self.list_requests
            + self.delete_requests
            + self.other_requests
        )


_stats = ObjectStoreStats()


def object_store_stats(reset: bool = False) -> ObjectStoreStats:
    """A snapshot of this process's object-storage counters; ``reset`` zeroes them after.

    Example::

        osf.object_store_stats(reset=True)
        osf.load_file("gs://bucket/w.safetensors", target=small_target)
        print(osf.object_store_stats().bytes_fetched)
    """
    global _stats
    with _lock:
        snapshot = dataclasses.replace(_stats)
        if reset:
            _stats = ObjectStoreStats()
    return snapshot


def _count(**increments: int) -> None:
    with _lock:
        for name, value in increments.items():
            setattr(_stats, name, getattr(_stats, name) + value)


# --------------------------------------------------------------------------- errors, retries


class ObjectStoreError(SafetensorsCheckpointError, OSError):
    """A request to object storage failed for good (after retries, or not retryable).

    A :class:`SafetensorsCheckpointError` and an ``OSError`` (``str``, ``args`` and ``errno``
    as for a plain ``OSError(message)``).

    Attributes:
      url: the object (or prefix) concerned.
      operation: what was attempted, e.g. ``"GET bytes 0-65535"``.
      attempts: tries made.
    """

    def __init__(self, url: str, operation: str, attempts: int, cause: BaseException) -> None:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{url}: {operation} failed{tries}: {describe_error(cause)}")
        self.url = url
        self.operation = operation
        self.attempts = attempts


def describe_error(error: BaseException) -> str:
    """``error``'s type, HTTP status when it has one, and message (cut at 300 characters)."""
    status = _status(error)
    text = str(error).strip() or type(error).__name__
    if len(text) > 300:
        text = text[:300] + "..."
    return (
        f"{type(error).__name__} (HTTP {status}): {text}"
        if status
        else f"{type(error).__name__}: {text}"
    )


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(code) if code else None
    code = getattr(error, "code", None)  # google.api_core GoogleAPICallError
    if isinstance(code, int):
        return code
    status = getattr(response, "status_code", None)
    return int(status) if isinstance(status, int) else None


_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_S3_CODES = {"RequestTimeout", "SlowDown", "InternalError", "ServiceUnavailable"}


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    status = _status(error)
    if status in _TRANSIENT_STATUS:
        return True
    response = getattr(error, "response", None)
    if isinstance(response, dict) and response.get("Error", {}).get("Code") in _TRANSIENT_S3_CODES:
        return True
    names = {cls.__name__ for cls in type(error).__mro__}
    transient_names = {
        # botocore
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "HTTPClientError",
        # requests / urllib3 / google
        "ChunkedEncodingError",
        "ProtocolError",
        "TransportError",
        "DataCorruption",
    }
    if names & transient_names:
        return True
    from_requests = type(error).__module__.startswith("requests")
    return from_requests and bool(names & {"ConnectionError", "Timeout"})


_TRACE = os.environ.get("OSF_OBJSTORE_TRACE") == "1"


def _trace(message: str) -> None:
    """One line per request on stderr when ``OSF_OBJSTORE_TRACE=1`` (debugging aid)."""
    import sys

    print(
        f"[osf-objstore {time.time():.3f} {threading.current_thread().name}] {message}",
        file=sys.stderr,
        flush=True,
    )


def _call(url: str, operation: str, fn: Callable[[], _T]) -> _T:
    """Runs ``fn`` with bounded retries on transient failures; wraps final errors."""
    options = get_object_store_options()
    attempt = 0
    while True:
        attempt += 1
        try:
            if not _TRACE:
                return fn()
            start = time.perf_counter()
            result = fn()
            _trace(f"{time.perf_counter() - start:8.3f}s {operation} {url}")
            return result
        except (FileNotFoundError, EOFError, ObjectStoreError, ImportError):
            raise
        except Exception as error:
            if _not_found(error):
                raise FileNotFoundError(f"{url}: no such object ({operation})") from error
            if not _is_transient(error) or attempt >= options.max_attempts:
                raise ObjectStoreError(url, operation, attempt, error) from error
            _count(retries=1)
            if _TRACE:
                _trace(f"retry after attempt {attempt}: {operation} {url}: {describe_error(error)}")
            delay = min(options.backoff_max, options.backoff_initial * 2 ** (attempt - 1))
            time.sleep(delay * (0.5 + random.random() / 2))


def _not_found(error: BaseException) -> bool:
    """A missing object (not a missing bucket or multipart upload)."""
    response = getattr(error, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code:
        return code in ("NoSuchKey", "404", "NotFound")
    return _status(error) == 404


# --------------------------------------------------------------------------- buffers


class _ViewsReader(io.RawIOBase):
    """A seekable, read-only file over a list of memoryviews (an upload body, no copy)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        self._starts = [0]
        for v in self._views:
            self._starts.append(self._starts[-1] + len(v))
        self._size = self._starts[-1]
        self._pos = 0
        self._i = 0  # index of the view holding byte ``_pos`` (sequential reads skip search)

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        self._i = max(0, bisect.bisect_right(self._starts, self._pos) - 1)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            while self._starts[self._i + 1] <= self._pos:
                self._i += 1
            view = self._views[self._i]
            start = self._pos - self._starts[self._i]
            n = min(len(out) - done, len(view) - start)
            out[done : done + n] = view[start : start + n]
            done += n
            self._pos += n
        return done

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes, copied once (``bytes`` of one view, or a join of several)."""
        if size is None or size < 0:
            size = self._size - self._pos
        stop = min(self._pos + size, self._size)
        chunks = []
        while self._pos < stop:
            while self._starts[self._i + 1] <= self._pos:
                self._i += 1
            start = self._pos - self._starts[self._i]
            n = min(stop - self._pos, len(self._views[self._i]) - start)
            chunks.append(self._views[self._i][start : start + n])
            self._pos += n
        return chunks[0].tobytes() if len(chunks) == 1 else b"".join(chunks)

    def readall(self) -> bytes:
        return self.read(-1)


class _ViewsWriter(io.RawIOBase):
    """A write-only file that fills a list of memoryviews in order (a download sink)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = list(views)
        self._i = 0
        self._off = 0
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        done = 0
        while done < len(src):
            if self._i >= len(self._views):
                raise EOFError("object storage returned more bytes than requested")
            view = self._views[self._i]
            n = min(len(src) - done, len(view) - self._off)
            view[self._off : self._off + n] = src[done : done + n]
            done += n
            self._off += n
            if self._off == len(view):
                self._i += 1
                self._off = 0
        self.written += done
        return done


def _slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The bytes ``[start, stop)`` of the concatenation of ``views``, as views."""
    out: list[memoryview] = []
    pos = 0
    for view in views:
        end = pos + len(view)
        if end > start and pos < stop:
            out.append(view[max(start, pos) - pos : min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


def _even_chunks(total: int, target: int) -> list[tuple[int, int]]:
    """Splits ``[0, total)`` into the fewest near-equal chunks of at most ``target`` bytes.

    Every chunk is at least ``min(total, target // 2)`` bytes long, so with ``target >= 2 * m``
    and ``total >= m`` every chunk is >= ``m`` (S3's minimum part size).
    """
    if total <= 0:
        return []
    n = max(1, -(-total // target))
    bounds = [total * k // n for k in range(n + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


# --------------------------------------------------------------------------- URL and stores


def _split_url(url: str) -> tuple[str, str, str]:
    scheme, _, rest = os.fspath(url).partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in ("s3", "gs") or not bucket:
        raise ValueError(f"not an s3:// or gs:// object URL: {url!r}")
    return scheme, bucket, key.strip("/")


def _fsspec_conf(protocol: str) -> dict[str, Any]:
    try:
        import fsspec.config
    except ImportError:  # pragma: no cover - fsspec comes with etils[epath]
        return {}
    conf = fsspec.config.conf.get(protocol)
    return dict(conf) if isinstance(conf, Mapping) else {}


def _missing_client(scheme: str, package: str, extra: str, error: ImportError) -> ImportError:
    return ImportError(
        f"{scheme}:// paths need {package}, which is not installed here ({error}); "
        f"install it with: pip install 'orbax-safetensors[{extra}]'",
        name=error.name,
    )


def _import_boto3() -> tuple[Any, Any]:
    """``(boto3, botocore.config.Config)``, or an ImportError naming the ``[s3]`` extra."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as error:
        raise _missing_client("s3", "boto3", "s3", error) from error
    return boto3, Config


def _import_gcs() -> Any:
    """``google.cloud.storage``, or an ImportError naming the ``[gcs]`` extra."""
    try:
        from google.cloud import storage
    except ImportError as error:
        raise _missing_client("gs", "google-cloud-storage", "gcs", error) from error
    return storage


class _S3:
    """S3 (or an S3-compatible server) through boto3: one thread-safe client per configuration."""

    scheme = "s3"
    _clients: dict[tuple[Any, ...], Any] = {}

    def client(self) -> Any:
        options = get_object_store_options()
        env = tuple(
            os.environ.get(k)
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
        if not (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")):
            endpoint = conf.get("endpoint_url") or client_kwargs.get("endpoint_url")
            if endpoint:
                kwargs["endpoint_url"] = endpoint
        if not os.environ.get("AWS_ACCESS_KEY_ID") and conf.get("key") and conf.get("secret"):
            kwargs["aws_access_key_id"] = conf["key"]
            kwargs["aws_secret_access_key"] = conf["secret"]
        session = boto3.session.Session()
        if session.region_name is None:
            kwargs["region_name"] = client_kwargs.get("region_name") or "us-east-1"
        client = session.client(
            "s3",
            config=Config(
                retries={"total_max_attempts": 1},  # retries are ours (_call)
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
        _count(head_requests=1)
        return int(self.client().head_object(Bucket=bucket, Key=key)["ContentLength"])

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        """Fills ``views`` with the bytes from ``start``; returns the object size if known.

        Raises EOFError when the object ends before the views are full.
        """
        n = sum(len(v) for v in views)
        _count(get_requests=1, bytes_fetched=n)
        try:
            response = self.client().get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}"
            )
        except Exception as error:
            if _status(error) == 416:
                raise EOFError(f"s3://{bucket}/{key}: no bytes at offset {start}") from None
            raise
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
        """Up to ``n`` bytes from ``start`` (fewer at the end) and the object size if known."""
        _count(get_requests=1, bytes_fetched=n)
        try:
            response = self.client().get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}"
            )
        except Exception as error:
            if _status(error) == 416:
                return b"", None
            raise
        body = response["Body"]
        try:
            data = body.read()
        finally:
            body.close()
        return data, _total_from_content_range(response.get("ContentRange"))

    # writes
    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        body = _ViewsReader(views)
        _count(put_requests=1, bytes_uploaded=len(body))
        self.client().put_object(Bucket=bucket, Key=key, Body=body, ContentLength=len(body))

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        for k in range(0, len(keys), 1000):
            batch = keys[k : k + 1000]
            _count(delete_requests=1)
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
            _count(list_requests=1)
            kwargs = {"ContinuationToken": token} if token else {}
            page = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix, **kwargs)
            for item in page.get("Contents", []):
                out[item["Key"]] = int(item["Size"])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    # multipart
    def create_upload(self, bucket: str, key: str) -> str:
        _count(other_requests=1)
        return str(self.client().create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, views: Sequence[memoryview]
    ) -> str:
        body = _ViewsReader(views)
        _count(put_requests=1, bytes_uploaded=len(body), multipart_parts=1)
        response = self.client().upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ContentLength=len(body),
        )
        return str(response["ETag"])

    def copy_part(
        self,
        bucket: str,
        key: str,
        upload_id: str,
        number: int,
        source_key: str,
        start: int,
        stop: int,
    ) -> str:
        _count(copy_requests=1, bytes_copied=stop - start)
        response = self.client().upload_part_copy(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            CopySource={"Bucket": bucket, "Key": source_key},
            CopySourceRange=f"bytes={start}-{stop - 1}",
        )
        return str(response["CopyPartResult"]["ETag"])

    def complete_upload(
        self, bucket: str, key: str, upload_id: str, parts: Sequence[tuple[int, str]]
    ) -> None:
        _count(other_requests=1)
        self.client().complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in sorted(parts)]},
        )

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> None:
        _count(other_requests=1)
        with contextlib.suppress(Exception):
            self.client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def _total_from_content_range(text: str | None) -> int | None:
    if not text or "/" not in text:
        return None
    total = text.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


class _GCS:
    """Google Cloud Storage through google-cloud-storage: one client per thread."""

    scheme = "gs"
    _local = threading.local()

    def client(self) -> Any:
        env = tuple(
            os.environ.get(k)
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

    @staticmethod
    def _timeout() -> tuple[float, float]:
        options = get_object_store_options()
        return (options.connect_timeout, options.read_timeout)

    def size(self, bucket: str, key: str) -> int:
        _count(head_requests=1)
        blob = self.client().bucket(bucket).get_blob(key, retry=None, timeout=self._timeout())
        if blob is None:
            raise FileNotFoundError(f"gs://{bucket}/{key}: no such object")
        return int(blob.size)

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        n = sum(len(v) for v in views)
        _count(get_requests=1, bytes_fetched=n)
        sink = _ViewsWriter(views)
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
            if _status(error) == 416:
                raise EOFError(f"gs://{bucket}/{key}: no bytes at offset {start}") from None
            raise
        if sink.written < n:
            raise EOFError(
                f"gs://{bucket}/{key}: needs bytes up to {start + n}, "
                f"file has {start + sink.written}"
            )
        return None

    def get_upto(self, bucket: str, key: str, start: int, n: int) -> tuple[bytes, int | None]:
        """Up to ``n`` bytes from ``start`` (fewer at the end) and the object size if known."""
        _count(get_requests=1, bytes_fetched=n)
        try:
            data = self._blob(bucket, key).download_as_bytes(
                start=start,
                end=start + n - 1,
                raw_download=True,
                checksum=None,
                retry=None,
                timeout=self._timeout(),
                single_shot_download=True,
            )
        except Exception as error:
            if _status(error) == 416:
                return b"", None
            raise
        return data, (start + len(data) if len(data) < n else None)

    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        body = _ViewsReader(views)
        _count(put_requests=1, bytes_uploaded=len(body))
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
            _count(delete_requests=1)
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
            _count(list_requests=1)
            for blob in page:
                out[blob.name] = int(blob.size)
        return out

    def compose(self, bucket: str, key: str, sources: Sequence[str]) -> None:
        if not 1 <= len(sources) <= GCS_MAX_COMPOSE:
            raise ValueError(f"compose takes 1..{GCS_MAX_COMPOSE} sources, got {len(sources)}")
        _count(compose_requests=1)
        b = self.client().bucket(bucket)
        blob = b.blob(key)
        blob.content_type = "application/octet-stream"
        blob.compose([b.blob(s) for s in sources], retry=None, timeout=self._timeout())


_STORES: dict[str, _S3 | _GCS] = {"s3": _S3(), "gs": _GCS()}


def _resolve(url: str) -> tuple[_S3 | _GCS, str, str]:
    scheme, bucket, key = _split_url(url)
    return _STORES[scheme], bucket, key


_executor: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_worker = threading.local()


def _shared_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool for object-storage requests (``max_in_flight`` threads).

    One pool bounds the requests in flight across every reader and writer of the process, and
    its long-lived threads keep their HTTP connections (and GCS clients) between calls.
    """
    global _executor
    n = get_object_store_options().max_in_flight
    with _lock:
        if _executor is None or _executor[0] != n:
            pool = concurrent.futures.ThreadPoolExecutor(
                n, thread_name_prefix="osf-objstore", initializer=_mark_worker
            )
            _executor = (n, pool)
        return _executor[1]


def _mark_worker() -> None:
    _worker.active = True


def _run_all(jobs: Sequence[Callable[[], _T]]) -> list[_T]:
    """Runs ``jobs`` on the shared pool and returns their results in order.

    Jobs started from inside a pool thread run inline (a nested fan-out must not wait for pool
    threads it occupies). The first failure is re-raised after the others were cancelled or
    finished, so no request outlives the call.
    """
    if len(jobs) <= 1 or getattr(_worker, "active", False):
        return [job() for job in jobs]
    pool = _shared_pool()
    futures = [pool.submit(job) for job in jobs]
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in futures:
        f.cancel()
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


# --------------------------------------------------------------------------- reading


class ObjectReader:
    """Random-access reads of one object through HTTP range requests.

    The reader interface ``router.open_reader`` hands out: ``size``, ``pread``, ``read_runs``, and
    the counters ``bytes_read`` (bytes requested, coalesced gaps included) and ``requests``.
    """

    def __init__(self, url: str) -> None:
        self.path = os.fspath(url)
        self._store, self._bucket, self._key = _resolve(self.path)
        self._size: int | None = None
        self._head: bytes | None = None  # the object's first bytes, once fetched
        self.bytes_read = 0
        self.requests = 0

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = _call(self.path, "HEAD", lambda: self._store.size(self._bucket, self._key))
        return self._size

    def close(self) -> None:
        """Nothing to release: requests hold no state between calls."""

    def _get(self, start: int, views: Sequence[memoryview]) -> int | None:
        n = sum(len(v) for v in views)
        return _call(
            self.path,
            f"GET bytes {start}-{start + n - 1}",
            lambda: self._store.get_into(self._bucket, self._key, start, views),
        )

    def _fetch_head(self) -> None:
        # One GET for the first 64 KiB serves the 8-byte length and, usually, the whole header;
        # S3 also reports the object size with it (Content-Range).
        self.requests += 1
        self.bytes_read += _HEAD_PREFETCH
        data, total = _call(
            self.path,
            f"GET bytes 0-{_HEAD_PREFETCH - 1}",
            lambda: self._store.get_upto(self._bucket, self._key, 0, _HEAD_PREFETCH),
        )
        self._head = data
        if total is None and len(data) < _HEAD_PREFETCH:
            total = len(data)
        if total is not None:
            self._size = total

    def pread(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` bytes at ``offset`` (fewer at the end of the object)."""
        if nbytes <= 0:
            return b""
        if self._head is None and offset < _HEAD_PREFETCH:
            self._fetch_head()
        assert self._head is not None or offset >= _HEAD_PREFETCH
        if self._head is not None and offset + nbytes <= len(self._head):
            return self._head[offset : offset + nbytes]
        nbytes = max(0, min(nbytes, self.size - offset))
        if nbytes == 0:
            return b""
        buffer = bytearray(nbytes)
        self.requests += 1
        self.bytes_read += nbytes
        self._get(offset, [memoryview(buffer)])
        return bytes(buffer)

    def read_runs(
        self,
        runs: Sequence[tuple[int, np.ndarray]],
        max_gap: int | None = None,
        on_run: Callable[[int], None] | None = None,
    ) -> None:
        """Fills each ``(offset, dest)`` with the object's bytes at ``offset`` (dest flat uint8).

        Runs closer than ``max_gap`` share a request; requests are at most
        ``max_request_bytes`` long and at most ``max_in_flight`` run at once. ``on_run(i)`` is
        called for every run once all are in place.
        """
        self._read_runs(runs, max_gap)
        if on_run is not None:
            for i in range(len(runs)):
                on_run(i)

    def _read_runs(self, runs: Sequence[tuple[int, np.ndarray]], max_gap: int | None) -> None:
        options = get_object_store_options()
        max_gap = options.max_gap if max_gap is None else max_gap
        wanted = [(o, d) for o, d in runs if d.nbytes]
        if not wanted:
            return
        end = max(o + d.nbytes for o, d in wanted)
        if self._size is not None and end > self._size:
            raise EOFError(f"{self.path}: needs bytes up to {end}, file has {self._size}")
        requests: list[tuple[int, list[memoryview]]] = []
        for start, bufs in _runs.coalesced_reads(wanted, max_gap):
            requests.extend(_split_request(start, bufs, options.max_request_bytes))
        self.requests += len(requests)
        self.bytes_read += sum(len(v) for _, views in requests for v in views)
        _run_all([functools.partial(self._get, s, v) for s, v in requests])


def _split_request(
    start: int, bufs: Sequence[memoryview], limit: int
) -> list[tuple[int, list[memoryview]]]:
    total = sum(len(b) for b in bufs)
    if total <= limit:
        return [(start, list(bufs))]
    return [(start + a, _slice_views(bufs, a, b)) for a, b in _even_chunks(total, limit)]


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass
class _Segment:
    """Contiguous bytes this process holds: ``views`` concatenated start at ``start``."""

    start: int
    views: list[memoryview]
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def slice(self, a: int, b: int) -> list[memoryview]:
        """Views of absolute file bytes ``[a, b)`` (inside this segment)."""
        return _slice_views(self.views, a - self.start, b - self.start)


def _segments(pieces: Sequence[_interface.Piece]) -> list[_Segment]:
    out: list[_Segment] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        n = int(p.data.nbytes)
        if n == 0:
            continue
        view = np.ascontiguousarray(p.data).reshape(-1).view(np.uint8).data
        if out and out[-1].end == p.offset:
            out[-1].views.append(view)
            out[-1].size += n
        elif out and out[-1].end > p.offset:
            raise ValueError(f"pieces overlap at offset {p.offset}")
        else:
            out.append(_Segment(int(p.offset), [view], n))
    return out


def _staging_prefix(key: str) -> tuple[str, str]:
    """(hidden prefix of a file's staged objects, file name) for object ``key``."""
    directory, _, name = key.rpartition("/")
    prefix = f"{directory}/{STAGING_DIR}/{name}/" if directory else f"{STAGING_DIR}/{name}/"
    return prefix, name


def s3_min_part(size: int) -> int:
    """Smallest non-last part of a file of ``size`` bytes: 5 MiB, or more for files so large
    that part numbers derived from offsets would pass 10,000."""
    return max(S3_MIN_PART, -(-size // (S3_MAX_PARTS - 1)))


def part_number(offset: int, size: int) -> int:
    """S3 part number of a part starting at ``offset``: increasing with the offset, unique as
    long as parts are >= :func:`s3_min_part` bytes, and <= 9,999."""
    return 1 + offset // s3_min_part(size)


def write_file(url: str, pieces: Sequence[_interface.Piece], size: int) -> None:
    """Writes this process's ``pieces`` of the ``size``-byte file at ``url``.

    When the pieces tile ``[0, size)`` the final object is written directly. Otherwise other
    processes hold the rest: this process uploads its ranges under the file's hidden staging
    prefix, and :func:`finalize_directory` (primary, after everyone wrote) joins them.
    """
    url = os.fspath(url)
    store, bucket, key = _resolve(url)
    segments = _segments(pieces)
    if segments and segments[-1].end > size:
        raise ValueError(f"{url}: pieces end at {segments[-1].end}, past the file size {size}")
    if size == 0 or (len(segments) == 1 and segments[0].start == 0 and segments[0].size == size):
        _write_whole(store, url, bucket, key, segments[0] if segments else _Segment(0, [], 0))
    elif segments:
        _write_ranges(store, url, bucket, key, segments, size)


def _write_whole(store: _S3 | _GCS, url: str, bucket: str, key: str, seg: _Segment) -> None:
    options = get_object_store_options()
    if seg.size <= options.part_size:
        _call(url, f"PUT {seg.size} bytes", lambda: store.put(bucket, key, seg.views))
        return
    chunks = _even_chunks(seg.size, options.part_size)
    if isinstance(store, _S3):
        upload_id = _call(url, "CreateMultipartUpload", lambda: store.create_upload(bucket, key))
        try:

            def upload(n: int, a: int, b: int) -> tuple[int, str]:
                etag = _call(
                    url,
                    f"UploadPart {n} (bytes {a}-{b - 1})",
                    lambda: store.upload_part(bucket, key, upload_id, n, seg.slice(a, b)),
                )
                return n, etag

            etags = _run_all(
                [functools.partial(upload, n, a, b) for n, (a, b) in enumerate(chunks, start=1)]
            )
            _complete(store, url, bucket, key, upload_id, etags, seg.size)
        except BaseException:
            store.abort_upload(bucket, key, upload_id)
            raise
        return
    # GCS: parallel staged objects, composed into the final object.
    prefix, _ = _staging_prefix(key)
    token = uuid.uuid4().hex[:12]
    names = [f"{prefix}w-{token}-{i:05d}" for i in range(len(chunks))]
    created: list[str] = []
    try:

        def put(name: str, a: int, b: int) -> None:
            _call(url, f"PUT part object {name}", lambda: store.put(bucket, name, seg.slice(a, b)))

        _run_all([functools.partial(put, n, a, b) for n, (a, b) in zip(names, chunks)])
        created = list(names)
        created += _compose_tree(store, url, bucket, key, names, f"{prefix}c-{token}")
    finally:
        _delete_quietly(store, bucket, names + created)


def _complete(
    store: _S3,
    url: str,
    bucket: str,
    key: str,
    upload_id: str,
    parts: Sequence[tuple[int, str]],
    size: int,
) -> None:
    def complete() -> None:
        try:
            store.complete_upload(bucket, key, upload_id, parts)
        except Exception as error:
            # A retried Complete after a lost response: the object is there already.
            response = getattr(error, "response", None)
            code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
            if code == "NoSuchUpload" and _existing_size(store, bucket, key) == size:
                return
            raise

    _call(url, f"CompleteMultipartUpload ({len(parts)} parts)", complete)


def _existing_size(store: _S3 | _GCS, bucket: str, key: str) -> int | None:
    try:
        return store.size(bucket, key)
    except Exception:
        return None


def _delete_quietly(store: _S3 | _GCS, bucket: str, keys: Sequence[str]) -> None:
    """Deletes temporary objects (with retries); a final failure leaves them behind rather
    than hiding the error that brought us here."""
    keys = list(dict.fromkeys(keys))
    if keys:
        with contextlib.suppress(Exception):
            _call(
                f"{store.scheme}://{bucket}/{keys[0]}",
                f"DELETE {len(keys)} temporary objects",
                lambda: store.delete(bucket, keys),
            )


def _compose_tree(
    store: _GCS, url: str, bucket: str, key: str, names: Sequence[str], tmp_prefix: str
) -> list[str]:
    """Composes ``names`` (in order) into ``key``, <= 32 sources per call, in a tree.

    Returns the intermediate objects created (the caller deletes them).
    """
    level = 0
    created: list[str] = []
    names = list(names)
    while len(names) > GCS_MAX_COMPOSE:
        groups = [names[i : i + GCS_MAX_COMPOSE] for i in range(0, len(names), GCS_MAX_COMPOSE)]
        targets = [f"{tmp_prefix}-{level}-{i:05d}" for i in range(len(groups))]
        created += targets

        def compose(target: str, group: list[str]) -> None:
            _call(
                url,
                f"compose {len(group)} objects into {target}",
                lambda: store.compose(bucket, target, group),
            )

        _run_all([functools.partial(compose, t, g) for t, g in zip(targets, groups)])
        names = targets
        level += 1
    _call(url, f"compose {len(names)} objects", lambda: store.compose(bucket, key, names))
    return created


# Multi-process writes ---------------------------------------------------------------------


def _write_ranges(
    store: _S3 | _GCS, url: str, bucket: str, key: str, segments: list[_Segment], size: int
) -> None:
    """Uploads this process's ranges of a file that other processes also write.

    Each range becomes one of: parts of the shared S3 multipart upload (interior of ranges
    >= 3 x the minimum part), whole staged objects (ranges >= the minimum part on S3 without a
    shared upload, >= ``gcs_min_object`` on GCS), or slices of this process's loose objects
    (everything smaller, and the 5 MiB edges around S3 direct parts). A manifest listing them
    by file offset is written last.
    """
    options = get_object_store_options()
    prefix, name = _staging_prefix(key)
    s3 = isinstance(store, _S3)
    upload_id = _upload_id_for(url) if s3 else None
    min_part = s3_min_part(size)
    target = max(options.part_size, 2 * min_part)
    sources: list[dict[str, Any]] = []
    uploads: list[Callable[[], Any]] = []
    loose: list[tuple[int, list[memoryview], int]] = []  # (file offset, views, nbytes)

    def put_job(obj: str, views: list[memoryview], what: str) -> Callable[[], None]:
        return lambda: _call(url, f"PUT {what} {obj}", lambda: store.put(bucket, obj, views))

    def part_job(record: dict[str, Any], views: list[memoryview]) -> Callable[[], None]:
        assert isinstance(store, _S3) and upload_id is not None
        number, a = record["part"], record["offset"]

        def job() -> None:
            record["etag"] = _call(
                url,
                f"UploadPart {number} (bytes {a}-{a + record['size'] - 1})",
                lambda: store.upload_part(bucket, key, upload_id, number, views),
            )

        return job

    def add_objects(seg: _Segment) -> None:
        for ca, cb in _even_chunks(seg.size, target):
            a, b = seg.start + ca, seg.start + cb
            obj = f"{prefix}o-{a:016x}-{b:016x}"
            sources.append({"offset": a, "size": b - a, "key": obj, "key_offset": 0, "whole": True})
            uploads.append(put_job(obj, seg.slice(a, b), "part object"))

    for seg in segments:
        if s3 and upload_id is not None and seg.size >= 3 * min_part:
            # Interior straight into the shared multipart upload; the edges go to the loose
            # object so the primary can always make parts >= min_part around others' bytes.
            a, b = seg.start + min_part, seg.end - min_part
            loose.append((seg.start, seg.slice(seg.start, a), min_part))
            for ca, cb in _even_chunks(b - a, target):
                record = {"offset": a + ca, "size": cb - ca, "part": part_number(a + ca, size)}
                sources.append(record)
                uploads.append(part_job(record, seg.slice(a + ca, a + cb)))
            loose.append((b, seg.slice(b, seg.end), min_part))
        elif seg.size >= (min_part if s3 else options.gcs_min_object):
            add_objects(seg)
        else:
            loose.append((seg.start, seg.views, seg.size))

    # Loose ranges: concatenated into bundle objects of <= part_size bytes.
    bundles: list[list[tuple[int, list[memoryview], int]]] = []
    total = 0
    for item in loose:
        if not bundles or total + item[2] > target:
            bundles.append([])
            total = 0
        bundles[-1].append(item)
        total += item[2]
    for items in bundles:
        obj = f"{prefix}l-{items[0][0]:016x}"
        views: list[memoryview] = []
        pos = 0
        for offset, item_views, n in items:
            sources.append({"offset": offset, "size": n, "key": obj, "key_offset": pos})
            views.extend(item_views)
            pos += n
        uploads.append(put_job(obj, views, "loose ranges"))

    _run_all(uploads)
    manifest = {
        "file": name,
        "size": size,
        "upload_id": upload_id,
        "sources": sorted(sources, key=lambda s: s["offset"]),
    }
    data = [memoryview(json.dumps(manifest).encode())]
    mkey = f"{prefix}m-{segments[0].start:016x}.json"
    _call(url, f"PUT manifest {mkey}", lambda: store.put(bucket, mkey, data))


# Before anyone writes (S3): shared upload ids -------------------------------------------


@dataclasses.dataclass
class _Uploads:
    """The multipart uploads of one checkpoint directory (S3, multi-process saves)."""

    ids: dict[str, str]  # file name -> UploadId
    created_here: bool  # by this process (the primary), which completes or aborts them


_directories: dict[str, _Uploads] = {}
_MAX_REMEMBERED = 64
_MIN_BROADCAST_BYTES = 256  # smallest padded length of _broadcast_json's bytes


def _broadcast_json(doc: Any, *, is_source: bool) -> Any:
    """``doc`` of the process where ``is_source`` is True, returned on every process.

    A collective: every process calls it at the same point of its main thread. Two calls of
    the public ``jax.experimental.multihost_utils.broadcast_one_to_all`` (same signature in
    jax 0.6 to 0.10; it sums the source's array with zeros from the others): the length of the
    JSON text, then its bytes, one per int32 (a reduction every backend has), padded to a power
    of two (few distinct shapes, so few compilations).
    """
    from jax.experimental import multihost_utils

    data = json.dumps(doc).encode() if is_source else b""
    length = multihost_utils.broadcast_one_to_all(
        np.array([len(data)], dtype=np.int32), is_source=is_source
    )
    n = int(np.asarray(length).reshape(-1)[0])
    buffer = np.zeros(max(_MIN_BROADCAST_BYTES, 1 << max(0, n - 1).bit_length()), np.int32)
    if is_source:
        buffer[:n] = np.frombuffer(data, dtype=np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buffer, is_source=is_source))
    return json.loads(out[:n].astype(np.uint8).tobytes()) if n else None


def prepare_directory(
    directory: str, files: Sequence[tuple[str, int]], *, is_primary: bool
) -> None:
    """Main-thread step of every process before a save into ``directory`` (S3 only).

    In a multi-process job the primary creates one multipart upload per file large enough to
    hold parts from several processes, and every process receives the UploadIds through
    :func:`_broadcast_json` (a JAX collective). Every process must call this for every save, in
    the same order; if the primary fails, every process raises. Does nothing on GCS.
    """
    import jax

    directory = os.fspath(directory).rstrip("/")
    if not directory.startswith("s3://"):
        return
    if jax.process_count() <= 1:
        return
    ids: dict[str, str] = {}
    failure: BaseException | None = None
    if is_primary:
        try:
            ids = _create_uploads(directory, files)
        except BaseException as error:  # every process must still reach the broadcast
            failure = error
    sent = {"uploads": ids} if failure is None else {"error": describe_error(failure)}
    try:
        doc = _broadcast_json(sent, is_source=is_primary)
    except BaseException:
        _abort_uploads(directory, ids)
        raise
    if failure is not None:
        raise failure
    if not isinstance(doc, dict) or not isinstance(doc.get("uploads"), dict):
        reason = doc.get("error") if isinstance(doc, dict) else "no process sent the upload ids"
        raise ObjectStoreError(
            directory, "starting the multipart uploads (primary)", 1, RuntimeError(reason)
        )
    _remember(directory, _Uploads(ids=dict(doc["uploads"]), created_here=is_primary))


def _create_uploads(directory: str, files: Sequence[tuple[str, int]]) -> dict[str, str]:
    """One multipart upload per file large enough for direct parts (primary); all or none."""
    store, bucket, key = _resolve(directory)
    assert isinstance(store, _S3)
    ids: dict[str, str] = {}
    try:
        for name, size in files:
            if size >= 3 * s3_min_part(size):
                obj = f"{key}/{name}" if key else name
                ids[name] = _call(
                    f"{directory}/{name}",
                    "CreateMultipartUpload",
                    functools.partial(store.create_upload, bucket, obj),
                )
    except BaseException:
        _abort_uploads(directory, ids)
        raise
    return ids


def _abort_uploads(directory: str, ids: Mapping[str, str]) -> None:
    if not ids:
        return
    store, bucket, key = _resolve(directory)
    assert isinstance(store, _S3)
    for name, upload_id in ids.items():
        store.abort_upload(bucket, f"{key}/{name}" if key else name, upload_id)


def _remember(directory: str, entry: _Uploads) -> None:
    with _lock:
        _directories.pop(directory, None)
        _directories[directory] = entry
        while len(_directories) > _MAX_REMEMBERED:
            _directories.pop(next(iter(_directories)))


def _upload_id_for(url: str) -> str | None:
    """The shared multipart upload of the file at ``url``, if :func:`prepare_directory` made one."""
    directory, _, name = url.rpartition("/")
    with _lock:
        entry = _directories.get(directory)
    return None if entry is None else entry.ids.get(name)


# Finalize (primary, after every process wrote) -------------------------------------------


def finalize_directory(directory: str) -> None:
    """Joins the ranges every process uploaded into each file of ``directory``, then deletes
    the staged objects. Run once, on the primary, after all processes finished writing."""
    directory = os.fspath(directory).rstrip("/")
    store, bucket, key = _resolve(directory)
    base = f"{key}/" if key else ""
    listing = _call(
        f"{directory}/{STAGING_DIR}/",
        "LIST parts",
        lambda: store.list(bucket, f"{base}{STAGING_DIR}/"),
    )
    with _lock:
        entry = _directories.pop(directory, None)
    if not listing and (entry is None or not entry.ids):
        return  # every file was written whole (by one process): nothing to join
    manifests: dict[str, list[dict[str, Any]]] = {}
    for obj in sorted(listing):
        rest = obj[len(f"{base}{STAGING_DIR}/") :]
        name, _, leaf = rest.rpartition("/")
        if leaf.startswith("m-") and leaf.endswith(".json"):
            data, _ = _call(
                f"{store.scheme}://{bucket}/{obj}",
                "GET manifest",
                functools.partial(store.get_upto, bucket, obj, 0, listing[obj] + 1),
            )
            manifests.setdefault(name, []).append(json.loads(data))
    created = entry.ids if entry is not None and entry.created_here else {}
    try:
        for name, docs in sorted(manifests.items()):
            url = f"{directory}/{name}"
            if isinstance(store, _S3):
                _assemble_s3(store, url, bucket, f"{base}{name}", docs)
            else:
                _assemble_gcs(store, url, bucket, f"{base}{name}", docs)
    finally:
        for name, upload_id in created.items():
            if name not in manifests and isinstance(store, _S3):  # written whole by one process
                store.abort_upload(bucket, f"{base}{name}", upload_id)
    leftovers = _call(
        f"{directory}/{STAGING_DIR}/",
        "LIST parts",
        lambda: store.list(bucket, f"{base}{STAGING_DIR}/"),
    )
    if leftovers:
        _call(
            f"{directory}/{STAGING_DIR}/",
            f"DELETE {len(leftovers)} part objects",
            lambda: store.delete(bucket, sorted(leftovers)),
        )


def _checked_sources(url: str, docs: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    sizes = {int(d["size"]) for d in docs}
    if len(sizes) != 1:
        raise ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"manifests disagree on size {sizes}")
        )
    size = sizes.pop()
    sources = sorted((s for d in docs for s in d["sources"]), key=lambda s: int(s["offset"]))
    pos = 0
    for s in sources:
        if int(s["offset"]) != pos:
            what = "missing" if int(s["offset"]) > pos else "written twice"
            raise ObjectStoreError(
                url,
                "finalize",
                1,
                RuntimeError(
                    f"bytes {min(pos, int(s['offset']))}-{max(pos, int(s['offset'])) - 1} "
                    f"are {what}: not every process uploaded its part of the file"
                ),
            )
        pos += int(s["size"])
    if pos != size:
        raise ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"bytes {pos}-{size - 1} were uploaded by no process")
        )
    return size, sources


def _fetch(
    store: _S3 | _GCS, url: str, bucket: str, ranges: Sequence[dict[str, Any]], out: memoryview
) -> None:
    """Downloads the object ranges ``ranges`` (consecutive in the file) into ``out``.

    Ranges of one object that lie close together (one process's loose ranges are stored back
    to back) share a request, as in :meth:`ObjectReader.read_runs`.
    """
    options = get_object_store_options()
    dest = np.frombuffer(out, dtype=np.uint8)
    by_object: dict[str, list[tuple[int, np.ndarray]]] = {}
    pos = 0
    for p in ranges:
        n = int(p["size"])
        by_object.setdefault(p["key"], []).append((int(p["key_offset"]), dest[pos : pos + n]))
        pos += n
    jobs: list[Callable[[], Any]] = []
    for obj, runs in by_object.items():
        for start, bufs in _runs.coalesced_reads(runs, options.max_gap):
            for s, views in _split_request(start, bufs, options.max_request_bytes):
                n = sum(len(v) for v in views)
                jobs.append(
                    functools.partial(
                        _call,
                        url,
                        f"GET {obj} bytes {s}-{s + n - 1}",
                        functools.partial(store.get_into, bucket, obj, s, views),
                    )
                )
    _count(bytes_reassembled=pos)
    _run_all(jobs)


def _cut(source: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    """The part of an object-backed ``source`` covering file bytes ``[a, b)``."""
    shift = a - int(source["offset"])
    return {
        "offset": a,
        "size": b - a,
        "key": source["key"],
        "key_offset": int(source["key_offset"]) + shift,
    }


def _assemble_gcs(store: _GCS, url: str, bucket: str, key: str, docs: list[dict[str, Any]]) -> None:
    size, sources = _checked_sources(url, docs)
    prefix, _ = _staging_prefix(key)
    names: list[str] = []
    fill_jobs: list[Callable[[], None]] = []
    run: list[dict[str, Any]] = []

    def flush() -> None:
        if not run:
            return
        ranges = list(run)
        run.clear()
        obj = f"{prefix}f-{int(ranges[0]['offset']):016x}"
        names.append(obj)

        def job() -> None:
            buffer = bytearray(sum(int(p["size"]) for p in ranges))
            _fetch(store, url, bucket, ranges, memoryview(buffer))
            _call(url, f"PUT filler {obj}", lambda: store.put(bucket, obj, [memoryview(buffer)]))

        fill_jobs.append(job)

    for s in sources:
        if s.get("whole"):
            flush()
            names.append(s["key"])
        else:
            run.append(s)
    flush()
    _run_all(fill_jobs)
    if not names:  # an empty file
        _call(url, "PUT 0 bytes", lambda: store.put(bucket, key, []))
        return
    del size
    _compose_tree(store, url, bucket, key, names, f"{prefix}c-{uuid.uuid4().hex[:12]}")


@dataclasses.dataclass
class PartRecipe:
    """How to build one S3 multipart part ``[start, stop)`` of a file: copy ``copy``
    server-side, or download ``ranges`` and upload them."""

    start: int
    stop: int
    copy: dict[str, Any] | None  # an object range to copy server-side, else download + upload
    ranges: list[dict[str, Any]]  # object ranges covering [start, stop) (for upload parts)

    @property
    def size(self) -> int:
        return self.stop - self.start


def part_recipes(
    flexible: Sequence[dict[str, Any]], is_last: bool, min_part: int, part_size: int
) -> list[PartRecipe]:
    """The multipart parts for consecutive object-backed ranges (between fixed parts).

    Every part is >= ``min_part`` bytes (except the file's last when ``is_last``) and <= about
    ``part_size``; a part inside one object range is copied server-side, others are built by
    downloading their ranges. Ranges are borrowed from big neighbours to grow small regions.
    """
    # Segments: [start, stop, copy source or None, ranges]
    segs: list[list[Any]] = []
    for s in flexible:
        a, b = int(s["offset"]), int(s["offset"]) + int(s["size"])
        if b - a >= min_part:
            segs.append([a, b, s, [s]])
        elif segs and segs[-1][2] is None:
            segs[-1][1] = b
            segs[-1][3].append(s)
        else:
            segs.append([a, b, None, [s]])
    changed = True
    while changed:
        changed = False
        for i, seg in enumerate(segs):
            small = seg[1] - seg[0] < min_part
            final = i == len(segs) - 1 and is_last
            if not small or final or len(segs) == 1:
                continue
            changed = True
            need = min_part - (seg[1] - seg[0])
            nxt = segs[i + 1] if i + 1 < len(segs) else None
            prv = segs[i - 1] if i > 0 else None
            if nxt is not None and nxt[2] is not None and nxt[1] - nxt[0] >= min_part + need:
                cut = nxt[0] + need
                seg[3].append(_cut(nxt[2], nxt[0], cut))
                seg[1] = cut
                nxt[0] = cut
                nxt[2] = _cut(nxt[2], cut, nxt[1])
                nxt[3] = [nxt[2]]
            elif prv is not None and prv[2] is not None and prv[1] - prv[0] >= min_part + need:
                cut = prv[1] - need
                seg[3].insert(0, _cut(prv[2], cut, prv[1]))
                seg[0] = cut
                prv[1] = cut
                prv[2] = _cut(prv[2], prv[0], cut)
                prv[3] = [prv[2]]
            else:  # merge with a neighbour into one downloaded segment
                j = i + 1 if nxt is not None else i - 1
                lo, hi = sorted((i, j))
                merged = [segs[lo][0], segs[hi][1], None, segs[lo][3] + segs[hi][3]]
                segs[lo : hi + 1] = [merged]
            break
    parts: list[PartRecipe] = []
    for a, b, copy, ranges in segs:
        for ca, cb in _even_chunks(b - a, part_size):
            pa, pb = a + ca, a + cb
            if copy is not None:
                parts.append(PartRecipe(pa, pb, _cut(copy, pa, pb), []))
            else:
                parts.append(PartRecipe(pa, pb, None, _ranges_between(ranges, pa, pb)))
    return parts


def _ranges_between(ranges: Sequence[dict[str, Any]], a: int, b: int) -> list[dict[str, Any]]:
    out = []
    for p in ranges:
        pa, pb = int(p["offset"]), int(p["offset"]) + int(p["size"])
        if pb > a and pa < b:
            out.append(_cut(p, max(a, pa), min(b, pb)))
    return out


def _assemble_s3(store: _S3, url: str, bucket: str, key: str, docs: list[dict[str, Any]]) -> None:
    options = get_object_store_options()
    size, sources = _checked_sources(url, docs)
    ids = {d.get("upload_id") for d in docs if d.get("upload_id")}
    if len(ids) > 1:
        raise ObjectStoreError(url, "finalize", 1, RuntimeError(f"several upload ids: {ids}"))
    upload_id = ids.pop() if ids else None
    flexible = [s for s in sources if "part" not in s]
    min_part = s3_min_part(size)
    copyable = any(int(s["size"]) >= min_part for s in flexible)
    if upload_id is None and size <= options.part_size and not copyable:
        # A small file of small ranges from several writers: one PUT of the downloaded ranges.
        buffer = bytearray(size)
        _fetch(store, url, bucket, flexible, memoryview(buffer))
        _call(url, f"PUT {size} bytes", lambda: store.put(bucket, key, [memoryview(buffer)]))
        return
    if upload_id is None:
        upload_id = _call(url, "CreateMultipartUpload", lambda: store.create_upload(bucket, key))
    try:
        done: list[tuple[int, str]] = [
            (int(s["part"]), str(s["etag"])) for s in sources if "part" in s
        ]
        recipes: list[PartRecipe] = []
        region: list[dict[str, Any]] = []
        for s in [*sources, None]:
            if s is None or "part" in s:
                if region:
                    is_last = s is None
                    recipes += part_recipes(region, is_last, min_part, options.part_size)
                    region = []
            else:
                region.append(s)
        for p in recipes[:-1]:
            if p.size < min_part:
                raise AssertionError(f"internal: planned part {p} under {min_part} bytes")
        jobs = [
            lambda p=p: _make_part(store, url, bucket, key, upload_id, p, size) for p in recipes
        ]
        done += _run_all(jobs)
        numbers = [n for n, _ in done]
        if len(set(numbers)) != len(numbers):
            raise AssertionError(f"internal: duplicate part numbers in {sorted(numbers)}")
        _complete(store, url, bucket, key, upload_id, done, size)
    except BaseException:
        store.abort_upload(bucket, key, upload_id)
        raise


def _make_part(
    store: _S3, url: str, bucket: str, key: str, upload_id: str, p: PartRecipe, size: int
) -> tuple[int, str]:
    number = part_number(p.start, size)
    if p.copy is not None:
        src = p.copy
        a = int(src["key_offset"])
        etag = _call(
            url,
            f"UploadPartCopy {number} from {src['key']} bytes {a}-{a + p.size - 1}",
            lambda: store.copy_part(bucket, key, upload_id, number, src["key"], a, a + p.size),
        )
        return number, etag
    buffer = bytearray(p.size)
    _fetch(store, url, bucket, p.ranges, memoryview(buffer))
    etag = _call(
        url,
        f"UploadPart {number} (bytes {p.start}-{p.stop - 1})",
        lambda: store.upload_part(bucket, key, upload_id, number, [memoryview(buffer)]),
    )
    return number, etag
