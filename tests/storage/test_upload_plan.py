"""The object-store upload plan of a multi-process save (issue 27 point 1): pure, the same on
every process; S3 parts >= 5 MiB but the last, GCS composes <= 32 sources; builders download
only the others' bytes of their windows and never upload their own bytes twice; what one
process's request list says equals the plan's per-process tally."""

from __future__ import annotations

import random

import numpy as np
import pytest

# tests/helpers/ is on sys.path (tests/conftest.py).
import upload_requests as _ur
from upload_requests import Phase, RequestKind

from orbax_safetensors._src.storage.objstore.upload_plan import (
    MAX_WINDOW_OWNERS,
    FileOwners,
    StoreKind,
    UploadLimits,
    plan_uploads,
)

MiB = 1 << 20
SMALL = UploadLimits(part_size=12 * MiB, gcs_min_object=256 << 10, compose_fan_in=4)


def _random_files(seed: int, n: int) -> list[FileOwners]:
    """Files cut into random ranges of random owners (short and long ranges mixed)."""
    rng = random.Random(seed)
    files = []
    for k in range(4):
        size = rng.choice([100, 3 * MiB, 40 * MiB, 90 * MiB])
        cuts = sorted({0, *(rng.randrange(size) for _ in range(rng.randrange(1, 40)))})
        segments: dict[int, list[tuple[int, int]]] = {}
        for a, b in zip(cuts, [*cuts[1:], size]):
            segments.setdefault(rng.randrange(n), []).append((a, b))
        files.append(FileOwners.from_segments(f"f{k}.safetensors", size, segments))
    files.append(FileOwners.from_segments("one.safetensors", 30 * MiB, {n - 1: [(0, 30 * MiB)]}))
    return files


@pytest.mark.parametrize("kind", list(StoreKind))
@pytest.mark.parametrize("seed", range(6))
def test_request_lists_match_the_tally_and_the_limits(kind: StoreKind, seed: int) -> None:
    n = 5
    files = _random_files(seed, n)
    plan = plan_uploads(kind, SMALL, files, n)
    again = plan_uploads(kind, SMALL, files, n)  # deterministic: every process plans alike
    tally = _ur.tally(plan)
    for p in range(n):
        mine = _ur.requests_of(plan, p)
        assert mine == _ur.requests_of(again, p)
        assert [r.phase for r in mine] == sorted(r.phase for r in mine)
        assert sum(r.upload for r in mine) == tally.upload[p]
        assert sum(r.download for r in mine) == tally.download[p]
        for k in RequestKind:
            assert sum(r.kind is k for r in mine) == tally.requests[k][p], (p, k)
        # Only a file's finisher, one of its writers, creates / completes / composes its top.
        finished = {r.file for r in mine if r.phase in (Phase.PREPARE, Phase.COMMIT)}
        for index in finished:
            fu = plan.files[index]
            assert fu.top == p and fu.windows > 1 and p in fu.writer, (p, index)
    for index, (f, fu) in enumerate(zip(files, plan.files)):
        owned = np.bincount(f.owners, weights=f.stops() - f.starts, minlength=n)
        if fu.whole_owner >= 0:
            continue
        sizes = fu.wstop() - fu.wstart
        assert sizes.sum() == f.size and (sizes > 0).all()
        if kind is StoreKind.S3:
            assert (sizes[:-1] >= SMALL.min_part(f.size)).all(), sizes
            assert len(sizes) <= SMALL.s3_max_parts
        # Every byte reaches its window once: the writer's own bytes plus the loose items.
        items = plan.item_file == index
        for w in range(fu.windows):
            at = items & (plan.item_window == w)
            assert (plan.item_builder[at] == fu.writer[w]).all()
            assert fu.writer[w] not in plan.item_owner[at]  # never re-uploads its own bytes
            mine = fu.pair_bytes[(fu.pair_window == w) & (fu.pair_owner == fu.writer[w])]
            own = int(mine.sum()) if not fu.pure[w] else int(sizes[w])
            assert own + int(plan.item_bytes[at].sum()) == sizes[w]
        loose = np.bincount(plan.item_owner[items], weights=plan.item_bytes[items], minlength=n)
        assert (loose <= owned).all()
    if kind is StoreKind.GCS:
        assert _ur.largest_compose(plan) <= SMALL.compose_fan_in


def test_owners_must_tile_the_file() -> None:
    with pytest.raises(ValueError, match=r"w.safetensors: bytes 10-19 are owned by no process"):
        FileOwners.from_segments("w.safetensors", 30, {0: [(0, 10)], 1: [(20, 30)]})
    with pytest.raises(ValueError, match=r"bytes 5-9 are owned twice"):
        FileOwners.from_segments("w.safetensors", 30, {0: [(0, 10)], 1: [(5, 30)]})
    with pytest.raises(ValueError, match=r"bytes 20-29 are owned by no process"):
        FileOwners.from_segments("w.safetensors", 30, {0: [(0, 20)]})


