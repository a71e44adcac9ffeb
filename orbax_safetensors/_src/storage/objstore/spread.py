"""A save by several processes on S3 or GCS, with the part building spread over the processes:
each process executes its part of the :mod:`.upload_plan` (issue 27 point 1).

:func:`register` (every process, from ``prepare_directory``) marks a checkpoint directory;
the engine's ``write_file`` then hands this process's bytes of each file to :func:`take`
instead of uploading them; :func:`finish` (every process, once it wrote all its files) does
the work: every process publishes which bytes of which file it holds and reads everyone
else's through the ``jax.distributed`` key-value store, all compute the same plan, and each
sends its own requests, phase by phase:

0. S3: it creates the multipart upload of each file it finishes (:mod:`.upload_plan`: one of
   the file's writers) and publishes its UploadId (``up/<file>``);
1. its own bytes: files it owns whole, pure windows (S3 parts, GCS staged objects) and its
   loose bundles (the bytes of windows others build), then it announces ``own``;
2. the windows it builds: it waits for the owners' ``own``, fetches their bytes (one ranged GET
   per owner and window), adds its own and uploads the part or filler, announces ``built``;
   on S3 it then completes the uploads of the files it finishes (once their parts' writers
   announced them); on GCS it composes the subtrees and top levels assigned to it (after their
   sources' writers announced them), and deletes the objects it wrote once they were composed;
3. it waits for the builders that read its loose bundles and deletes them;
4. it announces ``done`` (failed or not). A process that fails first announces it, and every
   process waiting for one of its steps raises (:mod:`.spread_kv`). The primary waits for
   every ``done``: if all went well it persists the commit record (:mod:`.spread_commit`);
   otherwise it removes everything the save wrote and aborts every upload a finisher created
   (each failing process aborts its own too), and raises. Then it deletes the save's keys.

So the primary sends no request per file. Its ``finalize_directory`` (after every process
finished; Orbax may run it on a fresh driver) finds the record and deletes it
(:func:`.spread_commit.commit`). Waits time out after
``spread_kv.WAIT_SECONDS`` with an error naming the process and step waited for. Without the
key-value store (or in a single-process job) nothing is registered and the engine works as
before.

Example::

    register("gs://b/ckpt/1/default", [("model.safetensors", size)], is_primary=True)
    # ... write_file(...) per file: take() keeps the pieces ...
    finish(store, "gs://b/ckpt/1/default")      # every process
    spread_commit.commit(store, "gs://b/ckpt/1/default", listing)   # the primary, finalize
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage.objstore import calls as _calls
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import gcs as _gcs
from orbax_safetensors._src.storage.objstore import s3 as _s3
from orbax_safetensors._src.storage.objstore import spread_commit as _commit
from orbax_safetensors._src.storage.objstore import spread_kv as _kv
from orbax_safetensors._src.storage.objstore import stats as _stats
from orbax_safetensors._src.storage.objstore import upload_plan as _up
from orbax_safetensors._src.storage.objstore import views as _views

LOOSE_DIR = "_loose"  # under the staging directory: every process's loose bundles
_lock = threading.Lock()  # guards _saves, _counts, _last
_Store = _s3.S3Store | _gcs.GcsStore
WriteWhole = Callable[[Any, str, str, str, _views.Segment], None]


@dataclasses.dataclass
class _Save:
    """A registered directory: its files and what this process wrote of them."""

    files: list[tuple[str, int]]
    is_primary: bool
    process: int
    count: int
    key: str  # key-value store namespace of this save
    written: dict[str, list[_views.Segment]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Outcome:
    """What :func:`_execute` got to before it returned or raised (for the clean-up)."""

    plan: _up.UploadPlan | None = None
    upload_ids: dict[str, str] = dataclasses.field(default_factory=dict)  # created here
    completed: set[str] = dataclasses.field(default_factory=set)  # of those, completed


_saves: dict[str, _Save] = {}
_counts: dict[str, int] = {}  # saves registered per directory (the same on every process)
_last: list[tuple[_up.UploadPlan, int]] = []  # the last plan this process executed, and its index


def last_plan() -> tuple[_up.UploadPlan, int] | None:
    """The plan of the last spread save this process finished and its own process index (to
    compare what it sent, :func:`.stats.object_store_stats`, with what the plan says)."""
    with _lock:
        return _last[-1] if _last else None


def register(directory: str, files: Sequence[tuple[str, int]], *, is_primary: bool) -> bool:
    """Marks ``directory`` for a spread save (every process, main thread, same order), when
    the job has several processes and a ``jax.distributed`` key-value store; returns whether it
    did (the same answer on every process)."""
    import jax

    if jax.process_count() <= 1 or _jaxcompat.distributed_kv() is None:
        return False
    with _lock:
        n = _counts[directory] = _counts.get(directory, 0) + 1
        _saves[directory] = _Save(
            list(files),
            is_primary,
            jax.process_index(),
            jax.process_count(),
            f"osf/{directory}/{n}",
        )
    return True


def take(url: str, pieces: Sequence[_interface.Piece], size: int) -> bool:
    """Keeps this process's ``pieces`` of the file at ``url`` for :func:`finish` if its
    directory is registered (True), else False (the engine writes them itself)."""
    directory, _, name = url.rpartition("/")
    with _lock:
        save = _saves.get(directory)
    if save is None or all(name != f for f, _ in save.files):
        return False
    segments = _views.segments_of(pieces)
    if segments and segments[-1].end > size:
        raise ValueError(f"{url}: pieces end at {segments[-1].end}, past the file size {size}")
    save.written[name] = segments
    return True


def _slices(segments: Sequence[_views.Segment], a: int, b: int) -> list[memoryview]:
    """Views of this process's bytes within ``[a, b)``, in offset order."""
    out: list[memoryview] = []
    for s in segments:
        if s.end > a and s.start < b:
            out += s.slice(max(a, s.start), min(b, s.end))
    return out


