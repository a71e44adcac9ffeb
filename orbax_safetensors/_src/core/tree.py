"""The pytree codec: any pytree <-> ``{dotted_name: array}`` plus a lossless JSON schema.

Naming rule (a public contract): a leaf's name joins its key path with ``.``; a dict key gives
the key as text, a sequence index its decimal index, an attribute or namedtuple field its name.
``{"layers": [{"w": x}]}`` gives ``layers.0.w``. Flax NNX ``Variable`` wrappers are transparent
(``nnx.state(model)`` and ``nnx.to_pure_dict`` give the same names). Names that collide once
joined (``{"a.b": x, "a": {"b": y}}``, ``{1: x, "1": y}``) get a ``~N`` suffix, chosen the same
way on save and on load.

The schema records the containers (dict with int or str keys, list, tuple, None, custom nodes by
their key entries), Python scalars inline, typed PRNG keys with their impl, and aliases (the same
array object at several leaves is stored once). It never names a class to import: custom node
types are rebuilt only from a caller's target. This module knows nothing of files or Orbax.

Example::

    flat = flatten({"layers": [{"w": np.ones(2)}], "step": 3})
    flat.arrays            # {"layers.0.w": array([1., 1.])}
    unflatten(flat.schema, flat.arrays)   # {"layers": [{"w": ...}], "step": 3}
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core.errors import DeletedArrayError, SchemaError, UnsupportedLeafError

SCHEMA_FORMAT = "orbax-safetensors/tree"
SCHEMA_VERSION = 1
ROOT_NAME = "value"  # the name of a tree that is a single leaf
_MAX_DEPTH = 256

KeyEntry = Any  # DictKey | SequenceKey | GetAttrKey | FlattenedIndexKey


# --------------------------------------------------------------------------- naming


def _entry_text(entry: KeyEntry) -> str:
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
    """The dotted name of a key path (without collision suffixes)."""
    text = ".".join(_entry_text(e) for e in path)
    return text if text else ROOT_NAME


def assign_names(paths: list[tuple[KeyEntry, ...]]) -> list[str]:
    """Unique dotted names for ``paths``; colliding ones get ``~1``, ``~2``... deterministically."""
    names = [".".join([_entry_text(e) for e in p]) or ROOT_NAME for p in paths]  # join_path
    return _dedupe(names, paths)


def _dedupe(names: list[str], paths: list[tuple[KeyEntry, ...]]) -> list[str]:
    # ``names`` are the joined ``paths``; gives the colliding ones their suffixes, in place.
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


# --------------------------------------------------------------------------- leaf kinds


def _is_nnx_variable(x: object) -> bool:
    # No object can be an NNX Variable unless flax.nnx was imported by the caller, so the
    # (slow, ~2 s) import is never triggered from here.
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def is_prng_key(x: object) -> bool:
    """Whether ``x`` is a typed PRNG key array (or a ShapeDtypeStruct of one)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if isinstance(dtype, np.dtype):  # every array's dtype but a key's: the quick answer
        return False
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


# The array kind of each leaf type seen: "jax", "scalar" (numpy scalar), "numpy", or "" for
# types that are no array. One dict lookup per leaf instead of several isinstance checks (a
# type's answer never changes); the few types a program uses are kept.
_KIND_OF_TYPE: dict[type, str] = {}


def _array_kind(x: object) -> str:
    kind = _KIND_OF_TYPE.get(type(x))
    if kind is None:
        if isinstance(x, jax.Array):
            kind = "jax"
        elif isinstance(x, np.generic):
            kind = "scalar"
        elif isinstance(x, np.ndarray):
            kind = "numpy"
        else:
            kind = ""
        _KIND_OF_TYPE[type(x)] = kind
    return kind


# numpy dtypes of whole bytes that a tensor may have (learned as leaves pass the full check).
_STORABLE_DTYPES: set[np.dtype[Any]] = set()


# --------------------------------------------------------------------------- flatten


@dataclasses.dataclass
class FlatTree:
    """A flattened pytree.

    Attributes:
      schema: the JSON-serialisable schema (format, version, tree).
      arrays: stored tensors by name, in flatten order; aliases appear once. Values are
        ``jax.Array`` or ``np.ndarray``; typed PRNG keys are already replaced by their key data.
    """

    schema: dict[str, Any]
    arrays: dict[str, Any]


