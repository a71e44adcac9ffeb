"""Orbax's argument names and meanings, differentially (issue 16, points 4, 5, 7, 12).

Each test saves the same tree through Orbax's own handler (``StandardCheckpointHandler`` or
``PyTreeCheckpointHandler``, real files) and through ours, restores both with the same
arguments, and compares the results leaf by leaf (type, dtype, shape, value, sharding):

- ``strict`` governs shapes, as in ``StandardRestore``: ``strict=False`` pads or truncates;
- ``partial_restore`` governs keys, as in ``PyTreeRestore``;
- ``restore_args`` is merged with ``item`` (structure and shapes from ``item``; types, dtypes and
  shardings from ``restore_args``);
- ``handler.metadata`` / ``item_metadata`` return a ``TreeMetadata`` with ``.tree`` and
  ``.custom_metadata``;
- ``SafetensorsSave(save_args=..., custom_metadata=...)`` as ``StandardSave``; args print a
  summary, never the arrays.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat

S = jax.ShapeDtypeStruct
_ORBAX = tuple(
    int(x) for x in re.findall(r"\d+", importlib.metadata.version("orbax-checkpoint"))[:3]
)
# orbax-checkpoint 0.11.11 restored the saved shape whatever the target asked (strict or not);
# later versions check it, or pad and truncate with strict=False. Ours behaves as the later ones.
_ORBAX_TARGET_SHAPES = (0, 11, 40)


# --------------------------------------------------------------------------- helpers


def _mesh() -> Mesh:
    return devices.mesh((2, 4), ("x", "y"))


def _state() -> dict[str, Any]:
    return {
        "a": jnp.arange(8.0),
        "b": jnp.arange(12, dtype=jnp.int32).reshape(3, 4),
        "n": np.arange(5, dtype=np.int64),
        "s": 3,
    }


def _save_both(tmp_path: Path, state: Any, **save_kwargs: Any) -> tuple[Path, Path]:
    """``state`` saved by Orbax's StandardCheckpointHandler and by ours (sync, real files)."""
    orbax_dir, ours_dir = tmp_path / "orbax", tmp_path / "ours"
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        ckptr.save(orbax_dir, args=ocp.args.StandardSave(state, **save_kwargs))
    with ocp.Checkpointer(osf.SafetensorsCheckpointHandler()) as ckptr:
        ckptr.save(ours_dir, args=osf.SafetensorsSave(state, **save_kwargs))
    return orbax_dir, ours_dir


def _orbax_standard(path: Path, args: Any) -> Any:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ckptr.restore(path, args=args)


def _orbax_pytree(path: Path, args: Any) -> Any:
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ckptr.restore(path, args=args)


def _ours(path: Path, args: osf.SafetensorsRestore) -> Any:
    with ocp.Checkpointer(osf.SafetensorsCheckpointHandler()) as ckptr:
        return ckptr.restore(path, args=args)


