"""What every object-store provider shares: the base of its client (:class:`Store`: requests
with bounded retries on a shared pool, the final error an :class:`ObjectStoreError`), this
process's counters (:func:`object_store_stats`), URLs, ranged reads (:class:`ObjectReader`),
byte segments, and the hidden prefix of temporary objects.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface

_T = TypeVar("_T")


@dataclasses.dataclass
class ObjectStoreStats:
    """Requests and bytes this process sent to object storage (cumulative, all threads):
    ``bytes_fetched`` every byte ranged GETs asked for (gaps included), ``bytes_uploaded``
    every byte of PUTs and parts (``multipart_parts``: S3 UploadPart requests among
    ``put_requests``), ``bytes_reassembled`` other processes' bytes downloaded to build the
    windows of a save by several processes.

    Example::

        before = osf.object_store_stats()
        print(before.requests, before.bytes_uploaded)
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
    def requests(self) -> int:  # every ``*_requests`` field (retries included)
        return sum(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name.endswith("_requests")
        )


_stats = ObjectStoreStats()
_stats_lock = threading.Lock()  # guards _stats


def object_store_stats(reset: bool = False) -> ObjectStoreStats:
    """A snapshot of this process's object-storage counters; ``reset`` zeroes them after.

    Example::

        osf.object_store_stats(reset=True)
        osf.load_file("gs://bucket/w.safetensors", target=small_target)
        print(osf.object_store_stats().bytes_fetched)
    """
    global _stats
    with _stats_lock:
        snapshot = dataclasses.replace(_stats)
        if reset:
            _stats = ObjectStoreStats()
    return snapshot


def count(**increments: int) -> None:
    """Adds ``increments`` to this process's counters (thread-safe)."""
    with _stats_lock:
        for name, value in increments.items():
            setattr(_stats, name, getattr(_stats, name) + value)


class ObjectStoreError(SafetensorsCheckpointError, OSError):
    """A request to object storage failed for good (after retries, or not retryable); also an
    ``OSError`` (``str``, ``args``, ``errno`` as for ``OSError(message)``).

    Attributes:
      url: the object (or prefix) concerned.
      operation: what was attempted, e.g. ``"GET bytes 0-65535"``.
      attempts: tries made.

    Example::

        try:
            osf.load_file("s3://bucket/w.safetensors")
        except osf.ObjectStoreError as error:
            print(error.url, error.operation, error.attempts)
    """

    def __init__(self, url: str, operation: str, attempts: int, cause: BaseException) -> None:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{url}: {operation} failed{tries}: {describe_error(cause)}")
        self.url = url
        self.operation = operation
        self.attempts = attempts


def describe_error(error: BaseException) -> str:
    """``error``'s type, HTTP status when it has one, and message (cut at 300 characters)."""
    status = http_status(error)
    text = str(error).strip() or type(error).__name__
    if len(text) > 300:
        text = text[:300] + "..."
    return (
        f"{type(error).__name__} (HTTP {status}): {text}"
        if status
        else f"{type(error).__name__}: {text}"
    )


def http_status(error: BaseException) -> int | None:
    """The HTTP status a client's error carries (botocore's or google's), or None."""
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
    status = http_status(error)
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


def _trace(message: str) -> None:
    # One line per request on stderr (IOOptions(trace=True)).
    import sys

    print(
        f"[osf-objstore {time.time():.3f} {threading.current_thread().name}] {message}",
        file=sys.stderr,
        flush=True,
    )


