"""What every object-store provider shares: URLs, the :class:`Store` protocol of a
provider's client, ranged reads (:class:`ObjectReader`), and the staged objects of
multi-process writes (their prefix, downloading their ranges, cleaning up).

Example::

    reader = ObjectReader(s3.S3Store(), "s3://bucket/ckpt/model.safetensors")
    head = reader.pread(0, 8)
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.storage.objstore import calls as _calls
from orbax_safetensors._src.storage.objstore import options as _options
from orbax_safetensors._src.storage.objstore import stats as _stats
from orbax_safetensors._src.storage.objstore import views as _views

STAGING_DIR = ".osf-parts"
_HEAD_PREFETCH = 64 * 1024  # first GET of a file: enough for most safetensors headers


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of an ``s3://`` or ``gs://`` URL (the key without slashes at
    either end); ValueError for any other URL."""
    scheme, _, rest = os.fspath(url).partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in ("s3", "gs") or not bucket:
        raise ValueError(f"not an s3:// or gs:// object URL: {url!r}")
    return scheme, bucket, key.strip("/")


def missing_client(scheme: str, package: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError to raise when a provider's client library is missing: it names the
    ``pip install 'orbax-safetensors[<extra>]'`` that brings it."""
    return ImportError(
        f"{scheme}:// paths need {package}, which is not installed here ({error}); "
        f"install it with: pip install 'orbax-safetensors[{extra}]'",
        name=error.name,
    )


_T = TypeVar("_T")


class Store(Protocol):
    """The requests every provider's client answers (``S3Store``, ``GcsStore``), given the
    bucket and key of an object. Every method sends its requests once (no retries: callers
    wrap them in :meth:`call`) and counts them in :mod:`.stats`."""

    scheme: str  # the URL scheme, e.g. "s3"
    options: _options.ObjectStoreOptions  # see .calls.Configured
    trace: bool

    def call(self, url: str, operation: str, fn: Callable[[], _T]) -> _T:
        """:func:`.calls.call` with this store's options."""
        ...

    def run_all(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        """:func:`.calls.run_all` with this store's ``max_in_flight``."""
        ...

    def size(self, bucket: str, key: str) -> int:
        """The object's size (FileNotFoundError-like client error when it is missing)."""
        ...

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        """Fills ``views`` with the bytes from ``start``; returns the object size if known.

        Raises EOFError when the object ends before the views are full.
        """
        ...

    def get_upto(self, bucket: str, key: str, start: int, n: int) -> tuple[bytes, int | None]:
        """Up to ``n`` bytes from ``start`` (fewer at the end) and the object size if known."""
        ...

    def put(self, bucket: str, key: str, views: Sequence[memoryview]) -> None:
        """Writes the object ``key`` from the concatenation of ``views``."""
        ...

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        """Deletes the objects ``keys``."""
        ...

    def list(self, bucket: str, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``, with its size."""
        ...


class ObjectReader:
    """Random-access reads of one object through HTTP range requests.

    The reader interface ``router.open_reader`` hands out: ``size``, ``pread``, ``read_runs``, and
    the counters ``bytes_read`` (bytes requested, coalesced gaps included) and ``requests``.
    """

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
                self.path, "HEAD", lambda: self._store.size(self._bucket, self._key)
            )
        return self._size

    def close(self) -> None:
        """Nothing to release: requests hold no state between calls."""

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
        """Fills each ``(offset, dest)`` with the object's bytes at ``offset`` (dest flat uint8).

        Runs share a request as far as the bytes read stay within
        ``core.runs.MAX_READ_RATIO`` x the bytes wanted (smallest gaps first, none longer than
        ``max_gap``: :func:`.runs.ranged_reads`); requests are at most
        ``max_request_bytes`` long and at most ``max_in_flight`` run at once. ``on_run(i)`` is
        called for every run once all are in place.
        """
        self._read_runs(runs, max_gap)
        if on_run is not None:
            for i in range(len(runs)):
                on_run(i)

    def _read_runs(self, runs: Sequence[tuple[int, np.ndarray]], max_gap: int | None) -> None:
        options = self._store.options
        max_gap = options.max_gap if max_gap is None else max_gap
        wanted = [(o, d) for o, d in runs if d.nbytes]
        if not wanted:
            return
        end = max(o + d.nbytes for o, d in wanted)
        if self._size is not None and end > self._size:
            raise EOFError(f"{self.path}: needs bytes up to {end}, file has {self._size}")
        requests: list[tuple[int, list[memoryview]]] = []
        for start, bufs in _runs.ranged_reads(wanted, max_gap):
            requests.extend(_views.split_request(start, bufs, options.max_request_bytes))
        self.requests += len(requests)
        self.bytes_read += sum(len(v) for _, views in requests for v in views)
        self._store.run_all([functools.partial(self._get, s, v) for s, v in requests])


def staging_prefix(key: str) -> tuple[str, str]:
    """(hidden prefix of a file's staged objects, file name) for object ``key``."""
    directory, _, name = key.rpartition("/")
    prefix = f"{directory}/{STAGING_DIR}/{name}/" if directory else f"{STAGING_DIR}/{name}/"
    return prefix, name


def existing_size(store: Store, bucket: str, key: str) -> int | None:
    """The size of the object ``key``, or None if it cannot be read (missing, or any error)."""
    try:
        return store.size(bucket, key)
    except Exception:
        return None


def delete_quietly(store: Store, bucket: str, keys: Sequence[str]) -> None:
    """Deletes temporary objects (with retries); a final failure leaves them behind rather
    than hiding the error that brought us here."""
    keys = list(dict.fromkeys(keys))
    if keys:
        with contextlib.suppress(Exception):
            store.call(
                f"{store.scheme}://{bucket}/{keys[0]}",
                f"DELETE {len(keys)} temporary objects",
                lambda: store.delete(bucket, keys),
            )


def checked_sources(url: str, docs: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The file size and the sources of the manifests ``docs`` of one file, in offset order;
    ObjectStoreError unless they agree on the size and tile it exactly."""
    sizes = {int(d["size"]) for d in docs}
    if len(sizes) != 1:
        raise _calls.ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"manifests disagree on size {sizes}")
        )
    size = sizes.pop()
    sources = sorted((s for d in docs for s in d["sources"]), key=lambda s: int(s["offset"]))
    pos = 0
    for s in sources:
        if int(s["offset"]) != pos:
            what = "missing" if int(s["offset"]) > pos else "written twice"
            raise _calls.ObjectStoreError(
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
        raise _calls.ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"bytes {pos}-{size - 1} were uploaded by no process")
        )
    return size, sources


def fetch(
    store: Store, url: str, bucket: str, ranges: Sequence[dict[str, Any]], out: memoryview
) -> None:
    """Downloads the object ranges ``ranges`` (consecutive in the file) into ``out``.

    Ranges of one object that lie close together (one process's loose ranges are stored back
    to back) share a request, as in :meth:`ObjectReader.read_runs`.
    """
    options = store.options
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
            for s, views in _views.split_request(start, bufs, options.max_request_bytes):
                n = sum(len(v) for v in views)
                jobs.append(
                    functools.partial(
                        store.call,
                        url,
                        f"GET {obj} bytes {s}-{s + n - 1}",
                        functools.partial(store.get_into, bucket, obj, s, views),
                    )
                )
    _stats.count(bytes_reassembled=pos)
    store.run_all(jobs)


def cut(source: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    """The part of an object-backed ``source`` covering file bytes ``[a, b)``."""
    shift = a - int(source["offset"])
    return {
        "offset": a,
        "size": b - a,
        "key": source["key"],
        "key_offset": int(source["key_offset"]) + shift,
    }
