"""What a restore is asked, in neutral terms: one frozen :class:`RestoreOptions` from the API
adapters to ``restore_plan.restore_tree``, and the wording of its mismatch errors
(:class:`Words`). Target leaves: arrays, ``ShapeDtypeStruct``s, numpy and Python scalars and
strings (each asking for its own kind), ``None`` and empty nodes (returned as given),
:class:`LeafRequest`, :class:`Skip`; Orbax's restore args and ``...`` are translated into the
last two (:func:`neutral_target`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.compat import orbaxargs as _orbaxargs
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import Mismatch, MismatchKind, TargetMismatchError
from orbax_safetensors._src.storage import config as _config


class Build(enum.Enum):
    """What a target leaf asks to be built from the stored tensor at its name."""

    JAX = "jax"  # a jax.Array (on the request's sharding, else the saved one)
    NUMPY = "numpy"  # a numpy array
    SCALAR = "scalar"  # a numpy scalar
    PYTHON = "python"  # a Python bool, int or float (``pytype``)
    STR = "str"  # a Python string (kept in the schema; no tensor can fill it)
    SAVED = "saved"  # whatever kind was saved
    SAVED_ARRAY = "saved_array"  # a jax.Array if saved as one, else a numpy array


@dataclasses.dataclass(frozen=True, slots=True)
class LeafRequest:
    """A target leaf spelled out: what to build, the shape the stored tensor must have and the
    dtype to cast to (None: as stored), where a ``jax.Array`` goes (None: the saved sharding)."""

    build: Build = Build.SAVED
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    sharding: Any = None
    pytype: type | None = None  # for Build.PYTHON
    # A jax.Array asked for explicitly: one saved host-local has no sharding to fall back to.
    needs_sharding: bool = False
    pad_or_truncate: bool = False  # this leaf, whatever the restore's own setting
    given: Any = None  # what a partial restore returns when the checkpoint lacks this key


@dataclasses.dataclass(frozen=True, slots=True)
class Skip:
    """A target leaf that reads nothing: the result holds ``value``. Unlike ``None`` or an
    empty node, it may also stand where the checkpoint has nothing."""

    value: Any = None


class Keys(enum.Enum):
    """How a targeted restore treats keys in one of the target and the checkpoint only."""

    EXACT = "exact"  # any such key is an error
    PARTIAL = "partial"  # only the target's keys; a target key the checkpoint lacks: as given
    LENIENT = "lenient"  # stored keys the target lacks are skipped; a missing target key
    # keeps the target's value where it is concrete (an array), else is an error


@dataclasses.dataclass(frozen=True)
class RestoreOptions:
    """Everything a restore is asked, in one value."""

    target: Any = None  # None (the saved tree) or a pytree of target leaves
    keys: Keys = Keys.EXACT
    pad_or_truncate: bool = False  # a stored array of another shape (same rank) cut and padded
    select: _select.Selection | None = None  # None: every name
    verify: bool = True  # each tensor read whole checked against its CRC32C
    # Where an array goes whose saved sharding these devices cannot rebuild and whose target
    # gives none (None: an error).
    fallback_sharding: jax.sharding.Sharding | None = None
    io: _config.IOOptions | None = None

    @classmethod
    def standalone(
        cls,
        target: Any = None,
        *,
        strict: bool = True,
        include: _select.Patterns = None,
        exclude: _select.Patterns = None,
        verify: bool = True,
        fallback_sharding: jax.sharding.Sharding | None = None,
        io: _config.IOOptions | None = None,
    ) -> RestoreOptions:
        """The options of ``load_file`` / ``restore_directory`` (``strict`` governs keys)."""
        return cls(
            neutral_target(target),
            keys=Keys.EXACT if strict else Keys.LENIENT,
            select=_select.Selection.of(include, exclude),
            verify=verify,
            fallback_sharding=fallback_sharding,
            io=io,
        )


# --------------------------------------------------------------------------- Orbax's leaves


def neutral_leaves(
    names: Sequence[str], leaves: Sequence[Any], givens: Sequence[Any] | None = None
) -> list[Any]:
    """``leaves`` with Orbax's restore args made :class:`LeafRequest` (given back as
    ``givens[i]``, else the args) and ``...`` made :class:`Skip`; a ``TargetMismatchError``
    names every leaf whose sharding metadata cannot be rebuilt here."""
    out: list[Any] = []
    problems: list[Mismatch] = []
    for i, (name, x) in enumerate(zip(names, leaves)):
        if x is ...:
            out.append(Skip(x))
        elif not _orbaxargs.is_restore_args(x):
            out.append(x)
        else:
            given = givens[i] if givens is not None and givens[i] is not None else x
            try:
                fields = _orbaxargs.restore_args_request(x)
            except ValueError as e:
                problems.append(Mismatch(name, MismatchKind.SHARDING, str(e)))
                out.append(None)
                continue
            out.append(LeafRequest(Build(fields.pop("build")), **fields, given=given))
    if problems:
        raise TargetMismatchError(mismatch_message(problems), problems)
    return out


def neutral_target(target: Any) -> Any:
    """``target`` with Orbax's leaves translated (:func:`neutral_leaves`); the same object
    when it has none."""
    is_args = _orbaxargs.is_restore_args
    if target is None or not any(
        x is ... or is_args(x) for x in jax.tree_util.tree_leaves(target, is_leaf=is_args)
    ):
        return target
    flat = _tree.flatten_target(target, is_leaf=is_args)
    return flat.rebuild(neutral_leaves(flat.names, flat.leaves))


# --------------------------------------------------------------------------- wording


@dataclasses.dataclass(frozen=True)
class Words:
    """How an API tells its caller to resolve mismatches, in its own option names."""

    keys: str = ""  # after keys the target lacks and structure mismatches
    missing: str = ""  # after target keys the checkpoint lacks
    shape: str = ""  # after a shape mismatch that padding or truncating would resolve


STANDALONE_WORDS = Words(keys="pass strict=False to skip them")

_LIMIT = 50  # keys listed per line


def mismatch_message(mismatches: Sequence[Mismatch], words: Words = STANDALONE_WORDS) -> str:
    """The message of a :class:`TargetMismatchError` listing ``mismatches`` in ``words``."""
    missing = [m.key for m in mismatches if m.kind is MismatchKind.MISSING]
    unexpected = [m.key for m in mismatches if m.kind is MismatchKind.UNEXPECTED]
    parts = ["the checkpoint does not match the restore target:"]
    if missing:
        hint = f" ({words.missing})" if words.missing else ""
        parts.append(
            f"  missing from the checkpoint ({len(missing)}): {', '.join(missing[:_LIMIT])}{hint}"
        )
    if unexpected:
        hint = f" ({words.keys})" if words.keys else ""
        parts.append(
            f"  in the checkpoint but not the target ({len(unexpected)}): "
            f"{', '.join(unexpected[:_LIMIT])}{hint}"
        )
    others = [
        m for m in mismatches if m.kind not in (MismatchKind.MISSING, MismatchKind.UNEXPECTED)
    ]
    for m in others[:_LIMIT]:
        hint = ""
        if m.kind is MismatchKind.SHAPE and m.resizable and words.shape:
            hint = f" ({words.shape})"
        elif m.kind is MismatchKind.STRUCTURE and words.keys:
            hint = f" ({words.keys})"
        parts.append(f"  {m.key}: {m.detail}{hint}")
    return "\n".join(parts)


def reworded(error: TargetMismatchError, words: Words) -> TargetMismatchError:
    """``error`` with its mismatches worded in ``words`` (itself when it lists none)."""
    if not error.mismatches:
        return error
    return TargetMismatchError(mismatch_message(error.mismatches, words), error.mismatches)
