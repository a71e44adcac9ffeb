"""Direct I/O: cold local reads, and durable local writes, through ``O_DIRECT``.

A cold buffered read goes disk -> page cache -> the caller's buffer, one readahead window at a
time; ``O_DIRECT`` moves the blocks straight into the caller's buffer with many requests in
flight, which is where a device's sequential read bandwidth is reached. It needs file offsets,
lengths and buffer addresses aligned to the device's block: new files start their data on a
4 KiB boundary and readers allocate each large buffer at an address congruent to its file
offset modulo 4 KiB (:func:`.buffers.aligned_empty`), so the blocks inside a tensor are read
in place. The bytes before the first and after the last whole block of a run (and any run that
is small, misaligned as in files from other writers, or whose buffer is not congruent) are read
buffered, as before.

When it is used (``IOOptions(direct_io=...)``, default ``OSF_DIRECT_IO``; see
:mod:`orbax_safetensors._src.storage.config`):

- ``auto`` (the default): for each chunk of a large aligned run whose pages are mostly *not* in
  the page cache (``cachestat``, or ``mincore`` on kernels before 6.5). Warm data (just saved,
  or read before) is copied from the page cache, which is faster than reading it from the
  device again; cold data goes direct. Direct reads also leave nothing in the page cache, so a
  restore holds nothing beyond its arrays (the price: restoring the same cold file twice reads
  the device twice). Where the page cache cannot be inspected (the kernel reports other users'
  files only to their owner or a writer), reads stay buffered.
- ``never``: always buffered.
- ``always``: direct for every large aligned run, cached or not (for measurements and tests).

A filesystem that refuses ``O_DIRECT`` (on open or on a read: ``EINVAL``) is read buffered;
only Linux has ``O_DIRECT`` here. Object stores never get here.

Durable writes (every local save: the file is fsynced before it counts) go direct in ``auto``
and ``always`` mode: a buffered write of a GiB first dirties a GiB of page cache (evicting what
the job had cached) and costs the kernel's copy into it (more CPU time than a direct save;
docs/performance.md has the figures). Where a host caches the disk (VMs), buffered writes with early writeback can be
faster: docs/performance.md has both measured. The writer copies each block-aligned
stretch into an aligned staging buffer (:func:`staging_buffer`) and writes it with
:func:`write_direct`; the partial blocks at either end of a stretch are written buffered.
A saved file therefore leaves nothing in the page cache (its first restore is cold).
``never`` writes buffered.

Example::

    plan = split_runs(runs, cached=None)   # runs: (file offset, flat uint8 buffer)
    plan.direct                             # [(offset, view, run number)], 4 KiB-aligned
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from orbax_safetensors._src.storage import config as _config

BLOCK = 4096  # alignment of offsets, lengths and addresses of direct reads
# Runs (reads) and units (writes) with less than this of whole blocks go buffered: a direct
# transfer waits for the device, and below this the per-call cost dominates.
MIN_BYTES = 1 << 20
CHUNK_BYTES = 16 << 20  # one direct read: large enough to keep the device's queue full
ENV = _config.DIRECT_IO_ENV
MODES = _config.DIRECT_IO_MODES
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux only
# Errors that mean "this file or filesystem does not do direct I/O": read it buffered instead.
_UNSUPPORTED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def mode(value: str | None) -> str:
    """The direct I/O mode ``value`` (``IOOptions.direct_io``), checked; None: the default
    (``OSF_DIRECT_IO``, else ``auto``: see :mod:`..config`).

    Raises:
      ValueError: for a value other than ``auto``, ``never``, ``always``.
    """
    if value is None:
        return _config.resolve(None).direct_io or "auto"
    if value not in MODES:
        raise ValueError(f"direct_io={value!r}: expected one of {', '.join(MODES)}")
    return value


def available() -> bool:
    """Whether this platform has ``O_DIRECT``."""
    return bool(_O_DIRECT)


class Split(NamedTuple):
    """A read split into buffered runs and direct chunks; each part names its run number."""

    buffered: list[tuple[int, np.ndarray, int]]  # (file offset, flat uint8 dest, run number)
    direct: list[tuple[int, memoryview, int]]  # (4 KiB-aligned offset, aligned view, run)


def split_runs(
    runs: Sequence[tuple[int, np.ndarray]], cached: Callable[[int, int], bool] | None
) -> Split:
    """Splits ``(offset, dest)`` runs: the whole 4 KiB blocks of each large run whose buffer
    is congruent to its offset modulo 4 KiB go direct, in chunks of at most
    :data:`CHUNK_BYTES`, unless ``cached(offset, nbytes)`` says a chunk is in the page cache;
    everything else is buffered. Runs read whole stay whole (no empty parts)."""
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
    # cachestat(2) (Linux 6.5+) counts a file range's pages in the page cache in one call;
    # mincore(2) (older kernels) answers page by page, slow on large files (figures in
    # docs/performance.md). Python's os and mmap modules bind neither, hence ctypes.
    # Elsewhere: the cache is unknown (reads stay buffered).
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def page_cache_probe(fd: int, path: str, st: os.stat_result) -> Callable[[int, int], bool] | None:
    """``cached(offset, nbytes)``: whether at least half of that range of the open file is in
    the page cache; None when this process cannot tell (no ``cachestat`` or ``mincore``, or
    the kernel hides other users' page cache: since Linux 5.0 ``mincore`` and later
    ``cachestat`` report it only to the file's owner, a user who may write it, or root)."""
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
    """One byte per page of the file's first ``size`` bytes, nonzero where the page is in the
    page cache (``mincore``); None when that cannot be known. Maps the file (no page is read
    or faulted)."""
    if _libc is None or size <= 0:
        return None
    try:
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    view = np.frombuffer(m, np.uint8)
    try:
        vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        mincore = _libc.mincore
        mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if mincore(view.ctypes.data, size, vec.ctypes.data) != 0:
            return None
        return vec & 1
    finally:
        del view  # the mapping cannot close while a view of it exists
        m.close()


def open_direct(path: str, like: os.stat_result, *, write: bool = False) -> int | None:
    """An ``O_DIRECT`` descriptor of ``path`` (``O_WRONLY`` if ``write``, else ``O_RDONLY``) if
    the filesystem allows it and it is still the file ``like`` describes (not replaced since);
    None otherwise."""
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
    """Writes ``view`` (page-aligned address, whole blocks) at ``offset`` through the
    ``O_DIRECT`` descriptor ``fd``; returns how many bytes were written: fewer than asked when
    the filesystem refuses this write or writes short (the caller writes the rest buffered).
    Other errors (disk full, quota) are raised."""
    return _transfer_all(os.pwritev, fd, offset, view)


def read_direct(fd: int, offset: int, view: memoryview) -> int:
    """Reads into ``view`` (aligned, whole blocks) at ``offset`` through the ``O_DIRECT``
    descriptor ``fd``; returns how many bytes were read: fewer than asked on a short read or
    when the filesystem refuses this read (the caller reads the rest buffered)."""
    return _transfer_all(os.preadv, fd, offset, view)
