"""The Orbax plugin: ``SafetensorsCheckpointHandler`` and its args, ``SafetensorsSave`` and
``SafetensorsRestore``, registered with it as Orbax's ``StandardSave`` / ``StandardRestore``
are with theirs. Each save is one ``SaveJob`` (copies, then writes in a commit future; the
primary's ``finalize`` merges every process's checksums); the handler keeps no state of a save.

Importing this module registers the handler with Orbax (the package root imports it once Orbax
is imported), so it reads no sibling module's names until called: it may be imported while one
is still half imported.

Example::

    mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    mngr.save(step, args=osf.SafetensorsSave(state))
    state = mngr.restore(mngr.latest_step(), args=osf.SafetensorsRestore(abstract_state))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.orbax import args as _args
from orbax_safetensors._src.orbax import claims as _claims
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export as _export_engine
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import restore_plan as _restore_plan
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.pipeline.read import ReadStats
from orbax_safetensors._src.pipeline.restore_options import Words, reworded
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config

# How long a save() whose host copies failed waits for Orbax to create the step directory (its
# writer future waits for that before it can end) before it raises.
_ABORT_WAIT_SECONDS = 60.0


def _flattened(item: Any) -> tuple[list[Any], Any] | None:
    # jax's leaves and treedef of ``item``; None for a tree jax cannot flatten (dict keys of
    # mixed types, which it cannot sort), whose args are then built again at each save.
    try:
        return jax.tree_util.tree_flatten(item)  # type: ignore[no-any-return]
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(repr=False)
class SafetensorsSave(ocp.args.CheckpointArgs):
    """Save ``item`` (any pytree) as safetensors; Orbax's ``StandardSave`` arguments.

    Attributes:
      item: the pytree to save.
      save_args: as in ``StandardSave``: a tree like ``item`` of ``ocp.SaveArgs`` (or None);
        ``SaveArgs(dtype=...)`` casts the leaf first, the zarr options raise.
      custom_metadata: a JSON-serialisable dict stored with the tensors, returned by
        ``mngr.item_metadata(step).custom_metadata``. ``metadata``: its earlier name.
      dtype: a save-time dtype policy, as in ``osf.save_file``: one dtype for every
        floating-point array, ``{glob pattern: dtype | None | "keep"}`` over dotted names, or
        ``(dotted_name, leaf) -> dtype | None | "keep"``. Each tensor is cast as it is
        written or copied, never as a cast copy of the whole state.
      io_options: how this save writes (``osf.IOOptions``); None: the handler's.
      mapping: an ``osf.KeyMapping``: the item is written as a Hugging Face model directory
        (the mapping's PyTorch names and layouts, shards plus an index above the handler's
        ``max_file_size``) that ``from_pretrained`` loads; every process writes only its own
        bytes, with no gather of the model (object storage is refused). Every name that does
        not fit raises here, all at once. ``SafetensorsRestore(target, mapping=...)`` reads
        it back.
      hf_config, generation_config: with ``mapping``: a transformers config (object, dict or
        path; a model directory also gives its generation config and tokenizer files) and a
        generation config, written as ``osf.export_pytorch`` writes them.
      snapshot: True (default): this process's shards are copied to host before ``save()``
        returns, so the caller may donate or change its arrays at once. False: each tensor
        is written straight from its array, with no host copy of the state, for a save that
        waits for its writes (``enable_async_checkpointing=False``): Orbax does not tell a
        handler which kind of save calls it. Under an async save the arrays must then stay
        unchanged until ``wait_until_finished()``.

    Everything is validated here, before Orbax creates the step (and again by the save when
    ``item`` changed since: the save writes the tree as it is then). Prints as a summary
    (``SafetensorsSave(item=<dict: 12 leaves, 3.4 MiB>)``), never the arrays.

    Example::

        mngr.save(step, args=osf.SafetensorsSave(state, custom_metadata={"epoch": 3}))
        sync_mngr.save(step, args=osf.SafetensorsSave(state, snapshot=False))
    """

    item: Any
    save_args: Any = None
    custom_metadata: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] | None = None
    dtype: Any = None
    io_options: _config.IOOptions | None = None
    mapping: Any = None
    hf_config: Any = None
    generation_config: Any = None
    snapshot: bool = True
    _validated: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _export: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _leaves: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Orbax's StandardSave refuses both, so a step that holds nothing is never committed
        # (it would count towards max_to_keep and push a real step out).
        if self.item is None:
            raise ValueError("SafetensorsSave: must provide an item to save (got None)")
        self._leaves = _flattened(self.item)
        if self._leaves is not None and not self._leaves[0] and not self.item:
            raise ValueError(f"SafetensorsSave: found an empty item ({self.item!r})")
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
        mapping = _args.hf_mapping(
            "SafetensorsSave",
            self.mapping,
            hf_config=self.hf_config,
            generation_config=self.generation_config,
        )
        if mapping is None:
            self._validated = _checkpoint_save.validate_save(
                item, self.custom_metadata, dtype=self.dtype
            )
            return
        # The policy names the item's tensors; the export plan applies it to their outputs.
        self._validated = _checkpoint_save.validate_save(item, self.custom_metadata)
        self._export = mapping.export_plan(
            self._validated,
            self.dtype,
            self.hf_config,
            generation_config=self.generation_config,
        )

    @property
    def validated_tree(self) -> _checkpoint_save.ValidatedTree:
        """The tree as validated when these args were built (what the save writes)."""
        return self._validated  # type: ignore[no-any-return]

    def as_at_save(self) -> SafetensorsSave:
        """These args, or the same args built again when ``item`` has changed since they
        were built (a leaf replaced, a key added, an ``nnx`` Variable given a new value):
        Orbax saves the tree as it is when ``save()`` runs, so args built once and reused
        save each step's values. An array changed in place needs no rebuild: the save reads
        it then."""
        now = _flattened(self.item)
        if now is not None and self._leaves is not None:
            (leaves, treedef), (old_leaves, old_treedef) = now, self._leaves
            # The old leaves are held here, so no new object can share an old one's id.
            if treedef == old_treedef and all(a is b for a, b in zip(leaves, old_leaves)):
                return self
        return dataclasses.replace(self)

    @property
    def export_plan(self) -> _export_engine.ExportPlan | None:
        """With ``mapping``: the tensors the save writes instead of the item's."""
        return self._export  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        policy = _casting.parse_policy(self.dtype)
        custom = self.custom_metadata
        return _args.args_repr(
            "SafetensorsSave",
            [
                ("item", _args.tree_summary(self.item)),
                (
                    "save_args",
                    None if self.save_args is None else _args.tree_summary(self.save_args),
                ),
                ("custom_metadata", None if custom is None else _args.tree_summary(dict(custom))),
                ("dtype", None if policy is None else policy.describe().removeprefix("dtype=")),
                ("io_options", None if self.io_options is None else repr(self.io_options)),
                ("mapping", None if self._export is None else f"<{self._export.summary}>"),
                ("snapshot", None if self.snapshot else "False"),
            ],
        )

    def __str__(self) -> str:
        return _args.with_registry_hint(repr(self))


