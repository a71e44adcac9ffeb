"""64-byte-aligned host buffers: reads land in them (aligned destinations copy several times
faster and let ``jax.device_put(..., may_alias=True)`` share the buffer instead of copying it).
A large buffer for bytes at a known file offset sits at an address congruent to that offset
modulo 4 KiB, so direct I/O can fill its whole blocks in place (:mod:`.direct`).

Example::

    buf = aligned_empty(1024)
    arena = BufferArena()
    a, b = arena.empty(1024), arena.empty(4096)   # both inside one 4 MiB slab
"""

from __future__ import annotations

import numpy as np

ALIGNMENT = 64
_PAGE = 4096  # the block direct I/O aligns to (:data:`.direct.BLOCK`)


def aligned_empty(
    nbytes: int, alignment: int = ALIGNMENT, *, file_offset: int | None = None
) -> np.ndarray:
    """An uninitialised flat uint8 array of ``nbytes`` whose data is ``alignment``-aligned.

    With ``file_offset`` (a multiple of ``alignment``), the address is congruent to it modulo
    4 KiB instead (still ``alignment``-aligned): the buffer for the bytes at that offset.
    """
    if file_offset is not None and file_offset % alignment == 0:
        alignment, phase = max(alignment, _PAGE), file_offset % _PAGE
    else:
        phase = 0
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (phase - raw.ctypes.data) % alignment
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

    def empty(self, nbytes: int, *, file_offset: int | None = None) -> np.ndarray:
        """An uninitialised flat uint8 array of ``nbytes``, ``ALIGNMENT``-aligned; a large
        one for the bytes at ``file_offset`` is placed for direct I/O (see
        :func:`aligned_empty`)."""
        if nbytes > self._SLAB // 8:
            return aligned_empty(nbytes, file_offset=file_offset)
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._slab is None or start + nbytes > self._slab.nbytes:
            self._slab, start = aligned_empty(self._SLAB), 0
        self._used = start + nbytes
        return self._slab[start : start + nbytes]
