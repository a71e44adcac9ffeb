"""The only entry point for I/O by path: local files (:mod:`.local`), URLs whose scheme has a
registered :class:`Provider` (``s3://`` and ``gs://``: :mod:`.objstore`), and other
``etils.epath`` backends (:mod:`.stream`).

Example::

    buf = buffers.aligned_empty(1024)
    with open_reader(path) as r:
        r.read_runs([(r.size - 1024, buf)])
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from etils import epath

from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core.errors import HeaderError, NotSafetensorsError, UnsafePathError
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import local as _local
from orbax_safetensors._src.storage import stream as _stream


class Provider(Protocol):
    """What serves the paths of one URL scheme (an object store): ranged readers, whole-file
    writes, and the two checkpoint hooks around a save by several processes."""

    def open_reader(self, url: str, io: _config.IOOptions) -> Any:
        """A reader with ``size``, ``pread``, ``read_runs`` and ``close`` (see
        :func:`open_reader`); ``io`` is resolved (:func:`.config.resolve`) in every method."""
        ...

    def write_file(
        self, url: str, pieces: Sequence[_interface.Piece], size: int, io: _config.IOOptions
    ) -> None:
        """Writes this process's ``pieces`` of the ``size``-byte file at ``url``."""
        ...

    def prepare_directory(
        self,
        directory: str,
        files: Sequence[tuple[str, int]],
        *,
        is_primary: bool,
        io: _config.IOOptions,
    ) -> None:
        """See :func:`prepare_directory`."""
        ...

    def finish_directory(self, directory: str, io: _config.IOOptions) -> None:
        """See :func:`finish_files`."""
        ...

    def finalize_directory(self, directory: str, io: _config.IOOptions) -> None:
        """See :func:`finalize_files`."""
        ...


_PROVIDERS: dict[str, Provider] = {}
# The object stores served by objstore/engine, which is imported by the first path of one of
# these schemes: local reads (a tool listing a file) never load the object-store engine and
# the multi-process machinery (JAX) it uses.
_BUILT_IN = {"s3": "S3", "gs": "GCS"}


def register_scheme(scheme: str, provider: Provider) -> None:
    """Serves every ``<scheme>://`` path through ``provider`` from now on (in this process)."""
    _PROVIDERS[scheme] = provider


def provider_for(path: epath.PathLike) -> Provider | None:
    """The provider registered for ``path``'s URL scheme (case-sensitive), or None."""
    scheme, sep, _ = os.fspath(path).partition("://")
    if not sep:
        return None
    if scheme not in _PROVIDERS and scheme in _BUILT_IN:
        from orbax_safetensors._src.storage.objstore import engine

        _PROVIDERS.setdefault(scheme, getattr(engine, _BUILT_IN[scheme]))
    return _PROVIDERS.get(scheme)


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


is_local = _confine.is_local  # (on a local filesystem fd-level I/O is used)


