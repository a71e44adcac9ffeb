"""Orbax's argument conventions, for the args classes beside their handler in :mod:`.v0`.

- :func:`apply_save_args`: ``SaveArgs(dtype=...)`` casts before saving, as Orbax does; options
  without a safetensors meaning raise;
- :func:`tree_summary`, :func:`args_repr`, :func:`with_registry_hint`: what args print;
- :class:`TreeMetadata`: what the handler's ``metadata`` returns, shaped like Orbax's;
- :class:`OrbaxRouter`, :data:`ORBAX_HANDLERS`: Orbax's own args (``StandardSave`` /
  ``StandardRestore``, ``PyTreeSave`` / ``PyTreeRestore``) in a root that also holds
  safetensors steps go to Orbax's own handlers;
- :func:`restore_options`, :func:`restore_orbax_native`: a restore's args (Orbax's
  ``strict``, ``partial_restore``, ``restore_args``) as the pipeline's neutral options, its
  mismatch errors worded in the caller's API (:data:`V0_WORDS`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.compat.orbaxargs import is_restore_args
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.pipeline.restore_options import (
    Keys,
    RestoreOptions,
    Skip,
    Words,
    neutral_leaves,
    neutral_target,
)
from orbax_safetensors._src.storage import config as _config

REGISTRY_HINT = (
    "an item that also takes Orbax's StandardSave/PyTreeSave args needs "
    "ocp.CheckpointManager(..., handler_registry=osf.handler_registry())"
)

# --------------------------------------------------------------------------- printing


def _leaf_bytes(x: Any) -> int:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # a typed PRNG key's dtype
        itemsize = getattr(dtype, "itemsize", 0) or 0
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def tree_summary(tree: Any) -> str:
    """``<dict: 12 leaves, 3.4 MiB>``: a pytree described without printing its arrays."""
    if tree is None:
        return "None"
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_restore_args)
    total = sum(_leaf_bytes(x) for x in leaves)
    count = f"{len(leaves)} leaf" if len(leaves) == 1 else f"{len(leaves)} leaves"
    return f"<{type(tree).__name__}: {count}, {_human_bytes(total)}>"


def args_repr(name: str, fields: list[tuple[str, str | None]]) -> str:
    """``name(field=text, ...)`` of the fields whose text is not ``None``."""
    return f"{name}({', '.join(f'{k}={v}' for k, v in fields if v is not None)})"


def with_registry_hint(summary: str) -> str:
    """``summary`` followed by how to let an item take Orbax's args too."""
    # Orbax's only error for an item already tied to another handler ('Item "default" and
    # args ... does not match with any registered handler!') formats the args with str(), so
    # the fix travels there (repr() stays the bare summary).
    return f"{summary} [{REGISTRY_HINT}]"


# --------------------------------------------------------------------------- save_args


def apply_save_args(item: Any, save_args: Any) -> Any:
    """``item`` with each ``SaveArgs(dtype=...)`` leaf cast, as Orbax saves it.

    Raises:
      ValueError: naming the key, for ``SaveArgs`` options safetensors has no use for
        (``aggregate``, ``chunk_byte_size``, ``shard_axes``) or a dtype on a non-array leaf.
    """
    if save_args is None:
        return item
    flat = _tree.flatten_target(item)
    args = _tree.flatten_target(save_args, is_leaf=_is_save_args)
    by_name = dict(zip(args.names, args.leaves))
    extra = sorted(set(by_name) - set(flat.names))
    if extra:
        raise ValueError(
            f"save_args has keys the item lacks: {', '.join(extra[:20])}; save_args must have "
            "the item's structure (None where nothing is asked)"
        )
    out = []
    for name, x in zip(flat.names, flat.leaves):
        arg = by_name.get(name)
        if arg is None:
            out.append(x)
            continue
        if not _is_save_args(arg):
            raise ValueError(
                f"save_args[{name!r}] is a {type(arg).__name__}, not an ocp.SaveArgs (or None)"
            )
        _refuse_unmapped(name, arg)
        dtype = getattr(arg, "dtype", None)
        if dtype is None:
            out.append(x)
        elif isinstance(x, (jax.Array, np.ndarray, np.generic)):
            out.append(x.astype(dtype))
        else:
            raise ValueError(
                f"save_args[{name!r}].dtype={np.dtype(dtype)} applies to arrays; the leaf is a "
                f"{type(x).__name__}"
            )
    return flat.rebuild(out)


def hf_mapping(owner: str, mapping: Any, **files: Any) -> Any:
    """``mapping`` checked (an unknown mapping type raises), or None; without one, each of
    ``files`` (``hf_config=``, ``generation_config=``) given raises, naming ``owner``."""
    if mapping is not None:
        return _export.check_mapping(mapping)
    for name, value in files.items():
        if value is not None:
            raise ValueError(
                f"{owner}: {name}= writes a file of a Hugging Face model directory, which "
                "needs mapping= (an osf.KeyMapping)"
            )
    return None


