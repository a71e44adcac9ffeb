"""Running a :class:`~orbax_safetensors._src.pipeline.save_job.SaveJob` where Orbax wants it,
for the v0 handler's ``async_save`` and the v1 handler's ``save`` alike.

On the caller's thread: refuse a renaming commit on S3, plan if the job must plan first, start
the writer as an Orbax commit future (it waits until Orbax has created the step directory),
then make the host copies, so a large state's writes start while its later tensors are still
being copied. If a copy fails, the job is aborted and the future waited for before the error
propagates: a ``save()`` that raised leaves no thread writing and no file of the step behind,
and the same step can be saved again at once.

Example::

    job = SaveJob(validated, directory, mode=SaveMode.SNAPSHOT, processes=Processes.of_jax())
    futures = start(job)      # the host copies are made when this returns
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from orbax.checkpoint import future as ocp_future

from orbax_safetensors._src.orbax import object_storage as _object_storage
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline import save_job as _save_job

# How long a save() whose host copies failed waits for Orbax to create the step directory (its
# writer future waits for that before it can end) before it raises.
_ABORT_WAIT_SECONDS = 60.0


@_gcpause.paused  # (the caller's thread only: what outlives save() is never paused)
def start(
    job: _save_job.SaveJob, *, on_failure: Callable[[], None] | None = None
) -> list[ocp_future.Future]:
    """Starts ``job`` under Orbax (see the module docstring); returns its commit future.

    ``on_failure`` runs if the background write fails (e.g. to forget the job).
    """
    _object_storage.refuse_renaming_commit(job.directory)  # S3: a save Orbax would rename
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


def write_now(job: _save_job.SaveJob) -> None:
    """Runs ``job`` (a ``DIRECT`` one) on the caller's thread: Orbax's synchronous ``save``,
    called once the directory exists."""
    _object_storage.refuse_renaming_commit(job.directory)
    job.start()
    job.write()
