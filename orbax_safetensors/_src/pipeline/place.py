"""Host buffers onto devices, and the target's values finished around them: which boxes this
process's devices need (:func:`host_buffers`), placing the filled buffers (:func:`place_read`,
through :func:`put`), the staging ring of accelerator restores (:func:`staged`,
:func:`ring_for`), saved shardings (:func:`saved_shardings`) and the leaves' final values
(:func:`finished`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core.errors import SchemaError, TargetMismatchError
from orbax_safetensors._src.storage import buffers as _buffers

# --------------------------------------------------------------------------- put

# ``jax.device_put`` of a numpy array spends most of its time in Python before the transfer: a
# numpy array bound for one addressable device takes the entry ``device_put`` itself ends in
# (``compat/jaxcompat``: the same transfer, aliasing and commit). Anything else (several
# devices, 64-bit dtypes JAX may canonicalise, a JAX without that entry) goes through it.


def _load_direct_put() -> _jaxcompat.DirectPut | None:
    direct_put = _jaxcompat.batched_device_put()
    if direct_put is None:
        return None
    try:  # one real transfer, checked, before the entry is trusted
        device = jax.local_devices()[0]
        probe = np.arange(3, dtype=np.float32)
        out = direct_put(probe, jax.sharding.SingleDeviceSharding(device), device)
        if not (isinstance(out, jax.Array) and np.array_equal(np.asarray(out), probe)):
            return None
    except Exception:
        return None
    return direct_put


_direct_put: _jaxcompat.DirectPut | bool | None = False  # False: not loaded yet (needs a backend)

# Dtypes that jax.device_put may convert (to 32 bits unless jax_enable_x64): left to it.
_CANONICALISED = frozenset(np.dtype(t) for t in (np.int64, np.uint64, np.float64, np.complex128))


def _single_device_sharding(target: Any) -> tuple[jax.sharding.Sharding, Any] | None:
    # A one-device target on this process: (its sharding, its device), else None.
    if isinstance(target, jax.sharding.SingleDeviceSharding):
        device: Any = next(iter(target.device_set))
        sharding = target
    elif isinstance(target, jax.Device):
        device, sharding = target, jax.sharding.SingleDeviceSharding(target)
    else:
        return None
    return (sharding, device) if device.process_index == jax.process_index() else None


def put(values: Sequence[np.ndarray], targets: Sequence[Any]) -> list[jax.Array]:
    """``jax.device_put(values, targets, may_alias=True)``, faster for many small arrays; the
    results may share the host arrays' memory (do not write to them after)."""
    global _direct_put
    if _direct_put is False:
        _direct_put = _load_direct_put()
    direct = _direct_put if callable(_direct_put) else None
    out: list[Any] = [None] * len(values)
    slow: list[int] = []
    # Per target: its one-device (sharding, device), or None (equal targets may share the
    # first one's sharding object).
    singles = _sharding.ShardingMemo(_single_device_sharding)
    for i, (x, target) in enumerate(zip(values, targets, strict=True)):
        if direct is None or type(x) is not np.ndarray or x.dtype in _CANONICALISED:
            slow.append(i)
            continue
        single = singles(target)
        if single is None:
            slow.append(i)
            continue
        out[i] = direct(x, *single)
    if slow:
        placed = jax.device_put(
            [values[i] for i in slow], [targets[i] for i in slow], may_alias=True
        )
        for i, array in zip(slow, placed):
            out[i] = array
    return out


_ALIASES: dict[tuple[str, str | None], bool] = {}


def aliases_host(device: Any, memory_kind: str | None = None) -> bool:
    """Whether ``jax.device_put`` of a 64-byte aligned numpy array onto ``device`` (memory
    ``memory_kind``) shares the host buffer (CPU) rather than copying it. Probed once per
    platform and kind; a failed probe answers True (the caller keeps every buffer placed)."""
    key = (device.platform, memory_kind)
    known = _ALIASES.get(key)
    if known is None:
        try:
            host = _buffers.aligned_empty(4096).view(np.float32)
            host[:] = 0
            target = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
            out = jax.device_put(host, target, may_alias=True)
            known = out.unsafe_buffer_pointer() == host.ctypes.data
            out.block_until_ready()
        except Exception:
            known = True
        _ALIASES[key] = known
    return known


# --------------------------------------------------------------------------- read buffers


