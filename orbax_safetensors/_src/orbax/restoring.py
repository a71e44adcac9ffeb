"""Orbax's restore vocabulary translated into the pipeline's neutral one.

Orbax's names are recognised here and nowhere below: ``ocp.RestoreArgs`` /
``ocp.ArrayRestoreArgs`` (including the sharding metadata objects Orbax's ``item_metadata``
gives, and ``mesh`` / ``mesh_axes``) become :class:`.restore_options.LeafRequest`,
``ocp.PLACEHOLDER`` becomes :class:`.restore_options.Skip`, ``SafetensorsRestore``'s fields
(Orbax's ``strict``, ``partial_restore``, ``restore_args``) become one
:class:`.restore_options.RestoreOptions`, and the pipeline's structured mismatch errors are
worded in the option names of the API the caller came through.

The public ``load_file`` and ``restore_directory`` are defined here as well (the pipeline
takes a :class:`.restore_options.RestoreOptions` only): the standalone API takes Orbax's
restore args and ``...`` as target leaves, translated before the pipeline sees them.

Example::

    options = restore_options(args, verify=True)
    tree = pipeline_restore(path, options)   # (checkpoint_restore.restore_checkpoint)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import Mismatch, MismatchKind, TargetMismatchError
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.pipeline.reader import ReadStats
from orbax_safetensors._src.pipeline.restore_options import (
    Build,
    Keys,
    LeafRequest,
    RestoreOptions,
    Skip,
    Words,
    mismatch_message,
    reworded,
)
from orbax_safetensors._src.storage import config as _config

# --------------------------------------------------------------------------- leaves


def is_restore_args(x: object) -> bool:
    """Whether ``x`` is Orbax's ``RestoreArgs`` (``ArrayRestoreArgs`` is one)."""
    return isinstance(x, ocp.RestoreArgs)


def is_placeholder(x: object) -> bool:
    """Whether ``x`` is Orbax's ``PLACEHOLDER`` (a leaf to leave unread)."""
    return x is ocp.PLACEHOLDER


def restore_args_sharding(arg: Any) -> Any:
    """The sharding an Orbax ``ArrayRestoreArgs`` asks for (its ``sharding``, converted from
    Orbax's sharding metadata if need be, or a ``NamedSharding`` built from ``mesh`` and
    ``mesh_axes``), else None.

    Raises:
      ValueError: Orbax's sharding metadata that this job's devices cannot reproduce.
    """
    sharding = getattr(arg, "sharding", None)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        # Orbax's ShardingMetadata (from item_metadata), known by its method: converted as
        # Orbax converts it.
        to_jax = getattr(sharding, "to_jax_sharding", None)
        if callable(to_jax):
            sharding = to_jax()
    mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
    if sharding is None and mesh is not None and axes is not None:
        sharding = jax.sharding.NamedSharding(mesh, axes)
    return sharding


def leaf_request(arg: Any, given: Any = None) -> LeafRequest:
    """What an Orbax ``RestoreArgs`` asks for, with Orbax's meaning: ``restore_type`` names
    the type to return (numpy arrays and Python scalars stay on the host, as
    ``PyTreeRestore`` returns them; None is the saved type; anything else is a
    ``jax.Array``); ``ArrayRestoreArgs(strict=False)`` pads or truncates to its
    ``global_shape``. ``given``: what a partial restore returns if the key is not saved.

    Raises:
      ValueError: Orbax's sharding metadata that this job's devices cannot reproduce.
    """
    shape = getattr(arg, "global_shape", None)
    shape = tuple(shape) if shape is not None else None
    dtype = np.dtype(arg.dtype) if getattr(arg, "dtype", None) is not None else None
    restore_type = getattr(arg, "restore_type", None)
    pad = getattr(arg, "strict", True) is False
    given = arg if given is None else given
    if isinstance(restore_type, type) and issubclass(restore_type, np.ndarray):
        return LeafRequest(Build.NUMPY, shape, dtype, pad_or_truncate=pad, given=given)
    if restore_type in (bool, int, float):
        return LeafRequest(Build.PYTHON, (), pytype=restore_type, given=given)
    if restore_type is str:
        return LeafRequest(Build.STR, (), given=given)
    sharding = restore_args_sharding(arg)
    if restore_type is None and sharding is None:
        return LeafRequest(Build.SAVED, shape, dtype, pad_or_truncate=pad, given=given)
    return LeafRequest(
        Build.JAX, shape, dtype, sharding, needs_sharding=True, pad_or_truncate=pad, given=given
    )


