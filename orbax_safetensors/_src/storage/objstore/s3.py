"""Amazon S3 (and S3-compatible servers) through boto3: the client (:class:`S3Store`),
multipart uploads, and the joining of several processes' ranges into one object
(:func:`assemble`). The upload ids every process of a save shares: :mod:`.s3_uploads`.

Example::

    store = S3Store()
    write_multipart(store, url, bucket, key, segment, chunks)
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import calls as _calls
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import options as _options
from orbax_safetensors._src.storage.objstore import stats as _stats
from orbax_safetensors._src.storage.objstore import views as _views

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
    """``(boto3, botocore.config.Config)``, or an ImportError naming the ``[s3]`` extra."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as error:
        raise _common.missing_client("s3", "boto3", "s3", error) from error
    return boto3, Config


class S3Store(_calls.Configured):
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
        _stats.count(head_requests=1)
        return int(self.client().head_object(Bucket=bucket, Key=key)["ContentLength"])

    def _get_range(self, bucket: str, key: str, start: int, n: int) -> Any:
        """The GetObject response for up to ``n`` bytes from ``start`` (its ``Body`` not read
        yet); None if the object has no byte at ``start``."""
        _stats.count(get_requests=1, bytes_fetched=n)
        try:
            return self.client().get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{start + n - 1}"
            )
        except Exception as error:
            if _calls.http_status(error) == 416:
                return None
            raise

    def get_into(
        self, bucket: str, key: str, start: int, views: Sequence[memoryview]
    ) -> int | None:
        """Fills ``views`` with the bytes from ``start``; returns the object size if known.

        Raises EOFError when the object ends before the views are full.
        """
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
        """Up to ``n`` bytes from ``start`` (fewer at the end) and the object size if known."""
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
        body = _views.ViewsReader(views)
        _stats.count(put_requests=1, bytes_uploaded=len(body))
        self.client().put_object(Bucket=bucket, Key=key, Body=body, ContentLength=len(body))

    def delete(self, bucket: str, keys: Sequence[str]) -> None:
        for k in range(0, len(keys), 1000):
            batch = keys[k : k + 1000]
            _stats.count(delete_requests=1)
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
            _stats.count(list_requests=1)
            kwargs = {"ContinuationToken": token} if token else {}
            page = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix, **kwargs)
            for item in page.get("Contents", []):
                out[item["Key"]] = int(item["Size"])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    # multipart
    def create_upload(self, bucket: str, key: str) -> str:
        _stats.count(other_requests=1)
        return str(self.client().create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])

    def upload_part(
        self, bucket: str, key: str, upload_id: str, number: int, views: Sequence[memoryview]
    ) -> str:
        body = _views.ViewsReader(views)
        _stats.count(put_requests=1, bytes_uploaded=len(body), multipart_parts=1)
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
        _stats.count(copy_requests=1, bytes_copied=stop - start)
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
        _stats.count(other_requests=1)
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
            _stats.count(list_requests=1)
            page = self.client().list_parts(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
            )
            out += [(int(p["PartNumber"]), str(p["ETag"])) for p in page.get("Parts", [])]
            if not page.get("IsTruncated"):
                return out
            marker = int(page["NextPartNumberMarker"])

    def abort_upload(self, bucket: str, key: str, upload_id: str) -> None:
        _stats.count(other_requests=1)
        with contextlib.suppress(Exception):
            self.client().abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def _total_from_content_range(text: str | None) -> int | None:
    if not text or "/" not in text:
        return None
    total = text.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def s3_min_part(size: int) -> int:
    """Smallest non-last part of a file of ``size`` bytes: 5 MiB, or more for files so large
    that part numbers derived from offsets would pass 10,000."""
    return max(_options.S3_MIN_PART, -(-size // (S3_MAX_PARTS - 1)))


def part_number(offset: int, size: int) -> int:
    """S3 part number of a part starting at ``offset``: increasing with the offset, unique as
    long as parts are >= :func:`s3_min_part` bytes, and <= 9,999."""
    return 1 + offset // s3_min_part(size)


def write_multipart(
    store: S3Store,
    url: str,
    bucket: str,
    key: str,
    seg: _views.Segment,
    chunks: Sequence[tuple[int, int]],
) -> None:
    """Writes the whole object ``key`` from ``seg`` as a multipart upload, one part per chunk
    (in parallel); the upload is aborted if any request fails."""
    upload_id = store.call(url, "CreateMultipartUpload", lambda: store.create_upload(bucket, key))
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
                seg[3].append(_common.cut(nxt[2], nxt[0], cut))
                seg[1] = cut
                nxt[0] = cut
                nxt[2] = _common.cut(nxt[2], cut, nxt[1])
                nxt[3] = [nxt[2]]
            elif prv is not None and prv[2] is not None and prv[1] - prv[0] >= min_part + need:
                cut = prv[1] - need
                seg[3].insert(0, _common.cut(prv[2], cut, prv[1]))
                seg[0] = cut
                prv[1] = cut
                prv[2] = _common.cut(prv[2], prv[0], cut)
                prv[3] = [prv[2]]
            else:  # merge with a neighbour into one downloaded segment
                j = i + 1 if nxt is not None else i - 1
                lo, hi = sorted((i, j))
                merged = [segs[lo][0], segs[hi][1], None, segs[lo][3] + segs[hi][3]]
                segs[lo : hi + 1] = [merged]
            break
    parts: list[PartRecipe] = []
    for a, b, copy, ranges in segs:
        for ca, cb in _views.even_chunks(b - a, part_size):
            pa, pb = a + ca, a + cb
            if copy is not None:
                parts.append(PartRecipe(pa, pb, _common.cut(copy, pa, pb), []))
            else:
                parts.append(PartRecipe(pa, pb, None, _ranges_between(ranges, pa, pb)))
    return parts


def _ranges_between(ranges: Sequence[dict[str, Any]], a: int, b: int) -> list[dict[str, Any]]:
    out = []
    for p in ranges:
        pa, pb = int(p["offset"]), int(p["offset"]) + int(p["size"])
        if pb > a and pa < b:
            out.append(_common.cut(p, max(a, pa), min(b, pb)))
    return out


def assemble(store: S3Store, url: str, bucket: str, key: str, docs: list[dict[str, Any]]) -> None:
    """Joins the ranges the manifests ``docs`` list into the object ``key``: completes the
    shared multipart upload with parts built from the staged objects (or makes a new upload, or
    one PUT for a small file)."""
    options = store.options
    size, sources = _common.checked_sources(url, docs)
    ids = {d.get("upload_id") for d in docs if d.get("upload_id")}
    if len(ids) > 1:
        raise _calls.ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"several upload ids: {ids}")
        )
    upload_id = ids.pop() if ids else None
    flexible = [s for s in sources if "part" not in s]
    min_part = s3_min_part(size)
    copyable = any(int(s["size"]) >= min_part for s in flexible)
    if upload_id is None and size <= options.part_size and not copyable:
        # A small file of small ranges from several writers: one PUT of the downloaded ranges.
        buffer = bytearray(size)
        _common.fetch(store, url, bucket, flexible, memoryview(buffer))
        store.call(url, f"PUT {size} bytes", lambda: store.put(bucket, key, [memoryview(buffer)]))
        return
    if upload_id is None:
        upload_id = store.call(
            url, "CreateMultipartUpload", lambda: store.create_upload(bucket, key)
        )
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
        done += store.run_all(jobs)
        numbers = [n for n, _ in done]
        if len(set(numbers)) != len(numbers):
            raise AssertionError(f"internal: duplicate part numbers in {sorted(numbers)}")
        complete(store, url, bucket, key, upload_id, done, size)
    except BaseException:
        store.abort_upload(bucket, key, upload_id)
        raise


def _make_part(
    store: S3Store, url: str, bucket: str, key: str, upload_id: str, p: PartRecipe, size: int
) -> tuple[int, str]:
    number = part_number(p.start, size)
    if p.copy is not None:
        src = p.copy
        a = int(src["key_offset"])
        etag = store.call(
            url,
            f"UploadPartCopy {number} from {src['key']} bytes {a}-{a + p.size - 1}",
            lambda: store.copy_part(bucket, key, upload_id, number, src["key"], a, a + p.size),
        )
        return number, etag
    buffer = bytearray(p.size)
    _common.fetch(store, url, bucket, p.ranges, memoryview(buffer))
    etag = store.call(
        url,
        f"UploadPart {number} (bytes {p.start}-{p.stop - 1})",
        lambda: store.upload_part(bucket, key, upload_id, number, [memoryview(buffer)]),
    )
    return number, etag
