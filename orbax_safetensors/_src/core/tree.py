"""The pytree codec: any pytree <-> ``{dotted_name: array}`` plus a lossless JSON schema.

Leaves are named by the naming rule (``core/rebuild.py``); the schema (``core/schema.py``)
records containers, Python scalars inline, typed PRNG keys and aliases (an array object at
several leaves is stored once), and never names a class to import. This module walks trees on
save, and re-exports the names other layers call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core.errors import DeletedArrayError, UnsupportedLeafError
from orbax_safetensors._src.core.rebuild import (
    ROOT_NAME,
    KeyEntry,
    assign_names,
    dedupe_names,
    entry_text,
    flatten_target,
    inline_value,
    is_nnx_variable,
    join_path,
    prune_schema,
    selectable_names,
    unflatten,
    validate_schema,
)
from orbax_safetensors._src.core.schema import (
    NONE,
    SCHEMA_FORMAT,
    SCHEMA_VERSION,
    Alias,
    ArrayKind,
    CustomNode,
    DictNode,
    Entry,
    EntryKind,
    Inline,
    Leaf,
    LeafKind,
    ListNode,
    Node,
    PrngKey,
    SchemaLeaf,
    Tensor,
    TupleNode,
    VarNode,
    leaf_kind,
)

# Names other layers call through this module (the tree codec's one entry point).
__all__ = [
    "SCHEMA_FORMAT",
    "ArrayKind",
    "LeafKind",
    "PrngKey",
    "SchemaLeaf",
    "Tensor",
    "assign_names",
    "flatten_target",
    "inline_value",
    "join_path",
    "prune_schema",
    "selectable_names",
    "unflatten",
    "validate_schema",
]

_MAX_DEPTH = _schema.MAX_DEPTH


# --------------------------------------------------------------------------- leaf kinds

# (Enum members read once: a class attribute lookup on an Enum costs a descriptor call.)
_JAX, _NUMPY, _SCALAR = ArrayKind.JAX, ArrayKind.NUMPY, ArrayKind.SCALAR
_BOOL, _INT, _FLOAT, _STR = LeafKind.BOOL, LeafKind.INT, LeafKind.FLOAT, LeafKind.STR


def is_prng_key(x: object) -> bool:
    """Whether ``x`` is a typed PRNG key array (or a ShapeDtypeStruct of one)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if isinstance(dtype, np.dtype):  # every array's dtype but a key's: the quick answer
        return False
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


# The array kind of each leaf type seen (None: no array): one dict lookup per leaf instead of
# several isinstance checks.
_KIND_OF_TYPE: dict[type, ArrayKind | None] = {}


def array_kind(x: object) -> ArrayKind | None:
    """What ``x`` would be stored as: a ``jax.Array``, a numpy scalar, an ``np.ndarray``, or
    None when it is no array."""
    kind = _KIND_OF_TYPE.get(type(x), False)
    if kind is False:
        if isinstance(x, jax.Array):
            kind = _JAX
        elif isinstance(x, np.generic):
            kind = _SCALAR
        elif isinstance(x, np.ndarray):
            kind = _NUMPY
        else:
            kind = None
        _KIND_OF_TYPE[type(x)] = kind
    return kind  # type: ignore[return-value]


def native_byte_order(x: Any) -> Any:
    """``x``, or a copy in the machine's byte order when ``x`` is a numpy array or scalar of
    the other one (``>f4`` from a file format): safetensors stores little-endian bytes and
    every writer takes an array's bytes as they are, so the values are kept by converting.

    Example:
      >>> native_byte_order(np.arange(2, dtype=">i4")).dtype
      dtype('int32')
    """
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        return x.astype(dtype.newbyteorder("="))
    return x


# numpy dtypes of whole bytes that a tensor may have (learned as leaves pass the full check).
_STORABLE_DTYPES: set[np.dtype[Any]] = set()


# --------------------------------------------------------------------------- flatten


@dataclasses.dataclass
class FlatTree:
    """A flattened pytree: ``schema``, the JSON document files store, and ``arrays``, the
    stored tensors by name in flatten order (aliases once; PRNG keys as their key data)."""

    schema: dict[str, Any]
    arrays: dict[str, Any]


