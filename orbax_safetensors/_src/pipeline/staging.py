"""Which reads of a restore go through a staging ring, and the rings kept between restores.

On an accelerator ``jax.device_put`` copies host bytes to the device and is then done with
them, so a restore need not read the whole state into fresh host memory: each large tensor is
read into a :class:`~orbax_safetensors._src.storage.buffers.StagingRing`, its transfer starts,
and the ring's space is read into again once the transfer is done. Host memory stays at the
ring's size whatever the state's, and its pages are faulted in once per process rather than
once per restore (first-touch faults are the slow part of reading into fresh memory on virtual
machines and sandboxes: docs/performance.md, "TPU"). On CPU the placed array *is* the host
buffer (zero-copy), so nothing is staged there.

Example::

    staged = staged_requests(requests)          # None: nothing to stage (e.g. on CPU)
    if staged is not None:
        with ring_for(requests, staged) as ring:
            ...                                 # reader._read_staged
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.storage import buffers as _buffers

# Tensors of at least this many bytes go through the ring; smaller ones are carved from the
# arena's slabs (few allocations, and the ring's page placement would waste more than they hold).
STAGE_MIN_BYTES = 1 << 20
# The ring's size (grown to hold the largest staged tensor), and how many waves of reads share
# it: a wave of at most a quarter of the ring is read while the three before it transfer.
# Waves of 128 MiB, four in flight: smaller waves or fewer of them left the transfers idle
# between waves on a TPU v5e (docs/performance.md, "TPU"); pages are faulted in only as far
# as a restore reaches into the ring.
RING_BYTES = 512 << 20
WAVES_IN_FLIGHT = 4
_PAGE = 4096

#: ``"auto"``: stage the large tensors bound for devices whose placement copies (accelerators);
#: ``"always"``: stage every large ``jax.Array`` read, and copy off the ring those whose
#: placement shared its memory (CPU: slower, for tests of this path on machines without an
#: accelerator); ``"never"``: read every tensor into its own fresh buffer, as on CPU.
MODE = "auto"


def staged(requests: Sequence[Any]) -> list[bool] | None:
    """Per request (``reader.ReadRequest``), whether its whole tensor is read through a staging
    ring: a ``jax.Array`` of at least :data:`STAGE_MIN_BYTES` whose placement copies the host
    bytes (an accelerator's memory, not CPU memory that ``device_put`` shares). None when no
    request is."""
    if MODE == "never":
        return None
    copies = _sharding.ShardingMemo(_copies) if MODE == "auto" else (lambda _: True)
    default = None
    out: list[bool] = []
    for req in requests:
        stage = False
        if req.kind == "jax" and req.stored.nbytes >= STAGE_MIN_BYTES:
            if MODE == "always":
                stage = True
            elif req.sharding is not None:
                stage = copies(req.sharding)
            else:
                if default is None:
                    default = _copies(jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
                stage = default
        out.append(stage)
    return out if any(out) else None


def _copies(sharding: jax.sharding.Sharding) -> bool:
    kind = getattr(sharding, "memory_kind", None)
    return not any(_place.aliases_host(d, kind) for d in sharding.addressable_devices)


def off_the_ring(value: Any) -> Any:
    """``value`` (placed from ring memory) as an array that does not share the ring's memory:
    itself where its placement copied, else a device copy (``MODE = "always"`` on CPU)."""
    if not isinstance(value, jax.Array):
        return value
    kind = getattr(value.sharding, "memory_kind", None)
    if any(_place.aliases_host(d, kind) for d in value.sharding.addressable_devices):
        return value.copy()
    return value


class _Rings:
    """Rings kept between restores: one idle ring (a restore takes it, or a new one when it
    needs more room or another restore holds it) so that its pages stay faulted in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: _buffers.StagingRing | None = None

    def take(self, capacity: int) -> _buffers.StagingRing:
        with self._lock:
            ring, self._idle = self._idle, None
        if ring is not None and ring.capacity >= capacity:
            return ring
        return _buffers.StagingRing(capacity)

    def give_back(self, ring: _buffers.StagingRing) -> None:
        with self._lock:
            if self._idle is None or self._idle.capacity < ring.capacity:
                self._idle = ring

    def clear(self) -> None:
        with self._lock:
            self._idle = None

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle.capacity if self._idle is not None else 0


RINGS = _Rings()


@contextlib.contextmanager
def ring_for(requests: Sequence[Any], staged: list[bool]) -> Iterator[_buffers.StagingRing]:
    """A staging ring large enough for every staged tensor of ``requests`` (at least
    :data:`RING_BYTES`); drained (every transfer out of it done) before it is kept for the
    next restore, also when the restore fails."""
    largest = max(r.stored.nbytes for r, s in zip(requests, staged) if s)
    ring = RINGS.take(max(RING_BYTES, largest + 2 * _PAGE))
    try:
        yield ring
    finally:
        try:
            ring.drain()
        except BaseException:
            ring = None  # type: ignore[assignment]  # a failed transfer: do not keep it
            raise
        finally:
            if ring is not None:
                RINGS.give_back(ring)
