"""The end of a spread save (:mod:`.spread`): what the primary's commit needs, kept in memory
and persisted as a small record beside the staged objects, the commit itself, and the clean-up
of a save that failed.

Each file several processes wrote is completed during the save by its finisher (one of its
writers, :mod:`.upload_plan`), so once every process finished its part the primary writes a
:class:`CommitRecord` to ``<directory>/.osf-parts/spread.json`` that names those files with nothing
left to complete (a record may also list S3 uploads or GCS top levels still to complete:
:func:`commit_file`). :func:`commit` (the primary's ``finalize_directory``) completes what the
record kept in memory lists, or, when this process did not run the save (Orbax's finalize on a
fresh driver: ``pipeline.save_job.finalize_from_disk``), the persisted record; then it deletes
the record. :func:`discard`
removes everything a failed save wrote (files, staged objects, the record) and aborts its
uploads: nothing is left that a reader could take for a checkpoint file.

Example::

    write_record(store, "gs://b/ckpt/1/default", CommitRecord.of_plan(plan))
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
    """What completing a spread save needs, per file several processes wrote: S3
    ``{"name", "size", "parts", "upload_id"}``; GCS ``{"name", "size", "level", "sources"}``
    (the composites ``compose_key(file, level, g)`` for ``g < sources``); ``{"name", "size"}``
    for a file its finisher completed during the save (what :mod:`.spread` writes)."""

    kind: str  # "s3" or "gs"
    files: tuple[Mapping[str, Any], ...]

    @classmethod
    def of_plan(cls, plan: _up.UploadPlan) -> CommitRecord:
        """The record of a save that ran ``plan``: every file's finisher completed its upload
        or composed its top level during the save (:mod:`.spread`), so each file several
        processes wrote is listed as ``{"name", "size"}``, with nothing left to complete."""
        files = [
            {"name": f.name, "size": f.size}
            for f in plan.files
            if f.whole_owner < 0 and f.windows > 1
        ]
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
            commit_file(store, directory, bucket, base, f)
    except BaseException:
        if isinstance(store, _s3.S3Store):
            for f in record.files:
                if "upload_id" in f:  # (not one its finisher completed)
                    store.abort_upload(bucket, base + f["name"], f["upload_id"])
        raise
    store.call(url, "DELETE commit record", functools.partial(store.delete, bucket, [key]))
    return True


def commit_file(
    store: _Store, directory: str, bucket: str, base: str, f: Mapping[str, Any]
) -> None:
    """Completes one file of a record: S3, lists the parts of upload ``f["upload_id"]`` and
    completes it (an error naming the file and the parts never uploaded unless all
    ``f["parts"]`` are there); GCS, composes ``f["sources"]`` composites of level
    ``f["level"]`` into the file and deletes them. Nothing for an entry without either (a file
    its finisher completed during the save).

    Example::

        commit_file(store, "s3://b/ckpt/1/default", "b", "ckpt/1/default/",
                    {"name": "model.safetensors", "size": n, "parts": 3, "upload_id": uid})
    """
    if "upload_id" not in f and "level" not in f:
        return
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
