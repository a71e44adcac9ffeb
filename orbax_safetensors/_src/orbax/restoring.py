"""Orbax's restore args translated into the pipeline's neutral options.

``SafetensorsRestore``'s fields (Orbax's ``strict``, ``partial_restore``, ``restore_args``)
become one :class:`.restore_options.RestoreOptions` (Orbax's leaves themselves are translated
by :func:`.restore_options.neutral_leaves`, which the standalone ``load_file`` shares), and the
pipeline's structured mismatch errors are worded in the option names of the API the caller came
through. An Orbax-native item is restored by Orbax's own handler, with the same meanings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.compat.orbaxargs import is_restore_args
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.pipeline.read import ReadStats
from orbax_safetensors._src.pipeline.restore_options import (
    Keys,
    RestoreOptions,
    Skip,
    Words,
    neutral_leaves,
    neutral_target,
    reworded,
)
from orbax_safetensors._src.storage import config as _config


def is_placeholder(x: object) -> bool:
    """Whether ``x`` is Orbax's ``PLACEHOLDER`` (a leaf to leave unread)."""
    return x is ocp.PLACEHOLDER


def merge_restore_args(item: Any, restore_args: Any, *, partial_restore: bool) -> Any:
    """The neutral restore target of ``SafetensorsRestore(item, restore_args=...)``.

    As Orbax's ``PyTreeRestore``: the tree (and its node types) is ``item``'s, each leaf is
    the ``restore_args`` leaf of the same key. An ``ArrayRestoreArgs`` (with its ``strict``
    left True) takes ``item``'s shape and dtype where it names none; its sharding is its own
    (none: as the saved tree would be restored). A ``PLACEHOLDER`` in ``item`` stays one
    whatever ``restore_args`` says there (Orbax keeps it). ``restore_args`` keys that ``item``
    lacks are an error, or dropped with ``partial_restore``.

    Raises:
      TargetMismatchError: naming the keys in one of the two trees only.
    """
    if restore_args is None:
        return neutral_target(item)
    if item is None:
        return neutral_target(restore_args)
    flat = _tree.flatten_target(item, is_leaf=is_restore_args)
    args = _tree.flatten_target(restore_args, is_leaf=is_restore_args)
    by_name = dict(zip(args.names, args.leaves))
    lacking = [
        n for n, x in zip(flat.names, flat.leaves) if n not in by_name and not is_placeholder(x)
    ]
    extra = [] if partial_restore else sorted(set(by_name) - set(flat.names))
    if lacking or extra:
        parts = ["restore_args does not match item:"]
        if lacking:
            parts.append(
                f"  in item but not restore_args ({len(lacking)}): {', '.join(lacking[:50])}"
            )
        if extra:
            parts.append(
                f"  in restore_args but not item ({len(extra)}): {', '.join(extra[:50])} "
                "(pass partial_restore=True to restore only item's keys)"
            )
        raise TargetMismatchError("\n".join(parts))  # (about the args: worded here)
    leaves: list[Any] = []
    givens: list[Any] = []
    for name, x in zip(flat.names, flat.leaves):
        arg = by_name.get(name)
        if is_placeholder(x):  # Orbax keeps the placeholder, whatever restore_args says
            leaves.append(Skip(x))
        elif is_restore_args(arg):
            leaves.append(_merge_leaf(x, arg))
        else:
            leaves.append(x if arg is None else arg)
        givens.append(x if is_restore_args(arg) and not is_placeholder(x) else None)
    return flat.rebuild(neutral_leaves(flat.names, leaves, givens))


def _merge_leaf(item_leaf: Any, arg: Any) -> Any:
    # Orbax fills an ArrayRestoreArgs's shape and dtype from the item when it is strict
    # (orbax-checkpoint >= 0.11.40; 0.11.11 restored the saved shape and dtype).
    if not getattr(arg, "strict", True) or not hasattr(arg, "global_shape"):
        return arg
    shape, dtype = getattr(item_leaf, "shape", None), getattr(item_leaf, "dtype", None)
    if shape is None or dtype is None or _tree.is_prng_key(item_leaf):
        return arg
    updates: dict[str, Any] = {}
    if arg.global_shape is None and getattr(arg, "shape", None) is None:
        updates["global_shape"] = tuple(shape)
    if arg.dtype is None:
        updates["dtype"] = dtype
    return dataclasses.replace(arg, **updates) if updates else arg


# --------------------------------------------------------------------------- args and words

