"""Rebuilding a pytree from stored tensors, with or without a target.

Without a target the stored schema gives back the saved containers. With a target, every
target leaf is matched to a stored leaf by its dotted name; all problems (missing, unexpected,
mis-shaped keys) are reported in one error. Target leaves may be arrays, numpy arrays,
``jax.ShapeDtypeStruct`` (with an optional sharding), Python scalars, typed PRNG keys or Orbax
``ArrayRestoreArgs``.

Example::

    tree = restore_tree(schema, stored, target=None)
    tree = restore_tree(schema, stored, target=abstract, strict=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SchemaError, TargetMismatchError
from orbax_safetensors._src.pipeline.reader import (
    ReadRequest,
    ReadStats,
    StoredTensor,
    read_tensors,
)

_RESTORE_ARGS_TYPES: dict[type, bool] = {}  # type -> whether its instances are restore args


def is_restore_args(x: object) -> bool:
    # Orbax's ArrayRestoreArgs/RestoreArgs, recognised by shape rather than imported, so the
    # core does not depend on Orbax. Called for every target leaf: the answer is kept per type
    # (dataclass instances always carry their fields).
    kind = type(x)
    known = _RESTORE_ARGS_TYPES.get(kind)
    if known is None:
        known = (
            not isinstance(x, type)
            and dataclasses.is_dataclass(x)
            and hasattr(x, "restore_type")
            and hasattr(x, "dtype")
        )
        if kind is not type:
            _RESTORE_ARGS_TYPES[kind] = known
    return known


def _leaf_of(stored: StoredTensor) -> _tree.SchemaLeaf:
    return _tree.SchemaLeaf(
        stored.name, "tensor", {"t": "tensor", "name": stored.name, "array": "jax"}
    )


@dataclasses.dataclass(slots=True)
class _Want:
    """What one target leaf asks of a stored tensor."""

    kind: str  # "jax" | "numpy" | "scalar" | "python"
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    sharding: Any
    key_impl: str | None = None
    pytype: type | None = None  # for "python": the scalar type to return
    resize: bool = False  # an Orbax ArrayRestoreArgs(strict=False): pad or truncate to shape


def restore_args_sharding(leaf: Any) -> Any:
    """The sharding an Orbax ``ArrayRestoreArgs`` asks for (its ``sharding``, or a
    ``NamedSharding`` built from ``mesh`` and ``mesh_axes``), else None."""
    sharding = getattr(leaf, "sharding", None)
    mesh, axes = getattr(leaf, "mesh", None), getattr(leaf, "mesh_axes", None)
    if sharding is None and mesh is not None and axes is not None:
        sharding = jax.sharding.NamedSharding(mesh, axes)
    return sharding


def _want(leaf: Any) -> _Want | None:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):  # the common case, first
        sharding = getattr(leaf, "sharding", None)
        if _tree.is_prng_key(leaf):
            return _Want("jax", tuple(leaf.shape), None, sharding, key_impl="?")
        return _Want("jax", tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    if isinstance(leaf, (bool, int, float)):
        return _Want("python", (), None, None, pytype=type(leaf))
    if is_restore_args(leaf):
        shape = getattr(leaf, "global_shape", None)
        dtype = getattr(leaf, "dtype", None)
        dtype = np.dtype(dtype) if dtype is not None else None
        restore_type = getattr(leaf, "restore_type", None)
        # Orbax's RestoreArgs name the type to return: numpy arrays and Python scalars stay on
        # the host (as PyTreeRestore returns them); anything else becomes a jax.Array.
        if isinstance(restore_type, type) and issubclass(restore_type, np.ndarray):
            return _Want("numpy", None, dtype, None)
        if restore_type in (bool, int, float):
            return _Want("python", (), None, None, pytype=restore_type)
        return _Want(
            "jax",
            tuple(shape) if shape is not None else None,
            dtype,
            restore_args_sharding(leaf),
            resize=getattr(leaf, "strict", True) is False,
        )
    if isinstance(leaf, np.ndarray):
        return _Want("numpy", tuple(leaf.shape), leaf.dtype, None)
    if isinstance(leaf, np.generic):
        return _Want("scalar", (), leaf.dtype, None)
    return None


# What a key-mismatch error tells the caller (the standalone API's strict governs keys).
KEY_HINT = "pass strict=False to skip them"


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    """How a targeted restore treats shape and key mismatches (see :func:`restore_tree`)."""

    pad_or_truncate: bool = False
    keep_missing: bool = False
    key_hint: str = KEY_HINT
    shape_hint: str = ""


def _shape_problem(
    name: str,
    stored: StoredTensor,
    stored_shape: tuple[int, ...],
    want: _Want,
    is_key: bool,
    options: _Options,
) -> str | None:
    """Why a stored shape cannot fill the target's (None: it can, padded or truncated)."""
    assert want.shape is not None
    text = (
        f"{name}: checkpoint has shape {stored_shape} ({stored.dtype}), "
        f"target wants {tuple(want.shape)}"
    )
    if not (options.pad_or_truncate or want.resize):
        return f"{text} ({options.shape_hint})" if options.shape_hint else text
    if is_key or want.kind not in ("jax", "numpy"):
        return f"{text}; only arrays can be padded or truncated"
    if len(want.shape) != len(stored_shape):
        return f"{text}; padding or truncating keeps the rank ({len(stored_shape)} dimensions)"
    return None


