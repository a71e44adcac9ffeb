"""The multipart uploads every process of a multi-process S3 save shares when the job has no
``jax.distributed`` key-value store (with one, the spread save creates exactly the uploads its
plan needs: :mod:`.spread`): the primary creates one per large file, every process receives the
UploadIds through a JAX collective (:func:`prepare_directory`), writers look theirs up
(:func:`upload_id_for`) and the primary's finalize takes them (:func:`take_uploads`) to
complete or abort.

Example::

    store = S3Store()
    prepare_directory(store, "s3://bucket/run/0/default", [("model.safetensors", 1 << 30)],
                      is_primary=jax.process_index() == 0)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from orbax_safetensors._src.storage.objstore import calls as _calls
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore.s3 import S3Store, s3_min_part

_lock = threading.Lock()  # guards _directories


@dataclasses.dataclass
class _Uploads:
    """The multipart uploads of one checkpoint directory (S3, multi-process saves)."""

    ids: dict[str, str]  # file name -> UploadId
    created_here: bool  # by this process (the primary), which completes or aborts them


_directories: dict[str, _Uploads] = {}  # checkpoint directory -> its uploads
_MAX_REMEMBERED = 64


def _broadcast_json(doc: Any, *, is_source: bool) -> Any:
    """``doc`` of the process where ``is_source`` is True, returned on every process.

    A collective: every process calls it at the same point of its main thread
    (``compat.multihost.broadcast_bytes``, of the JSON text).
    """
    from orbax_safetensors._src.compat import multihost as _multihost  # (imports JAX)

    data = json.dumps(doc).encode() if is_source else None
    return json.loads(_multihost.broadcast_bytes(data, is_source=is_source))


def prepare_directory(
    store: S3Store, directory: str, files: Sequence[tuple[str, int]], *, is_primary: bool
) -> None:
    """Main-thread step of every process before a save into the ``s3://`` ``directory``.

    In a multi-process job the primary creates one multipart upload per file large enough to
    hold parts from several processes, and every process receives the UploadIds through
    :func:`_broadcast_json` (through ``jax.distributed``). Every process must call this for
    every save, in the same order; if the primary fails, every process raises.
    """
    import jax

    directory = os.fspath(directory).rstrip("/")
    if jax.process_count() <= 1:
        return
    ids: dict[str, str] = {}
    failure: BaseException | None = None
    if is_primary:
        try:
            ids = _create_uploads(store, directory, files)
        except BaseException as error:  # every process must still reach the broadcast
            failure = error
    sent = {"uploads": ids} if failure is None else {"error": _calls.describe_error(failure)}
    try:
        doc = _broadcast_json(sent, is_source=is_primary)
    except BaseException:
        _abort_uploads(store, directory, ids)
        raise
    if failure is not None:
        raise failure
    if not isinstance(doc, dict) or not isinstance(doc.get("uploads"), dict):
        reason = doc.get("error") if isinstance(doc, dict) else "no process sent the upload ids"
        raise _calls.ObjectStoreError(
            directory, "starting the multipart uploads (primary)", 1, RuntimeError(reason)
        )
    _remember(directory, _Uploads(ids=dict(doc["uploads"]), created_here=is_primary))


def _create_uploads(
    store: S3Store, directory: str, files: Sequence[tuple[str, int]]
) -> dict[str, str]:
    """One multipart upload per file large enough for direct parts (primary); all or none."""
    _, bucket, key = _common.split_url(directory)
    ids: dict[str, str] = {}
    try:
        for name, size in files:
            if size >= 3 * s3_min_part(size):
                obj = f"{key}/{name}" if key else name
                ids[name] = store.call(
                    f"{directory}/{name}",
                    "CreateMultipartUpload",
                    functools.partial(store.create_upload, bucket, obj),
                )
    except BaseException:
        _abort_uploads(store, directory, ids)
        raise
    return ids


def _abort_uploads(store: S3Store, directory: str, ids: Mapping[str, str]) -> None:
    if not ids:
        return
    _, bucket, key = _common.split_url(directory)
    for name, upload_id in ids.items():
        store.abort_upload(bucket, f"{key}/{name}" if key else name, upload_id)


def _remember(directory: str, entry: _Uploads) -> None:
    with _lock:
        _directories.pop(directory, None)
        _directories[directory] = entry
        while len(_directories) > _MAX_REMEMBERED:
            _directories.pop(next(iter(_directories)))


def upload_id_for(url: str) -> str | None:
    """The shared multipart upload of the file at ``url``, if :func:`prepare_directory` made one."""
    directory, _, name = url.rpartition("/")
    with _lock:
        entry = _directories.get(directory)
    return None if entry is None else entry.ids.get(name)


def take_uploads(directory: str) -> _Uploads | None:
    """The uploads :func:`prepare_directory` made for ``directory``, forgotten from now on
    (``finalize_directory`` completes or aborts them)."""
    with _lock:
        return _directories.pop(directory, None)


def upload_ids(directory: str) -> dict[str, str]:
    """File name -> UploadId of the uploads :func:`prepare_directory` made for ``directory``.

    Raises KeyError if it made none (a single-process job, or already finalized).
    """
    with _lock:
        return dict(_directories[directory].ids)
