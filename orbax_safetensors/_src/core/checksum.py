"""CRC32C checksums computed in pieces, by many processes, and merged.

CRC32C runs at memory speed with the CPU's CRC instructions and, unlike xxh3 or SHA-256, is
*combinable*: ``crc(A + B)`` follows from ``crc(A)``, ``crc(B)`` and ``len(B)``. So each process
checksums the byte runs it writes, and the metadata's writer merges them into whole-tensor
checksums without seeing any data.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a C-contiguous bytes-like object, continuing from ``value``."""
    import crc32c as _crc32c  # on first use: reading a header's checksum table needs none

    return int(_crc32c.crc32c(data, value))


def _multmodp(a: int, b: int) -> int:
    # a(x) * b(x) modulo the CRC polynomial, in the reflected representation (as zlib does).
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()  # x^(2^k) mod p


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    # x^(8 * nbytes) mod p: the operator that appends nbytes zero bytes to a CRC register.
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` from the CRCs of ``A`` and ``B`` and the length of ``B``."""
    if len_b == 0:
        return crc_a
    return _multmodp(_shift(len_b), crc_a) ^ crc_b


def combine_runs(runs: Iterable[tuple[int, int, int]], total: int) -> int:
    """Whole-range CRC from ``(offset, length, crc)`` pieces that tile ``[0, total)`` exactly.

    Raises:
      ValueError: when the pieces overlap or leave a gap.
    """
    if isinstance(runs, list) and len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == total:
        return runs[0][2]  # the whole range in one run (the common case): its own CRC
    crc, expected = 0, 0
    for offset, length, piece in sorted(runs):
        if offset != expected:
            raise ValueError(
                f"checksum pieces do not tile the tensor: gap or overlap at {expected}"
            )
        crc = piece if expected == 0 else combine(crc, piece, length)
        expected += length
    if expected != total:
        raise ValueError(f"checksum pieces cover {expected} of {total} bytes")
    return crc


def share(runs: Iterable[tuple[int, int, int]], total: int) -> int:
    """One writer's share of the CRC of ``[0, total)``, from the ``(offset, length, crc)`` runs
    it wrote: XOR-ing the shares of writers whose runs tile ``[0, total)`` gives its CRC.
    """
    if isinstance(runs, list) and len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == total:
        return runs[0][2]  # the whole range in one run (the common case): its own CRC
    # CRC is linear: crc(P1 + ... + Pk) is the XOR of each crc(Pi) shifted past the bytes after
    # it, so a process folds its own (strided) runs into one value, and merging thousands of
    # processes is one XOR per process and tensor.
    acc, end = 0, None
    for offset, length, crc in sorted(runs):
        # Horner's rule: shift what we have past the gap and this run, then add this run.
        acc = crc if end is None else _multmodp(_shift(offset + length - end), acc) ^ crc
        end = offset + length
    if end is None or end == total:
        return acc
    return _multmodp(_shift(total - end), acc)


def from_hex(text: object) -> int | None:
    """The CRC stored as :func:`to_hex` text, or None when ``text`` is not such text."""
    if not isinstance(text, str) or len(text) != 8:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


def to_hex(crc: int) -> str:
    """Fixed-width hex text of a CRC (8 characters), as stored in metadata."""
    return f"{crc:08x}"
