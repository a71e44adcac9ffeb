"""Requests to object storage: :func:`call` (bounded retries on transient failures, the final
error an :class:`ObjectStoreError`), :func:`run_all` (a batch on the process-wide pool), and
this process's counters (:func:`object_store_stats`).

Example::

    size = call(url, "HEAD", lambda: store.size(bucket, key), options)
    sizes = run_all([lambda: store.size(bucket, k) for k in keys], options.max_in_flight)
    print(object_store_stats().requests)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.storage import config as _config

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


def call(
    url: str,
    operation: str,
    fn: Callable[[], _T],
    options: _config.ObjectStoreOptions,
    *,
    trace: bool = False,
) -> _T:
    """``fn()``, tried up to ``options.max_attempts`` times on transient failures (backoff with
    jitter); a missing object raises FileNotFoundError, any other final error an
    :class:`ObjectStoreError`; ``trace`` prints each request and retry on stderr."""
    attempt = 0
    while True:
        attempt += 1
        try:
            if not trace:
                return fn()
            start = time.perf_counter()
            result = fn()
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
                _trace(f"retry after attempt {attempt}: {operation} {url}: {describe_error(error)}")
            delay = min(options.backoff_max, options.backoff_initial * 2 ** (attempt - 1))
            time.sleep(delay * (0.5 + random.random() / 2))


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


def run_all(jobs: Sequence[Callable[[], _T]], max_in_flight: int) -> list[_T]:
    """The results of ``jobs`` run on the shared pool, in order; jobs started from a pool
    thread run inline (a nested fan-out must not wait for threads it occupies). The first
    failure is raised once the others are cancelled or finished."""
    if len(jobs) <= 1 or getattr(_worker, "active", False):
        return [job() for job in jobs]
    pool = _shared_pool(max_in_flight)
    futures = [pool.submit(job) for job in jobs]
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for f in futures:
        f.cancel()
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class Configured:
    """A client's :class:`ObjectStoreOptions` and tracing, applied by :meth:`call` and
    :meth:`run_all`."""

    def __init__(
        self, options: _config.ObjectStoreOptions | None = None, trace: bool = False
    ) -> None:
        self.options = options if options is not None else _config.ObjectStoreOptions()
        self.trace = trace

    def call(self, url: str, operation: str, fn: Callable[[], _T]) -> _T:
        return call(url, operation, fn, self.options, trace=self.trace)

    def run_all(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        return run_all(jobs, self.options.max_in_flight)