class CapturedTree:
    """A tree :func:`capture` accepted: its structure copied, its leaves checked, its stored
    arrays listed; :meth:`finish` names them and completes the schema. Nothing refers to the
    caller's containers (finishing later gives the tree as captured); the arrays are the
    caller's own.

    Attributes:
      arrays: the stored arrays in order (aliases once; typed PRNG keys as their key data).
      dtypes, shapes: each stored array's dtype and shape, read at capture.
      names: each stored array's dotted name before collision suffixes (see :meth:`finish`).
    """

    __slots__ = (
        "_aliases",
        "_leaves",
        "_paths",
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
        tree_node: Node,
        leaves: list[Leaf],
        paths: list[tuple[KeyEntry, ...]],
        values: list[Any],
        stored: list[int],
        aliases: dict[int, int],
        dtypes: list[Any],
        shapes: list[tuple[int, ...]],
    ) -> None:
        self._tree, self._leaves, self._paths, self._values = tree_node, leaves, paths, values
        self._stored, self._aliases = stored, aliases
        self.arrays = [values[i] for i in stored]
        self.names = [leaves[i].name for i in stored]
        self.dtypes, self.shapes = dtypes, shapes

    def stored_kinds(self) -> list[LeafKind]:
        """Each stored array's kind (``TENSOR`` or ``KEY``), in the order of ``arrays``."""
        return [leaf_kind(self._leaves[i]) for i in self._stored]

    def aliases(self) -> list[tuple[int, str, int]]:
        """Each alias as ``(leaf index, its final dotted name, position in arrays of the array
        it shares)``, in flatten order (names as :meth:`finish` gives them)."""
        if not self._aliases:
            return []
        names = dedupe_names([leaf.name for leaf in self._leaves], self._paths)
        position = {leaf: k for k, leaf in enumerate(self._stored)}
        return [(i, names[i], position[j]) for i, j in sorted(self._aliases.items())]

    def untie(self, retie: Mapping[int, int]) -> CapturedTree:
        """This tree with some aliases (leaf indices from :meth:`aliases`) no longer sharing
        their array's stored tensor: ``retie[i] == i`` stores alias ``i`` as a tensor of its
        own (a copy of the leaf it shared, under its own name), ``retie[i] == k`` makes it an
        alias of ``k`` (an earlier alias stored on its own). A dtype policy that casts two
        paths of one array differently stores two tensors, as Orbax would."""
        if not retie:
            return self
        leaves, values = list(self._leaves), list(self._values)
        aliases = dict(self._aliases)
        own = sorted(i for i, k in retie.items() if i == k)
        untied: dict[int, Leaf] = {}
        for i in own:
            j = aliases.pop(i)
            values[i] = values[j]
            untied[id(leaves[i])] = leaves[i] = _schema.renamed(leaves[j], leaves[i].name)
        for i, k in retie.items():
            if i != k:
                aliases[i] = k
        # (leaves are matched by identity: equal leaves at other paths stay as they are)
        tree_node = _schema.map_leaves(self._tree, lambda leaf: untied.get(id(leaf), leaf))
        position = {leaf: k for k, leaf in enumerate(self._stored)}
        stored = sorted([*self._stored, *own])
        source = [position[i] if i in position else position[self._aliases[i]] for i in stored]
        return CapturedTree(
            tree_node,
            leaves,
            self._paths,
            values,
            stored,
            aliases,
            [self.dtypes[k] for k in source],
            [self.shapes[k] for k in source],
        )

    def finish(self, cast_from: Sequence[str | None] | None = None) -> FlatTree:
        """The named schema and arrays; ``cast_from``: each stored array's safetensors dtype
        before a save-time cast (None: not cast)."""
        leaves, stored = self._leaves, self._stored
        names = dedupe_names([leaf.name for leaf in leaves], self._paths)
        final: dict[int, Leaf] = {}  # id(captured leaf) -> its named (or cast) leaf
        for i, j in self._aliases.items():
            final[id(leaves[i])] = Alias(names[i], names[j])
        for i, (leaf, name) in enumerate(zip(leaves, names)):
            if leaf.name != name and i not in self._aliases:
                final[id(leaf)] = _schema.renamed(leaf, name)
        if cast_from is not None:
            for i, origin in zip(stored, cast_from):
                leaf = final.get(id(leaves[i]), leaves[i])
                if origin is not None and isinstance(leaf, Tensor):
                    final[id(leaves[i])] = Tensor(leaf.name, leaf.array, origin)
        values = self._values
        arrays = {names[i]: values[i] for i in stored}
        doc = {
            "format": SCHEMA_FORMAT,
            "version": SCHEMA_VERSION,
            "tree": _schema.node_to_json(self._tree, final),
        }
        return FlatTree(doc, arrays)