def is_object_url(path: epath.PathLike) -> bool:
    """Whether ``path`` is served by a registered :class:`Provider` (``s3://``, ``gs://``)."""
    return provider_for(path) is not None


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

    Local files are opened without truncation (unless ``truncate``) so several processes can
    fill disjoint ranges of one file; each sets the same final size. Non-local paths are
    written as one sequential stream when the block exits, so the pieces must tile
    ``[0, size)`` exactly. If the block raises, nothing more is written or synced. ``io``:
    the direct I/O mode and object-store options (None: the defaults, see :mod:`.config`).
    ``threads``: a local file's write threads (None: ``local.WRITE_THREADS``).

    Example::

        with open_writer(path, size=len(header) + data.nbytes, truncate=True) as w:
            crcs = w.write([Piece(len(header), data, "t")], checksums=True)
            w.write([header_piece(header)])  # Piece, header_piece: see .interface
    """
    writer: _local.LocalWriter | _stream.BufferedWriter
    provider = provider_for(path)
    resolved = _config.resolve(io)
    if is_local(path):
        threads = _local.WRITE_THREADS if threads is None else threads
        writer = _local.LocalWriter(
            os.fspath(path), size, truncate, threads, sync, direct_io=resolved.direct_io
        )
    elif provider is not None:
        flush = functools.partial(_flush_to, provider, resolved)
        writer = _stream.BufferedWriter(os.fspath(path), size, flush=flush)
    else:
        writer = _stream.BufferedWriter(os.fspath(path), size, flush=_stream.write_stream)
    try:
        yield writer
    except BaseException:
        if isinstance(writer, _local.LocalWriter):
            writer.close(sync=False)
        raise
    writer.close(sync)


def _flush_to(
    provider: Provider,
    io: _config.IOOptions,
    url: str,
    pieces: Sequence[_interface.Piece],
    size: int,
) -> None:
    provider.write_file(url, pieces, size, io)


def write_file(
    path: epath.PathLike,
    pieces: Sequence[_interface.Piece],
    *,
    size: int,
    checksums: bool = True,
    truncate: bool = False,
    sync: bool = True,
    io: _config.IOOptions | None = None,
) -> list[tuple[object, int, int]]:
    """Writes ``pieces`` into the file at ``path`` and sets its size to ``size``.

    See :func:`open_writer`. Returns ``(tag, nbytes, crc32c)`` for every piece written, in
    offset order (crc32c 0 unless ``checksums``).
    """
    with open_writer(path, size=size, truncate=truncate, sync=sync, io=io) as w:
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


# Threads of a local read: at least 4 (several reads in flight keep a disk's queue full), up to
# 8 on machines with the cores (reads from the page cache are memory copies, which scale with
# threads: docs/performance.md, "TPU").
READ_THREADS = max(4, min(8, os.cpu_count() or 1))


@contextmanager
def open_reader(
    path: epath.PathLike,
    *,
    threads: int | None = None,
    io: _config.IOOptions | None = None,
) -> Iterator[Any]:
    """Opens ``path`` for ranged reads: fd-level locally, the scheme's provider (HTTP range
    requests on S3 and GCS: :class:`.objstore.common.ObjectReader`), a seekable stream
    elsewhere. ``io``: the direct I/O mode and object-store options (None: the defaults)."""
    reader: Any
    provider = provider_for(path)
    if is_local(path):
        threads = READ_THREADS if threads is None else threads
        reader = _local.LocalReader(path, threads, direct_io=_config.resolve(io).direct_io)
    elif provider is not None:
        reader = provider.open_reader(os.fspath(path), _config.resolve(io))
    else:
        reader = _stream.StreamReader(path)
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
    """Main-thread step of every process before a checkpoint's files are written, in the same
    order on every process.

    On object storage in a multi-process job it registers the directory for a save by several
    processes (see :func:`.objstore.engine.prepare_directory`; a RuntimeError names what is
    missing when the job has no ``jax.distributed`` key-value store); elsewhere it does nothing.
    """
    provider = provider_for(directory)
    if provider is not None:
        provider.prepare_directory(
            os.fspath(directory), files, is_primary=is_primary, io=_config.resolve(io)
        )


def finish_files(directory: epath.PathLike, io: _config.IOOptions | None = None) -> None:
    """Every process, after it wrote all its files of a checkpoint directory: on object
    storage in a multi-process save, uploads this process's share of the plan (its bytes, the
    parts it builds; see :mod:`.objstore.engine`). Local files need nothing.
    """
    provider = provider_for(directory)
    if provider is not None:
        provider.finish_directory(os.fspath(directory), _config.resolve(io))


def abandon_files(
    directory: epath.PathLike, error: BaseException, io: _config.IOOptions | None = None
) -> None:
    """This process's save into ``directory`` failed before or after its
    :func:`finish_files`: on object storage in a multi-process save, tells the other processes
    (they fail at once instead of waiting for this one) and removes what the save uploaded
    (the primary, once every process is done). Never raises: the save's error matters more.
    A provider without ``abandon_directory`` (one registered by :func:`register_scheme`) and
    local files need nothing.
    """
    provider = provider_for(directory)
    hook = getattr(provider, "abandon_directory", None)
    if hook is not None:
        with contextlib.suppress(Exception):
            hook(os.fspath(directory), error, _config.resolve(io))


def finalize_files(directory: epath.PathLike, io: _config.IOOptions | None = None) -> None:
    """Commits files that several processes wrote in parts (object storage; the primary,
    once, after every process finished): see :func:`.objstore.engine.finalize_directory`.

    Local files need nothing: every process wrote its bytes in place.
    """
    provider = provider_for(directory)
    if provider is not None:
        provider.finalize_directory(os.fspath(directory), _config.resolve(io))


def read_header(path: epath.PathLike, io: _config.IOOptions | None = None) -> _header.Header:
    """Reads and validates the header of a ``.safetensors`` file (no tensor bytes are read).

    Raises:
      NotSafetensorsError: ``path`` is something else that has a recognisable signature (a
        Flax msgpack checkpoint, a pickle, a zip, an Orbax directory...: ``core/sniff.py``);
        the message says what it looks like and what to run.
      HeaderError: the header is malformed, inconsistent or hostile.
    """
    path = epath.Path(path)
    try:
        with open_reader(path, io=io) as r:
            return _header.parse_file(r.pread, r.size, where=str(path))
    except NotSafetensorsError:
        raise
    except (HeaderError, UnsafePathError, OSError):
        found = (
            _sniff.sniff_directory(_entry_names(path), str(path)) if _is_directory(path) else None
        )
        if found is None:
            raise
    raise NotSafetensorsError(_sniff.message(str(path), found), found) from None


def _is_directory(path: epath.Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _entry_names(path: epath.Path, limit: int = 10_000) -> list[str]:
    names = []
    for child in path.iterdir():
        names.append(child.name)
        if len(names) >= limit:
            break
    return names
