"""One target leaf against one stored leaf: what to read and what to make of it.

:func:`leaf_request` says what a target leaf asks for (a :class:`.restore_options.LeafRequest`),
:func:`plan_tensor` how a stored tensor fills it (a plan: :class:`Known`, :class:`Read`,
:class:`Resize` or :class:`Finish`) or the :class:`~.core.errors.Mismatch` that prevents it,
and :func:`inline_as` what a Python value kept in the schema becomes.

Example::

    request = leaf_request(jax.ShapeDtypeStruct((3,), jnp.float32))
    plan = plan_tensor("w", request, saved, leaves, loader, saved_sharding, pad=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    Mismatch,
    MismatchKind,
    SchemaError,
    TargetMismatchError,
)
from orbax_safetensors._src.core.schema import ArrayKind, PrngKey, Tensor
from orbax_safetensors._src.pipeline.reader import ReadKind, StoredTensor
from orbax_safetensors._src.pipeline.restore_options import Build, LeafRequest

# A tensor name -> its saved sharding over this job's devices (None: none saved, the default
# device); raises TargetMismatchError when this job's devices cannot reproduce it.
SavedSharding = Callable[[str], Any]


class Loader(Protocol):
    """Collects read requests (see ``tree_restore``); gives each a slot in the results."""

    def stored_for(self, leaf: _tree.SchemaLeaf) -> StoredTensor: ...

    def request(self, leaf: _tree.SchemaLeaf, kind: ReadKind, sharding: Any, dtype: Any) -> int: ...


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True, slots=True)
class Known:
    """A value known without reading (a skipped leaf, an inline value)."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """The value read into ``slot``, as it is (the common case)."""

    slot: int


@dataclasses.dataclass(frozen=True, slots=True)
class Resize:
    """The tensor read whole on the host into ``slot``, then cut and padded to ``shape``."""

    slot: int
    shape: tuple[int, ...]
    build: Build
    sharding: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """The value in ``slot`` wrapped as a typed PRNG key (placed on ``sharding``) or converted
    to the Python type ``pytype``."""

    slot: int
    saved: _tree.SchemaLeaf
    sharding: Any = None
    pytype: type | None = None


Plan = Known | Read | Resize | Finish


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True, slots=True)
class _Key:
    """A typed PRNG key target: its shape, and where it goes."""

    shape: tuple[int, ...]
    sharding: Any


def leaf_request(leaf: Any) -> LeafRequest | _Key | None:
    """What a target leaf asks for (None: a leaf that cannot take a tensor).

    A ``jax.Array`` or ``jax.ShapeDtypeStruct`` asks for a ``jax.Array`` of its shape and
    dtype, on its sharding; without one, as saved (a numpy array if saved as one). A typed
    PRNG key asks for a typed key. Numpy arrays, numpy scalars and Python scalars ask for
    their own kind.
    """
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):  # the common case, first
        sharding = getattr(leaf, "sharding", None)
        if _tree.is_prng_key(leaf):
            return _Key(tuple(leaf.shape), sharding)
        build = Build.JAX if sharding is not None else Build.SAVED_ARRAY
        return LeafRequest(build, tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    if isinstance(leaf, LeafRequest):
        return leaf
    if isinstance(leaf, (bool, int, float)):
        return LeafRequest(Build.PYTHON, (), pytype=type(leaf))
    if isinstance(leaf, np.ndarray):
        return LeafRequest(Build.NUMPY, tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, np.generic):
        return LeafRequest(Build.SCALAR, (), leaf.dtype)
    if isinstance(leaf, str):
        return LeafRequest(Build.STR, ())
    return None


def resolve(build: Build, saved_kind: ArrayKind | None) -> Build:
    """``build`` made concrete by the saved leaf's kind: its :class:`ArrayKind`, or None for
    a Python value kept in the schema."""
    if build is Build.SAVED_ARRAY:
        return Build.JAX if saved_kind is ArrayKind.JAX else Build.NUMPY
    if build is Build.SAVED:
        return _SAVED_BUILDS[saved_kind]
    return build


_SAVED_BUILDS: dict[ArrayKind | None, Build] = {
    ArrayKind.JAX: Build.JAX,
    ArrayKind.NUMPY: Build.NUMPY,
    ArrayKind.SCALAR: Build.SCALAR,
    None: Build.SAVED,  # an inline value as it is
}


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


def wrap_key(name: str, data: Any, impl: str) -> Any:
    """``jax.random.wrap_key_data`` for a stored key, raising ``SchemaError`` on forged data.

    Works on ``jax.ShapeDtypeStruct`` inside ``jax.eval_shape`` too (checks without reading).
    """
    try:
        return jax.random.wrap_key_data(data, impl=impl)
    except (TypeError, ValueError) as e:
        reason = str(e).split(" for impl=")[0]
        raise SchemaError(
            f"PRNG key {name!r}: stored {data.dtype}{list(data.shape)} is not key data of "
            f"impl {impl!r} ({reason})"
        ) from None


def pad_or_truncate(value: Any, shape: tuple[int, ...], build: Build, sharding: Any = None) -> Any:
    """``value`` (a host array) cut to ``shape`` and padded with zeros, as Orbax's
    ``strict=False`` restores; a ``jax.Array`` on ``sharding`` for ``Build.JAX``.

    Example::

        pad_or_truncate(np.ones(3), (5,), Build.NUMPY)   # array([1., 1., 1., 0., 0.])
    """
    host = np.asarray(value)
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, host.shape))
    out[common] = host[common]
    if build is not Build.JAX:
        return out
    if sharding is None:
        return jax.device_put(out)
    return jax.make_array_from_callback(shape, sharding, lambda index: out[index])


def host_local_message(what: str) -> str:
    return (
        f"saved as {what} (host-local: no sharding saved), and the target asks for a "
        "jax.Array without a sharding; give it a sharding, or ask for a numpy array "
        "(as Orbax requires)"
    )


# --------------------------------------------------------------------------- planning


def _kind(name: str, detail: str) -> Mismatch:
    return Mismatch(name, MismatchKind.KIND, detail)


def inline_as(name: str, saved: _tree.SchemaLeaf, want: LeafRequest | _Key | None) -> Any:
    """A Python value kept in the schema, as ``want`` asks for it (Orbax's ScalarHandler).

    Raises:
      TargetMismatchError: carrying the one mismatch.
    """
    value = _tree.inline_value(saved)
    if want is None or saved.kind == "str":
        return value
    if isinstance(want, _Key):
        raise TargetMismatchError(
            "", [_kind(name, "a Python value in the checkpoint, a PRNG key in the target")]
        )
    build = resolve(want.build, None)  # an inline value
    if build in (Build.SAVED, Build.STR):
        return value
    if build is Build.PYTHON:
        assert want.pytype is not None
        return want.pytype(value)
    if want.shape not in (None, ()):
        detail = (
            f"checkpoint has a Python {saved.kind} (shape ()), target wants {tuple(want.shape)}"
        )
        raise TargetMismatchError(
            "", [Mismatch(name, MismatchKind.SHAPE, detail, saved=(), wanted=want.shape)]
        )
    if build is Build.SCALAR:
        assert want.dtype is not None
        return want.dtype.type(value)
    host = np.asarray(value, dtype=want.dtype)
    if build is Build.NUMPY:
        return host
    if want.sharding is None and want.needs_sharding:
        raise TargetMismatchError("", [_kind(name, host_local_message(f"a Python {saved.kind}"))])
    return jax.device_put(host, want.sharding or jax.local_devices()[0])


def plan_tensor(
    name: str,
    want: LeafRequest | _Key,
    saved: _tree.SchemaLeaf,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: Loader,
    saved_sharding: SavedSharding | None,
    pad: bool,
) -> Plan | Mismatch:
    """How to restore one stored tensor into a target leaf, or the mismatch that prevents
    it. ``pad``: the restore pads or truncates shapes (``RestoreOptions.pad_or_truncate``)."""
    if isinstance(want, LeafRequest) and want.build is Build.STR:
        return _kind(name, "target leaf of type str cannot receive a tensor")
    stored = loader.stored_for(saved)
    original = leaves.get(saved.tensor_name, saved)
    node = original.node
    is_key = type(node) is PrngKey
    impl = node.impl if type(node) is PrngKey else ""
    saved_kind = node.array if type(node) is Tensor else ArrayKind.JAX
    stored_shape = tuple(stored.shape)
    typed_key = False
    resize_to: tuple[int, ...] | None = None
    if isinstance(want, _Key):
        build, wanted_sharding, dtype = Build.JAX, want.sharding, None
        if not is_key:
            return _kind(name, "an array in the checkpoint, a PRNG key in the target")
        typed_key = True
        if want.shape != stored_shape[:-1]:
            return Mismatch(
                name,
                MismatchKind.SHAPE,
                f"checkpoint has a PRNG key of shape {stored_shape[:-1]}, target wants {want.shape}",
                saved=stored_shape[:-1],
                wanted=want.shape,
            )
    else:
        build = resolve(want.build, saved_kind)
        wanted_sharding, dtype = want.sharding, want.dtype
        if is_key:
            key_shape = stored_shape[:-1]
            if want.shape is None or want.shape == stored_shape:
                # Restore args, or a target of the key data's shape (what
                # ocp.utils.to_shape_dtype_struct makes of a key): a jax.Array target gives
                # the typed key back, a numpy one its key data, as Orbax does.
                typed_key = build is Build.JAX
                if not typed_key:  # the key data itself: still checked to be key data
                    data = jax.ShapeDtypeStruct(stored_shape, _dtypes.to_numpy(stored.dtype))
                    jax.eval_shape(lambda: wrap_key(saved.name, data, impl))
            elif want.shape == key_shape:
                return _kind(
                    name,
                    "a PRNG key in the checkpoint, an array in the target (give a typed key "
                    f"target, or one of the key data's shape {stored_shape})",
                )
            else:
                return Mismatch(
                    name,
                    MismatchKind.SHAPE,
                    f"checkpoint has a PRNG key of shape {key_shape} (key data "
                    f"{stored_shape}, {stored.dtype}), target wants {want.shape}",
                    saved=key_shape,
                    wanted=want.shape,
                )
        elif want.shape is not None and want.shape != stored_shape:
            problem = _shape_problem(name, stored, want, build, pad or want.pad_or_truncate)
            if problem is not None:
                return problem
            resize_to = want.shape
    sharding = wanted_sharding if build is Build.JAX else None
    if build is Build.JAX and sharding is None:
        if saved_kind is not ArrayKind.JAX:
            if isinstance(want, LeafRequest) and want.needs_sharding:
                return _kind(name, host_local_message("a numpy array"))
        elif saved_sharding is not None:
            try:
                sharding = saved_sharding(original.name)
            except TargetMismatchError as e:
                return Mismatch(name, MismatchKind.SHARDING, str(e))
            if is_key:  # saved: the key data's sharding
                sharding = key_sharding(sharding, len(stored_shape) - 1)
    if typed_key or dtype == _dtypes.to_numpy(stored.dtype):
        dtype = None
    if resize_to is not None:
        return Resize(
            loader.request(saved, ReadKind.NUMPY, None, dtype), resize_to, build, sharding
        )
    read_kind = ReadKind.NUMPY if build is Build.PYTHON else ReadKind(build.value)
    slot = loader.request(saved, read_kind, sharding, dtype)
    if typed_key:
        return Finish(slot, saved, sharding)
    if build is Build.PYTHON:
        assert isinstance(want, LeafRequest)
        return Finish(slot, saved, None, want.pytype)
    return Read(slot)


def _shape_problem(
    name: str, stored: StoredTensor, want: LeafRequest, build: Build, pad: bool
) -> Mismatch | None:
    """Why a stored array's shape cannot fill the target's (None: it can, padded or
    truncated to it, as Orbax's ``strict=False`` does)."""
    assert want.shape is not None
    stored_shape = tuple(stored.shape)
    text = f"checkpoint has shape {stored_shape} ({stored.dtype}), target wants {want.shape}"

    def problem(detail: str, resizable: bool = False) -> Mismatch:
        return Mismatch(
            name,
            MismatchKind.SHAPE,
            detail,
            saved=stored_shape,
            wanted=want.shape,
            resizable=resizable,
        )

    if not pad:
        resizable = build in (Build.JAX, Build.NUMPY) and len(want.shape) == len(stored_shape)
        return problem(text, resizable)
    if build not in (Build.JAX, Build.NUMPY):
        return problem(f"{text}; only arrays can be padded or truncated")
    if len(want.shape) != len(stored_shape):
        return problem(
            f"{text}; padding or truncating keeps the rank ({len(stored_shape)} dimensions)"
        )
    return None
