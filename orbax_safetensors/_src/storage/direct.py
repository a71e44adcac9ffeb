"""Direct I/O: cold local reads and durable local writes through ``O_DIRECT``, whose offsets,
lengths and buffer addresses must be aligned to the device's block (:data:`BLOCK`).
``IOOptions(direct_io=...)``: ``auto`` reads direct the chunks of large aligned runs mostly not
in the page cache and writes durable files direct; ``never``; ``always`` (every large aligned
run). A filesystem that refuses ``O_DIRECT`` is read and written buffered; only Linux has it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from orbax_safetensors._src.storage import config as _config

BLOCK = 4096  # alignment of offsets, lengths and addresses of direct reads
# Runs (reads) and units (writes) with less than this of whole blocks go buffered: a direct
# transfer waits for the device, and below this the per-call cost dominates.
MIN_BYTES = 1 << 20
CHUNK_BYTES = 16 << 20  # one direct read: large enough to keep the device's queue full
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux only
# Errors that mean "this file or filesystem does not do direct I/O": read it buffered instead.
_UNSUPPORTED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def mode(value: str | None) -> str:
    """The direct I/O mode ``value``, checked (None: the environment's); ``"never"`` where
    this platform has no ``O_DIRECT``."""
    return _config.direct_io_mode(value) if _O_DIRECT else "never"


def available() -> bool:
    return bool(_O_DIRECT)


class Split(NamedTuple):
    """A read split into buffered runs and direct chunks; each part names its run number."""

    buffered: list[tuple[int, np.ndarray, int]]  # (file offset, flat uint8 dest, run number)
    direct: list[tuple[int, memoryview, int]]  # (4 KiB-aligned offset, aligned view, run)


def split_runs(
    runs: Sequence[tuple[int, np.ndarray]], cached: Callable[[int, int], bool] | None
) -> Split:
    """Splits ``(offset, dest)`` runs: the whole blocks of each large run whose buffer is
    congruent to its offset modulo :data:`BLOCK` go direct in chunks of at most
    :data:`CHUNK_BYTES`, unless ``cached(offset, nbytes)``; the rest is buffered."""
    buffered: list[tuple[int, np.ndarray, int]] = []
    direct: list[tuple[int, memoryview, int]] = []
    for i, (offset, dest) in enumerate(runs):
        n = dest.nbytes
        if n < MIN_BYTES:  # most runs of a tree of many small tensors: nothing to work out
            buffered.append((offset, dest, i))
            continue
        first, last = block_span(offset, n)
        if last - first < MIN_BYTES or (dest.ctypes.data - offset) % BLOCK:
            buffered.append((offset, dest, i))
            continue
        if first > offset:
            buffered.append((offset, dest[: first - offset], i))
        for start in range(first, last, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, last)
            part = dest[start - offset : end - offset]
            if cached is not None and cached(start, end - start):
                buffered.append((start, part, i))
            else:
                direct.append((start, part.data, i))
        if last < offset + n:
            buffered.append((last, dest[last - offset :], i))
    return Split(buffered, direct)


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_CACHESTAT = 451  # the syscall's number on every architecture (added after the tables merged)


def _load_libc() -> ctypes.CDLL | None:
    # cachestat(2) (Linux 6.5+) counts a range's cached pages in one call; mincore(2) (older
    # kernels) answers page by page. Python binds neither, hence ctypes.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def libc_function(name: str, argtypes: list[Any]) -> Any | None:
    """The C library's function ``name`` taking ``argtypes`` and returning an int (errno kept),
    or None where this platform has none (Linux only)."""
    fn = None if _libc is None else getattr(_libc, name, None)
    if fn is not None:
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return fn


def page_cache_probe(fd: int, path: str, st: os.stat_result) -> Callable[[int, int], bool] | None:
    """``cached(offset, nbytes)``: whether at least half of that range of the open file is in
    the page cache; None when this process cannot tell (the kernel reports it only to the
    file's owner, a user who may write it, or root)."""
    if _libc is None:
        return None
    if _cachestat(fd, 0, 1) is not None:

        def counted(offset: int, nbytes: int) -> bool:
            pages = _cachestat(fd, offset, nbytes)
            return pages is None or 2 * pages * mmap.PAGESIZE >= nbytes  # unknown: buffered

        return counted
    if ctypes.get_errno() != errno.ENOSYS:  # EPERM: not ours to see
        return None
    euid = os.geteuid()
    if not (euid == 0 or st.st_uid == euid or os.access(path, os.W_OK)):
        return None  # mincore would report every page absent, sending warm reads direct
    pages = resident_pages(fd, st.st_size)
    if pages is None:
        return None

    def cached(offset: int, nbytes: int) -> bool:
        lo, hi = offset // mmap.PAGESIZE, -(-(offset + nbytes) // mmap.PAGESIZE)
        return 2 * int(np.count_nonzero(pages[lo:hi])) >= hi - lo

    return cached


def _cachestat(fd: int, offset: int, nbytes: int) -> int | None:
    assert _libc is not None
    rng, out = _CacheRange(offset, nbytes), _CacheStat()
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        return None
    return int(out.nr_cache)


def resident_pages(fd: int, size: int) -> np.ndarray | None:
    """One byte per page of the file's first ``size`` bytes, nonzero where the page is cached
    (``mincore`` on a mapping: no page is read); None when that cannot be known."""
    if _libc is None or size <= 0:
        return None
    try:
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    view = np.frombuffer(m, np.uint8)
    try:
        vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])
        if mincore is None or mincore(view.ctypes.data, size, vec.ctypes.data) != 0:
            return None
        return vec & 1
    finally:
        del view  # the mapping cannot close while a view of it exists
        m.close()


