"""Reads stay inside what the caller named, and never block on a special file.

A checkpoint names the files it is read from, and a forged name could lead anywhere (an
absolute path, ``../other``, a URL, a planted symbolic link). :func:`inside` is the one way a
path is built from such a name; :func:`check_tree` applies its rule to a directory another
library reads on its own; :func:`open_regular` is the one way a local file is opened for reading
(a FIFO, device, socket or directory is refused, never waited on).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError, UnsafePathError

if TYPE_CHECKING:  # (etils is imported where a path is built: listing one file needs none)
    from etils import epath

# Where the Hugging Face hub cache keeps a repository's files: snapshots/<rev>/<file> is a
# symbolic link to ../../blobs/<hash> (huggingface_hub's file_download.py).
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
_HUB_SNAPSHOTS = "snapshots"
_HUB_BLOBS = "blobs"


def is_local(path: epath.PathLike) -> bool:
    """Whether ``path`` is on a local (POSIX) filesystem (no URL scheme)."""
    return "://" not in os.fspath(path)


def inside(root: epath.PathLike, name: str, *, where: object = None) -> epath.Path:
    """``root / name`` for a ``name`` read from ``root`` (held by the file ``where``; default
    ``root``), once checked to stay inside ``root``.

    Refused: a name that is empty, absolute, holds a ``..`` part, a URL or NUL; on a local
    filesystem, one that symbolic links (followed to the end) lead out of ``root``'s real path,
    unless ``root`` is in a Hugging Face hub cache snapshot and the link leads into that
    repository's ``blobs/`` (how that cache stores every file). Existence is not checked.

    Raises:
      UnsafePathError: naming ``where``, ``name`` and ``root``.
    """
    from etils import epath

    where = root if where is None else where
    problem = _metadata.escape_problem(name)
    if problem is not None:
        raise _metadata.escape_error(where, name, root, problem)
    path = epath.Path(root) / name
    if is_local(path):
        real = os.path.realpath(os.fspath(path))
        if not _within_tree(real, os.path.realpath(os.fspath(root))):
            raise _metadata.escape_error(where, name, root, f"a symbolic link to {real}")
    return path


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _within_tree(real: str, real_root: str) -> bool:
    # Inside the tree: below its real path, or, from a hub cache snapshot, in its blobs.
    if _within(real, real_root):
        return True
    blobs = hub_blobs(real_root)
    return blobs is not None and _within(real, blobs)


def hub_blobs(real_root: str) -> str | None:
    """The ``blobs`` directory of the hub cache repository whose snapshot ``real_root`` (a real
    path) is or lies in (``.../models--org--name/snapshots/<rev>``), else None."""
    parts = real_root.rstrip(os.sep).split(os.sep)
    for i in range(len(parts) - 1, 1, -1):
        if parts[i - 1] == _HUB_SNAPSHOTS and parts[i - 2].startswith(_HUB_REPO_PREFIXES):
            return os.sep.join([*parts[: i - 1], _HUB_BLOBS])
    return None


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, as an error message says it."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def not_regular_error(path: object, mode: int) -> UnsafePathError:
    """The one error for a path read as a file that is something else."""
    return UnsafePathError(
        f"{path}: {kind_of(mode)}, not a regular file (refused without reading from it)"
    )


def open_regular(path: epath.PathLike) -> tuple[int, os.stat_result]:
    """Opens the local file ``path`` for reading and returns ``(fd, its fstat)``: without
    blocking (``O_NONBLOCK``: a FIFO would wait for a writer), and only a regular file.

    Raises:
      UnsafePathError: ``path`` is a FIFO, device, socket or directory (the fd is closed).
      OSError: it cannot be opened (missing, permissions).
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular_error(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


# What a file read whole (a config, an index, a metadata document) may hold.
MAX_SMALL_FILE_BYTES = 512 * 1024 * 1024
_COPY_CHUNK = 64 << 20


def read_file(
    path: epath.PathLike, *, limit: int | None = MAX_SMALL_FILE_BYTES, head: int | None = None
) -> bytes:
    """The content of the file ``path`` (every file this library reads whole is read here),
    opened as :func:`copy_file` opens it; a local file's size is checked against ``limit``
    (None: none) before a byte is read. ``head``: only the first ``head`` bytes (no limit).

    Raises:
      UnsafePathError: a FIFO, device, socket or directory.
      SafetensorsCheckpointError: larger than ``limit`` bytes.
      OSError: it cannot be read (missing, permissions).
    """
    f, size = _open_for_reading(path)
    with f:
        if head is not None:
            return f.read(head)
        if size is not None and limit is not None and size > limit:
            raise _too_large(path, size, limit)
        # (locally one buffer of the size fstat gives, grown if the file grew)
        data = f.read() if size is not None or limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:  # (grown since its size was read)
        raise _too_large(path, len(data), limit)
    return data


def _too_large(path: object, size: int, limit: int) -> SafetensorsCheckpointError:
    return SafetensorsCheckpointError(
        f"{path}: {size} bytes, larger than the {limit} bytes a file read whole may hold"
    )


def copy_file(src: epath.PathLike, dst: epath.PathLike) -> None:
    """Copies the file ``src`` to ``dst`` (created or replaced), a chunk at a time; ``src`` is
    opened first, locally through :func:`open_regular` (a FIFO is refused, not waited on)."""
    from etils import epath

    with _open_for_reading(src)[0] as f, epath.Path(dst).open("wb") as out:
        while chunk := f.read(_COPY_CHUNK):
            out.write(chunk)


def _open_for_reading(path: epath.PathLike) -> tuple[Any, int | None]:
    # A binary file object of ``path`` and, locally, its size: a local one opened by
    # open_regular (whose fstat gives the size), others by epath (size None).
    if is_local(path):
        fd, st = open_regular(path)
        return os.fdopen(fd, "rb", buffering=0), st.st_size
    from etils import epath

    return epath.Path(path).open("rb"), None


def check_tree(root: epath.PathLike, *, where: object = None) -> None:
    """Refuses a local directory tree another reader (Orbax, TensorStore) would read out of or
    block in: every symbolic link must lead inside ``root`` (the rule of :func:`inside`), and
    every entry be a directory or a regular file. Object storage holds neither.

    Raises:
      UnsafePathError: naming the entry (``where``: what holds the tree, default ``root``).
    """
    if not is_local(root):
        return
    real_root = os.path.realpath(os.fspath(root))
    where = root if where is None else where
    for entry in _entries(os.fspath(root)):
        if entry.is_symlink():
            real = os.path.realpath(entry.path)
            if not _within_tree(real, real_root):
                name = os.path.relpath(entry.path, os.fspath(root))
                raise _metadata.escape_error(where, name, root, f"a symbolic link to {real}")
            try:
                mode = os.stat(real).st_mode
            except OSError:
                continue  # (a dangling link inside: the reader reports it missing)
        else:
            mode = entry.stat(follow_symlinks=False).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise not_regular_error(entry.path, mode)


def _entries(directory: str) -> Iterator[os.DirEntry[str]]:
    # Every entry below ``directory``, not descending into symbolic links (each is checked).
    with os.scandir(directory) as it:
        children = list(it)
    for entry in children:
        yield entry
        if entry.is_dir(follow_symlinks=False):
            yield from _entries(entry.path)
