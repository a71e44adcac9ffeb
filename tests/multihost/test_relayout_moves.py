"""160 row-block -> column-stripe moves (``pipeline.relayout.move``) in a row across 4 real
processes: the values are right and the job does not hang (with the moves left in flight, gloo
hung here; each move is now waited for)."""

from __future__ import annotations

from multihost.launcher import run_workers


def test_many_moves_in_a_row_finish_with_the_right_values():
    results = run_workers("relayout_moves_worker.py", 4, args={"n": 160}, timeout=180)
    assert [r.result["ok"] for r in results] == [True] * 4
