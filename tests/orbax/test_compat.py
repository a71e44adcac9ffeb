"""_src/compat: every private or version-dependent JAX/Orbax name, fenced, with a fallback that gives
the same results. These run on every stack CI tests (.ci/matrix), so a rename in JAX or Orbax
fails here instead of silently changing behaviour or speed."""

from __future__ import annotations

import collections
import dataclasses
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
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree

PACKAGE = Path(osf.__file__).parent

Pair = collections.namedtuple("Pair", "first second")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: Any
    b: Any


class _Mlp(nnx.Module):
    def __init__(self) -> None:
        self.first = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.second = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


def _trees() -> dict[str, Any]:
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    return {
        "namedtuple": Pair(jnp.arange(3), None),
        "dataclass": Params(jnp.ones(2), np.zeros(2, np.int8)),
        "optax": optax.chain(optax.clip(1.0), optax.adamw(1e-3)).init(params),
        "nnx_state": nnx.state(_Mlp()),
        "nnx_variable": {"v": nnx.Param(jnp.ones(2))},
        "nested": {"a": [Pair(1, 2.5), (None, "s")], "b": Params(jnp.ones(1), {"x": 3})},
    }


@pytest.mark.parametrize("name", list(_trees()))
def test_one_level_flatten_fallback_gives_the_same_tree(name: str) -> None:
    tree = _trees()[name]
    direct = _tree.flatten(tree)
    saved = _jaxcompat._ONE_LEVEL
    _jaxcompat._ONE_LEVEL = None  # as on a jax older than 0.10.2
    try:
        fallback = _tree.flatten(tree)
    finally:
        _jaxcompat._ONE_LEVEL = saved
    assert fallback.schema == direct.schema
    assert list(fallback.arrays) == list(direct.arrays)
    for key, value in direct.arrays.items():
        np.testing.assert_array_equal(np.asarray(fallback.arrays[key]), np.asarray(value))


def test_one_level_flatten_fallback_matches_jax_one_level() -> None:
    if _jaxcompat._ONE_LEVEL is None:
        pytest.skip(f"jax {jax.__version__} has no flatten_one_level_with_keys (jax >= 0.10.2)")
    for tree in _trees().values():
        nodes = [tree, *jax.tree_util.tree_leaves(tree, is_leaf=lambda x, t=tree: x is not t)]
        for node in nodes:
            try:
                direct = _jaxcompat.flatten_one_level_with_keys(node)
            except ValueError:
                with pytest.raises(ValueError):
                    _jaxcompat.flatten_one_level_with_keys_fallback(node)
                continue
            fallback = _jaxcompat.flatten_one_level_with_keys_fallback(node)
            assert [c for _, c in fallback] == [c for _, c in direct] or all(
                a is b for (_, a), (_, b) in zip(fallback, direct, strict=True)
            )
            if not isinstance(node, tuple) or not hasattr(node, "_fields"):
                # (jaxlib 0.10 keys every namedtuple child with the first field; _tree fixes it)
                assert [k for k, _ in fallback] == [k for k, _ in direct]


def test_leaves_are_not_nodes_in_either_form() -> None:
    for leaf in (jnp.ones(2), np.ones(2), 3, "s"):
        with pytest.raises(ValueError):
            _jaxcompat.flatten_one_level_with_keys_fallback(leaf)
        with pytest.raises(ValueError):
            _jaxcompat.flatten_one_level_with_keys(leaf)


def test_sharding_memo_gives_the_same_answers_without_the_private_key() -> None:
    local = devices.take(2)
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()).reshape(-1), ("x",))
    shardings = [
        jax.sharding.SingleDeviceSharding(local[0]),
        jax.sharding.SingleDeviceSharding(local[0]),
        jax.sharding.SingleDeviceSharding(local[1]),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    ]
    assert _jaxcompat.single_device_key(shardings[0]) is not None, (
        f"SingleDeviceSharding._device is gone in jax {jax.__version__}: update _src/compat/jaxcompat.py"
    )

    def facts(memo: _sharding.ShardingMemo[Any]) -> list[Any]:
        return [memo(s) for s in shardings]

    def fact(s: Any) -> Any:
        return (sorted(d.id for d in s.device_set), s.is_fully_addressable)

    with_key = facts(_sharding.ShardingMemo(fact))
    saved = _jaxcompat.single_device_key
    _jaxcompat.single_device_key = lambda s: None  # type: ignore[assignment]
    try:
        without = facts(_sharding.ShardingMemo(fact))
    finally:
        _jaxcompat.single_device_key = saved
    assert with_key == without == [fact(s) for s in shardings]


