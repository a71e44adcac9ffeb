"""Rebuilding a pytree from stored tensors, with or without a target.

Without a target the stored schema gives back the saved containers. With a target, every
target leaf is matched to a stored leaf by its dotted name; all problems (missing, unexpected,
mis-shaped keys) are reported in one error. Target leaves may be arrays, numpy arrays,
``jax.ShapeDtypeStruct`` (with an optional sharding), Python scalars, typed PRNG keys or Orbax
``RestoreArgs``/``ArrayRestoreArgs``, and they mean what they mean to Orbax's
``StandardCheckpointHandler``/``PyTreeCheckpointHandler`` (see :func:`_want`): a
``ShapeDtypeStruct`` without a sharding gives a ``jax.Array`` on the saved sharding if the leaf
was saved as one, else a numpy array of the target's dtype; ``RestoreArgs()`` gives the saved
type; ``restore_type`` is honoured. ``None``, Orbax's ``PLACEHOLDER`` (``...``) and empty nodes
(an optax ``MaskedNode``) skip whatever the checkpoint holds there and come back as given.

Example::

    tree = restore_tree(schema, stored, target=None)
    tree = restore_tree(schema, stored, target=abstract, strict=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import select as _select
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


def is_skip_marker(x: object) -> bool:
    """Whether a target leaf asks for nothing (as Orbax skips it): ``None``, Orbax's
    ``PLACEHOLDER`` (``...``), or an empty node (``{}``, ``[]``, ``()``, an empty NamedTuple such
    as optax's ``MaskedNode``)."""
    if x is None or x is Ellipsis:
        return True
    kind = type(x)
    if kind is dict or kind is list:
        return not x
    return isinstance(x, tuple) and not x


def _target_leaf(x: object) -> bool:
    return is_skip_marker(x) or is_restore_args(x)


def _leaf_of(stored: StoredTensor) -> _tree.SchemaLeaf:
    return _tree.SchemaLeaf(
        stored.name, _tree.LeafKind.TENSOR, _tree.Tensor(stored.name, _tree.ArrayKind.JAX)
    )


@dataclasses.dataclass(slots=True)
class _Want:
    """What one target leaf asks of a stored tensor.

    ``kind`` is "jax", "numpy", "scalar" (a numpy scalar), "python" (``pytype``), "str", or one
    resolved against what was saved: "saved" (Orbax's ``RestoreArgs()``: the saved type) and
    "struct" (a ``ShapeDtypeStruct`` without a sharding: a ``jax.Array`` if saved as one, else a
    numpy array). ``needs_sharding``: restore args asking for a ``jax.Array``, which Orbax
    refuses to make of a host-local save without a sharding.
    """

    kind: str
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    sharding: Any
    key_impl: str | None = None
    pytype: type | None = None
    needs_sharding: bool = False
    resize: bool = False  # an Orbax ArrayRestoreArgs(strict=False): pad or truncate to shape


def restore_args_sharding(leaf: Any) -> Any:
    """The sharding an Orbax ``ArrayRestoreArgs`` asks for (its ``sharding``, converted from
    Orbax's sharding metadata if need be, or a ``NamedSharding`` built from ``mesh`` and
    ``mesh_axes``), else None.

    Raises:
      ValueError: Orbax's sharding metadata that this job's devices cannot reproduce.
    """
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        # Orbax's ShardingMetadata (from item_metadata), known by its method: converted as
        # Orbax converts it.
        to_jax = getattr(sharding, "to_jax_sharding", None)
        if callable(to_jax):
            sharding = to_jax()
    mesh, axes = getattr(leaf, "mesh", None), getattr(leaf, "mesh_axes", None)
    if sharding is None and mesh is not None and axes is not None:
        sharding = jax.sharding.NamedSharding(mesh, axes)
    return sharding


def _want(leaf: Any) -> _Want | None:
    """What a target leaf asks for, with Orbax's meaning (None: a leaf that takes no tensor)."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):  # the common case, first
        sharding = getattr(leaf, "sharding", None)
        kind = "jax" if sharding is not None else "struct"
        if _tree.is_prng_key(leaf):
            return _Want(kind, tuple(leaf.shape), None, sharding, key_impl="?")
        return _Want(kind, tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    if isinstance(leaf, (bool, int, float)):
        return _Want("python", (), None, None, pytype=type(leaf))
    if is_restore_args(leaf):
        shape = getattr(leaf, "global_shape", None)
        shape = tuple(shape) if shape is not None else None
        dtype = getattr(leaf, "dtype", None)
        dtype = np.dtype(dtype) if dtype is not None else None
        restore_type = getattr(leaf, "restore_type", None)
        # Orbax's RestoreArgs name the type to return: numpy arrays and Python scalars stay on
        # the host (as PyTreeRestore returns them); None is the saved type; anything else
        # becomes a jax.Array.
        resize = getattr(leaf, "strict", True) is False
        if isinstance(restore_type, type) and issubclass(restore_type, np.ndarray):
            return _Want("numpy", shape, dtype, None, resize=resize)
        if restore_type in (bool, int, float):
            return _Want("python", (), None, None, pytype=restore_type)
        if restore_type is str:
            return _Want("str", (), None, None)
        sharding = restore_args_sharding(leaf)
        if restore_type is None and sharding is None:
            return _Want("saved", shape, dtype, None, resize=resize)
        return _Want("jax", shape, dtype, sharding, needs_sharding=True, resize=resize)
    if isinstance(leaf, np.ndarray):
        return _Want("numpy", tuple(leaf.shape), leaf.dtype, None)
    if isinstance(leaf, np.generic):
        return _Want("scalar", (), leaf.dtype, None)
    if isinstance(leaf, str):
        return _Want("str", (), None, None)
    return None


def _resolve(kind: str, saved_kind: str) -> str:
    """A want's kind made concrete by the saved leaf's kind ("jax", "numpy", "scalar", or
    "inline" for a Python value kept in the schema)."""
    if kind == "struct":
        return "jax" if saved_kind == "jax" else "numpy"
    if kind == "saved":
        return saved_kind
    return kind


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


# A tensor name -> its saved sharding over this job's devices (None: none saved, the default
# device); raises TargetMismatchError when this job's devices cannot reproduce it.
SavedSharding = Callable[[str], Any]

_INLINE_KINDS = frozenset(("bool", "int", "float", "str"))

# What a key-mismatch error tells the caller (the standalone API's strict governs keys).
KEY_HINT = "pass strict=False to skip them"


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    """How a targeted restore treats shape and key mismatches (see :func:`restore_tree`)."""

    pad_or_truncate: bool = False
    keep_missing: bool = False
    key_hint: str = KEY_HINT
    shape_hint: str = ""
    select: _select.Selection | None = None


def _shape_problem(
    name: str,
    stored: StoredTensor,
    stored_shape: tuple[int, ...],
    want: _Want,
    kind: str,
    options: _Options,
) -> str | None:
    """Why a stored array's shape cannot fill the target's (None: it can, padded or
    truncated to it, as Orbax's ``strict=False`` does)."""
    assert want.shape is not None
    text = (
        f"{name}: checkpoint has shape {stored_shape} ({stored.dtype}), "
        f"target wants {tuple(want.shape)}"
    )
    if not (options.pad_or_truncate or want.resize):
        return f"{text} ({options.shape_hint})" if options.shape_hint else text
    if kind not in ("jax", "numpy"):
        return f"{text}; only arrays can be padded or truncated"
    if len(want.shape) != len(stored_shape):
        return f"{text}; padding or truncating keeps the rank ({len(stored_shape)} dimensions)"
    return None


def pad_or_truncate(value: Any, shape: tuple[int, ...], kind: str, sharding: Any = None) -> Any:
    """``value`` (a host array) cut to ``shape`` and padded with zeros, as Orbax's
    ``strict=False`` restores; a ``jax.Array`` on ``sharding`` for ``kind == "jax"``.

    Example::

        pad_or_truncate(np.ones(3), (5,), "numpy")   # array([1., 1., 1., 0., 0.])
    """
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
        if kind == "jax" and self.leaves.get(leaf.tensor_name, leaf).kind == "key":
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
    saved_sharding: SavedSharding | None = None,
    pad_or_truncate: bool = False,
    keep_missing: bool = False,
    key_hint: str = KEY_HINT,
    shape_hint: str = "",
    select: _select.Selection | None = None,
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
      saved_sharding: where to place a leaf saved as a ``jax.Array`` when the target gives no
        sharding (no target, a ``ShapeDtypeStruct`` without one, ``RestoreArgs()``); None:
        this process's first device.
      pad_or_truncate: an array whose stored shape differs from the target's (same rank) is
        cut to the target's extent and padded with zeros, as Orbax's
        ``StandardRestore(strict=False)`` does; otherwise that is an error.
      keep_missing: without ``strict``, a target leaf missing from the checkpoint is returned
        as given even when abstract (Orbax's ``partial_restore``); otherwise only concrete
        ones are, and an abstract one is an error.
      key_hint: what the key-mismatch error tells the caller to pass to skip keys.
      shape_hint: what a shape-mismatch error tells the caller ("": nothing).
      select: read only the leaves whose dotted names it selects (``core/select.py``).
        Without a target, the selected leaves come back in their saved containers (dicts
        lose unselected entries, lists keep their length with None in unselected places);
        with one, it selects among the target's leaves, and an unselected target leaf comes
        back as given, nothing read for it (as Orbax returns a ``PLACEHOLDER``); in strict
        mode only the selected names must agree. A pattern that matches no name raises.
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
        return _restore_untargeted(schema, leaves, loader, saved_sharding, select)
    options = _Options(pad_or_truncate, keep_missing, key_hint, shape_hint, select)
    return _restore_targeted(target, leaves, loader, strict, saved_sharding, options)


def _restore_untargeted(
    schema: Mapping[str, Any] | None,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: _Loader,
    saved_sharding: SavedSharding | None,
    select: _select.Selection | None = None,
) -> Any:
    slots: dict[str, int] = {}
    shardings: dict[str, Any] = {}
    wanted: Mapping[str, _tree.SchemaLeaf] = leaves
    if select is not None:
        select.check(leaves if schema is None else _tree.selectable_names(schema))
        wanted = {n: leaf for n, leaf in leaves.items() if select.selects(n)}
        if schema is not None:
            schema = _tree.prune_schema(schema, select.selects)
            assert schema is not None  # (check: something is selected)
    for leaf in wanted.values():
        if leaf.kind in ("tensor", "key", "ref"):
            original = leaves.get(leaf.tensor_name, leaf)
            kind = original.node.get("array", "jax") if original.kind == "tensor" else "jax"
            sharding = None
            if kind == "jax" and saved_sharding is not None:
                sharding = saved_sharding(original.name)
                if original.kind == "key":  # saved: the key data's sharding
                    sharding = key_sharding(sharding, len(loader.stored_for(leaf).shape) - 1)
                shardings[leaf.name] = sharding
            slots[leaf.name] = loader.request(leaf, kind, sharding, None)
    values = loader.run()
    finished: dict[int, Any] = {}

    def get(leaf: _tree.SchemaLeaf) -> Any:
        slot = slots[leaf.name]
        if slot not in finished:  # aliases share one object
            finished[slot] = _finish(leaf, leaves, values[slot], shardings.get(leaf.name))
        return finished[slot]

    if schema is None:
        return {name: get(leaf) for name, leaf in wanted.items()}
    return _tree.unflatten(schema, get, leaves)


def _inline_as(name: str, saved: _tree.SchemaLeaf, want: _Want | None) -> Any:
    """A Python value kept in the schema, as ``want`` asks for it (Orbax's ScalarHandler)."""
    value = _tree.inline_value(saved)
    kind = "inline" if want is None or saved.kind == "str" else _resolve(want.kind, "inline")
    if kind in ("inline", "str"):
        return value
    if kind == "python":
        assert want is not None and want.pytype is not None
        return want.pytype(value)
    assert want is not None
    if want.shape not in (None, ()):
        raise TargetMismatchError(
            f"{name}: checkpoint has a Python {saved.kind} (shape ()), target wants "
            f"{tuple(want.shape)}"
        )
    if kind == "scalar":
        assert want.dtype is not None
        return want.dtype.type(value)
    host = np.asarray(value, dtype=want.dtype)
    if kind == "numpy":
        return host
    if want.sharding is None and want.needs_sharding:
        raise TargetMismatchError(_host_local_message(name, f"a Python {saved.kind}"))
    return jax.device_put(host, want.sharding or jax.local_devices()[0])


def _host_local_message(name: str, what: str) -> str:
    return (
        f"{name}: saved as {what} (host-local: no sharding saved), and the restore args ask "
        "for a jax.Array without a sharding; give them a sharding, or restore_type=np.ndarray "
        "(as Orbax requires)"
    )


def _restore_targeted(
    target: Any,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: _Loader,
    strict: bool,
    saved_sharding: SavedSharding | None,
    options: _Options | None = None,
) -> Any:
    options = options or _Options()
    flat = _tree.flatten_target(target, is_leaf=_target_leaf)
    select = options.select
    if select is not None:
        select.check(flat.names, "the restore target")
    missing: list[str] = []
    problems: list[str] = []
    skipped: list[str] = []
    # Per target leaf: ("v", value) for a value known now, ("r", slot) for a value read as it
    # is (the common case), or ("f", slot, saved leaf, sharding of a typed key or None, the
    # Python type to convert to or None).
    plans: list[tuple] = []
    for name, tleaf in zip(flat.names, flat.leaves):
        if select is not None and not select.selects(name):  # as given, nothing read
            plans.append(("v", tleaf))
            continue
        if is_skip_marker(tleaf):  # Orbax skips these: nothing read, the marker returned
            skipped.append(name)
            plans.append(("v", tleaf))
            continue
        try:
            want = _want(tleaf)
        except ValueError as e:  # Orbax's sharding metadata this job cannot reproduce
            problems.append(f"{name}: {e}")
            continue
        saved = leaves.get(name)
        if saved is None:
            concrete = (
                want is not None
                and not isinstance(tleaf, jax.ShapeDtypeStruct)
                and not is_restore_args(tleaf)
            )
            if strict or not (concrete or options.keep_missing):
                missing.append(name)
            plans.append(("v", tleaf))
            continue
        if saved.kind in _INLINE_KINDS:
            try:
                plans.append(("v", _inline_as(name, saved, want)))
            except TargetMismatchError as e:
                problems.append(str(e))
            continue
        if want is None:
            problems.append(
                f"{name}: target leaf of type {type(tleaf).__name__} cannot receive a tensor"
            )
            continue
        plan = _plan_tensor(name, want, saved, leaves, loader, saved_sharding, options)
        if isinstance(plan, str):
            problems.append(plan)
        else:
            plans.append(plan)
    if strict:
        target_names = set(flat.names)
        under = tuple(f"{n}." for n in skipped)
        unexpected = [
            n
            for n in leaves
            if n not in target_names
            and not (under and n.startswith(under))
            and (select is None or select.selects(n))
        ]
    else:
        unexpected = []
    if missing or unexpected or problems:
        raise TargetMismatchError(
            _mismatch_message(missing, unexpected, problems, options.key_hint)
        )
    values = loader.run()
    out: list[Any] = []
    finished: dict[tuple, Any] = {}
    for plan in plans:
        if plan[0] == "v":
            out.append(plan[1])
        elif plan[0] == "r":
            out.append(values[plan[1]])  # the common case: nothing to finish (aliases share it)
        elif plan[0] == "resize":  # read whole on the host, then padded or truncated
            _, slot, shape, kind, sharding = plan
            out.append(pad_or_truncate(values[slot], shape, kind, sharding))
        else:
            _, slot, saved, sharding, pytype = plan
            if pytype is not None:
                out.append(pytype(values[slot].item()))
                continue
            once = (slot, id(sharding))
            if once not in finished:  # aliases share one object
                finished[once] = _finish(saved, leaves, values[slot], sharding)
            out.append(finished[once])
    return flat.rebuild(out)


def _plan_tensor(
    name: str,
    want: _Want,
    saved: _tree.SchemaLeaf,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: _Loader,
    saved_sharding: SavedSharding | None,
    options: _Options,
) -> tuple | str:
    """How to restore one stored tensor into a target leaf: a plan for
    :func:`_restore_targeted`, or the problem that prevents it."""
    if want.kind == "str":
        return f"{name}: target leaf of type str cannot receive a tensor"
    stored = loader.stored_for(saved)
    original = leaves.get(saved.tensor_name, saved)
    is_key = original.kind == "key"
    saved_kind = original.node.get("array", "jax") if original.kind == "tensor" else "jax"
    kind = _resolve(want.kind, saved_kind)
    stored_shape = tuple(stored.shape)
    typed_key = False
    resize_to: tuple[int, ...] | None = None
    if is_key:
        key_shape = stored_shape[:-1]
        if want.key_impl is not None:
            typed_key = True
            if want.shape != key_shape:
                return f"{name}: checkpoint has a PRNG key of shape {key_shape}, target wants {want.shape}"
        elif want.shape is None or want.shape == stored_shape:
            # Restore args, or a target of the key data's shape (what
            # ocp.utils.to_shape_dtype_struct makes of a key): a jax.Array target gives the
            # typed key back, a numpy one its key data, as Orbax does.
            typed_key = kind == "jax"
            if not typed_key:  # the key data itself: still checked to be key data of its impl
                data = jax.ShapeDtypeStruct(stored_shape, _dtypes.to_numpy(stored.dtype))
                jax.eval_shape(lambda: wrap_key(saved.name, data, original.node["impl"]))
        elif want.shape == key_shape:
            return (
                f"{name}: a PRNG key in the checkpoint, an array in the target (give a typed "
                f"key target, or one of the key data's shape {stored_shape})"
            )
        else:
            return (
                f"{name}: checkpoint has a PRNG key of shape {key_shape} (key data "
                f"{stored_shape}, {stored.dtype}), target wants {want.shape}"
            )
    else:
        if want.key_impl is not None:
            return f"{name}: an array in the checkpoint, a PRNG key in the target"
        if want.shape is not None and want.shape != stored_shape:
            problem = _shape_problem(name, stored, stored_shape, want, kind, options)
            if problem is not None:
                return problem
            resize_to = want.shape
    sharding = want.sharding if kind == "jax" else None
    if kind == "jax" and sharding is None:
        if saved_kind != "jax":
            if want.needs_sharding:
                return _host_local_message(name, "a numpy array")
        elif saved_sharding is not None:
            try:
                sharding = saved_sharding(original.name)
            except TargetMismatchError as e:
                return f"{name}: {e}"
            if is_key:  # saved: the key data's sharding
                sharding = key_sharding(sharding, len(stored_shape) - 1)
    dtype = want.dtype
    if typed_key or dtype == _dtypes.to_numpy(stored.dtype):
        dtype = None
    if resize_to is not None:
        return ("resize", loader.request(saved, "numpy", None, dtype), resize_to, kind, sharding)
    read_kind = "numpy" if kind == "python" else kind
    slot = loader.request(saved, read_kind, sharding, dtype)
    if typed_key:
        return ("f", slot, saved, sharding, None)
    if kind == "python":
        return ("f", slot, saved, None, want.pytype)
    return ("r", slot)


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
