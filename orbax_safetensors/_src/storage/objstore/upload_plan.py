"""The plan of a save by several processes on object storage: which windows (S3 parts, GCS
objects) each process uploads or builds, and the bytes it moves. Pure and deterministic: every
process computes the same plan from the files' sizes and every process's bytes of each.

A file one process owns is written whole by it. Another is cut into windows: a **pure** window,
inside one owner's range, is uploaded by that owner; a **mixed** one is built by the owner it
adds least to (a request weighing as 2 MiB moved), from the other owners' **loose** bundles
(one ranged GET per owner). GCS composes a file's objects in a tree spread over their writers;
each file's **finisher** creates and completes the S3 upload or composes the GCS top, so the
primary only commits. S3: every window but a file's last at least the minimum part, at most
10,000 per file; GCS: at most 32 objects per compose.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import numpy as np

from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.objstore import common as _common
from orbax_safetensors._src.storage.objstore.gcs import GCS_MAX_COMPOSE
from orbax_safetensors._src.storage.objstore.s3 import S3_MAX_PARTS

MiB = 1 << 20
# What one request weighs against bytes moved when builders are balanced: a window of many
# owners' short ranges costs its builder one GET per owner, however few its bytes.
_REQUEST_WEIGHT = 2 * MiB
# Mixed windows are cut where one would hold more than this many processes' ranges (but not
# under the store's minimum): its builder sends one GET per other owner.
MAX_WINDOW_OWNERS = 24


class StoreKind(enum.Enum):
    """The object store a plan is for."""

    S3 = "s3"
    GCS = "gs"


@dataclasses.dataclass(frozen=True)
class UploadLimits:
    """The sizes a plan obeys (the store's options and the providers' limits)."""

    part_size: int = 64 * MiB
    gcs_min_object: int = 1 * MiB
    compose_fan_in: int = GCS_MAX_COMPOSE
    s3_min_part: int = _config.S3_MIN_PART
    s3_max_parts: int = S3_MAX_PARTS

    @classmethod
    def of(cls, options: _config.ObjectStoreOptions) -> UploadLimits:
        """The limits of a store configured with ``options``."""
        return cls(part_size=options.part_size, gcs_min_object=options.gcs_min_object)

    def min_part(self, size: int) -> int:
        """Smallest S3 part but the last of a ``size``-byte file (<= ``s3_max_parts`` parts)."""
        return max(self.s3_min_part, -(-size // (self.s3_max_parts - 1)))


@dataclasses.dataclass(frozen=True)
class FileOwners:
    """Who owns which bytes of one file: process ``owners[i]`` owns ``[starts[i], next)``,
    where next is ``starts[i + 1]`` (``size`` for the last); the segments tile the file."""

    name: str
    size: int
    starts: np.ndarray  # int64, increasing, starts[0] == 0
    owners: np.ndarray  # int64 process indices

    @classmethod
    def from_segments(
        cls, name: str, size: int, segments: Mapping[int, Sequence[tuple[int, int]]]
    ) -> FileOwners:
        """From each process's ``[start, stop)`` byte ranges; ValueError naming the file and
        the bytes unless they tile ``[0, size)`` exactly (touching ranges of one owner join)."""
        items = sorted((a, b, p) for p, ranges in segments.items() for a, b in ranges if b > a)
        starts: list[int] = []
        owners: list[int] = []
        pos = 0
        for a, b, p in items:
            if a != pos:
                what = "owned by no process" if a > pos else "owned twice"
                raise ValueError(f"{name}: bytes {min(a, pos)}-{max(a, pos) - 1} are {what}")
            if not owners or owners[-1] != p:
                starts.append(a)
                owners.append(p)
            pos = b
        if pos != size or not starts:
            raise ValueError(f"{name}: bytes {pos}-{size - 1} are owned by no process")
        return cls(name, size, np.array(starts, np.int64), np.array(owners, np.int64))

    def stops(self) -> np.ndarray:
        return np.append(self.starts[1:], self.size)


@dataclasses.dataclass
class FileUpload:
    """The plan of one file: written whole by ``whole_owner``, or in windows."""

    name: str
    size: int
    whole_owner: int  # -1: several owners, see the windows
    wstart: np.ndarray  # window starts (int64); the last window ends at ``size``
    writer: np.ndarray  # who uploads each window: its owner (pure) or its builder (mixed)
    pure: np.ndarray  # bool: the writer owns the whole window
    # (window, owner, bytes) of every mixed window's owners, sorted by window then owner
    pair_window: np.ndarray
    pair_owner: np.ndarray
    pair_bytes: np.ndarray
    compose: list[list[tuple[int, int]]]  # GCS: per level below the top, (composer, sources)
    # The file's finisher (-1: none, the file is one writer's or one window): S3, creates, lists
    # and completes its upload; GCS, composes its top level. One of the writers of the top
    # level's sources, least loaded.
    top: int = -1

    @property
    def windows(self) -> int:
        return len(self.wstart)

    def wstop(self) -> np.ndarray:
        return np.append(self.wstart[1:], self.size)


@dataclasses.dataclass
class UploadPlan:
    """Every process's windows, the builders of the mixed ones and the loose bundles of one
    save (see the module docstring)."""

    kind: StoreKind
    limits: UploadLimits
    num_processes: int
    primary: int
    files: list[FileUpload]
    mixed_target: int  # bytes per mixed window (before the S3 minimum of large files)
    # loose items: bytes of a mixed window uploaded by an owner that does not build it
    item_owner: np.ndarray
    item_file: np.ndarray
    item_window: np.ndarray
    item_bytes: np.ndarray
    item_builder: np.ndarray
    item_bundle: np.ndarray  # bundle index among the owner's loose objects
    item_offset: np.ndarray  # offset of the item in its bundle


def _capped(seg_starts: np.ndarray, bounds: list[int], b: int, floor: int) -> list[int]:
    """``bounds`` (mixed window starts over ``[bounds[0], b)``), or, where one would hold more
    than ``MAX_WINDOW_OWNERS`` owners' ranges, windows cut before the range that would exceed
    it (each still >= ``floor`` bytes, no longer than the even ones): owners are often unevenly
    dense, and each costs the builder one GET."""
    edges = np.array([*bounds, b], np.int64)
    first = np.searchsorted(seg_starts, edges[:-1], "right")
    last = np.searchsorted(seg_starts, edges[1:], "left")
    if int((last - first).max()) < MAX_WINDOW_OWNERS:
        return bounds
    target = int((edges[1:] - edges[:-1]).max())
    out: list[int] = []
    x = bounds[0]
    while x < b:
        out.append(x)
        k = int(np.searchsorted(seg_starts, x, "right")) + MAX_WINDOW_OWNERS - 1
        cap = int(seg_starts[k]) if k < len(seg_starts) else b
        x = min(b, x + target, max(x + floor, cap))
    if len(out) > 1 and b - out[-1] < floor:  # the last is short: the one before gives bytes
        if b - out[-2] >= 2 * floor:
            out[-1] = b - floor
        else:
            out.pop()
    return out


def _windows(
    kind: StoreKind, limits: UploadLimits, f: FileOwners, mixed_target: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(window starts, owner of each pure window or -1)`` of a file with several owners: long
    ranges in pure windows of <= ``part_size``, the bytes between in mixed windows of about
    ``mixed_target``. A short run under the minimum borrows from the long range after it (on
    GCS, takes it whole if under twice the minimum), so no S3 part but the last is under the
    minimum, and a GCS file's header is no object of its own (two requests of the primary's).
    """
    s3 = kind is StoreKind.S3
    m = limits.min_part(f.size) if s3 else limits.gcs_min_object
    mixed = max(mixed_target, 2 * m) if s3 else mixed_target
    lengths = f.stops() - f.starts
    long = np.flatnonzero(lengths >= (2 * m if s3 else m))
    starts: list[int] = []
    pure: list[int] = []

    def add(a: int, b: int, target: int, owner: int) -> None:
        bounds = [a + start for start, _ in _common.even_chunks(b - a, target)]
        if owner < 0:
            bounds = _capped(f.starts, bounds, b, m)
        starts.extend(bounds)
        pure.extend([owner] * len(bounds))

    pos = 0
    for i in long.tolist():
        a, b, owner = int(f.starts[i]), int(f.starts[i] + lengths[i]), int(f.owners[i])
        if a > pos:
            if a - pos < m and (s3 or b - a >= 2 * m):  # borrow from this long range
                add(pos, pos + m, mixed, -1)
                a = pos + m
            elif a - pos < m:  # GCS: a short run and a long range that is not much longer
                add(pos, b, mixed, -1)
                pos = b
                continue
            else:
                add(pos, a, mixed, -1)
        add(a, b, limits.part_size, owner)
        pos = b
    if pos < f.size:
        add(pos, f.size, mixed, -1)
    return np.array(starts, np.int64), np.array(pure, np.int64)


