"""Tree structure and skipped leaves, differentially against Orbax (issue 25, points 8 and 9).

Each test saves the same tree through Orbax's own handler and through ours (real managers,
real files), restores both with the same arguments, and compares the results leaf by leaf
with ``assert_same_restore`` of ``tests/orbax/fidelity.py`` (structure, type, dtype, shape,
sharding, value), or checks that both refuse:

- a TrainState saved with one optimizer, restored into another optimizer's state, is refused
  (the tree structures differ), naming ``partial_restore=True`` (point 8);
- ``None``, empty nodes and ``PLACEHOLDER`` stand for a saved leaf, not a subtree, and a
  target key the checkpoint lacks (or a saved key the target lacks) is a mismatch even when
  one side is ``None`` or empty;
- a ``PLACEHOLDER`` in the item stays one when ``restore_args`` covers it; a leaf saved as
  ``optax.MaskedNode`` comes back as None under a full target; a ``PyTreeRestore`` item's
  leaves (Python scalars too) only mark positions; ``partial_restore`` with omitted and
  unexpected keys at once (point 9).
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from fidelity import assert_same_restore, restore_both, save_both
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf
from orbax_safetensors._src.core.errors import MismatchKind

S = jax.ShapeDtypeStruct
_ORBAX = tuple(
    int(x) for x in re.findall(r"\d+", importlib.metadata.version("orbax-checkpoint"))[:3]
)
_NEWER = pytest.mark.skipif(
    _ORBAX < (0, 11, 40),
    reason=f"orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')} has no "
    "PyTreeRestore(partial_restore=) (0.11.40 and newer)",
)


def _orbax_refuses(mngr: ocp.CheckpointManager, args: Any) -> str:
    """Orbax's error text for restoring step 0 with ``args`` (fails if it restores)."""
    with warnings.catch_warnings(), pytest.raises(ValueError) as err:
        warnings.simplefilter("ignore")
        mngr.restore(0, args=args)
    return str(err.value)


def _ours_refuses(mngr: ocp.CheckpointManager, args: Any) -> osf.TargetMismatchError:
    with pytest.raises(osf.TargetMismatchError) as err:
        mngr.restore(0, args=args)
    return err.value


def _mixed(root: Path, tree: Any) -> ocp.CheckpointManager:
    """Ours, in a manager that also takes Orbax's args (``osf.handler_registry``)."""
    mngr = ocp.CheckpointManager(root, handler_registry=osf.handler_registry())
    mngr.save(0, args=osf.SafetensorsSave(tree))
    mngr.wait_until_finished()
    return mngr


def _restore(mngr: ocp.CheckpointManager, args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Orbax warns about sharding-less restore args
        return mngr.restore(0, args=args)


# --------------------------------------------------------------------------- point 8


def _train_states() -> tuple[Any, Any]:
    from flax.training import train_state

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    adamw = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    sgd = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    return adamw, sgd


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "eval_shape"])
def test_point8_another_optimizers_state_is_refused_like_standard_restore(tmp_path, abstract):
    saved, other = _train_states()
    theirs, ours = save_both(tmp_path, saved)
    target = jax.eval_shape(lambda: other) if abstract else other
    text = _orbax_refuses(theirs, ocp.args.StandardRestore(target))
    assert "opt_state" in text  # (0.11.40 and newer also name partial_restore=True)
    error = _ours_refuses(ours, osf.SafetensorsRestore(target))
    assert "partial_restore=True" in str(error) and "opt_state.0" in str(error)
    kinds = {m.key: m.kind for m in error.mismatches}
    assert kinds["opt_state.0"] is MismatchKind.STRUCTURE  # sgd's EmptyState, adamw's moments
    assert kinds["opt_state.2"] is MismatchKind.UNEXPECTED  # adamw's chain is longer


def test_point8_the_v1_api_words_the_refusal_in_its_context_option(tmp_path):
    if not hasattr(ocp, "v1") or _ORBAX < (0, 12, 8):
        pytest.skip(f"orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')}: no v1 API")
    from orbax.checkpoint import v1

    saved, other = _train_states()
    ctx = v1.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        v1.save(tmp_path / "ckpt", {"state": saved.params, "opt": saved.opt_state})
        with pytest.raises(osf.TargetMismatchError) as err:
            v1.load(
                tmp_path / "ckpt",
                jax.eval_shape(lambda: {"state": other.params, "opt": other.opt_state}),
            )
    assert "partial_load = True" in str(err.value) and "partial_restore" not in str(err.value)


@_NEWER
def test_point8_partial_restore_takes_what_the_target_names(tmp_path):
    """A deliberate difference: Orbax's partial restore still refuses chains of another
    length ("Length mismatch"); ours restores the parameters and gives the target's own
    optimizer state back, as partial_restore=True asks (nothing read for it)."""
    saved, other = _train_states()
    theirs, ours = save_both(tmp_path, saved, orbax="pytree")
    _orbax_refuses(theirs, ocp.args.PyTreeRestore(other, partial_restore=True))
    got = _restore(ours, osf.SafetensorsRestore(other, partial_restore=True))
    assert got.opt_state == other.opt_state and int(got.step) == 0
    np.testing.assert_array_equal(np.asarray(got.params["w"]), np.asarray(saved.params["w"]))


# --------------------------------------------------------------------------- structure

_SAVED = {"a": jnp.ones(2), "b": {"c": jnp.arange(3.0)}, "n": None, "e": {}}
_FULL = {"a": S((2,), jnp.float32), "b": {"c": S((3,), jnp.float32)}, "n": None, "e": {}}

# name -> a target both refuse (Orbax's StandardRestore, our SafetensorsRestore)
REFUSED = {
    "None-where-nothing-saved": {**_FULL, "z": None},
    "empty-dict-where-nothing-saved": {**_FULL, "z": {}},
    "None-over-a-subtree": {**_FULL, "b": None},
    "MaskedNode-over-a-subtree": {**_FULL, "b": optax.MaskedNode()},
    "saved-empty-dict-missing": {k: v for k, v in _FULL.items() if k != "e"},
    "saved-None-missing": {k: v for k, v in _FULL.items() if k != "n"},
    "array-over-a-subtree": {**_FULL, "b": S((3,), jnp.float32)},
    "subtree-over-an-array": {**_FULL, "a": {"x": S((2,), jnp.float32)}},
}


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory) -> tuple[ocp.CheckpointManager, ocp.CheckpointManager]:
    return save_both(tmp_path_factory.mktemp("structure"), _SAVED)


@pytest.mark.parametrize("name", list(REFUSED))
def test_structure_mismatches_are_refused_as_orbax_refuses_them(saved_pair, name):
    theirs, ours = saved_pair
    target = REFUSED[name]
    _orbax_refuses(theirs, ocp.args.StandardRestore(target))
    error = _ours_refuses(ours, osf.SafetensorsRestore(target))
    assert error.mismatches and "partial_restore=True" in str(error)
    ours.restore(0, args=osf.SafetensorsRestore(target, partial_restore=True))  # the fix named


def test_none_over_a_saved_leaf_reads_nothing_as_orbax(saved_pair):
    theirs, ours = saved_pair
    target = {**_FULL, "a": None, "b": {"c": optax.MaskedNode()}}
    assert_same_restore(*restore_both(theirs, ours, item=target))


def test_the_message_names_the_structure_and_the_fix(saved_pair):
    _, ours = saved_pair
    error = _ours_refuses(ours, osf.SafetensorsRestore({**_FULL, "b": None}))
    assert "b: the target has None, the checkpoint a subtree" in str(error)
    with pytest.raises(osf.TargetMismatchError, match=r"b: the target has None.*strict=False"):
        osf.restore_directory(ours.directory / "0" / "default", {**_FULL, "b": None})
    lenient = osf.restore_directory(
        ours.directory / "0" / "default", {**_FULL, "b": None}, strict=False
    )
    assert lenient["b"] is None


# --------------------------------------------------------------------------- point 9


def test_point9_placeholder_in_the_item_stays_when_restore_args_cover_it(tmp_path):
    tree = {"a": jnp.ones(2), "b": jnp.arange(3), "c": 5}
    theirs, ours = save_both(tmp_path, tree, orbax="pytree")
    item = {"a": ocp.PLACEHOLDER, "b": ocp.PLACEHOLDER, "c": 0}
    restore_args = {"a": ocp.ArrayRestoreArgs(), "b": ocp.RestoreArgs(), "c": ocp.RestoreArgs()}
    got, want = restore_both(theirs, ours, item=item, restore_args=restore_args, standard=False)
    assert_same_restore(got, want)
    assert got["a"] is ocp.PLACEHOLDER and got["b"] is ocp.PLACEHOLDER and got["c"] == 5


def test_point9_placeholder_over_a_subtree_is_refused(tmp_path):
    theirs, ours = save_both(tmp_path, _SAVED, orbax="pytree")
    item = {**_FULL, "b": ocp.PLACEHOLDER}
    _orbax_refuses(theirs, ocp.args.PyTreeRestore(item))
    _ours_refuses(ours, osf.SafetensorsRestore(item))


def test_point9_placeholder_where_nothing_is_saved(tmp_path):
    theirs, ours = save_both(tmp_path, _SAVED, orbax="pytree")
    item = {**_FULL, "z": ocp.PLACEHOLDER}
    got = ours.restore(0, args=osf.SafetensorsRestore(item))
    assert got["z"] is ocp.PLACEHOLDER  # the newest Orbax's answer, on every stack
    if _ORBAX >= (0, 12, 8):
        assert_same_restore(got, _restore(theirs, ocp.args.PyTreeRestore(item)))


