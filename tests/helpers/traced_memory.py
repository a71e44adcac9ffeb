"""Peak host memory of a call, as tracemalloc sees it (numpy reports its buffers to it).

Example::

    peak = traced_peak(lambda: osf.save_file(tree, path))
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any


def traced_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by ``fn()`` above what was allocated before it."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