class _Translator:
    """Translates leaves, collecting the ones whose sharding cannot be rebuilt."""

    def __init__(self) -> None:
        self.problems: list[Mismatch] = []

    def leaf(self, name: str, x: Any, given: Any = None) -> Any:
        if is_placeholder(x):
            return Skip(x)
        if not is_restore_args(x):
            return x
        try:
            return leaf_request(x, given)
        except ValueError as e:
            self.problems.append(Mismatch(name, MismatchKind.SHARDING, str(e)))
            return None

    def check(self) -> None:
        if self.problems:
            raise TargetMismatchError(mismatch_message(self.problems), self.problems)


def neutral_target(target: Any) -> Any:
    """``target`` with Orbax's leaves translated (the same object when it has none).

    Raises:
      TargetMismatchError: naming leaves whose sharding metadata cannot be rebuilt here.
    """
    if target is None:
        return None
    if not any(
        is_restore_args(x) or is_placeholder(x)
        for x in jax.tree_util.tree_leaves(target, is_leaf=is_restore_args)
    ):
        return target
    flat = _tree.flatten_target(target, is_leaf=is_restore_args)
    translator = _Translator()
    out = [translator.leaf(n, x) for n, x in zip(flat.names, flat.leaves)]
    translator.check()
    return flat.rebuild(out)


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
    translator = _Translator()
    out = []
    for name, x in zip(flat.names, flat.leaves):
        if is_placeholder(x):  # Orbax keeps the placeholder, whatever restore_args says
            out.append(Skip(x))
            continue
        arg = by_name[name]
        if arg is None:
            out.append(translator.leaf(name, x))
        elif is_restore_args(arg):
            out.append(translator.leaf(name, _merge_leaf(x, arg), given=x))
        else:
            out.append(translator.leaf(name, arg))
    translator.check()
    return flat.rebuild(out)


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
        return _checkpoint_restore.restore_checkpoint(directory, options, stats=stats)
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


# --------------------------------------------------------------------------- the standalone API


def _standalone_options(
    target: Any,
    strict: bool,
    include: _select.Patterns,
    exclude: _select.Patterns,
    verify: bool,
    io_options: _config.IOOptions | None,
    fallback_sharding: jax.sharding.Sharding | None = None,
) -> RestoreOptions:
    """The one value :func:`load_file` and :func:`restore_directory` pass to the pipeline
    (arguments in ``load_file``'s order): Orbax's target leaves translated, ``strict``
    governing keys."""
    return RestoreOptions.standalone(
        neutral_target(target),
        strict=strict,
        include=include,
        exclude=exclude,
        verify=verify,
        fallback_sharding=fallback_sharding,
        io=io_options,
    )


