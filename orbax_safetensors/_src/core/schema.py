"""The tree schema's one typed codec: JSON document <-> typed nodes, validated on the way in.

The schema (``docs/format.md``) records a saved tree's containers and leaves as JSON objects
whose ``"t"`` names their kind; here each kind is an immutable named tuple. :func:`from_json`
checks a document read from a file and raises :class:`SchemaError` naming the first problem;
:func:`to_json` writes exactly the document the format specifies, field order included.
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from orbax_safetensors._src.core.errors import SchemaError

SCHEMA_FORMAT = "orbax-safetensors/tree"
SCHEMA_VERSION = 1
MAX_DEPTH = 256  # containers nested deeper are refused, on save and on load
MAX_LEAVES = 10_000_000  # the default bound on a schema's leaves


class ArrayKind(enum.StrEnum):
    """What a stored tensor comes back as: ``jax.Array``, ``np.ndarray`` or a numpy scalar."""

    JAX = "jax"
    NUMPY = "numpy"
    SCALAR = "scalar"


class LeafKind(enum.StrEnum):
    """A schema leaf's kind (its ``"t"``): stored tensor, PRNG key, alias or an inline value."""

    TENSOR = "tensor"
    KEY = "key"
    REF = "ref"
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    STR = "str"


# (Members read once: a class attribute lookup on an Enum costs a descriptor call.)
_TENSOR, _KEY, _REF = LeafKind.TENSOR, LeafKind.KEY, LeafKind.REF
_BOOL, _INT, _STR, _FLOAT = LeafKind.BOOL, LeafKind.INT, LeafKind.STR, LeafKind.FLOAT


class EntryKind(enum.StrEnum):
    """The kind of a custom node's key entry: a mapping key, an attribute or an index."""

    KEY = "key"
    ATTR = "attr"
    IDX = "idx"


INLINE_KINDS = frozenset((LeafKind.BOOL, LeafKind.INT, LeafKind.FLOAT, LeafKind.STR))
STORED_KINDS = frozenset((LeafKind.TENSOR, LeafKind.KEY))  # leaves whose bytes are stored


# Nodes are named tuples (cheap for millions of leaves), equal only to nodes of their own kind.


class Entry(NamedTuple):
    """One key entry of a :class:`CustomNode` (JSON ``["attr", "w"]``)."""

    kind: EntryKind
    key: str | int

    @property
    def text(self) -> str:
        """The entry's text in a dotted name."""
        return str(self.key)


class Tensor(NamedTuple):
    """A stored tensor; ``cast_from``: its safetensors dtype before a save-time cast."""

    name: str
    array: ArrayKind
    cast_from: str | None = None


class PrngKey(NamedTuple):
    """A typed PRNG key array, stored as its key data; ``impl`` names the PRNG implementation."""

    name: str
    impl: str


class Alias(NamedTuple):
    """The same array object as the stored tensor or key named ``of`` (stored once)."""

    name: str
    of: str


class Inline(NamedTuple):
    """A Python bool, int, float or str kept in the schema: ``v`` its JSON value (a float as
    ``float.hex()`` text), :attr:`value` the Python value."""

    kind: LeafKind  # one of INLINE_KINDS
    name: str
    v: bool | int | str

    @property
    def value(self) -> bool | int | float | str:
        return float.fromhex(self.v) if self.kind is _FLOAT else self.v  # type: ignore[arg-type]


class DictNode(NamedTuple):
    """A ``dict`` in insertion order; int and str keys are kept apart."""

    keys: tuple[str | int, ...]
    children: tuple[Node, ...]


class ListNode(NamedTuple):
    children: tuple[Node, ...]


class TupleNode(NamedTuple):
    children: tuple[Node, ...]


