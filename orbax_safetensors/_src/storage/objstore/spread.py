"""One process's part of a save by several processes on S3 or GCS, over ``jax.distributed``'s
key-value store: every process publishes which bytes of which file it holds, computes the same
plan (:mod:`.upload_plan`) and sends its own requests phase by phase (:func:`execute`). A
failing process sets ``failed``; every wait raises as soon as it sees that, naming the process
and step. ``docs/object-storage.md`` tells the protocol step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore import gcs as _gcs
from orbax_safetensors._src.storage.objstore import s3 as _s3
from orbax_safetensors._src.storage.objstore import upload_plan as _up

LOOSE_DIR = "_loose"  # under the staging directory: every process's loose bundles
WAIT_SECONDS = 600.0  # longest wait for another process's step
POLL_SECONDS = 2.0  # how often a wait checks whether another process failed
FAILED = "failed"  # the key a failing process sets: "process <p>: <error>"
_lock = threading.Lock()  # guards _last
Store = _s3.S3Store | _gcs.GcsStore


@dataclasses.dataclass
class Save:
    """A registered directory: its files and what this process wrote of them."""

    files: list[tuple[str, int]]
    is_primary: bool
    process: int
    count: int
    key: str  # key-value store namespace of this save
    written: dict[str, list[_common.Segment]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    """What :func:`execute` got to before it returned or raised (for the clean-up)."""

    plan: _up.UploadPlan | None = None
    upload_ids: dict[str, str] = dataclasses.field(default_factory=dict)  # created here
    completed: set[str] = dataclasses.field(default_factory=set)  # of those, completed


_last: list[tuple[_up.UploadPlan, int]] = []  # the last plan this process executed, and its index


def last_plan() -> tuple[_up.UploadPlan, int] | None:
    """The plan of the last spread save this process finished, and its process index (tests
    compare what it sent with the plan)."""
    with _lock:
        return _last[-1] if _last else None


class SaveKeys:
    """The steps of one save in the key-value store, under ``prefix`` (``osf/<directory>/<n>``,
    ``n`` counting the saves of that directory in this job), each set once. Every process sets
    ``done/<p>`` last, failed or not; the primary waits for them all (:meth:`wait_done`) before
    it commits or cleans up, then deletes the keys."""

    def __init__(self, prefix: str, directory: str) -> None:
        self.client: Any = _jaxcompat.require_distributed_kv(f"a save to {directory}")
        self.prefix = prefix
        self.directory = directory
        self.seen: set[str] = set()

    def set(self, key: str, value: str = "1") -> None:  # (once per save)
        self.client.key_value_set(f"{self.prefix}/{key}", value)

    def get(self, key: str, what: str, *, watch_failed: bool = True) -> str:
        """The value of ``key`` once a process set it; an ObjectStoreError naming ``what`` after
        :data:`WAIT_SECONDS`, or once another process reported its failure (``watch_failed``)."""
        full = f"{self.prefix}/{key}"
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            left = deadline - time.monotonic()
            step = min(left, POLL_SECONDS) if watch_failed else left
            try:
                value = self.client.blocking_key_value_get(full, max(1, int(step * 1000)))
                break
            except Exception as error:
                if watch_failed:
                    failed = self.failure()
                    if failed is not None:
                        raise _common.ObjectStoreError(
                            self.directory,
                            f"waiting for {what}",
                            1,
                            RuntimeError(f"the save failed on {failed}"),
                        ) from None
                if time.monotonic() >= deadline:
                    raise _common.ObjectStoreError(
                        self.directory, f"waiting {WAIT_SECONDS:.0f} s for {what}", 1, error
                    ) from error
        self.seen.add(key)
        return str(value)

    def wait(self, key: str, what: str) -> None:
        """Returns once ``key`` is set (see :meth:`get`)."""
        if key not in self.seen:
            self.get(key, what)

    def try_get(self, key: str) -> str | None:
        """The value of ``key`` if a process set it, else None (without waiting)."""
        return _jaxcompat.distributed_kv_try_get(self.client, f"{self.prefix}/{key}")

    def failure(self) -> str | None:  # (what the first failing process reported)
        return _jaxcompat.distributed_kv_try_get(self.client, f"{self.prefix}/{FAILED}")

    def fail(self, process: int, error: BaseException) -> None:
        """Reports this process's failure to the others (the first report stays)."""
        with contextlib.suppress(Exception):  # set already by another process
            self.set(FAILED, f"process {process}: {_common.describe_error(error)}")

    def wait_done(self, count: int, me: int) -> list[int]:
        """The primary, after its own ``done``: waits for every process's ``done/<p>``; the
        processes that failed or never answered."""
        failed = []
        for p in range(count):
            if p == me:
                continue
            try:
                if self.get(f"done/{p}", f"process {p} to finish", watch_failed=False) != "ok":
                    failed.append(p)
            except _common.ObjectStoreError:
                failed.append(p)
        return failed

    def delete(self) -> None:  # (the primary, once every process is done)
        with contextlib.suppress(Exception):  # best effort: the save's outcome matters more
            self.client.key_value_delete(self.prefix)  # (and every key under prefix/)


