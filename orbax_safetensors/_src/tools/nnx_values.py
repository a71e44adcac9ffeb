"""How Orbax stores an ``nnx.Variable`` (a ``{"value": x}`` dict), and which of those dicts
``convert`` and ``diff`` collapse so names match ``nnx.state(model)`` here.

Orbax-native items record nothing NNX-specific: ``StandardSave(nnx.state(model))`` writes
``layers.0.kernel.value``, the same as a plain dict ``{"layers": {"0": {"kernel": {"value":
x}}}}`` would. So, by default (``unwrap=None``):

1. an item ``convert`` wrote from safetensors records, in its Orbax ``custom_metadata``
   (``{"orbax_safetensors": {"nnx_variables": [...]}}``), the dotted Orbax names of the leaves
   that were NNX Variables; exactly those dicts are collapsed again, so a round trip through
   Orbax-native is the identity;
2. any other item is read as an ``nnx.State`` when every one of its leaves is the only entry
   of a ``{"value": ...}`` dict below the item's root (what Orbax writes for a state of
   Variables), and then every such dict is collapsed; otherwise none is.

``unwrap=True`` collapses every ``{"value": x}`` dict around a leaf; ``unwrap=False`` none.

Example::

    paths = unwrapped_paths(source, None)      # {("linear1", "kernel"), ...}
    tree = unwrap(source.tree, paths)          # {"linear1": {"kernel": ArrayMetadata...}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.storage import confine as _confine

RECORD_KEY = "orbax_safetensors"  # our entry of an Orbax item's custom_metadata
VARIABLES_KEY = "nnx_variables"  # its list of the dotted names of NNX Variable leaves
VALUE = "value"

Path = tuple[Any, ...]  # raw keys: dict keys and sequence indices


def raw_path(keypath: Iterable[Any]) -> Path:
    """A jax key path as plain keys (``DictKey('a')`` -> ``'a'``, ``SequenceKey(0)`` -> 0)."""
    out = []
    for entry in keypath:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                out.append(getattr(entry, attr))
                break
        else:
            out.append(str(entry))
    return tuple(out)


def recorded_variables(item: Any) -> list[str] | None:
    """The dotted Orbax names of the NNX Variable leaves ``convert`` recorded in an Orbax
    item's custom metadata, or None when it recorded nothing (an item Orbax wrote itself)."""
    path = _steps.absolute(item) / _steps.ORBAX_METADATA_FILE
    try:
        doc = json.loads(_confine.read_file(path))
    except (OSError, ValueError, RecursionError):
        return None
    custom = doc.get("custom_metadata") if isinstance(doc, dict) else None
    record = custom.get(RECORD_KEY) if isinstance(custom, dict) else None
    names = record.get(VARIABLES_KEY) if isinstance(record, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def custom_metadata(variable_names: Iterable[str]) -> dict[str, Any]:
    """The custom metadata ``convert`` writes into an Orbax item: which leaves (dotted Orbax
    names, ending in ``.value``) were NNX Variables."""
    return {RECORD_KEY: {VARIABLES_KEY: sorted(variable_names)}}


def _wrapped(paths: Iterable[Path], parents: Mapping[Path, Any]) -> list[Path]:
    # The parents of leaves that are the only "value" entry of a dict.
    out = []
    for path in paths:
        if path and path[-1] == VALUE:
            parent = parents.get(path[:-1])
            if isinstance(parent, dict) and len(parent) == 1:
                out.append(path[:-1])
    return out


def _dicts(tree: Any, path: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    if isinstance(tree, dict):
        out[path] = tree
        for k, v in tree.items():
            out.update(_dicts(v, (*path, k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_dicts(v, (*path, i)))
    return out


def unwrapped_paths(
    leaves: Mapping[str, Path], tree: Any, unwrap: bool | None, recorded: list[str] | None
) -> set[Path]:
    """The paths of the ``{"value": x}`` dicts to collapse (see the module docstring).

    Args:
      leaves: every leaf's raw key path in ``tree``, by dotted Orbax name.
      tree: the Orbax item's tree (metadata leaves).
      unwrap: True: every such dict; False: none; None: the recorded ones, else all of them
        when every leaf is wrapped so.
      recorded: :func:`recorded_variables` of the item.
    """
    if unwrap is False:
        return set()
    parents = _dicts(tree)
    candidates = _wrapped(leaves.values(), parents)
    if unwrap:
        return set(candidates)
    if recorded is not None:
        wanted = {leaves[n] for n in recorded if n in leaves}
        return set(_wrapped(wanted, parents))
    if leaves and len(candidates) == len(leaves) and () not in candidates:
        return set(candidates)  # an nnx.State (a lone {"value": x} item is not one)
    return set()


def unwrap(tree: Any, paths: set[Path], path: Path = ()) -> Any:
    """``tree`` with the dict at each of ``paths`` replaced by its ``"value"`` entry."""
    if path in paths and isinstance(tree, dict):
        return tree[VALUE]
    if isinstance(tree, dict):
        return {k: unwrap(v, paths, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(unwrap(v, paths, (*path, i)) for i, v in enumerate(tree))
    return tree


def mark_variables(node: _schema.Node, paths: set[Path], path: Path = ()) -> _schema.Node:
    """The schema ``node`` of an unwrapped tree with the leaf at each of ``paths`` recorded as
    an NNX Variable (``var``), as a save of ``nnx.state`` records it: converting back to Orbax
    wraps exactly those leaves again."""
    if path in paths:
        return _schema.VarNode(node)
    if isinstance(node, _schema.DictNode):
        return _schema.DictNode(
            node.keys,
            tuple([mark_variables(c, paths, (*path, k)) for k, c in zip(node.keys, node.children)]),
        )
    if isinstance(node, (_schema.ListNode, _schema.TupleNode)):
        return _schema.with_children(
            node,
            tuple([mark_variables(c, paths, (*path, i)) for i, c in enumerate(node.children)]),
        )
    return node


def renamed(leaves: Mapping[str, Path], paths: set[Path]) -> dict[str, str]:
    """Each Orbax leaf name mapped to its name once the dicts at ``paths`` are collapsed
    (``linear1.kernel.value`` -> ``linear1.kernel``), as a save of the unwrapped tree names
    it."""
    orbax_names = list(leaves)
    new_paths = [p[:-1] if p[:-1] in paths and p and p[-1] == VALUE else p for p in leaves.values()]
    return dict(zip(orbax_names, _tree.assign_names([_keys(p) for p in new_paths])))


def _keys(path: Path) -> tuple[Any, ...]:
    from jax.tree_util import DictKey, SequenceKey

    return tuple(SequenceKey(k) if isinstance(k, int) else DictKey(k) for k in path)
