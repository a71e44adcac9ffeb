"""The tree codec through real files: naming rule, lossless round trips, collisions, PRNG keys,
target node types, a schema that names no class, tied weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from exact import assert_same  # (tests/ is on sys.path)
from flax import nnx, struct
from flax.training import train_state
from safetensors import safe_open

import orbax_safetensors as osf
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import snapshots as _snapshots


def _roundtrip(tree: Any, path: Any, target: Any = None) -> Any:
    osf.save_file(tree, path)
    return osf.load_file(path, target=target)


def _names(path: Any) -> list[str]:
    with safe_open(path, "numpy") as f:
        return list(f.keys())


def _schema(path: Any) -> dict:
    return json.loads(osf.read_header(path).metadata[_metadata.SCHEMA_KEY])


# --------------------------------------------------------------------------- naming rule


def test_naming_rule_dict_list_index(tmp_path):
    path = tmp_path / "n.safetensors"
    x = np.arange(4.0)
    osf.save_file({"layers": [{"w": x}]}, path)
    assert _names(path) == ["layers.0.w"]
    with safe_open(path, "numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("layers.0.w"), x)


def test_naming_rule_all_entry_kinds(tmp_path):
    Pair = namedtuple("Pair", "first second")

    @struct.dataclass
    class Box:
        inner: Any

    tree = {
        "d": {"k": np.ones(1), 3: np.ones(1)},
        "l": [np.ones(1), (np.ones(1),)],
        "nt": Pair(np.ones(1), np.ones(1)),
        "dc": Box({"z": np.ones(1)}),
    }
    path = tmp_path / "n.safetensors"
    osf.save_file(tree, path)
    assert sorted(_names(path)) == sorted(
        ["d.k", "d.3", "l.0", "l.1.0", "nt.first", "nt.second", "dc.inner.z"]
    )


def test_a_single_array_is_named_value(tmp_path):
    path = tmp_path / "v.safetensors"
    out = _roundtrip(np.arange(3), path)
    assert _names(path) == ["value"]
    assert_same(out, np.arange(3))


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))


def _train_state() -> train_state.TrainState:
    model = _MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads)


def test_naming_rule_linen_train_state(tmp_path):
    state = _train_state()
    path = tmp_path / "ts.safetensors"
    osf.save_file(state, path)
    names = set(_names(path))
    assert {
        "params.Dense_0.kernel",
        "params.Dense_0.bias",
        "params.Dense_1.kernel",
        "opt_state.0.count",
        "opt_state.0.mu.Dense_0.kernel",
        "opt_state.0.nu.Dense_0.kernel",
        "opt_state.0.mu.Dense_1.bias",
    } <= names
    assert "step" not in names  # a Python int: inline in the schema, not a tensor
    assert len(names) == 1 + 3 * 4
    with safe_open(path, "flax") as f:
        np.testing.assert_array_equal(
            f.get_tensor("opt_state.0.mu.Dense_0.kernel"),
            state.opt_state[0].mu["Dense_0"]["kernel"],
        )


def test_nnx_variables_are_transparent_in_names(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    osf.save_file(nnx.state(model), a)
    osf.save_file(nnx.to_pure_dict(nnx.state(model)), b)
    assert _names(a) == _names(b)
    assert set(_names(a)) == {"kernel", "bias"}


# --------------------------------------------------------------------------- lossless round trips


def test_lossless_round_trip_without_target(tmp_path):
    tree = {
        "dict": {"a": np.ones(2), "b": None},
        "list": [np.int8(3), np.array(2.5, np.float32), jnp.arange(3)],
        "tuple": (1, 2.0, "three", True, None),
        3: {"int": 7, 0: "zero"},
        "3": "string key beside int key 3",
        "empty_list": [],
        "empty_tuple": (),
        "empty_dict": {},
        "nested_empty": [[], {}, ()],
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-310, 0.1],
        "ints": [0, -1, 2**70, -(2**70)],
        "bools": [True, False],
        "strs": ["", "ünïcødé ✓", "a.b~1", "{json}"],
        "none": None,
        "zero_d_np": np.array(4.0),
        "zero_d_jax": jnp.array(5, jnp.int32),
        "empty_np": np.zeros((0, 3), np.float16),
        "empty_jax": jnp.zeros((2, 0), jnp.bfloat16),
        "np_scalars": [np.float32(1.5), np.int64(-2), np.bool_(True), np.uint16(9)],
        "np_float64": np.float64(-2.5),  # a subclass of float, yet a numpy scalar
    }
    out = _roundtrip(tree, tmp_path / "t.safetensors")
    assert_same(out, tree)
    # array kinds come back exactly: numpy stays numpy, jax stays jax, scalars stay scalars
    assert type(out["zero_d_jax"]) is type(tree["zero_d_jax"])
    assert isinstance(out["np_scalars"][0], np.float32)
    assert isinstance(out["empty_np"], np.ndarray)
    assert isinstance(out["list"][2], jax.Array)


def test_inline_values_are_not_tensors(tmp_path):
    path = tmp_path / "i.safetensors"
    osf.save_file({"step": 3, "lr": 0.1, "name": "run", "flag": False, "w": np.ones(1)}, path)
    assert _names(path) == ["w"]
    tree = _schema(path)["tree"]
    kinds = dict(zip(tree["k"], [v["t"] for v in tree["v"]]))
    assert kinds == {"step": "int", "lr": "float", "name": "str", "flag": "bool", "w": "tensor"}
    assert tree["v"][1]["v"] == (0.1).hex()  # floats are stored exactly, as hex


def test_zero_d_and_empty_arrays_keep_their_shape_in_the_header(tmp_path):
    path = tmp_path / "z.safetensors"
    osf.save_file({"s": np.array(1.0, np.float32), "e": np.zeros((0, 4), np.int32)}, path)
    tensors = osf.read_header(path).tensors
    assert tensors["s"].shape == ()
    assert tensors["e"].shape == (0, 4)
    assert tensors["e"].nbytes == 0
    with safe_open(path, "numpy") as f:
        assert f.get_tensor("s").shape == ()
        assert f.get_tensor("e").shape == (0, 4)


def test_dict_vs_list_vs_tuple_and_int_vs_str_keys_are_distinguished(tmp_path):
    x = np.arange(2.0)
    variants = [
        {"0": x, "1": x + 1},
        {0: x, 1: x + 1},
        [x, x + 1],
        (x, x + 1),
    ]
    for i, tree in enumerate(variants):
        path = tmp_path / f"v{i}.safetensors"
        out = _roundtrip(tree, path)
        assert _names(path) == ["0", "1"]  # same names for all four ...
        assert_same(out, tree)  # ... yet each comes back as itself


# --------------------------------------------------------------------------- collisions


def test_a_leaf_named_like_the_metadata_slot_is_suffixed(tmp_path):
    # "__metadata__" is the safetensors header's own key, so such a leaf is always stored as ~1.
    tree = {"__metadata__": np.arange(2.0), "a": {"b": 1}}
    path = tmp_path / "m.safetensors"
    out = _roundtrip(tree, path)
    assert _names(path) == ["__metadata__~1"]
    assert_same(out, tree)
    back = osf.load_file(path, target={"__metadata__": np.zeros(2), "a": {"b": 0}})
    np.testing.assert_array_equal(back["__metadata__"], np.arange(2.0))


def test_dotted_key_collision_round_trips(tmp_path):
    x, y = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    tree = {"a.b": x, "a": {"b": y}}
    path = tmp_path / "c.safetensors"
    out = _roundtrip(tree, path)
    assert sorted(_names(path)) == ["a.b", "a.b~1"]
    with safe_open(path, "numpy") as f:  # the nested path sorts first and keeps the plain name
        np.testing.assert_array_equal(f.get_tensor("a.b"), y)
        np.testing.assert_array_equal(f.get_tensor("a.b~1"), x)
    assert_same(out, tree)
    target = {"a": {"b": np.zeros(2)}, "a.b": np.zeros(2)}  # another key order
    back = osf.load_file(path, target=target)
    np.testing.assert_array_equal(back["a.b"], x)
    np.testing.assert_array_equal(back["a"]["b"], y)


def test_int_vs_str_key_collision_round_trips(tmp_path):
    a, b = np.array([1, 2]), np.array([3, 4, 5])
    for tree in ({1: a, "1": b}, {"1": b, 1: a}):
        path = tmp_path / "k.safetensors"
        out = _roundtrip(tree, path)
        assert_same(out, tree)
        with safe_open(path, "numpy") as f:  # int keys sort before str keys
            np.testing.assert_array_equal(f.get_tensor("1"), a)
            np.testing.assert_array_equal(f.get_tensor("1~1"), b)


def test_int_vs_str_collision_with_target(tmp_path):
    # jax cannot flatten one dict with mixed int and str keys (it sorts them), so such a dict can
    # never be a restore target; the same int-vs-str collision across two dicts can.
    with pytest.raises((TypeError, ValueError)):
        jax.tree_util.tree_flatten({1: 0, "1": 0})
    a, b = np.array([1, 2]), np.array([3, 4, 5])
    tree = {"x": {1: a}, "x.1": b}
    path = tmp_path / "k.safetensors"
    osf.save_file(tree, path)
    assert sorted(_names(path)) == ["x.1", "x.1~1"]
    back = osf.load_file(path, target={"x.1": np.zeros(3, int), "x": {1: np.zeros(2, int)}})
    np.testing.assert_array_equal(back["x"][1], a)
    np.testing.assert_array_equal(back["x.1"], b)


def test_collision_suffix_skips_names_already_taken(tmp_path):
    x, y, z = np.ones(1), np.ones(2), np.ones(3)
    tree = {"a.b": x, "a": {"b": y}, "a.b~1": z}
    path = tmp_path / "c.safetensors"
    out = _roundtrip(tree, path)
    assert sorted(_names(path)) == ["a.b", "a.b~1", "a.b~2"]
    with safe_open(path, "numpy") as f:
        assert f.get_tensor("a.b~1").shape == (3,)
    assert_same(out, tree)
    back = osf.load_file(path, target=jax.tree.map(np.zeros_like, tree))
    for k in tree:  # jax orders a target's dict keys; values follow the names
        assert_same(back[k], tree[k])


# --------------------------------------------------------------------------- PRNG keys


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys_round_trip(tmp_path, impl):
    key = jax.random.key(42, impl=impl)
    tree = {"key": key, "keys": jax.random.split(key, 3), "raw": jax.random.key_data(key)}
    path = tmp_path / "k.safetensors"
    out = _roundtrip(tree, path)
    data_width = jax.random.key_data(key).shape[-1]
    header = osf.read_header(path).tensors
    assert (header["key"].dtype, header["key"].shape) == ("U32", (data_width,))
    assert header["keys"].shape == (3, data_width)
    for name in ("key", "keys"):
        assert jax.dtypes.issubdtype(out[name].dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(out[name])) == impl
        assert bool(jnp.all(out[name] == tree[name]))
    assert not jax.dtypes.issubdtype(out["raw"].dtype, jax.dtypes.prng_key)
    # the keys behave as the originals
    np.testing.assert_array_equal(jax.random.normal(out["key"], (4,)), jax.random.normal(key, (4,)))
    target = {
        "key": jax.random.key(0, impl=impl),
        "keys": jax.eval_shape(lambda: tree["keys"]),
        "raw": tree["raw"],
    }
    back = osf.load_file(path, target=target)
    assert str(jax.random.key_impl(back["key"])) == impl
    assert bool(jnp.all(back["key"] == key))
    assert bool(jnp.all(back["keys"] == tree["keys"]))


def test_prng_key_impl_is_in_the_schema(tmp_path):
    path = tmp_path / "k.safetensors"
    osf.save_file({"k": jax.random.key(1, impl="rbg")}, path)
    node = _schema(path)["tree"]["v"][0]
    assert node == {"t": "key", "impl": "rbg", "name": "k"}


def test_nnx_rngs_state_round_trips_as_typed_keys(tmp_path):
    rngs = nnx.Rngs(0, dropout=1)
    rngs.dropout()  # advance a counter
    path = tmp_path / "r.safetensors"
    out = _roundtrip(nnx.to_pure_dict(nnx.state(rngs)), path)
    state = nnx.to_pure_dict(nnx.state(rngs))
    assert_same(out, state)
    assert jax.dtypes.issubdtype(out["dropout"]["key"].dtype, jax.dtypes.prng_key)


# --------------------------------------------------------------------------- target node types

Point = namedtuple("Point", "x y")


@struct.dataclass
class Params:
    w: jax.Array
    b: jax.Array
    label: str = struct.field(pytree_node=False, default="static")


def _abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def test_target_node_types_come_back(tmp_path):
    ts = _train_state()
    tree = {
        "ts": ts,
        "pt": Point(np.arange(2.0), jnp.ones(3)),
        "st": nnx.State({"a": {"b": jnp.ones(2)}, "c": jnp.zeros(1)}),
        "dc": Params(jnp.ones((2, 2)), jnp.zeros(2), label="mine"),
    }
    path = tmp_path / "n.safetensors"
    osf.save_file(tree, path)
    plain = osf.load_file(path)  # without a target: plain containers keyed by field names
    assert type(plain["ts"]) is dict
    assert type(plain["pt"]) is dict and set(plain["pt"]) == {"x", "y"}
    assert type(plain["dc"]) is dict and set(plain["dc"]) == {"w", "b"}
    target = jax.tree.map(_abstract, tree)
    out = osf.load_file(path, target=target)
    assert type(out["ts"]) is train_state.TrainState
    assert out["ts"].apply_fn is ts.apply_fn  # static fields come from the target
    assert type(out["ts"].opt_state[0]) is type(ts.opt_state[0])
    assert out["ts"].step == ts.step
    assert type(out["pt"]) is Point
    assert type(out["st"]) is nnx.State
    assert type(out["dc"]) is Params and out["dc"].label == "mine"
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _walk_schema(node: Any):
    yield node
    if isinstance(node, dict):
        for v in node.get("v", []) if isinstance(node.get("v"), list) else [node.get("v")]:
            if isinstance(v, dict):
                yield from _walk_schema(v)


def test_schema_never_names_an_importable_class(tmp_path):
    tree = {
        "ts": _train_state(),
        "pt": Point(np.ones(1), np.ones(1)),
        "dc": Params(jnp.ones(1), jnp.ones(1)),
    }
    path = tmp_path / "s.safetensors"
    osf.save_file(tree, path)
    schema = _schema(path)
    assert set(schema) == {"format", "version", "tree"}
    text = json.dumps(schema)
    for module in ("flax", "optax", "train_state", "test_tree", "__main__", "builtins", "jax."):
        assert module not in text
    allowed = {"t", "k", "v", "name", "array", "impl", "of", "type"}
    for node in _walk_schema(schema["tree"]):
        assert set(node) <= allowed, node
        if node["t"] == "node":  # an informational bare class name, never a module path
            assert "." not in node["type"] and ":" not in node["type"]


_CUSTOM_MODULE = """
import dataclasses
import jax

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SecretState:
    weights: dict
    step: int
