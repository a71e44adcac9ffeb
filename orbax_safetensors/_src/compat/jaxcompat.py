"""Every private or version-dependent JAX and flax name the package touches, in one place.

The supported stacks (``pyproject.toml``; jax 0.6 to 0.10, flax 0.11 to 0.12) differ in what
they offer, and a few speed-ups need names JAX keeps private. Each such name is looked up here,
once, behind a guard, with a public fallback that gives the same results;
``tests/test_compat.py`` checks every fallback against the fast path on every stack CI tests.
Outside ``orbax_safetensors._src.compat`` (this module and :mod:`.orbaxcompat`, for Orbax's
names), nothing in the package imports ``jax._src`` or reads another library's private
attribute.

| what | name | since / status | fallback |
|---|---|---|---|
| :func:`flatten_one_level_with_keys` | ``jax.tree_util.flatten_one_level_with_keys`` | public since jax 0.10.2 | ``tree_flatten_with_path`` with an ``is_leaf`` that stops one level down |
| :func:`batched_device_put` | ``jax._src.interpreters.pxla.batched_device_put``, ``jax._src.core.ShapedArray`` | private | ``jax.device_put`` (``None`` here) |
| :func:`single_device_key` | ``SingleDeviceSharding._device`` | private | the sharding itself as a dict key (``None`` here) |
| :func:`nnx_list` | ``flax.nnx.List`` | public since flax 0.12 (needed there for lists of modules) | a plain ``list`` (what flax 0.11 takes) |
| :func:`distributed_kv`, :func:`require_distributed_kv` | ``jax._src.distributed.global_state.client`` and its :data:`KV_METHODS` (every supported jaxlib, 0.6.0 on, has them) | private | none for an object-store save by several processes: it raises, naming what is missing (:func:`require_distributed_kv`); :mod:`.multihost` uses device collectives |
| :mod:`.multihost`'s barriers and broadcasts | the client's ``wait_at_barrier`` (with :func:`distributed_kv`) | private (the client) | device collectives as ``multihost_utils``', waited for on every local device |
| :func:`global_mesh_kept`, :func:`plain_set_mesh` | ``jax.sharding.set_mesh`` | a plain setter returning the previous mesh on jax 0.7, a context manager from 0.8 on, absent before | nothing to guard (no call on other versions) |
| :func:`device_holds` | whether XLA takes an ml_dtypes dtype (float6 types: not on jax 0.10's CPU) | differs by version | probed once per dtype by a one-element ``jax.device_put`` |
| :func:`is_nnx_internal_attr` | ``Module._pytree__state`` (flax 0.12), ``Module._object__state`` (flax 0.11): an empty pytree child of every Module | private | none needed: a flax without them has no such child |

Example::

    children = flatten_one_level_with_keys(optax_state)  # [(key entry, child), ...]
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
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
    """The children of pytree node ``x`` with their key entries; ValueError for a leaf.

    Example::

        flatten_one_level_with_keys({"a": 1})  # [(DictKey(key='a'), 1)]
    """
    if _ONE_LEVEL is None:
        return flatten_one_level_with_keys_fallback(x)
    return list(_ONE_LEVEL(x)[0])


# -- flax.nnx.List (public since flax 0.12) ---------------------------------------------------


def nnx_list(items: list[Any]) -> Any:
    """``nnx.List(items)`` where flax has it (0.12+, which requires it for a list of modules
    held by a module), else the plain list flax 0.11 takes. The state's names are the same.
    """
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    make = getattr(nnx, "List", None)
    return list(items) if make is None else make(items)


# -- flax.nnx variable values (Variable.get_value since flax 0.12) -----------------------------


def nnx_variable_types() -> tuple[type, ...]:
    """The classes an ``nnx.State`` holds its leaves in: ``nnx.Variable``, and
    ``nnx.VariableState`` where this flax still defines that name (flax 0.11, as an alias).

    The name is looked up in ``flax.nnx``'s own namespace, never with ``getattr``: flax 0.12
    serves it from a module ``__getattr__`` that warns (``DeprecationWarning``).
    """
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    state_type = vars(nnx).get("VariableState")
    return (nnx.Variable,) if state_type is None else (nnx.Variable, state_type)


def nnx_value(var: Any) -> Any:
    """The value an NNX ``Variable`` (or flax 0.11's ``VariableState``) holds: its
    ``get_value()`` where the class defines one (flax 0.12+), else its ``value`` (flax 0.11's
    ``VariableState`` forwards unknown attributes to the array, so ``get_value`` would fail)."""
    get = getattr(type(var), "get_value", None)
    return var.value if get is None else get(var)


def nnx_is_lora_param(var: Any) -> bool:
    """Whether an NNX ``Variable`` (or flax 0.11's ``VariableState``, which names its class in
    ``type``) is an ``nnx.LoRAParam``."""
    from flax import nnx  # imported here: flax.nnx takes seconds to import

    kind = type(var) if isinstance(var, nnx.Variable) else getattr(var, "type", None)
    return isinstance(kind, type) and issubclass(kind, nnx.LoRAParam)


# -- flax.nnx's internal Module attributes (private) ------------------------------------------

# flax 0.12 names it _pytree__state; flax 0.11 (flax/nnx/object.py, ObjectState) _object__state.
_NNX_INTERNAL_ATTRS = frozenset({"_pytree__state", "_object__state"})


def is_nnx_internal_attr(name: str) -> bool:
    """Whether ``name`` is an attribute flax.nnx gives every Module as an empty pytree child
    (flax 0.12's ``_pytree__state``, flax 0.11's ``_object__state``): no state of the user's.
    A saved Module restored without a target leaves it out, so the result is what
    ``nnx.to_pure_dict`` gives.
    """
    return name in _NNX_INTERNAL_ATTRS


# -- pxla.batched_device_put (private) -------------------------------------------------------

DirectPut = Callable[[Any, Any, Any], jax.Array]


def batched_device_put() -> DirectPut | None:
    """The entry ``jax.device_put`` ends in for numpy inputs, as ``put(x, sharding, device)``
    (one numpy array onto one device of ``sharding``), or None when this JAX lacks it: callers
    then use ``jax.device_put``, which gives the same array. See ``pipeline.place``.
    """
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
    """A cheap hashable key equal for equal ``SingleDeviceSharding``s, or None.

    ``SingleDeviceSharding.__hash__``/``__eq__`` run in Python; its private ``_device`` plus
    the memory kind identify it for a fraction of that. None (no such attribute, or not a
    ``SingleDeviceSharding``): use the sharding itself as the key, which gives the same answers.
    """
    if type(sharding) is not jax.sharding.SingleDeviceSharding:
        return None
    device = getattr(sharding, "_device", None)
    return None if device is None else (device, sharding.memory_kind)


# -- jax._src.distributed.global_state.client (private) --------------------------------------


KV_METHODS = ("key_value_set", "blocking_key_value_get", "key_value_try_get", "key_value_delete")
"""What callers use of the key-value store: ``key_value_set(key, value)``,
``blocking_key_value_get(key, timeout_in_ms)`` (waits until another process set the key),
``key_value_try_get(key)`` and ``key_value_delete(prefix)`` (strings)."""


def _distributed_client() -> Any:
    try:  # jax 0.6-0.10 keep the client here
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


def kv_missing(client: Any) -> str | None:
    """Why ``client`` (``jax.distributed``'s, None before ``jax.distributed.initialize``) cannot
    serve as the key-value store, or None if it can.

    Example::

        assert kv_missing(None).startswith("jax.distributed is not initialized")
    """
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
    """The key-value store of ``jax.distributed`` (the coordination service every process of a
    job is connected to; see :data:`KV_METHODS`), or None when the job is not distributed or
    this JAX hides it."""
    client = _distributed_client()
    return None if kv_missing(client) else client


def require_distributed_kv(purpose: str) -> Any:
    """:func:`distributed_kv`, or a RuntimeError saying that ``purpose`` needs it and what is
    missing.

    Example::

        client = require_distributed_kv("a save to gs://b/ckpt/1/default by 4 processes")
    """
    client = _distributed_client()
    reason = kv_missing(client)
    if reason:
        raise RuntimeError(f"{purpose} needs the key-value store of jax.distributed: {reason}")
    return client


def distributed_kv_try_get(client: Any, key: str) -> str | None:
    """The value of ``key`` in the key-value store ``client`` (:func:`distributed_kv`), or None
    if it is not set. Errors other than a missing key propagate.

    Example::

        failed = distributed_kv_try_get(distributed_kv(), "osf/ckpt/1/failed")
    """
    try:
        return str(client.key_value_try_get(key))
    except Exception as error:
        if "NOT_FOUND" in str(error) or "not found" in str(error).lower():
            return None
        raise


def distributed_kv_delete(client: Any, directory: str) -> None:
    """Deletes every key under ``directory`` + ``/`` (and ``directory`` itself) from the
    key-value store ``client``.

    Example::

        distributed_kv_delete(distributed_kv(), "osf/gs://b/ckpt/1/default/1")
    """
    client.key_value_delete(directory)


# -- jax.sharding.set_mesh (a plain setter on jax 0.7) ----------------------------------------


def plain_set_mesh() -> Callable[[Any], Any] | None:
    """``jax.sharding.set_mesh`` where it is a plain setter returning the previous mesh (jax
    0.7), else None (absent before, a context manager class from jax 0.8 on)."""
    set_mesh = getattr(jax.sharding, "set_mesh", None)
    return None if set_mesh is None or isinstance(set_mesh, type) else set_mesh


@contextlib.contextmanager
def global_mesh_kept() -> Iterator[None]:
    """Restores this thread's global concrete mesh on exit, if the body changed it.

    On jax 0.7 ``jax.sharding.set_mesh`` is a plain setter (it returns the previous mesh; a
    context manager from jax 0.8 on), and orbax-checkpoint 0.11.40 uses it as a context manager
    when it saves a replicated array: the call fails after setting a mesh for the whole thread,
    and every later jit on other devices fails with "incompatible devices". Calls into Orbax's
    own handlers run inside this guard; on other versions it does nothing.

    Example::

        with global_mesh_kept():
            orbax_handler.save(directory, args=args)
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
    """Whether this JAX places arrays of ``dtype`` on its devices. ml_dtypes knows types that
    not every XLA does (the float6 types on jax 0.10's CPU: ``device_put`` raises
    "Unknown NumPy dtype"); probed once per dtype with a one-element array.

    Example::

        device_holds(np.dtype(ml_dtypes.float6_e2m3fn))   # False on jax 0.10.2's CPU
    """
    if dtype.kind in "biufc":  # numpy's own types: always (64-bit ones canonicalised)
        return True
    try:
        jax.block_until_ready(jax.device_put(np.zeros(1, dtype)))
    except Exception:  # (XlaRuntimeError / JaxRuntimeError / TypeError, by version)
        return False
    return True