@dataclasses.dataclass(slots=True)
class Box:
    """One box of a tensor that this process's devices need, and its host buffer."""

    index: _runs.Index
    buffer: np.ndarray  # flat aligned uint8: the box's bytes in row-major order

    @property
    def key(self) -> tuple:
        return _runs.index_key(self.index)


@dataclasses.dataclass(slots=True)
class HostBuffers:
    """Where one read request's bytes land on the host."""

    whole: np.ndarray | None  # the buffer of the whole tensor, when it is read whole (one run)
    boxes: list[Box]  # otherwise: the boxes read from the file
    device_keys: dict[Any, tuple] | None  # device -> index key of its box (None: no sharding)


def on_one_device(sharding: jax.sharding.Sharding) -> bool:
    """Whether one device of this process holds the whole array (placed whole, no assembly)."""
    return len(sharding.device_set) == 1 and sharding.is_fully_addressable


def host_buffers(
    req: Any, whole: Callable[[Any], np.ndarray], one_device: Callable[[Any], bool]
) -> HostBuffers:
    """The host buffers a ``read.ReadRequest`` is read into: each distinct box this process's
    devices need, or ``whole(req)`` when it needs every byte; ``one_device``:
    :func:`on_one_device`, memoised by the caller."""
    shape = req.stored.shape
    if req.kind != "jax" or req.sharding is None or one_device(req.sharding):
        return HostBuffers(whole(req), [], None)
    device_keys: dict[Any, tuple] = {}
    boxes: dict[tuple, Box] = {}
    for device, index in req.sharding.addressable_devices_indices_map(shape).items():
        norm = _runs.normalize_index(index or (), shape)
        device_keys[device] = _runs.index_key(norm)
        boxes.setdefault(device_keys[device], Box(norm, np.empty(0, np.uint8)))
    if req.sharding.is_fully_addressable or _runs.index_key(_runs.whole_index(shape)) in boxes:
        # This process needs every byte: one whole read (verifiable) serves every box.
        return HostBuffers(whole(req), [], device_keys)
    for box in boxes.values():
        box.buffer = _buffers.aligned_empty(
            _dtypes.nbytes(req.stored.dtype, _runs.box_shape(box.index))
        )
    return HostBuffers(None, list(boxes.values()), device_keys)


def _host_value(req: Any, raw: np.ndarray, box_shape: tuple[int, ...]) -> np.ndarray:
    value = _dtypes.unpack(raw, req.stored.dtype, box_shape)
    if req.dtype is not None and value.dtype != req.dtype:
        # jax's cast, as a save-time cast: numpy's out-of-range float -> int is the platform's
        value = _casting.astype(value, req.dtype)
    return value


def _shard_targets(sharding: Any, devices: list[Any]) -> list[Any]:
    # Where each device's shard of an array over ``sharding`` goes: the device, or its memory
    # of the sharding's kind (e.g. ``pinned_host``) when that is not the device's own.
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or kind == "device":
        return devices
    return [jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in devices]


def place_read(requests: Sequence[Any], buffers: Sequence[HostBuffers]) -> list[Any]:
    """The values of read requests from their filled ``buffers`` (host arrays, or
    ``jax.Array``s assembled from their shards), every placement in one :func:`put`."""
    results: list[Any] = [None] * len(requests)
    default = jax.local_devices()[0]  # jax.devices()[0] may belong to another process
    # values[k] goes to targets[k]. Per request placed: (request, first k, shards to assemble
    # into one array over its sharding, or None for an array placed whole on one device).
    values: list[np.ndarray] = []
    targets: list[Any] = []
    spans: list[tuple[int, int, int | None]] = []
    for i, (req, rbuf) in enumerate(zip(requests, buffers)):
        if rbuf.whole is not None:
            full = _host_value(req, rbuf.whole, req.stored.shape)
            if req.kind != "jax":
                results[i] = full[()] if req.kind == "scalar" else full
                continue
            if rbuf.device_keys is None:  # one device: put to the sharding itself
                spans.append((i, len(values), None))
                values.append(full)
                targets.append(req.sharding or default)
                continue
            keys = set(rbuf.device_keys.values())
            host = {k: full[tuple(slice(a, b) for a, b in k)] for k in keys}
        else:
            assert rbuf.device_keys is not None
            host = {b.key: _host_value(req, b.buffer, _runs.box_shape(b.index)) for b in rbuf.boxes}
        devices = list(rbuf.device_keys)
        spans.append((i, len(values), len(devices)))
        values.extend(host[rbuf.device_keys[d]] for d in devices)
        targets.extend(_shard_targets(req.sharding, devices))
    placed = put(values, targets)
    for i, start, shards in spans:
        if shards is None:
            results[i] = placed[start]
        else:
            sharding = requests[i].sharding
            results[i] = jax.make_array_from_single_device_arrays(
                requests[i].stored.shape, sharding, placed[start : start + shards]
            )
    return results


