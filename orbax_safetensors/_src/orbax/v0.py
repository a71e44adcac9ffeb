"""The Orbax plugin: ``SafetensorsCheckpointHandler`` and its registered args.

Thin glue over ``pipeline.save_job`` and ``pipeline.checkpoint_restore``: each save is one
``SaveJob`` (run by ``orbax/saving.py``): under an async save, ``async_save`` copies this
process's owned shards to host (so the caller may donate its arrays as soon as ``save()``
returns) and a commit future plans and writes them once Orbax has created the step directory;
under a synchronous save it writes straight from the arrays. Orbax's barrier then orders "every
process wrote" before the primary's :meth:`finalize`, which finds the job by its directory and
merges checksums into the metadata file, before Orbax commits the step atomically. The handler
holds no state of a save: one instance serves any number of items, managers and concurrent
saves. Orbax's own args in a mixed root go to Orbax's handlers (``orbax/routing.py``).

Example::

    import orbax.checkpoint as ocp
    import orbax_safetensors as osf

    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    state = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore(abstract_state))
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.orbax import restoring as _restoring
from orbax_safetensors._src.orbax import routing as _routing
from orbax_safetensors._src.orbax import saving as _saving
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.restore_args import SafetensorsRestore
from orbax_safetensors._src.orbax.save_args import SafetensorsSave
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.orbax.tree_metadata import TreeMetadata
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline.reader import ReadStats
from orbax_safetensors._src.pipeline.restore_options import Words
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config


class SafetensorsCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Stores a pytree as standard safetensors files plus ``orbax_safetensors.json``.

    Args:
      max_file_size: split the tensors into files of at most this many bytes of data (a tensor
        never spans files; one file holds a tensor larger than this alone). ``None``: one file.
        Default about 5 GB, as on the Hugging Face Hub.
      checksums: compute a CRC32C of every tensor while saving (stored in the metadata file).
      verify: on restore, check every tensor read whole against its CRC32C.
      primary_host: the process that writes headers, index and metadata and finalizes
        (Orbax's convention; default 0).
      reuse_host_buffers: an async save copies into host buffers kept from the previous
        save (no allocation and page faults per save, so ``save()`` blocks for little more
        than the copy); between saves they hold this process's share of the last save's large
        tensors until ``close()``. False: fresh buffers each save, freed once written.
      device_snapshot: an async save on an accelerator (TPU, GPU) copies this process's
        shards on their devices, when every device has room for the copies, and returns:
        ``save()`` blocks for milliseconds and the device-to-host copies run beside training
        (the device memory of each copy is freed once it is on the host). False, or without
        the room: the host copies are made before ``save()`` returns.
      io_options: how files are written and read (``osf.IOOptions``: direct I/O mode,
        object-store options, tracing); None: the defaults (environment variables).

    After a save's writes finish, ``last_write_stats`` (a ``WriteStats``) holds the byte ranges
    this process wrote; after a restore, ``last_read_stats`` (a ``ReadStats``) holds the bytes
    it read against the bytes it needed.

    Example::

        handler = osf.SafetensorsCheckpointHandler(max_file_size=2 << 30, checksums=True)
        mngr = ocp.CheckpointManager(path, item_handlers=handler)
    """

    def __init__(
        self,
        *,
        max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
        checksums: bool = True,
        verify: bool = True,
        primary_host: int = 0,
        reuse_host_buffers: bool = True,
        device_snapshot: bool = True,
        io_options: _config.IOOptions | None = None,
    ) -> None:
        self._layout = _checkpoint_save.SaveLayout(max_file_size, checksums)
        self._verify = verify
        self._primary_host = primary_host
        self._io = io_options
        self._device_snapshot = device_snapshot
        self.last_read_stats: ReadStats | None = None
        self.last_write_stats: _pieces.WriteStats | None = None
        # Not per save: the written jobs awaiting finalize, by item directory; Orbax's handlers
        # for Orbax's args (see handler_registry); host buffers an async save's copies reuse
        # (a save takes free ones only, so concurrent saves never share one).
        self._pending = _save_job.PendingSaves()
        self._routing = _routing.OrbaxRouter()
        self._host_buffers = _buffers.HostBufferPool() if reuse_host_buffers else None

    def _orbax_handler(self, kind: str) -> Any:
        return self._routing.handler(kind)

    @property
    def primary_host(self) -> int:
        """The process that writes headers, index and metadata and finalizes."""
        return self._primary_host

    def new_job(
        self, directory: epath.Path, args: SafetensorsSave, mode: _save_job.SaveMode
    ) -> _save_job.SaveJob:
        """A ``SaveJob`` of ``args`` into ``directory`` with this handler's options (on the
        caller's thread: raises if ``primary_host`` is not a process of this job)."""
        job = _save_job.SaveJob(
            args.validated_tree,
            directory,
            mode=mode,
            layout=self._layout,
            processes=_save_job.Processes.of_jax(self._primary_host),
            host_buffers=self._host_buffers,
            io=args.io_options if args.io_options is not None else self._io,
            export=args.export_plan,
            device_snapshot=self._device_snapshot,
        )
        self.last_write_stats = job.stats
        return job

    def async_save(  # type: ignore[override]
        self, directory: epath.Path, args: SafetensorsSave | Any
    ) -> Coroutine[Any, Any, list[ocp_future.Future] | None]:
        """Starts the save; the returned coroutine (awaited by Orbax) gives its commit future.

        Under an async ``CheckpointManager`` (or ``ocp.AsyncCheckpointer``) this process's owned
        shards are copied to host before this returns, so the caller may donate or overwrite
        its arrays as soon as ``save()`` returns; a writer thread plans the files and writes
        the copies once Orbax's step directory exists (a large state's writes start while its
        later tensors are still being copied). Under a synchronous save, which waits for the
        commit future before returning, nothing is copied up front: each tensor is written
        straight from its buffer. If the copies fail this raises, and nothing of the save is
        written or left writing.

        A plain method returning a coroutine, not ``async def``: the copies must happen in the
        caller's call, and :func:`_saving.save_mode` must see the caller's frames.
        """
        if (
            _routing.orbax_kind(args) is not None
        ):  # Orbax's StandardSave / PyTreeSave, in a mixed root
            self._pending.pop(directory)
            return self._routing.async_save(directory, args)
        job = self._job(directory, args, _saving.save_mode(skip=1))
        try:
            futures = _saving.start(job, on_failure=lambda: self._pending.discard(job))
        except BaseException:
            self._pending.discard(job)
            raise

        async def started() -> list[ocp_future.Future]:
            return futures

        return started()

    def _job(
        self, directory: epath.Path, args: SafetensorsSave, mode: _save_job.SaveMode
    ) -> _save_job.SaveJob:
        # A job finalize will look up by its directory (the primary's only: Orbax finalizes
        # there).
        self._routing.forget(directory)
        job = self.new_job(directory, args, mode)
        if job.processes.is_primary:
            self._pending.add(job)
        return job

    @_gcpause.paused
    def save(self, directory: epath.Path, args: SafetensorsSave | Any) -> None:
        """Synchronous save (used by ``ocp.Checkpointer``): writes straight from the arrays."""
        if (
            _routing.orbax_kind(args) is not None
        ):  # Orbax's StandardSave / PyTreeSave, in a mixed root
            self._pending.pop(directory)
            self._routing.save(directory, args)
            return
        job = self._job(directory, args, _save_job.SaveMode.DIRECT)
        try:
            _saving.write_now(job)
        except BaseException:
            self._pending.discard(job)
            raise

    def finalize(self, directory: epath.Path) -> None:
        """Merges every process's checksums into the metadata file (primary, after all wrote)."""
        if self._routing.finalize(directory):  # an item Orbax's handler saved (Orbax's args)
            return
        job = self._pending.pop(directory)
        if job is None:  # not saved through this handler: the draft and shares are on disk
            _save_job.finalize_from_disk(directory, self._io)
        else:
            job.finalize()

    def restore(self, directory: epath.Path, args: SafetensorsRestore | Any = None) -> Any:
        """Restores the tree; see :class:`SafetensorsRestore` for the target forms.

        An Orbax-native item (a step that ``StandardSave`` or ``PyTreeSave`` wrote in the same
        root) is restored through Orbax's own handler, with the same arguments: a root can
        hold both kinds of steps (see :func:`handler_registry`).
        """
        native = _steps.item_kind(epath.Path(directory)) is PathKind.ORBAX
        if native:  # (Orbax reads the names its _METADATA records: kept inside the item)
            _steps.check_orbax_item(directory)
        kind = _routing.orbax_kind(args)
        if kind is not None:  # Orbax's StandardRestore / PyTreeRestore, in a mixed root
            if native:
                return self._orbax_handler(kind).restore(directory, args=args)
            args = SafetensorsRestore(**_restoring.from_orbax_restore(args))
        args = args or SafetensorsRestore()
        if native:
            return _restoring.restore_orbax_native(directory, args, self._orbax_handler)
        return self.restore_safetensors(directory, args)

    def restore_safetensors(
        self, directory: epath.Path, args: SafetensorsRestore, *, words: Words | None = None
    ) -> Any:
        """Restores a safetensors item; a mismatch error is worded in ``words`` (the option
        names of the API the caller came through; default ``SafetensorsRestore``'s)."""
        stats = ReadStats()
        io = args.io_options if args.io_options is not None else self._io
        if args.mapping is not None:  # a Hugging Face directory, read into the JAX layout
            result = _export.check_mapping(args.mapping).restore(
                epath.Path(directory),
                args.item,
                strict=not args.partial_restore,
                verify=self._verify,
                io=io,
                stats=stats,
            )
            self.last_read_stats = stats
            return result
        result = _restoring.restore_safetensors(
            directory,
            args,
            verify=self._verify,
            words=words or _restoring.v0_words(args),
            stats=stats,
            io=args.io_options if args.io_options is not None else self._io,
        )
        self.last_read_stats = stats
        return result

    def metadata(self, directory: epath.Path) -> TreeMetadata | Any:
        """The saved tree (``jax.ShapeDtypeStruct`` leaves, inline values as saved) and its
        ``custom_metadata``, as a ``TreeMetadata`` like Orbax's; reads no tensor bytes."""
        if _steps.item_kind(epath.Path(directory)) is PathKind.ORBAX:  # an Orbax-native step
            _steps.check_orbax_item(directory)
            return self._orbax_handler("pytree").metadata(directory)  # type: ignore[no-any-return]
        metadata = _checkpoint_restore.read_metadata(directory)
        return TreeMetadata.build(
            _checkpoint_restore.abstract_tree(directory, metadata),
            custom_metadata=metadata.get("metadata") or None,
        )

    def close(self) -> None:
        """Closes Orbax's handlers used for Orbax's args; every file of ours is closed when its
        write or read ends."""
        self._routing.close()
        if self._host_buffers is not None:
            self._host_buffers.clear()  # the host memory kept for the next save

    @classmethod
    def typestr(cls) -> str:
        return _steps.HANDLER_TYPESTR


