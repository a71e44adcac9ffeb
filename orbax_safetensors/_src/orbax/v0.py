"""The Orbax plugin: ``SafetensorsCheckpointHandler`` and its registered args.

Thin glue over ``pipeline.checkpoint_save`` and ``pipeline.checkpoint_restore``: under an async
save, ``async_save`` copies this process's owned shards to host (so the caller may donate its
arrays as soon as ``save()`` returns) and a commit future names, plans and writes them once Orbax has created the step
directory; under a synchronous save it writes straight from the arrays. Orbax's barrier then
orders "every process wrote" before the primary's :meth:`finalize`, which merges checksums into
the metadata file, before Orbax commits the step atomically.

Example::

    import orbax.checkpoint as ocp
    import orbax_safetensors as osf

    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=osf.SafetensorsSave(state))
    mngr.wait_until_finished()
    state = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore(abstract_state))
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.orbax import args as _args
from orbax_safetensors._src.orbax import object_storage as _object_storage
from orbax_safetensors._src.orbax import restoring as _restoring
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.tree_metadata import TreeMetadata
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.pipeline.reader import ReadStats
from orbax_safetensors._src.pipeline.restore_options import Words
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import router as _router

# How long an async save's writer waits, once every host copy is made, before it plans the
# files: time for the caller's thread to finish Orbax's save() without this thread's Python
# work competing for the GIL.
_PLAN_DELAY_SECONDS = 0.03


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
        io_options: _config.IOOptions | None = None,
    ) -> None:
        if max_file_size is not None and max_file_size <= 0:
            raise ValueError(f"max_file_size must be positive or None, got {max_file_size}")
        self._max_file_size = max_file_size
        self._checksums = checksums
        self._verify = verify
        self._primary_host = primary_host
        self._io = io_options
        self.last_read_stats: ReadStats | None = None
        self.last_write_stats: _pieces.WriteStats | None = None
        # (item directory, metadata draft) of this process's last save as the primary, so that
        # finalize need not read the draft back (Orbax finalizes on the primary, after all wrote).
        self._draft: tuple[str, dict[str, Any]] | None = None
        # In a single-process job: (item directory, checksum share) of the last save, which is
        # then kept in memory only, as is the draft (the finalize is this process's).
        self._share: tuple[str, dict[str, Any]] | None = None
        # Orbax's own handlers, for Orbax's args in a mixed root (see handler_registry), by
        # kind; and which of them saved each item directory still to finalize.
        self._orbax: dict[str, Any] = {}
        self._orbax_saved: dict[str, Any] = {}
        # An async save's host copies go to buffers kept from the previous save (no allocation
        # and page faults per save); between saves they hold this process's share of one save.
        self._host_buffers = _buffers.HostBufferPool() if reuse_host_buffers else None

    def _orbax_handler(self, kind: str) -> Any:
        handler = self._orbax.get(kind)
        if handler is None:
            make = (
                ocp.StandardCheckpointHandler if kind == "standard" else ocp.PyTreeCheckpointHandler
            )
            handler = self._orbax[kind] = make()
        return handler

    @property
    def primary_host(self) -> int:
        """The process that writes headers, index and metadata and finalizes."""
        return self._primary_host

    def _is_primary(self) -> bool:
        return jax.process_index() == self._primary_host

    def _prepare(
        self,
        directory: epath.Path,
        args: SafetensorsSave,
        *,
        snapshot: _snapshots.SnapshotQueue | None = None,
    ) -> _checkpoint_save.PreparedSave:
        # Always lazy: ``pieces`` views each tensor when iterated, or writes ``snapshot``'s
        # host copies.
        prepared = _checkpoint_save.prepare_save(
            args.item,
            validated=args._validated,
            user_metadata=args.custom_metadata,
            max_file_size=self._max_file_size,
            is_primary=self._is_primary(),
            process_index=jax.process_index(),
            copy=False,
            lazy=True,
            checksums=self._checksums,
            snapshot=snapshot,
        )
        self._draft = (str(directory), prepared.metadata) if prepared.is_primary else None
        return prepared

    def _check_primary_host(self) -> None:
        count = jax.process_count()
        if not 0 <= self._primary_host < count:
            # Checked on the caller's thread: otherwise no process writes the headers and the
            # step fails later, in Orbax's background commit, with a FileNotFoundError.
            raise ValueError(
                f"primary_host={self._primary_host} is not a process of this job "
                f"(jax.process_count() is {count}); pass a process index in [0, {count})"
            )

    @_gcpause.paused  # (the caller's thread only: what outlives save() is never paused)
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
        straight from its buffer (zero-copy on CPU; one tensor at a time in host memory on
        accelerators).

        A plain method returning a coroutine, not ``async def``: the copies must happen in the
        caller's call, and :func:`_orbaxcompat.orbax_waits_for_commit` must see the caller's frames.
        """
        kind = _orbax_kind(args)
        if kind is not None:  # Orbax's StandardSave / PyTreeSave, in a mixed root
            handler = self._orbax_handler(kind)
            self._orbax_saved[str(directory)] = handler
            return handler.async_save(directory, args=args)  # type: ignore[no-any-return]
        self._check_primary_host()
        sync = _orbaxcompat.orbax_waits_for_commit(skip=1)
        stats = self.last_write_stats = _pieces.WriteStats()
        persist = _persist_shares()
        self._share = None
        snapshot = None if sync else _snapshots.SnapshotQueue()
        prepared: _checkpoint_save.PreparedSave | None = None
        if (
            snapshot is None
            or _router.is_object_url(directory)
            or args._validated.header_bound() > _header.MAX_HEADER_BYTES
        ):
            # Planned now, on the caller's thread: a sync save writes straight from the arrays;
            # object storage must start its uploads here (see _prepare_directory); a header
            # that may exceed the safetensors cap must fail here, not in the background.
            prepared = self._prepare(directory, args, snapshot=snapshot)
            _prepare_directory(directory, prepared, self._io)

        def write_share() -> dict[str, Any]:
            ready = prepared
            if ready is None:
                # Planned here, on the writer thread, once the first host copies (or all of
                # a small state's) are in: the planning is Python work per tensor, which
                # save() need not wait for.
                assert snapshot is not None
                snapshot.wait_started()
                if snapshot.complete():
                    # All copied: give the caller's thread time to leave save() before this
                    # thread takes the GIL for planning (Orbax's few milliseconds of
                    # bookkeeping after our async_save stretch many times over against a
                    # planning thread). A fixed courtesy: nothing here may look at the
                    # caller's thread (reading another thread's frames can crash CPython).
                    time.sleep(_PLAN_DELAY_SECONDS)
                ready = self._prepare(directory, args, snapshot=snapshot)
            return _checkpoint_save.write_process_share(
                ready, directory, stats, persist_share=persist, io=self._io
            )

        def write_share_paused() -> dict[str, Any]:
            # The caller waits in Orbax's synchronous save() for this write: the cyclic GC
            # may pause for it. An async save's write outlives save(): it never pauses the GC.
            with _gcpause.gc_paused():
                return write_share()

        pool = self._host_buffers if snapshot is not None else None
        arena = pool.arena() if pool is not None else None

        async def write() -> None:
            # Runs once the contracted signals arrive (the step directory exists); the blocking
            # file I/O runs on a worker thread so the event loop stays responsive.
            try:
                share = await asyncio.to_thread(write_share_paused if sync else write_share)
            finally:
                if pool is not None and arena is not None:
                    pool.release(arena)  # written (or failed): the next save reuses them
            self._share = None if persist else (str(directory), share)

        future = ocp_future.CommitFutureAwaitingContractedSignals(write(), name="safetensors_save")
        if snapshot is not None:
            try:
                arrays = enumerate(args._validated.captured.arrays)
                casts = args._validated.snapshot_casts()  # a dtype policy: copy the cast bytes
                snaps = _snapshots.iter_snapshots(
                    arrays, is_primary=self._is_primary(), casts=casts, buffers=arena
                )
                for item in snaps:
                    snapshot.put(item)  # device-to-host copies, on the caller's thread
            except BaseException as e:
                snapshot.fail(e)
                captured = args._validated.captured  # arrays donated since the args were built?
                _checkpoint_save.check_not_deleted(zip(captured.names, captured.arrays))
                raise
            snapshot.close()

        async def started() -> list[ocp_future.Future]:
            return [future]

        return started()

    @_gcpause.paused
    def save(self, directory: epath.Path, args: SafetensorsSave | Any) -> None:
        """Synchronous save (used by ``ocp.Checkpointer``): writes straight from the arrays."""
        kind = _orbax_kind(args)
        if kind is not None:  # Orbax's StandardSave / PyTreeSave, in a mixed root
            handler = self._orbax_handler(kind)
            self._orbax_saved[str(directory)] = handler
            handler.save(directory, args=args)
            return
        self._check_primary_host()
        prepared = self._prepare(directory, args)
        _prepare_directory(directory, prepared, self._io)
        self.last_write_stats = _pieces.WriteStats()
        persist = _persist_shares()
        share = _checkpoint_save.write_process_share(
            prepared, directory, self.last_write_stats, persist_share=persist, io=self._io
        )
        self._share = None if persist else (str(directory), share)

    def finalize(self, directory: epath.Path) -> None:
        """Merges every process's checksums into the metadata file (primary, after all wrote)."""
        orbax = self._orbax_saved.pop(str(directory), None)
        if orbax is not None:  # an item Orbax's handler saved (Orbax's args)
            orbax.finalize(directory)
            return
        draft, self._draft = self._draft, None
        share, self._share = self._share, None
        known = draft[1] if draft is not None and draft[0] == str(directory) else None
        shares = [share[1]] if share is not None and share[0] == str(directory) else []
        _checkpoint_save.finalize(directory, known, shares, io=self._io)

    def restore(self, directory: epath.Path, args: SafetensorsRestore | Any = None) -> Any:
        """Restores the tree; see :class:`SafetensorsRestore` for the target forms.

        An Orbax-native item (a step that ``StandardSave`` or ``PyTreeSave`` wrote in the same
        root) is restored through Orbax's own handler, with the same arguments: a root can
        hold both kinds of steps (see :func:`handler_registry`).
        """
        native = _steps.item_kind(epath.Path(directory)) == "orbax"
        kind = _orbax_kind(args)
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
        result = _restoring.restore_safetensors(
            directory,
            args,
            verify=self._verify,
            words=words or _restoring.v0_words(args),
            stats=stats,
            io=self._io,
        )
        self.last_read_stats = stats
        return result

    def metadata(self, directory: epath.Path) -> TreeMetadata | Any:
        """The saved tree (``jax.ShapeDtypeStruct`` leaves, inline values as saved) and its
        ``custom_metadata``, as a ``TreeMetadata`` like Orbax's; reads no tensor bytes."""
        if _steps.item_kind(epath.Path(directory)) == "orbax":  # an Orbax-native step
            return self._orbax_handler("pytree").metadata(directory)  # type: ignore[no-any-return]
        metadata = _checkpoint_restore.read_metadata(directory)
        return TreeMetadata.build(
            _checkpoint_restore.abstract_tree(directory, metadata),
            custom_metadata=metadata.get("metadata") or None,
        )

    def close(self) -> None:
        """Closes Orbax's handlers used for Orbax's args; every file of ours is closed when its
        write or read ends."""
        handlers, self._orbax = list(self._orbax.values()), {}  # new ones if used again
        for handler in handlers:
            handler.close()
        if self._host_buffers is not None:
            self._host_buffers.clear()  # the host memory kept for the next save

    @classmethod
    def typestr(cls) -> str:
        return _steps.HANDLER_TYPESTR