def pad_or_truncate(value: Any, shape: tuple[int, ...], kind: str, sharding: Any = None) -> Any:
    """``value`` (a host array) cut to ``shape`` and padded with zeros, as Orbax's
    ``strict=False`` restores; a ``jax.Array`` on ``sharding`` for ``kind == "jax"``."""
    host = np.asarray(value)
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, host.shape))
    out[common] = host[common]
    if kind != "jax":
        return out
    if sharding is None:
        return jax.device_put(out)
    return jax.make_array_from_callback(shape, sharding, lambda index: out[index])


class _Loader:
    def __init__(
        self,
        leaves: Mapping[str, _tree.SchemaLeaf],
        stored: Mapping[str, StoredTensor],
        verify: bool,
        stats: ReadStats | None,
    ) -> None:
        self.leaves, self.stored, self.verify, self.stats = leaves, stored, verify, stats
        self.requests: list[ReadRequest] = []
        self.slots: dict[tuple, int] = {}

    def stored_for(self, leaf: _tree.SchemaLeaf) -> StoredTensor:
        name = leaf.tensor_name
        if name not in self.stored:
            raise SchemaError(
                f"schema leaf {leaf.name!r} refers to tensor {name!r}, which no file holds"
            )
        return self.stored[name]

    def request(self, leaf: _tree.SchemaLeaf, kind: str, sharding: Any, dtype: Any) -> int:
        stored = self.stored_for(leaf)
        if leaf.kind == "key" or self.leaves.get(leaf.tensor_name, leaf).kind == "key":
            sharding, dtype = None, None  # key data is read plainly, wrapped, then placed
        slot = (stored.name, kind, id(sharding) if sharding is not None else None, str(dtype))
        index = self.slots.get(slot)
        if index is None:
            index = self.slots[slot] = len(self.requests)
            self.requests.append(ReadRequest(stored, kind, sharding, dtype, self.verify))
        return index

    def run(self) -> list[Any]:
        return read_tensors(self.requests, self.stats)


def _finish(
    leaf: _tree.SchemaLeaf, leaves: Mapping[str, _tree.SchemaLeaf], value: Any, sharding: Any = None
) -> Any:
    original = leaves.get(leaf.tensor_name, leaf)
    if original.kind == "key":
        key = wrap_key(leaf.name, value, original.node["impl"])
        return jax.device_put(key, sharding) if sharding is not None else key
    return value


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


def restore_tree(
    schema: Mapping[str, Any] | None,
    stored: Mapping[str, StoredTensor],
    target: Any = None,
    *,
    strict: bool = True,
    verify: bool = True,
    stats: ReadStats | None = None,
    pad_or_truncate: bool = False,
    keep_missing: bool = False,
    key_hint: str = KEY_HINT,
    shape_hint: str = "",
) -> Any:
    """Rebuilds a tree from ``stored`` tensors (see the module docstring).

    Args:
      schema: the stored tree schema, or None for a plain safetensors file (a flat dict).
      stored: every stored tensor by name.
      target: None, or a pytree whose leaves say what to build (and how to place it).
      strict: with a target, missing or unexpected keys are errors; otherwise unexpected keys
        are skipped and missing ones keep the target's value where it is concrete.
      verify: check CRC32C checksums of tensors read whole.
      stats: accumulates bytes read and needed.
      pad_or_truncate: an array whose stored shape differs from the target's (same rank) is
        cut to the target's extent and padded with zeros, as Orbax's
        ``StandardRestore(strict=False)`` does; otherwise that is an error.
      keep_missing: without ``strict``, a target leaf missing from the checkpoint is returned
        as given even when abstract (Orbax's ``partial_restore``); otherwise only concrete
        ones are, and an abstract one is an error.
      key_hint: what the key-mismatch error tells the caller to pass to skip keys.
      shape_hint: what a shape-mismatch error tells the caller ("": nothing).
    """
    if schema is not None:
        leaves = _tree.validate_schema(schema)
        for leaf in leaves.values():  # a damaged file fails whole, whatever the target asks
            if leaf.kind in ("tensor", "key") and leaf.name not in stored:
                raise SchemaError(
                    f"schema leaf {leaf.name!r} refers to tensor {leaf.name!r}, which no file holds"
                )
    else:
        leaves = {name: _leaf_of(s) for name, s in stored.items()}
    loader = _Loader(leaves, stored, verify, stats)
    if target is None:
        return _restore_untargeted(schema, leaves, loader)
    return _restore_targeted(
        target,
        leaves,
        loader,
        strict,
        _Options(pad_or_truncate, keep_missing, key_hint, shape_hint),
    )


