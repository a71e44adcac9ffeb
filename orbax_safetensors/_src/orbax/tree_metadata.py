"""``TreeMetadata``: what ``SafetensorsCheckpointHandler.metadata`` returns, shaped like Orbax's.

Orbax's ``StandardCheckpointHandler.metadata`` and ``PyTreeCheckpointHandler.metadata`` return a
``TreeMetadata`` (orbax-checkpoint 0.11.11 to 0.12): a pytree over the saved tree's top-level
entries, with ``.tree`` (the saved tree) and ``.custom_metadata`` (what the save was given).
Orbax's class is private (in its internal metadata package); this one has the same public
members, so it satisfies Orbax's ``runtime_checkable`` ``TreeMetadata`` protocol and Orbax's
args (``StandardRestore``, ``PyTreeRestore``) accept it as a restore target, as do ours.

Example::

    meta = mngr.item_metadata(step)
    meta.tree["params"]["w"].shape, meta.custom_metadata
    state = mngr.restore(step, args=osf.SafetensorsRestore(meta))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey


def _fields(x: object) -> tuple[str, ...]:
    # A namedtuple's field names (its public ``_fields``), else ().
    return tuple(getattr(type(x), "_fields", ())) if isinstance(x, tuple) else ()


def _is_namedtuple(x: object) -> bool:
    return bool(_fields(x))


@jax.tree_util.register_pytree_with_keys_class
class TreeMetadata:
    """The saved tree (``jax.ShapeDtypeStruct`` leaves, inline scalars as saved) and the
    ``custom_metadata`` it was saved with.

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
