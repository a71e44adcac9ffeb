"""The naming rule, and trees back from a schema.

The naming rule (a public contract): a leaf's name joins its key path with ``.`` (a dict key as
text, a sequence index in decimal, an attribute or namedtuple field by name); a tree that is a
single leaf is named ``value``; NNX ``Variable`` wrappers are transparent; names that collide
once joined get a ``~N`` suffix, chosen the same way on save and on load. From a schema (typed
or its JSON document) this module rebuilds trees (:func:`unflatten`), cuts the schemas of a
selective restore (:func:`prune_schema`) and flattens restore targets (:func:`flatten_target`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import header as _header
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

ROOT_NAME = "value"  # the name of a tree that is a single leaf

KeyEntry = Any  # DictKey | SequenceKey | GetAttrKey | FlattenedIndexKey


def entry_text(entry: KeyEntry) -> str:
    """A key entry's text in a dotted name (``DictKey("w")`` gives ``w``, ``SequenceKey(0)``
    gives ``0``)."""
    if isinstance(entry, DictKey):
        return str(entry.key)
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def _entry_order(entry: KeyEntry) -> tuple[int, int, int, str]:
    # A total order over key entries of mixed kinds, used only to break name collisions.
    if isinstance(entry, DictKey):
        k = entry.key
        if isinstance(k, int) and not isinstance(k, bool):
            return (0, 0, k, "")
        return (0, 1, 0, f"{type(k).__name__}:{k}")
    if isinstance(entry, SequenceKey):
        return (1, 0, entry.idx, "")
    if isinstance(entry, GetAttrKey):
        return (2, 0, 0, entry.name)
    if isinstance(entry, FlattenedIndexKey):
        return (3, 0, entry.key, "")
    return (4, 0, 0, str(entry))


def join_path(path: Iterable[KeyEntry]) -> str:
    """The dotted name of a key path, without collision suffixes (``layers.0.w``)."""
    text = ".".join(entry_text(e) for e in path)
    return text if text else ROOT_NAME


def assign_names(paths: list[tuple[KeyEntry, ...]]) -> list[str]:
    """Unique dotted names for ``paths``; colliding ones get ``~1``, ``~2``... deterministically."""
    names = [".".join([entry_text(e) for e in p]) or ROOT_NAME for p in paths]  # join_path
    return dedupe_names(names, paths)


def dedupe_names(names: list[str], paths: list[tuple[KeyEntry, ...]]) -> list[str]:
    """``names`` (the joined ``paths``) with colliding ones suffixed, in place: the paths of a
    group sorted, the first keeps the name, the others get ``~1``, ``~2``... (skipping names
    used elsewhere); ``__metadata__`` is always suffixed."""
    if len(set(names)) == len(names) and _header.METADATA_KEY not in names:
        return names  # the common case: nothing collides
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(n, []).append(i)
    taken = set(names)
    for base, idx in groups.items():
        reserved = base == _header.METADATA_KEY  # the header's metadata slot: always suffixed
        if len(idx) < 2 and not reserved:
            continue
        idx.sort(key=lambda i: [_entry_order(e) for e in paths[i]])
        suffix = 0
        for i in idx if reserved else idx[1:]:
            suffix += 1
            while f"{base}~{suffix}" in taken:
                suffix += 1
            names[i] = f"{base}~{suffix}"
            taken.add(names[i])
    return names


def is_nnx_variable(x: object) -> bool:
    """Whether ``x`` is a flax NNX ``Variable`` (never imports flax: an object can be one only
    once the caller imported it)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


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
            return node if not kids and keep(name or ROOT_NAME) else None
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
        return node if keep(name or ROOT_NAME) else None
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
    """
    is_variable = is_nnx_variable

    def outer_leaf(x: Any) -> bool:
        return is_variable(x) or (is_leaf is not None and is_leaf(x))

    outer, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=outer_leaf)
    paths: list[tuple[KeyEntry, ...]] = []
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
        names = assign_names(paths)
    else:
        names = [join_path(p) for p in paths]
        stored = [i for i, x in enumerate(leaves) if not structural(x)]
        deduped = dedupe_names([names[i] for i in stored], [paths[i] for i in stored])
        for i, name in zip(stored, deduped):
            names[i] = name
    return TargetLeaves(
        names,
        leaves,
        lambda values: jax.tree_util.tree_unflatten(treedef, values),
    )
