"""What a restore is asked, in neutral terms: one frozen :class:`RestoreOptions` value from the
API adapters (``load_file``, ``restore_directory``, the Orbax handlers) to
:func:`.restore_plan.restore_tree`, and the wording of its mismatch errors (:class:`Words`).

Target leaves: ``jax.Array``, ``jax.ShapeDtypeStruct``, numpy arrays and scalars, Python scalars
and strings (each asking for its own kind of value), ``None`` and empty nodes (nothing to read:
returned as given), :class:`LeafRequest` (what to build, spelled out), :class:`Skip` (read
nothing, return a value), and Orbax's restore args and ``...`` (:func:`neutral_target`
translates them into the last two).

Example::

    options = RestoreOptions(target=abstract, keys=Keys.PARTIAL, pad_or_truncate=True)
    tree = restore_tree(schema, stored, options)
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
    """A target leaf spelled out.

    Attributes:
      build: what kind of value to build.
      shape, dtype: what the stored tensor must have (None: whatever it has), and the dtype
        to cast to.
      sharding: where a ``jax.Array`` goes (None: the saved sharding).
      pytype: the Python type for ``Build.PYTHON``.
      needs_sharding: a ``jax.Array`` asked for explicitly: one saved host-local (numpy) has
        no sharding to fall back to, so that is an error without ``sharding``.
      pad_or_truncate: a stored shape of the same rank that differs from ``shape`` is cut and
        zero-padded to it (for this leaf, whatever the restore's own setting).
      given: what a partial restore returns when the checkpoint lacks this key.

    Example::

        LeafRequest(Build.NUMPY, dtype=np.dtype("float16"))
    """

    build: Build = Build.SAVED
    shape: tuple[int, ...] | None = None
    dtype: np.dtype | None = None
    sharding: Any = None
    pytype: type | None = None
    needs_sharding: bool = False
    pad_or_truncate: bool = False
    given: Any = None


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
    """Everything a restore is asked, in one value.

    Attributes:
      target: None (the saved tree) or a pytree of target leaves (see the module docstring).
      keys: how keys in one of target and checkpoint only are treated (:class:`Keys`).
      pad_or_truncate: a stored array whose shape differs from the target's (same rank) is cut
        and zero-padded to it; otherwise that is an error.
      select: read only the names it selects (None: every name).
      verify: check each tensor read whole against its CRC32C.
      fallback_sharding: where an array goes whose saved sharding this job's devices cannot
        rebuild and whose target gives none (None: that is an error).
      io: how files are read (None: the defaults, see :class:`~orbax_safetensors.IOOptions`).

    Example::

        RestoreOptions(target=abstract, select=Selection.of("params.*", None))
    """

    target: Any = None
    keys: Keys = Keys.EXACT
    pad_or_truncate: bool = False
    select: _select.Selection | None = None
    verify: bool = True
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
        """The options of ``load_file`` / ``restore_directory``: Orbax's target leaves
        translated (:func:`neutral_target`), ``strict`` governing keys (the safetensors and
        PyTorch meaning)."""
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
    """``leaves`` with Orbax's translated: its restore args into :class:`LeafRequest`
    (``givens[i]``, else the args themselves, what a partial restore returns where the key is
    not saved), ``...`` (Orbax's placeholder) into :class:`Skip`.

    Raises:
      TargetMismatchError: naming every leaf whose sharding metadata cannot be rebuilt here.
    """
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
    """How an API tells its caller to resolve mismatches, in its own option names.

    Attributes:
      keys: appended to the list of keys in the checkpoint but not the target (and to
        structure mismatches): what to pass to restore only the target's keys.
      missing: appended to the list of target keys the checkpoint lacks.
      shape: appended to a shape mismatch that padding or truncating would resolve.
    """

    keys: str = ""
    missing: str = ""
    shape: str = ""


STANDALONE_WORDS = Words(keys="pass strict=False to skip them")

_LIMIT = 50  # keys listed per line


def mismatch_message(mismatches: Sequence[Mismatch], words: Words = STANDALONE_WORDS) -> str:
    """The message of a :class:`TargetMismatchError` listing ``mismatches`` in ``words``.

    Example::

        mismatch_message([Mismatch("ghost", MismatchKind.MISSING)])
        # 'the checkpoint does not match the restore target:\\n  missing from the
        # checkpoint (1): ghost'
    """
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