class CapturedTree:
    """A tree :func:`capture` accepted: its structure copied, its leaves checked, its stored
    arrays listed; :meth:`finish` names them and completes the schema.

    Nothing here refers to the caller's containers, so finishing later (on another thread, after
    the caller changed its dicts) gives the tree as it was captured. The arrays themselves are
    the caller's: copy them (see ``pipeline.snapshots.iter_snapshots``) before they may change.

    Attributes:
      arrays: the stored arrays in order (aliases once; typed PRNG keys as their key data).
      dtypes, shapes: each stored array's dtype and shape, read at capture.
      names: each stored array's dotted name before collision suffixes (see :meth:`finish`).
    """

    __slots__ = (
        "_names",
        "_pending",
        "_stored",
        "_tree",
        "_values",
        "arrays",
        "dtypes",
        "names",
        "shapes",
    )

    def __init__(
        self,
        tree_node: dict[str, Any],
        pending: list[tuple[dict[str, Any], tuple[KeyEntry, ...]]],
        names: list[str],
        values: list[Any],
        stored: list[int],
        dtypes: list[Any],
        shapes: list[tuple[int, ...]],
    ) -> None:
        self._tree, self._pending, self._names, self._values = tree_node, pending, names, values
        self._stored = stored
        self.arrays = [values[i] for i in stored]
        self.names = [names[i] for i in stored]
        self.dtypes, self.shapes = dtypes, shapes

    def stored_nodes(self) -> list[dict[str, Any]]:
        """The schema node of each stored array, in the order of ``arrays`` (a tensor's or a
        PRNG key's; the caller may add fields to them)."""
        return [self._pending[i][0] for i in self._stored]

    def finish(self) -> FlatTree:
        """The named schema and arrays. (Names the captured schema nodes in place: a second
        call gives an equal FlatTree over the same nodes.)"""
        pending, values = self._pending, self._values
        names = _dedupe(list(self._names), [path for _, path in pending])
        arrays: dict[str, Any] = {}
        for (node, _), name, value in zip(pending, names, values):
            node["name"] = name
            if node["t"] in ("tensor", "key"):
                arrays[name] = value
        for node, _ in pending:  # resolve alias indices into the aliased tensor's name
            if node["t"] == "ref" and isinstance(node["of"], int):
                node["of"] = pending[node["of"]][0]["name"]
        schema = {"format": SCHEMA_FORMAT, "version": SCHEMA_VERSION, "tree": self._tree}
        return FlatTree(schema, arrays)


def flatten(tree: Any) -> FlatTree:
    """Flattens ``tree`` into dotted names and a lossless schema: ``capture(tree).finish()``.

    Raises:
      UnsupportedLeafError: naming the first leaf that cannot be stored (before any I/O).
      DeletedArrayError (a ValueError): naming a ``jax.Array`` that has been deleted (donated).
    """
    return capture(tree).finish()


