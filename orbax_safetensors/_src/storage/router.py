"""The only entry point for I/O by path: local files (:mod:`.local`), object stores
(``s3://``, ``gs://``: :mod:`.objstore`), and other ``etils.epath`` backends (written as one
stream once every byte is in hand, read through a seekable file object).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core.errors import HeaderError, NotSafetensorsError, UnsafePathError
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import local as _local

Flush = Callable[[str, Sequence[_interface.Piece], int], None]


class BufferedWriter:
    """Collects pieces for a path written whole on close by ``flush(path, pieces in offset
    order, size)`` (object storage, other epath backends)."""

    def __init__(self, path: str, size: int, flush: Flush) -> None:
        self.path = path
        self.size = size
        self._flush = flush
        self._pieces: list[_interface.Piece] = []

    def write(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.WriteResult:
        self._pieces.extend(pieces)
        return [
            (p.tag, p.data.nbytes, _checksum.crc32c(p.data) if checksums else 0) for p in pieces
        ]

    def submit(
        self, pieces: Sequence[_interface.Piece], *, checksums: bool = False
    ) -> _interface.PendingWrite:
        return _interface.Done(self.write(pieces, checksums=checksums))

    def close(self, sync: bool) -> None:
        ordered = sorted(self._pieces, key=lambda p: p.offset)
        self._pieces = []
        self._flush(self.path, ordered, self.size)


def write_stream(path: str, ordered: Sequence[_interface.Piece], size: int) -> None:
    """Writes ``ordered`` (every byte of the file, in offset order) as one stream to ``path``."""
    target = epath.Path(path)
    expected = 0
    with target.open("wb") as f:
        for p in ordered:
            if p.offset != expected:
                raise ValueError(
                    f"{target}: a streamed write needs every byte (gap at offset {expected})"
                )
            f.write(p.data.data)
            expected += p.data.nbytes
    if expected != size:
        raise ValueError(f"{target}: streamed {expected} bytes, expected {size}")


class StreamReader:
    """Ranged reads through a seekable file object (other epath backends)."""

    def __init__(self, path: epath.PathLike) -> None:
        self.path = epath.Path(path)
        self._f = self.path.open("rb")
        self._f.seek(0, os.SEEK_END)
        self.size = self._f.tell()
        self.bytes_read = 0
        self.requests = 0

    def close(self) -> None:
        self._f.close()

    def pread(self, offset: int, nbytes: int) -> bytes:
        self._f.seek(offset)
        return self._f.read(max(0, min(nbytes, self.size - offset)))

    def read_runs(
        self,
        runs: Sequence[tuple[int, np.ndarray]],
        max_gap: int = _runs.DEFAULT_MAX_GAP,
        on_run: Callable[[int], None] | None = None,
    ) -> None:
        for i, (offset, dest) in sorted(enumerate(runs), key=lambda r: r[1][0]):
            if offset + dest.nbytes > self.size:
                raise EOFError(
                    f"{self.path}: needs bytes up to {offset + dest.nbytes}, file has {self.size}"
                )
            self._f.seek(offset)
            self.requests += 1
            self.bytes_read += dest.nbytes
            view = dest.data
            got = 0
            while got < dest.nbytes:
                n = self._f.readinto(view[got:])
                if not n:
                    raise EOFError(f"{self.path}: unexpected end of file at {offset + got}")
                got += n
            if on_run is not None:
                on_run(i)


# The object stores' URL schemes: their clients in objstore/engine._CLIENTS.
_OBJECT_SCHEMES = frozenset(("s3", "gs"))


def _objstore(path: epath.PathLike) -> ModuleType | None:
    """objstore's engine when an object store serves ``path``'s URL scheme (case-sensitive),
    else None."""
    if not is_object_url(path):
        return None
    # Imported by the first such path: local I/O never loads the engine and the JAX it uses.
    from orbax_safetensors._src.storage.objstore import engine

    return engine


def is_regular_file(path: epath.PathLike) -> bool:
    """Whether ``path`` is an existing regular file (``epath.Path.is_file`` is true for a FIFO,
    whose opening blocks)."""
    if not is_local(path):  # (some etils releases take a missing object for a file)
        p = epath.Path(path)
        return p.exists() and not p.is_dir()
    try:
        return stat.S_ISREG(os.stat(os.fspath(path)).st_mode)
    except (OSError, ValueError):
        return False


is_local = _confine.is_local  # (on a local filesystem fd-level I/O is used)


def is_object_url(path: epath.PathLike) -> bool:
    """Whether ``path`` is served by an object store (``s3://``, ``gs://``)."""
    scheme, sep, _ = os.fspath(path).partition("://")
    return bool(sep) and scheme in _OBJECT_SCHEMES


@contextmanager
def open_writer(
    path: epath.PathLike,
    *,
    size: int,
    truncate: bool = False,
    sync: bool = True,
    threads: int | None = None,
    io: _config.IOOptions | None = None,
) -> Iterator[_interface.Writer]:
    """Opens a file of final size ``size`` for positional writes; durable (fsync) on exit.

    Local files are not truncated (unless ``truncate``), so several processes can fill
    disjoint ranges of one file. Other paths are written whole when the block exits (the pieces
    must tile ``[0, size)``, or a multi-process save must be prepared). If the block raises,
    nothing more is written or synced.
    """
    writer: _local.LocalWriter | BufferedWriter
    engine = _objstore(path)
    resolved = _config.resolve(io)
    if is_local(path):
        threads = _local.WRITE_THREADS if threads is None else threads
        writer = _local.LocalWriter(
            os.fspath(path), size, truncate, threads, sync, direct_io=resolved.direct_io
        )
    elif engine is not None:
        flush = functools.partial(engine.write_file, engine.store_for(os.fspath(path), resolved))
        writer = BufferedWriter(os.fspath(path), size, flush=flush)
    else:
        writer = BufferedWriter(os.fspath(path), size, flush=write_stream)
    try:
        yield writer
    except BaseException:
        if isinstance(writer, _local.LocalWriter):
            writer.close(sync=False)
        raise
    writer.close(sync)


def fsync_dir(path: epath.PathLike) -> None:
    """Makes a directory entry change (create, rename) durable on local filesystems."""
    if not is_local(path):
        return
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Threads of a local read: at least 4 (several reads in flight keep a disk's queue full), up to
# 8 with the cores (reads from the page cache are memory copies, which scale with threads).
READ_THREADS = max(4, min(8, os.cpu_count() or 1))


@contextmanager
def open_reader(
    path: epath.PathLike,
    *,
    threads: int | None = None,
    io: _config.IOOptions | None = None,
) -> Iterator[Any]:
    """Opens ``path`` for ranged reads (``size``, ``pread``, ``read_runs``): fd-level locally,
    HTTP range requests on object stores, a seekable stream elsewhere."""
    reader: Any
    engine = _objstore(path)
    if is_local(path):
        threads = READ_THREADS if threads is None else threads
        reader = _local.LocalReader(path, threads, direct_io=_config.resolve(io).direct_io)
    elif engine is not None:
        reader = engine.open_reader(os.fspath(path), _config.resolve(io))
    else:
        reader = StreamReader(path)
    try:
        yield reader
    finally:
        reader.close()


def prepare_directory(
    directory: epath.PathLike,
    files: Sequence[tuple[str, int]],
    *,
    is_primary: bool,
    io: _config.IOOptions | None = None,
) -> None:
    """Every process, on its main thread, in the same order, before a checkpoint's files are
    written: registers a save by several processes on object storage (a RuntimeError names
    what is missing without ``jax.distributed``'s key-value store); nothing elsewhere."""
    engine = _objstore(directory)
    if engine is not None:
        engine.prepare_directory(os.fspath(directory), files, is_primary=is_primary)


def finish_files(directory: epath.PathLike, io: _config.IOOptions | None = None) -> None:
    """Every process, after it wrote all its files of a checkpoint directory: on object
    storage, in a save by several processes, sends this process's share; nothing locally."""
    engine = _objstore(directory)
    if engine is not None:
        url = os.fspath(directory)
        engine.finish_directory(engine.store_for(url, _config.resolve(io)), url)


def abandon_files(
    directory: epath.PathLike, error: BaseException, io: _config.IOOptions | None = None
) -> None:
    """This process's save into ``directory`` failed: on object storage, in a save by several
    processes, tells the others and (the primary) removes what the save uploaded. Never
    raises: the save's error matters more."""
    engine = _objstore(directory)
    if engine is not None:
        url = os.fspath(directory)
        with contextlib.suppress(Exception):
            engine.abandon_directory(engine.store_for(url, _config.resolve(io)), url, error)


def finalize_files(directory: epath.PathLike, io: _config.IOOptions | None = None) -> None:
    """The primary, once every process finished: commits files several processes wrote on
    object storage; nothing locally (every process wrote its bytes in place)."""
    engine = _objstore(directory)
    if engine is not None:
        url = os.fspath(directory)
        engine.finalize_directory(engine.store_for(url, _config.resolve(io)), url)


def read_header(path: epath.PathLike, io: _config.IOOptions | None = None) -> _header.Header:
    """Reads and validates the header of a ``.safetensors`` file (no tensor bytes are read).

    Raises:
      NotSafetensorsError: ``path`` is recognisably something else (a Flax msgpack checkpoint,
        a pickle, a zip, an Orbax directory...); the message says what to run instead.
      HeaderError: the header is malformed, inconsistent or hostile.

    Example::

        header = osf.read_header("model.safetensors")
        header.tensors["w"].shape, header.metadata
    """
    path = epath.Path(path)
    try:
        with open_reader(path, io=io) as r:
            return _header.parse_file(r.pread, r.size, where=str(path))
    except NotSafetensorsError:
        raise
    except (HeaderError, UnsafePathError, OSError):
        names = _entry_names(path)
        found = None if names is None else _sniff.sniff_directory(names, str(path))
        if found is None:
            raise
    raise NotSafetensorsError(_sniff.message(str(path), found), found) from None


def _entry_names(path: epath.Path) -> list[str] | None:
    # The first 10,000 entry names of the directory ``path``; None when it is none.
    try:
        if not path.is_dir():
            return None
    except OSError:
        return None
    return [child.name for child in itertools.islice(path.iterdir(), 10_000)]
