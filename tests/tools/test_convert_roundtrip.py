"""A round trip through ``convert`` is the identity by default, and Orbax-native ``nnx.State``
checkpoints migrate without flags (issue 25, point 10). Real Orbax, real files."""

from __future__ import annotations

import os
import shutil
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.catalog import orbax_source as _orbax_source
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.tools import convert_items as _convert_items
from orbax_safetensors._src.tools import diff as _diff


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)


def names(path) -> list[str]:
    return sorted(_sources.open_source(path).tensors)


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def save_native(path, tree):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(path), tree)
    ckptr.wait_until_finished()


def test_a_safetensors_root_round_trips_through_orbax(tmp_path, capsys):
    model = Model(nnx.Rngs(0))
    with ocp.CheckpointManager(tmp_path / "st") as mngr:
        for step in (1, 2):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=osf.SafetensorsSave(nnx.state(model)),
                    meta=ocp.args.JsonSave({"step": step}),
                ),
            )
        mngr.wait_until_finished()
    for argv in (("st", "orbax"), ("orbax", "back")):
        code, _, err = run(capsys, "convert", *(tmp_path / a for a in argv), "-q")
        assert code == 0, err
    assert names(tmp_path / "back/2/state") == names(tmp_path / "st/2/state")
    assert "linear.kernel" in names(tmp_path / "back/2/state")
    # The Orbax copy compares equal to both, tensor by tensor, under the same names.
    for other in ("orbax/2", "back/2", "orbax/2/state"):
        a = tmp_path / ("st/2/state" if other.endswith("state") else "st/2")
        code, out, _ = run(capsys, "diff", a, tmp_path / other)
        assert code == 0, out
        assert f"{len(names(tmp_path / 'st/2/state'))} tensors equal" in out
    # The copy restores as Orbax users restore an nnx.State.
    abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
    restored = ocp.StandardCheckpointer().restore(tmp_path / "orbax/2/state", abstract)
    np.testing.assert_array_equal(restored["linear"]["kernel"][...], model.linear.kernel[...])


def test_a_mixed_tree_keeps_its_own_value_dicts(tmp_path):
    """Only the leaves recorded as NNX Variables are wrapped and unwrapped again: a genuine
    ``{"value": x}`` dict next to them keeps its name both ways."""
    model = Model(nnx.Rngs(0))
    tree = {"model": nnx.state(model), "critic": {"value": np.arange(3.0)}, "step": 7}
    osf.save_directory(tree, tmp_path / "st")
    osf.convert(tmp_path / "st", tmp_path / "orbax", progress=False)
    osf.convert(tmp_path / "orbax", tmp_path / "back", progress=False)
    assert names(tmp_path / "back") == names(tmp_path / "st")
    assert "critic.value" in names(tmp_path / "back")
    assert "model.linear.kernel" in names(tmp_path / "back")
    back = osf.restore_directory(tmp_path / "back")
    assert back["step"] == 7
    np.testing.assert_array_equal(back["critic"]["value"], np.arange(3.0))
    assert _diff.diff_paths(tmp_path / "st", tmp_path / "orbax").identical


def test_an_orbax_native_nnx_root_migrates_without_flags(tmp_path, capsys):
    model = Model(nnx.Rngs(0))
    with ocp.CheckpointManager(tmp_path / "native") as mngr:
        mngr.save(5, args=ocp.args.StandardSave(nnx.state(model)))
        mngr.wait_until_finished()
    code, _, err = run(capsys, "convert", tmp_path / "native", tmp_path / "st", "-q")
    assert code == 0, err
    fresh = Model(nnx.Rngs(1))
    with ocp.CheckpointManager(tmp_path / "st") as mngr:
        restored = mngr.restore(5, args=osf.SafetensorsRestore(nnx.state(fresh)))
    nnx.update(fresh, restored)
    np.testing.assert_array_equal(fresh.out.kernel[...], model.out.kernel[...])
    np.testing.assert_array_equal(fresh.bn.var[...], model.bn.var[...])
    code, out, _ = run(capsys, "diff", tmp_path / "native/5", tmp_path / "st/5")
    assert code == 0 and "checkpoints are identical" in out
    # ...and back to Orbax-native, then safetensors again: the same names each time.
    code, _, err = run(capsys, "convert", tmp_path / "st", tmp_path / "native2", "-q")
    assert code == 0, err
    code, _, err = run(capsys, "convert", tmp_path / "native2", tmp_path / "st2", "-q")
    assert code == 0, err
    assert names(tmp_path / "st2/5/default") == names(tmp_path / "st/5/default")


def test_the_flags_still_choose(tmp_path, capsys):
    model = Model(nnx.Rngs(0))
    save_native(tmp_path / "nnx", nnx.state(model))
    code, _, err = run(
        capsys, "convert", tmp_path / "nnx", tmp_path / "kept", "--no-unwrap-values", "-q"
    )
    assert code == 0, err
    assert "linear.kernel.value" in names(tmp_path / "kept")
    # A plain dict where only some leaves sit in {"value": x}: not an nnx.State, kept as is...
    save_native(tmp_path / "mixed", {"kernel": {"value": jnp.ones(2)}, "bias": jnp.zeros(1)})
    osf.convert(tmp_path / "mixed", tmp_path / "as_is", progress=False)
    assert names(tmp_path / "as_is") == ["bias", "kernel.value"]
    # ...unless asked.
    code, _, err = run(
        capsys, "convert", tmp_path / "mixed", tmp_path / "collapsed", "--unwrap-values", "-q"
    )
    assert code == 0, err
    assert names(tmp_path / "collapsed") == ["bias", "kernel"]
    # An item that is one {"value": x} dict is no nnx.State: its name stays.
    save_native(tmp_path / "lone", {"value": jnp.ones(2)})
    osf.convert(tmp_path / "lone", tmp_path / "lone_st", progress=False)
    assert names(tmp_path / "lone_st") == ["value"]


@pytest.mark.parametrize("flag", ["--unwrap-values", None])
def test_a_native_nnx_item_round_trips_to_itself(tmp_path, capsys, flag):
    """Orbax-native -> safetensors -> Orbax-native gives Orbax's own layout back."""
    model = Model(nnx.Rngs(0))
    save_native(tmp_path / "native", nnx.state(model))
    extra = [flag] if flag else []
    code, _, err = run(capsys, "convert", tmp_path / "native", tmp_path / "st", "-q", *extra)
    assert code == 0, err
    code, _, err = run(capsys, "convert", tmp_path / "st", tmp_path / "back", "-q")
    assert code == 0, err
    orbax_names = sorted(_orbax_source.OrbaxSource(tmp_path / "native").tensors)
    assert sorted(_orbax_source.OrbaxSource(tmp_path / "back").tensors) == orbax_names
    assert _diff.diff_paths(tmp_path / "native", tmp_path / "back").identical


# ------------------------------------------------------------------ what Orbax cannot store


def left_over(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "st")


@pytest.mark.parametrize(
    "tree, first, second, name",
    [
        ({"a.b": np.full(2, 1.0), "a": {"b": np.full(2, 2.0)}}, "['a']['b']", "['a.b']", "a.b"),
        ({"l": [np.full(2, 3.0)], "l.0": np.full(2, 4.0)}, "['l'][0]", "['l.0']", "l.0"),
    ],
    ids=["dotted key", "list index"],
)
def test_convert_to_orbax_refuses_leaves_orbax_would_name_alike(
    tmp_path, capsys, tree, first, second, name
):
    """Orbax names each array by its keys joined with '.': two leaves with one such name would
    share one Orbax array, one value silently replacing the other (this library stores them
    apart, as ``a.b`` and ``a.b~1``). Refused before Orbax writes anything, naming both."""
    osf.save_directory(tree, tmp_path / "st")
    code, _, err = run(capsys, "convert", "-q", tmp_path / "st", tmp_path / "orbax")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the leaves at {first} (float64[2]) and {second} (float64[2])" in err, err
    assert f"both get the Orbax name {name!r}" in err, err
    assert left_over(tmp_path) == []
    with pytest.raises(osf.SafetensorsCheckpointError, match="overwrite the other"):
        osf.convert(tmp_path / "st", tmp_path / "orbax", progress=False)


@pytest.mark.parametrize(
    "leaf, why",
    [
        (2**70, "'x': Python int 1180591620717411303424 lies outside int64 and uint64"),
        (-(2**63) - 1, "lies outside int64 and uint64"),
        (np.zeros((0, 4), np.float32), "'x': float32[0,4] holds no elements"),
        (np.zeros(4, ml_dtypes.float6_e2m3fn), "'x': float6_e2m3fn[4]: TensorStore"),
    ],
    ids=["int beyond uint64", "int below int64", "zero-size", "float6"],
)
def test_convert_to_orbax_refuses_leaves_orbax_cannot_store(tmp_path, capsys, leaf, why):
    """Checked before Orbax starts, each named: one error line, nothing left behind (Orbax
    failed late, naming no leaf, or with its background threads' tracebacks, and left a
    half-written staging directory)."""
    osf.save_directory({"w": np.ones(2, np.float32), "x": leaf}, tmp_path / "st")
    code, _, err = run(capsys, "convert", "-q", tmp_path / "st", tmp_path / "orbax")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot be converted to Orbax-native (nothing was written)" in err
    assert why in err, err
    assert left_over(tmp_path) == []


def test_a_failed_orbax_save_is_waited_for(tmp_path):
    """A save Orbax refuses part way has other arrays' writes running in its threads: they are
    waited for before the failure is passed on, so removing the output removes it for good."""
    before = set(threading.enumerate())
    tree = {"a": jnp.ones(2), "b": np.zeros((0, 4), np.float32)}  # "a" written in a thread
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        with (
            pytest.raises(ValueError, match="zero size"),
            _convert_items.orbax_threads_joined_on_failure(),
        ):
            checkpointer.save(tmp_path / "out", args=ocp.args.StandardSave(tree))
    finally:
        checkpointer.close()
    running = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not [t for t in running if type(t).__module__.startswith("orbax.")]
    for entry in tmp_path.iterdir():
        shutil.rmtree(entry)
    assert list(tmp_path.iterdir()) == []


def test_numpy_scalars_round_trip_beside_a_string(tmp_path):
    """A tree holding a string is written with PyTreeSave, which stored numpy scalars as Python
    scalars (np.bool_ it refused): they come back as the 0-d arrays StandardSave gives."""
    tree = {"u8": np.uint8(200), "f16": np.float16(1.5), "flag": np.bool_(True), "name": "run"}
    osf.save_directory(tree, tmp_path / "st")
    osf.convert(tmp_path / "st", tmp_path / "orbax", progress=False)
    osf.convert(tmp_path / "orbax", tmp_path / "back", progress=False)
    back = osf.restore_directory(tmp_path / "back")
    for key in ("u8", "f16", "flag"):
        assert np.asarray(back[key]).dtype == np.asarray(tree[key]).dtype, key
        assert np.asarray(back[key]) == tree[key]
    assert back["name"] == "run"
    assert names(tmp_path / "back") == ["f16", "flag", "u8"]
    assert _diff.diff_paths(tmp_path / "st", tmp_path / "back").identical


def test_convert_includes_a_tied_weight_by_its_alias_name(tmp_path, capsys):
    """An alias selected by its own name reads its tensor, as in ``load_file(include=...)``."""
    w = np.arange(4.0, dtype=np.float32)
    osf.save_file({"embed": w, "head": w, "bias": np.ones(2)}, tmp_path / "f.safetensors")
    code, out, err = run(
        capsys, "convert", "-q", "--include", "head", tmp_path / "f.safetensors", tmp_path / "o"
    )
    assert code == 0, err
    assert "converted 1 tensor (16 B)" in out
    restored = ocp.StandardCheckpointer().restore(tmp_path / "o")
    assert list(restored) == ["head"]
    np.testing.assert_array_equal(restored["head"], w)


@pytest.mark.parametrize("saved", ["item", "file"])
def test_diff_compares_a_tied_weight_with_its_orbax_copy(tmp_path, capsys, saved):
    """A tied tensor (stored once, its other path an alias) is compared under each name: its
    Orbax-native copy, which stores one array per path, compares equal."""
    w = np.arange(4.0, dtype=np.float32)
    tree = {"embed": w, "head": w}
    src = tmp_path / ("st" if saved == "item" else "st.safetensors")
    (osf.save_directory if saved == "item" else osf.save_file)(tree, src)
    osf.convert(src, tmp_path / "orbax", progress=False)
    code, out, _ = run(capsys, "diff", src, tmp_path / "orbax")
    assert code == 0, out
    assert "2 tensors equal; checkpoints are identical" in out
    osf.convert(tmp_path / "orbax", tmp_path / "back", progress=False)
    assert _diff.diff_paths(src, tmp_path / "back").identical
    # A changed value under the alias's name is reported under that name.
    osf.save_directory({"embed": w, "head": w + 1}, tmp_path / "untied")
    report = _diff.diff_paths(src, tmp_path / "untied")
    assert [n for n, _ in report.values] == ["head"] and report.same == 1


def test_a_refusal_lists_a_bounded_number_of_leaves(tmp_path):
    osf.save_directory({f"e{i:02}": np.zeros(0, np.float32) for i in range(25)}, tmp_path / "st")
    with pytest.raises(osf.SafetensorsCheckpointError) as info:
        osf.convert(tmp_path / "st", tmp_path / "orbax", progress=False)
    message = str(info.value)
    assert "'e00': float32[0] holds no elements" in message and "'e10'" not in message
    assert message.endswith("; and 15 more")
    assert left_over(tmp_path) == []