def capture(tree: Any) -> CapturedTree:
    """Walks ``tree`` once: copies its structure, checks every leaf, lists the stored arrays.

    Raises:
      UnsupportedLeafError: naming the first leaf that cannot be stored (before any I/O).
      DeletedArrayError (a ValueError): naming a ``jax.Array`` that has been deleted (donated).
    """
    pending: list[tuple[dict[str, Any], tuple[KeyEntry, ...]]] = []  # (leaf node, key path)
    names: list[str] = []  # each pending leaf's joined path (collisions not yet suffixed)
    values: list[Any] = []  # each pending leaf's value (a key's key data)
    stored: list[int] = []  # pending indices of the stored arrays, with their dtype and shape
    dtypes: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    first_by_id: dict[int, int] = {}
    kind_of = _KIND_OF_TYPE
    storable = _STORABLE_DTYPES

    # Names are joined on the way down (``name`` is the parent's; None at the root), as
    # join_path would join each leaf's path.

    def array_leaf(x: Any, kind: str, path: tuple[KeyEntry, ...], name: str | None) -> Any:
        node: dict[str, Any]
        if id(x) in first_by_id and kind != "scalar":
            node = {"t": "ref", "of": first_by_id[id(x)]}
        else:
            dtype = x.dtype
            if isinstance(dtype, np.dtype) and dtype in storable:  # _array_node's quick answer
                node = {"t": "tensor", "array": kind}
            else:
                node = _array_node(x, kind, path)
            if kind == "jax" and x.is_deleted():
                raise DeletedArrayError(deleted_message(join_path(path), x))
            first_by_id[id(x)] = len(pending)
            stored.append(len(pending))
            if node["t"] == "key":
                x = jax.random.key_data(x)  # now: the caller may donate the key array
                dtype = x.dtype
            dtypes.append(dtype)
            shapes.append(x.shape)
        pending.append((node, path))
        names.append(name or ROOT_NAME)
        values.append(x)
        return node

    def leaf(x: Any, path: tuple[KeyEntry, ...], name: str | None) -> dict[str, Any]:
        kind = _array_kind(x)
        if kind:  # numpy scalars, np.float64 too, go here
            return array_leaf(x, kind, path, name)  # type: ignore[no-any-return]
        node: dict[str, Any]
        if x is None:
            return {"t": "none"}
        elif isinstance(x, bool):
            node = {"t": "bool", "v": x}
        elif isinstance(x, int):
            node = {"t": "int", "v": x}
        elif isinstance(x, float):
            node = {"t": "float", "v": x.hex()}
        elif isinstance(x, str):
            node = {"t": "str", "v": x}
        else:
            raise UnsupportedLeafError(
                f"leaf {join_path(path)!r} of type {type(x).__module__}.{type(x).__qualname__} "
                "cannot be stored: leaves must be arrays, Python int/float/bool/str or None"
            )
        pending.append((node, path))
        names.append(name or ROOT_NAME)
        values.append(x)
        return node

    def child(
        c: Any, path: tuple[KeyEntry, ...], name: str | None, text: str, depth: int
    ) -> dict[str, Any]:
        # A container's child at ``path`` (its entry already appended): arrays of a known type
        # go straight to array_leaf, the common case in large trees.
        name = text if name is None else f"{name}.{text}"
        kind = kind_of.get(type(c))
        if kind and depth < _MAX_DEPTH:  # (else walk raises, naming the depth)
            return array_leaf(c, kind, path, name)  # type: ignore[no-any-return]
        return walk(c, path, name, depth + 1)

    def walk(x: Any, path: tuple[KeyEntry, ...], name: str | None, depth: int) -> dict[str, Any]:
        if depth > _MAX_DEPTH:
            raise UnsupportedLeafError(
                f"tree deeper than {_MAX_DEPTH} levels at {join_path(path)!r}"
            )
        if type(x) is dict:
            keys = list(x)
            for k in keys:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedLeafError(
                        f"dict key {k!r} at {join_path(path)!r}: only str and int keys are supported"
                    )
            return {
                "t": "dict",
                "k": keys,
                "v": [child(x[k], (*path, DictKey(k)), name, str(k), depth) for k in keys],
            }
        if type(x) in (list, tuple):
            return {
                "t": type(x).__name__,
                "v": [
                    child(c, (*path, SequenceKey(i)), name, str(i), depth) for i, c in enumerate(x)
                ],
            }
        if x is None or _array_kind(x) or isinstance(x, (bool, int, float, str)):
            return leaf(x, path, name)
        children: list[tuple[Any, Any]]
        if _is_nnx_variable(x):
            children = _jaxcompat.flatten_one_level_with_keys(x)
            if len(children) == 1:  # transparent: the Variable's value takes its place
                return {"t": "var", "v": walk(children[0][1], path, name, depth + 1)}
        try:
            children = _jaxcompat.flatten_one_level_with_keys(x)
        except ValueError:  # a leaf jax does not know how to flatten
            return leaf(x, path, name)
        fields = getattr(type(x), "_fields", None)
        if isinstance(x, tuple) and fields is not None and len(fields) == len(children):
            # jaxlib 0.10 names every namedtuple child after the first field; use the fields.
            children = [(GetAttrKey(f), c) for f, (_, c) in zip(fields, children)]
        if len(children) == 1 and children[0][1] is x:
            return leaf(x, path, name)
        return {
            "t": "node",
            "type": type(x).__qualname__,  # informational only: never imported
            "k": [_encode_entry(e) for e, _ in children],
            "v": [child(c, (*path, e), name, _entry_text(e), depth) for e, c in children],
        }

    tree_node = walk(tree, (), None, 0)
    return CapturedTree(tree_node, pending, names, values, stored, dtypes, shapes)


