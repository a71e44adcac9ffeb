"""Writing a directory that may already exist, so that no reader ever follows a stale file.

Every writer of a directory goes through :func:`replacing_directory`: locally the new content
is written into a hidden sibling and swapped in (one atomic exchange on Linux); on object
storage the writer's own objects of the old content are deleted first, index and metadata
before shards. Files the writer does not own (``config.json``, a tokenizer...) are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid
from collections.abc import Iterator

from etils import epath

from orbax_safetensors._src.storage import direct as _direct
from orbax_safetensors._src.storage import router as _router

_INDEX_SUFFIX = ".safetensors.index.json"
_METADATA_PREFIX = "orbax_safetensors"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def owned(name: str) -> bool:
    """Whether a file named ``name`` belongs to a checkpoint writer (and is replaced)."""
    return (
        name.endswith((".safetensors", _INDEX_SUFFIX))
        or (name.startswith(_METADATA_PREFIX) and name.endswith(".json"))
        or name.startswith(f"{_METADATA_PREFIX}.")
    )


@contextlib.contextmanager
def made_parents(path: epath.PathLike) -> Iterator[None]:
    """Creates the missing parent directories of ``path`` for the block, and removes those it
    created (while empty) if the block raises: a failed write leaves nothing behind."""
    parent = epath.Path(path).parent
    created = []
    while not parent.exists() and parent != parent.parent:
        created.append(parent)
        parent = parent.parent
    if created:
        created[0].mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for directory in created:
            try:
                directory.rmdir()
            except OSError:  # (not empty: something else wrote there meanwhile)
                break
        raise


@contextlib.contextmanager
def replacing_directory(directory: epath.PathLike) -> Iterator[epath.Path]:
    """Yields where to write the new content of ``directory``; on a normal exit that content
    replaces the directory's checkpoint files."""
    directory = epath.Path(directory)
    if not _router.is_local(directory):
        remove_owned(directory)
        directory.mkdir(parents=True, exist_ok=True)
        yield directory
        return
    with made_parents(directory):
        tmp = staging_path(directory, uuid.uuid4().hex[:8])
        tmp.mkdir()
        try:
            yield tmp
            swap_in(tmp, directory)
        except BaseException:
            if tmp.exists():
                tmp.rmtree()
            raise


def staging_path(directory: epath.PathLike, token: str) -> epath.Path:
    """The hidden sibling of a local ``directory`` its new content is written into
    (``/out/.hf.writing-<token>`` for ``/out/hf``; several processes agree on ``token``)."""
    directory = epath.Path(directory)
    return directory.parent / f".{directory.name}.writing-{token}"


def swap_in(tmp: epath.Path, directory: epath.Path) -> None:
    """Makes ``tmp`` (written under :func:`staging_path`) the content of the local
    ``directory``, keeping the files of ``directory`` that no checkpoint writer owns."""
    if not directory.exists():
        tmp.rename(directory)
        _router.fsync_dir(directory.parent)
        return
    if not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    for child in directory.iterdir():
        if not owned(child.name) and not (tmp / child.name).exists():
            _copy(child, tmp / child.name)
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    if _exchange(tmp, directory):
        tmp.rename(old)  # (the old content, now under the temporary name)
    else:
        directory.rename(old)
        tmp.rename(directory)
    _router.fsync_dir(directory.parent)
    old.rmtree()


def _copy(src: epath.Path, dst: epath.Path) -> None:
    if src.is_dir():
        dst.mkdir()
        for child in src.iterdir():
            _copy(child, dst / child.name)
        return
    try:
        os.link(os.fspath(src), os.fspath(dst))  # kept files: linked, not copied, when possible
    except OSError:
        src.copy(dst)


def _exchange(a: epath.Path, b: epath.Path) -> bool:
    """Atomically exchanges two paths (Linux ``renameat2``); False where unavailable."""
    c_int, c_path = ctypes.c_int, ctypes.c_char_p
    renameat2 = _direct.libc_function("renameat2", [c_int, c_path, c_int, c_path, ctypes.c_uint])
    if renameat2 is None:
        return False
    rc = renameat2(
        _AT_FDCWD, os.fsencode(os.fspath(a)), _AT_FDCWD, os.fsencode(os.fspath(b)),
        _RENAME_EXCHANGE,
    )  # fmt: skip
    return rc == 0


def remove_owned(directory: epath.Path) -> None:
    """Object storage: deletes the old checkpoint's own objects of ``directory``, index and
    metadata first (no interrupted state names a missing or old shard); keeps the others."""
    if not directory.exists():
        return
    children = [c for c in directory.iterdir() if owned(c.name)]
    children.sort(key=lambda c: c.name.endswith(".safetensors"))
    for child in children:
        child.unlink()
