"""Pausing Python's cyclic garbage collector while the caller waits for a bulk save or restore.

A tree of 10,000 tensors allocates hundreds of thousands of small objects (names, pieces,
entries, ``jax.Array`` wrappers) and frees few: each allocation burst triggers collections that
rescan every live object (``benchmarks/gc_pause_bench.py`` measures what the pause buys; the
figures are in ``docs/performance.md``). Nothing these functions build is cyclic garbage, so
collection can wait until they return.

The pause is process-wide, so it is only ever held while the caller's thread waits for the
work: ``save_file``, ``load_file``, restores, the host copies inside an async ``save()``, and a
synchronous save's write. An async save's background write never pauses the collector. Pauses
nest and overlap safely (a count, under a lock): the collector comes back on when the last one
ends, and only if it was on when the first one began.

Example::

    @paused
    def save_file(tree, path): ...
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_depth = 0  # pauses in force, over all threads
_reenable = False  # whether the first of them found the collector enabled
enabled = True  # False: pauses do nothing (benchmarks/gc_pause_bench.py compares both)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic collector inside the block; see the module docstring."""
    global _depth, _reenable
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()


def paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator form of :func:`gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper
