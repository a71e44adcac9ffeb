"""storage/buffers.LentBuffers: an export's band buffers, lent and given back, reused rather
than faulted in afresh, placed at their file offset's phase for direct I/O."""

from __future__ import annotations

import threading

import numpy as np

from orbax_safetensors._src.storage import buffers as _buffers

MiB = 1 << 20


def test_a_buffer_given_back_is_lent_again_and_fresh_counts_new_ones():
    lent = _buffers.LentBuffers(2 * MiB)
    a = lent.take(MiB)
    a_address = a.ctypes.data
    assert a.nbytes == MiB and a.dtype == np.uint8 and lent.fresh == 1
    b = lent.take(2 * MiB)  # a still lent: a second buffer
    assert lent.fresh == 2 and not np.shares_memory(a, b)
    lent.give_back(memoryview(a))  # a memoryview of a view given back frees its buffer
    c = lent.take(2 * MiB)
    assert c.ctypes.data == a_address and lent.fresh == 2


def test_take_places_the_view_at_its_file_offsets_phase():
    lent = _buffers.LentBuffers(MiB)
    for offset in [0, 64, 4095, 4096 * 7 + 100, 10**9 + 3]:
        view = lent.take(MiB, file_offset=offset)
        assert (view.ctypes.data - offset) % 4096 == 0 and view.nbytes == MiB
        view[:] = 7  # the whole view is the lender's memory (capacity plus a page)
        lent.give_back(view)
    assert lent.fresh == 1
    assert lent.take(100).ctypes.data % _buffers.ALIGNMENT == 0


def test_above_the_capacity_fresh_memory_never_pooled():
    lent = _buffers.LentBuffers(MiB)
    big = lent.take(MiB + 1, file_offset=4096 + 64)
    assert big.nbytes == MiB + 1 and (big.ctypes.data - 64) % 4096 == 0
    lent.give_back(big)
    assert lent.fresh == 0 and lent._free == []


def test_foreign_and_empty_data_are_ignored_and_idle_buffers_bounded():
    lent = _buffers.LentBuffers(4096, max_idle=2)
    lent.give_back(np.zeros(10, np.uint8))  # not lent by it
    lent.give_back(b"")
    views = [lent.take(4096) for _ in range(5)]
    for v in views:
        lent.give_back(v)
    lent.give_back(views[0])  # twice: ignored
    assert len(lent._free) == 2 and lent._lent == {}


def test_threads_never_share_a_lent_buffer():
    lent = _buffers.LentBuffers(64 * 1024, max_idle=8)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(300):
            view = lent.take(64 * 1024, file_offset=i * 64)
            view[:] = k
            if not (view == k).all():
                errors.append(f"thread {k}: buffer overwritten")
            lent.give_back(view)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and lent.fresh <= 6 and lent._lent == {}
