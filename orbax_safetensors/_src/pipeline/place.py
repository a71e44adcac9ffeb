"""Host buffers to ``jax.Array``s: one call for many arrays, zero-copy where XLA allows it.

``jax.device_put`` of a numpy array spends most of its time in Python (it builds the abstract
value several times over and runs sharding checks meant for resharding ``jax.Array``s) before
XLA's C++ transfer, which takes a fraction of that. Restoring 10,000 small tensors, that Python
was most of the restore (docs/performance.md, "Figures behind the code"). So a numpy array bound for one addressable device takes the entry that
``jax.device_put`` itself ends in for numpy inputs (``pxla.batched_device_put``: the same
transfer, the same zero-copy aliasing of 64-byte aligned buffers on CPU, committed like
``device_put`` to a device) straight away. Anything else (shardings over several devices,
64-bit dtypes that JAX may canonicalise, a JAX without that entry) goes through
``jax.device_put``. The private entry is looked up in :mod:`orbax_safetensors._src.compat.jaxcompat`.

Example::

    arrays = put([np.ones(4, np.float32)], [jax.local_devices()[0]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.storage import buffers as _buffers


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


_direct_put: _jaxcompat.DirectPut | bool | None = (
    False  # False: not loaded yet (needs a JAX backend)
)

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
    """``jax.device_put(values, targets, may_alias=True)``, faster for many small arrays.

    Args:
      values: host arrays; the results may share their memory (do not write to them after).
      targets: a ``jax.Device`` or ``jax.sharding.Sharding`` for each value.
    """
    global _direct_put
    if _direct_put is False:
        _direct_put = _load_direct_put()
    direct = _direct_put if callable(_direct_put) else None
    out: list[Any] = [None] * len(values)
    slow: list[int] = []
    # Per target: its one-device (sharding, device), or None. (Equal targets may share the
    # first one's sharding object.)
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
    """Whether ``jax.device_put`` of a 64-byte aligned numpy array onto ``device`` (its memory
    of ``memory_kind``; None: the default) shares the host buffer rather than copying it: True
    on CPU, False on accelerators. Probed once per platform and memory kind with a small array;
    a probe that fails answers True (the caller then keeps every buffer it placed)."""
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