def test_direct_device_put_is_found() -> None:
    # tests/pipeline/test_place.py compares it with jax.device_put (and the fallback path) leaf by leaf.
    assert _jaxcompat.batched_device_put() is not None, (
        f"pxla.batched_device_put moved in jax {jax.__version__}: restores of many small "
        "tensors take jax.device_put (correct, slower); update _src/compat/jaxcompat.py"
    )


def test_no_private_names_outside_compat() -> None:
    """Private JAX/Orbax names are used in _src/compat only; no frame of any thread is read
    anywhere (Orbax gives no sign of a synchronous save: ``SafetensorsSave(snapshot=False)``
    says it)."""
    private = re.compile(
        r"jax\._src|_current_frames|\._device\b|orbax\.checkpoint\._src|"
        r"get_jax_distributed_client|sys\._getframe"
    )
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if private.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    compat = sorted((PACKAGE / "_src" / "compat").glob("*.py"))
    assert compat
    for f in compat:
        assert "_current_frames" not in f.read_text() and "_getframe" not in f.read_text()


def test_partial_restore_fallback_restores_the_same_leaves(tmp_path: Path) -> None:
    tree = {"a": np.arange(4.0), "b": {"c": np.ones((2, 2), np.int32), "d": np.zeros(3)}}
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(tmp_path / "ck", args=ocp.args.PyTreeSave(tree))
    item = {"b": {"c": 0}}
    restore_args = {"b": {"c": ocp.RestoreArgs(restore_type=np.ndarray)}}
    forms = [_orbaxcompat.pytree_partial_restore_fallback(item, restore_args)]
    forms.append(_orbaxcompat.pytree_partial_restore(item, restore_args))
    results = [ckptr.restore(tmp_path / "ck", args=args) for args in forms]
    for restored in results:
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(item)
        value = restored["b"]["c"]
        assert type(value) is np.ndarray and value.dtype == np.int32
        np.testing.assert_array_equal(value, tree["b"]["c"])


@pytest.mark.parametrize("how", ["ocdbt_zarr3", "ocdbt_zarr2", "plain_zarr2"])
def test_tensorstore_reads_of_orbax_arrays_match_orbax_restore(tmp_path: Path, how: str) -> None:
    # The spec Orbax's own helper builds (array_read_spec) opens each array of an item saved
    # every way this Orbax saves (OCDBT or a directory per array, zarr3 or zarr2; chunks of
    # each device's shard, typed dtypes): the values equal Orbax's restore (the fallback),
    # whole and in boxes that cut across chunks.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from orbax_safetensors._src.catalog import orbax_source as _orbax_source
    from orbax_safetensors._src.orbax import steps as _steps

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = 8 * len(jax.devices())
    w = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
    tree = {
        "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("d"))),
        "b": jnp.arange(5, dtype=jnp.bfloat16),
        "n": {"i": np.arange(12, dtype=np.int8).reshape(3, 4), "s": np.array(2.5, np.float32)},
    }
    ocdbt, zarr3 = how != "plain_zarr2", how == "ocdbt_zarr3"
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
    ckptr = ocp.Checkpointer(handler)
    ckptr.save(tmp_path / "ck", args=ocp.args.PyTreeSave(tree))
    storage = _steps.array_storage(tmp_path / "ck")
    assert (storage.use_ocdbt, storage.use_zarr3) == (ocdbt, zarr3)
    source = _orbax_source.OrbaxSource(tmp_path / "ck")
    names = sorted(source.tensors)
    assert names == ["b", "n.i", "n.s", "w"]
    assert all(source.store(n) is not None for n in names)  # (this Orbax builds the spec)
    fast, slow = source.read(names), source.restore(names)
    for n in names:
        assert fast[n].dtype == np.asarray(slow[n]).dtype
        np.testing.assert_array_equal(fast[n], np.asarray(slow[n]))
    box = (slice(3, rows - 5), slice(1, 4))
    np.testing.assert_array_equal(source.read_box("w", box), w[box])
    got = source.read_sharded(["w"], {"w": tree["w"].sharding})["w"]
    assert got.sharding == tree["w"].sharding
    np.testing.assert_array_equal(np.asarray(got), w)


