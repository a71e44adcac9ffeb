"""Orbax's argument conventions for saves (restore args are translated in ``restoring``).

- :func:`apply_save_args`: ``StandardSave(item, save_args)``: ``SaveArgs(dtype=...)`` casts
  before saving, as Orbax does; options that have no safetensors meaning raise.
- :func:`tree_summary`: what the args objects print instead of the arrays.

Example::

    item = apply_save_args(item, save_args)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.orbax.restoring import is_restore_args

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


# --------------------------------------------------------------------------- save_args


def args_repr(name: str, fields: list[tuple[str, str | None]]) -> str:
    """``name(field=text, ...)`` of the fields whose text is not ``None`` (an args class's
    ``__repr__``: the optional fields it was given, each summarised by its caller)."""
    return f"{name}({', '.join(f'{k}={v}' for k, v in fields if v is not None)})"


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


def _is_save_args(x: object) -> bool:
    # Orbax's SaveArgs, recognised by its fields (no Orbax import needed).
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
