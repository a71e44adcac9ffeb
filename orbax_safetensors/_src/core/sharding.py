"""The sharding codec: a ``NamedSharding`` as JSON (mesh axes and shape, partition spec) in
``orbax_safetensors.json``, and back over this job's devices.

Example::

    desc = sharding_to_json(x.sharding)  # {"mesh_axes": ["d"], "mesh_shape": [8], "spec": ["d", None]}
    sharding = sharding_from_json(desc)  # None when this job's devices cannot form that mesh
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np


def named_sharding_json(
    axis_names: Iterable[str], mesh_shape: Iterable[Any], spec: Iterable[Any]
) -> dict[str, Any]:
    """The JSON description of a named sharding from its mesh axes, mesh shape and partition spec."""
    out = [e if e is None or isinstance(e, str) else list(e) for e in spec]
    return {"mesh_axes": list(axis_names), "mesh_shape": [int(d) for d in mesh_shape], "spec": out}


def sharding_to_json(sharding: Any) -> dict[str, Any] | None:
    """A JSON description of a ``NamedSharding`` (mesh axes and shape, partition spec), else None."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    return named_sharding_json(
        mesh.axis_names, [mesh.shape[a] for a in mesh.axis_names], sharding.spec
    )


def sharding_from_json(desc: Mapping[str, Any] | None) -> jax.sharding.Sharding | None:
    """A ``NamedSharding`` like the saved one over this job's devices, or None if impossible."""
    if not desc:
        return None
    shape = tuple(int(d) for d in desc["mesh_shape"])
    devices = jax.devices()
    if int(np.prod(shape)) != len(devices):
        return None
    mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), tuple(desc["mesh_axes"]))
    spec = [tuple(e) if isinstance(e, list) else e for e in desc["spec"]]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