def test_nnx_internal_attrs_are_empty_pytree_children():
    # What is_nnx_internal_attr names must hold no state of the user's on this flax (or be
    # absent): a saved Module restored without a target leaves these children out.
    from jax.tree_util import GetAttrKey

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    try:
        children = _jaxcompat.flatten_one_level_with_keys(model)
    except ValueError:
        pytest.skip("this flax's Modules are not pytrees: nothing to leave out")
    internal = [
        child
        for key, child in children
        if isinstance(key, GetAttrKey) and _jaxcompat.is_nnx_internal_attr(key.name)
    ]
    for child in internal:
        assert jax.tree.leaves(child) == []
    # and every such empty private child this flax gives a Module is named (flax 0.11:
    # _object__state, flax 0.12: _pytree__state), so none leaks into a restore.
    unnamed = [
        key.name
        for key, child in children
        if isinstance(key, GetAttrKey)
        and key.name.startswith("_")
        and jax.tree.leaves(child) == []
        and not _jaxcompat.is_nnx_internal_attr(key.name)
    ]
    assert unnamed == []
    assert not _jaxcompat.is_nnx_internal_attr("kernel")


def test_nnx_value_reads_every_leaf_an_nnx_state_holds():
    # flax 0.12: nnx.state holds Variables (get_value); flax 0.11: VariableStates, whose
    # unknown attributes forward to the array (so get_value would fail there).
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(
        nnx.state(model), is_leaf=lambda x: isinstance(x, _jaxcompat.nnx_variable_types())
    )
    assert leaves and all(isinstance(x, _jaxcompat.nnx_variable_types()) for x in leaves)
    values = sorted((np.asarray(_jaxcompat.nnx_value(x)).shape for x in leaves), key=len)
    assert values == [(3,), (2, 3)]
    np.testing.assert_array_equal(_jaxcompat.nnx_value(model.kernel), model.kernel.value)


def test_lora_params_are_recognised_in_a_module_and_its_state():
    # flax 0.12: Variables of class LoRAParam; flax 0.11: VariableStates naming it in ``type``.
    model = nnx.LoRALinear(2, 3, lora_rank=1, rngs=nnx.Rngs(0))
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    lora = {".".join(map(str, p)) for p, v in flat.items() if _jaxcompat.nnx_is_lora_param(v)}
    assert lora == {"lora.lora_a", "lora.lora_b"}
    assert _jaxcompat.nnx_is_lora_param(model.lora.lora_a)
    assert not _jaxcompat.nnx_is_lora_param(model.kernel)
    assert not _jaxcompat.nnx_is_lora_param(np.zeros(2))


def test_nnx_variable_types_touch_no_deprecated_flax_name():
    # flax 0.12 serves nnx.VariableState from a module __getattr__ that warns; the suite turns
    # this package's DeprecationWarnings into errors (pyproject.toml), this checks any warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        types = _jaxcompat.nnx_variable_types()
    assert types[0] is nnx.Variable


def test_distributed_key_value_store_is_found_where_expected() -> None:
    """A save to object storage by several processes (storage/objstore/spread.py) runs over
    jax.distributed's key-value store, found here; a single process has none (its saves write
    each file whole); tests/objstore/test_objstore_spread.py uses it from real processes."""
    from jax._src import distributed

    assert hasattr(distributed, "global_state") and hasattr(distributed.global_state, "client"), (
        f"jax {jax.__version__} moved jax._src.distributed.global_state.client: update "
        "_src/compat/jaxcompat.distributed_kv"
    )
    assert _jaxcompat.distributed_kv() is None  # not initialized in this test process
    with pytest.raises(
        RuntimeError,
        match=r"2 processes needs the key-value store of jax\.distributed: jax\.distributed is not initialized",
    ):
        _jaxcompat.require_distributed_kv("a save to gs://b/ckpt/1/default by 2 processes")


def test_every_supported_jaxlib_client_has_the_key_value_store() -> None:
    """The object-store protocol has no fallback: every jaxlib CI tests (0.6.0 on the floor
    stack) has each method it calls; a client that lacked one is refused, naming it."""
    try:  # jaxlib's extension module: _jax from jax 0.7 on, xla_extension before
        from jax._src.lib import _jax as extension
    except ImportError:
        from jax._src.lib import xla_extension as extension

    client = extension.DistributedRuntimeClient
    assert _jaxcompat.kv_missing(client) is None, _jaxcompat.kv_missing(client)
    assert hasattr(client, "wait_at_barrier")  # (compat/jaxcompat's barriers)

    class OldClient:
        def key_value_set(self, key: str, value: str) -> None: ...

        def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
            return ""

    assert _jaxcompat.kv_missing(OldClient()) == (
        f"the client of jax {jax.__version__} has no key_value_try_get, key_value_delete"
    )