"""


def test_loading_needs_no_class_from_the_file(tmp_path):
    # One interpreter saves a tree holding a class from a private module; another, where that
    # module cannot be imported, loads the file without a target and gets plain containers.
    (tmp_path / "secret_mod").mkdir()
    (tmp_path / "secret_mod" / "secret_state_mod.py").write_text(_CUSTOM_MODULE)
    path = tmp_path / "s.safetensors"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    save = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path / "secret_mod")!r})
        import numpy as np
        import orbax_safetensors as osf
        from secret_state_mod import SecretState
        osf.save_file(SecretState({{"w": np.arange(3.0)}}, 5), {str(path)!r})
        """
    )
    load = textwrap.dedent(
        f"""
        import json, sys
        import orbax_safetensors as osf
        tree = osf.load_file({str(path)!r})
        assert tree["step"] == 5 and tree["weights"]["w"].tolist() == [0.0, 1.0, 2.0], tree
        assert "secret_state_mod" not in sys.modules
        text = osf.read_header({str(path)!r}).metadata["orbax_safetensors.tree"]
        assert "secret_state_mod" not in text, text
        print(json.loads(text)["tree"]["type"])
        """
    )
    for code in (save, load):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "SecretState"  # informational only


# --------------------------------------------------------------------------- tied weights