class CustomNode(NamedTuple):
    """Any other pytree node, by its key entries; ``type_name`` is for people only (never
    imported; None when a file did not record it)."""

    type_name: str | None
    entries: tuple[Entry, ...]
    children: tuple[Node, ...]

    @property
    def indexed(self) -> bool:
        """Whether every entry is an index (the node reads back as a list)."""
        return all(e.kind is EntryKind.IDX for e in self.entries)


class VarNode(NamedTuple):
    """An NNX ``Variable`` holding one value: transparent for naming."""

    child: Node


class NoneNode(NamedTuple):
    """``None`` (use :data:`NONE`)."""


NONE = NoneNode()

Leaf = Tensor | PrngKey | Alias | Inline
Container = DictNode | ListNode | TupleNode | CustomNode
Node = Container | VarNode | NoneNode | Leaf
LEAF_TYPES = (Tensor, PrngKey, Alias, Inline)
_KIND_OF = {Tensor: _TENSOR, PrngKey: _KEY, Alias: _REF}  # an Inline holds its kind


def leaf_kind(leaf: Leaf) -> LeafKind:
    """A leaf node's kind (its ``"t"``)."""
    return leaf.kind if type(leaf) is Inline else _KIND_OF[type(leaf)]  # type: ignore[union-attr]


_LEAF_TYPE_SET = frozenset(LEAF_TYPES)
_NODE_TYPES = (Entry, DictNode, ListNode, TupleNode, CustomNode, VarNode, NoneNode, *LEAF_TYPES)


def _typed_eq(self: tuple[Any, ...], other: object) -> bool:
    return type(self) is type(other) and tuple.__eq__(self, other)  # type: ignore[operator]


def _typed_ne(self: tuple[Any, ...], other: object) -> bool:
    return not _typed_eq(self, other)


for _cls in _NODE_TYPES:
    _cls.__eq__ = _typed_eq  # type: ignore[method-assign, assignment]
    _cls.__ne__ = _typed_ne  # type: ignore[method-assign, assignment]
    _cls.__hash__ = tuple.__hash__  # type: ignore[method-assign, assignment]


class SchemaLeaf(NamedTuple):
    """A leaf of a stored tree by name, as :func:`from_json` lists them."""

    name: str
    kind: LeafKind
    node: Leaf

    @property
    def tensor_name(self) -> str:
        """The stored tensor holding this leaf's bytes (aliases point at their original)."""
        node = self.node
        return node.of if type(node) is Alias else self.name


class SchemaLeaves(dict[str, SchemaLeaf]):
    """:func:`from_json`'s leaves by name, with the document (``doc``) and typed tree (``tree``)
    they were read from, so that ``unflatten`` does not read that document again."""

    __slots__ = ("doc", "tree")
    doc: object
    tree: Node


@dataclasses.dataclass(frozen=True)
class Schema:
    """A whole schema document: the tree, its version, and (not compared) its leaves by name."""

    tree: Node
    leaves: Mapping[str, SchemaLeaf] = dataclasses.field(default_factory=dict, compare=False)
    version: int = SCHEMA_VERSION


# --------------------------------------------------------------------------- to JSON


def to_json(schema: Schema) -> dict[str, Any]:
    """The JSON document of ``schema`` (what files store, field order included)."""
    return {"format": SCHEMA_FORMAT, "version": schema.version, "tree": node_to_json(schema.tree)}


