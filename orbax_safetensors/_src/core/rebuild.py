"""Trees back from a schema (:func:`unflatten`), the cut-down schemas of a selective restore
(:func:`prune_schema`) and restore targets (:func:`flatten_target`). Each takes the typed
:class:`~.schema.Schema` or its JSON document.

Example::

    schema = from_json(doc)
    tree = unflatten(schema, lambda leaf: arrays[leaf.tensor_name])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, overload

import jax
from jax.tree_util import GetAttrKey

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import naming as _naming
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core.errors import SchemaError
from orbax_safetensors._src.core.schema import (
    NONE,
    CustomNode,
    DictNode,
    Inline,
    ListNode,
    Node,
    NoneNode,
    Schema,
    SchemaLeaf,
    SchemaLeaves,
    TupleNode,
    VarNode,
)

SchemaDoc = Mapping[str, Any]  # a schema's JSON document


def validate_schema(
    schema: object, *, max_leaves: int = _schema.MAX_LEAVES
) -> dict[str, SchemaLeaf]:
    """``from_json(schema).leaves``: the leaves by name of a schema read from a file.

    Raises:
      SchemaError: naming the first problem.
    """
    return _schema.from_json(schema, max_leaves=max_leaves).leaves  # type: ignore[return-value]


def _typed(schema: Schema | SchemaDoc, *, check_aliases: bool = True) -> Schema:
    if isinstance(schema, Schema):
        return schema
    return _schema.from_json(schema, check_aliases=check_aliases)


def inline_value(leaf: SchemaLeaf) -> Any:
    """The Python value of an inline (non-tensor) leaf (a float from its hex text)."""
    node = leaf.node
    if not isinstance(node, Inline):
        raise TypeError(f"leaf {leaf.name!r} is not an inline value")
    return node.value


def unflatten(
    schema: Schema | SchemaDoc,
    get: Callable[[SchemaLeaf], Any],
    leaves: Mapping[str, SchemaLeaf] | None = None,
) -> Any:
    """Rebuilds the stored tree; ``get(leaf)`` supplies each array leaf's value.

    Custom nodes come back as dicts of their fields (lists when keyed by index; None when
    empty, as Orbax restores them), NNX Variables as their values, NNX Modules as
    ``nnx.to_pure_dict`` gives them. ``leaves``: the full schema's leaves when ``schema`` was
    cut down by :func:`prune_schema` (its aliases may point at leaves it no longer holds).

    Example::

        unflatten(schema, lambda leaf: arrays[leaf.tensor_name])
    """
    tree: Node
    by_name: Mapping[str, SchemaLeaf]
    if isinstance(leaves, SchemaLeaves) and leaves.doc is schema:  # read once, by the caller
        tree, by_name = leaves.tree, leaves
    else:
        typed = _typed(schema, check_aliases=leaves is None)
        tree, by_name = typed.tree, typed.leaves if leaves is None else leaves

    def build(node: Node) -> Any:
        t = type(node)
        if t is DictNode:
            return {k: build(c) for k, c in zip(node.keys, node.children)}  # type: ignore[union-attr]
        if t is ListNode:
            return [build(c) for c in node.children]  # type: ignore[union-attr]
        if t is TupleNode:
            return tuple([build(c) for c in node.children])  # type: ignore[union-attr]
        if t is CustomNode:
            assert isinstance(node, CustomNode)
            if not node.entries:  # an empty custom node (optax MaskedNode): None, as Orbax gives
                return None
            if node.indexed:
                return [build(c) for c in node.children]
            return {
                e.key: build(c)
                for e, c in zip(node.entries, node.children)
                if not _is_nnx_internal(e, c)
            }
        if t is VarNode:
            return build(node.child)  # type: ignore[union-attr]
        if t is NoneNode:
            return None
        leaf = by_name[node.name]  # type: ignore[union-attr]
        if leaf.kind in _schema.INLINE_KINDS:
            return inline_value(leaf)
        return get(leaf)

    return build(tree)


def _is_nnx_internal(entry: _schema.Entry, child: Node) -> bool:
    # flax.nnx's empty internal child of every Module (not the user's state), left out.
    return (
        entry.kind == "attr"
        and isinstance(child, CustomNode)
        and not child.entries
        and _jaxcompat.is_nnx_internal_attr(entry.text)
    )


@overload
def prune_schema(schema: Schema, keep: Callable[[str], bool]) -> Schema | None: ...
@overload
def prune_schema(schema: SchemaDoc, keep: Callable[[str], bool]) -> dict[str, Any] | None: ...
def prune_schema(schema: Any, keep: Callable[[str], bool]) -> Any:
    """``schema`` cut down to the leaves whose names ``keep`` accepts, in their saved containers
    (None: nothing kept); a JSON document for a JSON document, typed for typed.

    Dicts and named nodes lose the entries that hold nothing kept; sequences keep their length,
    with None where nothing is kept. A None leaf or an empty container is kept when ``keep``
    accepts its dotted path. Aliases may point at tensors not kept: pass the full schema's
    leaves to :func:`unflatten`.

    Example::

        pruned = prune_schema(schema, lambda name: name.startswith("params."))
    """
    typed = _typed(schema, check_aliases=False)
    tree = _prune(typed.tree, None, keep)
    if tree is None:
        return None
    if isinstance(schema, Schema):
        kept = {n: leaf for n, leaf in typed.leaves.items() if keep(n)}
        return Schema(tree, kept, typed.version)
    return _schema.to_json(Schema(tree, version=typed.version))


def _prune(node: Node, name: str | None, keep: Callable[[str], bool]) -> Node | None:
    # ``node`` at dotted path ``name`` (None: the root) cut down; None when nothing is kept.
    t = type(node)
    if t in (DictNode, ListNode, TupleNode, CustomNode):
        if t is DictNode:
            texts = [str(k) for k in node.keys]  # type: ignore[union-attr]
        elif t is CustomNode:
            texts = [e.text for e in node.entries]  # type: ignore[union-attr]
        else:
            texts = [str(i) for i in range(len(node.children))]  # type: ignore[union-attr]
        kids = [
            _prune(c, t_ if name is None else f"{name}.{t_}", keep)
            for t_, c in zip(texts, node.children)  # type: ignore[union-attr]
        ]
        if all(k is None for k in kids):
            return node if not kids and keep(name or _naming.ROOT_NAME) else None
        if isinstance(node, (ListNode, TupleNode)) or (
            isinstance(node, CustomNode) and node.indexed
        ):
            return _schema.with_children(node, tuple([NONE if k is None else k for k in kids]))
        kept = [i for i, k in enumerate(kids) if k is not None]
        children = tuple([kids[i] for i in kept])
        if t is DictNode:
            return DictNode(tuple([node.keys[i] for i in kept]), children)  # type: ignore[arg-type, union-attr]
        entries = tuple([node.entries[i] for i in kept])  # type: ignore[union-attr]
        return CustomNode(node.type_name, entries, children)  # type: ignore[arg-type, union-attr]
    if t is VarNode:
        inner = _prune(node.child, name, keep)  # type: ignore[union-attr]
        return None if inner is None else VarNode(inner)
    if t is NoneNode:
        return node if keep(name or _naming.ROOT_NAME) else None
    return node if keep(node.name) else None  # type: ignore[union-attr]


def selectable_names(schema: Schema | SchemaDoc) -> list[str]:
    """Every name :func:`prune_schema` asks about: the leaves', and the dotted paths of None
    leaves and empty containers."""
    names: list[str] = []

    def record(name: str) -> bool:
        names.append(name)
        return False  # keeps nothing: every name is asked about

    _prune(_typed(schema, check_aliases=False).tree, None, record)
    return names


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass
class TargetLeaves:
    """A restore target flattened with the naming rule; ``rebuild(values)`` gives its tree back."""

    names: list[str]
    leaves: list[Any]
    rebuild: Callable[[list[Any]], Any]


def flatten_target(
    target: Any,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    structural: Callable[[Any], bool] | None = None,
) -> TargetLeaves:
    """Flattens a restore target with jax's own pytree rules (keeping its node types).

    Leaves for which ``structural`` holds (None and empty nodes) keep their plain dotted path
    and take no part in breaking name collisions, as a saved schema names them.

    Example::

        flat = flatten_target({"w": jnp.zeros(2)})
        flat.names                        # ["w"]
        flat.rebuild([np.ones(2)])        # {"w": array([1., 1.])}
    """
    is_variable = _naming.is_nnx_variable

    def outer_leaf(x: Any) -> bool:
        return is_variable(x) or (is_leaf is not None and is_leaf(x))

    outer, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=outer_leaf)
    paths: list[tuple[_naming.KeyEntry, ...]] = []
    leaves: list[Any] = []
    for path, x in outer:
        if is_variable(x):
            inner, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=is_leaf)
            for ipath, ix in inner:
                transparent = len(inner) == 1 and ipath == (GetAttrKey("value"),)
                paths.append(tuple(path) if transparent else (*path, *ipath))
                leaves.append(ix)
        else:
            paths.append(tuple(path))
            leaves.append(x)
    treedef = jax.tree_util.tree_structure(target, is_leaf=is_leaf)
    if getattr(treedef, "num_leaves", len(leaves)) != len(
        leaves
    ):  # pragma: no cover - guards a jax behaviour change
        raise SchemaError("internal: target leaf count differs between flattening passes")
    if structural is None:
        names = _naming.assign_names(paths)
    else:
        names = [_naming.join_path(p) for p in paths]
        stored = [i for i, x in enumerate(leaves) if not structural(x)]
        deduped = _naming.dedupe_names([names[i] for i in stored], [paths[i] for i in stored])
        for i, name in zip(stored, deduped):
            names[i] = name
    return TargetLeaves(
        names,
        leaves,
        lambda values: jax.tree_util.tree_unflatten(treedef, values),
    )