@dataclasses.dataclass(repr=False)
class SafetensorsRestore(ocp.args.CheckpointArgs):
    """Restore a safetensors checkpoint; Orbax's ``StandardRestore`` and ``PyTreeRestore``
    arguments, with their meanings.

    Attributes:
      item: None (the saved tree) or a target pytree of arrays, numpy arrays,
        ``jax.ShapeDtypeStruct`` (with an optional sharding), Python scalars or
        ``ocp.ArrayRestoreArgs``; the result has its node types. A ``TreeMetadata`` (from
        ``mngr.item_metadata``) works too.
      strict: as in ``StandardRestore``: a stored shape that differs from the target's raises
        (False: truncated or zero-padded to it, same rank).
      restore_args: as in ``PyTreeRestore``: a tree of ``ocp.RestoreArgs``; with ``item``,
        the structure (and the shapes and dtypes it leaves open) comes from ``item``.
      partial_restore: as in ``PyTreeRestore``: restore only the target's keys; a target key
        the checkpoint lacks comes back as given. False: any key in one but not the other
        raises, naming them all.
      fallback_sharding: as in ``StandardRestore``: where an array goes whose saved sharding
        this job cannot reproduce, when the target gives none (None: an error).
      include, exclude: glob patterns over dotted names, as in ``osf.load_file``: only the
        selected tensors are read; an unselected target leaf comes back as given.
      io_options: how this restore reads (``osf.IOOptions``); None: the handler's.
      mapping: an ``osf.KeyMapping``: the item holds the mapping's PyTorch tensors (a
        ``SafetensorsSave(item, mapping=...)`` item, or any Hugging Face directory), read back
        into ``item``'s layout, each process reading its own shards' bytes.
        ``partial_restore=True``: target leaves nothing maps to come back as given.

    ``osf.load_file`` keeps the safetensors meaning of ``strict`` (keys). Prints as a
    summary, never the arrays.

    Example::

        state = mngr.restore(step, args=osf.SafetensorsRestore(abstract, partial_restore=True))
    """

    item: Any = None
    strict: bool = True
    restore_args: Any = None
    partial_restore: bool = False
    fallback_sharding: Any = None
    include: str | Sequence[str] | None = None
    exclude: str | Sequence[str] | None = None
    io_options: _config.IOOptions | None = None
    mapping: Any = None

    def __post_init__(self) -> None:
        _select.Selection.of(self.include, self.exclude)  # a bad pattern fails here
        if self.mapping is not None:
            _export_engine.check_mapping(self.mapping)  # an unknown mapping type fails here
            unused = [
                n
                for n, v in (
                    ("restore_args", self.restore_args),
                    ("include", self.include),
                    ("exclude", self.exclude),
                    ("fallback_sharding", self.fallback_sharding),
                )
                if v is not None
            ]
            if self.item is None or unused:
                raise ValueError(
                    "SafetensorsRestore(mapping=...) restores into a target: give item= "
                    "(the JAX tree or its abstract tree)"
                    + (f"; {', '.join(unused)} do(es) not apply" if unused else "")
                )
        self.item = _args.tree_of_metadata(self.item)
        self.restore_args = _args.tree_of_metadata(self.restore_args)

    def __repr__(self) -> str:
        def shown(value: Any, text: Any = repr) -> str | None:
            return None if value is None else text(value)

        return _args.args_repr(
            "SafetensorsRestore",
            [
                ("item", _args.tree_summary(self.item)),
                ("strict", str(self.strict)),
                ("restore_args", shown(self.restore_args, _args.tree_summary)),
                ("partial_restore", "True" if self.partial_restore else None),
                ("fallback_sharding", shown(self.fallback_sharding, str)),
                ("include", shown(self.include)),
                ("exclude", shown(self.exclude)),
                ("io_options", shown(self.io_options)),
                ("mapping", shown(self.mapping, lambda m: f"<{type(m).__name__}>")),
            ],
        )

    def __str__(self) -> str:
        return _args.with_registry_hint(repr(self))