def _peer_ranges(f: _up.FileOwners, a: int, b: int) -> dict[int, list[tuple[int, int]]]:
    """Each owner's ranges within ``[a, b)`` of the file, in offset order."""
    stops = f.stops()
    lo = int(np.searchsorted(stops, a, "right"))
    hi = int(np.searchsorted(f.starts, b, "left"))
    out: dict[int, list[tuple[int, int]]] = {}
    for i in range(lo, hi):
        out.setdefault(int(f.owners[i]), []).append(
            (max(a, int(f.starts[i])), min(b, int(stops[i])))
        )
    return out


def finish(store: _Store, directory: str, write_whole: WriteWhole) -> None:
    """This process's part of the save of ``directory`` (see the module docstring); does
    nothing unless :func:`register` marked it. Every process calls it once it wrote its files.
    ``write_whole(store, url, bucket, key, segment)`` writes a file this process owns all of.

    A process that fails tells the others (they raise instead of waiting for it); the primary
    waits until every process is done, then persists the commit record
    (:mod:`.spread_commit`), or, if any process failed, removes everything the save wrote and
    aborts its uploads, and raises; then it deletes the save's keys.
    """
    directory = directory.rstrip("/")
    with _lock:
        save = _saves.pop(directory, None)
    if save is None:
        return
    kv = _kv.SaveKeys(save.key, directory)
    me, outcome = save.process, _Outcome()
    error: BaseException | None = None
    try:
        _execute(store, directory, write_whole, save, kv, outcome)
    except BaseException as e:
        error = e
        kv.fail(me, e)
        _abort_mine(store, directory, outcome)
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
            record = _commit.CommitRecord.of_plan(outcome.plan)
            _commit.write_record(store, directory, record)
            return
        first = kv.failure()
        if error is None or (first is not None and not first.startswith(f"process {me}:")):
            # Another process failed first (this one's own failure, if any, followed from
            # it: an upload that process aborted, say): the error names the first.
            reason = first or f"processes {failed} did not finish"
            own, error = (
                error,
                _calls.ObjectStoreError(
                    directory, "the save", 1, RuntimeError(f"the save failed on {reason}")
                ),
            )
            error.__cause__ = own
    except BaseException as e:
        error = error or e
    finally:
        if error is not None:
            names = [name for name, _ in save.files]
            _commit.discard(store, directory, names, _created_uploads(kv, outcome))
        kv.delete()  # every process is done with them
    raise error