# --------------------------------------------------------------------------- staging

# On an accelerator ``jax.device_put`` copies host bytes: large tensors are read into a ring
# whose space is reused once their transfers are done, and kept between restores so that its
# pages are faulted in once per process. On CPU the placed array *is* the host buffer: nothing
# is staged.

# Tensors of at least this many bytes go through the ring; smaller ones are carved from the
# arena's slabs (few allocations, and the ring's page placement would waste more than they hold).
STAGE_MIN_BYTES = 1 << 20
# The ring's size (grown to hold the largest staged tensor), and how many waves of reads share
# it: a wave of at most a quarter of the ring is read while the three before it transfer
# (smaller or fewer waves left the transfers idle between waves).
RING_BYTES = 512 << 20
WAVES_IN_FLIGHT = 4
_PAGE = 4096

#: ``"auto"``: stage the large tensors bound for devices whose placement copies (accelerators);
#: ``"always"``: stage every large ``jax.Array`` read, and copy off the ring those whose
#: placement shared its memory (CPU: slower, for tests of this path on machines without an
#: accelerator); ``"never"``: read every tensor into its own fresh buffer, as on CPU.
MODE = "auto"


def staged(requests: Sequence[Any]) -> list[bool] | None:
    """Per read request, whether it is read through a staging ring: a ``jax.Array`` of at
    least :data:`STAGE_MIN_BYTES` whose placement copies the host bytes. None when none is."""
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
    return not any(aliases_host(d, kind) for d in sharding.addressable_devices)


def off_the_ring(value: Any) -> Any:
    """``value`` (placed from ring memory) as an array not sharing the ring's memory."""
    if isinstance(value, jax.Array) and not _copies(value.sharding):
        return value.copy()
    return value


class _Rings:
    """The one idle ring kept between restores, so that its pages stay faulted in."""

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
    """A staging ring for the staged tensors of ``requests`` (at least :data:`RING_BYTES`),
    drained before it is kept for the next restore, also when the restore fails."""
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


# --------------------------------------------------------------------------- saved shardings


def saved_shardings(
    directory: epath.PathLike,
    metadata: Mapping[str, Any],
    fallback_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[str], Any] | None:
    """A tensor name -> its saved sharding over this job's devices (None: saved without one),
    or ``fallback_sharding`` where these devices cannot rebuild it, else a
    ``TargetMismatchError``; None when no tensor has one."""
    tensors = metadata["tensors"]
    if not any(
        isinstance(info, dict) and (info.get("sharding") or "device" in info)
        for info in tensors.values()
    ):
        return None
    # A saved single device counts in a single-process job only: in a multi-process one, each
    # process places host-local arrays on its own first device (the same answer everywhere).
    single_process = jax.process_count() == 1
    device_meshes = metadata.get("device_meshes")
    built: dict[str, Any] = {}  # one sharding object per distinct description

    def sharding_of(name: str) -> Any:
        info = tensors.get(name)
        desc = info.get("sharding") if isinstance(info, dict) else None
        if not desc:
            if not (single_process and isinstance(info, dict) and "device" in info):
                return None
            saved = info["device"]
            key = f"device {saved!r}"
            if key not in built:
                built[key] = _sharding.device_from_json(saved)
        else:
            if not isinstance(desc, dict):
                raise SchemaError(f"{directory}: tensor {name!r} has a malformed sharding {desc!r}")
            if "device_ids" in desc:  # (long lists: kept in device_meshes by this library)
                key = json.dumps(desc, sort_keys=True)
            else:
                fields = ("mesh_axes", "mesh_shape", "spec", "mesh_devices", "axis_types")
                key = repr(tuple(desc.get(f) for f in fields))
            if key not in built:
                built[key] = _sharding.sharding_from_json(desc, device_meshes)
        if built[key] is not None:
            return built[key]
        if fallback_sharding is not None:
            return fallback_sharding
        if desc:
            where = (
                f"with sharding {desc!r} (a mesh of {_sharding.mesh_size(desc)} devices), "
                f"which this job's {len(jax.devices())} devices cannot reproduce"
            )
        else:
            where = f"on device {saved}, which this process does not have"
        raise TargetMismatchError(
            f"{directory}: tensor {name!r} was saved {where}; pass a restore target whose "
            "leaves are jax.ShapeDtypeStruct with the sharding you want"
        )

    return sharding_of


