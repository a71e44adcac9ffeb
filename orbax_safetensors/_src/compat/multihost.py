"""Barriers, broadcasts and gathers across the processes of a job, done when they return.

``jax.experimental.multihost_utils``'s ``sync_global_devices``, ``broadcast_one_to_all`` and
``process_allgather`` run one collective over every device of the job and read its result from
this process's first device only: its other devices may still be running that collective when
the caller starts the next one. On jax 0.6's CPU backend (gloo), with several devices per
process, gloo then receives one collective's message inside another and aborts the process
(``gloo::EnforceNotMet ... op.preamble.length <= op.nbytes. 8 vs 4``); seen on CI under load,
and within seconds by 300 broadcasts of 8 bytes, each followed by a barrier, in 2 processes of
2 CPU devices with the cores busy (jax 0.10.2 passes the same run). Orbax's own barriers are
``sync_global_devices`` too, so the collective before one of ours may still be running.

So barriers and broadcasts of control data go through ``jax.distributed``'s coordination
service (its barrier and key-value store: no device collective, and nothing to collide with a
collective still running), where this JAX exposes it (:func:`.jaxcompat.distributed_kv`);
else, and for gathers of device data, through the same device collectives as
``multihost_utils``, waited for on every local device before they return.

Every process calls them at the same point of its main thread, in the same order.

Example::

    barrier("orbax_safetensors.export.staged")
    token = broadcast_bytes(os.urandom(8) if primary else None, is_source=primary)
"""

from __future__ import annotations

import base64
import functools
import itertools
import zlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat

# How long a process waits at a barrier or for a broadcast value for the others: an export's
# "written" barrier waits for the slowest writer of the job (three times Orbax's default
# barrier timeout).
TIMEOUT_S = 3600
_KEY_PREFIX = "orbax_safetensors/multihost"
# Calls of this module in this process: every process makes them in the same order, so the
# n-th call has the same number on every process (the barriers' and values' unique keys).
_calls = itertools.count()
# Broadcast values this process (their source) set since the last barrier: once every process
# has passed a barrier, every process has read them, and the source deletes them.
_set_keys: list[str] = []


def _sum_over_processes(x: Any) -> Any:
    return x.sum(axis=0)


def _identity(x: Any) -> Any:
    return x


@functools.cache
def _process_mesh() -> jax.sharding.Mesh:
    # Every device of the job, one row per process (multihost_utils's mesh).
    devices = np.array(jax.devices(), dtype=object)
    return jax.sharding.Mesh(
        devices.reshape(jax.process_count(), jax.local_device_count()),
        ("processes", "local_devices"),
    )


@functools.lru_cache(maxsize=8)
def _broadcast_fn(mesh: jax.sharding.Mesh) -> Any:
    return jax.jit(_sum_over_processes, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _settled(out: jax.Array) -> np.ndarray:
    out.block_until_ready()  # every local device, not only the one read below
    return np.asarray(out.addressable_data(0))


def broadcast_one_to_all(x: np.ndarray | np.generic, *, is_source: bool) -> np.ndarray:
    """``x`` of the process where ``is_source`` is True, returned on every process (the
    others' ``x`` give only shape and dtype). One process alone returns ``x``.

    Example::

        token = broadcast_one_to_all(np.zeros(8, np.uint8), is_source=jax.process_index() == 0)
    """
    host = np.asarray(x)
    if jax.process_count() == 1:
        return host
    mesh = _process_mesh()
    mine = host if is_source else np.zeros_like(host)
    inp = multihost_utils.host_local_array_to_global_array(
        mine[None], mesh, PartitionSpec("processes")
    )
    return _settled(_broadcast_fn(mesh)(inp))


def barrier(name: str) -> None:
    """Waits until every process has called ``barrier(name)`` (up to :data:`TIMEOUT_S`).

    Raises:
      AssertionError: another process called a barrier of another name at this point.
      RuntimeError: (from JAX) the others did not come within :data:`TIMEOUT_S`, or one of
        them failed.
    """
    if jax.process_count() == 1:
        return
    client = _coordination()
    if client is None:
        mine = np.uint32(zlib.crc32(name.encode()))
        got = broadcast_one_to_all(mine, is_source=jax.process_index() == 0)
        if got != mine:
            raise AssertionError(f"barrier name mismatch: this process is at {name!r}")
        return
    n = next(_calls)
    # (the primary's name, as a broadcast value: a process at another barrier says so)
    primary = jax.process_index() == 0
    theirs = _exchange(client, n, name.encode() if primary else None, is_source=primary)
    if theirs != name.encode():
        raise AssertionError(
            f"barrier name mismatch: this process is at {name!r}, the primary at "
            f"{theirs.decode(errors='replace')!r}"
        )
    client.wait_at_barrier(f"{_KEY_PREFIX}/{n}/{name}", TIMEOUT_S * 1000)
    for key in _set_keys:  # (every process has read them: it has passed the barrier)
        _jaxcompat.distributed_kv_delete(client, key)
    _set_keys.clear()


def broadcast_bytes(data: bytes | None, *, is_source: bool) -> bytes:
    """``data`` of the one process where ``is_source`` is True (others pass None), returned on
    every process. One process alone returns ``data``.

    Example::

        token = broadcast_bytes(os.urandom(8) if primary else None, is_source=primary)
    """
    if is_source and data is None:
        raise ValueError("broadcast_bytes: the source process passes the bytes")
    if jax.process_count() == 1:
        assert data is not None
        return data
    client = _coordination()
    if client is not None:
        return _exchange(client, next(_calls), data, is_source=is_source)
    length = broadcast_one_to_all(np.array([len(data or b"")], np.int32), is_source=is_source)
    n = int(length.reshape(-1)[0])
    buffer = np.zeros(max(8, 1 << max(0, n - 1).bit_length()), np.int32)
    if is_source:
        buffer[:n] = np.frombuffer(data or b"", np.uint8)
    out = broadcast_one_to_all(buffer, is_source=is_source)
    return out[:n].astype(np.uint8).tobytes()


def _coordination() -> Any:
    # jax.distributed's client, where it has a key-value store and a barrier; else None
    client = _jaxcompat.distributed_kv()
    return client if hasattr(client, "wait_at_barrier") else None


def _exchange(client: Any, n: int, data: bytes | None, *, is_source: bool) -> bytes:
    # The source's ``data`` under the n-th call's key of the coordination service (text: the
    # string form every jaxlib's client has), read by the others.
    key = f"{_KEY_PREFIX}/{n}/value"
    if is_source:
        assert data is not None
        client.key_value_set(key, base64.b64encode(data).decode("ascii"))
        _set_keys.append(key)
        return data
    return base64.b64decode(client.blocking_key_value_get(key, TIMEOUT_S * 1000))


def process_allgather(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` (a ``jax.Array`` sharded over several processes) on the host of
    every process (a collective: for small arrays; ``multihost_utils.process_allgather(x,
    tiled=True)``).

    Example::

        adapter = process_allgather(lora_a)  # np.ndarray of lora_a's global shape
    """
    devices = sorted(x.sharding.device_set, key=lambda d: int(d.id))  # type: ignore[attr-defined]
    replicated = NamedSharding(
        jax.sharding.Mesh(np.array(devices, dtype=object), ("all",)), PartitionSpec()
    )
    return _settled(_replicate(replicated)(x))


@functools.lru_cache(maxsize=64)
def _replicate(sharding: NamedSharding) -> Any:
    return jax.jit(_identity, out_shardings=sharding)
