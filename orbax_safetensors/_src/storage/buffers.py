"""64-byte-aligned host buffers: reads land in them (aligned destinations copy several times
faster and let ``jax.device_put(..., may_alias=True)`` share the buffer instead of copying it).

Example::

    buf = aligned_empty(1024)
    arena = BufferArena()
    a, b = arena.empty(1024), arena.empty(4096)   # both inside one 4 MiB slab
"""

from __future__ import annotations

import numpy as np

ALIGNMENT = 64


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialised flat uint8 array of ``nbytes`` whose data is ``alignment``-aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes]


class BufferArena:
    """64-byte-aligned buffers; small ones are carved from shared slabs, so 10,000 small
    tensors cost a few allocations instead of 10,000. A slab lives while any of its buffers
    does (zero-copy ``jax.Array``s included).

    Example::

        arena = BufferArena()
        a, b = arena.empty(1024), arena.empty(4096)   # both inside one 4 MiB slab
    """

    _SLAB = 4 << 20

    def __init__(self) -> None:
        self._slab: np.ndarray | None = None
        self._used = 0

    def empty(self, nbytes: int) -> np.ndarray:
        """An uninitialised flat uint8 array of ``nbytes``, ``ALIGNMENT``-aligned."""
        if nbytes > self._SLAB // 8:
            return aligned_empty(nbytes)
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._slab is None or start + nbytes > self._slab.nbytes:
            self._slab, start = aligned_empty(self._SLAB), 0
        self._used = start + nbytes
        return self._slab[start : start + nbytes]