def node_to_json(node: Node, swap: Mapping[int, Leaf] | None = None) -> dict[str, Any]:
    """The JSON object of ``node``; ``swap``: leaves written in place of others, by ``id`` of
    the leaf they replace (how a captured tree is named without copying it first)."""
    t = type(node)
    if swap and t in _LEAF_TYPE_SET:
        node = swap.get(id(node), node)  # type: ignore[arg-type]
        t = type(node)
    if t is Tensor:
        tensor = {"t": "tensor", "array": node.array.value, "name": node.name}  # type: ignore[union-attr]
        if node.cast_from is not None:  # type: ignore[union-attr]
            tensor["cast_from"] = node.cast_from  # type: ignore[union-attr]
        return tensor
    if t is DictNode:
        return {
            "t": "dict",
            "k": list(node.keys),  # type: ignore[union-attr]
            "v": [node_to_json(c, swap) for c in node.children],  # type: ignore[union-attr]
        }
    if t is ListNode:
        return {"t": "list", "v": [node_to_json(c, swap) for c in node.children]}  # type: ignore[union-attr]
    if t is TupleNode:
        return {"t": "tuple", "v": [node_to_json(c, swap) for c in node.children]}  # type: ignore[union-attr]
    if t is CustomNode:
        assert isinstance(node, CustomNode)
        out: dict[str, Any] = {"t": "node"}
        if node.type_name is not None:
            out["type"] = node.type_name
        out["k"] = [[e.kind.value, e.key] for e in node.entries]
        out["v"] = [node_to_json(c, swap) for c in node.children]
        return out
    if t is VarNode:
        return {"t": "var", "v": node_to_json(node.child, swap)}  # type: ignore[union-attr]
    if t is NoneNode:
        return {"t": "none"}
    if t is Inline:
        return {"t": node.kind.value, "v": node.v, "name": node.name}  # type: ignore[union-attr]
    if t is Alias:
        return {"t": "ref", "of": node.of, "name": node.name}  # type: ignore[union-attr]
    if t is PrngKey:
        return {"t": "key", "impl": node.impl, "name": node.name}  # type: ignore[union-attr]
    raise TypeError(f"not a schema node: {node!r}")


# --------------------------------------------------------------------------- from JSON

_ARRAY_KINDS = {k.value: k for k in ArrayKind}
_LEAF_KINDS = {k.value: k for k in LeafKind}
_ENTRY_KINDS = {k.value: k for k in EntryKind}
_CONTAINER_KINDS = frozenset(("dict", "list", "tuple", "node"))
_new = tuple.__new__  # builds a node without its Python-level __new__ (no defaults, no checks)
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 60, 60


def _brief(obj: object) -> str:
    """A bounded repr of (possibly huge, hostile) JSON for an error message."""
    return _BRIEF.repr(obj)[:80]


def check_header(doc: object) -> int:
    """Checks a schema document's format and version; returns the version.

    Raises:
      SchemaError: not an object, another format, or a version this library cannot read.
    """
    if not isinstance(doc, dict):
        raise SchemaError("schema is not a JSON object")
    if doc.get("format") != SCHEMA_FORMAT:
        raise SchemaError(f"schema format {_brief(doc.get('format'))} is not {SCHEMA_FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SchemaError(f"schema version {_brief(version)} is not a positive integer")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"schema version {version} is newer than this library reads ({SCHEMA_VERSION}); "
            "upgrade orbax-safetensors"
        )
    return version


def from_json(doc: object, *, max_leaves: int = MAX_LEAVES, check_aliases: bool = True) -> Schema:
    """Checks a schema document read from a file and gives it typed; hostile input cannot make
    it recurse past :data:`MAX_DEPTH` or build more than it holds. ``check_aliases=False``
    accepts aliases whose tensor is not in the document (a schema cut down by ``prune_schema``).

    Raises:
      SchemaError: naming the first problem (version, kind, keys, duplicate names, aliases,
        depth, more than ``max_leaves`` leaves).
    """
    version = check_header(doc)
    assert isinstance(doc, dict)  # (check_header raised otherwise)
    parser = _Parser(max_leaves)
    tree = parser.node(doc.get("tree"), 0)
    leaves = parser.leaves
    leaves.doc, leaves.tree = doc, tree
    if check_aliases:
        for leaf in leaves.values():
            if leaf.kind is _REF:
                target = leaves.get(leaf.node.of)  # type: ignore[union-attr]
                if target is None or target.kind not in STORED_KINDS:
                    raise SchemaError(
                        f"alias {leaf.name!r} points at {leaf.tensor_name!r}, "
                        "which is not a stored tensor"
                    )
    return Schema(tree, leaves, version)


