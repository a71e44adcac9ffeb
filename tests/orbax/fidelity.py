"""Helpers of the differential tests against Orbax (issue 16): save one tree both ways, restore
both, compare leaf by leaf.

:func:`assert_same_restore` compares tree structure, type, dtype, shape, sharding (kind, device
set, mesh, partition spec), memory kind and value. The installed Orbax is the reference: where
Orbax releases differ, :func:`as_newest_orbax` and the probes below say what it does.
"""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

# --------------------------------------------------------------------------- the comparison


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def describe(x: Any) -> dict[str, Any]:
    """Everything a restore decides about one leaf, comparable with ``==`` (value aside)."""
    if isinstance(x, jax.Array):
        s = x.sharding
        out: dict[str, Any] = {
            "type": "jax.Array",
            "dtype": str(x.dtype),
            "shape": tuple(x.shape),
            "sharding": type(s).__name__,
            "devices": sorted(d.id for d in s.device_set),
            "memory_kind": s.memory_kind,
        }
        if is_key(x):
            out["key_impl"] = str(jax.random.key_impl(x))
        if isinstance(s, NamedSharding):
            out["mesh"] = dict(s.mesh.shape)
            out["axis_types"] = [t.name for t in s.mesh.axis_types]
            out["mesh_devices"] = [d.id for d in s.mesh.devices.flat]
            out["spec"] = tuple(s.spec)
        return out
    if isinstance(x, (np.ndarray, np.generic)):
        return {"type": type(x).__name__, "dtype": str(x.dtype), "shape": tuple(x.shape)}
    return {"type": type(x).__name__}


def _value(x: Any) -> Any:
    if is_key(x):
        return np.asarray(jax.random.key_data(x))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x)
    return x


def _flat(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    # None and Orbax's PLACEHOLDER count as leaves, so that skipped leaves are compared too.
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or x is ...)


def assert_same_restore(ours: Any, theirs: Any) -> None:
    """Our restore and Orbax's agree: same structure (node types included) and, per leaf, same
    type, dtype, shape, sharding, memory kind and value."""
    (flat_ours, def_ours), (flat_theirs, def_theirs) = _flat(ours), _flat(theirs)
    assert def_ours == def_theirs, f"tree structure: ours {def_ours}, Orbax {def_theirs}"
    for (path, a), (_, b) in zip(flat_ours, flat_theirs):
        key = jax.tree_util.keystr(path)
        assert describe(a) == describe(b), f"{key}: ours {describe(a)}, Orbax {describe(b)}"
        va, vb = _value(a), _value(b)
        if isinstance(vb, np.ndarray):
            np.testing.assert_array_equal(va, vb, err_msg=key)
        else:
            assert va == vb or (va is vb), f"{key}: ours {va!r}, Orbax {vb!r}"


# --------------------------------------------------------------------------- what the installed Orbax does

# The older supported Orbax releases differ from the newest in a few places. The library keeps
# the newest Orbax's semantics on every stack (issue 16 is written against orbax-checkpoint
# 0.12.8); where the installed Orbax is older, the tests below say so explicitly.

# A ShapeDtypeStruct target leaf without a sharding. orbax-checkpoint 0.12.8
# (checkpoint_utils.py:531, construct_restore_args) gives RestoreArgs(restore_type=np.ndarray,
# dtype=...): a numpy array of the target's dtype, also for a saved Python scalar (issue 16
# point 11). orbax-checkpoint 0.11.11 (checkpoint_utils.py:447) gives RestoreArgs(dtype=...)
# without a restore type, so the saved kind's handler decides: ScalarHandler.deserialize
# (type_handlers.py:749) returns `r.item()`, a Python scalar, and a saved jax.Array comes back
# in its saved shape whatever the target's. Probed here on the installed Orbax's own helper.
ORBAX_SDS_TARGET_GIVES_NDARRAY = (
    ocp.checkpoint_utils.construct_restore_args({"v": jax.ShapeDtypeStruct((), np.int32)})[
        "v"
    ].restore_type
    is not None
)