def open_direct(path: str, like: os.stat_result, *, write: bool = False) -> int | None:
    """An ``O_DIRECT`` descriptor of ``path`` (for writing if ``write``) if the filesystem allows
    it and it is still the file ``like`` describes; None otherwise."""
    if not _O_DIRECT:
        return None
    flags = os.O_WRONLY if write else os.O_RDONLY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | _O_DIRECT)
    except OSError as e:
        if e.errno in _UNSUPPORTED:  # tmpfs before Linux 6.6, FUSE, some network filesystems
            return None
        raise
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (like.st_dev, like.st_ino):
        os.close(fd)
        return None
    return fd


def staging_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of page-aligned anonymous memory (an address direct I/O accepts)."""
    return memoryview(mmap.mmap(-1, max(nbytes, BLOCK)))[:nbytes]


def block_span(offset: int, nbytes: int) -> tuple[int, int]:
    """``(first, last)``: the whole :data:`BLOCK`-aligned blocks inside
    ``[offset, offset + nbytes)``; ``first >= last`` when there are none."""
    return -(-offset // BLOCK) * BLOCK, (offset + nbytes) // BLOCK * BLOCK


def _transfer_all(
    call: Callable[[int, list[memoryview], int], int], fd: int, offset: int, view: memoryview
) -> int:
    # pwritev / preadv on an O_DIRECT descriptor until done, a short or unaligned transfer
    # (end of file, or no longer block-aligned: the rest cannot go direct) or a refusal.
    done = 0
    try:
        while done < len(view):
            moved = call(fd, [view[done:]], offset + done)
            done += max(moved, 0)
            if moved <= 0 or moved % BLOCK:
                break
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    return done


def write_direct(fd: int, offset: int, view: memoryview) -> int:
    """Writes ``view`` (aligned, whole blocks) at ``offset`` through the ``O_DIRECT`` descriptor
    ``fd``; the bytes written: fewer when the filesystem refuses or writes short (the caller
    writes the rest buffered). Other errors (disk full) are raised."""
    return _transfer_all(os.pwritev, fd, offset, view)


def read_direct(fd: int, offset: int, view: memoryview) -> int:
    """Reads into ``view`` (aligned, whole blocks) at ``offset`` through the ``O_DIRECT``
    descriptor ``fd``; the bytes read: fewer on a short read or a refusal."""
    return _transfer_all(os.preadv, fd, offset, view)
