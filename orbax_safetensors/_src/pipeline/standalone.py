"""The standalone verbs, no Orbax needed: a pytree to and from one ``.safetensors`` file
(:func:`save_file`, :func:`load_file`: the schema and CRC32Cs ride in its ``__metadata__``) or
one checkpoint directory (:func:`save_directory`, :func:`restore_directory`; the Orbax handlers
call :func:`restore_checkpoint` with a ``RestoreOptions``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline.read import ReadStats
from orbax_safetensors._src.pipeline.restore_options import RestoreOptions
from orbax_safetensors._src.pipeline.restore_plan import restore_tree
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

# --------------------------------------------------------------------------- one file


@_pieces.gc_paused()
def save_file(
    tree: Any,
    path: epath.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: _casting.DtypePolicy | None = None,
    io_options: _config.IOOptions | None = None,
) -> None:
    """Saves a pytree as one ``.safetensors`` file, atomically: a crash never leaves a
    half-written file at ``path`` (local files are renamed into place; an ``s3://`` or
    ``gs://`` object appears only once complete).

    Args:
      tree: any pytree of arrays (``jax.Array``, numpy), Python scalars, strings and None.
      path: the file to write (any ``etils.epath`` path, including ``s3://`` and ``gs://``).
      metadata: extra ``str -> str`` entries for the header's ``__metadata__``.
      dtype: store tensors in another dtype: one dtype (floating-point arrays only), a
        mapping of glob patterns over dotted names to a dtype or None (keep; the first match
        wins), or a callable ``(dotted_name, leaf) -> dtype | None``. Each tensor is cast as
        it is written; the schema records its original dtype.
      io_options: how the file is written (:class:`~orbax_safetensors.IOOptions`); None: the
        defaults.

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
    write_file(validated, path, metadata=metadata, io=io_options)


def write_file(
    validated: _checkpoint_save.ValidatedTree,
    path: epath.PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    io: _config.IOOptions | None = None,
) -> None:
    """Writes ``validated`` as :func:`save_file` does: into a temporary file beside ``path``,
    renamed into place and its directory synced (an object store: the object itself, which
    appears only once complete); a failure leaves nothing at ``path``."""
    path = epath.Path(path)
    tmp = None
    if not _router.is_object_url(path):
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    # Planned with placeholder checksums of the final width: every offset is known before any
    # byte is written.
    plan = _file_plan(validated, metadata, {s.name: _checksum.to_hex(0) for s in validated.specs})
    try:
        with _router.open_writer(
            tmp if tmp is not None else path,
            size=plan.files[0].size,
            truncate=tmp is not None,
            io=io,
        ) as w:
            # Data first, checksummed as written, a batch of tensors at a time (cast or copied
            # bytes are held for one batch only); then the header, which holds the CRCs.
            records: _interface.WriteResult = []
            pieces = _pieces.iter_host_pieces(plan, validated.flat.arrays)
            for _, batch in _checkpoint_save.batched(pieces, _WRITE_BATCH_BYTES):
                records += w.write(batch, checksums=True)
                del batch  # (not held while the next batch is produced)
            crcs = _pieces.tensor_checksums(records, {s.name: s.nbytes for s in validated.specs})
            checksums = {n: _checksum.to_hex(c) for n, c in crcs.items()}
            final = _file_plan(validated, metadata, checksums).files[0]
            if final.data_start != plan.files[0].data_start:
                raise AssertionError("internal: header length changed after checksumming")
            w.write([_interface.header_piece(final.header)])
        if tmp is not None:
            tmp.replace(path)
    except BaseException:  # nothing half-written is ever at ``path``
        if tmp is not None and tmp.exists():
            tmp.unlink()
        raise
    if tmp is not None:
        _router.fsync_dir(path.parent)


# Tensor bytes save_file hands to the writer at once: large enough for parallel writes,
# small enough that cast or device-copied bytes stay a bounded extra.
_WRITE_BATCH_BYTES = 64 << 20


def _file_plan(
    validated: _checkpoint_save.ValidatedTree,
    metadata: Mapping[str, str] | None,
    checksums: Mapping[str, str],
) -> _plan.CheckpointPlan:
    meta = _metadata.file_metadata(validated.flat.schema, checksums, metadata)
    return _plan.plan_files(validated.specs, max_file_size=None, metadata=meta)


def load_file(
    path: epath.PathLike,
    target: Any = None,
    *,
    strict: bool = True,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
    verify: bool = True,
    io_options: _config.IOOptions | None = None,
) -> Any:
    """Loads a ``.safetensors`` file, rebuilding the saved pytree.

    Args:
      path: a file written by :func:`save_file`, or any safetensors file (then the result is a
        flat ``{name: array}`` dict).
      target: optional pytree saying what to build, whose node types the result has: leaves
        may be ``jax.Array``, numpy arrays, ``jax.ShapeDtypeStruct`` (placed with its
        sharding; without one, a leaf saved as numpy comes back as numpy, as in Orbax),
        Python scalars, Orbax ``RestoreArgs``, or ``None`` / ``...`` / empty nodes to skip a
        leaf. Only the tensors the target asks for are read.
      strict: with a target, missing or unexpected keys raise one error listing all of them;
        ``strict=False`` skips unexpected keys, and missing keys keep the target's value.
      include: glob patterns over dotted names (``*`` crosses dots; ``params`` also selects
        ``params.w``; a pattern matching nothing raises ``TargetMismatchError``): only the
        selected tensors are read. None: every name.
      exclude: glob patterns of names not to read, by the same rule (after ``include``).
      verify: check each tensor read whole against its CRC32C: the file's own, or for a file
        of a checkpoint directory the one its ``orbax_safetensors.json`` records.
      io_options: how the file is read (:class:`~orbax_safetensors.IOOptions`; None: default).

    Raises:
      HeaderError, SchemaError: the file (or, with ``verify``, its directory's metadata) is
        damaged or hostile, or they disagree.
      TargetMismatchError: the target disagrees with the file (every key at once;
        ``.mismatches`` lists them).
      IntegrityError: a tensor's bytes do not match their checksum.

    Example::

        params = osf.load_file("w.safetensors", target=jax.eval_shape(lambda: params))
        attn = osf.load_file("w.safetensors", include="layers.*.attn", exclude="*.bias")
    """
    options = RestoreOptions.standalone(
        target, strict=strict, include=include, exclude=exclude, verify=verify, io=io_options
    )
    path = epath.Path(path)
    # The header and the tensors (and a checkpoint directory's metadata) are read through
    # separate opens: if save_file (or save_directory) replaces the file in between, the reads
    # mix two versions. Read again until the file stayed the same.
    for _ in range(_READ_ATTEMPTS):
        before = _identity(path)
        header = _router.read_header(path, options.io)
        try:
            schema, stored = _read.file_index(path, header, directory_checksums=options.verify)
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
    # What changes when a local file is replaced or rewritten (None elsewhere).
    if not _router.is_local(path):
        return None
    try:
        st = os.stat(os.fspath(path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def load_metadata(path: epath.PathLike) -> dict[str, str]:
    """The user metadata of a file saved with :func:`save_file` (reserved keys removed).

    Example::

        osf.load_metadata("w.safetensors")  # {"format": "flax", "step": "10"}
    """
    header = _router.read_header(path)
    return {k: v for k, v in header.metadata.items() if k not in _metadata.RESERVED_KEYS}


# --------------------------------------------------------------------------- a directory


@_pieces.gc_paused()
def save_directory(
    tree: Any,
    directory: epath.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    dtype: _casting.DtypePolicy | None = None,
    io_options: _config.IOOptions | None = None,
) -> None:
    """Saves ``tree`` as a checkpoint directory from one process, without Orbax; ``dtype`` and
    ``io_options`` as in :func:`save_file`. An existing directory's checkpoint files are
    replaced whole: a reader never meets old and new files mixed.

    Example::

        osf.save_directory(state, "/tmp/ckpt", max_file_size=1 << 30)
    """
    directory = epath.Path(directory)
    layout = _checkpoint_save.SaveLayout(max_file_size)
    validated = _checkpoint_save.validate_save(tree, metadata, dtype=dtype)  # before any I/O
    with _replace.replacing_directory(directory) as out:
        job = _save_job.SaveJob(
            validated, out, mode=_save_job.SaveMode.DIRECT, layout=layout, io=io_options
        )
        job.start()
        job.write()
        job.finalize()


def restore_directory(
    directory: epath.PathLike,
    target: Any = None,
    *,
    strict: bool = True,
    verify: bool = True,
    stats: ReadStats | None = None,
    fallback_sharding: jax.sharding.Sharding | None = None,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
    io_options: _config.IOOptions | None = None,
) -> Any:
    """Restores a checkpoint directory (a step's item directory, or one that
    :func:`save_directory` wrote), without Orbax's manager.

    ``target``, ``strict``, ``include``, ``exclude``, ``verify`` and ``io_options`` are as in
    :func:`load_file`; ``stats`` (a ``ReadStats``) accumulates the bytes read and needed. As in
    Orbax, an array saved as ``jax.Array`` whose target gives no sharding goes on its saved
    sharding when this job has those devices, else on ``fallback_sharding``, else a
    ``TargetMismatchError`` asks for a target sharding. Host-local arrays come back on this
    process's first device.

    Example::

        state = osf.restore_directory("/tmp/ckpt/100/default", target=abstract_state)
    """
    options = RestoreOptions.standalone(
        target,
        strict=strict,
        include=include,
        exclude=exclude,
        verify=verify,
        fallback_sharding=fallback_sharding,
        io=io_options,
    )
    return restore_checkpoint(directory, options, stats=stats)


@_pieces.gc_paused()
def restore_checkpoint(
    directory: epath.PathLike,
    options: RestoreOptions | None = None,
    *,
    stats: ReadStats | None = None,
) -> Any:
    """Restores a checkpoint directory as ``options`` asks; placement as in
    :func:`restore_directory`."""
    options = options or RestoreOptions()
    directory = epath.Path(directory)
    metadata = _read.read_metadata(directory, stats=stats)
    stored = _read.locate_in_directory(directory, metadata, stats=stats, io=options.io)
    saved_sharding = _place.saved_shardings(directory, metadata, options.fallback_sharding)
    return restore_tree(
        metadata["schema"], stored, options, stats=stats, saved_sharding=saved_sharding
    )
