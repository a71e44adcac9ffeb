"""Every private or version-dependent JAX and flax name the package touches, and the barriers
and broadcasts between the processes of a job, in one place.

Each private or version-dependent name is looked up behind a guard with a fallback that gives
the same results (``tests/orbax/test_compat.py`` checks each on every supported stack, jax 0.6
to 0.10 and flax 0.11 to 0.12).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import KeyEntry

# -- jax.tree_util.flatten_one_level_with_keys (public since jax 0.10.2) --------------------

_ONE_LEVEL = getattr(jax.tree_util, "flatten_one_level_with_keys", None)


def flatten_one_level_with_keys_fallback(x: Any) -> list[tuple[KeyEntry, Any]]:
    """:func:`flatten_one_level_with_keys` from public names every supported jax has."""
    flat, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is x:
        raise ValueError(f"{type(x).__name__} is a leaf, not a pytree node")
    return [(path[0], child) for path, child in flat]


def flatten_one_level_with_keys(x: Any) -> list[tuple[KeyEntry, Any]]:
    """The children of pytree node ``x`` with their key entries; ValueError for a leaf."""
    if _ONE_LEVEL is None:
        return flatten_one_level_with_keys_fallback(x)
    return list(_ONE_LEVEL(x)[0])


# -- flax.nnx names (nnx.List, Variable.get_value since flax 0.12) ------------------------------


def nnx_list(items: list[Any]) -> Any:
    """``nnx.List(items)`` on flax 0.12+ (required there for a module's list of modules), else
    the plain list flax 0.11 takes; the state's names are the same."""
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    make = getattr(nnx, "List", None)
    return list(items) if make is None else make(items)


def nnx_variable_types() -> tuple[type, ...]:
    """The classes an ``nnx.State`` holds its leaves in: ``nnx.Variable``, and flax 0.11's
    ``nnx.VariableState`` (looked up in ``vars(nnx)``: flax 0.12's ``getattr`` of it warns)."""
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    state_type = vars(nnx).get("VariableState")
    return (nnx.Variable,) if state_type is None else (nnx.Variable, state_type)


def nnx_value(var: Any) -> Any:
    """The value an NNX ``Variable`` (or flax 0.11's ``VariableState``) holds."""
    get = getattr(type(var), "get_value", None)
    return var.value if get is None else get(var)


def nnx_is_lora_param(var: Any) -> bool:
    """Whether an NNX ``Variable`` (or flax 0.11's ``VariableState``, which names its class in
    ``type``) is an ``nnx.LoRAParam``."""
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    kind = type(var) if isinstance(var, nnx.Variable) else getattr(var, "type", None)
    return isinstance(kind, type) and issubclass(kind, nnx.LoRAParam)


# flax 0.12 names it _pytree__state; flax 0.11 (flax/nnx/object.py, ObjectState) _object__state.
_NNX_INTERNAL_ATTRS = frozenset({"_pytree__state", "_object__state"})


def is_nnx_internal_attr(name: str) -> bool:
    """Whether ``name`` is the empty pytree child flax.nnx gives every Module (no user state;
    a restore without a target leaves it out, as ``nnx.to_pure_dict`` does)."""
    return name in _NNX_INTERNAL_ATTRS


# -- pxla.batched_device_put (private) -------------------------------------------------------

DirectPut = Callable[[Any, Any, Any], jax.Array]


def batched_device_put() -> DirectPut | None:
    """``put(x, sharding, device)``: the entry ``jax.device_put`` ends in for one numpy array
    onto one device of ``sharding``; None when this JAX lacks it (use ``jax.device_put``)."""
    try:  # jax 0.6-0.10 keep both here; guarded so that a move only costs speed
        from jax._src import core
        from jax._src.interpreters import pxla

        put = pxla.batched_device_put
        shaped_array = core.ShapedArray
    except (ImportError, AttributeError):
        return None

    avals: dict[tuple[tuple[int, ...], Any], Any] = {}  # ShapedArrays are immutable

    def direct_put(x: Any, sharding: Any, device: Any) -> jax.Array:
        # One abstract value per (shape, dtype): building one costs as much as the transfer,
        # and a model repeats a few shapes over and over.
        key = (x.shape, x.dtype)
        aval = avals.get(key)
        if aval is None:
            if len(avals) >= 4096:
                avals.clear()
            aval = avals[key] = shaped_array(x.shape, x.dtype)
        return put(aval, sharding, [x], [device])  # type: ignore[no-any-return]

    return direct_put


# -- SingleDeviceSharding._device (private) --------------------------------------------------


def single_device_key(sharding: Any) -> Any:
    """A cheap hashable key equal for equal ``SingleDeviceSharding``s (whose ``__hash__`` and
    ``__eq__`` run in Python), or None: then the sharding itself is the key."""
    if type(sharding) is not jax.sharding.SingleDeviceSharding:
        return None
    device = getattr(sharding, "_device", None)
    return None if device is None else (device, sharding.memory_kind)


# -- jax._src.distributed.global_state.client (private; no fallback) -------------------------

# What callers use of the key-value store (string keys and values).
KV_METHODS = ("key_value_set", "blocking_key_value_get", "key_value_try_get", "key_value_delete")


def _distributed_client() -> Any:
    try:  # jax 0.6-0.10 keep the client here
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


def kv_missing(client: Any) -> str | None:
    """Why ``client`` (``jax.distributed``'s, None before ``jax.distributed.initialize``) cannot
    serve as the key-value store, or None if it can."""
    if client is None:
        return (
            "jax.distributed is not initialized (call jax.distributed.initialize() in every "
            "process), or this JAX keeps its client elsewhere than "
            "jax._src.distributed.global_state.client"
        )
    missing = [name for name in KV_METHODS if not hasattr(client, name)]
    if missing:
        return f"the client of jax {jax.__version__} has no {', '.join(missing)}"
    return None


def distributed_kv() -> Any:
    """The key-value store of ``jax.distributed``'s coordination service, or None when the job
    is not distributed or this JAX hides it."""
    client = _distributed_client()
    return None if kv_missing(client) else client


def require_distributed_kv(purpose: str) -> Any:
    """:func:`distributed_kv`, or a RuntimeError saying that ``purpose`` needs it and what is
    missing."""
    client = _distributed_client()
    reason = kv_missing(client)
    if reason:
        raise RuntimeError(f"{purpose} needs the key-value store of jax.distributed: {reason}")
    return client


def distributed_kv_try_get(client: Any, key: str) -> str | None:
    """The value of ``key`` in the key-value store ``client``, or None if it is not set."""
    try:
        return str(client.key_value_try_get(key))
    except Exception as error:
        if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
            return None
        raise


# -- barriers, broadcasts and gathers between the processes of a job --------------------------

# These go through the coordination service (its barrier and key-value store), never a device
# collective: ``jax.experimental.multihost_utils`` reads a collective's result from one local
# device while the others may still run it, and jax 0.6's gloo then aborts the process on the
# next collective. Every process calls them at the same point of its main thread, in order.

# How long a process waits for the others: an export's "written" barrier waits for the slowest
# writer of the job (three times Orbax's default barrier timeout).
TIMEOUT_S = 3600
_KEY_PREFIX = "orbax_safetensors/multihost"
# The n-th call has the same number on every process (the keys of its barrier and value).
_calls = itertools.count()
# Values this process set since the last barrier: once every process passed it, all read them.
_set_keys: list[str] = []


def _client() -> Any:
    return require_distributed_kv("a barrier or broadcast between processes")


def barrier(name: str) -> None:
    """Waits until every process has called ``barrier(name)`` (up to :data:`TIMEOUT_S`).

    Raises:
      AssertionError: another process called a barrier of another name at this point.
      RuntimeError: (from JAX) the others did not come in time, or one of them failed.
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
        client.key_value_delete(key)
    _set_keys.clear()


def broadcast_bytes(data: bytes | None, *, is_source: bool) -> bytes:
    """``data`` of the one process where ``is_source`` is True (others pass None), returned on
    every process. One process alone returns ``data``."""
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
    process: a collective, for small arrays."""
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


# -- mesh axis types (jax.sharding.AxisType: Auto, Explicit, Manual) -------------------------


def axis_type_names(mesh: Any) -> list[str] | None:
    """The names of ``mesh``'s axis types (``"Auto"``, ``"Explicit"``, ``"Manual"``) when some
    axis is not Auto, else None (every axis Auto, or a jax without axis types)."""
    names = [getattr(t, "name", str(t)) for t in getattr(mesh, "axis_types", None) or ()]
    return None if all(n == "Auto" for n in names) else names


def make_mesh(devices: np.ndarray, axes: tuple[str, ...], axis_types: Any = None) -> Any:
    """``jax.sharding.Mesh(devices, axes)``, with the axis types named in ``axis_types`` (see
    :func:`axis_type_names`) where given; ValueError for a name this jax does not know."""
    if axis_types is None:
        return jax.sharding.Mesh(devices, axes)
    kinds = getattr(jax.sharding, "AxisType", None)
    try:
        types = tuple(getattr(kinds, name) for name in axis_types)
    except (AttributeError, TypeError):
        raise ValueError(f"this jax has no mesh axis types {list(axis_types)!r}") from None
    return jax.sharding.Mesh(devices, axes, axis_types=types)


# -- jax.sharding.set_mesh (a plain setter on jax 0.6 and 0.7) ---------------------------------


def plain_set_mesh() -> Callable[[Any], Any] | None:
    """``jax.sharding.set_mesh`` where it is a plain setter returning the previous mesh (jax 0.6
    and 0.7), else None (a context manager class from jax 0.8 on)."""
    set_mesh = getattr(jax.sharding, "set_mesh", None)
    return None if set_mesh is None or isinstance(set_mesh, type) else set_mesh


@contextlib.contextmanager
def global_mesh_kept() -> Iterator[None]:
    """Restores this thread's global concrete mesh on exit, if the body changed it.

    orbax-checkpoint 0.11.40 uses ``set_mesh`` as a context manager when it saves a replicated
    array; on jax 0.7, where it is a plain setter, that call fails after setting a mesh for the
    whole thread, and every later jit on other devices fails. Calls into Orbax's own handlers
    run inside this guard; elsewhere it does nothing.
    """
    set_mesh = plain_set_mesh()
    if set_mesh is None:
        yield
        return
    before = set_mesh(None)
    set_mesh(before)
    try:
        yield
    finally:
        set_mesh(before)


# -- dtypes XLA may lack -----------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def device_holds(dtype: np.dtype) -> bool:
    """Whether this JAX places arrays of ``dtype`` on its devices (ml_dtypes knows types not
    every XLA does, e.g. float6 on jax 0.10's CPU); probed once per dtype."""
    if dtype.kind in "biufc":  # numpy's own types: always (64-bit ones canonicalised)
        return True
    try:
        jax.block_until_ready(jax.device_put(np.zeros(1, dtype)))
    except Exception:  # (XlaRuntimeError / JaxRuntimeError / TypeError, by version)
        return False
    return True
