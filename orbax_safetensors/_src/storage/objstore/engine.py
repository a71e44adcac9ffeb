"""The provider-neutral write flow of object storage, and the providers the router
registers (:data:`S3`, :data:`GCS`): the only module that knows both :mod:`.s3` and :mod:`.gcs`.

Example::

    S3.write_file("s3://bucket/w.safetensors", [interface.header_piece(header), *pieces], size)
    with contextlib.closing(GCS.open_reader("gs://bucket/w.safetensors")) as reader:
        head = reader.pread(0, 8)
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import gcs as _gcs
from orbax_safetensors._src.storage.objstore import s3 as _s3
from orbax_safetensors._src.storage.objstore import s3_uploads as _s3_uploads
from orbax_safetensors._src.storage.objstore import spread as _spread
from orbax_safetensors._src.storage.objstore import spread_commit as _spread_commit
from orbax_safetensors._src.storage.objstore import views as _views

_Store: TypeAlias = _s3.S3Store | _gcs.GcsStore


def write_file(store: _Store, url: str, pieces: Sequence[_interface.Piece], size: int) -> None:
    """Writes this process's ``pieces`` of the ``size``-byte file at ``url``.

    When the pieces tile ``[0, size)`` the final object is written directly. Otherwise other
    processes hold the rest: this process uploads its ranges under the file's hidden staging
    prefix, and :func:`finalize_directory` (primary, after everyone wrote) joins them.
    In a save that :func:`prepare_directory` registered for the spread plan (several
    processes, see :mod:`.spread`) the pieces are kept for :func:`finish_directory` instead.
    """
    url = os.fspath(url)
    if _spread.take(url, pieces, size):
        return  # a save by several processes: sent by finish_directory
    _, bucket, key = _common.split_url(url)
    segments = _views.segments_of(pieces)
    if segments and segments[-1].end > size:
        raise ValueError(f"{url}: pieces end at {segments[-1].end}, past the file size {size}")
    if size == 0 or (len(segments) == 1 and segments[0].start == 0 and segments[0].size == size):
        _write_whole(store, url, bucket, key, segments[0] if segments else _views.Segment(0, [], 0))
    elif segments:
        _write_ranges(store, url, bucket, key, segments, size)


def _write_whole(store: _Store, url: str, bucket: str, key: str, seg: _views.Segment) -> None:
    options = store.options
    if seg.size <= options.part_size:
        store.call(url, f"PUT {seg.size} bytes", lambda: store.put(bucket, key, seg.views))
        return
    chunks = _views.even_chunks(seg.size, options.part_size)
    if isinstance(store, _s3.S3Store):
        _s3.write_multipart(store, url, bucket, key, seg, chunks)
    else:
        _gcs.write_composed(store, url, bucket, key, seg, chunks)


def _write_ranges(
    store: _Store, url: str, bucket: str, key: str, segments: list[_views.Segment], size: int
) -> None:
    """Uploads this process's ranges of a file that other processes also write.

    Each range becomes one of: parts of the shared S3 multipart upload (interior of ranges
    >= 3 x the minimum part), whole staged objects (ranges >= the minimum part on S3 without a
    shared upload, >= ``gcs_min_object`` on GCS), or slices of this process's loose objects
    (everything smaller, and the 5 MiB edges around S3 direct parts). A manifest listing them
    by file offset is written last.
    """
    options = store.options
    prefix, name = _common.staging_prefix(key)
    s3 = isinstance(store, _s3.S3Store)
    upload_id = _s3_uploads.upload_id_for(url) if s3 else None
    min_part = _s3.s3_min_part(size)
    target = max(options.part_size, 2 * min_part)
    sources: list[dict[str, Any]] = []
    uploads: list[Callable[[], Any]] = []
    loose: list[tuple[int, list[memoryview], int]] = []  # (file offset, views, nbytes)

    def put_job(obj: str, views: list[memoryview], what: str) -> Callable[[], None]:
        return lambda: store.call(url, f"PUT {what} {obj}", lambda: store.put(bucket, obj, views))

    def part_job(record: dict[str, Any], views: list[memoryview]) -> Callable[[], None]:
        assert isinstance(store, _s3.S3Store) and upload_id is not None
        number, a = record["part"], record["offset"]

        def job() -> None:
            record["etag"] = store.call(
                url,
                f"UploadPart {number} (bytes {a}-{a + record['size'] - 1})",
                lambda: store.upload_part(bucket, key, upload_id, number, views),
            )

        return job

    def add_objects(seg: _views.Segment) -> None:
        for ca, cb in _views.even_chunks(seg.size, target):
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
            for ca, cb in _views.even_chunks(b - a, target):
                record = {"offset": a + ca, "size": cb - ca, "part": _s3.part_number(a + ca, size)}
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

    store.run_all(uploads)
    manifest = {
        "file": name,
        "size": size,
        "upload_id": upload_id,
        "sources": sorted(sources, key=lambda s: s["offset"]),
    }
    data = [memoryview(json.dumps(manifest).encode())]
    mkey = f"{prefix}m-{segments[0].start:016x}.json"
    store.call(url, f"PUT manifest {mkey}", lambda: store.put(bucket, mkey, data))


def prepare_directory(
    store: _Store, directory: str, files: Sequence[tuple[str, int]], *, is_primary: bool
) -> None:
    """Main-thread step of every process before a save into ``directory``: in a multi-process
    job with a ``jax.distributed`` key-value store, registers the directory for the spread plan
    (:func:`.spread.register`: the S3 uploads are created once the plan shows which files need
    one); otherwise on S3 the primary starts the shared uploads
    (:func:`.s3_uploads.prepare_directory`)."""
    directory = os.fspath(directory).rstrip("/")
    if _spread.register(directory, files, is_primary=is_primary):
        return
    if isinstance(store, _s3.S3Store):
        _s3_uploads.prepare_directory(store, directory, files, is_primary=is_primary)


def finish_directory(store: _Store, directory: str) -> None:
    """Every process, once it wrote all its files of ``directory``: its part of a spread save
    (:func:`.spread.finish`); nothing otherwise."""
    _spread.finish(store, os.fspath(directory).rstrip("/"), _write_whole)


def abandon_directory(store: _Store, directory: str, error: BaseException) -> None:
    """This process's save of ``directory`` failed outside :func:`finish_directory`: see
    :func:`.spread.abandon` (nothing for a save that is not spread)."""
    _spread.abandon(store, os.fspath(directory).rstrip("/"), error)


def finalize_directory(store: _Store, directory: str) -> None:
    """Joins the ranges every process uploaded into each file of ``directory``, then deletes
    the staged objects. Run once, on the primary, after all processes finished writing; for a
    spread save, completes it from the commit record (:func:`.spread_commit.commit`), which
    works on a process that did not run the save too."""
    directory = os.fspath(directory).rstrip("/")
    _, bucket, key = _common.split_url(directory)
    base = f"{key}/" if key else ""
    listing = store.call(
        f"{directory}/{_common.STAGING_DIR}/",
        "LIST parts",
        lambda: store.list(bucket, f"{base}{_common.STAGING_DIR}/"),
    )
    if _spread_commit.commit(store, directory, listing):
        # A spread save: its uploads completed, its tops composed, its record deleted; the
        # files nobody registered for it (none from this library's pipeline) are joined below.
        listing = {k: n for k, n in listing.items() if k != _spread_commit.record_key(directory)}
        if not any(k.rpartition("/")[2].startswith("m-") for k in listing):
            return
    entry = _s3_uploads.take_uploads(directory) if isinstance(store, _s3.S3Store) else None
    if not listing and (entry is None or not entry.ids):
        return  # every file was written whole (by one process): nothing to join
    manifests: dict[str, list[dict[str, Any]]] = {}
    for obj in sorted(listing):
        rest = obj[len(f"{base}{_common.STAGING_DIR}/") :]
        name, _, leaf = rest.rpartition("/")
        if leaf.startswith("m-") and leaf.endswith(".json"):
            data, _ = store.call(
                f"{store.scheme}://{bucket}/{obj}",
                "GET manifest",
                functools.partial(store.get_upto, bucket, obj, 0, listing[obj] + 1),
            )
            manifests.setdefault(name, []).append(json.loads(data))
    created = entry.ids if entry is not None and entry.created_here else {}
    try:
        for name, docs in sorted(manifests.items()):
            url = f"{directory}/{name}"
            if isinstance(store, _s3.S3Store):
                _s3.assemble(store, url, bucket, f"{base}{name}", docs)
            else:
                _gcs.assemble(store, url, bucket, f"{base}{name}", docs)
    finally:
        for name, upload_id in created.items():
            # written whole by one process
            if name not in manifests and isinstance(store, _s3.S3Store):
                store.abort_upload(bucket, f"{base}{name}", upload_id)
    leftovers = store.call(
        f"{directory}/{_common.STAGING_DIR}/",
        "LIST parts",
        lambda: store.list(bucket, f"{base}{_common.STAGING_DIR}/"),
    )
    if leftovers:
        store.call(
            f"{directory}/{_common.STAGING_DIR}/",
            f"DELETE {len(leftovers)} part objects",
            lambda: store.delete(bucket, sorted(leftovers)),
        )


class ObjectStoreProvider:
    """One object store as a :class:`orbax_safetensors._src.storage.router.Provider`: the
    router hands it every path of its URL scheme, with the I/O options of the call."""

    def __init__(self, make_store: Callable[[_config.ObjectStoreOptions, bool], _Store]) -> None:
        self._make_store = make_store

    @functools.lru_cache(maxsize=16)  # noqa: B019 (two module-level providers, kept for good)
    def store(self, io: _config.IOOptions) -> _Store:
        """The client for ``io`` (resolved: see :func:`.config.resolve`); one per options."""
        assert io.object_store is not None and io.trace is not None
        return self._make_store(io.object_store, io.trace)

    def open_reader(self, url: str, io: _config.IOOptions) -> _common.ObjectReader:
        """A ranged reader of the object at ``url``."""
        return _common.ObjectReader(self.store(io), url)

    def write_file(
        self, url: str, pieces: Sequence[_interface.Piece], size: int, io: _config.IOOptions
    ) -> None:
        """See :func:`write_file`."""
        write_file(self.store(io), url, pieces, size)

    def prepare_directory(
        self,
        directory: str,
        files: Sequence[tuple[str, int]],
        *,
        is_primary: bool,
        io: _config.IOOptions,
    ) -> None:
        """See :func:`prepare_directory`."""
        prepare_directory(self.store(io), directory, files, is_primary=is_primary)

    def finish_directory(self, directory: str, io: _config.IOOptions) -> None:
        """See :func:`finish_directory`."""
        finish_directory(self.store(io), directory)

    def abandon_directory(
        self, directory: str, error: BaseException, io: _config.IOOptions
    ) -> None:
        """See :func:`abandon_directory`."""
        abandon_directory(self.store(io), directory, error)

    def finalize_directory(self, directory: str, io: _config.IOOptions) -> None:
        """See :func:`finalize_directory`."""
        finalize_directory(self.store(io), directory)


S3 = ObjectStoreProvider(_s3.S3Store)
GCS = ObjectStoreProvider(_gcs.GcsStore)
