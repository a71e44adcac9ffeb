"""What every object-store provider shares: URLs, the :class:`Store` protocol of a client,
ranged reads (:class:`ObjectReader`), bytes as lists of memoryviews without copies, and the
hidden prefix of temporary objects.

Example::

    reader = ObjectReader(s3.S3Store(), "s3://bucket/ckpt/model.safetensors")
    head = reader.pread(0, 8)
    assert ViewsReader([memoryview(b"abc"), memoryview(b"de")]).read() == b"abcde"
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import io
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface

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


def missing_client(scheme: str, package: str, extra: str, error: ImportError) -> ImportError:
    """The ImportError for a missing client library, naming the ``pip install`` that brings it."""
    return ImportError(
        f"{scheme}:// paths need {package}, which is not installed here ({error}); "
        f"install it with: pip install 'orbax-safetensors[{extra}]'",
        name=error.name,
    )


class ViewsReader(io.RawIOBase):
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
        """Up to ``size`` bytes, copied once."""
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


class ViewsWriter(io.RawIOBase):
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


_T = TypeVar("_T")


class Store(Protocol):
    """The requests every provider's client answers (``S3Store``, ``GcsStore``), by bucket and
    key. Each method sends its requests once and counts them; callers retry through
    :meth:`call` (:func:`.calls.call`, as :meth:`run_all` is :func:`.calls.run_all`)."""

    scheme: str  # the URL scheme, e.g. "s3"
    options: _config.ObjectStoreOptions
    trace: bool

    def call(self, url: str, operation: str, fn: Callable[[], _T]) -> _T: ...

    def run_all(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]: ...

    def size(self, bucket: str, key: str) -> int:
        """The object's size (a not-found error when it is missing)."""
        ...

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        """Fills ``views`` with the bytes from ``start``; the object size if known; EOFError
        when the object ends first."""
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
        """Fills each ``(offset, dest)`` with the object's bytes at ``offset``, in the fewest
        ranged GETs that read at most 1.5x the bytes wanted (``runs.ranged_reads``), each at
        most ``max_request_bytes``; ``on_run(i)`` for every run once all are in place."""
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
            requests.extend(split_request(start, bufs, options.max_request_bytes))
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
