"""storage/buffers.StagingRing: one host buffer reused as a ring by a restore onto an
accelerator; space is taken again only once the transfers out of it are done."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from orbax_safetensors._src.storage import buffers as _buffers

KiB, MiB = 1 << 10, 1 << 20


class Transfers:
    """Stands for the device transfers out of held space: records which groups were waited
    for, and in which order."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_for(self, group: int):
        return lambda: self.waited.append(group)


def _inside(ring: _buffers.StagingRing, view: np.ndarray) -> tuple[int, int]:
    start = view.ctypes.data - ring._ring.ctypes.data
    assert start >= 0 and start + view.nbytes <= ring.capacity
    return start, start + view.nbytes


def test_takes_are_aligned_placed_and_never_overlap_until_waited():
    ring = _buffers.StagingRing(MiB)
    transfers = Transfers()
    spans = []
    for k, (n, offset) in enumerate([(1000, 8192 + 64), (300, None), (4096, 4096 * 9 + 640)]):
        view = ring.take(n, file_offset=offset)
        assert view.nbytes == n and view.dtype == np.uint8
        assert view.ctypes.data % _buffers.ALIGNMENT == 0
        if offset is not None:
            assert (view.ctypes.data - offset) % 4096 == 0  # direct I/O fills it in place
        spans.append(_inside(ring, view))
        ring.hold(transfers.wait_for(k))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert transfers.waited == [] and ring.waits == 0


def test_an_offset_not_a_multiple_of_64_gets_a_64_byte_aligned_buffer():
    ring = _buffers.StagingRing(MiB)
    view = ring.take(100, file_offset=4096 + 3)
    assert view.ctypes.data % _buffers.ALIGNMENT == 0


def test_wrapping_waits_for_the_oldest_groups_first_and_only_as_needed():
    ring = _buffers.StagingRing(64 * KiB)
    transfers = Transfers()
    for group in range(4):  # four groups of 16 KiB fill the ring
        ring.take(16 * KiB)
        ring.hold(transfers.wait_for(group))
    assert transfers.waited == []
    second_lap = ring.take(20 * KiB)  # needs the first two groups' space
    assert transfers.waited == [0, 1] and ring.waits == 2
    assert _inside(ring, second_lap)[0] == 0
    ring.hold(transfers.wait_for(4))
    ring.drain()
    assert transfers.waited == [0, 1, 2, 3, 4]


def test_a_take_that_does_not_fit_the_rest_of_the_lap_starts_the_next():
    ring = _buffers.StagingRing(64 * KiB)
    transfers = Transfers()
    ring.take(40 * KiB)
    ring.hold(transfers.wait_for(0))
    view = ring.take(30 * KiB)  # 24 KiB left in this lap: wraps, and needs group 0's space
    assert _inside(ring, view)[0] == 0 and transfers.waited == [0]


def test_a_group_that_wraps_holds_its_space_in_both_laps():
    ring = _buffers.StagingRing(64 * KiB)
    transfers = Transfers()
    ring.take(48 * KiB)
    ring.hold(transfers.wait_for(0))
    end_of_lap = ring.take(8 * KiB)
    start_of_lap = ring.take(12 * KiB)  # 8 KiB left: wraps, and needs group 0's space
    assert transfers.waited == [0]
    assert _inside(ring, end_of_lap)[0] == 48 * KiB and _inside(ring, start_of_lap)[0] == 0
    ring.hold(transfers.wait_for(1))  # one group, two pieces of space
    ring.take(40 * KiB)  # from 12 KiB: reaches the end-of-lap piece, so waits for group 1
    assert transfers.waited == [0, 1]


def test_a_group_larger_than_the_ring_is_refused():
    ring = _buffers.StagingRing(64 * KiB)
    ring.take(40 * KiB)
    with pytest.raises(ValueError, match="hold"):
        ring.take(40 * KiB)  # would overwrite this group's own unsent bytes


def test_oversized_requests_are_refused_and_fits_says_so():
    ring = _buffers.StagingRing(64 * KiB)
    assert ring.fits(60 * KiB) and not ring.fits(64 * KiB)
    with pytest.raises(ValueError, match="do not fit"):
        ring.take(64 * KiB)


def test_bytes_written_into_one_take_stay_until_its_space_is_taken_again():
    ring = _buffers.StagingRing(64 * KiB)
    transfers = Transfers()
    a = ring.take(16 * KiB)
    a[:] = 1
    ring.hold(transfers.wait_for(0))
    b = ring.take(16 * KiB)
    b[:] = 2
    ring.hold(transfers.wait_for(1))
    assert (a == 1).all() and (b == 2).all() and not np.shares_memory(a, b)
