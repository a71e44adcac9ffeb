"""The fuzzers' time budget: each test runs hypothesis batches for its share of
``OSF_FUZZ_SECONDS`` (default 24 s)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

BUDGET = float(os.environ.get("OSF_FUZZ_SECONDS", "24"))


def run_for(share: float, batch: Callable[[], None]) -> int:
    """Runs hypothesis ``batch`` repeatedly for ``share`` of the budget (at least once);
    returns the batches run."""
    end = time.monotonic() + BUDGET * share
    runs = 0
    while True:
        batch()
        runs += 1
        if time.monotonic() >= end:
            return runs