def load_file(
    path: epath.PathLike,
    target: Any = None,
    *,
    strict: bool = True,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
    verify: bool = True,
    io_options: _config.IOOptions | None = None,
) -> Any:
    """Loads a ``.safetensors`` file, rebuilding the saved pytree.

    Args:
      path: a file written by :func:`save_file`, or any safetensors file (then the result is a
        flat ``{name: array}`` dict).
      target: optional pytree saying what to build: leaves may be ``jax.Array``, numpy arrays,
        ``jax.ShapeDtypeStruct`` (placed with its sharding; without one, a leaf saved as numpy
        comes back as numpy of the struct's dtype, as Orbax's ``StandardRestore`` gives it),
        Python scalars, Orbax ``RestoreArgs``, or ``None`` / ``...`` / empty nodes to skip a
        leaf; the result has the target's node types (TrainState, namedtuples,
        ``nnx.State``...). Only the tensors the target asks for are read.
      strict: with a target, missing or unexpected keys (and ``None`` or an empty node where
        the file has a subtree) raise one error listing all of them; with ``strict=False``
        unexpected keys are skipped, skipped subtrees too, and missing ones keep the target's
        (concrete) value.
      include: glob patterns (one string or a sequence) over dotted names, as ``fnmatch``
        reads them (``*`` crosses dots); a pattern also selects everything beneath a name it
        matches (``params`` selects ``params.w``). Only the selected tensors' bytes are read.
        Without a target the selected subtrees come back in their saved containers (lists
        keep their length, None where nothing is selected); with one, they select among the
        target's leaves and an unselected leaf comes back as given. A pattern matching no
        name raises ``TargetMismatchError`` listing names. None: every name.
      exclude: glob patterns of names not to read, by the same rule (applied after
        ``include``).
      verify: check each tensor read whole against its CRC32C: the one the file's header
        records, or, for one file of a checkpoint directory (a CheckpointManager item's
        ``model.safetensors``, whose header records none), the one the directory's
        ``orbax_safetensors.json`` records, which must then describe the file exactly as its
        header does. False: nothing is checked, and the directory's metadata is not read.
      io_options: how the file is read (:class:`~orbax_safetensors.IOOptions`: direct I/O
        mode, object-store options, tracing); None: the defaults (environment).

    Raises:
      HeaderError, SchemaError: the file is damaged or hostile, or (with ``verify``) the
        metadata of the checkpoint directory it belongs to is, or disagrees with it.
      TargetMismatchError: the target disagrees with the file (names every key at once;
        ``.mismatches`` lists them as records).
      IntegrityError: a tensor's bytes do not match their checksum.

    Example::

        params = osf.load_file("w.safetensors", target=jax.eval_shape(lambda: params))
        attn = osf.load_file("w.safetensors", include="layers.*.attn", exclude="*.bias")
    """
    options = _standalone_options(target, strict, include, exclude, verify, io_options)
    return _standalone.load_with_options(path, options)


def restore_directory(
    directory: epath.PathLike,
    target: Any = None,
    *,
    strict: bool = True,
    verify: bool = True,
    stats: ReadStats | None = None,
    fallback_sharding: jax.sharding.Sharding | None = None,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
    io_options: _config.IOOptions | None = None,
) -> Any:
    """Restores a checkpoint directory (an item directory of a step, or one that
    ``save_directory`` wrote), without Orbax's manager.

    ``target``, ``strict``, ``include``, ``exclude``, ``verify`` and ``io_options`` are as in
    :func:`load_file` (``strict`` governs keys); only the selected tensors' bytes are read.
    ``stats`` (a ``ReadStats``) accumulates the bytes read and needed.

    As Orbax's handlers do, arrays saved as ``jax.Array`` without a sharding in the target (no
    target at all, ``jax.ShapeDtypeStruct`` or ``ArrayRestoreArgs`` without one,
    ``RestoreArgs()``) are placed with their saved sharding, rebuilt over the saved devices
    when this job has them all; otherwise on ``fallback_sharding`` (as Orbax's
    ``StandardRestore(fallback_sharding=...)``) if given, else a ``TargetMismatchError`` asks
    for a target sharding (Orbax: "Topology mismatch"). Arrays saved host-local come back on
    this process's first device.

    Example::

        state = osf.restore_directory("/tmp/ckpt/100/default", target=abstract_state)
    """
    options = _standalone_options(
        target, strict, include, exclude, verify, io_options, fallback_sharding
    )
    return _checkpoint_restore.restore_checkpoint(directory, options, stats=stats)