def key_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of a typed PRNG key array of ``ndim`` dimensions from its key data's
    sharding (one more, trailing dimension), or None when the data's sharding splits that
    dimension."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or len(sharding.spec) <= ndim:
        return sharding
    if any(e is not None for e in sharding.spec[ndim:]):
        return None
    spec = jax.sharding.PartitionSpec(*sharding.spec[:ndim])
    return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


# --------------------------------------------------------------------------- values finished


@dataclasses.dataclass(frozen=True, slots=True)
class Known:
    """A target leaf's value known without reading (a skipped leaf, an inline value)."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """The value read into ``slot``, as it is (the common case)."""

    slot: int


@dataclasses.dataclass(frozen=True, slots=True)
class Resize:
    """The tensor read whole on the host into ``slot``, then cut and zero-padded to ``shape``
    (a ``jax.Array`` on ``sharding`` when ``to_jax``)."""

    slot: int
    shape: tuple[int, ...]
    to_jax: bool
    sharding: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """The key data in ``slot`` wrapped as a typed PRNG key of ``impl`` (placed on
    ``sharding``), or, with ``pytype``, the value converted to that Python type."""

    slot: int
    name: str
    impl: str = ""
    sharding: Any = None
    pytype: type | None = None


Plan = Known | Read | Resize | Finish


def finished(plans: Sequence[Plan], values: Sequence[Any]) -> list[Any]:
    """The target leaves ``plans`` make of the ``values`` read (one per read slot); plans that
    wrap the same slot on the same sharding share one object, as aliases do."""
    out: list[Any] = []
    once: dict[tuple, Any] = {}
    for plan in plans:
        if isinstance(plan, Read):
            out.append(values[plan.slot])  # the common case (aliases share it)
        elif isinstance(plan, Known):
            out.append(plan.value)
        elif isinstance(plan, Resize):
            out.append(pad_or_truncate(values[plan.slot], plan.shape, plan.to_jax, plan.sharding))
        elif plan.pytype is not None:
            out.append(plan.pytype(values[plan.slot].item()))
        else:
            key = (plan.slot, id(plan.sharding))
            if key not in once:
                once[key] = typed_key(plan.name, values[plan.slot], plan.impl, plan.sharding)
            out.append(once[key])
    return out


def typed_key(name: str, data: Any, impl: str, sharding: Any = None) -> Any:
    """Stored key data as a typed PRNG key (placed on ``sharding`` if given)."""
    key = wrap_key(name, data, impl)
    return jax.device_put(key, sharding) if sharding is not None else key


def wrap_key(name: str, data: Any, impl: str) -> Any:
    """``jax.random.wrap_key_data`` for a stored key (also of a ``ShapeDtypeStruct`` inside
    ``jax.eval_shape``), raising ``SchemaError`` on forged data."""
    try:
        return jax.random.wrap_key_data(data, impl=impl)
    except (TypeError, ValueError) as e:
        reason = str(e).split(" for impl=")[0]
        raise SchemaError(
            f"PRNG key {name!r}: stored {data.dtype}{list(data.shape)} is not key data of "
            f"impl {impl!r} ({reason})"
        ) from None


def pad_or_truncate(value: Any, shape: tuple[int, ...], to_jax: bool, sharding: Any = None) -> Any:
    """``value`` (a host array) cut to ``shape`` and padded with zeros, as Orbax's
    ``strict=False`` restores; a ``jax.Array`` on ``sharding`` when ``to_jax``."""
    host = np.asarray(value)
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, host.shape))
    out[common] = host[common]
    if not to_jax:
        return out
    if sharding is None:
        return jax.device_put(out)
    return jax.make_array_from_callback(shape, sharding, lambda index: out[index])
