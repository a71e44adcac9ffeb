"""``compat.jaxcompat``'s barriers, broadcasts and gathers, back to back in 2 real processes of
2 CPU devices each: the values are right and no process aborts (jax 0.6's gloo did, with
``jax.experimental.multihost_utils``'s, when one local device ran behind the other)."""

from __future__ import annotations

from multihost.launcher import run_workers


def test_back_to_back_collectives_of_other_sizes_agree():
    results = run_workers("collectives_worker.py", 2, args={"n": 300}, timeout=180)
    assert [r.result["ok"] for r in results] == [True, True]