def _resized(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` cut to ``shape`` and padded with zeros (what strict=False restores)."""
    host = np.asarray(x)
    out = np.zeros(shape, host.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(shape, host.shape))
    out[common] = host[common]
    return out


def _kind(x: Any) -> str:
    if isinstance(x, jax.Array):
        return "jax"
    if isinstance(x, np.ndarray):
        return "numpy"
    return type(x).__name__


def _assert_same(ours: Any, orbax: Any, *, shardings: bool = True) -> None:
    """Same structure; each leaf the same kind, dtype, shape, value (and sharding)."""
    assert jax.tree.structure(ours) == jax.tree.structure(orbax)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(orbax)):
        key = jax.tree_util.keystr(path)
        assert _kind(got) == _kind(want), (key, type(got), type(want))
        if isinstance(want, (jax.Array, np.ndarray)):
            assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
            assert got.shape == want.shape, (key, got.shape, want.shape)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=key)
        elif isinstance(want, jax.ShapeDtypeStruct):
            assert (got.shape, got.dtype) == (want.shape, want.dtype), key
        else:
            assert got == want, (key, got, want)
        if shardings and isinstance(want, jax.Array):
            assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (
                key,
                got.sharding,
                want.sharding,
            )


# --------------------------------------------------------------------------- point 4: strict


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((10,), (3, 4)), ((6,), (2, 6)), ((8,), (5, 2))],
    ids=["pad", "truncate-and-pad", "pad-rows-truncate-columns"],
)
def test_strict_false_pads_or_truncates_like_standard_restore(
    tmp_path: Path, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    target = {
        "a": S(a_shape, jnp.float32),
        "b": S(b_shape, jnp.int32),
        "n": np.zeros(5, np.int64),
        "s": 0,
    }
    got = _ours(ours_dir, osf.SafetensorsRestore(target, strict=False))
    state = _state()
    np.testing.assert_array_equal(got["a"], _resized(state["a"], a_shape))
    np.testing.assert_array_equal(got["b"], _resized(state["b"], b_shape))
    if _ORBAX >= _ORBAX_TARGET_SHAPES:
        want = _orbax_standard(orbax_dir, ocp.args.StandardRestore(target, strict=False))
        _assert_same(got, want)


def test_strict_false_pads_onto_the_target_sharding_and_dtype(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    mesh = _mesh()
    target = {
        "a": S((16,), jnp.bfloat16, sharding=NamedSharding(mesh, P(("x", "y")))),
        "b": S((4, 4), jnp.float32, sharding=NamedSharding(mesh, P("x", "y"))),
        "n": np.zeros(5, np.int64),
        "s": 0,
    }
    want = _orbax_standard(orbax_dir, ocp.args.StandardRestore(target, strict=False))
    got = _ours(ours_dir, osf.SafetensorsRestore(target, strict=False))
    _assert_same(got, want)
    assert len(got["a"].addressable_shards) == 8
    for shard in got["b"].addressable_shards:  # each device holds its box of the padded array
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want["b"])[shard.index])


def test_strict_true_refuses_another_shape_naming_key_and_the_fix(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    target = {"a": S((10,), jnp.float32), "b": S((3, 4), jnp.int32), "n": np.zeros(5, np.int64)}
    target["s"] = 0
    if _ORBAX >= _ORBAX_TARGET_SHAPES:
        with pytest.raises(ValueError, match="not compatible with the stored shape"):
            _orbax_standard(orbax_dir, ocp.args.StandardRestore(target))
    with pytest.raises(osf.TargetMismatchError) as err:
        _ours(ours_dir, osf.SafetensorsRestore(target))
    text = str(err.value)
    assert "a: checkpoint has shape (8,)" in text and "target wants (10,)" in text
    assert "strict=False" in text and "b:" not in text


def test_strict_false_keeps_the_rank(tmp_path: Path) -> None:
    """Orbax fails deep in TensorStore ("Ranks do not match"); ours names the key."""
    _, ours_dir = _save_both(tmp_path, _state())
    target = {"a": S((2, 4), jnp.float32), "b": S((3, 4), jnp.int32), "n": np.zeros(5, np.int64)}
    target["s"] = 0
    with pytest.raises(osf.TargetMismatchError, match=r"a: .*\(8,\).*\(2, 4\).*keeps the rank"):
        _ours(ours_dir, osf.SafetensorsRestore(target, strict=False))


def test_array_restore_args_strict_false_pads_that_leaf_only(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    restore_args = {
        "a": ocp.ArrayRestoreArgs(global_shape=(12,), strict=False),
        "b": ocp.ArrayRestoreArgs(),
        "n": ocp.RestoreArgs(restore_type=np.ndarray),
        "s": ocp.RestoreArgs(),
    }
    want = _orbax_pytree(orbax_dir, ocp.args.PyTreeRestore(restore_args=restore_args))
    got = _ours(ours_dir, osf.SafetensorsRestore(restore_args=restore_args))
    _assert_same(got, want, shardings=False)  # no sharding given: point 1 of issue 16
    assert got["a"].shape == (12,)


# --------------------------------------------------------------------------- partial_restore


def test_partial_restore_restores_only_the_items_keys(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    item = {"a": S((8,), jnp.float32), "n": np.zeros(5, np.int64)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    want = _orbax_pytree(orbax_dir, orbaxcompat.pytree_partial_restore(item, restore_args))
    args = osf.SafetensorsRestore(item, restore_args=restore_args, partial_restore=True)
    got = _ours(ours_dir, args)
    _assert_same(got, want)
    assert set(got) == {"a", "n"}


@pytest.mark.skipif(_ORBAX < (0, 11, 40), reason="PyTreeRestore(partial_restore=) is newer")
def test_partial_restore_returns_a_missing_target_leaf_as_given(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    kept = jnp.full((2,), 7.0)
    item = {"a": S((8,), jnp.float32), "new_head": S((3,), jnp.float32), "kept": kept}
    want = _orbax_pytree(orbax_dir, ocp.args.PyTreeRestore(item, partial_restore=True))
    got = _ours(ours_dir, osf.SafetensorsRestore(item, partial_restore=True))
    _assert_same(got, want, shardings=False)
    assert got["new_head"] == item["new_head"] and got["kept"] is kept


def test_without_partial_restore_a_subset_is_an_error_naming_every_key(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    item = {"a": S((8,), jnp.float32), "extra": S((2,), jnp.float32)}
    with pytest.raises(ValueError):
        _orbax_standard(orbax_dir, ocp.args.StandardRestore(item))
    with pytest.raises(osf.TargetMismatchError) as err:
        _ours(ours_dir, osf.SafetensorsRestore(item))
    text = str(err.value)
    assert "extra" in text and "b, n, s" in text and "partial_restore=True" in text


def test_strict_false_from_older_code_says_what_changed(tmp_path: Path) -> None:
    """``SafetensorsRestore(strict=False)`` used to skip keys: the error names the new way."""
    _, ours_dir = _save_both(tmp_path, _state())
    with pytest.raises(osf.TargetMismatchError) as err:
        _ours(ours_dir, osf.SafetensorsRestore({"a": S((8,), jnp.float32)}, strict=False))
    text = str(err.value)
    assert "partial_restore=True" in text and "no longer skips keys" in text


def test_load_file_keeps_strict_for_keys(tmp_path: Path) -> None:
    """The standalone API keeps the safetensors / PyTorch meaning of ``strict``."""
    path = tmp_path / "x.safetensors"
    osf.save_file({"a": np.arange(4.0), "b": np.ones(2)}, path)
    out = osf.load_file(path, target={"a": np.zeros(4)}, strict=False)
    assert set(out) == {"a"}
    with pytest.raises(osf.TargetMismatchError, match=r"\(4,\).*\(6,\)"):
        osf.load_file(path, target={"a": np.zeros(6)}, strict=False)  # never pads


# --------------------------------------------------------------------------- point 7: restore_args


def test_restore_args_are_trimmed_to_item(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    item = {"a": 0}
    restore_args = {
        "a": ocp.ArrayRestoreArgs(dtype=jnp.bfloat16, sharding=NamedSharding(_mesh(), P("x"))),
        "b": ocp.ArrayRestoreArgs(),
    }
    want = _orbax_pytree(orbax_dir, orbaxcompat.pytree_partial_restore(item, restore_args))
    args = osf.SafetensorsRestore(item, restore_args=restore_args, partial_restore=True)
    got = _ours(ours_dir, args)
    _assert_same(got, want)
    assert set(got) == {"a"} and got["a"].dtype == jnp.bfloat16


@pytest.mark.skipif(_ORBAX < (0, 11, 40), reason="0.11.11 ignores item's dtype and shape")
def test_restore_args_take_shape_and_dtype_from_item_types_and_shardings_from_themselves(
    tmp_path: Path,
) -> None:
    mesh = _mesh()
    orbax_dir, ours_dir = _save_both(tmp_path, _state())
    item = {
        "a": S((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),  # its sharding: unused
        "b": np.zeros((3, 4), np.int32),
        "n": S((5,), jnp.int64),
        "s": 0,
    }
    restore_args = {
        "a": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P("x"))),
        "b": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P(None, "y"))),
        "n": ocp.RestoreArgs(restore_type=np.ndarray),
        "s": ocp.RestoreArgs(),
    }
    want = _orbax_pytree(orbax_dir, ocp.args.PyTreeRestore(item, restore_args=restore_args))
    got = _ours(ours_dir, osf.SafetensorsRestore(item, restore_args=restore_args))
    _assert_same(got, want)
    assert got["a"].dtype == jnp.bfloat16 and got["a"].sharding.spec == P("x")
    assert isinstance(got["b"], jax.Array) and isinstance(got["n"], np.ndarray)


def test_restore_args_lacking_an_item_key_is_an_error(tmp_path: Path) -> None:
    _, ours_dir = _save_both(tmp_path, _state())
    args = osf.SafetensorsRestore(
        {"a": 0, "b": 0}, restore_args={"a": ocp.ArrayRestoreArgs()}, partial_restore=True
    )
    with pytest.raises(osf.TargetMismatchError, match=r"in item but not restore_args \(1\): b"):
        _ours(ours_dir, args)


def test_restore_args_with_more_keys_than_item_needs_partial_restore(tmp_path: Path) -> None:
    _, ours_dir = _save_both(tmp_path, _state())
    args = osf.SafetensorsRestore(
        {"a": 0}, restore_args={"a": ocp.ArrayRestoreArgs(), "b": ocp.ArrayRestoreArgs()}
    )
    with pytest.raises(
        osf.TargetMismatchError, match=r"restore_args but not item.*partial_restore"
    ):
        _ours(ours_dir, args)


# --------------------------------------------------------------------------- point 5: metadata


def test_metadata_is_a_tree_metadata_like_orbaxs(tmp_path: Path) -> None:
    state = {"params": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}, "step": 4}
    custom = {"run": "r1", "lr": 0.1}
    roots = {}
    for name, save in (
        ("orbax", ocp.args.StandardSave(state, custom_metadata=custom)),
        ("ours", osf.SafetensorsSave(state, custom_metadata=custom)),
    ):
        roots[name] = tmp_path / name
        with ocp.CheckpointManager(roots[name]) as mngr:
            mngr.save(1, args=save)
            mngr.wait_until_finished()
    with ocp.CheckpointManager(roots["orbax"]) as mngr:
        mngr.restore(1)  # configures the item's handler, as item_metadata needs
        want = mngr.item_metadata(1)
    with ocp.CheckpointManager(
        roots["ours"], item_handlers=osf.SafetensorsCheckpointHandler()
    ) as mngr:
        got = mngr.item_metadata(1)
    assert got.custom_metadata == want.custom_metadata == custom
    assert set(got.tree) == set(want.tree) and set(got) == set(want)
    for key in ("w", "b"):
        g, w = got["params"][key], want["params"][key]
        assert (g.shape, np.dtype(g.dtype)) == (w.shape, np.dtype(w.dtype))

    def paths(meta: Any) -> list[str]:  # both map over the tree, keyed like it
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(meta)]

    assert paths(got) == paths(want) == ["['params']['b']", "['params']['w']", "['step']"]
    # Orbax's own args take ours as a target, as they take theirs (its tree).
    assert ocp.args.StandardRestore(got).item is got.tree
    assert ocp.args.PyTreeRestore(got).item is got.tree
    # And ours takes it too: the saved tree comes back.
    with ocp.Checkpointer(osf.SafetensorsCheckpointHandler()) as ckptr:
        restored = ckptr.restore(roots["ours"] / "1" / "default", args=osf.SafetensorsRestore(got))
    np.testing.assert_array_equal(restored["params"]["w"], np.ones((2, 3)))


def test_metadata_without_custom_metadata_is_none_as_in_orbax(tmp_path: Path) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, {"w": jnp.ones(2)})
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        want = ckptr.metadata(orbax_dir)
    got = osf.SafetensorsCheckpointHandler().metadata(ours_dir)
    # Orbax's Checkpointer.metadata wraps the handler's in a StepMetadata from 0.11.x on.
    want = getattr(want, "item_metadata", want)
    assert got.custom_metadata is None and want.custom_metadata is None


@pytest.mark.parametrize("custom", [{}, {"epoch": 3}])
def test_custom_metadata_comes_back_as_given_as_in_orbax(tmp_path: Path, custom: Any) -> None:
    orbax_dir, ours_dir = _save_both(tmp_path, {"w": jnp.ones(2)}, custom_metadata=custom)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        want = ckptr.metadata(orbax_dir)
    want = getattr(want, "item_metadata", want)
    got = osf.SafetensorsCheckpointHandler().metadata(ours_dir)
    assert got.custom_metadata == want.custom_metadata == custom


# --------------------------------------------------------------------------- save args


@pytest.mark.parametrize("save", [ocp.args.StandardSave, osf.SafetensorsSave])
def test_args_built_once_save_the_tree_as_it_is_at_each_save(tmp_path: Path, save: Any) -> None:
    from flax import nnx

    state = {"w": np.zeros(2, np.float32), "n": np.zeros(2, np.float32), "step": 0}
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    args = save(state)
    nnx_args = save(nnx.state(model))
    state.update(w=np.ones(2, np.float32), step=5, extra=[1.0])  # replaced and added
    state["n"][:] = 9  # changed in place
    got = []
    with ocp.CheckpointManager(tmp_path / save.__name__) as mngr:
        mngr.save(0, args=args)
        for step in (1, 2):
            model.kernel.value = jnp.full((2, 2), float(step))
            mngr.save(step, args=nnx_args)
        mngr.wait_until_finished()
        saved = mngr.restore(0)
        for step in (1, 2):
            got.append(np.asarray(jax.tree.leaves(mngr.restore(step))[1]))
    assert sorted(saved) == ["extra", "n", "step", "w"] and saved["step"] == 5
    np.testing.assert_array_equal(saved["w"], [1, 1])
    np.testing.assert_array_equal(saved["n"], [9, 9])
    np.testing.assert_array_equal(got[0], np.full((2, 2), 1.0))
    np.testing.assert_array_equal(got[1], np.full((2, 2), 2.0))


@pytest.mark.parametrize("item", [None, {}, []])
def test_a_missing_or_empty_item_is_refused_as_standard_save_refuses_it(
    tmp_path: Path, item: Any
) -> None:
    # Orbax: "Must provide item to save." / "Found empty item." (raised inside its save, where
    # a failing save leaves its step-creation thread waiting: not run here). A committed step
    # holding nothing would count towards max_to_keep.
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=osf.SafetensorsSave({"w": np.ones(2)}))
        with pytest.raises(ValueError, match=r"empty item|provide an item"):
            mngr.save(1, args=osf.SafetensorsSave(item))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
    osf.SafetensorsSave({"a": {}})  # not empty as Orbax judges it: an empty node is kept


def test_save_args_dtype_is_honoured_like_standard_save(tmp_path: Path) -> None:
    state = _state()
    save_args = {"a": ocp.SaveArgs(dtype=np.dtype(jnp.bfloat16)), "b": None, "n": None, "s": None}
    orbax_dir, ours_dir = _save_both(tmp_path, state, save_args=save_args)
    want = _orbax_standard(orbax_dir, ocp.args.StandardRestore())
    got = _ours(ours_dir, osf.SafetensorsRestore())
    assert got["a"].dtype == want["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(want["a"]))


@pytest.mark.parametrize(
    "save_arg, words",
    [
        (ocp.SaveArgs(chunk_byte_size=1 << 20), "chunk_byte_size"),
        (ocp.SaveArgs(shard_axes=(0,)), "shard_axes"),
        (ocp.SaveArgs(aggregate=True), "aggregate"),
    ],
    ids=["chunk_byte_size", "shard_axes", "aggregate"],
)
def test_save_args_without_a_safetensors_meaning_say_what_to_do(save_arg: Any, words: str) -> None:
    with pytest.raises(ValueError) as err:
        osf.SafetensorsSave({"w": jnp.ones(4)}, save_args={"w": save_arg})
    assert "save_args['w']" in str(err.value) and words in str(err.value)
    assert "drop" in str(err.value)


def test_custom_metadata_is_orbaxs_name_and_metadata_still_works(tmp_path: Path) -> None:
    handler = osf.SafetensorsCheckpointHandler()
    for i, kwargs in enumerate(({"custom_metadata": {"k": 1}}, {"metadata": {"k": 1}})):
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(tmp_path / str(i), args=osf.SafetensorsSave({"w": jnp.ones(2)}, **kwargs))
        assert handler.metadata(tmp_path / str(i)).custom_metadata == {"k": 1}
    with pytest.raises(ValueError, match="not both"):
        osf.SafetensorsSave({"w": jnp.ones(2)}, custom_metadata={"a": 1}, metadata={"a": 2})


# --------------------------------------------------------------------------- printing


def test_args_print_a_summary_never_the_arrays() -> None:
    state = {"w": jnp.full((256, 256), 1.25, jnp.float32), "b": np.full(3, 7.5), "step": 5}
    save = osf.SafetensorsSave(state, custom_metadata={"run": "x"})
    text = repr(save)
    assert text.startswith("SafetensorsSave(item=<dict: 3 leaves, 256.0 KiB>")
    assert "1.25" not in text and "7.5" not in text and "Array(" not in text
    restore = osf.SafetensorsRestore(jax.eval_shape(lambda: state), strict=False)
    assert repr(restore) == "SafetensorsRestore(item=<dict: 3 leaves, 256.0 KiB>, strict=False)"
    args = osf.SafetensorsRestore(restore_args=ocp.checkpoint_utils.construct_restore_args(state))
    assert "restore_args=<dict: 3 leaves" in repr(args) and "ArrayRestoreArgs" not in repr(args)
    assert dataclasses.replace(save).custom_metadata == {"run": "x"}


def test_environment_has_eight_devices() -> None:
    devices.take(8)  # (skips on an accelerator with fewer)
    assert len(jax.devices()) >= 8, os.environ.get("JAX_NUM_CPU_DEVICES")


# --------------------------------------------------------------------------- point 12: mixed roots


def test_a_root_of_orbax_native_steps_continues_with_safetensors_steps(tmp_path: Path) -> None:
    """Must-hold 5: the same manager saves both kinds, and a restore without args reads each
    step with its own format, as Orbax's own manager restores its steps."""
    root = tmp_path / "run"
    first = {"w": jnp.arange(4.0), "step": 1}
    with ocp.CheckpointManager(root) as mngr:  # the run so far: Orbax-native
        mngr.save(1, args=ocp.args.StandardSave(first))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(root) as mngr:
        want = mngr.restore(1)  # what Orbax alone gives

    abstract = jax.eval_shape(lambda: first)
    with ocp.CheckpointManager(root, handler_registry=osf.handler_registry()) as mngr:
        _assert_same(mngr.restore(1), want)
        _assert_same(
            mngr.restore(1, args=ocp.args.StandardRestore(abstract)),
            _orbax_standard(root / "1" / "default", ocp.args.StandardRestore(abstract)),
        )
        mngr.save(2, args=osf.SafetensorsSave({"w": jnp.arange(4.0) + 1, "step": 2}))
        mngr.save(3, args=ocp.args.StandardSave({"w": jnp.arange(4.0) + 2, "step": 3}))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2, 3]
        assert mngr.restore(2)["step"] == 2
        # Orbax's args on a safetensors step mean what they mean in SafetensorsRestore.
        got = mngr.restore(2, args=ocp.args.StandardRestore(abstract))
        np.testing.assert_array_equal(got["w"], np.arange(4.0) + 1)
        assert mngr.item_metadata(2).tree["w"].shape == (4,)
        assert mngr.item_metadata(1)["w"].shape == (4,)

    assert (root / "2" / "default" / "orbax_safetensors.json").exists()
    assert (root / "3" / "default" / "_METADATA").exists()  # StandardSave stays Orbax-native
    assert not (root / "3" / "default" / "orbax_safetensors.json").exists()
    with ocp.CheckpointManager(root) as mngr:  # Orbax alone still reads its steps
        step3 = mngr.restore(3, args=ocp.args.StandardRestore(abstract))
    np.testing.assert_array_equal(step3["w"], np.arange(4.0) + 2)
    with ocp.CheckpointManager(root, handler_registry=osf.handler_registry()) as mngr:
        for step in (1, 2, 3):  # a fresh manager: every step without args
            restored = mngr.restore(step)
            np.testing.assert_array_equal(restored["w"], np.arange(4.0) + step - 1)


def test_safetensors_restore_reads_an_orbax_native_step_with_orbaxs_meanings(
    tmp_path: Path,
) -> None:
    orbax_dir, _ = _save_both(tmp_path, _state())
    target = {"a": S((10,), jnp.float32), "b": S((3, 4), jnp.int32), "n": np.zeros(5, np.int64)}
    target["s"] = 0
    handler = osf.SafetensorsCheckpointHandler()
    got = handler.restore(orbax_dir, osf.SafetensorsRestore(target, strict=False))
    if _ORBAX >= _ORBAX_TARGET_SHAPES:
        want = _orbax_standard(orbax_dir, ocp.args.StandardRestore(target, strict=False))
        _assert_same(got, want)
    item = {"a": S((8,), jnp.float32)}
    partial = handler.restore(orbax_dir, osf.SafetensorsRestore(item, partial_restore=True))
    assert set(partial) == {"a"}
    np.testing.assert_array_equal(partial["a"], np.arange(8.0))
    handler.close()


_PLAIN_MANAGER_SCRIPT = """
import os, sys
import jax, jax.numpy as jnp, orbax.checkpoint as ocp
import orbax_safetensors as osf

root = sys.argv[1]
state = {"w": jnp.full((64, 64), 0.123, jnp.float32)}
with ocp.CheckpointManager(root) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
mngr = ocp.CheckpointManager(root)
mngr.restore(1, args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
try:
    mngr.save(2, args=osf.SafetensorsSave(state))
except ValueError as e:
    print(e, flush=True)
# Orbax's step-directory thread now waits 300 s for a signal that never comes, and Python
# would wait for it at exit (the docs' "surprises"): leave without waiting.
os._exit(0)
"""


def test_a_plain_manager_refuses_the_other_args_with_a_short_message(tmp_path: Path) -> None:
    """Without ``handler_registry()``, Orbax ties "default" to the first handler it met. Its
    error (quoted in docs/migrating-from-orbax.md) now prints our summary, not the arrays.
    In a subprocess: after that error, Orbax leaves a thread that would delay the exit."""
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_MANAGER_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    package_root = str(Path(osf.__file__).parent.parent)  # this checkout, not an installed copy
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    text = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'args "SafetensorsSave(item=<dict: 1 leaf, 16.0 KiB>) [' in text, text[-2000:]
    assert "does not match with any registered handler" in text and "0.123" not in text
    # ... and names the fix.
    assert "handler_registry=osf.handler_registry()" in text, text[-2000:]


def test_args_print_a_summary_and_their_str_names_the_registry_fix() -> None:
    save = osf.SafetensorsSave({"w": np.zeros(4, np.float32)})
    restore = osf.SafetensorsRestore()
    assert repr(save) == "SafetensorsSave(item=<dict: 1 leaf, 16 B>)"
    for args in (save, restore):
        assert str(args).startswith(repr(args) + " [")
        assert "handler_registry=osf.handler_registry()" in str(args)
