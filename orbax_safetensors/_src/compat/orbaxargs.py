"""Orbax's restore args (``ocp.RestoreArgs``, ``ocp.ArrayRestoreArgs``) as restore target
leaves, recognised and read without importing Orbax.

``load_file`` and ``restore_directory`` take them in a target, as the Orbax handlers do, but the
restore pipeline lies below the Orbax layer and must not import Orbax (lint contract
``orbax-free``, which covers this module too). Their class is looked up in ``sys.modules``: such
an object exists only once its maker imported Orbax, so the lookup is exact, imports nothing and
needs no registration. (A translation hook installed by the Orbax layer, the other way, would
hold only after that layer is imported, which a caller of ``load_file`` alone never does.)
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np

_restore_args: type | None = None  # Orbax's class, once Orbax is imported


def is_restore_args(x: object) -> bool:
    """Whether ``x`` is Orbax's ``RestoreArgs`` (``ArrayRestoreArgs`` is one); imports nothing."""
    global _restore_args
    if _restore_args is None:
        _restore_args = getattr(sys.modules.get("orbax.checkpoint"), "RestoreArgs", None)
        if _restore_args is None:
            return False
    return isinstance(x, _restore_args)


def restore_args_request(arg: Any) -> dict[str, Any]:
    """What an Orbax ``RestoreArgs`` asks for, as the keyword arguments of the pipeline's
    ``LeafRequest`` (``build`` by its value), with Orbax's meaning: ``restore_type`` names the
    type to return (numpy arrays and Python scalars stay on the host, as ``PyTreeRestore``
    returns them; None: the saved type; anything else: a ``jax.Array`` on the args' sharding,
    converted from Orbax's sharding metadata or built from ``mesh`` and ``mesh_axes``);
    ``ArrayRestoreArgs(strict=False)`` pads or truncates to its ``global_shape``.

    Raises:
      ValueError: Orbax's sharding metadata that this job's devices cannot reproduce.
    """
    shape = getattr(arg, "global_shape", None)
    shape = tuple(shape) if shape is not None else None
    dtype = np.dtype(arg.dtype) if getattr(arg, "dtype", None) is not None else None
    restore_type = getattr(arg, "restore_type", None)
    pad = getattr(arg, "strict", True) is False
    if isinstance(restore_type, type) and issubclass(restore_type, np.ndarray):
        return {"build": "numpy", "shape": shape, "dtype": dtype, "pad_or_truncate": pad}
    if restore_type in (bool, int, float):
        return {"build": "python", "shape": (), "pytype": restore_type}
    if restore_type is str:
        return {"build": "str", "shape": ()}
    sharding = getattr(arg, "sharding", None)
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        # Orbax's ShardingMetadata (from item_metadata), known by its method: converted as
        # Orbax converts it.
        to_jax = getattr(sharding, "to_jax_sharding", None)
        if callable(to_jax):
            sharding = to_jax()
    mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
    if sharding is None and mesh is not None and axes is not None:
        sharding = jax.sharding.NamedSharding(mesh, axes)
    if restore_type is None and sharding is None:
        return {"build": "saved", "shape": shape, "dtype": dtype, "pad_or_truncate": pad}
    return {
        "build": "jax",
        "shape": shape,
        "dtype": dtype,
        "sharding": sharding,
        "needs_sharding": True,
        "pad_or_truncate": pad,
    }