class _Parser:
    __slots__ = ("leaves", "max_leaves")

    def __init__(self, max_leaves: int) -> None:
        self.leaves = SchemaLeaves()
        self.max_leaves = max_leaves

    def node(self, obj: object, depth: int) -> Node:
        # (Hot for trees of millions of leaves: globals bound as locals, tensors and dicts
        # checked inline, nodes built by tuple.__new__; anything unusual takes the slow path.)
        leaves, max_leaves, parse = self.leaves, self.max_leaves, self.node
        new, tensor, tensor_kind, schema_leaf, array_kinds = (
            _new,
            Tensor,
            _TENSOR,
            SchemaLeaf,
            _ARRAY_KINDS,
        )
        if depth > MAX_DEPTH:
            raise SchemaError(f"schema tree nested deeper than {MAX_DEPTH}")
        kind = obj.get("t") if isinstance(obj, dict) else None
        if type(kind) is not str and not isinstance(kind, str):
            raise SchemaError(f"schema node {_brief(obj)!r} has no kind")
        assert isinstance(obj, dict)
        if kind == "dict" or kind in _CONTAINER_KINDS:
            raw = obj.get("v")
            if type(raw) is not list and not isinstance(raw, list):
                raise SchemaError(f"schema {kind} node has no child list")
            keys: tuple[Any, ...] = ()
            if kind == "dict" or kind == "node":
                raw_keys = obj.get("k")
                if not isinstance(raw_keys, list) or len(raw_keys) != len(raw):
                    raise SchemaError(f"schema {kind} node keys do not match its children")
                if kind == "dict":
                    keys = tuple(raw_keys)
                    for k in keys:
                        if type(k) is not str and type(k) is not int:
                            _dict_key(k)
                else:
                    keys = tuple([_entry(k) for k in raw_keys])
                if len(set(keys)) != len(keys):
                    raise SchemaError(
                        f"schema {kind} node has a duplicate key in {_brief(raw_keys[:8])}"
                    )
            depth += 1
            out: list[Node] = []
            add = out.append
            for c in raw:
                if type(c) is dict and c.get("t") == "tensor":  # the common leaf, inline
                    name, array = c.get("name"), c.get("array")
                    if (
                        type(name) is str
                        and type(array) is str
                        and array in array_kinds
                        and c.get("cast_from") is None
                        and name not in leaves
                        and len(leaves) < max_leaves
                    ):
                        leaf = new(tensor, (name, array_kinds[array], None))
                        leaves[name] = new(schema_leaf, (name, tensor_kind, leaf))
                        add(leaf)
                        continue
                add(parse(c, depth))
            children = tuple(out)
            if kind == "dict":
                return new(DictNode, (keys, children))
            if kind == "list":
                return new(ListNode, (children,))
            if kind == "tuple":
                return new(TupleNode, (children,))
            type_name = obj.get("type")
            if type_name is not None and type(type_name) is not str:
                raise SchemaError(f"schema node type {_brief(type_name)} is not a string")
            return CustomNode(type_name, keys, children)
        leaf_kind = _LEAF_KINDS.get(kind)
        if leaf_kind is not None:
            return self.leaf(leaf_kind, obj)
        if kind == "var":
            return VarNode(parse(obj.get("v"), depth + 1))
        if kind == "none":
            return NONE
        raise SchemaError(f"schema node kind {_brief(kind)} is unknown")

    def leaf(self, kind: LeafKind, obj: dict[str, Any]) -> Leaf:
        name = obj.get("name")
        if type(name) is not str:
            raise SchemaError(f"schema {kind} leaf has no name")
        if name in self.leaves:
            raise SchemaError(f"schema names leaf {name!r} twice")
        node = _leaf(kind, obj, name)
        self.leaves[name] = SchemaLeaf(name, kind, node)
        if len(self.leaves) > self.max_leaves:
            raise SchemaError(f"schema has more than {self.max_leaves} leaves")
        return node