def window_key(key: str, w: int) -> str:
    """The staged object of window ``w`` of the object ``key`` (GCS)."""
    return f"{_common.staging_prefix(key)}w-{w:06d}"


def compose_key(key: str, level: int, group: int) -> str:
    """The composite of group ``group`` of compose level ``level`` of the object ``key``."""
    return f"{_common.staging_prefix(key)}c{level}-{group:06d}"


def write_whole(store: Store, url: str, bucket: str, key: str, seg: _common.Segment) -> None:
    """Writes the object ``key`` from ``seg`` (all of its bytes): one PUT up to ``part_size``,
    else a multipart (S3) or parallel composite (GCS) upload."""
    options = store.options
    if seg.size <= options.part_size:
        store.call(url, f"PUT {seg.size} bytes", store.put, bucket, key, seg.views)
        return
    chunks = _common.even_chunks(seg.size, options.part_size)
    if isinstance(store, _s3.S3Store):
        _s3.write_multipart(store, url, bucket, key, seg, chunks)
    else:
        _gcs.write_composed(store, url, bucket, key, seg, chunks)


def commit_file(store: Store, directory: str, bucket: str, base: str, f: Mapping[str, Any]) -> None:
    """Completes one file several processes wrote, as a commit record lists it: S3, completes
    upload ``f["upload_id"]`` (an error naming the parts never uploaded); GCS, composes the
    ``f["sources"]`` composites of level ``f["level"]`` into the file and deletes them."""
    if "upload_id" not in f and "level" not in f:
        return
    url, key = f"{directory}/{f['name']}", base + f["name"]
    if isinstance(store, _s3.S3Store):
        upload_id, count = str(f["upload_id"]), int(f["parts"])
        parts = store.call(url, "ListParts", store.list_parts, bucket, key, upload_id)
        numbers = sorted(n for n, _ in parts)
        if numbers != list(range(1, count + 1)):
            missing = sorted(set(range(1, count + 1)) - set(numbers))
            raise _common.ObjectStoreError(
                url, "finalize", 1, RuntimeError(f"parts {missing[:10]} were never uploaded")
            )
        _s3.complete(store, url, bucket, key, upload_id, parts, int(f["size"]))
        return
    level, count = int(f["level"]), int(f["sources"])
    sources = [compose_key(key, level, g) for g in range(count)]
    _gcs.compose_into(store, url, bucket, key, sources)
    store.call(url, f"DELETE {len(sources)} composed objects", store.delete, bucket, sources)


def _slices(segments: Sequence[_common.Segment], a: int, b: int) -> list[memoryview]:
    # Views of this process's bytes within [a, b), in offset order.
    out: list[memoryview] = []
    for s in segments:
        if s.end > a and s.start < b:
            out += s.slice(max(a, s.start), min(b, s.end))
    return out


def _peer_ranges(f: _up.FileOwners, a: int, b: int) -> dict[int, list[tuple[int, int]]]:
    # Each owner's ranges within [a, b) of the file, in offset order.
    stops = f.stops()
    lo = int(np.searchsorted(stops, a, "right"))
    hi = int(np.searchsorted(f.starts, b, "left"))
    out: dict[int, list[tuple[int, int]]] = {}
    for i in range(lo, hi):
        out.setdefault(int(f.owners[i]), []).append(
            (max(a, int(f.starts[i])), min(b, int(stops[i])))
        )
    return out