def flatten(tree: Any) -> FlatTree:
    """Flattens ``tree`` into dotted names and a lossless schema: ``capture(tree).finish()``
    (raising as :func:`capture` does)."""
    return capture(tree).finish()


def capture(tree: Any) -> CapturedTree:
    """Walks ``tree`` once: copies its structure, checks every leaf, lists the stored arrays.

    Raises:
      UnsupportedLeafError: naming the first leaf that cannot be stored (before any I/O).
      DeletedArrayError (a ValueError): naming a ``jax.Array`` that has been deleted (donated).
    """
    leaves: list[Leaf] = []  # each leaf but None, named by its joined path (not yet suffixed)
    paths: list[tuple[KeyEntry, ...]] = []  # each leaf's key path
    values: list[Any] = []  # each leaf's value (a key's key data)
    stored: list[int] = []  # leaf indices of the stored arrays, with their dtype and shape
    aliases: dict[int, int] = {}  # leaf index of an alias -> leaf index of its stored array
    dtypes: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    first_by_id: dict[int, int] = {}
    kind_of = _KIND_OF_TYPE
    storable = _STORABLE_DTYPES
    scalar = _SCALAR

    # Names are joined on the way down (``name`` is the parent's; None at the root), as
    # join_path would join each leaf's path.

    def array_leaf(x: Any, kind: ArrayKind, path: tuple[KeyEntry, ...], name: str) -> Leaf:
        node: Leaf
        name = name or ROOT_NAME  # ("" joins as the root's name, as join_path gives it)
        if not name.isascii():
            check_tensor_name(name, join_path(path))
        first = first_by_id.get(id(x))
        if first is not None and kind is not scalar:
            node = Alias(name, "")  # ``of`` is named by finish
            aliases[len(leaves)] = first
        else:
            first_by_id[id(x)] = len(leaves)  # the caller's object: a second path is an alias
            dtype = x.dtype
            if isinstance(dtype, np.dtype) and dtype in storable:  # _array_node's quick answer
                node = Tensor(name, kind)
            else:
                x = native_byte_order(x)
                dtype = x.dtype
                node = _array_node(x, kind, path, name)
            if kind is _JAX and x.is_deleted():
                raise DeletedArrayError(deleted_message(join_path(path), x))
            stored.append(len(leaves))
            if type(node) is PrngKey:
                x = jax.random.key_data(x)  # now: the caller may donate the key array
                dtype = x.dtype
            dtypes.append(dtype)
            shapes.append(x.shape)
        leaves.append(node)
        paths.append(path)
        values.append(x)
        return node

    def leaf(x: Any, path: tuple[KeyEntry, ...], name: str | None) -> Node:
        name = name or ROOT_NAME
        kind = array_kind(x)
        if kind:  # numpy scalars, np.float64 too, go here
            return array_leaf(x, kind, path, name)
        node: Inline
        if x is None:
            return NONE
        elif isinstance(x, bool):
            node = Inline(_BOOL, name, x)
        elif isinstance(x, int):
            node = Inline(_INT, name, x)
        elif isinstance(x, float):
            node = Inline(_FLOAT, name, x.hex())
        elif isinstance(x, str):
            node = Inline(_STR, name, x)
        else:
            raise UnsupportedLeafError(
                f"leaf {join_path(path)!r} of type {type(x).__module__}.{type(x).__qualname__} "
                "cannot be stored: leaves must be arrays, Python int/float/bool/str or None"
            )
        leaves.append(node)
        paths.append(path)
        values.append(x)
        return node

    def child(c: Any, path: tuple[KeyEntry, ...], name: str | None, text: str, depth: int) -> Node:
        # A container's child at ``path`` (its entry already appended): arrays of a known type
        # go straight to array_leaf, the common case in large trees.
        name = text if name is None else f"{name}.{text}"
        kind = kind_of.get(type(c))
        if kind and depth < _MAX_DEPTH:  # (else walk raises, naming the depth)
            return array_leaf(c, kind, path, name)
        return walk(c, path, name, depth + 1)

    def walk(x: Any, path: tuple[KeyEntry, ...], name: str | None, depth: int) -> Node:
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
            return DictNode(
                tuple(keys),
                tuple([child(x[k], (*path, DictKey(k)), name, str(k), depth) for k in keys]),
            )
        if type(x) in (list, tuple):
            kids = tuple(
                [child(c, (*path, SequenceKey(i)), name, str(i), depth) for i, c in enumerate(x)]
            )
            return ListNode(kids) if type(x) is list else TupleNode(kids)
        if x is None or array_kind(x) or isinstance(x, (bool, int, float, str)):
            return leaf(x, path, name)
        children: list[tuple[Any, Any]]
        if is_nnx_variable(x):
            children = _jaxcompat.flatten_one_level_with_keys(x)
            if len(children) == 1:  # transparent: the Variable's value takes its place
                return VarNode(walk(children[0][1], path, name, depth + 1))
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
        return CustomNode(
            type(x).__qualname__,  # informational only: never imported
            tuple([_encode_entry(e) for e, _ in children]),
            tuple([child(c, (*path, e), name, entry_text(e), depth) for e, c in children]),
        )

    tree_node = walk(tree, (), None, 0)
    return CapturedTree(tree_node, leaves, paths, values, stored, aliases, dtypes, shapes)