def _abort_mine(store: _Store, directory: str, outcome: _Outcome) -> None:
    """Aborts the uploads this process created and did not complete (its save failed)."""
    if isinstance(store, _s3.S3Store):
        _, bucket, base = _common.split_url(directory)
        for name, upload_id in outcome.upload_ids.items():
            if name not in outcome.completed:
                store.abort_upload(bucket, f"{base}/{name}" if base else name, upload_id)


def _created_uploads(kv: _kv.SaveKeys, outcome: _Outcome) -> dict[str, str]:
    """The primary, once every process is done with a failed save: every multipart upload
    a finisher created (its own, and those the others published), to abort."""
    ids = dict(outcome.upload_ids)
    plan = outcome.plan
    if plan is not None and plan.kind is _up.StoreKind.S3:
        for index, f in enumerate(plan.files):
            if f.whole_owner < 0 and f.windows > 1 and f.name not in ids:
                try:
                    upload_id = kv.try_get(f"up/{index}")
                except Exception:  # the coordination service is gone: the job fails anyway
                    continue
                if upload_id is not None:
                    ids[f.name] = upload_id
    return ids


def abandon(store: _Store, directory: str, error: BaseException) -> None:
    """This process's save of ``directory`` failed outside :func:`finish` (a host copy, a
    write before it, or the primary's files after it): tells the other processes (they raise
    instead of waiting for this one) and, on the primary, removes what the save wrote once
    every process is done (or, after :func:`finish`, aborts the uploads the commit record
    holds). Nothing if this process registered no spread save of ``directory``."""
    directory = directory.rstrip("/")
    with _lock:
        save = _saves.pop(directory, None)
    if save is None:
        _commit.forget(store, directory)
        return
    kv = _kv.SaveKeys(save.key, directory)
    kv.fail(save.process, error)
    try:
        kv.set(f"done/{save.process}", "failed")
    except Exception:  # the coordination service is gone: the job is failing anyway
        return
    if save.is_primary:
        try:
            kv.wait_done(save.count, save.process)
            _commit.discard(store, directory, [name for name, _ in save.files], {})
        finally:
            kv.delete()


def _execute(
    store: _Store,
    directory: str,
    write_whole: WriteWhole,
    save: _Save,
    kv: _kv.SaveKeys,
    outcome: _Outcome,
) -> None:
    """The steps of :func:`finish` on this process, up to its clean-up."""
    me, s3 = save.process, isinstance(store, _s3.S3Store)
    mine = {name: [[s.start, s.end] for s in segs] for name, segs in save.written.items()}
    kv.set(f"seg/{me}", json.dumps(mine))
    if save.is_primary:
        kv.set("primary", str(me))
    primary = me if save.is_primary else int(kv.get("primary", "the primary's index"))
    docs = {me: mine}
    for p in range(save.count):
        if p != me:
            docs[p] = json.loads(kv.get(f"seg/{p}", f"process {p}'s byte ranges"))
    owners = []
    for name, size in save.files:
        try:
            ranges = {p: [(a, b) for a, b in d.get(name, [])] for p, d in docs.items()}
            owners.append(_up.FileOwners.from_segments(name, size, ranges))
        except ValueError as error:
            raise _calls.ObjectStoreError(
                f"{directory}/{name}", "planning the upload", 1, error
            ) from error
    kind = _up.StoreKind.S3 if s3 else _up.StoreKind.GCS
    limits = _up.UploadLimits.of(store.options)
    plan = outcome.plan = _up.plan_uploads(kind, limits, owners, save.count, primary)
    _, bucket, base = _common.split_url(directory)
    base = f"{base}/" if base else ""
    ids = outcome.upload_ids
    if s3:
        assert isinstance(store, _s3.S3Store)
        # The uploads of the files this process finishes (the plan needs them all, and no
        # other): created before anyone writes, their ids published for the parts' writers.
        for index, f in enumerate(plan.files):
            if f.whole_owner < 0 and f.windows > 1 and f.top == me:
                url = f"{directory}/{f.name}"
                ids[f.name] = store.call(
                    url,
                    "CreateMultipartUpload",
                    functools.partial(store.create_upload, bucket, base + f.name),
                )
                kv.set(f"up/{index}", ids[f.name])
    run = _Run(store, directory, bucket, base, plan, owners, save, kv, dict(ids), write_whole)
    run.own()
    kv.set(f"own/{me}")
    run.build()
    kv.set(f"built/{me}")
    if s3:
        run.complete(outcome.completed)
    else:
        run.compose()
    run.cleanup()
    with _lock:
        _last[:] = [(plan, me)]