def _is_save_args(x: object) -> bool:
    # Orbax's SaveArgs, recognised by its fields.
    return dataclasses.is_dataclass(x) and hasattr(x, "aggregate") and hasattr(x, "dtype")


def _refuse_unmapped(name: str, arg: Any) -> None:
    if getattr(arg, "aggregate", False):
        raise ValueError(
            f"save_args[{name!r}].aggregate=True: Orbax has deprecated it and StandardSave "
            "refuses it; drop it (every leaf is stored as its own tensor)"
        )
    shard_axes: Any = getattr(arg, "shard_axes", ())
    if getattr(arg, "chunk_byte_size", None) is not None or shard_axes:
        raise ValueError(
            f"save_args[{name!r}] sets chunk_byte_size or shard_axes, zarr chunking options: "
            "safetensors stores each tensor contiguously, and a restore reads only the byte "
            "ranges its devices need; drop them (to split files, pass "
            "SafetensorsCheckpointHandler(max_file_size=...))"
        )


# --------------------------------------------------------------------------- TreeMetadata


def _fields(x: object) -> tuple[str, ...]:
    # A namedtuple's field names (its public ``_fields``), else ().
    return tuple(getattr(type(x), "_fields", ())) if isinstance(x, tuple) else ()


def _is_namedtuple(x: object) -> bool:
    return bool(_fields(x))


@jax.tree_util.register_pytree_with_keys_class
class TreeMetadata:
    """The saved tree (``jax.ShapeDtypeStruct`` leaves, inline scalars as saved) and the
    ``custom_metadata`` it was saved with: the members of Orbax's own (private)
    ``TreeMetadata``, so Orbax's protocol and args (``StandardRestore``, ``PyTreeRestore``)
    take it as a restore target, as ours do.

    Maps over like the tree itself (``jax.tree.map(f, meta)``), and indexes like its top
    level (``meta["params"]``); ``meta.tree`` is the plain tree.
    """

    def __init__(self, *, tree: Any, custom_metadata: Any = None, use_zarr3: bool = False):
        self._tree = tree
        self._custom_metadata = custom_metadata
        self._use_zarr3 = use_zarr3

    @classmethod
    def build(
        cls, tree: Any, *, custom_metadata: Any = None, use_zarr3: bool = False
    ) -> TreeMetadata:
        """Orbax's constructor name."""
        return cls(tree=tree, custom_metadata=custom_metadata, use_zarr3=use_zarr3)

    @property
    def tree(self) -> Any:
        """The saved tree."""
        return self._tree

    @property
    def custom_metadata(self) -> Any:
        """``SafetensorsSave(custom_metadata=...)`` of the save (None if not given)."""
        return self._custom_metadata

    @property
    def use_zarr3(self) -> bool:
        """Always False: Orbax's protocol member; safetensors files are not zarr."""
        return self._use_zarr3

    def _children(self) -> tuple[list[Any], list[Any]]:
        tree = self._tree
        if isinstance(tree, dict):
            return [DictKey(k) for k in tree], list(tree.values())
        if _is_namedtuple(tree):
            return [DictKey(k) for k in _fields(tree)], list(tree)
        if isinstance(tree, (list, tuple)):
            return [SequenceKey(i) for i in range(len(tree))], list(tree)
        return [GetAttrKey("tree")], [tree]

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], Any]:
        keys, values = self._children()
        return list(zip(keys, values)), (self._tree, self._custom_metadata, self._use_zarr3)

    def tree_flatten(self) -> tuple[list[Any], Any]:
        pairs, aux = self.tree_flatten_with_keys()
        return [v for _, v in pairs], aux

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> TreeMetadata:
        template, custom_metadata, use_zarr3 = aux
        children = list(children)
        if isinstance(template, dict):
            tree: Any = type(template)(zip(template.keys(), children))
        elif _is_namedtuple(template):
            tree = type(template)(*children)
        elif isinstance(template, (list, tuple)):
            tree = type(template)(children)
        else:
            (tree,) = children
        return cls(tree=tree, custom_metadata=custom_metadata, use_zarr3=use_zarr3)

    def __getitem__(self, key: Any) -> Any:
        if _is_namedtuple(self._tree) and isinstance(key, str):
            return getattr(self._tree, key)
        return self._tree[key]

    def __contains__(self, key: Any) -> bool:
        if isinstance(self._tree, dict):
            return key in self._tree
        if _is_namedtuple(self._tree) and isinstance(key, str):
            return key in _fields(self._tree)
        if isinstance(self._tree, (list, tuple)):
            return isinstance(key, int) and -len(self._tree) <= key < len(self._tree)
        return False

    def __len__(self) -> int:
        return len(self._tree) if isinstance(self._tree, (dict, list, tuple)) else 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self._tree) if isinstance(self._tree, (dict, list, tuple)) else iter([])

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            return default
        return self[key]

    def keys(self) -> Any:
        return self._tree.keys() if isinstance(self._tree, dict) else range(len(self))

    def values(self) -> Any:
        return self._tree.values() if isinstance(self._tree, dict) else list(self._children()[1])

    def items(self) -> Any:
        return (
            self._tree.items() if isinstance(self._tree, dict) else zip(self.keys(), self.values())
        )

    def __repr__(self) -> str:
        leaves = jax.tree_util.tree_leaves(self._tree)
        return (
            f"TreeMetadata(tree=<{type(self._tree).__name__} with {len(leaves)} leaves>, "
            f"custom_metadata={self._custom_metadata!r})"
        )