def _pairs(
    f: FileOwners, wstart: np.ndarray, mixed: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window, owner, bytes) of the owners of the mixed windows, by window then owner."""
    starts, stops = f.starts, f.stops()
    first = np.searchsorted(wstart, starts, "right") - 1
    last = np.searchsorted(wstart, stops - 1, "right") - 1
    count = last - first + 1
    seg = np.repeat(np.arange(len(starts)), count)
    ramp = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    window = np.repeat(first, count) + ramp
    wstop = np.append(wstart[1:], f.size)
    nbytes = np.minimum(stops[seg], wstop[window]) - np.maximum(starts[seg], wstart[window])
    keep = mixed[window]
    key = window[keep] * n + f.owners[seg[keep]]
    unique, inverse = np.unique(key, return_inverse=True)
    total = np.bincount(inverse, weights=nbytes[keep]).astype(np.int64)
    return unique // n, unique % n, total


def _compose_levels(
    writer: np.ndarray, fan_in: int, load: np.ndarray, tasks: np.ndarray
) -> list[list[tuple[int, int]]]:
    """The compose tree below the top of a file whose window objects ``writer`` wrote: per
    level, ``(composer, sources)`` of each group of <= ``fan_in`` objects, the composer the
    group's writer with fewest tasks, then least load (both updated)."""
    levels: list[list[tuple[int, int]]] = []
    writers = writer.tolist()
    while len(writers) > fan_in:
        level = []
        for k in range(0, len(writers), fan_in):
            group = writers[k : k + fan_in]
            composer = min(set(group), key=lambda p: (tasks[p], load[p], p))
            load[composer] += _REQUEST_WEIGHT * 2  # the compose, and deleting the composite
            tasks[composer] += 2
            level.append((composer, len(group)))
        levels.append(level)
        writers = [c for c, _ in level]
    return levels