# --------------------------------------------------------------------------- running a job


@_pieces.gc_paused()  # (the caller's thread only: what outlives save() is never paused)
def start_save(
    job: _save_job.SaveJob, *, on_failure: Callable[[], None] | None = None
) -> list[ocp_future.Future]:
    """Starts ``job`` under Orbax (the v0 and v1 handlers); returns its commit future.

    On the caller's thread: refuses a renaming commit on S3, plans if the job must, starts the
    writer as an Orbax commit future (it waits for the step directory), then makes the host
    copies, which the writer writes as they come. If a copy fails, the job is aborted and the
    future waited for before the error propagates: nothing of the step is left writing.
    ``on_failure`` runs if the background write fails.
    """
    _steps.refuse_renaming_commit(job.directory)  # S3: a save Orbax would rename
    job.start()

    async def write() -> None:
        # Runs once the contracted signals arrive (the step directory exists); the blocking
        # file I/O runs on a worker thread so the event loop stays responsive.
        try:
            await asyncio.to_thread(job.write)
        except BaseException:
            if on_failure is not None:
                on_failure()
            raise

    future = ocp_future.CommitFutureAwaitingContractedSignals(write(), name="safetensors_save")
    try:
        job.snapshot()
    except BaseException:
        # The job is aborted (its writer writes nothing more); wait for the future's thread,
        # which ends once Orbax's step directory exists, so that none outlives this save().
        with contextlib.suppress(Exception):
            future.result(timeout=_ABORT_WAIT_SECONDS)
        raise
    return [future]


