"""The end of a spread save (:mod:`.spread`): what the primary's commit needs, kept in memory
and persisted as a small record beside the staged objects, the commit itself, and the clean-up
of a save that failed.

Once every process finished its part, the primary writes :class:`CommitRecord` to
``<directory>/.osf-parts/spread.json``: per S3 file its multipart UploadId and part count, per GCS
file the composites of the top level. :func:`commit` (the primary's ``finalize_directory``)
completes the uploads or composes the tops from the record kept in memory, or, when this process
did not run the save (Orbax's finalize on a fresh driver: ``pipeline.save_job.
finalize_from_disk``), from the persisted record; then it deletes the record. :func:`discard`
removes everything a failed save wrote (files, staged objects, the record) and aborts its
uploads: nothing is left that a reader could take for a checkpoint file.

Example::

    keep("gs://b/ckpt/1/default", CommitRecord.of_plan(plan, {}))
    commit(store, "gs://b/ckpt/1/default", listing)     # primary, in finalize_directory
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orbax_safetensors._src.storage.objstore import calls as _calls
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import gcs as _gcs
from orbax_safetensors._src.storage.objstore import s3 as _s3
from orbax_safetensors._src.storage.objstore import upload_plan as _up

RECORD_NAME = "spread.json"  # under the staging directory
_FORMAT = 1
_MAX_KEPT = 64  # records kept for a finalize that another driver ran instead
_lock = threading.Lock()  # guards _kept
_Store = _s3.S3Store | _gcs.GcsStore


def window_key(key: str, w: int) -> str:
    """The staged object of window ``w`` of the object ``key`` (GCS)."""
    prefix, _ = _common.staging_prefix(key)
    return f"{prefix}w-{w:06d}"


def compose_key(key: str, level: int, group: int) -> str:
    """The composite of group ``group`` of compose level ``level`` of the object ``key``."""
    prefix, _ = _common.staging_prefix(key)
    return f"{prefix}c{level}-{group:06d}"


def _base(directory: str) -> tuple[str, str]:
    _, bucket, key = _common.split_url(directory)
    return bucket, f"{key}/" if key else ""


def record_key(directory: str) -> str:
    """The object key of the commit record of the spread save of ``directory``."""
    _, base = _base(directory)
    return f"{base}{_common.STAGING_DIR}/{RECORD_NAME}"


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """What completing a spread save needs, per file the primary completes or composes:
    S3 ``{"name", "size", "parts", "upload_id"}``; GCS ``{"name", "size", "level", "sources"}``
    (the composites ``compose_key(file, level, g)`` for ``g < sources``)."""

    kind: str  # "s3" or "gs"
    files: tuple[Mapping[str, Any], ...]

    @classmethod
    def of_plan(cls, plan: _up.UploadPlan, upload_ids: Mapping[str, str]) -> CommitRecord:
        """The record of ``plan`` (S3: with the UploadIds the primary created)."""
        files: list[dict[str, Any]] = []
        for f in plan.files:
            if f.whole_owner >= 0 or f.windows <= 1:
                continue
            if plan.kind is _up.StoreKind.S3:
                files.append(
                    {
                        "name": f.name,
                        "size": f.size,
                        "parts": f.windows,
                        "upload_id": upload_ids[f.name],
                    }
                )
            elif f.compose:  # (else one of its writers composed it: see spread._Run.compose)
                level = len(f.compose) - 1
                files.append(
                    {"name": f.name, "size": f.size, "level": level, "sources": len(f.compose[-1])}
                )
        return cls(plan.kind.value, tuple(files))

    def to_json(self) -> str:
        return json.dumps({"format": _FORMAT, "kind": self.kind, "files": list(self.files)})

    @classmethod
    def from_json(cls, url: str, text: bytes | str) -> CommitRecord:
        """The record in ``text``; an ObjectStoreError naming ``url`` if it is not one."""
        try:
            doc = json.loads(text)
            if doc.get("format") != _FORMAT or doc.get("kind") not in ("s3", "gs"):
                raise ValueError(f"format {doc.get('format')!r}, kind {doc.get('kind')!r}")
            return cls(str(doc["kind"]), tuple(dict(f) for f in doc["files"]))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise _calls.ObjectStoreError(
                url, "reading the spread save's record", 1, error
            ) from error


_kept: dict[str, CommitRecord] = {}  # the primary's records, until its finalize


def write_record(store: _Store, directory: str, record: CommitRecord) -> None:
    """Persists ``record`` (the primary, once every process finished) and keeps it for
    :func:`commit`."""
    bucket, _ = _base(directory)
    key, data = record_key(directory), [memoryview(record.to_json().encode())]
    store.call(
        f"{directory}/{_common.STAGING_DIR}/{RECORD_NAME}",
        "PUT commit record",
        lambda: store.put(bucket, key, data),
    )
    with _lock:
        _kept.pop(directory, None)
        _kept[directory] = record
        while len(_kept) > _MAX_KEPT:  # finalized by other drivers: from the persisted record
            _kept.pop(next(iter(_kept)))


def forget(store: _Store, directory: str) -> None:
    """The primary's save of ``directory`` failed after its spread part (before its commit):
    aborts the uploads of the record kept for it and removes what the save wrote."""
    with _lock:
        record = _kept.pop(directory, None)
    if record is not None:
        ids = {str(f["name"]): str(f["upload_id"]) for f in record.files if "upload_id" in f}
        discard(store, directory, [str(f["name"]) for f in record.files], ids)


def commit(store: _Store, directory: str, listing: Mapping[str, int]) -> bool:
    """The primary's last step of a spread save of ``directory``: completes each S3 upload or
    composes each GCS file's top level, then deletes the record. The record comes from memory or,
    if this process did not run the save, from ``listing`` (the staging directory's objects)
    and the store. False if ``directory`` holds no spread save (nothing done)."""
    with _lock:
        record = _kept.pop(directory, None)
    bucket, base = _base(directory)
    key = record_key(directory)
    url = f"{directory}/{_common.STAGING_DIR}/{RECORD_NAME}"
    if record is None:
        if key not in listing:
            return False
        data, _ = store.call(
            url,
            "GET commit record",
            functools.partial(store.get_upto, bucket, key, 0, listing[key] + 1),
        )
        record = CommitRecord.from_json(url, data)
    if record.kind != store.scheme:
        raise _calls.ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"a record of a {record.kind}:// save")
        )
    try:
        for f in record.files:
            _commit_file(store, directory, bucket, base, f)
    except BaseException:
        if isinstance(store, _s3.S3Store):
            for f in record.files:
                store.abort_upload(bucket, base + f["name"], f["upload_id"])
        raise
    store.call(url, "DELETE commit record", functools.partial(store.delete, bucket, [key]))
    return True


def _commit_file(
    store: _Store, directory: str, bucket: str, base: str, f: Mapping[str, Any]
) -> None:
    url, key = f"{directory}/{f['name']}", base + f["name"]
    if isinstance(store, _s3.S3Store):
        upload_id, count = str(f["upload_id"]), int(f["parts"])
        parts = store.call(
            url, "ListParts", functools.partial(store.list_parts, bucket, key, upload_id)
        )
        numbers = sorted(n for n, _ in parts)
        if numbers != list(range(1, count + 1)):
            missing = sorted(set(range(1, count + 1)) - set(numbers))
            raise _calls.ObjectStoreError(
                url, "finalize", 1, RuntimeError(f"parts {missing[:10]} were never uploaded")
            )
        _s3.complete(store, url, bucket, key, upload_id, parts, int(f["size"]))
        return
    level, count = int(f["level"]), int(f["sources"])
    sources = [compose_key(key, level, g) for g in range(count)]
    store.call(
        url,
        f"compose {len(sources)} objects into {key}",
        functools.partial(store.compose, bucket, key, sources),
    )
    store.call(
        url,
        f"DELETE {len(sources)} composed objects",
        functools.partial(store.delete, bucket, sources),
    )


def discard(
    store: _Store, directory: str, names: Sequence[str], upload_ids: Mapping[str, str]
) -> None:
    """Removes what a failed spread save of the files ``names`` wrote in ``directory`` (the
    primary, once no process writes for it any more): aborts the multipart uploads
    ``upload_ids``, deletes the files already written whole or composed (``names`` and any
    ``.safetensors`` object of the item directory) and every staged object. Best effort: a failure leaves objects behind rather than hiding the save's error."""
    bucket, base = _base(directory)
    if isinstance(store, _s3.S3Store):
        for name, upload_id in upload_ids.items():
            store.abort_upload(bucket, base + name, upload_id)
    try:
        listing = store.call(
            f"{directory}/", "LIST (clean-up)", functools.partial(store.list, bucket, base)
        )
    except Exception:
        return
    staged = f"{base}{_common.STAGING_DIR}/"
    wanted = {base + n for n in names}

    def written(k: str) -> bool:  # a file of this save (in the item directory itself)
        rest = k[len(base) :]
        return k in wanted or ("/" not in rest and rest.endswith(".safetensors"))

    doomed = [k for k in sorted(listing) if written(k) or k.startswith(staged)]
    _common.delete_quietly(store, bucket, doomed)