def test_long_ranges_are_direct_parts_and_short_ones_borrow_on_s3() -> None:
    size = 100 * MiB
    segments = {0: [(0, 1000)], 1: [(1000, 60 * MiB)], 2: [(60 * MiB, size)]}
    owners = [FileOwners.from_segments("w", size, segments)]
    plan = plan_uploads(StoreKind.S3, UploadLimits(), owners, 3)
    f = plan.files[0]
    # The header-sized range borrows 5 MiB - 1000 bytes from process 1's range to make a part
    # of 5 MiB; process 0, which moves least, builds it (process 1 moves 55 MiB already).
    assert f.wstart.tolist()[:2] == [0, 5 * MiB] and f.writer[0] == 0 and not f.pure[0]
    assert f.pure[1:].all() and set(f.writer[1:].tolist()) == {1, 2}
    assert _ur.tally(plan).download.tolist() == [5 * MiB - 1000, 0, 0]
    assert [r.kind for r in _ur.requests_of(plan, 0)] == [
        RequestKind.CREATE_UPLOAD,
        RequestKind.GET_RANGE,
        RequestKind.UPLOAD_PART,
        RequestKind.LIST_PARTS,
        RequestKind.COMPLETE_UPLOAD,
    ]
    assert [r.kind for r in _ur.requests_of(plan, 1)][-2:] == [
        RequestKind.PUT_LOOSE,
        RequestKind.DELETE,
    ]


def test_many_owners_spread_the_building() -> None:
    """64 processes each own 1/64 of every tensor of a file: every window is mixed, and the
    windows are built by many processes, not by the primary."""
    n, tensors, share = 64, 40, 200 << 10
    starts = np.arange(tensors * n, dtype=np.int64) * share
    owners = np.tile(np.arange(n), tensors)
    f = FileOwners("w", tensors * n * share, starts, owners)
    for kind in StoreKind:
        plan = plan_uploads(kind, UploadLimits(), [f], n)
        tally = _ur.tally(plan)
        moved = tally.upload + tally.download
        assert moved.max() <= 1.25 * f.size / n + 2 * 64 * MiB
        assert len(set(plan.files[0].writer.tolist())) == min(n, plan.files[0].windows)
        requests = tally.total_requests()
        assert requests.max() <= 2 * requests.mean(), requests


@pytest.mark.parametrize("kind", list(StoreKind))
def test_the_primary_sends_no_request_per_file(kind: StoreKind) -> None:
    """Many files, each split in contiguous ranges among its processes (each process's bytes
    of a file in one range): the per-file work (S3 create / list / complete, GCS top-level
    compose) is spread over each file's writers, so the primary is no outlier and no process
    sends more than 2x the mean requests."""
    n, count, size = 32, 60, 48 * MiB
    files = []
    for k in range(count):
        writers = [(k * 3 + j) % n for j in range(8)]  # 8 processes per file, rotating
        bounds = [size * j // 8 for j in range(9)]
        segments = {p: [(bounds[j], bounds[j + 1])] for j, p in enumerate(writers)}
        files.append(FileOwners.from_segments(f"f{k:03d}.safetensors", size, segments))
    plan = plan_uploads(kind, UploadLimits(part_size=8 * MiB), files, n)
    tally = _ur.tally(plan)
    requests = tally.total_requests()
    assert requests.max() <= 2 * requests.mean(), requests
    tops = [f.top for f in plan.files]
    assert all(f.top in f.writer for f in plan.files)
    assert tops.count(plan.primary) <= 2 * count / n + 1, tops
    per_file = RequestKind.CREATE_UPLOAD if kind is StoreKind.S3 else RequestKind.COMPOSE
    assert tally.requests[per_file].sum() >= count
    assert tally.requests[per_file][plan.primary] <= 2 * tally.requests[per_file].mean() + 1


@pytest.mark.parametrize("kind", list(StoreKind))
def test_a_dense_stretch_beside_a_sparse_one_keeps_windows_few_owners(kind: StoreKind) -> None:
    """One stretch of mixed bytes: 512 processes' 200 KiB ranges (a joined group of small
    tensors), then 512 ranges of 1.5 MiB. Cut evenly by the stretch's mean density, the dense
    part's windows held hundreds of owners and their builders one GET per owner; now no window
    holds more than MAX_WINDOW_OWNERS owners' ranges (S3: unless its minimum part needs more),
    every S3 part but the last is still >= 5 MiB, and the primary builds none."""
    n = 512
    small, large = 200 << 10, 1536 << 10
    lengths = np.array([small] * n + [large] * n, np.int64)
    starts = np.append(0, np.cumsum(lengths)[:-1])
    owners = np.tile(np.arange(n), 2)
    f = FileOwners("w", int(lengths.sum()), starts, owners)
    plan = plan_uploads(kind, UploadLimits(), [f], n)
    up = plan.files[0]
    per_window = np.bincount(up.pair_window, minlength=up.windows)
    limit = MAX_WINDOW_OWNERS + 1
    if kind is StoreKind.S3:
        limit = max(limit, -(-UploadLimits().s3_min_part // small) + 1)
    assert per_window.max() <= limit, per_window.max()
    sizes = up.wstop() - up.wstart
    if kind is StoreKind.S3:
        assert sizes[:-1].min() >= UploadLimits().s3_min_part
    assert plan.primary not in up.writer[~up.pure].tolist()
    # Each builder: one GET per other owner, its part, its own loose object and a few more.
    requests = _ur.tally(plan).total_requests()
    assert requests.max() <= limit + 6, requests