# --------------------------------------------------------------------------- the handler


class SafetensorsCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Stores a pytree as standard safetensors files plus ``orbax_safetensors.json``.

    Args:
      max_file_size: split the tensors into files of at most this many bytes of data (a
        tensor never spans files). ``None``: one file. Default about 5 GB, as on the Hub.
      checksums: compute a CRC32C of every tensor while saving.
      verify: on restore, check every tensor read whole against its CRC32C.
      primary_host: the process that writes headers, index and metadata and finalizes
        (Orbax's convention; default 0).
      reuse_host_buffers: an async save copies into host buffers kept from the previous save
        (no allocation per save); they hold this process's share of the last save's large
        tensors until ``close()``. False: fresh buffers each save, freed once written.
      device_snapshot: on an accelerator, an async save copies this process's shards on
        their devices when they have room, and returns: the device-to-host copies run beside
        training. False, or without the room: the host copies are made before ``save()``
        returns.
      io_options: how files are written and read (``osf.IOOptions``); None: the defaults.

    ``last_write_stats`` (a ``WriteStats``) holds the byte ranges this process's last save
    wrote, ``last_read_stats`` (a ``ReadStats``) what its last restore read. Orbax's own
    ``StandardSave`` / ``PyTreeSave`` args go to Orbax's handlers (:func:`handler_registry`).

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
        self._routing = _args.OrbaxRouter()
        self._host_buffers = _buffers.HostBufferPool() if reuse_host_buffers else None

    @property
    def primary_host(self) -> int:
        """The process that writes headers, index and metadata and finalizes."""
        return self._primary_host

    def new_job(
        self, directory: epath.Path, args: SafetensorsSave, mode: _save_job.SaveMode
    ) -> _save_job.SaveJob:
        """A ``SaveJob`` of ``args`` into ``directory`` with this handler's options (on the
        caller's thread: raises if ``primary_host`` is not a process of this job)."""
        args = args.as_at_save()
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
        """Starts the save (host copies made before it returns, unless ``snapshot=False``);
        the returned coroutine gives its commit future. A plain method, not ``async def``: the
        copies must happen in the caller's call."""
        if _args.orbax_handler_type(args) is not None:  # Orbax's own args, in a mixed root
            self._pending.pop(directory)
            return self._routing.async_save(directory, args)
        mode = _save_job.SaveMode.SNAPSHOT if args.snapshot else _save_job.SaveMode.DIRECT
        job = self._job(directory, args, mode)
        try:
            futures = start_save(job, on_failure=lambda: self._pending.discard(job))
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

    @_pieces.gc_paused()
    def save(self, directory: epath.Path, args: SafetensorsSave | Any) -> None:
        """Synchronous save (``ocp.Checkpointer``): writes straight from the arrays."""
        if _args.orbax_handler_type(args) is not None:  # Orbax's own args, in a mixed root
            self._pending.pop(directory)
            self._routing.save(directory, args)
            return
        job = self._job(directory, args, _save_job.SaveMode.DIRECT)
        try:
            _steps.refuse_renaming_commit(job.directory)
            job.start()
            job.write()
        except BaseException:
            self._pending.discard(job)
            raise

    def finalize(self, directory: epath.Path) -> None:
        """Merges every process's checksums into the metadata file (primary, after all wrote)."""
        if self._routing.finalize(directory):  # an item Orbax's handler saved (Orbax's args)
            return
        job = self._pending.pop(directory)
        if job is None:  # not saved through this handler: the draft and shares are on disk
            _checkpoint_save.finalize(directory, io=self._io)
        else:
            job.finalize()

    def restore(self, directory: epath.Path, args: SafetensorsRestore | Any = None) -> Any:
        """Restores the tree; see :class:`SafetensorsRestore` for the target forms. An
        Orbax-native item (``StandardSave`` / ``PyTreeSave`` in the same root) is restored
        through Orbax's own handler, with the same arguments, once its files back the shapes
        it claims (else a ``SafetensorsCheckpointError`` names the array)."""
        native = _steps.item_kind(epath.Path(directory)) is _steps.PathKind.ORBAX
        if native:  # (Orbax reads the names its _METADATA records: kept inside the item)
            _steps.check_orbax_item(directory)
            _claims.admit_restore(directory)  # (Orbax allocates whatever the metadata claims)
        orbax_handler = _args.orbax_handler_type(args)
        if orbax_handler is not None:  # Orbax's StandardRestore / PyTreeRestore, in a mixed root
            if native:
                return self._routing.handler(orbax_handler).restore(directory, args=args)
            args = SafetensorsRestore(**_args.from_orbax_restore(args))
        args = args or SafetensorsRestore()
        if native:
            return _args.restore_orbax_native(directory, args, self._routing)
        return self.restore_safetensors(directory, args)

    def restore_safetensors(
        self, directory: epath.Path, args: SafetensorsRestore, *, words: Words | None = None
    ) -> Any:
        """Restores a safetensors item; a mismatch error names the options in ``words``
        (default: ``SafetensorsRestore``'s)."""
        stats = ReadStats()
        io = args.io_options if args.io_options is not None else self._io
        if args.mapping is not None:  # a Hugging Face directory, read into the JAX layout
            result = _export_engine.check_mapping(args.mapping).restore(
                epath.Path(directory),
                args.item,
                strict=not args.partial_restore,
                verify=self._verify,
                io=io,
                stats=stats,
            )
        else:
            try:
                options = _args.restore_options(args, verify=self._verify, io=io)
                result = _standalone.restore_checkpoint(directory, options, stats=stats)
            except TargetMismatchError as e:
                ours = _args.V0_WORDS if args.strict else _args.V0_WORDS_STRICT_FALSE
                raise reworded(e, words or ours) from None
        self.last_read_stats = stats
        return result

    def metadata(self, directory: epath.Path) -> _args.TreeMetadata | Any:
        """The saved tree and its ``custom_metadata`` as a ``TreeMetadata`` like Orbax's
        (``jax.ShapeDtypeStruct`` leaves); reads no tensor bytes."""
        if _steps.item_kind(epath.Path(directory)) is _steps.PathKind.ORBAX:
            _steps.check_orbax_item(directory)
            return self._routing.handler(ocp.PyTreeCheckpointHandler).metadata(directory)
        metadata = _read.read_metadata(directory)
        return _args.TreeMetadata.build(
            _restore_plan.abstract_tree(directory, metadata),
            custom_metadata=metadata.get("metadata"),  # None when none was given, as Orbax
        )

    def close(self) -> None:
        """Closes Orbax's handlers used for Orbax's args and drops the kept host buffers."""
        self._routing.close()
        if self._host_buffers is not None:
            self._host_buffers.clear()

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
    handlers. ``mngr.restore(step)`` without args reads each step in its own format. Without
    it, a ``CheckpointManager`` ties each item to the first handler it meets.

    Example::

        mngr = ocp.CheckpointManager(root, handler_registry=osf.handler_registry())
        state = mngr.restore(mngr.latest_step())  # an Orbax-native step
        mngr.save(step + 1, args=osf.SafetensorsSave(state))
    """
    # Orbax finalizes, restores without args and reads metadata through one handler per item;
    # this one passes Orbax's args to Orbax's handlers.
    handler = handler or SafetensorsCheckpointHandler()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args_type in (SafetensorsSave, SafetensorsRestore, *_args.ORBAX_HANDLERS):
        registry.add(item, args_type, handler)
    return registry


ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_save=True)(SafetensorsSave)
ocp.args.register_with_handler(SafetensorsCheckpointHandler, for_restore=True)(SafetensorsRestore)