def test_tied_weights_are_stored_once_and_shared_after_loading(tmp_path):
    emb = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
    host = np.arange(1000, dtype=np.int16)
    tree = {
        "embed": {"table": emb},
        "head": {"kernel": emb, "extra": [emb]},
        "h1": host,
        "h2": (host,),
        "other": jnp.ones(4),
    }
    path = tmp_path / "tied.safetensors"
    osf.save_file(tree, path)
    names = _names(path)
    assert sorted(names) == ["embed.table", "h1", "other"]
    header = osf.read_header(path)
    assert os.path.getsize(path) == header.data_start + emb.nbytes + host.nbytes + 16
    schema_text = json.dumps(_schema(path))
    assert '"t": "ref", "of": "embed.table", "name": "head.kernel"' in schema_text

    out = osf.load_file(path)
    assert out["head"]["kernel"] is out["embed"]["table"]
    assert out["head"]["extra"][0] is out["embed"]["table"]
    assert out["h2"][0] is out["h1"]
    np.testing.assert_array_equal(out["head"]["kernel"], emb)

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    back = osf.load_file(path, target=target)
    assert back["head"]["kernel"] is back["embed"]["table"]
    assert back["head"]["extra"][0] is back["embed"]["table"]
    np.testing.assert_array_equal(back["head"]["extra"][0], emb)

    concrete = osf.load_file(path, target=jax.tree.map(jnp.zeros_like, tree))
    assert concrete["head"]["kernel"] is concrete["embed"]["table"]