def _restore_untargeted(
    schema: Mapping[str, Any] | None, leaves: Mapping[str, _tree.SchemaLeaf], loader: _Loader
) -> Any:
    slots: dict[str, int] = {}
    for leaf in leaves.values():
        if leaf.kind in ("tensor", "key", "ref"):
            original = leaves.get(leaf.tensor_name, leaf)
            kind = original.node.get("array", "jax") if original.kind == "tensor" else "jax"
            slots[leaf.name] = loader.request(leaf, kind, None, None)
    values = loader.run()
    finished: dict[int, Any] = {}

    def get(leaf: _tree.SchemaLeaf) -> Any:
        slot = slots[leaf.name]
        if slot not in finished:  # aliases share one object
            finished[slot] = _finish(leaf, leaves, values[slot])
        return finished[slot]

    if schema is None:
        return {name: get(leaf) for name, leaf in leaves.items()}
    return _tree.unflatten(schema, get, leaves)


def _restore_targeted(
    target: Any,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: _Loader,
    strict: bool,
    options: _Options | None = None,
) -> Any:
    options = options or _Options()
    flat = _tree.flatten_target(target, is_leaf=is_restore_args)
    missing: list[str] = []
    problems: list[str] = []
    matches: list[tuple[str, Any, _Want | None, _tree.SchemaLeaf | None, int | None]] = []
    resized: dict[int, tuple[tuple[int, ...], _Want]] = {}  # match index -> (shape, want)
    for name, tleaf in zip(flat.names, flat.leaves):
        want = _want(tleaf)
        saved = leaves.get(name)
        if saved is None:
            concrete = (
                want is not None
                and not isinstance(tleaf, jax.ShapeDtypeStruct)
                and not is_restore_args(tleaf)
            )
            if strict or not (concrete or options.keep_missing):
                missing.append(name)
            matches.append((name, tleaf, want, None, None))
            continue
        if saved.kind in ("bool", "int", "float", "str"):
            matches.append((name, tleaf, want, saved, None))
            continue
        if want is None:
            problems.append(
                f"{name}: target leaf of type {type(tleaf).__name__} cannot receive a tensor"
            )
            continue
        stored = loader.stored_for(saved)
        original = leaves.get(saved.tensor_name, saved)
        is_key = original.kind == "key"
        stored_shape = stored.shape[: len(stored.shape) - 1] if is_key else stored.shape
        resize_to = None
        if want.shape is not None and want.shape != tuple(stored_shape):
            problem = _shape_problem(name, stored, tuple(stored_shape), want, is_key, options)
            if problem is not None:
                problems.append(problem)
                continue
            resize_to = want.shape
        if (want.key_impl is not None) != is_key:
            problems.append(
                f"{name}: {'a PRNG key' if is_key else 'an array'} in the checkpoint, "
                f"{'a PRNG key' if want.key_impl else 'an array'} in the target"
            )
            continue
        kind = "numpy" if want.kind == "python" else want.kind
        dtype = (
            want.dtype
            if want.dtype is not None and want.dtype != _dtypes.to_numpy(stored.dtype)
            else None
        )
        if resize_to is not None:  # read whole on the host; padded and placed below
            resized[len(matches)] = (resize_to, want)
            matches.append((name, tleaf, want, saved, loader.request(saved, "numpy", None, dtype)))
            continue
        matches.append(
            (name, tleaf, want, saved, loader.request(saved, kind, want.sharding, dtype))
        )
    target_names = set(flat.names)
    unexpected = [n for n in leaves if n not in target_names] if strict else []
    if missing or unexpected or problems:
        raise TargetMismatchError(
            _mismatch_message(missing, unexpected, problems, options.key_hint)
        )
    values = loader.run()
    out: list[Any] = []
    finished: dict[int, Any] = {}
    for _name, tleaf, want, saved, slot in matches:
        if saved is None:
            out.append(tleaf)
        elif slot is None:
            out.append(_tree.inline_value(saved))
        elif want is not None and want.kind == "jax" and saved.kind == "tensor":
            out.append(values[slot])  # the common case: nothing to finish (aliases share it)
        else:
            if slot not in finished:
                finished[slot] = _finish(
                    saved, leaves, values[slot], want.sharding if want else None
                )
            value = finished[slot]
            if want is not None and want.kind == "python":
                value = (want.pytype or type(tleaf))(value.item())
            out.append(value)
    for index, (shape, want) in resized.items():
        out[index] = pad_or_truncate(out[index], shape, want.kind, want.sharding)
    return flat.rebuild(out)


def _mismatch_message(
    missing: list[str], unexpected: list[str], problems: list[str], key_hint: str = KEY_HINT
) -> str:
    parts = ["the checkpoint does not match the restore target:"]
    if missing:
        parts.append(f"  missing from the checkpoint ({len(missing)}): {', '.join(missing[:50])}")
    if unexpected:
        parts.append(
            f"  in the checkpoint but not the target ({len(unexpected)}): {', '.join(unexpected[:50])}"
            f" ({key_hint})"
        )
    parts.extend(f"  {p}" for p in problems[:50])
    return "\n".join(parts)
