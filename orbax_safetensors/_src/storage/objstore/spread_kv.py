"""The ``jax.distributed`` key-value steps of one spread save (:mod:`.spread`): every key of a
save lives under one prefix of its own (``osf/<directory>/<n>``, ``n`` counting the saves of that
directory in this job), is set once, and is deleted by the primary once every process is done.

A process that fails sets ``failed``; a process waiting for another's step sees it within
:data:`POLL_SECONDS` and raises instead of waiting :data:`WAIT_SECONDS` (where the jaxlib client
has ``key_value_try_get``; otherwise only the timeout ends the wait). Every process sets
``done/<p>`` last, failed or not; the primary waits for all of them (:meth:`SaveKeys.wait_done`)
before it commits or cleans up, so no process still writes when it decides.

Example::

    keys = SaveKeys("osf/gs://b/ckpt/1/default/1", "gs://b/ckpt/1/default")
    keys.set("own/0")
    keys.wait("own/1", "process 1 to upload its own bytes")
    keys.delete()          # the primary, once every process set done/<p>
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.storage.objstore import calls as _calls

WAIT_SECONDS = 600.0  # longest wait for another process's step
POLL_SECONDS = 2.0  # how often a wait checks whether another process failed
FAILED = "failed"  # the key a failing process sets: "process <p>: <error>"


class SaveKeys:
    """The steps of one save in the key-value store (see the module docstring)."""

    def __init__(self, prefix: str, directory: str) -> None:
        self.client: Any = _jaxcompat.distributed_kv()
        self.prefix = prefix
        self.directory = directory
        self.seen: set[str] = set()

    def set(self, key: str, value: str = "1") -> None:
        """Sets ``key`` (once per save)."""
        self.client.key_value_set(f"{self.prefix}/{key}", value)

    def get(self, key: str, what: str, *, watch_failed: bool = True) -> str:
        """The value of ``key`` once a process set it. Raises an ObjectStoreError naming
        ``what`` after :data:`WAIT_SECONDS`, or as soon as another process reported its failure
        (``watch_failed``)."""
        full = f"{self.prefix}/{key}"
        deadline = time.monotonic() + WAIT_SECONDS
        poll = watch_failed and _jaxcompat.can_try_get(self.client)
        while True:
            left = deadline - time.monotonic()
            step = min(left, POLL_SECONDS) if poll else left
            try:
                value = self.client.blocking_key_value_get(full, max(1, int(step * 1000)))
                break
            except Exception as error:
                if poll:
                    failed = self.failure()
                    if failed is not None:
                        raise _calls.ObjectStoreError(
                            self.directory,
                            f"waiting for {what}",
                            1,
                            RuntimeError(f"the save failed on {failed}"),
                        ) from None
                if time.monotonic() >= deadline:
                    raise _calls.ObjectStoreError(
                        self.directory, f"waiting {WAIT_SECONDS:.0f} s for {what}", 1, error
                    ) from error
        self.seen.add(key)
        return str(value)

    def wait(self, key: str, what: str) -> None:
        """Returns once ``key`` is set (see :meth:`get`)."""
        if key not in self.seen:
            self.get(key, what)

    def try_get(self, key: str) -> str | None:
        """The value of ``key`` if a process set it, else None (without waiting; None too
        where the jaxlib client has no ``key_value_try_get``)."""
        return _jaxcompat.distributed_kv_try_get(self.client, f"{self.prefix}/{key}")

    def failure(self) -> str | None:
        """What the first failing process reported, or None."""
        return _jaxcompat.distributed_kv_try_get(self.client, f"{self.prefix}/{FAILED}")

    def fail(self, process: int, error: BaseException) -> None:
        """Reports this process's failure to the others (the first report stays)."""
        with contextlib.suppress(Exception):  # set already by another process
            self.set(FAILED, f"process {process}: {_calls.describe_error(error)}")

    def wait_done(self, count: int, me: int) -> list[int]:
        """The primary, after its own ``done``: waits until every process set ``done/<p>``
        (at most :data:`WAIT_SECONDS` each); returns the processes that failed or never
        answered."""
        failed = []
        for p in range(count):
            if p == me:
                continue
            try:
                if self.get(f"done/{p}", f"process {p} to finish", watch_failed=False) != "ok":
                    failed.append(p)
            except _calls.ObjectStoreError:
                failed.append(p)
        return failed

    def delete(self) -> None:
        """Removes every key of this save (the primary, once every process is done; no process
        reads them any more). Without ``key_value_delete`` in this jaxlib they stay."""
        with contextlib.suppress(Exception):  # best effort: the save's outcome matters more
            _jaxcompat.distributed_kv_delete(self.client, self.prefix)