def deleted_message(name: str, x: Any) -> str:
    """The error for saving ``x``, a deleted (donated) ``jax.Array``, at ``name``."""
    return (
        f"cannot save {name!r} ({x.dtype}{list(x.shape)}): the array has been deleted "
        "(donated to a jitted function?); save before donating, or save the result"
    )


def _array_node(x: Any, kind: str, path: tuple[KeyEntry, ...]) -> dict[str, Any]:
    dtype = x.dtype
    if isinstance(dtype, np.dtype) and dtype in _STORABLE_DTYPES:  # the common case
        return {"t": "tensor", "array": kind}
    if not isinstance(dtype, np.dtype) and is_prng_key(x):  # keys have extended dtypes
        return {"t": "key", "impl": str(jax.random.key_impl(x))}
    try:  # raises early: dtype, sub-byte size
        stored = _dtypes.from_numpy(dtype)
        if _dtypes.bits(stored) % 8:
            _dtypes.nbytes(stored, x.shape)
        elif isinstance(dtype, np.dtype):
            _STORABLE_DTYPES.add(dtype)
    except UnsupportedLeafError as e:
        _dtypes.from_numpy(x.dtype, key=join_path(path))  # the same error, naming the leaf
        raise UnsupportedLeafError(f"leaf {join_path(path)!r}: {e}") from None
    return {"t": "tensor", "array": kind}


def _encode_entry(entry: KeyEntry) -> list[Any]:
    if isinstance(entry, DictKey):
        if not isinstance(entry.key, (str, int)) or isinstance(entry.key, bool):
            raise UnsupportedLeafError(
                f"node key {entry.key!r}: only str and int keys are supported"
            )
        return ["key", entry.key]
    if isinstance(entry, GetAttrKey):
        return ["attr", entry.name]
    if isinstance(entry, SequenceKey):
        return ["idx", entry.idx]
    if isinstance(entry, FlattenedIndexKey):
        return ["idx", entry.key]
    raise UnsupportedLeafError(f"unsupported pytree key entry {entry!r}")


# --------------------------------------------------------------------------- schema reading


class SchemaLeaf(NamedTuple):
    """A leaf of a stored tree: a tensor, PRNG key, alias or inline Python value (a named
    tuple: immutable, and cheap to create for trees of many leaves)."""

    name: str
    kind: str  # "tensor" | "key" | "ref" | "bool" | "int" | "float" | "str"
    node: Mapping[str, Any]

    @property
    def tensor_name(self) -> str:
        """The stored tensor holding this leaf's bytes (aliases point at their original)."""
        return str(self.node["of"]) if self.kind == "ref" else self.name


_LEAF_KINDS = frozenset(("tensor", "key", "ref", "bool", "int", "float", "str"))
_ARRAY_KINDS = frozenset(("jax", "numpy", "scalar"))