def test_point9_masked_node_saved_gives_none_under_a_full_target(tmp_path):
    saved = {"mu": {"w": jnp.ones((2, 3)), "b": optax.MaskedNode()}, "n": None}
    full = {"mu": {"w": S((2, 3), jnp.float32), "b": S((3,), jnp.float32)}}
    full["n"] = S((2,), jnp.float32)
    theirs, ours = save_both(tmp_path, saved, orbax="pytree")
    want = _restore(theirs, ocp.args.PyTreeRestore(full))
    got = _restore(ours, osf.SafetensorsRestore(full))
    assert_same_restore(got, want)
    assert got["mu"]["b"] is None and got["n"] is None
    # StandardRestore: orbax-checkpoint 0.11.11 gives None too; 0.12.8 refuses ("not found in
    # metadata_tree"). Ours gives None through either args (PyTreeRestore's answer).
    mixed = _mixed(tmp_path / "mixed", saved)
    assert_same_restore(_restore(mixed, ocp.args.StandardRestore(full)), want)


def test_point9_a_pytree_restore_items_leaves_only_mark_positions(tmp_path):
    mesh = devices.mesh((2, 4), ("a", "b"))
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("a", "b")))
    tree = {"x": x, "n": np.arange(3, dtype=np.int16), "s": 5, "f": 2.5, "v": jnp.ones(2)}
    theirs, _ = save_both(tmp_path, tree, orbax="pytree")
    ours = _mixed(tmp_path / "mixed", tree)
    for item in (
        {"x": 0, "n": 0, "s": 0, "f": 0, "v": 0.0},  # Python scalars: positions only
        {
            "x": S((4, 8), jnp.float16, sharding=NamedSharding(mesh, P(None, "b"))),
            "n": np.zeros(3, np.float32),
            "s": 0.0,
            "f": np.zeros((), np.float32),
            "v": True,
        },
    ):
        want = _restore(theirs, ocp.args.PyTreeRestore(item))
        got = _restore(ours, ocp.args.PyTreeRestore(item))
        assert_same_restore(got, want)
    assert got["x"].dtype == jnp.float32 and got["x"].sharding.spec == P("a", "b")


@_NEWER
@pytest.mark.parametrize("through", ["SafetensorsRestore", "PyTreeRestore"])
def test_point9_partial_restore_with_omitted_and_unexpected_keys(tmp_path, through):
    tree = {"a": jnp.ones(2), "b": {"c": jnp.arange(3), "d": np.ones(2)}, "s": 3}
    theirs, _ = save_both(tmp_path, tree, orbax="pytree")
    ours = _mixed(tmp_path / "mixed", tree)
    kept = np.full(4, 7.0)
    item = {  # omits "b.d" and "s"; "z", "b.q" and "new" are not saved
        "a": S((2,), jnp.float32),
        "b": {"c": S((3,), jnp.int32), "q": S((5,), jnp.float32)},
        "z": kept,
        "new": {"w": S((2, 2), jnp.float32)},
    }
    want = _restore(theirs, ocp.args.PyTreeRestore(item, partial_restore=True))
    if through == "PyTreeRestore":
        got = _restore(ours, ocp.args.PyTreeRestore(item, partial_restore=True))
    else:
        got = _restore(ours, osf.SafetensorsRestore(item, partial_restore=True))
    assert_same_restore(got, want)
    assert got["z"] is kept and got["b"]["q"] is item["b"]["q"]


# --------------------------------------------------------------------------- the standalone API


def test_load_file_still_takes_orbaxs_restore_args_and_placeholder(tmp_path):
    """Recognised without importing Orbax (``compat/orbaxcompat.py``) and translated into the
    pipeline's neutral leaves before a target is matched."""
    path = tmp_path / "x.safetensors"
    osf.save_file({"a": jnp.arange(3.0), "b": np.ones(2, np.int16), "c": jnp.ones(4)}, path)
    target = {
        "a": ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float16),
        "b": ocp.PLACEHOLDER,
        "c": ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(devices.take(2)[1])),
    }
    got = osf.load_file(path, target)
    assert type(got["a"]) is np.ndarray and got["a"].dtype == np.float16
    assert got["b"] is ocp.PLACEHOLDER
    assert got["c"].devices() == {jax.devices()[1]}
    got = osf.restore_directory(
        _mixed(tmp_path / "m", {"a": jnp.arange(3.0)}).directory / "0" / "default",
        {"a": ocp.PLACEHOLDER},
    )
    assert got == {"a": ocp.PLACEHOLDER}