# How a v0 restore (SafetensorsRestore, or Orbax's own args) tells its caller what to pass.
V0_WORDS = Words(
    keys="pass partial_restore=True to restore only the target's keys",
    missing="pass partial_restore=True to return them as given",
    shape="pass strict=False to pad or truncate it, as Orbax's StandardRestore does",
)
V0_WORDS_STRICT_FALSE = dataclasses.replace(
    V0_WORDS,
    keys=(
        "pass partial_restore=True to restore only the target's keys; strict=False pads or "
        "truncates shapes, as in Orbax's StandardRestore, and no longer skips keys"
    ),
)


def v0_words(args: Any) -> Words:
    """The mismatch wording for ``SafetensorsRestore`` ``args``."""
    return V0_WORDS_STRICT_FALSE if not args.strict else V0_WORDS


def restore_options(
    args: Any, *, verify: bool, io: _config.IOOptions | None = None
) -> RestoreOptions:
    """The neutral options of a ``SafetensorsRestore``: ``strict`` governs shapes (as in
    ``StandardRestore``), ``partial_restore`` keys (as in ``PyTreeRestore``); ``io``: the
    handler's I/O options."""
    target = merge_restore_args(args.item, args.restore_args, partial_restore=args.partial_restore)
    return RestoreOptions(
        target,
        keys=Keys.PARTIAL if args.partial_restore else Keys.EXACT,
        pad_or_truncate=not args.strict,
        select=_select.Selection.of(args.include, args.exclude),
        verify=verify,
        fallback_sharding=args.fallback_sharding,
        io=io,
    )


def restore_safetensors(
    directory: epath.Path,
    args: Any,
    *,
    verify: bool,
    words: Words,
    stats: ReadStats,
    io: _config.IOOptions | None = None,
) -> Any:
    """Restores a safetensors item as ``SafetensorsRestore`` ``args`` ask; a mismatch error
    is worded in ``words``."""
    try:
        options = restore_options(args, verify=verify, io=io)
        return _standalone.restore_checkpoint(directory, options, stats=stats)
    except TargetMismatchError as e:
        raise reworded(e, words) from None


def from_orbax_restore(args: Any) -> dict[str, Any]:
    """``SafetensorsRestore``'s fields for Orbax's ``StandardRestore`` / ``PyTreeRestore``
    on a safetensors item. ``PyTreeRestore(item)`` without ``restore_args`` restores every
    leaf as saved (``RestoreArgs()`` for each, as Orbax fills them in): ``item``'s leaves
    only say where."""
    if isinstance(args, ocp.args.StandardRestore):
        return {"item": args.item, "strict": args.strict}
    if getattr(args, "transforms", None) is not None or getattr(args, "legacy_transform_fn", None):
        raise ValueError(
            "PyTreeRestore(transforms=...) cannot restore a safetensors step: restore the tree "
            "and transform it, or use SafetensorsRestore(item, partial_restore=True)"
        )
    restore_args = args.restore_args
    if restore_args is None and args.item is not None:
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(), args.item)
    return {
        "item": args.item,
        "restore_args": restore_args,
        "partial_restore": bool(getattr(args, "partial_restore", False)),
    }


def restore_orbax_native(
    directory: epath.Path, args: Any, orbax_handler: Callable[[str], Any]
) -> Any:
    """An Orbax-native item restored by Orbax's handler, with ``SafetensorsRestore``
    ``args``'s meanings: its ``StandardRestore`` (``item``, ``strict``) or, given
    ``restore_args`` or ``partial_restore``, its ``PyTreeRestore``."""
    if args.include is not None or args.exclude is not None:
        raise ValueError(
            f"{directory}: an Orbax-native item; include/exclude select within "
            "safetensors items only: pass the keys to restore as the item with "
            "partial_restore=True, or convert the step (orbax-safetensors convert)"
        )
    if args.restore_args is None and not args.partial_restore:
        return orbax_handler("standard").restore(
            directory, args=ocp.args.StandardRestore(args.item, strict=args.strict)
        )
    restore_args = args.restore_args
    if restore_args is None:
        item = args.item
        restore_args = (
            ocp.checkpoint_utils.construct_restore_args(item) if item is not None else None
        )
    if not args.strict and restore_args is not None:
        restore_args = jax.tree.map(
            lambda a: dataclasses.replace(a, strict=False) if hasattr(a, "strict") else a,
            restore_args,
            is_leaf=is_restore_args,
        )
    if args.partial_restore:
        pytree_args = _orbaxcompat.pytree_partial_restore(args.item, restore_args)
    else:
        pytree_args = ocp.args.PyTreeRestore(args.item, restore_args=restore_args)
    return orbax_handler("pytree").restore(directory, args=pytree_args)
