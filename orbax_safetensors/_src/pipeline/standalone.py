"""The standalone API: one pytree <-> one ``.safetensors`` file, no Orbax needed.

The tree schema and per-tensor CRC32C checksums live in the file's ``__metadata__``, so the file
alone round-trips, while every safetensors reader sees plain tensors under dotted names.

Example::

    import orbax_safetensors as osf
    osf.save_file({"params": params, "step": 10}, "/tmp/ckpt.safetensors")
    tree = osf.load_file("/tmp/ckpt.safetensors")                 # same containers back
    tree = osf.load_file("/tmp/ckpt.safetensors", target=abstract)  # target's node types
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from etils import epath

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core.errors import (
    SafetensorsCheckpointError,
    SchemaError,
)
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline.reader import StoredTensor
from orbax_safetensors._src.pipeline.restore_options import RestoreOptions
from orbax_safetensors._src.pipeline.tree_restore import restore_tree
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import router as _router


@_gcpause.paused
def save_file(
    tree: Any,
    path: epath.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: _casting.DtypePolicy | None = None,
    io_options: _config.IOOptions | None = None,
) -> None:
    """Saves a pytree as one ``.safetensors`` file.

    The file appears atomically (written beside ``path`` under a temporary name, made durable,
    then renamed; on ``s3://`` and ``gs://`` the object itself appears only once complete), so
    a crash never leaves a half-written file at ``path``.

    Args:
      tree: any pytree of arrays (``jax.Array``, numpy), Python scalars, strings and None.
      path: the file to write (any ``etils.epath`` path, including ``s3://`` and ``gs://``).
      metadata: extra ``str -> str`` entries for the header's ``__metadata__``.
      dtype: store tensors in another dtype (e.g. bf16 weights from an f32 state): one dtype
        (applied to floating-point arrays only), a mapping of glob patterns over dotted names
        to a dtype or None (keep; the first matching pattern wins, unmatched names keep
        theirs), or a callable ``(dotted_name, leaf) -> dtype | None``. Each tensor is cast
        as it is written, never as a cast copy of the whole tree; the schema records each
        cast tensor's original dtype. ``load_file`` without a target gives the stored dtype,
        with a target the target's.
      io_options: how the file is written (:class:`~orbax_safetensors.IOOptions`: direct
        I/O mode, object-store options, tracing); None: the defaults (environment).

    Raises:
      UnsupportedLeafError: for a leaf or dtype that cannot be stored, before anything is written.
      ValueError: for a ``dtype`` policy naming no dtype, before anything is written.

    Example::

        osf.save_file({"layers": [{"w": jnp.ones((2, 2))}]}, "w.safetensors")
        # safe_open("w.safetensors", "flax").keys() == ["layers.0.w"]
        osf.save_file(params, "w16.safetensors", dtype=jnp.bfloat16)
        osf.save_file(params, "w16.safetensors", dtype={"*.norm.*": None, "*": "bfloat16"})
    """
    validated = _checkpoint_save.validate_save(tree, dtype=dtype)  # before any I/O
    job = _save_job.FileSaveJob(validated, path, metadata=metadata, io=io_options)
    job.start()
    job.write()
    job.finalize()


def locate_in_file(
    path: epath.Path, header: _header.Header, crcs: Mapping[str, Any] | None
) -> dict[str, StoredTensor]:
    """The tensors of one file, with their checksums when known."""
    out = {}
    for name, e in header.tensors.items():
        crc = None
        if crcs is not None and name in crcs:
            crc = _checksum.from_hex(crcs[name])
            if crc is None:
                raise SchemaError(f"{path}: checksum of {name!r} is malformed: {crcs[name]!r}")
        out[name] = StoredTensor(name, path, header.data_start + e.begin, e.dtype, e.shape, crc)
    return out


@_gcpause.paused
def file_index(
    path: epath.Path,
    header: _header.Header,
    *,
    strict: bool = True,
    directory_checksums: bool = False,
) -> tuple[Any, dict[str, StoredTensor]]:
    """The schema (``None`` if the file has none, or when not ``strict``) and where each tensor
    of a standalone file lies, with its checksum when the file records one.

    ``strict=False`` skips the schema and ignores a checksum entry that is not an object (for
    tools that list any safetensors file); the schema is parsed first, so the first error a
    strict caller sees is the schema's.

    ``directory_checksums``: a file that records no checksums of its own but is a file of a
    checkpoint directory (the directory's ``orbax_safetensors.json`` lists it) takes the
    checksums that metadata records for it
    (:func:`.checkpoint_restore.locate_in_directory_file`: a metadata file that is malformed
    or disagrees with the header raises). A file's own checksums always win.

    Example::

        schema, stored = file_index(path, _router.read_header(path))
    """
    schema = _metadata.header_json(header, _metadata.SCHEMA_KEY, str(path)) if strict else None
    crcs = _metadata.header_json(header, _metadata.CHECKSUM_KEY, str(path))
    if crcs is not None and not isinstance(crcs, dict):
        if strict:
            raise SchemaError(f"{path}: {_metadata.CHECKSUM_KEY} is not an object")
        crcs = None
    if crcs is None and directory_checksums:
        stored = _checkpoint_restore.locate_in_directory_file(path, header)
        if stored is not None:
            return schema, stored
    return schema, locate_in_file(path, header, crcs)


def load_with_options(path: epath.PathLike, options: RestoreOptions) -> Any:
    """Loads a ``.safetensors`` file as ``options`` asks (see :class:`.RestoreOptions`); with
    ``options.verify``, a file of a checkpoint directory is checked against the checksums its
    directory records (:func:`file_index`'s ``directory_checksums``).

    Raises:
      HeaderError, SchemaError: the file is damaged or hostile, or (with ``options.verify``)
        the metadata of the checkpoint directory it belongs to cannot vouch for it.
      TargetMismatchError: the target disagrees with the file (names every key at once).
      IntegrityError: a tensor's bytes do not match their checksum.

    Example::

        tree = load_with_options("w.safetensors", RestoreOptions(target=abstract))
    """
    path = epath.Path(path)
    # The header and the tensors (and a checkpoint directory's metadata) are read through
    # separate opens: if save_file (or save_directory) replaces the file in between, the reads
    # mix two versions. Read again until the file stayed the same.
    for _ in range(_READ_ATTEMPTS):
        before = _identity(path)
        header = _router.read_header(path, options.io)
        try:
            schema, stored = file_index(path, header, directory_checksums=options.verify)
            tree = restore_tree(schema, stored, options)
        except (SafetensorsCheckpointError, OSError, EOFError):
            if _identity(path) == before:
                raise
            continue
        if _identity(path) == before:
            return tree
    raise SafetensorsCheckpointError(
        f"{path}: replaced {_READ_ATTEMPTS} times while being read; try again"
    )


_READ_ATTEMPTS = 5


def _identity(path: epath.Path) -> tuple[int, ...] | None:
    """What changes when a local file is replaced or rewritten (None elsewhere)."""
    if not _router.is_local(path):
        return None
    try:
        st = os.stat(os.fspath(path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def load_metadata(path: epath.PathLike) -> dict[str, str]:
    """The user metadata of a file saved with :func:`save_file` (reserved keys removed)."""
    header = _router.read_header(path)
    return {k: v for k, v in header.metadata.items() if k not in _metadata.RESERVED_KEYS}


__all__ = ["load_metadata", "load_with_options", "save_file"]