def handler_registry(
    handler: SafetensorsCheckpointHandler | None = None, item: str = "default"
) -> Any:
    """A ``CheckpointHandlerRegistry`` for a root that holds Orbax-native and safetensors steps.

    Item ``item`` goes to ``handler`` (default ``SafetensorsCheckpointHandler()``) for
    ``SafetensorsSave`` / ``SafetensorsRestore`` and for Orbax's ``StandardSave`` /
    ``StandardRestore`` and ``PyTreeSave`` / ``PyTreeRestore``, which it passes to Orbax's own
    handlers: those steps are Orbax-native, as before. ``mngr.restore(step)`` without args and
    ``mngr.item_metadata(step)`` read each step with its own format; Orbax's restore args on a
    safetensors step mean what they mean in ``SafetensorsRestore``. Without it, Orbax's ``CheckpointManager`` ties each item to the first
    handler it meets, and the other kind of args fails with "does not match with any
    registered handler".

    Example::

        mngr = ocp.CheckpointManager(root, handler_registry=osf.handler_registry())
        state = mngr.restore(mngr.latest_step())  # an Orbax-native step
        mngr.save(step + 1, args=osf.SafetensorsSave(state))
    """
    return _routing.registry_for(
        handler or SafetensorsCheckpointHandler(), item, (SafetensorsSave, SafetensorsRestore)
    )


# SafetensorsSave is defined in save_args.py; it saves through this handler.
ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_save=True)(SafetensorsSave)


# SafetensorsRestore is defined in restore_args.py; it restores through this handler.
ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_restore=True)(SafetensorsRestore)
