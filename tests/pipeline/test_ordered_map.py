"""pipeline/pieces.ordered_map: the export's tensors cast on several threads, handed on in
order, never more than the workers ahead, and an early stop or an error leaves nothing
running."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.pipeline import pieces as _pieces


def test_results_come_in_order_whatever_finishes_first():
    def slow_for_even(i: int) -> int:
        time.sleep(0.02 if i % 2 == 0 else 0.0)
        return i * i

    assert list(_pieces.ordered_map(slow_for_even, range(20), workers=3)) == [
        i * i for i in range(20)
    ]
    assert list(_pieces.ordered_map(slow_for_even, range(5), workers=1)) == [0, 1, 4, 9, 16]
    assert list(_pieces.ordered_map(slow_for_even, [], workers=4)) == []


def test_at_most_the_workers_are_taken_ahead_of_the_caller():
    taken: list[int] = []

    def items():
        for i in range(100):
            taken.append(i)
            yield i

    results = _pieces.ordered_map(lambda i: i, items(), workers=4)
    assert next(results) == 0
    assert len(taken) <= 4
    results.close()


def test_a_drain_waits_for_every_result_before_it_before_taking_the_next_item():
    taken: list[object] = []
    got: list[int] = []

    def items():
        for item in (0, 1, _pieces.DRAIN, 2, 3):
            taken.append(item)
            yield item

    for result in _pieces.ordered_map(lambda i: i, items(), workers=4):
        got.append(result)
        if result < 2:  # (nothing after the drain is taken before 0 and 1 are handed on)
            assert 2 not in taken
    assert got == [0, 1, 2, 3]
    assert list(_pieces.ordered_map(lambda i: i, [_pieces.DRAIN, 5], workers=1)) == [5]


def test_an_error_is_raised_in_order_and_an_early_stop_starts_nothing_more():
    started: list[int] = []
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            started.append(i)
        if i == 3:
            raise ValueError("tensor 3")
        return i

    got = []
    with pytest.raises(ValueError, match="tensor 3"):
        for r in _pieces.ordered_map(fn, range(1000), workers=2):
            got.append(r)
    assert got == [0, 1, 2]
    assert len(started) < 10  # the rest were never submitted or were cancelled


def test_casts_on_several_threads_give_the_same_bytes():
    rng = np.random.default_rng(0)
    kernels = [rng.standard_normal((300, 700), dtype=np.float32) for _ in range(8)]

    def cast(x: np.ndarray) -> np.ndarray:
        return _casting.astype(x.T, ml_dtypes.bfloat16)

    alone = [cast(x) for x in kernels]
    together = list(_pieces.ordered_map(cast, kernels, workers=4))
    for a, b in zip(alone, together):
        assert a.tobytes() == b.tobytes()
