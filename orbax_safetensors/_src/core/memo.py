"""Facts about shardings, worked out once per sharding during one pass over many arrays.

A tree of 10,000 small arrays has a handful of distinct shardings, but often 10,000 sharding
objects (arrays created one by one each get their own, equal to the others). Asking each one
``device_set`` or ``is_fully_addressable`` costs microseconds of Python per array; so does the
``__eq__`` a dict lookup by value runs. :class:`ShardingMemo` looks a sharding up by identity
first (free), then by value, and only then computes.

Example::

    on_one_device = ShardingMemo(lambda s: len(s.device_set) == 1)
    flags = [on_one_device(x.sharding) for x in arrays]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat

T = TypeVar("T")
_SINGLE = jax.sharding.SingleDeviceSharding


class ShardingMemo(Generic[T]):
    """Memoises ``fn(sharding)`` for the lifetime of this object (meant for one pass).

    Entries keep their sharding alive, so an id seen here is never reused by another object
    while the memo lives.
    """

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self._fn = fn
        self._by_id: dict[int, tuple[Any, T]] = {}
        self._by_value: dict[Any, T] = {}

    def __call__(self, sharding: Any) -> T:
        hit = self._by_id.get(id(sharding))
        if hit is not None:
            return hit[1]
        # A SingleDeviceSharding equals another on the same device and memory kind; keyed on
        # those directly, the lookup skips its Python __hash__ and __eq__. Without that key
        # (see _src/compat/jaxcompat.py), the sharding itself is the key: the same answers, a little slower.
        single = _jaxcompat.single_device_key(sharding)
        key = sharding if single is None else (_SINGLE, *single)
        try:
            value = self._by_value[key]
        except KeyError:
            value = self._by_value[key] = self._fn(sharding)
        except TypeError:  # unhashable: identity only
            value = self._fn(sharding)
        self._by_id[id(sharding)] = (sharding, value)
        return value