def check_tensor_name(name: str, leaf: str | None = None) -> None:
    """Raises ``UnsupportedLeafError`` naming ``leaf`` (its path; default ``name``) when the
    tensor name ``name`` is not valid UTF-8 (a lone surrogate, legal in a Python ``str``):
    safetensors headers are UTF-8. Every path from a tree's leaves to tensor names calls it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        where = name if leaf is None else leaf
        raise UnsupportedLeafError(
            f"leaf {where!r} cannot be stored: its name {name!r} "
            f"is not valid UTF-8 (character {name[e.start]!r} at {e.start}), and safetensors "
            "stores tensor names as UTF-8"
        ) from None


def deleted_message(name: str, x: Any) -> str:
    """The error for saving ``x``, a deleted (donated) ``jax.Array``, at ``name``."""
    return (
        f"cannot save {name!r} ({x.dtype}{list(x.shape)}): the array has been deleted "
        "(donated to a jitted function?); save before donating, or save the result"
    )


def _array_node(x: Any, kind: ArrayKind, path: tuple[KeyEntry, ...], name: str) -> Leaf:
    dtype = x.dtype
    if isinstance(dtype, np.dtype) and dtype in _STORABLE_DTYPES:  # the common case
        return Tensor(name, kind)
    if not isinstance(dtype, np.dtype) and is_prng_key(x):  # keys have extended dtypes
        return PrngKey(name, str(jax.random.key_impl(x)))
    try:  # raises early: dtype, sub-byte size
        stored = _dtypes.from_numpy(dtype)
        if _dtypes.bits(stored) % 8:
            _dtypes.nbytes(stored, x.shape)
        elif isinstance(dtype, np.dtype):
            _STORABLE_DTYPES.add(dtype)
    except UnsupportedLeafError as e:
        _dtypes.from_numpy(x.dtype, key=join_path(path))  # the same error, naming the leaf
        raise UnsupportedLeafError(f"leaf {join_path(path)!r}: {e}") from None
    return Tensor(name, kind)


def _encode_entry(entry: KeyEntry) -> Entry:
    if isinstance(entry, DictKey):
        if not isinstance(entry.key, (str, int)) or isinstance(entry.key, bool):
            raise UnsupportedLeafError(
                f"node key {entry.key!r}: only str and int keys are supported"
            )
        return Entry(EntryKind.KEY, entry.key)
    if isinstance(entry, GetAttrKey):
        return Entry(EntryKind.ATTR, entry.name)
    if isinstance(entry, SequenceKey):
        return Entry(EntryKind.IDX, entry.idx)
    if isinstance(entry, FlattenedIndexKey):
        return Entry(EntryKind.IDX, entry.key)
    raise UnsupportedLeafError(f"unsupported pytree key entry {entry!r}")