def plan_uploads(
    kind: StoreKind,
    limits: UploadLimits,
    files: Sequence[FileOwners],
    num_processes: int,
    primary: int = 0,
) -> UploadPlan:
    """The upload plan of a save of ``files`` (every file with every process's bytes of it) by
    ``num_processes`` processes."""
    n = num_processes
    total = sum(f.size for f in files)
    low = 2 * (limits.s3_min_part if kind is StoreKind.S3 else limits.gcs_min_object)
    mixed_target = int(min(limits.part_size, max(low, total // (4 * n))))
    # Balance by bytes moved: start from each process's own bytes.
    load = np.zeros(n, np.int64)
    # Requests each process was given per file or compose group (finishing a file, composing):
    # these go to the process with fewest so far (then the least loaded), whatever its bytes,
    # so that no process collects many.
    tasks = np.zeros(n, np.int64)
    # The primary owns every file's header, so it is an owner of more mixed windows than
    # anyone: a handicap of one request per file keeps it from building many of them.
    load[primary] += _REQUEST_WEIGHT * len(files)
    for f in files:
        load += np.bincount(f.owners, weights=f.stops() - f.starts, minlength=n).astype(np.int64)
    out: list[FileUpload] = []
    items: list[tuple[np.ndarray, ...]] = []
    for index, f in enumerate(files):
        if (f.owners == f.owners[0]).all():
            empty = np.zeros(0, np.int64)
            sole = int(f.owners[0])
            out.append(
                FileUpload(
                    f.name, f.size, sole, empty, empty, empty.astype(bool), empty, empty, empty, []
                )
            )
            continue
        wstart, pure_owner = _windows(kind, limits, f, mixed_target)
        mixed = pure_owner < 0
        pw, po, pb = _pairs(f, wstart, mixed, n)
        wsize = np.append(wstart[1:], f.size) - wstart
        writer = pure_owner.copy()
        bounds = np.searchsorted(pw, np.arange(len(wstart) + 1))
        alone = mixed & (np.diff(bounds) == 1)  # short ranges of one owner only: pure
        writer[alone] = po[bounds[:-1][alone]]
        mixed &= ~alone
        for w in np.flatnonzero(mixed).tolist():
            lo, hi = bounds[w], bounds[w + 1]
            owners_w, bytes_w = po[lo:hi], pb[lo:hi]
            # What building it adds: the others' bytes down and the window up, one GET per
            # other owner. The owner of most bytes adds least unless it is loaded already.
            added = 2 * (int(wsize[w]) - bytes_w) + _REQUEST_WEIGHT * len(owners_w)
            best = int(np.argmin(load[owners_w] + added))
            chosen = int(owners_w[best])
            writer[w] = chosen
            load[chosen] += int(added[best])
        others = po != writer[pw]
        items.append(
            (
                po[others],
                np.full(int(others.sum()), index, np.int64),
                pw[others],
                pb[others],
                writer[pw][others],
            )
        )
        compose, top = [], -1
        if kind is StoreKind.GCS:
            compose = _compose_levels(writer, limits.compose_fan_in, load, tasks)
        if len(wstart) > 1:
            # The file's finisher, one of the writers of its top level's sources: S3, it
            # creates the upload, lists the parts and completes it (3 requests); GCS, it
            # composes the top level (the sources are deleted by their writers).
            candidates = [c for c, _ in compose[-1]] if compose else writer.tolist()
            top = min(set(candidates), key=lambda p: (tasks[p], load[p], p))
            cost = 3 if kind is StoreKind.S3 else 1
            load[top] += _REQUEST_WEIGHT * cost
            tasks[top] += cost
        upload = FileUpload(f.name, f.size, -1, wstart, writer, ~mixed, pw, po, pb, compose, top)
        out.append(upload)
    columns: list[np.ndarray] = (
        [np.concatenate(c) for c in zip(*items)] if items else [np.zeros(0, np.int64)] * 5
    )
    owner, file, window, nbytes, builder = columns
    # Each process's loose bytes, in file and window order, cut into bundles of ~part_size.
    order = np.argsort(owner, kind="stable")
    owner, file, window, nbytes, builder = (
        a[order] for a in (owner, file, window, nbytes, builder)
    )
    cumulative = np.cumsum(nbytes) - nbytes
    head_of = np.searchsorted(owner, owner, "left")
    within = cumulative - cumulative[head_of] if len(owner) else cumulative
    bundle = within // limits.part_size
    bundle_start = np.zeros_like(within)
    if len(owner):
        # offset of each item inside its bundle: bytes before it in the same bundle
        key = owner * (int(bundle.max()) + 1) + bundle
        head = np.searchsorted(key, key, "left")
        bundle_start = within - within[head]
    return UploadPlan(
        kind,
        limits,
        n,
        primary,
        out,
        mixed_target,
        owner,
        file,
        window,
        nbytes,
        builder,
        bundle,
        bundle_start,
    )