class _Run:
    """The requests of one process for one save."""

    def __init__(
        self,
        store: _Store,
        directory: str,
        bucket: str,
        base: str,
        plan: _up.UploadPlan,
        owners: list[_up.FileOwners],
        save: _Save,
        kv: _kv.SaveKeys,
        ids: dict[str, str],
        write_whole: WriteWhole,
    ) -> None:
        self.write_whole = write_whole
        self.store, self.directory, self.bucket, self.base = store, directory, bucket, base
        self.plan, self.owners, self.save, self.kv, self.ids = plan, owners, save, kv, ids
        self.me = save.process

    def loose_key(self, process: int, bundle: int) -> str:
        return f"{self.base}{_common.STAGING_DIR}/{LOOSE_DIR}/{process:06d}-{bundle:06d}"

    def _put_window(self, index: int, w: int, views: list[memoryview]) -> None:
        f = self.plan.files[index]
        url, key = f"{self.directory}/{f.name}", self.base + f.name
        store, bucket = self.store, self.bucket
        if f.windows == 1:
            store.call(url, "PUT", lambda: store.put(bucket, key, views))
        elif isinstance(store, _s3.S3Store):
            upload_id = self.upload_id(index)
            store.call(
                url,
                f"UploadPart {w + 1}",
                lambda: store.upload_part(bucket, key, upload_id, w + 1, views),
            )
        else:
            obj = _commit.window_key(key, w)
            store.call(url, f"PUT window {obj}", lambda: store.put(bucket, obj, views))

    def upload_id(self, index: int) -> str:
        """S3: the UploadId of file ``index``, from its finisher (through the key-value store)."""
        name = self.plan.files[index].name
        if name not in self.ids:
            finisher = int(self.plan.files[index].top)
            self.ids[name] = self.kv.get(
                f"up/{index}", f"process {finisher} to create the upload of {name}"
            )
        return self.ids[name]

    def _ready_keys(self, f: _up.FileUpload) -> list[str]:
        """The key announcing each window of ``f`` uploaded (its writer's ``own`` or ``built``)."""
        return [
            f"own/{p}" if pure else f"built/{p}"
            for p, pure in zip(f.writer.tolist(), f.pure.tolist())
        ]

    def complete(self, completed: set[str]) -> None:
        """S3: completes the uploads of the files this process finishes, once every part's
        writer announced it (``ListParts`` gives the ETags; a missing part fails naming it);
        adds each file's name to ``completed``."""
        store = self.store
        assert isinstance(store, _s3.S3Store)
        for f in self.plan.files:
            if f.whole_owner >= 0 or f.windows <= 1 or f.top != self.me:
                continue
            for k in sorted(set(self._ready_keys(f))):
                self.kv.wait(k, f"{k} (parts of {f.name})")
            entry = {"name": f.name, "size": f.size, "parts": f.windows}
            _commit.commit_file(
                store,
                self.directory,
                self.bucket,
                self.base,
                {**entry, "upload_id": self.ids[f.name]},
            )
            completed.add(f.name)

    def own(self) -> None:
        """Files this process owns whole, its pure windows, its loose bundles."""
        jobs: list[Any] = []
        written = self.save.written
        for index, f in enumerate(self.plan.files):
            segs = written.get(f.name, [])
            url = f"{self.directory}/{f.name}"
            if f.whole_owner == self.me:
                seg = segs[0] if segs else _views.Segment(0, [], 0)
                key = self.base + f.name
                jobs.append(
                    functools.partial(self.write_whole, self.store, url, self.bucket, key, seg)
                )
                continue
            if f.whole_owner >= 0:
                continue
            stops = f.wstop()
            for w in np.flatnonzero((f.writer == self.me) & f.pure).tolist():
                views = _slices(segs, int(f.wstart[w]), int(stops[w]))
                jobs.append(functools.partial(self._put_window, index, w, views))
        plan = self.plan
        mine = np.flatnonzero(plan.item_owner == self.me)
        bundles: dict[int, list[memoryview]] = {}
        for i in mine.tolist():
            f = plan.files[int(plan.item_file[i])]
            w = int(plan.item_window[i])
            a, b = int(f.wstart[w]), int(f.wstop()[w])
            bundles.setdefault(int(plan.item_bundle[i]), []).extend(
                _slices(written.get(f.name, []), a, b)
            )
        for bundle, views in bundles.items():
            obj = self.loose_key(self.me, bundle)
            jobs.append(
                functools.partial(
                    self.store.call,
                    f"{self.store.scheme}://{self.bucket}/{obj}",
                    "PUT loose bundle",
                    functools.partial(self.store.put, self.bucket, obj, views),
                )
            )
        self.store.run_all(jobs)

    def _build(self, index: int, w: int) -> None:
        plan, f, owners = self.plan, self.plan.files[index], self.owners[index]
        a, b = int(f.wstart[w]), int(f.wstop()[w])
        buffer = bytearray(b - a)
        out = memoryview(buffer)
        ranges = _peer_ranges(owners, a, b)
        for x, y in ranges.get(self.me, []):
            pos = x - a
            for v in _slices(self.save.written.get(f.name, []), x, y):
                out[pos : pos + len(v)] = v
                pos += len(v)
        reads = np.flatnonzero((plan.item_file == index) & (plan.item_window == w))
        jobs = []
        for i in reads.tolist():
            peer = int(plan.item_owner[i])
            self.kv.wait(f"own/{peer}", f"process {peer} to upload its own bytes")
            views = [out[x - a : y - a] for x, y in ranges[peer]]
            obj = self.loose_key(peer, int(plan.item_bundle[i]))
            start = int(plan.item_offset[i])
            jobs.append(self._get_job(obj, start, views))
        _stats.count(bytes_reassembled=sum(int(n) for n in plan.item_bytes[reads]))
        self.store.run_all(jobs)
        self._put_window(index, w, [out])

    def _get_job(self, obj: str, start: int, views: list[memoryview]) -> Any:
        n = sum(len(v) for v in views)
        store, bucket = self.store, self.bucket
        return functools.partial(
            store.call,
            f"{store.scheme}://{bucket}/{obj}",
            f"GET bytes {start}-{start + n - 1}",
            functools.partial(store.get_into, bucket, obj, start, views),
        )

    def build(self) -> None:
        """The mixed windows this process builds."""
        jobs = []
        for index, f in enumerate(self.plan.files):
            if f.whole_owner < 0:
                for w in np.flatnonzero((f.writer == self.me) & ~f.pure).tolist():
                    jobs.append(functools.partial(self._build, index, w))
        self.store.run_all(jobs)

    def compose(self) -> None:
        """GCS: the compose subtrees this process was given, level by level."""
        store = self.store
        assert isinstance(store, _gcs.GcsStore)
        fan_in = self.plan.limits.compose_fan_in
        for index, f in enumerate(self.plan.files):
            if f.whole_owner >= 0 or f.windows <= 1:
                continue
            key = self.base + f.name
            names = [_commit.window_key(key, w) for w in range(f.windows)]
            ready = self._ready_keys(f)
            for level, groups in enumerate(f.compose):
                targets, done = [], []
                for g, (composer, _) in enumerate(groups):
                    target = _commit.compose_key(key, level, g)
                    sources = names[g * fan_in : (g + 1) * fan_in]
                    if composer == self.me:
                        for k in ready[g * fan_in : (g + 1) * fan_in]:
                            self.kv.wait(k, f"{k} (sources of {target})")
                        url = f"{self.directory}/{f.name}"
                        _compose(store, url, self.bucket, target, sources)
                    targets.append(target)
                    done.append(f"c/{index}/{level}/{composer}")
                if any(c == self.me for c, _ in groups):
                    self.kv.set(f"c/{index}/{level}/{self.me}")
                names, ready = targets, done
            if f.top == self.me:  # the top level: this process finishes the file
                for k in sorted(set(ready)):
                    self.kv.wait(k, f"{k} (sources of {key})")
                url = f"{self.directory}/{f.name}"
                _compose(store, url, self.bucket, key, names)
                self.kv.set(f"top/{index}")

    def _delete_composed(self, store: _gcs.GcsStore) -> None:
        """GCS: the window objects and composites this process wrote, once the compose that
        used them is done (the top level's: once its finisher announced ``top``)."""
        fan_in = self.plan.limits.compose_fan_in
        for index, f in enumerate(self.plan.files):
            if f.whole_owner >= 0 or f.windows <= 1:
                continue
            key = self.base + f.name
            levels = [[p for p, _ in groups] for groups in f.compose]
            # (objects of one level, their writers, the key announcing their compose)
            writers = f.writer.tolist()
            doomed: list[str] = []
            for level in range(len(levels) + 1):
                names = (
                    [_commit.window_key(key, w) for w in range(f.windows)]
                    if level == 0
                    else [
                        _commit.compose_key(key, level - 1, g)
                        for g in range(len(levels[level - 1]))
                    ]
                )
                for i, (name, writer) in enumerate(zip(names, writers)):
                    if writer != self.me:
                        continue
                    done = (
                        f"c/{index}/{level}/{levels[level][i // fan_in]}"
                        if level < len(levels)
                        else f"top/{index}"
                    )
                    self.kv.wait(done, f"{done} (the compose of {name})")
                    doomed.append(name)
                if level < len(levels):
                    writers = levels[level]
            if doomed:
                store.call(
                    f"{self.directory}/{f.name}",
                    f"DELETE {len(doomed)} composed objects",
                    functools.partial(store.delete, self.bucket, doomed),
                )

    def cleanup(self) -> None:
        """Deletes this process's loose bundles once every builder reading them is done, and
        (GCS) its window objects and composites once they were composed."""
        if isinstance(self.store, _gcs.GcsStore):
            self._delete_composed(self.store)
        plan = self.plan
        mine = plan.item_owner == self.me
        if not mine.any():
            return
        for b in sorted(set(plan.item_builder[mine].tolist())):
            self.kv.wait(f"built/{b}", f"process {b} to build its windows")
        keys = [
            self.loose_key(self.me, int(k)) for k in sorted(set(plan.item_bundle[mine].tolist()))
        ]
        store, bucket = self.store, self.bucket
        store.call(
            f"{store.scheme}://{bucket}/{keys[0]}",
            f"DELETE {len(keys)} loose bundles",
            lambda: store.delete(bucket, keys),
        )


def _compose(store: _gcs.GcsStore, url: str, bucket: str, target: str, sources: list[str]) -> None:
    store.call(
        url,
        f"compose {len(sources)} objects into {target}",
        functools.partial(store.compose, bucket, target, sources),
    )
