"""The only entry point for I/O by path: local files (:mod:`.local`), ``s3://`` and ``gs://``
(:mod:`.objstore`), and other ``etils.epath`` backends (:mod:`.stream`).

Example::

    buf = buffers.aligned_empty(1024)
    with open_reader(path) as r:
        r.read_runs([(r.size - 1024, buf)])
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from etils import epath

from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import local as _local
from orbax_safetensors._src.storage import objstore as _objstore
from orbax_safetensors._src.storage import stream as _stream


def is_regular_file(path: epath.PathLike) -> bool:
    """Whether ``path`` is an existing regular file (not a directory, FIFO or device).

    ``epath.Path.is_file`` is true for a FIFO, and opening one for reading blocks.
    """
    if not is_local(path):
        return epath.Path(path).is_file()
    try:
        return stat.S_ISREG(os.stat(os.fspath(path)).st_mode)
    except (OSError, ValueError):
        return False


def is_local(path: epath.PathLike) -> bool:
    """Whether ``path`` is on a local (POSIX) filesystem, where fd-level I/O is used."""
    return "://" not in os.fspath(path)


def is_object_url(path: epath.PathLike) -> bool:
    """Whether ``path`` is on S3 or GCS (``s3://``, ``gs://``), served by :mod:`.objstore`."""
    return os.fspath(path).startswith(("s3://", "gs://"))


@contextmanager
def open_writer(
    path: epath.PathLike,
    *,
    size: int,
    truncate: bool = False,
    sync: bool = True,
    threads: int = _local.WRITE_THREADS,
) -> Iterator[_interface.Writer]:
    """Opens a file of final size ``size`` for positional writes; durable (fsync) on exit.

    Local files are opened without truncation (unless ``truncate``) so several processes can
    fill disjoint ranges of one file; each sets the same final size. Non-local paths are
    written as one sequential stream when the block exits, so the pieces must tile
    ``[0, size)`` exactly. If the block raises, nothing more is written or synced.

    Example::

        with open_writer(path, size=len(header) + data.nbytes, truncate=True) as w:
            crcs = w.write([Piece(len(header), data, "t")], checksums=True)
            w.write([header_piece(header)])  # Piece, header_piece: see .interface
    """
    writer: _local.LocalWriter | _stream.BufferedWriter
    if is_local(path):
        writer = _local.LocalWriter(os.fspath(path), size, truncate, threads, sync)
    elif is_object_url(path):
        writer = _stream.BufferedWriter(os.fspath(path), size, flush=_objstore.write_file)
    else:
        writer = _stream.BufferedWriter(os.fspath(path), size, flush=_stream.write_stream)
    try:
        yield writer
    except BaseException:
        if isinstance(writer, _local.LocalWriter):
            writer.close(sync=False)
        raise
    writer.close(sync)


def write_file(
    path: epath.PathLike,
    pieces: Sequence[_interface.Piece],
    *,
    size: int,
    checksums: bool = True,
    truncate: bool = False,
    sync: bool = True,
) -> list[tuple[object, int, int]]:
    """Writes ``pieces`` into the file at ``path`` and sets its size to ``size``.

    See :func:`open_writer`. Returns ``(tag, nbytes, crc32c)`` for every piece written, in
    offset order (crc32c 0 unless ``checksums``).
    """
    with open_writer(path, size=size, truncate=truncate, sync=sync) as w:
        return w.write(pieces, checksums=checksums)


def fsync_dir(path: epath.PathLike) -> None:
    """Makes a directory entry change (create, rename) durable on local filesystems."""
    if not is_local(path):
        return
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def open_reader(path: epath.PathLike, *, threads: int = 4) -> Iterator[Any]:
    """Opens ``path`` for ranged reads: fd-level locally, HTTP range requests on S3 and GCS
    (:class:`.objstore.ObjectReader`), a seekable stream elsewhere."""
    reader: Any
    if is_local(path):
        reader = _local.LocalReader(path, threads)
    elif is_object_url(path):
        reader = _objstore.ObjectReader(os.fspath(path))
    else:
        reader = _stream.StreamReader(path)
    try:
        yield reader
    finally:
        reader.close()


def prepare_directory(
    directory: epath.PathLike, files: Sequence[tuple[str, int]], *, is_primary: bool
) -> None:
    """Main-thread step of every process before a checkpoint's files are written.

    On S3 in a multi-process job the primary starts one multipart upload per large file here
    (see :func:`.objstore.prepare_directory`); elsewhere it does nothing.
    """
    if is_object_url(directory):
        _objstore.prepare_directory(os.fspath(directory), files, is_primary=is_primary)


def finalize_files(directory: epath.PathLike) -> None:
    """Joins files that several processes wrote in parts (object storage; primary, once).

    Local files need nothing: every process wrote its bytes in place.
    """
    if is_object_url(directory):
        _objstore.finalize_directory(os.fspath(directory))


def read_header(path: epath.PathLike) -> _header.Header:
    """Reads and validates the header of a ``.safetensors`` file (no tensor bytes are read)."""
    path = epath.Path(path)
    with open_reader(path) as r:
        return _header.parse_header(r.pread(0, 8), lambda n: r.pread(8, n), r.size, where=str(path))
