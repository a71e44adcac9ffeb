"""Linux /proc helpers: resident memory, peak-RSS reset, I/O counters, page-cache control."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    """Current resident set size of this process (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Resets ``VmHWM`` to the current RSS (writes 5 to ``/proc/self/clear_refs``).

    Returns:
      False when the kernel refused (then the peak covers the whole process life).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def io_counters() -> dict[str, int]:
    """``/proc/self/io`` as a dict (``rchar``, ``read_bytes``, ``wchar``, ``write_bytes``...).

    ``rchar`` counts bytes passed through read-like syscalls (cache hits included, mmap faults
    excluded); ``read_bytes`` counts bytes this process caused to be fetched from the block
    device (page faults on mmaps and readahead included).
    """
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return {}


def drop_caches() -> str | None:
    """``os.sync()`` then drops the page cache, dentries and inodes.

    Returns:
      None on success, else why it could not (e.g. not root, read-only /proc/sys).
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return None
    except OSError as e:
        return f"cannot write /proc/sys/vm/drop_caches: {e.strerror or e}"


def files_under(path: Path) -> list[Path]:
    """All regular files below ``path`` (or ``[path]`` if it is a file), sorted."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def fsync_tree(path: Path) -> None:
    """fsyncs every file and directory below ``path``, and ``path``'s parent directory."""
    dirs = {path.parent}
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_dir():
            dirs.add(p)
            continue
        if not p.is_file():
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(p.parent)
    for d in sorted(dirs):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_through(path: Path, chunk: int = 16 << 20) -> int:
    """Reads every file below ``path`` once (to warm the page cache); returns the bytes read."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    for p in files_under(path):
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def disk_usage(path: Path) -> tuple[int, int]:
    """(apparent bytes, number of files) below ``path``."""
    files = files_under(path)
    return sum(p.stat().st_size for p in files), len(files)


def filesystem_of(path: Path) -> str:
    """The filesystem type and device holding ``path`` (from ``/proc/mounts``), e.g. ``ext4 /dev/vda``."""
    path = path.resolve()
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, *_ = line.split()
                if (path == Path(mnt) or Path(mnt) in path.parents) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} {best[2]}"


def mem_available() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _libc() -> Any:
    """libc through ctypes (foreign calls release the GIL), with the prototypes used here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = 14


class HotMemory:
    """A block of memory kept faulted in by the orchestrator and handed to a worker on demand.

    On this VM (virtio-balloon with free page reporting, transparent huge pages on ``madvise``,
    which numpy uses for large arrays) the host reclaims guest memory about 2 s after the guest
    frees it, and the next first write to it costs 1.5-7 s/GiB instead of ~0.2 s/GiB. A fresh
    worker process would pay that on every buffer it allocates, swamping the methods' own
    costs. So the orchestrator holds ``nbytes`` of populated (huge-page) memory and releases it
    the moment a worker is about to start its timed operation: the freed pages sit hot at the
    head of the kernel's free lists, where the operation's buffers and page cache come from.
    Once the operation is done the block is populated again in a background thread (ctypes
    calls release the GIL), overlapping the worker's untimed tail and the next worker's start.
    """

    def __init__(self, nbytes: int) -> None:
        page = 2 << 20
        self.nbytes = -(-max(0, nbytes) // page) * page
        self._addr: int | None = None
        self._thread: threading.Thread | None = None
        self._libc: Any = _libc() if self.nbytes else None
        self.warm_seconds = 0.0

    def _populate(self) -> None:
        t0 = time.perf_counter()
        libc, n = self._libc, self.nbytes
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        addr = libc.mmap(None, n, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, _MAP_FAILED):
            return
        libc.madvise(addr, n, _MADV_HUGEPAGE)
        half = n // 2 // mmap.PAGESIZE * mmap.PAGESIZE
        parts = [(addr, half), (addr + half, n - half)]
        done: list[bool] = []

        def populate(start: int, length: int) -> None:
            done.append(libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0)

        threads = [threading.Thread(target=populate, args=part) for part in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not all(done):  # kernel without MADV_POPULATE_WRITE: write the memory
            ctypes.memset(addr, 1, n)
        self._addr = addr
        self.warm_seconds += time.perf_counter() - t0

    def warm(self, background: bool = False) -> None:
        """(Re)populates the block, now or in a background thread; no-op if held or pending."""
        if not self.nbytes or self._addr is not None or self._thread is not None:
            return
        if background:
            self._thread = threading.Thread(target=self._populate, daemon=True)
            self._thread.start()
        else:
            self._populate()

    def release(self) -> None:
        """Finishes a pending populate, then unmaps the block (a worker is about to allocate)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._addr is not None:
            self._libc.munmap(self._addr, self.nbytes)
            self._addr = None


def cached_bytes(path: Path) -> int:
    """Bytes of the files below ``path`` now resident in the page cache (``mincore``).

    Right after a cold read this is what was read from those files (readahead included),
    unlike ``/proc/self/io`` ``read_bytes``, which also counts libraries loaded lazily.

    Returns:
      -1 if ``mincore`` is unavailable.
    """
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return -1
    page = mmap.PAGESIZE
    total = 0
    for p in files_under(path):
        size = p.stat().st_size
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                return -1
            try:
                vec = (ctypes.c_ubyte * (-(-size // page)))()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return -1
                total += sum(v & 1 for v in vec) * page
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return total


def read_ahead_kib(filesystem: str) -> int | None:
    """The block device's read-ahead window for a :func:`filesystem_of` string, if known."""
    dev = filesystem.split()[-1] if filesystem.split() else ""
    name = Path(dev).name
    for candidate in (name, name.rstrip("0123456789"), name.rsplit("p", 1)[0]):
        try:
            return int(Path(f"/sys/block/{candidate}/queue/read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None
