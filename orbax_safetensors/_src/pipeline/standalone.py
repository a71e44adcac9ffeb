"""The standalone verbs: a pytree to and from one ``.safetensors`` file (:func:`save_file`,
:func:`load_file`) or one checkpoint directory (:func:`save_directory`,
:func:`restore_directory`), no Orbax needed; and the two restores the Orbax handlers call with
a :class:`.RestoreOptions` (:func:`load_with_options`, :func:`restore_checkpoint`).

A file keeps the tree schema and per-tensor CRC32C checksums in its ``__metadata__``, so it
round-trips alone, while every safetensors reader sees plain tensors under dotted names.

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

import jax
from etils import epath

from orbax_safetensors._src.core import casting as _casting
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
      target: optional pytree saying what to build: leaves may be ``jax.Array``, numpy arrays,
        ``jax.ShapeDtypeStruct`` (placed with its sharding; without one, a leaf saved as numpy
        comes back as numpy of the struct's dtype, as Orbax's ``StandardRestore`` gives it),
        Python scalars, Orbax ``RestoreArgs``, or ``None`` / ``...`` / empty nodes to skip a
        leaf; the result has the target's node types (TrainState, namedtuples,
        ``nnx.State``...). Only the tensors the target asks for are read.
      strict: with a target, missing or unexpected keys (and ``None`` or an empty node where
        the file has a subtree) raise one error listing all of them; with ``strict=False``
        unexpected keys and skipped subtrees are skipped, and missing keys keep the target's
        (concrete) value.
      include: glob patterns (a string or a sequence) over dotted names, as ``fnmatch`` reads
        them (``*`` crosses dots); a pattern also selects all beneath a name it matches
        (``params`` selects ``params.w``), and one matching no name raises
        ``TargetMismatchError``. Only the selected tensors are read: without a target in their
        saved containers (lists keep their length, None where nothing is selected), with one
        an unselected target leaf comes back as given. None: every name.
      exclude: glob patterns of names not to read, by the same rule (after ``include``).
      verify: check each tensor read whole against its CRC32C: the file's own, or for a file
        of a checkpoint directory (a CheckpointManager item's ``model.safetensors``) the one
        the directory's ``orbax_safetensors.json`` records, which must then describe the file
        exactly as its header does. False: nothing is checked, no directory metadata read.
      io_options: how the file is read (:class:`~orbax_safetensors.IOOptions`; None: default).

    Raises:
      HeaderError, SchemaError: the file is damaged or hostile, or (with ``verify``) the
        metadata of the checkpoint directory it belongs to is, or disagrees with it.
      TargetMismatchError: the target disagrees with the file (names every key at once;
        ``.mismatches`` lists them as records).
      IntegrityError: a tensor's bytes do not match their checksum.

    Example::

        params = osf.load_file("w.safetensors", target=jax.eval_shape(lambda: params))
        attn = osf.load_file("w.safetensors", include="layers.*.attn", exclude="*.bias")
    """
    options = RestoreOptions.standalone(
        target, strict=strict, include=include, exclude=exclude, verify=verify, io=io_options
    )
    return load_with_options(path, options)


def load_with_options(path: epath.PathLike, options: RestoreOptions) -> Any:
    """Loads a ``.safetensors`` file as ``options`` asks; with ``options.verify``, a file of a
    checkpoint directory is checked against the checksums its directory records. Raises as
    :func:`load_file` does.

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
    """Saves ``tree`` as a checkpoint directory from one process (no Orbax involved);
    ``dtype`` is a dtype policy (see :func:`save_file`), applied tensor by tensor as it writes;
    ``io_options`` the I/O options (see :func:`save_file`). An existing directory's checkpoint
    files are replaced whole: a reader never meets old and new files mixed.

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
    """Restores a checkpoint directory (an item directory of a step, or one that
    :func:`save_directory` wrote), without Orbax's manager.

    ``target``, ``strict``, ``include``, ``exclude``, ``verify`` and ``io_options`` are as in
    :func:`load_file` (``strict`` governs keys); only the selected tensors' bytes are read.
    ``stats`` (a ``ReadStats``) accumulates the bytes read and needed.

    As Orbax's handlers do, arrays saved as ``jax.Array`` without a sharding in the target (no
    target at all, ``jax.ShapeDtypeStruct`` or ``ArrayRestoreArgs`` without one,
    ``RestoreArgs()``) are placed with their saved sharding, rebuilt over the saved devices
    when this job has them all; otherwise on ``fallback_sharding`` (as Orbax's
    ``StandardRestore(fallback_sharding=...)``) if given, else a ``TargetMismatchError`` asks
    for a target sharding (Orbax: "Topology mismatch"). Arrays saved host-local come back on
    this process's first device.

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
    :func:`restore_directory` (``options.fallback_sharding``).

    Example::

        tree = restore_checkpoint(path, RestoreOptions(target=abstract, keys=Keys.PARTIAL))
    """
    options = options or RestoreOptions()
    directory = epath.Path(directory)
    metadata = _read.read_metadata(directory, stats=stats)
    stored = _read.locate_in_directory(directory, metadata, stats=stats, io=options.io)
    saved_sharding = _place.saved_shardings(directory, metadata, options.fallback_sharding)
    return restore_tree(
        metadata["schema"], stored, options, stats=stats, saved_sharding=saved_sharding
    )