def tree_of_metadata(x: Any) -> Any:
    """The plain tree of a ``TreeMetadata`` (ours, or Orbax's own, recognised by its members);
    anything else as given."""
    if isinstance(x, TreeMetadata) or (
        x is not None
        and hasattr(x, "tree")
        and hasattr(x, "custom_metadata")
        and hasattr(type(x), "tree_flatten_with_keys")
    ):
        return x.tree
    return x


# --------------------------------------------------------------------------- Orbax's own args


# Orbax's args types a safetensors item also takes in a mixed root (``handler_registry``), and
# the Orbax handler of each.
ORBAX_HANDLERS: dict[type, type] = {
    ocp.args.StandardSave: ocp.StandardCheckpointHandler,
    ocp.args.StandardRestore: ocp.StandardCheckpointHandler,
    ocp.args.PyTreeSave: ocp.PyTreeCheckpointHandler,
    ocp.args.PyTreeRestore: ocp.PyTreeCheckpointHandler,
}


def orbax_handler_type(args: object) -> type | None:
    """The Orbax handler class of Orbax's own args (a mixed root's), else None."""
    return next((h for t, h in ORBAX_HANDLERS.items() if isinstance(args, t)), None)


class OrbaxRouter:
    """Orbax's own handlers, made when first needed, and which of them saved each item
    directory still to finalize. Thread-safe: one router serves any number of items and
    concurrent saves (each directory is one save).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: dict[type, Any] = {}
        self._saved: dict[str, Any] = {}  # item directory -> the Orbax handler that saved it

    def handler(self, handler_type: type) -> Any:
        """Orbax's handler of class ``handler_type`` (made once, kept until :meth:`close`)."""
        with self._lock:
            if handler_type not in self._handlers:
                self._handlers[handler_type] = handler_type()
            return self._handlers[handler_type]

    def _saving(self, directory: epath.Path, args: Any) -> Any:
        handler_type = orbax_handler_type(args)
        if handler_type is None:
            raise TypeError(f"not one of Orbax's args: {type(args).__name__}")
        handler = self.handler(handler_type)
        with self._lock:
            self._saved[str(directory)] = handler
        return handler

    def async_save(self, directory: epath.Path, args: Any) -> Coroutine[Any, Any, Any]:
        """Orbax's handler's ``async_save`` for Orbax's args; its finalize is remembered."""
        return _mesh_kept(self._saving(directory, args).async_save(directory, args=args))

    def save(self, directory: epath.Path, args: Any) -> None:
        """Orbax's handler's ``save`` for Orbax's args; its finalize is remembered."""
        with _jaxcompat.global_mesh_kept():
            self._saving(directory, args).save(directory, args=args)

    def forget(self, directory: epath.Path) -> None:
        """``directory`` is saved by another handler now (e.g. a retry with other args)."""
        with self._lock:
            self._saved.pop(str(directory), None)

    def finalize(self, directory: epath.Path) -> bool:
        """Finalizes ``directory`` if one of Orbax's handlers saved it; whether it did."""
        with self._lock:
            handler = self._saved.pop(str(directory), None)
        if handler is None:
            return False
        handler.finalize(directory)
        return True

    def close(self) -> None:
        """Closes Orbax's handlers (new ones are made if used again)."""
        with self._lock:
            handlers, self._handlers = list(self._handlers.values()), {}
        for handler in handlers:
            handler.close()


async def _mesh_kept(save: Coroutine[Any, Any, Any]) -> Any:
    # Orbax's save runs while this coroutine is awaited: a global mesh it leaves set (Orbax
    # 0.11.40 on jax 0.7, see jaxcompat.global_mesh_kept) is undone on the same thread.
    with _jaxcompat.global_mesh_kept():
        return await save


# --------------------------------------------------------------------------- restoring


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


def restore_orbax_native(directory: epath.Path, args: Any, router: OrbaxRouter) -> Any:
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
        return router.handler(ocp.StandardCheckpointHandler).restore(
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
    return router.handler(ocp.PyTreeCheckpointHandler).restore(directory, args=pytree_args)
