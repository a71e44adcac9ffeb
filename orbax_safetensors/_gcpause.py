"""Pausing Python's cyclic garbage collector around bulk saves and restores.

A tree of 10,000 tensors allocates hundreds of thousands of small objects (names, pieces,
entries, ``jax.Array`` wrappers) and frees few: each allocation burst triggers collections that
rescan every live object, which more than doubled the per-tensor cost of a save or restore.
Nothing these functions build is cyclic garbage, so collection can wait until they return.

Example::

    @paused
    def save_file(tree, path): ...
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic collector inside the block (if it was enabled on entry)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator form of :func:`gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper
