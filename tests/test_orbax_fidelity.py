"""Differential tests against Orbax (issue 16): restores behave as StandardCheckpointHandler and
PyTreeCheckpointHandler do.

Every test saves the same tree through Orbax's own handler (``StandardSave`` / ``PyTreeSave``)
and through ``SafetensorsSave``, each with a real ``ocp.CheckpointManager``, restores both with
the same target or restore args, and compares the results leaf by leaf with one helper
(:func:`assert_same_restore`): tree structure, type, dtype, shape, sharding (kind, device set,
mesh, partition spec), memory kind and value. The installed Orbax is the reference: where
Orbax releases differ, these tests follow whichever one is installed. The few deliberate
differences are listed in ``DELIBERATE`` with their reasons and checked as such.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import typing
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

# --------------------------------------------------------------------------- the comparison


def _is_key(x: Any) -> bool:
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
        if _is_key(x):
            out["key_impl"] = str(jax.random.key_impl(x))
        if isinstance(s, NamedSharding):
            out["mesh"] = dict(s.mesh.shape)
            out["mesh_devices"] = [d.id for d in s.mesh.devices.flat]
            out["spec"] = tuple(s.spec)
        return out
    if isinstance(x, (np.ndarray, np.generic)):
        return {"type": type(x).__name__, "dtype": str(x.dtype), "shape": tuple(x.shape)}
    return {"type": type(x).__name__}


def _value(x: Any) -> Any:
    if _is_key(x):
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
        mngr = _save(Path(root), ocp.args.StandardSave(tree))
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


def _save(root: Path, args: Any) -> ocp.CheckpointManager:
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
    theirs = _save(tmp_path / f"orbax_{orbax}", save(tree))
    ours = _save(tmp_path / "ours", osf.SafetensorsSave(tree))
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


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def _sharded() -> jax.Array:
    return jax.device_put(
        jnp.arange(32, dtype=jnp.float32).reshape(4, 8), NamedSharding(_mesh(), P("a", "b"))
    )


# --------------------------------------------------------------------------- point 1


def test_point1_saved_sharding_reused_without_target(tmp_path):
    tree = {"x": _sharded(), "y": jnp.arange(3), "z": jax.device_put(jnp.ones(2), jax.devices()[3])}
    theirs, ours = save_both(tmp_path, tree)
    got, want = restore_both(theirs, ours)
    assert_same_restore(got, want)
    assert len(got["x"].sharding.device_set) == 8 and got["x"].sharding.spec == P("a", "b")
    assert got["z"].sharding == SingleDeviceSharding(jax.devices()[3])  # its saved device


def test_point1_saved_sharding_reused_for_shardless_targets(tmp_path):
    tree = {
        "x": _sharded(),
        "y": jnp.arange(3.0),
        "z": jax.device_put(jnp.ones(2), jax.devices()[5]),
    }
    theirs, ours = save_both(tmp_path, tree)
    abstract = jax.eval_shape(lambda: tree)  # ShapeDtypeStructs without shardings
    assert_same_restore(*restore_both(theirs, ours, item=abstract))
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    for args in (ocp.ArrayRestoreArgs(), ocp.RestoreArgs()):
        restore_args = dict.fromkeys(tree, args)
        got, want = restore_both(theirs, ours, restore_args=restore_args, standard=False)
        assert_same_restore(got, want)
        assert len(got["x"].sharding.device_set) == 8


def test_point1_saved_sharding_with_a_cast(tmp_path):
    tree = {"x": _sharded()}
    theirs, ours = save_both(tmp_path, tree)
    target = {"x": jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)}
    assert_same_restore(*restore_both(theirs, ours, item=target))


def _orbax_cannot_save_replicated_arrays() -> bool:
    # orbax-checkpoint 0.11.40's replica_slices.py:100 (ReplicaSlice.data, for an array
    # replicated over a mesh axis) runs `with jax.sharding.set_mesh(mesh):`, written for the
    # jax whose set_mesh is a context manager (a class in jax 0.10.2). On jax 0.7.0 it is a
    # plain setter: Orbax's save raises "TypeError: 'NoneType' object does not support the
    # context manager protocol" after setting that mesh globally, which breaks every later jit
    # on other devices in the process. orbax-checkpoint 0.11.11 has no such call.
    if isinstance(jax.sharding.set_mesh, type):
        return False
    try:
        from orbax.checkpoint._src.serialization import replica_slices
    except ImportError:
        return False
    return "with jax.sharding.set_mesh(" in inspect.getsource(replica_slices)


def test_point1_sub_mesh_of_the_job(tmp_path):
    # A mesh over 4 of the 8 devices: its devices all exist, so it is reused as saved.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[2:6]).reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P("b", None)))
    ours = _save(tmp_path / "ours", osf.SafetensorsSave({"x": x}))
    got = restore_ours(ours)
    assert_same_restore(got, {"x": x})  # exactly as saved: what Orbax gives where it can save
    assert sorted(d.id for d in got["x"].sharding.device_set) == [2, 3, 4, 5]
    if _orbax_cannot_save_replicated_arrays():
        pytest.skip(
            f"orbax-checkpoint with jax {jax.__version__}: Orbax's own save of a replicated "
            "array fails (replica_slices.py uses jax.sharding.set_mesh as a context manager, "
            "which it is in newer jax); our restore was checked against the saved array"
        )
    theirs = _save(tmp_path / "orbax_standard", ocp.args.StandardSave({"x": x}))
    assert_same_restore(got, restore_orbax(theirs))


_FEWER_DEVICES = textwrap.dedent(
    """
    import json, os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = sys.argv[1]
    import jax, numpy as np, orbax.checkpoint as ocp
    import orbax_safetensors as osf

    def restore(root, args):
        mngr = ocp.CheckpointManager(root)
        try:
            out = mngr.restore(0, args=args)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
        x = out["x"]
        return {"devices": sorted(d.id for d in x.sharding.device_set),
                "sum": float(np.asarray(x).sum())}

    theirs, ours, abstract = sys.argv[2], sys.argv[3], {"x": jax.ShapeDtypeStruct((4, 8), np.float32)}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    placed = {"x": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=sharding)}
    fallback = ocp.args.StandardRestore(abstract, fallback_sharding=sharding)
    x = osf.restore_directory(ours + "/0/default", abstract, fallback_sharding=sharding)["x"]
    print(json.dumps({
        "theirs": [restore(theirs, None), restore(theirs, ocp.args.StandardRestore(abstract)),
                   restore(theirs, ocp.args.StandardRestore(placed)), restore(theirs, fallback)],
        "ours": [restore(ours, None), restore(ours, osf.SafetensorsRestore(abstract)),
                 restore(ours, osf.SafetensorsRestore(placed)),
                 {"devices": sorted(d.id for d in x.sharding.device_set),
                  "sum": float(np.asarray(x).sum())}],
    }))
    """
)


def test_must_hold2_saved_mesh_missing_devices_falls_back_as_orbax(tmp_path):
    # Saved over 8 devices, restored by a job of 4: Orbax refuses a restore that needs the
    # saved sharding ("Topology mismatch"), and so do we, naming the tensor; with a target
    # sharding or a fallback sharding both restore the same values.
    theirs, ours = save_both(tmp_path, {"x": _sharded()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(
        [sys.executable, "-c", _FEWER_DEVICES, "4", str(theirs.directory), str(ours.directory)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    # orbax-checkpoint 0.12.8 says "Topology mismatch" (standard_checkpoint_handler.py:361)
    # in both cases. 0.11.11 refuses too, in other words: without a target from
    # metadata/sharding.py:131 ("The available devices are different ..."), and for a
    # sharding-less ShapeDtypeStruct (RestoreArgs without a sharding, checkpoint_utils.py:447)
    # from serialization.py:528. The installed Orbax's own wording is required.
    handler_source = inspect.getsource(sys.modules[ocp.StandardCheckpointHandler.__module__])
    if "Topology mismatch" in handler_source:
        orbax_says = ["Topology mismatch", "Topology mismatch"]
    else:
        orbax_says = [
            "The available devices are different from the devices used to save",
            "sharding passed to deserialization should be specified",
        ]
    for i in (0, 1):  # no target, and a ShapeDtypeStruct without a sharding
        assert res["theirs"][i]["error"] == "ValueError"
        assert orbax_says[i] in res["theirs"][i]["message"]
        assert res["ours"][i]["error"] == "TargetMismatchError"
        message = res["ours"][i]["message"]
        assert "'x'" in message and "a mesh of 8 devices" in message
        assert "this job's 4 devices cannot reproduce" in message
    placed = {"devices": [1], "sum": float(sum(range(32)))}
    assert res["ours"][2] == res["theirs"][2] == placed
    # Orbax's StandardRestore(fallback_sharding=...): osf.restore_directory(fallback_sharding=)
    if "Topology mismatch" in handler_source:
        assert res["ours"][3] == res["theirs"][3] == placed
    else:
        # orbax-checkpoint 0.11.11 applies fallback_sharding only when no target is given
        # (standard_checkpoint_handler.py:232-235, _construct_restore_args); with this
        # sharding-less target it refuses as above. We keep 0.12.8's meaning (the fallback
        # for every array whose saved sharding this job cannot reproduce, target or not).
        assert res["theirs"][3]["error"] == "ValueError"
        assert orbax_says[1] in res["theirs"][3]["message"]
        assert res["ours"][3] == placed


# --------------------------------------------------------------------------- point 2


def test_point2_numpy_leaves_keep_their_dtype(tmp_path):
    tree = {"n": np.array([2**40, 7]), "f": np.array(1e300), "x": jnp.arange(4.0)}
    theirs, ours = save_both(tmp_path, tree)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got, want = restore_both(theirs, ours, item=target)
    assert_same_restore(got, want)
    assert type(got["n"]) is np.ndarray and got["n"][0] == 2**40 and got["f"] == 1e300


def test_point2_restore_args_without_type_give_the_saved_type(tmp_path):
    tree = {"n": np.array([2**40, 7]), "f": np.array(1e300), "x": _sharded(), "i": 3}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(), tree)
    got, want = restore_both(theirs, ours, restore_args=restore_args, standard=False)
    assert_same_restore(got, want)


def test_point2_eval_shape_target_casts_as_orbax(tmp_path):
    # jax.eval_shape narrows int64/float64 to the 32-bit dtypes (without jax_enable_x64):
    # the target asks for them, and Orbax casts too.
    tree = {"n": np.array([2**40, 7]), "f": np.array(1e300), "i": 5, "fl": 2.5}
    theirs, ours = save_both(tmp_path, tree)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the float64 -> float32 overflow
        got, want = restore_both(theirs, ours, item=jax.eval_shape(lambda: tree))
    assert_same_restore(got, want)


# --------------------------------------------------------------------------- point 3


def test_point3_typed_keys_with_a_key_data_target(tmp_path):
    tree = {"k": jax.random.key(0), "ks": jax.random.split(jax.random.key(1), 3)}
    theirs, ours = save_both(tmp_path, tree)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # uint32 key data structs
    if orbax_restores_typed_key_targets():
        got, want = restore_both(theirs, ours, item=target)
        assert_same_restore(got, want)
        assert_same_restore(*restore_both(theirs, ours, item=jax.eval_shape(lambda: tree)))
    else:
        # This Orbax fails on key targets (see orbax_restores_typed_key_targets); we keep the
        # newer Orbax's result: the typed keys as saved, for both target forms.
        got = restore_ours(ours, item=target)
        assert_same_restore(got, tree)
        assert_same_restore(restore_ours(ours, item=jax.eval_shape(lambda: tree)), tree)
    assert _is_key(got["k"])
    assert_same_restore(*restore_both(theirs, ours))


def test_point3_typed_keys_with_restore_args(tmp_path):
    tree = {"k": jax.random.key(0)}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    for args in (
        ocp.RestoreArgs(),
        ocp.ArrayRestoreArgs(),
        ocp.RestoreArgs(restore_type=np.ndarray),
    ):
        got, want = restore_both(theirs, ours, restore_args={"k": args}, standard=False)
        assert_same_restore(got, want)


# --------------------------------------------------------------------------- point 6


class _Empty(typing.NamedTuple):
    pass


def test_point6_skip_markers_read_nothing(tmp_path):
    tree = {"a": jnp.ones(2), "b": {"c": jnp.zeros(3), "d": np.ones(2)}, "s": 3}
    theirs, _ = save_both(tmp_path, tree)
    handler = osf.SafetensorsCheckpointHandler()
    ours = ocp.CheckpointManager(tmp_path / "ours", item_handlers=handler)
    target = {
        "a": None,
        "b": {"c": jax.ShapeDtypeStruct((3,), jnp.float32), "d": optax.MaskedNode()},
        "s": 0,
    }
    got, want = restore_both(theirs, ours, item=target)
    assert_same_restore(got, want)
    assert handler.last_read_stats.bytes_needed == 3 * 4  # only "b.c" was read


def test_point6_placeholder(tmp_path):
    tree = {"a": jnp.ones(2), "b": {"c": jnp.zeros(3), "d": np.ones(2)}, "s": 3}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    item = {
        "a": ocp.PLACEHOLDER,
        "b": {"c": jax.ShapeDtypeStruct((3,), jnp.float32), "d": ocp.PLACEHOLDER},
        "s": 0,
    }
    assert_same_restore(*restore_both(theirs, ours, item=item, standard=False))
    restore_args = {
        "a": ocp.PLACEHOLDER,
        "b": {"c": ocp.ArrayRestoreArgs(), "d": ocp.PLACEHOLDER},
        "s": ocp.RestoreArgs(),
    }
    got, want = restore_both(theirs, ours, item=item, restore_args=restore_args, standard=False)
    assert_same_restore(got, want)
    assert got["a"] is ...


def test_point6_empty_nodes_without_target(tmp_path):
    tree = {
        "a": jnp.ones(2),
        "m": optax.MaskedNode(),
        "e": _Empty(),
        "ed": {},
        "el": [],
        "et": (),
        "n": None,
    }
    theirs, ours = save_both(tmp_path, tree)
    got, want = restore_both(theirs, ours)
    assert_same_restore(got, want)
    assert got["m"] is None and got["e"] is None
    target = {"a": jax.ShapeDtypeStruct((2,), jnp.float32), "m": optax.MaskedNode(), "n": None}
    target |= {"e": _Empty(), "ed": {}, "el": [], "et": ()}
    assert_same_restore(*restore_both(theirs, ours, item=target))


def test_point6_optax_state_with_masked_nodes(tmp_path):
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    opt = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    state = {"params": params, "opt": opt.init(params)}
    theirs, ours = save_both(tmp_path, state)
    assert_same_restore(*restore_both(theirs, ours, item=jax.eval_shape(lambda: state)))


# --------------------------------------------------------------------------- point 8


@pytest.mark.parametrize(
    "restore_type", [float, int, bool, np.ndarray], ids=["float", "int", "bool", "ndarray"]
)
@pytest.mark.parametrize("saved", [5, 2.5, True, np.float32(1.5), np.array(7)], ids=repr)
def test_point8_restore_type_for_scalars(tmp_path, saved, restore_type):
    tree = {"v": saved}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    restore_args = {"v": ocp.RestoreArgs(restore_type=restore_type)}
    assert_same_restore(*restore_both(theirs, ours, restore_args=restore_args, standard=False))


def test_point8_restore_type_for_arrays(tmp_path):
    tree = {"x": _sharded(), "n": np.arange(3, dtype=np.int16)}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    for restore_args in (
        {
            "x": ocp.RestoreArgs(restore_type=np.ndarray),
            "n": ocp.RestoreArgs(restore_type=np.ndarray),
        },
        {
            "x": ocp.RestoreArgs(restore_type=jax.Array),
            "n": ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32),
        },
        {
            "x": ocp.ArrayRestoreArgs(restore_type=np.ndarray, dtype=np.float16),
            "n": ocp.RestoreArgs(),
        },
    ):
        got, want = restore_both(theirs, ours, restore_args=restore_args, standard=False)
        assert_same_restore(got, want)


# --------------------------------------------------------------------------- point 9


def _has_pinned_host() -> bool:
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return "pinned_host" in kinds


@pytest.mark.skipif(
    not _has_pinned_host(),
    reason=f"jax {jax.__version__}: this backend's devices have no pinned_host memory",
)
def test_point9_host_offload_targets(tmp_path):
    tree = {"x": _sharded()}
    theirs, ours = save_both(tmp_path, tree)
    host = NamedSharding(_mesh(), P("a", "b")).with_memory_kind("pinned_host")
    for sharding in (host, SingleDeviceSharding(jax.devices()[2], memory_kind="pinned_host")):
        target = {"x": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=sharding)}
        got, want = restore_both(theirs, ours, item=target)
        assert_same_restore(got, want)
        assert got["x"].sharding.memory_kind == "pinned_host"


# --------------------------------------------------------------------------- point 10


def test_point10_orbax_sharding_metadata_as_restore_args(tmp_path):
    tree = {"x": _sharded()}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    metadata = theirs.item_metadata(0)
    meta_tree = metadata.tree if hasattr(metadata, "tree") else metadata
    sharding = meta_tree["x"].sharding  # Orbax's NamedShardingMetadata
    assert not isinstance(sharding, jax.sharding.Sharding)
    restore_args = {"x": ocp.ArrayRestoreArgs(sharding=sharding)}
    got, want = restore_both(theirs, ours, restore_args=restore_args, standard=False)
    assert_same_restore(got, want)
    assert got["x"].sharding.spec == P("a", "b")


# --------------------------------------------------------------------------- point 11


def test_point11_scalar_leaves_follow_the_target(tmp_path):
    from flax.training import train_state

    params = {"w": jnp.ones((2, 2))}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    state = state.replace(step=7)  # a Python int leaf
    theirs, ours = save_both(tmp_path, state)
    abstract = jax.eval_shape(lambda: state)  # step: ShapeDtypeStruct((), int32)
    got, want = restore_both(theirs, ours, item=abstract)
    assert_same_restore(got, want)
    assert type(got.step) is np.ndarray and got.step.dtype == np.int32 and got.step == 7


def test_point11_scalar_into_array_and_python_targets(tmp_path):
    tree = {"i": 5, "f": 2.5, "b": True}
    theirs, ours = save_both(tmp_path, tree)
    device = jax.devices()[1]
    for target in (
        {"i": jnp.zeros((), jnp.float32), "f": jax.device_put(jnp.zeros(()), device), "b": 0},
        {"i": np.zeros((), np.float32), "f": 0, "b": 0.0},
        {"i": 0.0, "f": jax.ShapeDtypeStruct((), jnp.float16), "b": np.zeros((), np.int8)},
    ):
        assert_same_restore(*restore_both(theirs, ours, item=target))


# --------------------------------------------------------------------------- point 13


def _orbax_pure(tree: Any) -> Any:
    # Orbax's restore of an NNX Module: Variables as {"value": x}, the Module's internal empty
    # child as None. Ours: Variables transparent, the internal child left out.
    if isinstance(tree, dict):
        if set(tree) == {"value"}:
            return tree["value"]
        internal = ("_pytree__state", "_object__state")  # flax 0.12, flax 0.11
        return {k: _orbax_pure(v) for k, v in tree.items() if k not in internal}
    return tree


def test_point13_nnx_module_as_a_plain_tree(tmp_path):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            self.count = nnx.BatchStat(jnp.zeros(()))

    model = Model()
    theirs, ours = save_both(tmp_path, model)
    got, want = restore_both(theirs, ours)
    assert_same_restore(got, _orbax_pure(want))
    # What nnx.to_pure_dict gives: usable with nnx.replace_by_pure_dict as it is.
    pure = nnx.to_pure_dict(nnx.state(model))
    assert jax.tree.structure(got) == jax.tree.structure(pure)
    other = Model()
    state = nnx.state(other)
    nnx.replace_by_pure_dict(state, got)
    nnx.update(other, state)
    np.testing.assert_array_equal(
        np.asarray(other.lin.kernel[...]), np.asarray(model.lin.kernel[...])
    )
    path = tmp_path / "model.safetensors"
    osf.save_file(model, path)
    assert_same_restore(osf.load_file(path), got)


# --------------------------------------------------------------------------- target forms x saved kinds


SAVED_KINDS = {
    "jax_sharded": _sharded,
    "jax_one_device": lambda: jax.device_put(jnp.arange(4, dtype=jnp.int32), jax.devices()[0]),
    "numpy_int64": lambda: np.array([2**40, 7]),
    "numpy_0d_float64": lambda: np.array(1e300),
    "python_int": lambda: 5,
    "python_float": lambda: 2.5,
    "python_bool": lambda: True,
    "key": lambda: jax.random.key(0),
}


def _sds(v: Any, dtype: Any = None, sharding: Any = None) -> jax.ShapeDtypeStruct:
    shape = np.shape(jax.random.key_data(v))[:-1] if _is_key(v) else np.shape(v)
    dtype = dtype or (v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# name -> (Orbax args kind, a function of the saved value giving the leaf)
TARGET_FORMS: dict[str, tuple[str, Any]] = {
    "sds": ("standard", lambda v: _sds(v)),
    "sds_float16": ("standard", lambda v: _sds(v, jnp.float16)),
    "sds_int32_scalar": ("standard", lambda v: jax.ShapeDtypeStruct((), jnp.int32)),
    "numpy_float32": ("standard", lambda v: np.zeros(np.shape(v), np.float32)),
    "python_int": ("standard", lambda v: 0),
    "python_float": ("standard", lambda v: 0.0),
    "jax_array": ("standard", lambda v: jnp.zeros(np.shape(v), jnp.float32)),
    "RestoreArgs()": ("pytree", lambda v: ocp.RestoreArgs()),
    "RestoreArgs(np.ndarray)": ("pytree", lambda v: ocp.RestoreArgs(restore_type=np.ndarray)),
    "RestoreArgs(np.ndarray, float16)": (
        "pytree",
        lambda v: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float16),
    ),
    "RestoreArgs(jax.Array)": ("pytree", lambda v: ocp.RestoreArgs(restore_type=jax.Array)),
    "RestoreArgs(int)": ("pytree", lambda v: ocp.RestoreArgs(restore_type=int)),
    "RestoreArgs(float)": ("pytree", lambda v: ocp.RestoreArgs(restore_type=float)),
    "ArrayRestoreArgs()": ("pytree", lambda v: ocp.ArrayRestoreArgs()),
    "ArrayRestoreArgs(float16)": ("pytree", lambda v: ocp.ArrayRestoreArgs(dtype=jnp.float16)),
    "ArrayRestoreArgs(np.ndarray)": (
        "pytree",
        lambda v: ocp.ArrayRestoreArgs(restore_type=np.ndarray),
    ),
}

# (saved kind, target form) -> why we deliberately differ from Orbax there.
DELIBERATE = {
    ("numpy_int64", "sds_int32_scalar"): (
        "Orbax's NumpyHandler ignores the target's shape and returns the saved (2,) array; "
        "we report the shape mismatch (TargetMismatchError naming the key)"
    ),
    ("key", "numpy_float32"): (
        "a numpy target of the key's own shape (): Orbax returns the (2,) key data ignoring "
        "the shape; we report the mismatch (a numpy target of the key data's shape gets it)"
    ),
    ("key", "ArrayRestoreArgs(float16)"): (
        "Orbax fails wrapping float16 key data; we return the typed key (a key's dtype is its "
        "impl's: the cast does not apply)"
    ),
}


if not ORBAX_SDS_TARGET_GIVES_NDARRAY:
    # orbax-checkpoint 0.11.11 (checkpoint_utils.py:447, see ORBAX_SDS_TARGET_GIVES_NDARRAY)
    # restores a saved jax.Array into a sharding-less ShapeDtypeStruct of another shape in its
    # saved shape; 0.12.8 refuses, and we report the mismatch on every stack.
    for _kind in ("jax_sharded", "jax_one_device"):
        DELIBERATE[(_kind, "sds_int32_scalar")] = (
            "orbax-checkpoint 0.11.11 ignores the target's shape () and returns the saved "
            "array; we report the shape mismatch (TargetMismatchError), as 0.12.8 refuses"
        )

# (saved kind, target form) that orbax-checkpoint 0.11.11 refuses only because it cannot
# restore typed keys into a ShapeDtypeStruct (see orbax_restores_typed_key_targets); newer
# Orbax and we give the typed key as saved.
NEWER_ORBAX_RESTORES = {("key", "sds")}


@pytest.fixture(scope="module")
def saved_kinds(tmp_path_factory) -> dict[str, tuple[Any, ocp.CheckpointManager, ...]]:
    out = {}
    for name, make in SAVED_KINDS.items():
        root = tmp_path_factory.mktemp(name)
        tree = {"v": make()}
        standard = _save(root / "orbax_standard", ocp.args.StandardSave(tree))
        pytree = _save(root / "orbax_pytree", ocp.args.PyTreeSave(tree))
        ours = _save(root / "ours", osf.SafetensorsSave(tree))
        out[name] = (tree["v"], standard, pytree, ours)
    return out


@pytest.mark.parametrize("form", list(TARGET_FORMS))
@pytest.mark.parametrize("kind", list(SAVED_KINDS))
def test_target_form_against_saved_kind(saved_kinds, kind, form):
    value, standard, pytree, ours = saved_kinds[kind]
    orbax_kind, make_leaf = TARGET_FORMS[form]
    try:
        leaf = make_leaf(value)
    except ValueError:
        pytest.skip("the target cannot be built for this value")
    theirs = standard if orbax_kind == "standard" else pytree
    if orbax_kind == "standard":
        kwargs: dict[str, Any] = {"item": {"v": leaf}}
    else:
        kwargs = {"restore_args": {"v": leaf}}
    try:
        want = restore_orbax(theirs, standard=orbax_kind == "standard", **kwargs)
    except Exception:  # Orbax refuses: so must we (with our clearer error)
        want = None
    if (kind, form) in DELIBERATE:
        expect = pytest.raises(osf.TargetMismatchError) if want is not None else nullcontext()
        with expect:
            restore_ours(ours, **kwargs)
        return
    if want is None and (kind, form) in NEWER_ORBAX_RESTORES:
        assert not orbax_restores_typed_key_targets()  # the newer Orbax restores it
        assert_same_restore(restore_ours(ours, **kwargs), {"v": value})
        return
    if want is None:
        with pytest.raises((osf.TargetMismatchError, ValueError, TypeError)):
            restore_ours(ours, **kwargs)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # casts that overflow, as Orbax's do
        got = restore_ours(ours, **kwargs)
    assert_same_restore(got, want)


# --------------------------------------------------------------------------- more cases


def test_construct_restore_args_from_a_sharded_target(tmp_path):
    # The PyTreeCheckpointHandler idiom: restore args built by Orbax's own helper.
    tree = {"x": _sharded(), "n": np.arange(4, dtype=np.int64), "i": 3, "f": 0.5}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    other = NamedSharding(_mesh(), P(None, ("a", "b")))
    target = dict(tree, x=jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=other))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    got, want = restore_both(theirs, ours, item=target, restore_args=restore_args, standard=False)
    assert_same_restore(got, want)
    assert got["x"].sharding == other


def test_optax_state_without_target(tmp_path):
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    )
    state = {"params": params, "opt": opt.init(params), "step": 4}
    theirs, ours = save_both(tmp_path, state)
    got, want = restore_both(theirs, ours)
    # Deliberate: Orbax gives a saved tuple back as a list; we keep the tuple.
    assert isinstance(got["opt"], tuple) and isinstance(want["opt"], list)
    assert_same_restore(_tuples_as_lists(got), want)


def _tuples_as_lists(tree: Any) -> Any:
    if type(tree) is tuple:
        return [_tuples_as_lists(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _tuples_as_lists(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tuples_as_lists(x) for x in tree]
    return tree


def test_aliased_arrays(tmp_path):
    shared = jnp.arange(6.0)
    tree = {"a": shared, "b": shared, "c": {"d": shared}}
    theirs, ours = save_both(tmp_path, tree)
    assert_same_restore(*restore_both(theirs, ours))
    assert_same_restore(*restore_both(theirs, ours, item=jax.eval_shape(lambda: tree)))


def test_checkpointer_without_manager(tmp_path):
    tree = {"x": _sharded(), "n": np.array([2**40]), "k": jax.random.key(3)}
    # An Orbax that cannot restore typed keys into a target (orbax-checkpoint 0.11.11, see
    # orbax_restores_typed_key_targets) is compared without "k"; ours is then checked against
    # the saved key, which is what newer Orbax gives.
    with_keys = orbax_restores_typed_key_targets()
    orbax_tree = tree if with_keys else {k: v for k, v in tree.items() if k != "k"}
    theirs = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    theirs.save(tmp_path / "theirs", args=ocp.args.StandardSave(orbax_tree))
    ours = ocp.Checkpointer(osf.SafetensorsCheckpointHandler())
    ours.save(tmp_path / "ours", args=osf.SafetensorsSave(tree))
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    got = ours.restore(tmp_path / "ours", args=osf.SafetensorsRestore(target))
    orbax_target = {k: target[k] for k in orbax_tree}
    want = theirs.restore(tmp_path / "theirs", args=ocp.args.StandardRestore(orbax_target))
    if not with_keys:
        assert_same_restore(got["k"], tree["k"])
        want = dict(want, k=tree["k"])
    assert_same_restore(got, want)