def as_newest_orbax(want: Any, item: Any) -> Any:
    """Orbax's StandardRestore(item) result as orbax-checkpoint 0.12.8 gives it: on an Orbax
    older than that (see ``ORBAX_SDS_TARGET_GIVES_NDARRAY``), a Python scalar restored into a
    sharding-less ShapeDtypeStruct is the 0-d numpy array of the struct's dtype it has already
    been cast to. The identity on an Orbax with the newest semantics."""
    if ORBAX_SDS_TARGET_GIVES_NDARRAY:
        return want

    def leaf(target: Any, value: Any) -> Any:
        if (
            isinstance(target, jax.ShapeDtypeStruct)
            and target.sharding is None
            and type(value) in (int, float, bool)
        ):
            return np.asarray(value, dtype=target.dtype)
        return value

    return jax.tree.map(leaf, item, want, is_leaf=lambda x: x is None or x is ...)


@functools.cache
def orbax_restores_typed_key_targets() -> bool:
    """Whether the installed Orbax restores a typed PRNG key into a ShapeDtypeStruct target.

    orbax-checkpoint 0.11.11 cannot: StandardRestore(jax.eval_shape(...)) or a
    ``ocp.utils.to_shape_dtype_struct`` target (which it makes of the key's own dtype) fails
    with ``TypeError: Cannot interpret 'key<fry>' as a data type``; without a target it
    restores the key. Newer ones (0.11.40, 0.12.8) give the typed key, and so do we on every
    stack (issue 16 point 3). Probed on the installed Orbax with a real save and restore.
    """
    tree = {"k": jax.random.key(0)}
    with tempfile.TemporaryDirectory() as root:
        mngr = save_manager(Path(root), ocp.args.StandardSave(tree))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mngr.restore(0, args=ocp.args.StandardRestore(jax.eval_shape(lambda: tree)))
        except TypeError:
            return False
        finally:
            mngr.close()
    return True


# --------------------------------------------------------------------------- saving both ways


def save_manager(root: Path, args: Any) -> ocp.CheckpointManager:
    mngr = ocp.CheckpointManager(root)
    mngr.save(0, args=args)
    mngr.wait_until_finished()
    return mngr


def save_both(
    tmp_path: Path, tree: Any, *, orbax: str = "standard"
) -> tuple[ocp.CheckpointManager, ocp.CheckpointManager]:
    """(Orbax's manager, ours), each holding step 0: ``tree`` saved by Orbax's StandardSave
    (``orbax="standard"``) or PyTreeSave, and by SafetensorsSave."""
    save = ocp.args.StandardSave if orbax == "standard" else ocp.args.PyTreeSave
    theirs = save_manager(tmp_path / f"orbax_{orbax}", save(tree))
    ours = save_manager(tmp_path / "ours", osf.SafetensorsSave(tree))
    return theirs, ours


def restore_orbax(
    theirs: ocp.CheckpointManager,
    *,
    item: Any = None,
    restore_args: Any = None,
    standard: bool = True,
) -> Any:
    """Orbax's restore of step 0: no args when ``item`` and ``restore_args`` are None, else
    ``StandardRestore(item)`` or ``PyTreeRestore(item, restore_args)``."""
    if item is None and restore_args is None:
        return theirs.restore(0)
    if standard:
        args: Any = ocp.args.StandardRestore(item)
    else:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Orbax warns about sharding-less restore args
        restored = theirs.restore(0, args=args)
    return as_newest_orbax(restored, item) if standard else restored


def restore_ours(ours: ocp.CheckpointManager, *, item: Any = None, restore_args: Any = None) -> Any:
    """Our restore of step 0 with the same arguments (no args when both are None)."""
    if item is None and restore_args is None:
        return ours.restore(0)
    return ours.restore(0, args=osf.SafetensorsRestore(item=item, restore_args=restore_args))


def restore_both(
    theirs: ocp.CheckpointManager,
    ours: ocp.CheckpointManager,
    *,
    item: Any = None,
    restore_args: Any = None,
    standard: bool = True,
) -> tuple[Any, Any]:
    """(ours, Orbax's) restores of step 0 with the same target (see :func:`restore_orbax`)."""
    want = restore_orbax(theirs, item=item, restore_args=restore_args, standard=standard)
    return restore_ours(ours, item=item, restore_args=restore_args), want


def make_mesh() -> jax.sharding.Mesh:
    return devices.mesh((2, 4), ("a", "b"))


def sharded_array() -> jax.Array:
    return jax.device_put(
        jnp.arange(32, dtype=jnp.float32).reshape(4, 8), NamedSharding(make_mesh(), P("a", "b"))
    )