def test_equal_but_distinct_arrays_are_not_tied(tmp_path):
    a = np.ones(8)
    path = tmp_path / "d.safetensors"
    out = _roundtrip({"a": a, "b": a.copy()}, path)
    assert sorted(_names(path)) == ["a", "b"]
    assert out["a"] is not out["b"]


# --------------------------------------------------------------------------- capture, finish later


def test_capture_then_finish_gives_the_tree_as_captured():
    """An async save captures the tree in the call and names it later on its writer thread;
    the caller changing its containers in between changes nothing."""
    from orbax_safetensors._src.core import tree as _tree

    key = jax.random.key(3)
    expected_key = np.asarray(jax.random.key_data(key))
    layers = [{"w": np.ones(2, np.float32)}, {"w": np.zeros(3, np.int8)}]
    tree = {"layers": layers, "a.b": np.arange(2), "a": {"b": np.arange(3)}, "rng": key, "n": 4}
    reference = _tree.flatten(tree)
    captured = _tree.capture(tree)
    assert captured.names == ["layers.0.w", "layers.1.w", "a.b", "a.b", "rng"]  # no suffixes yet
    assert [a.shape for a in captured.arrays] == [(2,), (3,), (2,), (3,), (2,)]
    layers.append({"w": np.ones(9)})  # the caller's containers change after the capture
    tree["n"] = 5
    del tree["a"]
    flat = captured.finish()
    assert flat.schema == reference.schema
    assert list(flat.arrays) == list(reference.arrays)
    assert list(flat.arrays) == ["layers.0.w", "layers.1.w", "a.b~1", "a.b", "rng"]
    np.testing.assert_array_equal(np.asarray(flat.arrays["rng"]), expected_key)


