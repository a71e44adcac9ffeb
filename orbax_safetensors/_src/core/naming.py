"""The naming rule: a pytree leaf's key path as one dotted name (a public contract).

A leaf's name joins its key path with ``.``: a dict key gives the key as text, a sequence index
its decimal index, an attribute or namedtuple field its name. ``{"layers": [{"w": x}]}`` gives
``layers.0.w``; a tree that is a single leaf is named ``value``. Flax NNX ``Variable`` wrappers
are transparent. Names that collide once joined (``{"a.b": x, "a": {"b": y}}``,
``{1: x, "1": y}``) get a ``~N`` suffix, chosen the same way on save and on load.

Example::

    assign_names([(DictKey("a.b"),), (DictKey("a"), DictKey("b"))])   # ["a.b~1", "a.b"]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from orbax_safetensors._src.core import header as _header

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
    """The dotted name of a key path (without collision suffixes).

    Example::

        join_path((DictKey("layers"), SequenceKey(0), DictKey("w")))   # "layers.0.w"
    """
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
