"""One save as one object: validate -> snapshot -> plan -> write -> finalize.

A :class:`SaveJob` holds all one save of a checkpoint directory needs, from the caller's call to
the primary's finalize; drivers (the Orbax handlers, ``standalone.save_directory``) keep no state
per save, only build jobs and call their steps where their protocol puts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import time
from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export_item as _export_item
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import snapshots as _snapshots
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import router as _router

# How long an async save's writer waits, once every host copy is made, before it plans the
# files: time for the caller's thread to finish the driver's save() without this thread's
# Python work competing for the GIL.
_PLAN_DELAY_SECONDS = 0.03


class SaveMode(enum.Enum):
    """How a save treats the caller's arrays."""

    DIRECT = "direct"  # the caller waits for the write: each tensor written from its array
    SNAPSHOT = "snapshot"  # the caller goes on once snapshot() made this process's host copies


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes of a save: this one (``index``), how many (``count``), which finalizes."""

    index: int = 0
    count: int = 1
    primary: int = 0

    @classmethod
    def of_jax(cls, primary: int = 0) -> Processes:
        """This JAX job's processes; a ``ValueError`` if ``primary`` is not one of them."""
        count = jax.process_count()
        if not 0 <= primary < count:
            # Checked on the caller's thread: otherwise no process writes the headers and the
            # step fails later, in the driver's background commit, with a FileNotFoundError.
            raise ValueError(
                f"primary_host={primary} is not a process of this job "
                f"(jax.process_count() is {count}); pass a process index in [0, {count})"
            )
        return cls(jax.process_index(), count, primary)

    @property
    def is_primary(self) -> bool:
        """Whether this process writes headers, index and metadata and finalizes."""
        return self.index == self.primary


class _State(enum.Enum):
    NEW = "new"  # not written yet
    WRITING = "writing"
    ABORTING = "aborting"  # aborted while its writer runs: the writer removes what it wrote
    ABORTED = "aborted"
    WRITTEN = "written"
    FAILED = "failed"
    FINALIZED = "finalized"