def execute(store: Store, directory: str, save: Save, kv: SaveKeys, outcome: Outcome) -> None:
    """This process's requests of the save of ``directory`` (see the module docstring), once it
    wrote its files; ``outcome`` records the plan and the uploads created (for a clean-up)."""
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
            raise _common.ObjectStoreError(
                f"{directory}/{name}", "planning the upload", 1, error
            ) from error
    kind = _up.StoreKind.S3 if s3 else _up.StoreKind.GCS
    limits = _up.UploadLimits.of(store.options)
    plan = outcome.plan = _up.plan_uploads(kind, limits, owners, save.count, primary)
    bucket, base = _common.split_directory(directory)
    ids = outcome.upload_ids
    if s3:
        assert isinstance(store, _s3.S3Store)
        # The uploads of the files this process finishes (the plan needs them all, and no
        # other): created before anyone writes, their ids published for the parts' writers.
        for index, f in enumerate(plan.files):
            if f.top == me:
                url = f"{directory}/{f.name}"
                ids[f.name] = store.call(
                    url, "CreateMultipartUpload", store.create_upload, bucket, base + f.name
                )
                kv.set(f"up/{index}", ids[f.name])
    run = _Run(store, directory, bucket, base, plan, owners, save, kv, dict(ids))
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


@dataclasses.dataclass
class _Run:
    """The requests of one process for one save."""

    store: Store
    directory: str
    bucket: str
    base: str
    plan: _up.UploadPlan
    owners: list[_up.FileOwners]
    save: Save
    kv: SaveKeys
    ids: dict[str, str]
    # GCS: per file (its URL), the objects this process wrote and the key announcing their compose
    composed: dict[str, list[tuple[str, str]]] = dataclasses.field(default_factory=dict)

    @property
    def me(self) -> int:
        return self.save.process

    def loose_key(self, process: int, bundle: int) -> str:
        return f"{self.base}{_common.STAGING_DIR}/{LOOSE_DIR}/{process:06d}-{bundle:06d}"

    def _put_window(self, index: int, w: int, views: list[memoryview]) -> None:
        f = self.plan.files[index]
        url, key = f"{self.directory}/{f.name}", self.base + f.name
        store, bucket = self.store, self.bucket
        if f.windows == 1:
            store.call(url, "PUT", store.put, bucket, key, views)
        elif isinstance(store, _s3.S3Store):
            upload_id = self.upload_id(index)
            store.call(
                url, f"UploadPart {w + 1}", store.upload_part, bucket, key, upload_id, w + 1, views
            )
        else:
            obj = window_key(key, w)
            store.call(url, f"PUT window {obj}", store.put, bucket, obj, views)

    def upload_id(self, index: int) -> str:  # S3: the UploadId of file ``index``
        name = self.plan.files[index].name
        if name not in self.ids:
            finisher = int(self.plan.files[index].top)
            self.ids[name] = self.kv.get(
                f"up/{index}", f"process {finisher} to create the upload of {name}"
            )
        return self.ids[name]

    def _ready_keys(self, f: _up.FileUpload) -> list[str]:
        # The key announcing each window of f uploaded (its writer's own or built).
        return [
            f"own/{p}" if pure else f"built/{p}"
            for p, pure in zip(f.writer.tolist(), f.pure.tolist())
        ]

    def complete(self, completed: set[str]) -> None:
        """S3: completes the uploads of the files this process finishes, once every part's
        writer announced it; adds each file's name to ``completed``."""
        store = self.store
        assert isinstance(store, _s3.S3Store)
        for f in self.plan.files:
            if f.top != self.me:
                continue
            for k in sorted(set(self._ready_keys(f))):
                self.kv.wait(k, f"{k} (parts of {f.name})")
            entry = {
                "name": f.name,
                "size": f.size,
                "parts": f.windows,
                "upload_id": self.ids[f.name],
            }
            commit_file(store, self.directory, self.bucket, self.base, entry)
            completed.add(f.name)

    def own(self) -> None:  # files this process owns whole, its pure windows, loose bundles
        jobs: list[Any] = []
        written = self.save.written
        for index, f in enumerate(self.plan.files):
            segs = written.get(f.name, [])
            url = f"{self.directory}/{f.name}"
            if f.whole_owner == self.me:
                seg = segs[0] if segs else _common.Segment(0, [], 0)
                key = self.base + f.name
                jobs.append(functools.partial(write_whole, self.store, url, self.bucket, key, seg))
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
            url = f"{self.store.scheme}://{self.bucket}/{obj}"
            put = self.store.put
            jobs.append(
                functools.partial(
                    self.store.call, url, "PUT loose bundle", put, self.bucket, obj, views
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
            url = f"{self.store.scheme}://{self.bucket}/{obj}"
            what = f"GET bytes {start}-{start + sum(len(v) for v in views) - 1}"
            get = self.store.get_into
            jobs.append(
                functools.partial(self.store.call, url, what, get, self.bucket, obj, start, views)
            )
        _common.count(bytes_reassembled=sum(int(n) for n in plan.item_bytes[reads]))
        self.store.run_all(jobs)
        self._put_window(index, w, [out])

    def build(self) -> None:  # the mixed windows this process builds
        jobs = []
        for index, f in enumerate(self.plan.files):
            if f.whole_owner < 0:
                for w in np.flatnonzero((f.writer == self.me) & ~f.pure).tolist():
                    jobs.append(functools.partial(self._build, index, w))
        self.store.run_all(jobs)

    def compose(self) -> None:  # GCS: the compose subtrees this process was given, by level
        store = self.store
        assert isinstance(store, _gcs.GcsStore)
        fan_in = self.plan.limits.compose_fan_in
        for index, f in enumerate(self.plan.files):
            if f.top < 0:
                continue
            key, url = self.base + f.name, f"{self.directory}/{f.name}"
            names = [window_key(key, w) for w in range(f.windows)]
            writers, ready = f.writer.tolist(), self._ready_keys(f)
            # The objects this process wrote, each with the key announcing the compose that
            # used it (cleanup deletes them once it is set).
            doomed = self.composed.setdefault(url, [])
            for level, groups in enumerate(f.compose):
                targets, done = [], []
                for g, (composer, _) in enumerate(groups):
                    target = compose_key(key, level, g)
                    part = slice(g * fan_in, (g + 1) * fan_in)
                    if composer == self.me:
                        for k in ready[part]:
                            self.kv.wait(k, f"{k} (sources of {target})")
                        _gcs.compose_into(store, url, self.bucket, target, names[part])
                    announced = f"c/{index}/{level}/{composer}"
                    doomed += [
                        (n, announced) for n, p in zip(names[part], writers[part]) if p == self.me
                    ]
                    targets.append(target)
                    done.append(announced)
                if any(c == self.me for c, _ in groups):
                    self.kv.set(f"c/{index}/{level}/{self.me}")
                names, ready, writers = targets, done, [c for c, _ in groups]
            doomed += [(n, f"top/{index}") for n, p in zip(names, writers) if p == self.me]
            if f.top == self.me:  # the top level: this process finishes the file
                for k in sorted(set(ready)):
                    self.kv.wait(k, f"{k} (sources of {key})")
                _gcs.compose_into(store, url, self.bucket, key, names)
                self.kv.set(f"top/{index}")

    def cleanup(self) -> None:  # deletes what this process wrote once no one reads it
        store, bucket = self.store, self.bucket
        for url, doomed in self.composed.items():  # GCS: once the compose using each is done
            for name, done in doomed:
                self.kv.wait(done, f"{done} (the compose of {name})")
            if doomed:
                what = f"DELETE {len(doomed)} composed objects"
                store.call(url, what, store.delete, bucket, [name for name, _ in doomed])
        plan = self.plan
        mine = plan.item_owner == self.me
        if not mine.any():
            return
        for b in sorted(set(plan.item_builder[mine].tolist())):
            self.kv.wait(f"built/{b}", f"process {b} to build its windows")
        keys = [
            self.loose_key(self.me, int(k)) for k in sorted(set(plan.item_bundle[mine].tolist()))
        ]
        store.call(
            f"{store.scheme}://{bucket}/{keys[0]}",
            f"DELETE {len(keys)} loose bundles",
            lambda: store.delete(bucket, keys),
        )
