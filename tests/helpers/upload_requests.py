"""What an object-store upload plan (``storage/objstore/upload_plan.UploadPlan``) asks of each
process, as the tests and ``benchmarks/scale_sim.py`` count it: the list of one process's
requests (:func:`requests_of`: what the engine, ``storage/objstore/spread.py``, sends, which the
multi-process tests compare with the counters each process measured) and every process's bytes
and request counts at once (:func:`tally`, the same sums, computed with array operations so
that a simulation of thousands of processes stays fast), plus the plan's limits as figures
(:func:`part_figures`, :func:`compose_depth`, :func:`largest_compose`).

Example::

    plan = upload_plan.plan_uploads(StoreKind.GCS, UploadLimits(), owners, num_processes=4)
    mine = requests_of(plan, 2)
    assert sum(r.upload for r in mine) == tally(plan).upload[2]
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from orbax_safetensors._src.storage.objstore.upload_plan import FileUpload, StoreKind, UploadPlan

_PAGE = 1000  # parts per S3 ListParts page; keys per S3 DeleteObjects request


class Phase(enum.IntEnum):
    """When a request is sent, in the order of a save."""

    PREPARE = 0  # a file's finisher, before anyone writes (S3 CreateMultipartUpload)
    OWN = 1  # every process: its own bytes (whole files, pure windows, loose objects)
    BUILD = 2  # builders: mixed windows and compose subtrees (after the owners' OWN phase)
    CLEANUP = 3  # owners delete their loose objects (after their builders' BUILD phase)
    COMMIT = 4  # a file's finisher: complete its upload / compose its top level


class RequestKind(enum.Enum):
    """One request to the object store."""

    PUT_OBJECT = "put_object"  # a final object in one PUT
    PUT_STAGED = "put_staged"  # GCS: one object of one owner's bytes (a pure window, a chunk)
    PUT_LOOSE = "put_loose"  # a bundle of a process's bytes that builders fetch
    PUT_FILLER = "put_filler"  # GCS: a mixed window's object, built by its builder
    CREATE_UPLOAD = "create_upload"  # S3 CreateMultipartUpload
    UPLOAD_PART = "upload_part"  # S3 UploadPart
    LIST_PARTS = "list_parts"  # S3 ListParts (the ETags to complete with), one per 1,000 parts
    COMPLETE_UPLOAD = "complete_upload"  # S3 CompleteMultipartUpload
    GET_RANGE = "get_range"  # a ranged GET of another process's loose object
    COMPOSE = "compose"  # GCS compose
    DELETE = "delete"  # S3: one DeleteObjects of <= 1,000 keys; GCS: one object


WRITE_KINDS = frozenset(
    k for k in RequestKind if k not in (RequestKind.GET_RANGE, RequestKind.LIST_PARTS)
)
"""Kinds that write (create or delete) objects: what a bucket's write-rate limit counts."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a process: its kind, phase, file (index in the plan; -1 for a loose
    bundle, which may hold bytes of several files) and bytes moved. ``start``/``stop``: the
    file bytes of a part or window object (of a GET: the bytes in the peer's loose object);
    ``number``: S3 part number, bundle index (loose objects, GETs) or compose level; ``peer``:
    whose loose object a GET reads; ``window``: the window a part or GET is for; ``sources``:
    objects composed or deleted (parts completed)."""

    kind: RequestKind
    phase: Phase
    file: int
    upload: int = 0
    download: int = 0
    start: int = 0
    stop: int = 0
    number: int = 0
    peer: int = -1
    window: int = -1
    sources: int = 0


@dataclasses.dataclass
class Tally:
    """Per process (arrays indexed by process): bytes uploaded and downloaded, and requests
    of each kind."""

    upload: np.ndarray
    download: np.ndarray
    requests: dict[RequestKind, np.ndarray]

    def total_requests(self) -> np.ndarray:
        """Requests of every kind, per process."""
        return np.sum(list(self.requests.values()), axis=0)


def _chunks(size: int, target: int) -> list[int]:
    """Sizes of the fewest near-equal chunks of ``size`` bytes of <= ``target`` each."""
    n = max(1, -(-size // target))
    bounds = [size * k // n for k in range(n + 1)]
    return [bounds[k + 1] - bounds[k] for k in range(n)]


def _tree(count: int, fan_in: int) -> list[int]:
    """Compose calls per level (top last) joining ``count`` objects, <= ``fan_in`` each."""
    levels = []
    while count > fan_in:
        count = -(-count // fan_in)
        levels.append(count)
    return [*levels, 1]


def _whole(plan: UploadPlan, index: int, f: FileUpload) -> list[Request]:
    """A file one process owns all of: one PUT, or its own multipart upload / compose."""
    if f.size <= plan.limits.part_size:
        return [Request(RequestKind.PUT_OBJECT, Phase.OWN, index, upload=f.size, stop=f.size)]
    sizes = _chunks(f.size, plan.limits.part_size)
    out: list[Request] = []
    s3 = plan.kind is StoreKind.S3
    if s3:
        out.append(Request(RequestKind.CREATE_UPLOAD, Phase.OWN, index))
    pos = 0
    for k, n in enumerate(sizes):
        kind = RequestKind.UPLOAD_PART if s3 else RequestKind.PUT_STAGED
        out.append(Request(kind, Phase.OWN, index, upload=n, start=pos, stop=pos + n, number=k + 1))
        pos += n
    if s3:
        return [*out, Request(RequestKind.COMPLETE_UPLOAD, Phase.OWN, index, sources=len(sizes))]
    levels = _tree(len(sizes), plan.limits.compose_fan_in)
    for level, calls in enumerate(levels):
        out += [Request(RequestKind.COMPOSE, Phase.OWN, index, number=level)] * calls
    deleted = len(sizes) + sum(levels[:-1])  # the chunks and the intermediate objects
    return [*out, *[Request(RequestKind.DELETE, Phase.OWN, index, sources=1)] * deleted]


def requests_of(plan: UploadPlan, process: int) -> list[Request]:
    """The requests ``process`` sends for the save, by phase, then file, then window."""
    out: list[Request] = []
    s3 = plan.kind is StoreKind.S3
    for index, f in enumerate(plan.files):
        if f.whole_owner >= 0:
            if f.whole_owner == process:
                out += _whole(plan, index, f)
            continue
        k = f.windows
        finisher = k > 1 and f.top == process
        if finisher and s3:
            out.append(Request(RequestKind.CREATE_UPLOAD, Phase.PREPARE, index))
        wstop = f.wstop()
        for w in np.flatnonzero(f.writer == process).tolist():
            a, b = int(f.wstart[w]), int(wstop[w])
            phase = Phase.OWN if f.pure[w] else Phase.BUILD
            if not f.pure[w]:
                reads = (plan.item_file == index) & (plan.item_window == w)
                for i in np.flatnonzero(reads).tolist():
                    offset = int(plan.item_offset[i])
                    nbytes = int(plan.item_bytes[i])
                    out.append(
                        Request(
                            RequestKind.GET_RANGE,
                            Phase.BUILD,
                            index,
                            download=nbytes,
                            start=offset,
                            stop=offset + nbytes,
                            number=int(plan.item_bundle[i]),
                            peer=int(plan.item_owner[i]),
                            window=w,
                        )
                    )
            if k == 1:
                kind = RequestKind.PUT_OBJECT
            elif s3:
                kind = RequestKind.UPLOAD_PART
            else:
                kind = RequestKind.PUT_STAGED if f.pure[w] else RequestKind.PUT_FILLER
            out.append(
                Request(kind, phase, index, upload=b - a, start=a, stop=b, number=w + 1, window=w)
            )
        if not s3 and k > 1:  # window objects: deleted by their writers once composed
            mine = int((f.writer == process).sum())
            out += [Request(RequestKind.DELETE, Phase.CLEANUP, index, sources=1)] * mine
        for level, groups in enumerate(f.compose):
            for composer, sources in groups:
                if composer == process:
                    out.append(
                        Request(
                            RequestKind.COMPOSE, Phase.BUILD, index, number=level, sources=sources
                        )
                    )
                    # deleted once composed at the next level (or the top)
                    out.append(Request(RequestKind.DELETE, Phase.CLEANUP, index, sources=1))
        if finisher and s3:
            out.append(Request(RequestKind.LIST_PARTS, Phase.COMMIT, index, sources=k))
            out += [Request(RequestKind.LIST_PARTS, Phase.COMMIT, index)] * ((k - 1) // _PAGE)
            out.append(Request(RequestKind.COMPLETE_UPLOAD, Phase.COMMIT, index, sources=k))
        elif finisher:
            top = len(f.compose[-1]) if f.compose else k
            level = len(f.compose)
            out.append(Request(RequestKind.COMPOSE, Phase.COMMIT, index, number=level, sources=top))
    bundles = _bundles_of(plan, process)
    for bundle, nbytes in bundles:
        out.append(Request(RequestKind.PUT_LOOSE, Phase.OWN, -1, upload=nbytes, number=bundle))
    if bundles:
        if s3:
            for k in range(0, len(bundles), _PAGE):
                n = len(bundles[k : k + _PAGE])
                out.append(Request(RequestKind.DELETE, Phase.CLEANUP, -1, sources=n))
        else:
            out += [Request(RequestKind.DELETE, Phase.CLEANUP, -1, sources=1)] * len(bundles)
    return sorted(out, key=lambda r: r.phase)


def _bundles_of(plan: UploadPlan, process: int) -> list[tuple[int, int]]:
    """``(bundle index, bytes)`` of ``process``'s loose objects."""
    mask = plan.item_owner == process
    bundles, inverse = np.unique(plan.item_bundle[mask], return_inverse=True)
    sizes = np.bincount(inverse, weights=plan.item_bytes[mask], minlength=len(bundles))
    return [(int(b), int(n)) for b, n in zip(bundles, sizes.astype(np.int64))]


def tally(plan: UploadPlan) -> Tally:
    """Every process's bytes and request counts: what :func:`requests_of` lists, summed."""
    n = plan.num_processes
    t = Tally(
        np.zeros(n, np.int64),
        np.zeros(n, np.int64),
        {k: np.zeros(n, np.int64) for k in RequestKind},
    )
    s3 = plan.kind is StoreKind.S3
    for index, f in enumerate(plan.files):
        if f.whole_owner >= 0:
            for r in _whole(plan, index, f):
                t.requests[r.kind][f.whole_owner] += 1
                t.upload[f.whole_owner] += r.upload
            continue
        k = f.windows
        size = f.wstop() - f.wstart
        if k == 1:
            t.requests[RequestKind.PUT_OBJECT][f.writer[0]] += 1
        elif s3:
            t.requests[RequestKind.UPLOAD_PART] += np.bincount(f.writer, minlength=n)
        else:
            t.requests[RequestKind.PUT_STAGED] += np.bincount(f.writer[f.pure], minlength=n)
            t.requests[RequestKind.PUT_FILLER] += np.bincount(f.writer[~f.pure], minlength=n)
        t.upload += np.bincount(f.writer, weights=size, minlength=n).astype(np.int64)
        if not s3 and k > 1:
            t.requests[RequestKind.DELETE] += np.bincount(f.writer, minlength=n)
        for groups in f.compose:  # each composite is deleted by its composer once composed
            composers = np.array([c for c, _ in groups], np.int64)
            t.requests[RequestKind.COMPOSE] += np.bincount(composers, minlength=n)
            t.requests[RequestKind.DELETE] += np.bincount(composers, minlength=n)
        if k > 1:  # the file's finisher
            if s3:
                t.requests[RequestKind.CREATE_UPLOAD][f.top] += 1
                t.requests[RequestKind.LIST_PARTS][f.top] += 1 + (k - 1) // _PAGE
                t.requests[RequestKind.COMPLETE_UPLOAD][f.top] += 1
            else:
                t.requests[RequestKind.COMPOSE][f.top] += 1
    # loose items: uploaded by their owners, downloaded by their builders
    t.requests[RequestKind.GET_RANGE] += np.bincount(plan.item_builder, minlength=n)
    t.download += np.bincount(plan.item_builder, weights=plan.item_bytes, minlength=n).astype(
        np.int64
    )
    t.upload += np.bincount(plan.item_owner, weights=plan.item_bytes, minlength=n).astype(np.int64)
    if len(plan.item_owner):
        key = plan.item_owner * (int(plan.item_bundle.max()) + 1) + plan.item_bundle
        first = np.flatnonzero(np.append(True, key[1:] != key[:-1]))
        bundles = np.bincount(plan.item_owner[first], minlength=n)
        t.requests[RequestKind.PUT_LOOSE] += bundles
        t.requests[RequestKind.DELETE] += -(-bundles // _PAGE) if s3 else bundles
    return t


def part_figures(plan: UploadPlan) -> tuple[int, int | None]:
    """``(most parts of one S3 upload or GCS objects of one file, smallest part or window
    object but a file's last)``; None when no file has more than one."""
    most, smallest = 0, None
    for f in plan.files:
        if f.whole_owner >= 0:
            sizes = (
                _chunks(f.size, plan.limits.part_size)
                if f.size > plan.limits.part_size
                else [f.size]
            )
        else:
            sizes = (f.wstop() - f.wstart).tolist()
        most = max(most, len(sizes))
        if len(sizes) > 1:
            low = min(sizes[:-1])
            smallest = low if smallest is None else min(smallest, low)
    return most, smallest


def compose_depth(plan: UploadPlan) -> int:
    """Levels of the deepest GCS compose tree of the plan (0 on S3 or without composes)."""
    if plan.kind is not StoreKind.GCS:
        return 0
    depth = 0
    for f in plan.files:
        if f.whole_owner >= 0:
            if f.size > plan.limits.part_size:
                depth = max(
                    depth,
                    len(
                        _tree(
                            len(_chunks(f.size, plan.limits.part_size)), plan.limits.compose_fan_in
                        )
                    ),
                )
        elif f.windows > 1:
            depth = max(depth, len(f.compose) + 1)
    return depth


def largest_compose(plan: UploadPlan) -> int:
    """The most sources of any one compose call of the plan."""
    most = 0
    for f in plan.files:
        for groups in f.compose:
            most = max(most, *(s for _, s in groups))
        if f.whole_owner < 0 and f.windows > 1:
            most = max(most, len(f.compose[-1]) if f.compose else f.windows)
        elif f.whole_owner >= 0 and f.size > plan.limits.part_size:
            most = max(
                most, min(plan.limits.compose_fan_in, len(_chunks(f.size, plan.limits.part_size)))
            )
    return most