def test_validated_tree_specs_come_from_the_capture_not_the_arrays(tmp_path):
    """An async save's writer plans from the dtypes and shapes read at capture and writes host
    copies: the caller's arrays may be deleted (donated) and its numpy arrays reshaped in place
    by then, and the checkpoint is still the tree as saved."""
    from orbax_safetensors._src.pipeline import standalone as _standalone

    host = np.arange(6, dtype=np.float32)
    key = jax.random.key(7)
    key_data = np.asarray(jax.random.key_data(key)).copy()
    tree = {"w": jnp.arange(4.0), "host": host, "alias": host, "bf": jnp.ones(3, jnp.bfloat16)}
    tree["rng"] = key
    validated = _checkpoint_save.validate_save(tree)
    snapshot = list(_snapshots.iter_snapshots(enumerate(validated.captured.arrays)))
    tree["w"].delete()
    tree["bf"].delete()
    key.delete()  # its key data (a view of the same buffer) goes with it
    host.shape = (2, 3)  # reshaped in place: the spec was read at capture
    host[:] = -1  # and overwritten: the snapshot holds a copy
    assert [(s.name, s.dtype, s.shape) for s in validated.specs] == [
        ("w", "F32", (4,)),
        ("host", "F32", (6,)),
        ("bf", "BF16", (3,)),
        ("rng", "U32", (2,)),
    ]
    prepared = _checkpoint_save.prepare(validated, _checkpoint_save.SaveLayout(), snapshot)
    _checkpoint_save.write_process_share(prepared, tmp_path)
    _checkpoint_save.finalize(tmp_path)
    restored = _standalone.restore_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4.0, dtype=np.float32))
    np.testing.assert_array_equal(restored["host"], np.arange(6, dtype=np.float32))
    assert restored["alias"] is restored["host"]
    assert np.asarray(restored["bf"]).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored["rng"])), key_data)
