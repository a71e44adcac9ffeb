"""Shardings: the codec of a ``NamedSharding`` as JSON in ``orbax_safetensors.json`` (mesh axes
and shape, partition spec, the mesh's device ids, each distinct id list kept once in the
document's ``device_meshes`` table) and back over this job's devices; and
:class:`ShardingMemo`, facts about shardings worked out once per sharding.

JAX is imported by the functions that take shardings, not with the module: the metadata codec
validates sharding JSON for tools that never start JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from orbax_safetensors._src.core.errors import SchemaError

if TYPE_CHECKING:
    import jax

T = TypeVar("T")

# The names of jax.sharding.AxisType's members a description's ``axis_types`` may hold.
AXIS_TYPES = ("Auto", "Explicit", "Manual")


def named_sharding_json(
    axis_names: Iterable[str],
    mesh_shape: Iterable[Any],
    spec: Iterable[Any],
    device_ids: Iterable[int] | None = None,
    axis_types: Iterable[str] | None = None,
) -> dict[str, Any]:
    """The JSON description of a named sharding (device ids, if given, in mesh order; the
    mesh's axis type names, if given, recorded when some axis is not ``"Auto"``)."""
    out = [e if e is None or isinstance(e, str) else list(e) for e in spec]
    desc: dict[str, Any] = {
        "mesh_axes": list(axis_names),
        "mesh_shape": [int(d) for d in mesh_shape],
        "spec": out,
    }
    types = None if axis_types is None else [str(t) for t in axis_types]
    if types is not None and any(t != "Auto" for t in types):
        desc["axis_types"] = types  # (absent: every axis Auto, as files from before they were kept)
    if device_ids is not None:
        desc["device_ids"] = [int(i) for i in device_ids]
    return desc


def sharding_to_json(sharding: Any) -> dict[str, Any] | None:
    """The JSON description of a ``NamedSharding``, ``{"device_id": id}`` for a
    ``SingleDeviceSharding`` (see :func:`split_devices`), else None."""
    import jax
    import numpy as np

    from orbax_safetensors._src.compat import jaxcompat

    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        device: Any = next(iter(sharding.device_set))
        return {"device_id": int(device.id)}
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    ids = [d.id for d in np.asarray(mesh.devices).flat]
    return named_sharding_json(
        mesh.axis_names,
        [mesh.shape[a] for a in mesh.axis_names],
        sharding.spec,
        ids,
        jaxcompat.axis_type_names(mesh),
    )


def intern_device_ids(
    shardings: Mapping[str, dict[str, Any] | None],
) -> tuple[dict[str, dict[str, Any] | None], list[list[int]]]:
    """``shardings`` with each description's ``device_ids`` replaced by ``mesh_devices``, its
    index in the returned table of distinct id lists (the metadata's ``device_meshes``)."""
    table: list[list[int]] = []
    index: dict[tuple[int, ...], int] = {}
    by_desc: dict[int, dict[str, Any]] = {}  # equal shardings often share one description
    out: dict[str, dict[str, Any] | None] = {}
    for name, desc in shardings.items():
        if desc is None or "device_ids" not in desc:
            out[name] = desc
            continue
        done = by_desc.get(id(desc))
        if done is None:
            ids = tuple(desc["device_ids"])
            if ids not in index:
                index[ids] = len(table)
                table.append(list(ids))
            done = {k: v for k, v in desc.items() if k != "device_ids"}
            done["mesh_devices"] = index[ids]
            by_desc[id(desc)] = done
        out[name] = done
    return out, table


def split_devices(
    shardings: Mapping[str, dict[str, Any] | None],
) -> tuple[dict[str, dict[str, Any] | None], dict[str, int]]:
    """``shardings`` without the single-device descriptions, and those as tensor -> device id
    (a tensor's own ``device`` field, which readers of named shardings only ignore)."""
    devices: dict[str, int] = {}
    out: dict[str, dict[str, Any] | None] = {}
    for name, desc in shardings.items():
        if desc is not None and "device_id" in desc:
            devices[name] = int(desc["device_id"])
            desc = None
        out[name] = desc
    return out, devices


def check_sharding_json(
    desc: object, device_meshes: object = None, rank: int | None = None
) -> Sequence[Any] | None:
    """Checks a stored sharding description as :func:`sharding_from_json` reads it (the
    metadata parser runs it on every tensor, so ``verify`` and restore refuse the same ones);
    its device ids, one per mesh device, if it lists them.

    Raises:
      SchemaError: naming what is malformed.
    """
    if desc is None:
        return None
    if not isinstance(desc, dict) or not desc:
        raise SchemaError(f"sharding {desc!r} is malformed (not a mesh description)")
    shape, axes, spec = desc.get("mesh_shape"), desc.get("mesh_axes"), desc.get("spec")
    if not (isinstance(shape, list) and shape and all(type(d) is int and d >= 1 for d in shape)):
        raise SchemaError(f"sharding {desc!r} is malformed (mesh_shape is not a list of sizes)")
    if not (
        isinstance(axes, list)
        and len(axes) == len(shape)
        and all(isinstance(a, str) for a in axes)
        and len(set(axes)) == len(axes)
    ):
        raise SchemaError(
            f"sharding {desc!r} is malformed (mesh_axes are not {len(shape)} distinct names)"
        )
    if not isinstance(spec, list) or (rank is not None and len(spec) > rank):
        raise SchemaError(
            f"sharding {desc!r} is malformed (spec is not a list of at most {rank} entries)"
            if rank is not None
            else f"sharding {desc!r} is malformed (spec is not a list)"
        )
    used: list[str] = []
    for entry in spec:
        names = [] if entry is None else [entry] if isinstance(entry, str) else entry
        if not isinstance(names, list) or not all(isinstance(a, str) and a in axes for a in names):
            raise SchemaError(
                f"sharding {desc!r} is malformed (spec entry {entry!r} is not None, a mesh axis "
                "or a list of mesh axes)"
            )
        used += names
    if len(set(used)) != len(used):
        raise SchemaError(f"sharding {desc!r} is malformed (a mesh axis is used twice in spec)")
    types = desc.get("axis_types")
    if types is not None and not (
        isinstance(types, list) and len(types) == len(shape) and all(t in AXIS_TYPES for t in types)
    ):
        raise SchemaError(
            f"sharding {desc!r} is malformed (axis_types is not a list of {len(shape)} of "
            f"{', '.join(AXIS_TYPES)})"
        )
    ids = _device_ids(desc, device_meshes if isinstance(device_meshes, list) else None)
    if ids is not None and len(ids) != math.prod(shape):
        raise SchemaError(
            f"sharding {desc!r} is malformed ({len(ids)} device ids for a mesh of "
            f"{math.prod(shape)} devices)"
        )
    return ids


def device_from_json(device_id: object) -> jax.sharding.Sharding | None:
    """The ``SingleDeviceSharding`` of a saved device id when that device is this process's
    (as Orbax looks it up), else None."""
    import jax

    if type(device_id) is not int:
        raise SchemaError(f"device id {device_id!r} is not an integer")
    for device in jax.local_devices():
        if device.id == device_id:
            return jax.sharding.SingleDeviceSharding(device)
    return None


def mesh_size(desc: Mapping[str, Any]) -> int:
    """The number of devices of a described sharding's mesh."""
    return math.prod(int(d) for d in desc.get("mesh_shape") or [0])


def _device_ids(
    desc: Mapping[str, Any], device_meshes: Sequence[Any] | None
) -> Sequence[Any] | None:
    ids = desc.get("device_ids")
    if ids is None and "mesh_devices" in desc:
        i = desc["mesh_devices"]
        if (
            type(i) is not int
            or not isinstance(device_meshes, list)
            or not 0 <= i < len(device_meshes)
        ):
            raise SchemaError(f"sharding {dict(desc)!r} names no entry of device_meshes")
        ids = device_meshes[i]
    if ids is not None and not (isinstance(ids, list) and all(type(x) is int for x in ids)):
        raise SchemaError(f"sharding {dict(desc)!r}: device ids are not a list of integers")
    return ids


def sharding_from_json(
    desc: Mapping[str, Any] | None, device_meshes: Sequence[Any] | None = None
) -> jax.sharding.Sharding | None:
    """A ``NamedSharding`` like the saved one over this job's devices, or None if impossible:
    from the saved device ids when there are ids (None unless each is a device of this job and,
    with several processes, the mesh has devices of every process), else ``jax.devices()`` in
    order when their number matches the mesh size.

    Raises:
      SchemaError: a malformed description.
    """
    import jax
    import numpy as np

    from orbax_safetensors._src.compat import jaxcompat

    if not desc:
        return None
    ids = check_sharding_json(desc, device_meshes)  # (so the fields below have their types)
    shape, axes = tuple(desc["mesh_shape"]), tuple(desc["mesh_axes"])
    spec = [tuple(e) if isinstance(e, list) else e for e in desc["spec"]]
    size = math.prod(shape)
    if ids is not None:  # (as many as the mesh has devices)
        by_id = {d.id: d for d in jax.devices()}
        if any(i not in by_id for i in ids):
            return None
        devices = [by_id[i] for i in ids]
        count = jax.process_count()
        if count > 1 and len({d.process_index for d in devices}) != count:
            # A mesh that leaves out some process: that process could hold no shard of the
            # array (the same answer on every process: the job's device list is global).
            return None
    else:
        devices = jax.devices()
        if size != len(devices):
            return None
    try:
        mesh = jaxcompat.make_mesh(np.array(devices).reshape(shape), axes, desc.get("axis_types"))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    except (TypeError, ValueError) as e:
        raise SchemaError(f"sharding {desc!r} is malformed ({e})") from None


class ShardingMemo(Generic[T]):
    """Memoises ``fn(sharding)`` for one pass over many arrays: a tree of 10,000 arrays often
    has 10,000 sharding objects but a handful of distinct shardings. Looks a sharding up by
    identity first, then by value; entries keep their sharding alive (no id is reused).
    """

    def __init__(self, fn: Callable[[Any], T]) -> None:
        from orbax_safetensors._src.compat import jaxcompat

        self._fn = fn
        self._single_key = jaxcompat.single_device_key
        self._by_id: dict[int, tuple[Any, T]] = {}
        self._by_value: dict[Any, T] = {}

    def __call__(self, sharding: Any) -> T:
        hit = self._by_id.get(id(sharding))
        if hit is not None:
            return hit[1]
        # A SingleDeviceSharding keyed on its device and memory kind skips its Python __hash__
        # and __eq__; without that key, the sharding itself is the key (the same answers).
        single = self._single_key(sharding)
        key = sharding if single is None else ("single", *single)
        try:
            value = self._by_value[key]
        except KeyError:
            value = self._by_value[key] = self._fn(sharding)
        except TypeError:  # unhashable: identity only
            value = self._fn(sharding)
        self._by_id[id(sharding)] = (sharding, value)
        return value
