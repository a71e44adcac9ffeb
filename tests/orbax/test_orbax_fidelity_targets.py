"""Differential tests against Orbax (issue 16): every target form against every saved kind, and
further cases. The few deliberate differences are listed in ``DELIBERATE`` with their reasons
and checked as such.

Saved both ways and compared as described in ``test_orbax_fidelity.py``.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import fidelity  # (tests/orbax/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf

# --------------------------------------------------------------------------- target forms x saved kinds


SAVED_KINDS = {
    "jax_sharded": fidelity.sharded_array,
    "jax_one_device": lambda: jax.device_put(jnp.arange(4, dtype=jnp.int32), jax.devices()[0]),
    "numpy_int64": lambda: np.array([2**40, 7]),
    "numpy_0d_float64": lambda: np.array(1e300),
    "python_int": lambda: 5,
    "python_float": lambda: 2.5,
    "python_bool": lambda: True,
    "key": lambda: jax.random.key(0),
}


def _sds(v: Any, dtype: Any = None, sharding: Any = None) -> jax.ShapeDtypeStruct:
    shape = np.shape(jax.random.key_data(v))[:-1] if fidelity.is_key(v) else np.shape(v)
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


# (saved kind, target form) restoring a float onto an integer dtype it does not fit: our cast is
# jax's (saturating, docs/restore-targets.md); TensorStore's is C's undefined conversion.
JAX_CASTS = {("numpy_0d_float64", "sds_int32_scalar")}


if not fidelity.ORBAX_SDS_TARGET_GIVES_NDARRAY:
    # orbax-checkpoint 0.11.11 (checkpoint_utils.py:447, see fidelity.ORBAX_SDS_TARGET_GIVES_NDARRAY)
    # restores a saved jax.Array into a sharding-less ShapeDtypeStruct of another shape in its
    # saved shape; 0.12.8 refuses, and we report the mismatch on every stack.
    for _kind in ("jax_sharded", "jax_one_device"):
        DELIBERATE[(_kind, "sds_int32_scalar")] = (
            "orbax-checkpoint 0.11.11 ignores the target's shape () and returns the saved "
            "array; we report the shape mismatch (TargetMismatchError), as 0.12.8 refuses"
        )

# (saved kind, target form) that orbax-checkpoint 0.11.11 refuses only because it cannot
# restore typed keys into a ShapeDtypeStruct (see fidelity.orbax_restores_typed_key_targets); newer
# Orbax and we give the typed key as saved.
NEWER_ORBAX_RESTORES = {("key", "sds")}


@pytest.fixture(scope="module")
def saved_kinds(tmp_path_factory) -> dict[str, tuple[Any, ocp.CheckpointManager, ...]]:
    out = {}
    for name, make in SAVED_KINDS.items():
        root = tmp_path_factory.mktemp(name)
        tree = {"v": make()}
        standard = fidelity.save_manager(root / "orbax_standard", ocp.args.StandardSave(tree))
        pytree = fidelity.save_manager(root / "orbax_pytree", ocp.args.PyTreeSave(tree))
        ours = fidelity.save_manager(root / "ours", osf.SafetensorsSave(tree))
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
        want = fidelity.restore_orbax(theirs, standard=orbax_kind == "standard", **kwargs)
    except Exception:  # Orbax refuses: so must we (with our clearer error)
        want = None
    if (kind, form) in DELIBERATE:
        expect = pytest.raises(osf.TargetMismatchError) if want is not None else nullcontext()
        with expect:
            fidelity.restore_ours(ours, **kwargs)
        return
    if want is None and (kind, form) in NEWER_ORBAX_RESTORES:
        assert not fidelity.orbax_restores_typed_key_targets()  # the newer Orbax restores it
        fidelity.assert_same_restore(fidelity.restore_ours(ours, **kwargs), {"v": value})
        return
    if want is None:
        with pytest.raises((osf.TargetMismatchError, ValueError, TypeError)):
            fidelity.restore_ours(ours, **kwargs)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # casts that overflow, as Orbax's do
        got = fidelity.restore_ours(ours, **kwargs)
    if (kind, form) in JAX_CASTS:
        assert type(got["v"]) is type(want["v"]) and got["v"].dtype == want["v"].dtype
        expected = np.asarray(jnp.asarray(value).astype(want["v"].dtype))
        np.testing.assert_array_equal(np.asarray(got["v"]), expected)
        return
    fidelity.assert_same_restore(got, want)


# --------------------------------------------------------------------------- more cases


def test_construct_restore_args_from_a_sharded_target(tmp_path):
    # The PyTreeCheckpointHandler idiom: restore args built by Orbax's own helper.
    tree = {"x": fidelity.sharded_array(), "n": np.arange(4, dtype=np.int64), "i": 3, "f": 0.5}
    theirs, ours = fidelity.save_both(tmp_path, tree, orbax="pytree")
    other = NamedSharding(fidelity.make_mesh(), P(None, ("a", "b")))
    target = dict(tree, x=jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=other))
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    got, want = fidelity.restore_both(
        theirs, ours, item=target, restore_args=restore_args, standard=False
    )
    fidelity.assert_same_restore(got, want)
    assert got["x"].sharding == other


def test_optax_state_without_target(tmp_path):
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.masked(optax.adam(1e-3), {"w": True, "b": False})
    )
    state = {"params": params, "opt": opt.init(params), "step": 4}
    theirs, ours = fidelity.save_both(tmp_path, state)
    got, want = fidelity.restore_both(theirs, ours)
    # Deliberate: Orbax gives a saved tuple back as a list; we keep the tuple.
    assert isinstance(got["opt"], tuple) and isinstance(want["opt"], list)
    fidelity.assert_same_restore(_tuples_as_lists(got), want)


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
    theirs, ours = fidelity.save_both(tmp_path, tree)
    fidelity.assert_same_restore(*fidelity.restore_both(theirs, ours))
    fidelity.assert_same_restore(
        *fidelity.restore_both(theirs, ours, item=jax.eval_shape(lambda: tree))
    )


def test_checkpointer_without_manager(tmp_path):
    tree = {"x": fidelity.sharded_array(), "n": np.array([2**40]), "k": jax.random.key(3)}
    # An Orbax that cannot restore typed keys into a target (orbax-checkpoint 0.11.11, see
    # fidelity.orbax_restores_typed_key_targets) is compared without "k"; ours is then checked against
    # the saved key, which is what newer Orbax gives.
    with_keys = fidelity.orbax_restores_typed_key_targets()
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
        fidelity.assert_same_restore(got["k"], tree["k"])
        want = dict(want, k=tree["k"])
    fidelity.assert_same_restore(got, want)