class SaveJob:
    """One save of ``validated`` (from ``validate_save``) into ``directory`` (which must exist
    when :meth:`write` runs) by this process.

    ``host_buffers``: the pool a ``SNAPSHOT``'s large copies draw from and go back to once
    written (None: fresh buffers). ``export``: write this plan's tensors instead of the tree's
    (``export_item.prepare``). ``device_snapshot``: on an accelerator, :meth:`snapshot` may copy
    on the devices and leave the host copies to a thread (``snapshots.device_copies``). After
    :meth:`write`, ``stats`` holds the byte ranges this process wrote.
    """

    def __init__(
        self,
        validated: _checkpoint_save.ValidatedTree,
        directory: epath.PathLike,
        *,
        mode: SaveMode,
        layout: _checkpoint_save.SaveLayout | None = None,
        processes: Processes | None = None,
        host_buffers: _buffers.HostBufferPool | None = None,
        io: _config.IOOptions | None = None,
        export: _export_item.ExportPlan | None = None,
        device_snapshot: bool = True,
    ) -> None:
        self.directory = epath.Path(directory)
        self.device_snapshot = device_snapshot
        self.io = io
        self.export = export
        self.mode = mode
        self.layout = layout if layout is not None else _checkpoint_save.SaveLayout()
        self.processes = processes = processes if processes is not None else Processes()
        self.stats = _pieces.WriteStats()
        # Several processes: the draft and the checksum shares go to disk for the primary's
        # finalize; one process: the finalize is this one's and takes them from memory.
        self._persist = processes.count > 1
        self._validated: _checkpoint_save.ValidatedTree | None = validated
        snapshot = mode is SaveMode.SNAPSHOT
        self._queue = _snapshots.SnapshotQueue() if snapshot else None
        self._pool = host_buffers if snapshot else None
        self._arena = self._pool.arena() if self._pool is not None else None
        self._prepared: _checkpoint_save.PreparedSave | None = None
        self._draft: dict[str, Any] | None = None  # the metadata file less checksums (primary)
        self._share: dict[str, Any] | None = None  # this process's checksum share, unpersisted
        self._lock = threading.Lock()
        self._state = _State.NEW
        self._idle = threading.Event()  # set once no writer runs for this job any more
        self._copier: threading.Thread | None = None  # a device snapshot's host copies

    def __repr__(self) -> str:
        return f"SaveJob({str(self.directory)!r}, {self.mode.name}, {self._state.value})"

    # -- the caller's thread ------------------------------------------------------------------

    def start(self) -> None:
        """On the caller's thread: plans now when the plan must come first (a direct save;
        object storage, whose uploads start on every process before any write; a header that
        may exceed the cap fails here, not in the background), else leaves it to the writer."""
        validated = self._require_validated()
        if (
            self.mode is SaveMode.DIRECT
            or _router.is_object_url(self.directory)
            or validated.header_bound() > _header.MAX_HEADER_BYTES
        ):
            prepared = self._prepared = self._plan(validated)
            files = [(f.filename, f.size) for f in prepared.plan.files]
            _router.prepare_directory(
                self.directory, files, is_primary=prepared.is_primary, io=self.io
            )

    def snapshot(self) -> None:
        """``SNAPSHOT``: copies this process's owned shards to host (no-op for ``DIRECT``); the
        caller may then donate its arrays. Raises (after :meth:`abort`) what the copy raised,
        or a ``DeletedArrayError`` naming an array donated since the tree was validated."""
        if self._queue is None:
            return
        validated = self._require_validated()
        try:
            snaps: Any
            if self.export is not None and self.processes.count > 1:  # (device steps first)
                snaps = _export_item.snapshot_items(
                    validated, self.export, self.processes.is_primary, self._arena
                )
            elif (later := self._device_snapshot(validated)) is not None:
                snaps, rest = later
                for item in snaps:  # host leaves (the caller may change them): copied now
                    self._queue.put(item)
                self._copier = threading.Thread(
                    target=self._copy_later, args=(rest,), name="osf-host-copies", daemon=True
                )
                self._copier.start()
                return  # the copier closes the queue
            else:
                snaps = _snapshots.iter_snapshots(
                    enumerate(validated.captured.arrays),
                    is_primary=self.processes.is_primary,
                    casts=validated.casts,  # a dtype policy: copy the cast bytes
                    buffers=self._arena,
                    row_blocks=_router.is_object_url(self.directory),  # contiguous uploads
                )
            for item in snaps:
                self._queue.put(item)  # device-to-host copies, on the caller's thread
        except BaseException as e:
            self.abort(e)
            captured = validated.captured  # arrays donated since the tree was validated?
            _checkpoint_save.check_not_deleted(zip(captured.names, captured.arrays))
            raise
        self._queue.close()

    def _device_snapshot(self, validated: _checkpoint_save.ValidatedTree) -> Any:
        # (host copies to make now, device copies whose host copies a thread makes), or None:
        # see snapshots.device_copies. Not where a save moves row blocks between processes
        # (collectives belong on the caller's thread) or an export runs its own snapshot.
        own_snapshot = self.export is not None or _router.is_object_url(self.directory)
        if not self.device_snapshot or (self.processes.count > 1 and own_snapshot):
            return None
        owned = _snapshots.owned_tensors(
            enumerate(validated.captured.arrays), self.processes.is_primary
        )
        split = _snapshots.device_copies(owned)
        if split is None:
            return None
        now, later = split
        assert self._arena is not None or self._pool is None
        arena = self._arena if self._arena is not None else _buffers.BufferArena()
        casts = validated.casts
        return _snapshots.iter_owned(now, casts=casts, buffers=arena), (later, casts, arena)

    def _copy_later(self, rest: Any) -> None:
        # The copier thread of a device snapshot: host copies of the device copies (each
        # device copy freed once copied), handed to the writer; the end or a failure closes
        # the queue. Stops early if the save was aborted or failed meanwhile.
        later, casts, arena = rest
        assert self._queue is not None
        copies = _snapshots.iter_owned(later, casts=casts, buffers=arena, delete=True)
        try:
            for item in copies:
                if self._state in (_State.ABORTING, _State.ABORTED, _State.FAILED):
                    break
                self._queue.put(item)
        except BaseException as e:
            self._queue.fail(e)
            return
        finally:
            _snapshots.delete_device_copies(later)  # (those not yet copied, on an early end)
        self._queue.close()

    def abort(self, error: BaseException) -> None:
        """Ends the save: its writer writes nothing more and removes what it wrote (a writer
        not yet started returns at once). Returns once no thread writes for this job."""
        with self._lock:
            state = self._state
            if state is _State.NEW:
                self._state = _State.ABORTED
            elif state is _State.WRITING:
                self._state = _State.ABORTING
        if self._queue is not None:
            self._queue.fail(error)
        if state is _State.WRITING:
            self._idle.wait()
        elif state is _State.NEW:
            self._release()
            _router.abandon_files(self.directory, error, io=self.io)  # (its writer never runs)

    # -- the writer's thread ------------------------------------------------------------------

    def write(self) -> None:
        """Writes this process's bytes (the primary: headers, index, the draft too). Returns at
        once if the job was aborted before; if aborted meanwhile, removes what it wrote and ends
        without error (whoever aborted it reports the error)."""
        with self._lock:
            if self._state is _State.ABORTED:
                return
            if self._state is not _State.NEW:
                raise RuntimeError(f"{self!r}: written twice")
            self._state = _State.WRITING
        try:
            if self.mode is SaveMode.DIRECT:
                # The caller waits for this write: the cyclic GC may pause for it. An async
                # save's write outlives save(): it never pauses the GC.
                with _pieces.gc_paused():
                    share = self._write()
            else:
                share = self._write()
        except BaseException as error:
            # Object storage, several processes: the others stop waiting for this one, and
            # nothing the save uploaded stays (router.abandon_files never raises).
            _router.abandon_files(self.directory, error, io=self.io)
            if self._end(_State.FAILED) is _State.ABORTED:
                return  # whoever aborted the job reports its error
            raise
        self._share = None if self._persist else share
        self._end(_State.WRITTEN)

    def _write(self) -> dict[str, Any]:
        prepared = self._prepared
        if prepared is None:
            # Planned here, on the writer thread, once the first host copies (or all of a
            # small state's) are in: the planning is Python work per tensor, which the
            # caller need not wait for.
            assert self._queue is not None
            self._queue.wait_started()
            if self._state is _State.ABORTING:
                raise RuntimeError(f"{self.directory}: the save was aborted")
            if self._queue.complete():
                # All copied: give the caller's thread time to leave save() before this
                # thread takes the GIL for planning. A fixed courtesy: nothing here may look
                # at the caller's thread (reading another thread's frames can crash CPython).
                time.sleep(_PLAN_DELAY_SECONDS)
            prepared = self._prepared = self._plan(self._require_validated())
        if prepared.is_primary:
            self._draft = prepared.metadata
        return _checkpoint_save.write_process_share(
            prepared, self.directory, self.stats, persist_share=self._persist, io=self.io
        )

    def _end(self, state: _State) -> _State:
        with self._lock:
            aborted = self._state is _State.ABORTING
            state = self._state = _State.ABORTED if aborted else state
        try:
            if aborted:
                self._remove_written()
        finally:
            self._release()
            self._idle.set()
        return state

    def _release(self) -> None:
        # The caller's arrays and the host copies are no longer needed: the job keeps only
        # what finalize merges (it may wait in a driver's registry until then).
        copier = self._copier
        if copier is not None and copier is not threading.current_thread():
            copier.join()  # (it stops after its current tensor once the job ended)
        self._validated = None
        self._prepared = None
        pool, arena, self._arena = self._pool, self._arena, None
        if pool is not None and arena is not None:
            pool.release(arena)  # written (or failed): the next save reuses them

    def _remove_written(self) -> None:
        # An aborted save's files: nothing of it may stay for a reader or a retry to meet.
        prepared = self._prepared
        names = [f.filename for f in prepared.plan.files] if prepared is not None else []
        names += list(self.export.files) if self.export is not None else []
        names += [
            _plan.INDEX_FILE_NAME,
            _metadata.DRAFT_FILE,
            f"{_metadata.SHARE_FILE_PREFIX}{self.processes.index}.json",
        ]
        for name in names:
            with contextlib.suppress(OSError):
                (self.directory / name).unlink(missing_ok=True)
        self._draft = None

    # -- one process, after every process wrote -----------------------------------------------

    def finalize(self) -> None:
        """Merges every process's checksum share into the metadata file (one process, after
        all wrote)."""
        with self._lock:
            if self._state is not _State.WRITTEN:
                raise RuntimeError(f"{self!r}: finalize needs a written save")
            self._state = _State.FINALIZED
        draft, share = self._draft, self._share
        self._draft = self._share = None
        shares = [share] if share is not None else []
        _checkpoint_save.finalize(self.directory, draft, shares, io=self.io)

    def _plan(self, validated: _checkpoint_save.ValidatedTree) -> _checkpoint_save.PreparedSave:
        is_primary, index = self.processes.is_primary, self.processes.index
        if self.export is not None:
            return _export_item.prepare(
                validated,
                self.export,
                self._queue,
                self.layout,
                is_primary=is_primary,
                process_index=index,
                multi_process=self.processes.count > 1,
            )
        # (DIRECT: planned in start, on the caller's thread, where row blocks are moved)
        return _checkpoint_save.prepare(
            validated,
            self.layout,
            self._queue,
            is_primary=is_primary,
            process_index=index,
            row_blocks=_router.is_object_url(self.directory),  # joined groups' file order
        )

    def _require_validated(self) -> _checkpoint_save.ValidatedTree:
        validated = self._validated
        if validated is None:
            raise RuntimeError(f"{self!r}: the tree was already written or the save aborted")
        return validated


class PendingSaves:
    """Written save jobs awaiting their finalize, by directory: how a driver that finalizes a
    directory (Orbax's handler protocol) finds its save's job. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, SaveJob] = {}

    def add(self, job: SaveJob) -> None:
        """Registers ``job`` for its directory (replacing an earlier, failed job's)."""
        with self._lock:
            self._jobs[str(job.directory)] = job

    def pop(self, directory: epath.PathLike) -> SaveJob | None:
        """The job registered for ``directory``, removed; None if there is none."""
        with self._lock:
            return self._jobs.pop(str(directory), None)

    def discard(self, job: SaveJob) -> None:
        """Forgets ``job`` (a failed save, never finalized), if it is still registered."""
        with self._lock:
            if self._jobs.get(str(job.directory)) is job:
                del self._jobs[str(job.directory)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