def validate_schema(schema: object, *, max_leaves: int = 10_000_000) -> dict[str, SchemaLeaf]:
    """Checks a schema read from a file and returns its leaves by name.

    Raises:
      SchemaError: naming the first problem (unknown version or kind, bad keys, duplicate names,
        aliases pointing nowhere or at another alias, trees nested too deeply).
    """
    if not isinstance(schema, dict):
        raise SchemaError("schema is not a JSON object")
    if schema.get("format") != SCHEMA_FORMAT:
        raise SchemaError(f"schema format {schema.get('format')!r} is not {SCHEMA_FORMAT!r}")
    version = schema.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SchemaError(f"schema version {version!r} is not a positive integer")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"schema version {version} is newer than this library reads ({SCHEMA_VERSION}); "
            "upgrade orbax-safetensors"
        )
    leaves: dict[str, SchemaLeaf] = {}

    def visit(node: object, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise SchemaError(f"schema tree nested deeper than {_MAX_DEPTH}")
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise SchemaError(f"schema node {str(node)[:80]!r} has no kind")
        kind = node["t"]
        if kind in ("dict", "list", "tuple", "node"):
            children = node.get("v")
            if not isinstance(children, list):
                raise SchemaError(f"schema {kind} node has no child list")
            if kind in ("dict", "node"):
                keys = node.get("k")
                if not isinstance(keys, list) or len(keys) != len(children):
                    raise SchemaError(f"schema {kind} node keys do not match its children")
                for k in keys:
                    _check_key(kind, k)
                if len({_key_id(k) for k in keys}) != len(keys):
                    raise SchemaError(f"schema {kind} node has a duplicate key in {keys[:8]!r}")
            for c in children:
                visit(c, depth + 1)
        elif kind == "var":
            visit(node.get("v"), depth + 1)
        elif kind == "none":
            pass
        elif kind in _LEAF_KINDS:
            name = node.get("name")
            if type(name) is not str:
                raise SchemaError(f"schema {kind} leaf has no name")
            if name in leaves:
                raise SchemaError(f"schema names leaf {name!r} twice")
            array = node.get("array")
            if kind != "tensor" or type(array) is not str or array not in _ARRAY_KINDS:
                _check_leaf(kind, node, name)  # (a tensor of a known array kind is fine)
            leaves[name] = SchemaLeaf(name, kind, node)
            if len(leaves) > max_leaves:
                raise SchemaError(f"schema has more than {max_leaves} leaves")
        else:
            raise SchemaError(f"schema node kind {kind!r} is unknown")

    visit(schema.get("tree"), 0)
    for leaf in leaves.values():
        if leaf.kind == "ref":
            target = leaves.get(leaf.tensor_name)
            if target is None or target.kind not in ("tensor", "key"):
                raise SchemaError(
                    f"alias {leaf.name!r} points at {leaf.tensor_name!r}, which is not a stored tensor"
                )
    return leaves


def _key_id(key: Any) -> tuple[str, Any]:
    """A hashable identity of a dict key or node key entry (``1`` and ``"1"`` differ)."""
    return (type(key).__name__, tuple(key) if isinstance(key, list) else key)


def _check_key(kind: str, key: object) -> None:
    if kind == "dict":
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise SchemaError(f"dict key {key!r} is neither str nor int")
        return
    ok = (
        isinstance(key, list)
        and len(key) == 2
        and key[0] in ("key", "attr", "idx")
        and isinstance(key[1], (str, int))
        and not isinstance(key[1], bool)
    )
    if not ok:
        raise SchemaError(f"node key entry {key!r} is malformed")


def _check_leaf(kind: str, node: Mapping[str, Any], name: str) -> None:
    v = node.get("v")
    if kind == "bool" and not isinstance(v, bool):
        raise SchemaError(f"leaf {name!r}: bool value {v!r}")
    if kind == "int" and (not isinstance(v, int) or isinstance(v, bool)):
        raise SchemaError(f"leaf {name!r}: int value {v!r}")
    if kind == "str" and not isinstance(v, str):
        raise SchemaError(f"leaf {name!r}: str value {v!r}")
    if kind == "float":
        try:
            float.fromhex(v)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            raise SchemaError(f"leaf {name!r}: float value {v!r} is not a hex float") from None
    if kind == "tensor" and node.get("array") not in ("jax", "numpy", "scalar"):
        raise SchemaError(f"leaf {name!r}: unknown array kind {node.get('array')!r}")
    if kind == "key" and not isinstance(node.get("impl"), str):
        raise SchemaError(f"leaf {name!r}: PRNG key without impl")
    if kind == "ref" and not isinstance(node.get("of"), str):
        raise SchemaError(f"alias {name!r} names no tensor")


def inline_value(leaf: SchemaLeaf) -> Any:
    """The Python value of an inline (non-tensor) leaf."""
    v = leaf.node["v"]
    return float.fromhex(v) if leaf.kind == "float" else v


def unflatten(
    schema: Mapping[str, Any],
    get: Callable[[SchemaLeaf], Any],
    leaves: Mapping[str, SchemaLeaf] | None = None,
) -> Any:
    """Rebuilds the stored tree; ``get(leaf)`` supplies each array leaf's value.

    Custom nodes come back as dicts keyed by their field names (or lists when keyed by
    index; None when empty, as Orbax restores them); NNX Variables as their values, and flax
    NNX Modules without their internal empty child (as ``nnx.to_pure_dict`` gives them). Pass a target to :func:`match_target` for the
    original node types. ``leaves`` is :func:`validate_schema`'s result for ``schema`` when the
    caller has it already (the schema is validated here otherwise).
    """
    if leaves is None:
        leaves = validate_schema(schema)

    def build(node: Mapping[str, Any]) -> Any:
        kind = node["t"]
        if kind == "dict":
            return {k: build(c) for k, c in zip(node["k"], node["v"])}
        if kind == "list":
            return [build(c) for c in node["v"]]
        if kind == "tuple":
            return tuple(build(c) for c in node["v"])
        if kind == "node":
            if not node["k"]:  # an empty custom node (optax MaskedNode): None, as Orbax gives
                return None
            if all(k[0] == "idx" for k in node["k"]):
                return [build(c) for c in node["v"]]
            return {
                k[1]: build(c) for k, c in zip(node["k"], node["v"]) if not _is_nnx_internal(k, c)
            }
        if kind == "var":
            return build(node["v"])
        if kind == "none":
            return None
        leaf = leaves[node["name"]]
        if leaf.kind in ("bool", "int", "float", "str"):
            return inline_value(leaf)
        return get(leaf)

    return build(schema["tree"])


def prune_schema(schema: Mapping[str, Any], keep: Callable[[str], bool]) -> dict[str, Any] | None:
    """``schema`` cut down to the leaves whose names ``keep`` accepts, in their saved
    containers (None: nothing kept).

    Dicts and named nodes lose the entries that hold nothing kept; lists, tuples and
    index-keyed nodes keep their length, with None where nothing is kept, so indices still
    name the same entries. A None leaf or an empty container is kept when ``keep`` accepts
    its dotted path. Leaves are not re-validated: pass the full schema's leaves (aliases may
    point at tensors that are not kept) to :func:`unflatten`.

    Example::

        pruned = prune_schema(schema, lambda name: name.startswith("params."))
    """
    drop = object()

    def visit(node: Mapping[str, Any], name: str | None) -> Any:
        kind = node["t"]
        if kind in ("dict", "list", "tuple", "node"):
            if kind in ("dict", "node"):
                texts = [str(k[1]) if kind == "node" else str(k) for k in node["k"]]
            else:
                texts = [str(i) for i in range(len(node["v"]))]
            kids = [
                visit(c, t if name is None else f"{name}.{t}") for t, c in zip(texts, node["v"])
            ]
            if not any(k is not drop for k in kids):
                return dict(node) if not kids and keep(name or ROOT_NAME) else drop
            indexed = kind in ("list", "tuple") or (
                kind == "node" and all(k[0] == "idx" for k in node["k"])
            )
            if indexed:
                out = {**node, "v": [{"t": "none"} if k is drop else k for k in kids]}
                return out
            kept = [(key, k) for key, k in zip(node["k"], kids) if k is not drop]
            return {**node, "k": [key for key, _ in kept], "v": [k for _, k in kept]}
        if kind == "var":
            inner = visit(node["v"], name)
            return drop if inner is drop else {**node, "v": inner}
        if kind == "none":
            return node if keep(name or ROOT_NAME) else drop
        return node if keep(node["name"]) else drop

    tree = visit(schema["tree"], None)
    return None if tree is drop else {**schema, "tree": tree}


def selectable_names(schema: Mapping[str, Any]) -> list[str]:
    """Every name :func:`prune_schema` asks about: the leaves', and the dotted paths of None
    leaves and empty containers."""
    names: list[str] = []

    def record(name: str) -> bool:
        names.append(name)
        return False  # keeps nothing: every name is asked about

    prune_schema(schema, record)
    return names


def _is_nnx_internal(key: list[Any], child: Mapping[str, Any]) -> bool:
    # flax.nnx's empty internal child of every Module (not the user's state), left out.
    return (
        key[0] == "attr"
        and child.get("t") == "node"
        and not child.get("k")
        and _jaxcompat.is_nnx_internal_attr(str(key[1]))
    )


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass
class TargetLeaves:
    """A restore target flattened with the naming rule; ``rebuild(values)`` gives its tree back."""

    names: list[str]
    leaves: list[Any]
    rebuild: Callable[[list[Any]], Any]


def flatten_target(target: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> TargetLeaves:
    """Flattens a restore target with jax's own pytree rules (keeping its node types)."""

    def outer_leaf(x: Any) -> bool:
        return _is_nnx_variable(x) or (is_leaf is not None and is_leaf(x))

    outer, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=outer_leaf)
    paths: list[tuple[KeyEntry, ...]] = []
    leaves: list[Any] = []
    for path, x in outer:
        if _is_nnx_variable(x):
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
    return TargetLeaves(
        assign_names(paths), leaves, lambda values: jax.tree_util.tree_unflatten(treedef, values)
    )