def _dict_key(key: object) -> str | int:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise SchemaError(f"dict key {_brief(key)} is neither str nor int")
    return key


def _entry(key: object) -> Entry:
    if (
        isinstance(key, list)
        and len(key) == 2
        and type(key[0]) is str
        and key[0] in _ENTRY_KINDS
        and isinstance(key[1], (str, int))
        and not isinstance(key[1], bool)
    ):
        return Entry(_ENTRY_KINDS[key[0]], key[1])
    raise SchemaError(f"node key entry {_brief(key)} is malformed")


def _leaf(kind: LeafKind, obj: dict[str, Any], name: str) -> Leaf:
    if kind is _TENSOR:
        array = obj.get("array")
        array_kind = _ARRAY_KINDS.get(array) if type(array) is str else None
        if array_kind is None:
            raise SchemaError(f"leaf {name!r}: unknown array kind {_brief(array)}")
        cast_from = obj.get("cast_from")
        if cast_from is not None and type(cast_from) is not str:
            raise SchemaError(f"leaf {name!r}: cast_from {_brief(cast_from)} is not a dtype name")
        return Tensor(name, array_kind, cast_from)
    if kind is _KEY:
        impl = obj.get("impl")
        if not isinstance(impl, str):
            raise SchemaError(f"leaf {name!r}: PRNG key without impl")
        return PrngKey(name, impl)
    if kind is _REF:
        of = obj.get("of")
        if not isinstance(of, str):
            raise SchemaError(f"alias {name!r} names no tensor")
        return Alias(name, of)
    v = obj.get("v")
    if kind is _BOOL and not isinstance(v, bool):
        raise SchemaError(f"leaf {name!r}: bool value {_brief(v)}")
    if kind is _INT and (not isinstance(v, int) or isinstance(v, bool)):
        raise SchemaError(f"leaf {name!r}: int value {_brief(v)}")
    if kind is _STR and not isinstance(v, str):
        raise SchemaError(f"leaf {name!r}: str value {_brief(v)}")
    if kind is _FLOAT:
        try:
            float.fromhex(v)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            raise SchemaError(
                f"leaf {name!r}: float value {_brief(v)} is not a hex float"
            ) from None
    return Inline(kind, name, v)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- rewriting


def with_children(node: Container, children: tuple[Node, ...]) -> Container:
    """``node`` with other children (the same keys, entries and type)."""
    if isinstance(node, DictNode):
        return DictNode(node.keys, children)
    if isinstance(node, CustomNode):
        return CustomNode(node.type_name, node.entries, children)
    return type(node)(children)


def renamed(leaf: Leaf, name: str) -> Leaf:
    """``leaf`` under another name."""
    if isinstance(leaf, Tensor):
        return Tensor(name, leaf.array, leaf.cast_from)
    if isinstance(leaf, PrngKey):
        return PrngKey(name, leaf.impl)
    if isinstance(leaf, Alias):
        return Alias(name, leaf.of)
    return Inline(leaf.kind, name, leaf.v)


def map_leaves(node: Node, fn: Callable[[Leaf], Leaf]) -> Node:
    """``node`` with each leaf replaced by ``fn(leaf)``; subtrees without a changed leaf are
    shared, not copied."""
    if isinstance(node, (DictNode, ListNode, TupleNode, CustomNode)):
        old = node.children
        new = tuple([map_leaves(c, fn) for c in old])
        if all(a is b for a, b in zip(old, new)):
            return node
        return with_children(node, new)
    if isinstance(node, VarNode):
        child = map_leaves(node.child, fn)
        return node if child is node.child else VarNode(child)
    if isinstance(node, NoneNode):
        return node
    return fn(node)