def _orbax_kind(args: object) -> str | None:
    """``standard`` or ``pytree`` for Orbax's own args (a mixed root's), else None."""
    if isinstance(args, (ocp.args.StandardSave, ocp.args.StandardRestore)):
        return "standard"
    if isinstance(args, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)):
        return "pytree"
    return None


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
    handler = handler or SafetensorsCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    # One handler for every args type: Orbax finalizes, restores without args and reads
    # metadata through one handler per item (the first or the last registered); ours passes
    # Orbax's args to Orbax's handlers and reads either kind of step.
    for args_type in (
        SafetensorsSave,
        SafetensorsRestore,
        ocp.args.StandardSave,
        ocp.args.StandardRestore,
        ocp.args.PyTreeSave,
        ocp.args.PyTreeRestore,
    ):
        registry.add(item, args_type, handler)
    return registry


def _prepare_directory(
    directory: epath.Path,
    prepared: _checkpoint_save.PreparedSave,
    io: _config.IOOptions | None = None,
) -> None:
    # Main thread, every process, before any write: on S3 with several processes the primary
    # starts the multipart uploads the processes' parts go into (no-op elsewhere).
    _object_storage.refuse_renaming_commit(directory)  # S3: a save Orbax would commit by renaming
    files = [(f.filename, f.size) for f in prepared.plan.files]
    _router.prepare_directory(directory, files, is_primary=prepared.is_primary, io=io)


