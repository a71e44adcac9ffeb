"""Save-time dtype policies: the dtype each tensor is stored in, from its dotted name and leaf.

A policy (the ``dtype=`` argument of ``save_file``, ``SafetensorsSave``, ``save_model`` and
``convert``) is one of:

- one dtype: every floating-point array is stored in it; other arrays keep their dtype;
  ``None`` or ``"keep"``: every array keeps its dtype;
- a mapping of glob patterns (``fnmatch``, over dotted names) to a dtype or ``None`` /
  ``"keep"`` (keep the dtype); the first pattern that matches wins, a name no pattern matches keeps its dtype;
- a callable ``(dotted_name, leaf) -> dtype | None | "keep"``.

:func:`parse_policy` checks a policy before anything is written; :func:`resolve` gives each
tensor's stored dtype (pure: names, dtypes and shapes in, dtypes out). The schema records each
cast tensor's original safetensors dtype under :data:`CAST_FROM` of its tensor node. This
module knows nothing of files or Orbax; the pipeline casts tensor by tensor as it writes.

Example::

    policy = parse_policy({"*.kernel": "bfloat16", "*": None})
    resolve(policy, ["l.kernel", "l.bias"], [np.dtype("float32")] * 2, [(2, 2), (2,)], [x, b])
    # [dtype(bfloat16), None]
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import UnsupportedLeafError

# The schema key of a cast tensor's node holding its dtype before the cast (a safetensors
# dtype string). Absent on tensors stored in their own dtype and in files written before it.
CAST_FROM = "cast_from"

# What a dtype may be given as: a numpy / ml_dtypes / jax.numpy dtype or scalar type, a numpy
# name ("bfloat16", "float16") or a safetensors name ("BF16").
DTypeLike = Any
# A dtype policy: DTypeLike, Mapping[str, DTypeLike | None] or
# Callable[[str, leaf], DTypeLike | None] (Any: DTypeLike takes every value already).
DtypePolicy = Any


@dataclasses.dataclass(frozen=True)
class Policy:
    """A checked dtype policy: exactly one of ``single``, ``patterns`` or ``fn`` is set."""

    single: np.dtype | None = None
    patterns: tuple[tuple[str, np.dtype | None], ...] | None = None
    fn: Callable[[str, Any], Any] | None = None

    def describe(self) -> str:
        if self.single is not None:
            return f"dtype={self.single}"
        if self.patterns is not None:
            return f"dtype={{{', '.join(f'{p!r}: {d}' for p, d in self.patterns)}}}"
        return f"dtype={getattr(self.fn, '__name__', 'callable')}"


def to_dtype(value: DTypeLike, where: str) -> np.dtype:
    """``value`` as a numpy dtype that safetensors can store.

    Raises:
      ValueError: naming ``where`` when ``value`` is no dtype, or one safetensors lacks.
    """
    dt: np.dtype | None = None
    if isinstance(value, str):
        if _dtypes.is_known(value):
            dt = _dtypes.to_numpy(value)
        elif isinstance(getattr(ml_dtypes, value, None), type):
            dt = np.dtype(getattr(ml_dtypes, value))
    if dt is None:
        try:
            dt = np.dtype(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: {value!r} is not a dtype (give e.g. jnp.bfloat16, 'float16' or 'BF16')"
            ) from None
    try:
        _dtypes.from_numpy(dt)
    except UnsupportedLeafError:
        raise ValueError(
            f"{where}: safetensors cannot store dtype {dt} (supported: "
            f"{', '.join(_dtypes.SAFETENSORS_DTYPES)})"
        ) from None
    return dt


def _is_dtype_like(value: object) -> bool:
    # A jax.numpy scalar type (jnp.bfloat16) is callable but has a dtype; a numpy scalar type
    # (np.float16) is a type; a function or lambda is neither.
    return isinstance(value, (str, np.dtype, type)) or hasattr(value, "dtype")


def parse_policy(policy: DtypePolicy | Policy | None) -> Policy | None:
    """Checks a dtype policy (see the module docstring); None for no policy.

    Raises:
      ValueError: naming the pattern or value that is not a dtype, a single dtype that is not
        floating-point, or a pattern that is not a non-empty string.
      TypeError: for a policy of none of the accepted kinds.
    """
    if policy is None or isinstance(policy, Policy):
        return policy
    if _is_keep(policy):
        return None
    if isinstance(policy, Mapping):
        patterns = []
        for pattern, value in policy.items():
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(
                    f"dtype policy pattern {pattern!r}: patterns are non-empty glob strings "
                    "over dotted names, e.g. '*.kernel'"
                )
            dt = None if _is_keep(value) else to_dtype(value, f"dtype policy pattern {pattern!r}")
            patterns.append((pattern, dt))
        return Policy(patterns=tuple(patterns))
    if callable(policy) and not _is_dtype_like(policy):
        return Policy(fn=policy)
    dt = to_dtype(policy, "dtype")
    if not _is_floating(dt):
        raise ValueError(
            f"dtype={dt}: a single dtype applies to floating-point arrays and must be one "
            "(e.g. bfloat16); to cast other arrays, map their names: {'*.ids': 'int32'}"
        )
    return Policy(single=dt)


def _is_keep(value: object) -> bool:
    # None or "keep" (any case): the tensor keeps its dtype.
    return value is None or (isinstance(value, str) and value.lower() == "keep")


def _is_floating(dt: np.dtype) -> bool:
    return bool(np.issubdtype(dt, np.floating)) or dt in _ML_FLOATS


# ml_dtypes' float types (bfloat16, float8_*, float4/6) subclass np.floating in current
# releases; listed too in case an older release does not.
_ML_FLOATS = frozenset(
    _dtypes.to_numpy(n) for n in _dtypes.SAFETENSORS_DTYPES if n.startswith(("F", "BF"))
)


def resolve(
    policy: Policy | None,
    names: Sequence[str],
    dtypes: Sequence[Any],
    shapes: Sequence[tuple[int, ...]],
    leaves: Sequence[Any],
    *,
    keys: frozenset[int] = frozenset(),
) -> list[np.dtype | None]:
    """The dtype each tensor is stored in, or None where it keeps its own.

    Args:
      policy: :func:`parse_policy`'s result.
      names, dtypes, shapes: each stored tensor's dotted name, dtype and shape.
      leaves: each stored tensor's value (passed to a callable policy).
      keys: positions of typed PRNG keys (their key data is never cast).

    Raises:
      UnsupportedLeafError: naming the tensor when a callable returns no dtype, or a cast asks
        for what cannot be stored: a PRNG key, a complex array to a real dtype, a sub-byte
        dtype that does not fill whole bytes.
    """
    out: list[np.dtype | None] = [None] * len(names)
    if policy is None:
        return out
    for i, (name, dtype) in enumerate(zip(names, dtypes)):
        current = np.dtype(dtype)
        want: np.dtype | None
        if policy.single is not None:
            if i in keys or not _is_floating(current):
                continue
            want = policy.single
        elif policy.patterns is not None:
            want = next((d for p, d in policy.patterns if fnmatch.fnmatchcase(name, p)), None)
        else:
            assert policy.fn is not None
            value = policy.fn(name, leaves[i])
            want = None if _is_keep(value) else _leaf_dtype(value, name)
        if want is None or want == current:
            continue
        _check_cast(name, current, want, shapes[i], i in keys)
        out[i] = want
    return out


def _leaf_dtype(value: Any, name: str) -> np.dtype:
    try:
        return to_dtype(value, f"the dtype policy's answer for {name!r}")
    except ValueError as e:
        raise UnsupportedLeafError(str(e)) from None


def _check_cast(
    name: str, current: np.dtype, want: np.dtype, shape: tuple[int, ...], is_key: bool
) -> None:
    if is_key:
        raise UnsupportedLeafError(
            f"leaf {name!r} is a PRNG key: its key data cannot be cast to {want}; leave it out "
            "of the dtype policy"
        )
    if current.kind == "c" and want.kind != "c":
        raise UnsupportedLeafError(
            f"leaf {name!r} ({current}{list(shape)}) is complex: casting it to {want} would drop "
            "its imaginary part"
        )
    try:
        _dtypes.nbytes(_dtypes.from_numpy(want), shape)
    except UnsupportedLeafError as e:
        raise UnsupportedLeafError(f"leaf {name!r} cast to {want}: {e}") from None


def stored_specs(
    arrays: Mapping[str, Any], casts: Sequence[np.dtype | None]
) -> list[_plan.TensorSpec]:
    """The tensor specs of ``arrays`` (a flat tree's) stored under ``casts`` (see
    :func:`apply_policy`): each array's own dtype where its cast is None."""
    return _plan.specs_of(
        (name, a.dtype if want is None else want, a.shape)
        for (name, a), want in zip(arrays.items(), casts)
    )


def apply_policy(
    captured: _tree.CapturedTree, policy: Policy | None
) -> tuple[_tree.FlatTree, list[np.dtype | None]]:
    """Names ``captured`` (:meth:`~.tree.CapturedTree.finish`) and resolves ``policy`` over its
    stored arrays: ``(flat tree, stored dtype or None for each of flat.arrays)``. Each cast
    tensor's schema node records its original dtype under :data:`CAST_FROM`.

    Raises:
      UnsupportedLeafError: see :func:`resolve`.
    """
    flat = captured.finish()
    if policy is None:
        return flat, [None] * len(flat.arrays)
    key = _tree.LeafKind.KEY
    keys = frozenset(i for i, kind in enumerate(captured.stored_kinds()) if kind is key)
    casts = resolve(
        policy, list(flat.arrays), captured.dtypes, captured.shapes, captured.arrays, keys=keys
    )
    if any(want is not None for want in casts):
        flat = captured.finish(
            cast_from=[
                None if want is None else _dtypes.from_numpy(dtype)
                for dtype, want in zip(captured.dtypes, casts)
            ]
        )
    return flat, casts