def is_not_found(error: BaseException) -> bool:
    """A missing object (not a missing bucket or multipart upload)."""
    response = getattr(error, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code:
        return code in ("NoSuchKey", "404", "NotFound")
    return http_status(error) == 404


_executor: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_worker = threading.local()
_pool_lock = threading.Lock()  # guards _executor


def _shared_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    # One pool bounds the requests in flight across every reader and writer of the process;
    # its long-lived threads keep their HTTP connections (and GCS clients) between calls.
    global _executor
    with _pool_lock:
        if _executor is None or _executor[0] != n:
            pool = concurrent.futures.ThreadPoolExecutor(
                n, thread_name_prefix="osf-objstore", initializer=_mark_worker
            )
            _executor = (n, pool)
        return _executor[1]


def _mark_worker() -> None:
    _worker.active = True


class Store:
    """The base of a provider's client: the requests it answers by bucket and key (each sent
    once and counted), retried through :meth:`call` and fanned out by :meth:`run_all` under its
    :class:`ObjectStoreOptions` and tracing."""

    scheme: str  # the URL scheme, e.g. "s3"

    def __init__(
        self, options: _config.ObjectStoreOptions | None = None, trace: bool = False
    ) -> None:
        self.options = options if options is not None else _config.ObjectStoreOptions()
        self.trace = trace

    def call(self, url: str, operation: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, tried up to ``max_attempts`` times on transient failures (backoff with
        jitter); a missing object raises FileNotFoundError, any other final error an
        :class:`ObjectStoreError`."""
        options, trace = self.options, self.trace
        attempt = 0
        while True:
            attempt += 1
            try:
                if not trace:
                    return fn(*args)
                start = time.perf_counter()
                result = fn(*args)
                _trace(f"{time.perf_counter() - start:8.3f}s {operation} {url}")
                return result
            except (FileNotFoundError, EOFError, ObjectStoreError, ImportError):
                raise
            except Exception as error:
                if is_not_found(error):
                    raise FileNotFoundError(f"{url}: no such object ({operation})") from error
                if not _is_transient(error) or attempt >= options.max_attempts:
                    raise ObjectStoreError(url, operation, attempt, error) from error
                count(retries=1)
                if trace:
                    _trace(
                        f"retry after attempt {attempt}: {operation} {url}: {describe_error(error)}"
                    )
                delay = min(options.backoff_max, options.backoff_initial * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))

    def run_all(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        """The results of ``jobs`` run on the shared pool, in order; jobs started from a pool
        thread run inline (a nested fan-out must not wait for threads it occupies). The first
        failure is raised once the others are cancelled or finished."""
        if len(jobs) <= 1 or getattr(_worker, "active", False):
            return [job() for job in jobs]
        pool = _shared_pool(self.options.max_in_flight)
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def size(self, bucket: str, key: str) -> int:
        raise NotImplementedError

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        """Fills ``views`` with the bytes from ``start``; the object size if known; EOFError
        when the object ends first."""
        raise NotImplementedError

    def get_upto(self, bucket: str, key: str, start: int, n: int) -> tuple[bytes, int | None]:
        """Up to ``n`` bytes from ``start`` (fewer at the end) and the object size if known."""
        raise NotImplementedError

    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        raise NotImplementedError

    def list(self, bucket: str, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``, with its size."""
        raise NotImplementedError


STAGING_DIR = ".osf-parts"
_HEAD_PREFETCH = 64 * 1024  # first GET of a file: enough for most safetensors headers


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of an ``s3://`` or ``gs://`` URL (key stripped of slashes);
    ValueError for any other URL."""
    scheme, _, rest = os.fspath(url).partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in ("s3", "gs") or not bucket:
        raise ValueError(f"not an s3:// or gs:// object URL: {url!r}")
    return scheme, bucket, key.strip("/")


def split_directory(directory: str) -> tuple[str, str]:
    """``(bucket, key prefix)`` of a directory URL: the prefix ends with ``/`` unless empty."""
    _, bucket, key = split_url(directory)
    return bucket, f"{key}/" if key else ""


def missing_client(scheme: str, package: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError for a missing client library, naming the ``pip install`` that brings it."""
    return ImportError(
        f"{scheme}:// paths need {package}, which is not installed here ({error}); "
        f"install it with: pip install 'orbax-safetensors[{extra}]'",
        name=error.name,
    )


def even_chunks(total: int, target: int) -> list[tuple[int, int]]:
    """``[0, total)`` in the fewest near-equal chunks of at most ``target`` bytes, each at least
    ``min(total, target // 2)`` (so with ``target >= 2 * m`` none is under S3's minimum ``m``)."""
    if total <= 0:
        return []
    n = max(1, -(-total // target))
    bounds = [total * k // n for k in range(n + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


def split_request(
    start: int, bufs: Sequence[memoryview], limit: int
) -> list[tuple[int, list[memoryview]]]:
    """The request filling ``bufs`` from object offset ``start``, as ``(start, views)`` requests
    of at most ``limit`` bytes."""
    total = sum(len(b) for b in bufs)
    if total <= limit:
        return [(start, list(bufs))]
    return [(start + a, _buffers.slice_views(bufs, a, b)) for a, b in even_chunks(total, limit)]


@dataclasses.dataclass
class Segment:
    """Contiguous bytes this process holds: ``views`` concatenated start at ``start``."""

    start: int
    views: list[memoryview]
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def slice(self, a: int, b: int) -> list[memoryview]:
        """Views of absolute file bytes ``[a, b)`` (inside this segment)."""
        return _buffers.slice_views(self.views, a - self.start, b - self.start)


def segments_of(pieces: Sequence[_interface.Piece]) -> list[Segment]:
    """The bytes of ``pieces`` as contiguous segments in offset order; ValueError on overlap."""
    out: list[Segment] = []
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
            out.append(Segment(int(p.offset), [view], n))
    return out


class ObjectReader:
    """Random-access reads of one object through HTTP range requests (``size``, ``pread``,
    ``read_runs``; counters ``bytes_read``, gaps included, and ``requests``)."""

    def __init__(self, store: Store, url: str) -> None:
        self.path = os.fspath(url)
        self._store = store
        _, self._bucket, self._key = split_url(self.path)
        self._size: int | None = None
        self._head: bytes | None = None  # the object's first bytes, once fetched
        self.bytes_read = 0
        self.requests = 0

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = self._store.call(
                self.path, "HEAD", self._store.size, self._bucket, self._key
            )
        return self._size

    def close(self) -> None:
        pass  # requests hold no state between calls

    def _get(self, start: int, views: Sequence[memoryview]) -> int | None:
        n = sum(len(v) for v in views)
        return self._store.call(
            self.path,
            f"GET bytes {start}-{start + n - 1}",
            lambda: self._store.get_into(self._bucket, self._key, start, views),
        )

    def _fetch_head(self) -> None:
        # One GET for the first 64 KiB serves the 8-byte length and, usually, the whole header;
        # S3 also reports the object size with it (Content-Range).
        self.requests += 1
        self.bytes_read += _HEAD_PREFETCH
        data, total = self._store.call(
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
        """Fills each ``(offset, dest)`` with the object's bytes at ``offset``, in the fewest
        ranged GETs that read at most 1.5x the bytes wanted (``runs.ranged_reads``), each at
        most ``max_request_bytes``; ``on_run(i)`` for every run once all are in place."""
        options = self._store.options
        max_gap = options.max_gap if max_gap is None else max_gap
        wanted = [(o, d) for o, d in runs if d.nbytes]
        if wanted:
            end = max(o + d.nbytes for o, d in wanted)
            if self._size is not None and end > self._size:
                raise EOFError(f"{self.path}: needs bytes up to {end}, file has {self._size}")
            requests: list[tuple[int, list[memoryview]]] = []
            for start, bufs in _runs.ranged_reads(wanted, max_gap):
                requests.extend(split_request(start, bufs, options.max_request_bytes))
            self.requests += len(requests)
            self.bytes_read += sum(len(v) for _, views in requests for v in views)
            self._store.run_all([functools.partial(self._get, s, v) for s, v in requests])
        if on_run is not None:
            for i in range(len(runs)):
                on_run(i)


def staging_prefix(key: str) -> str:
    """The hidden prefix of the staged objects of the object ``key``."""
    directory, _, name = key.rpartition("/")
    return f"{directory}/{STAGING_DIR}/{name}/" if directory else f"{STAGING_DIR}/{name}/"


def existing_size(store: Store, bucket: str, key: str) -> int | None:
    """The size of the object ``key``, or None if it cannot be read (missing, or any error)."""
    try:
        return store.size(bucket, key)
    except Exception:
        return None


def delete_quietly(store: Store, bucket: str, keys: Sequence[str]) -> None:
    """Deletes temporary objects (with retries); a failure leaves them rather than hiding the
    error that brought us here."""
    keys = list(dict.fromkeys(keys))
    if keys:
        with contextlib.suppress(Exception):
            store.call(
                f"{store.scheme}://{bucket}/{keys[0]}",
                f"DELETE {len(keys)} temporary objects",
                lambda: store.delete(bucket, keys),
            )
