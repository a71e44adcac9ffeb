"""Barriers, broadcasts and gathers across the processes of a job, done when they return.

Barriers and broadcasts go through ``jax.distributed``'s coordination service (its barrier and
key-value store), never a device collective: ``jax.experimental.multihost_utils`` reads a
collective's result from one local device while the others may still run it, and jax 0.6's
gloo then aborts the process on the next collective. Every process calls these at the same
point of its main thread, in the same order.

Example::

    barrier("orbax_safetensors.export.staged")
    token = broadcast_bytes(os.urandom(8) if primary else None, is_source=primary)
"""

from __future__ import annotations

import base64
import functools
import itertools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat

# How long a process waits for the others: an export's "written" barrier waits for the slowest
# writer of the job (three times Orbax's default barrier timeout).
TIMEOUT_S = 3600
_KEY_PREFIX = "orbax_safetensors/multihost"
# The n-th call has the same number on every process (the keys of its barrier and value).
_calls = itertools.count()
# Values this process set since the last barrier: once every process passed it, all read them.
_set_keys: list[str] = []


def _client() -> Any:
    # Every supported jaxlib's client has the key-value store and wait_at_barrier
    # (tests/orbax/test_compat.py checks it on every stack).
    return _jaxcompat.require_distributed_kv("a barrier or broadcast between processes")


def barrier(name: str) -> None:
    """Waits until every process has called ``barrier(name)`` (up to :data:`TIMEOUT_S`).

    Raises:
      AssertionError: another process called a barrier of another name at this point.
      RuntimeError: (from JAX) the others did not come in time, or one of them failed.

    Example::

        barrier("orbax_safetensors.export.written")
    """
    if jax.process_count() == 1:
        return
    client, n = _client(), next(_calls)
    # The primary's name, as a broadcast value: a process at another barrier says so.
    primary = jax.process_index() == 0
    theirs = _exchange(client, n, name.encode() if primary else None, is_source=primary)
    if theirs != name.encode():
        raise AssertionError(
            f"barrier name mismatch: this process is at {name!r}, the primary at "
            f"{theirs.decode(errors='replace')!r}"
        )
    client.wait_at_barrier(f"{_KEY_PREFIX}/{n}/{name}", TIMEOUT_S * 1000)
    for key in _set_keys:
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
    return _exchange(_client(), next(_calls), data, is_source=is_source)


def _exchange(client: Any, n: int, data: bytes | None, *, is_source: bool) -> bytes:
    # The source's ``data`` under the n-th call's key (text: what every jaxlib's client takes).
    key = f"{_KEY_PREFIX}/{n}/value"
    if is_source:
        assert data is not None
        client.key_value_set(key, base64.b64encode(data).decode("ascii"))
        _set_keys.append(key)
        return data
    return base64.b64decode(client.blocking_key_value_get(key, TIMEOUT_S * 1000))


def process_allgather(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` (a ``jax.Array`` sharded over several processes) on the host of every
    process: a collective, for small arrays.

    Example::

        adapter = process_allgather(lora_a)  # np.ndarray of lora_a's global shape
    """
    devices = sorted(x.sharding.device_set, key=lambda d: int(d.id))  # type: ignore[attr-defined]
    replicated = NamedSharding(
        jax.sharding.Mesh(np.array(devices, dtype=object), ("all",)), PartitionSpec()
    )
    out = _replicate(replicated)(x)
    out.block_until_ready()  # every local device, not only the one read below
    return np.asarray(out.addressable_data(0))


def _identity(x: Any) -> Any:
    return x


@functools.lru_cache(maxsize=64)
def _replicate(sharding: NamedSharding) -> Any:
    return jax.jit(_identity, out_shardings=sharding)
