"""The provider-neutral write flow of object storage, and its clients by URL scheme
(:func:`store_for`). A file one process holds whole is written directly; a save by several
processes is registered (:func:`prepare_directory`, every process), run
(:func:`finish_directory`, every process; then the primary persists the commit record) and
committed (:func:`finalize_directory`, the primary, maybe on a fresh driver). A failed save is
removed: nothing is left a reader could take for a checkpoint file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import gcs as _gcs
from orbax_safetensors._src.storage.objstore import s3 as _s3
from orbax_safetensors._src.storage.objstore import spread as _spread
from orbax_safetensors._src.storage.objstore import upload_plan as _up

RECORD_NAME = "spread.json"  # under the staging directory
_FORMAT = 1
_MAX_KEPT = 64  # records kept for a finalize that another driver ran instead
_lock = threading.Lock()  # guards _saves, _counts, _kept
_Store = _spread.Store

_saves: dict[str, _spread.Save] = {}  # registered directories, until their finish
_counts: dict[str, int] = {}  # saves registered per directory (the same on every process)


def write_file(store: _Store, url: str, pieces: Sequence[_interface.Piece], size: int) -> None:
    """Writes this process's ``pieces`` of the ``size``-byte file at ``url``: kept for
    :func:`finish_directory` in a registered save, else written directly (whole or not at all;
    ValueError naming the bytes held unless they tile ``[0, size)``)."""
    url = os.fspath(url)
    segments = _common.segments_of(pieces)
    if segments and segments[-1].end > size:
        raise ValueError(f"{url}: pieces end at {segments[-1].end}, past the file size {size}")
    directory, _, name = url.rpartition("/")
    with _lock:
        save = _saves.get(directory)
    if save is not None and any(name == f for f, _ in save.files):
        save.written[name] = segments  # sent by finish_directory
        return
    _, bucket, key = _common.split_url(url)
    if size and not (len(segments) == 1 and segments[0].start == 0 and segments[0].size == size):
        held = ", ".join(f"{s.start}-{s.end - 1}" for s in segments[:4]) or "none"
        held += ", ..." if len(segments) > 4 else ""
        raise ValueError(
            f"{url}: this process holds bytes {held} of {size}, and no save by several "
            "processes was prepared for its directory (storage.router.prepare_directory)"
        )
    whole = segments[0] if segments else _common.Segment(0, [], 0)
    _spread.write_whole(store, url, bucket, key, whole)


def prepare_directory(
    directory: str, files: Sequence[tuple[str, int]], *, is_primary: bool
) -> None:
    """Every process, before a save of ``files`` into ``directory``, in the same order: with
    several processes, registers the directory (:func:`write_file` then keeps the pieces).

    Raises:
      RuntimeError: several processes, and ``jax.distributed``'s key-value store is missing
        (naming what is missing).
    """
    import jax

    if jax.process_count() <= 1:
        return
    directory = os.fspath(directory).rstrip("/")
    _jaxcompat.require_distributed_kv(f"a save to {directory} by {jax.process_count()} processes")
    with _lock:
        n = _counts[directory] = _counts.get(directory, 0) + 1
        _saves[directory] = _spread.Save(
            list(files),
            is_primary,
            jax.process_index(),
            jax.process_count(),
            f"osf/{directory}/{n}",
        )


def finish_directory(store: _Store, directory: str) -> None:
    """Every process, once it wrote its files of a registered ``directory``: its part of the
    save (:func:`.spread.execute`). A failing process tells the others. The primary waits for
    every process, then persists the commit record, or removes what the save wrote and raises
    naming the first failure."""
    directory = os.fspath(directory).rstrip("/")
    with _lock:
        save = _saves.pop(directory, None)
    if save is None:
        return
    kv = _spread.SaveKeys(save.key, directory)
    me, outcome = save.process, _spread.Outcome()
    error: BaseException | None = None
    try:
        _spread.execute(store, directory, save, kv, outcome)
    except BaseException as e:
        error = e
        kv.fail(me, e)
        ids = outcome.upload_ids
        _abort_uploads(
            store, directory, {n: u for n, u in ids.items() if n not in outcome.completed}
        )
    try:
        kv.set(f"done/{me}", "ok" if error is None else "failed")
    except Exception as e:  # the coordination service is gone: the job is failing anyway
        error = error or e
    if not save.is_primary:
        if error is not None:
            raise error
        return
    try:
        failed = kv.wait_done(save.count, me)
        if error is None and not failed:
            assert outcome.plan is not None
            _write_record(store, directory, CommitRecord.of_plan(outcome.plan))
            return
        first = kv.failure()
        if error is None or (first is not None and not first.startswith(f"process {me}:")):
            # Another process failed first (this one's own failure, if any, followed from
            # it: an upload that process aborted, say): the error names the first.
            reason = first or f"processes {failed} did not finish"
            own, error = (
                error,
                _common.ObjectStoreError(
                    directory, "the save", 1, RuntimeError(f"the save failed on {reason}")
                ),
            )
            error.__cause__ = own
    except BaseException as e:
        error = error or e
    finally:
        if error is not None:
            names = [name for name, _ in save.files]
            discard(store, directory, names, _created_uploads(kv, outcome))
        kv.delete()  # every process is done with them
    raise error


def abandon_directory(store: _Store, directory: str, error: BaseException) -> None:
    """This process's save of ``directory`` failed outside :func:`finish_directory`: tells the
    other processes and, on the primary, removes what the save wrote once every process is
    done (after :func:`finish_directory`, aborts the uploads its kept record holds)."""
    directory = os.fspath(directory).rstrip("/")
    with _lock:
        save = _saves.pop(directory, None)
        record = _kept.pop(directory, None) if save is None else None
    if save is None:
        if record is not None:
            names = [str(f["name"]) for f in record.files]
            discard(store, directory, names, _upload_ids(record))
        return
    kv = _spread.SaveKeys(save.key, directory)
    kv.fail(save.process, error)
    try:
        kv.set(f"done/{save.process}", "failed")
    except Exception:  # the coordination service is gone: the job is failing anyway
        return
    if save.is_primary:
        try:
            kv.wait_done(save.count, save.process)
            discard(store, directory, [name for name, _ in save.files], {})
        finally:
            kv.delete()


def _abort_uploads(store: _Store, directory: str, upload_ids: Mapping[str, str]) -> None:
    # S3: aborts the multipart uploads ``upload_ids`` (file name -> UploadId) of ``directory``.
    if isinstance(store, _s3.S3Store):
        bucket, base = _common.split_directory(directory)
        for name, upload_id in upload_ids.items():
            store.abort_upload(bucket, base + name, upload_id)


def _created_uploads(kv: _spread.SaveKeys, outcome: _spread.Outcome) -> dict[str, str]:
    # The primary, once every process is done with a failed save: every multipart upload a
    # finisher created (its own, and those the others published), to abort.
    ids = dict(outcome.upload_ids)
    plan = outcome.plan
    if plan is not None and plan.kind is _up.StoreKind.S3:
        for index, f in enumerate(plan.files):
            if f.top >= 0 and f.name not in ids:
                try:
                    upload_id = kv.try_get(f"up/{index}")
                except Exception:  # the coordination service is gone: the job fails anyway
                    continue
                if upload_id is not None:
                    ids[f.name] = upload_id
    return ids


def record_key(directory: str) -> str:
    """The object key of the commit record of the save of ``directory``."""
    _, base = _common.split_directory(directory)
    return f"{base}{_common.STAGING_DIR}/{RECORD_NAME}"


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """What committing a save by several processes needs, per file several processes wrote,
    persisted as ``<directory>/.osf-parts/spread.json``: ``{"name", "size"}`` for a file
    completed during the save; S3 ``{..., "parts", "upload_id"}`` or GCS ``{..., "level",
    "sources"}`` for one still to complete (:func:`.spread.commit_file`)."""

    kind: str  # "s3" or "gs"
    files: tuple[Mapping[str, Any], ...]

    @classmethod
    def of_plan(cls, plan: _up.UploadPlan) -> CommitRecord:  # (every file completed)
        files = tuple({"name": f.name, "size": f.size} for f in plan.files if f.top >= 0)
        return cls(plan.kind.value, files)

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
            raise _common.ObjectStoreError(
                url, "reading the spread save's record", 1, error
            ) from error


def _upload_ids(record: CommitRecord) -> dict[str, str]:
    return {str(f["name"]): str(f["upload_id"]) for f in record.files if "upload_id" in f}


_kept: dict[str, CommitRecord] = {}  # the primary's records, until its finalize


def _write_record(store: _Store, directory: str, record: CommitRecord) -> None:
    # Persists ``record`` (the primary, once every process finished) and keeps it for
    # finalize_directory.
    bucket, _ = _common.split_directory(directory)
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


def finalize_directory(store: _Store, directory: str) -> None:
    """The primary's last step of a save into ``directory`` (maybe on a driver that did not run
    it): completes what its commit record lists (kept in memory, else read from the store) and
    deletes the record; without one, deletes what a save killed mid-way left behind."""
    directory = os.fspath(directory).rstrip("/")
    bucket, base = _common.split_directory(directory)
    staged = f"{directory}/{_common.STAGING_DIR}/"
    listing = store.call(staged, "LIST parts", store.list, bucket, f"{base}{_common.STAGING_DIR}/")
    with _lock:
        record = _kept.pop(directory, None)
    key = record_key(directory)
    url = f"{staged}{RECORD_NAME}"
    if record is None and key in listing:
        data, _ = store.call(
            url, "GET commit record", store.get_upto, bucket, key, 0, listing[key] + 1
        )
        record = CommitRecord.from_json(url, data)
    if record is None:
        if listing:  # a save killed mid-way left them
            store.call(
                staged,
                f"DELETE {len(listing)} temporary objects",
                lambda: store.delete(bucket, sorted(listing)),
            )
        return
    if record.kind != store.scheme:
        raise _common.ObjectStoreError(
            url, "finalize", 1, RuntimeError(f"a record of a {record.kind}:// save")
        )
    try:
        for f in record.files:
            _spread.commit_file(store, directory, bucket, base, f)
    except BaseException:  # (a file listed with an upload_id: not one its finisher completed)
        _abort_uploads(store, directory, _upload_ids(record))
        raise
    store.call(url, "DELETE commit record", store.delete, bucket, [key])


def discard(
    store: _Store, directory: str, names: Sequence[str], upload_ids: Mapping[str, str]
) -> None:
    """Removes what a failed save of the files ``names`` wrote in ``directory`` (the primary,
    once no process writes any more): aborts ``upload_ids``, deletes the files written and
    every staged object. Best effort: the save's error matters more."""
    bucket, base = _common.split_directory(directory)
    _abort_uploads(store, directory, upload_ids)
    try:
        listing = store.call(f"{directory}/", "LIST (clean-up)", store.list, bucket, base)
    except Exception:
        return
    staged = f"{base}{_common.STAGING_DIR}/"
    wanted = {base + n for n in names}

    def written(k: str) -> bool:  # a file of this save (in the item directory itself)
        rest = k[len(base) :]
        return k in wanted or ("/" not in rest and rest.endswith(".safetensors"))

    doomed = [k for k in sorted(listing) if written(k) or k.startswith(staged)]
    _common.delete_quietly(store, bucket, doomed)


# The client of each object store, by URL scheme (``storage.router`` serves these schemes).
_CLIENTS: dict[str, Callable[[_config.ObjectStoreOptions, bool], _Store]] = {
    "s3": _s3.S3Store,
    "gs": _gcs.GcsStore,
}


def store_for(url: str, io: _config.IOOptions) -> _Store:
    """The client of the object store serving ``url`` with the resolved I/O options ``io``
    (one per scheme and options, kept: its connections are reused)."""
    return _client(os.fspath(url).partition("://")[0], io)


@functools.lru_cache(maxsize=32)
def _client(scheme: str, io: _config.IOOptions) -> _Store:
    assert io.object_store is not None and io.trace is not None
    return _CLIENTS[scheme](io.object_store, io.trace)


def open_reader(url: str, io: _config.IOOptions) -> _common.ObjectReader:
    """Ranged reads of the object ``url`` (see :func:`store_for`)."""
    return _common.ObjectReader(store_for(url, io), url)