def _persist_shares() -> bool:
    # The metadata draft and checksum shares go to disk for a finalize in another process; in a
    # single-process job the finalize is this process's, and takes them from memory. (A crash
    # before it leaves an uncommitted step either way.)
    return jax.process_count() > 1


_REGISTRY_HINT = (
    "an item that also takes Orbax's StandardSave/PyTreeSave args needs "
    "ocp.CheckpointManager(..., handler_registry=osf.handler_registry())"
)


@ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_save=True)
@dataclasses.dataclass(repr=False)
class SafetensorsSave(ocp.args.CheckpointArgs):
    """Save ``item`` (any pytree) as safetensors; Orbax's ``StandardSave`` arguments.

    Attributes:
      item: the pytree to save.
      save_args: as in ``StandardSave``: a tree like ``item`` of ``ocp.SaveArgs`` (or None).
        ``SaveArgs(dtype=...)`` casts the leaf before saving, as Orbax does; the zarr
        options (``chunk_byte_size``, ``shard_axes``) and ``aggregate`` raise a
        ``ValueError`` saying what to do instead.
      custom_metadata: optional JSON-serialisable dict stored in ``orbax_safetensors.json``,
        returned by ``handler.metadata(...).custom_metadata`` (Orbax's name).
      metadata: the same as ``custom_metadata`` (this library's earlier name); pass one.
        ``custom_metadata`` holds the value either way.
      dtype: a save-time dtype policy, as in ``osf.save_file``: one dtype (every
        floating-point array is stored in it), a mapping of glob patterns over dotted names to
        a dtype or None (first match wins), or a callable ``(dotted_name, leaf) -> dtype |
        None``. Each tensor is cast as it is written (a synchronous save) or copied to host
        (an async save's snapshot holds the cast bytes), never as a cast copy of the whole
        state; each process casts its own shards. A bad policy raises here, before Orbax
        creates the step.

    Prints as a summary (``SafetensorsSave(item=<dict: 12 leaves, 3.4 MiB>)``), never the
    arrays.
    """

    item: Any
    save_args: Any = None
    custom_metadata: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] | None = None
    dtype: Any = None
    _validated: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.custom_metadata is None:
            self.custom_metadata = self.metadata
        elif self.metadata is not None and self.metadata != self.custom_metadata:
            raise ValueError(
                "SafetensorsSave: pass custom_metadata (Orbax's name) or metadata, not both"
            )
        # Validate here, on the caller's line: once CheckpointManager.save() has started its
        # background step-directory creation, an error inside async_save can leave the process
        # waiting in Orbax's barriers at exit.
        item = _args.apply_save_args(self.item, self.save_args)
        self._validated = _checkpoint_save.validate_save(
            item, self.custom_metadata, dtype=self.dtype
        )

    def __repr__(self) -> str:
        parts = [f"item={_args.tree_summary(self.item)}"]
        if self.save_args is not None:
            parts.append(f"save_args={_args.tree_summary(self.save_args)}")
        if self.custom_metadata is not None:
            parts.append(f"custom_metadata={_args.tree_summary(dict(self.custom_metadata))}")
        if self.dtype is not None:
            parts.append(_casting.parse_policy(self.dtype).describe())  # type: ignore[union-attr]
        return f"SafetensorsSave({', '.join(parts)})"

    def __str__(self) -> str:
        return _with_registry_hint(repr(self))


@ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_restore=True)
@dataclasses.dataclass(repr=False)
class SafetensorsRestore(ocp.args.CheckpointArgs):
    """Restore a safetensors checkpoint; Orbax's ``StandardRestore`` and ``PyTreeRestore``
    arguments, with their meanings.

    Attributes:
      item: None (the saved tree, rebuilt from its schema) or a target pytree whose leaves are
        arrays, numpy arrays, ``jax.ShapeDtypeStruct`` (with an optional sharding), Python
        scalars or ``ocp.ArrayRestoreArgs``; the result has the target's node types. A
        ``TreeMetadata`` (from ``handler.metadata`` or ``mngr.item_metadata``) works too.
      strict: as in ``StandardRestore``: an array whose stored shape differs from the
        target's raises (False: it is truncated or padded with zeros to the target's shape,
        same rank). Missing or unexpected keys are ``partial_restore``'s business.
      restore_args: as in ``PyTreeRestore``: a tree of ``ocp.RestoreArgs`` /
        ``ocp.ArrayRestoreArgs`` (e.g. from ``ocp.checkpoint_utils.construct_restore_args``).
        With ``item``, the structure (and the shapes and dtypes an ``ArrayRestoreArgs`` leaves
        open) come from ``item``, types, dtypes and shardings from ``restore_args``; alone, it
        is the target.
      partial_restore: as in ``PyTreeRestore``: restore only the target's keys (stored keys
        it lacks are not read); a target key the checkpoint lacks comes back as given.
        False: any key in one but not the other raises, naming them all.
      fallback_sharding: as in ``StandardRestore``: where an array goes whose saved sharding
        this job cannot reproduce (its devices are not all here) when the target gives none;
        None: that is an error naming the tensor.
      include, exclude: glob patterns (a string or a sequence) over dotted names, as in
        ``osf.load_file``: only the selected tensors are read. Without ``item`` the selected
        subtrees come back in their saved containers; with one, the patterns select among its
        leaves, and an unselected leaf comes back as given (as Orbax's ``PLACEHOLDER``).

    The standalone ``load_file`` / ``load_model`` keep the safetensors and PyTorch meaning of
    ``strict`` (keys). Prints as a summary, never the arrays.
    """

    item: Any = None
    strict: bool = True
    restore_args: Any = None
    partial_restore: bool = False
    fallback_sharding: Any = None
    include: str | Sequence[str] | None = None
    exclude: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        _select.Selection.of(self.include, self.exclude)  # a bad pattern fails here
        if isinstance(self.item, TreeMetadata) or _is_orbax_tree_metadata(self.item):
            self.item = self.item.tree
        if isinstance(self.restore_args, TreeMetadata) or _is_orbax_tree_metadata(
            self.restore_args
        ):
            self.restore_args = self.restore_args.tree

    def __repr__(self) -> str:
        parts = [f"item={_args.tree_summary(self.item)}", f"strict={self.strict}"]
        if self.restore_args is not None:
            parts.append(f"restore_args={_args.tree_summary(self.restore_args)}")
        if self.partial_restore:
            parts.append("partial_restore=True")
        if self.fallback_sharding is not None:
            parts.append(f"fallback_sharding={self.fallback_sharding}")
        if self.include is not None:
            parts.append(f"include={self.include!r}")
        if self.exclude is not None:
            parts.append(f"exclude={self.exclude!r}")
        return f"SafetensorsRestore({', '.join(parts)})"

    def __str__(self) -> str:
        return _with_registry_hint(repr(self))


def _with_registry_hint(summary: str) -> str:
    # Orbax's only error for an item already tied to another handler is
    # 'Item "default" and args "{args}" does not match with any registered handler!': it
    # formats the args with str(), so the fix travels there (repr() stays the bare summary).
    return f"{summary} [{_REGISTRY_HINT}]"


def _is_orbax_tree_metadata(x: object) -> bool:
    # Orbax's own TreeMetadata (a runtime-checkable protocol of its private metadata module),
    # recognised by its members.
    return (
        x is not None
        and hasattr(x, "tree")
        and hasattr(x, "custom_metadata")
        and hasattr(type(x), "tree_flatten_with_keys")
    )
