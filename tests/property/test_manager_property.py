"""Property: any pytree through a real Orbax CheckpointManager comes back bit for bit.

Random trees (dicts, lists, tuples, namedtuples, flax.struct dataclasses, nnx.State, optax
states, None and empty nodes, Python scalars) of every dtype the format stores, with shapes of
size 0, 1, odd and around 4 KiB, sharded over the 8 CPU devices, saved synchronously or
asynchronously (one item, or two items of one Composite), under each ``OSF_DIRECT_IO`` mode and
dtype policies; restored with their abstract tree, under include/exclude, and without a
target; checked by ``verify``; and the same tree through Orbax's own StandardCheckpointHandler
restores to the same leaves (types, dtypes, shapes, bytes, shardings).

``OSF_PROPERTY_PROFILE=long`` runs 25 times the examples (see ``campaign.py``).
"""

from __future__ import annotations

import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from campaign import (
    JAX_DTYPES,
    NUMPY_DTYPES,
    ORBAX_DTYPES,
    abstract,
    arrays,
    as_x64,
    assert_leaf_equal,
    assert_trees_equal,
    campaign,
    containers,
    direct_io,
    manager_trees,
    storable,
)
from hypothesis import assume, given
from hypothesis import strategies as st
from jax_casts import compared

import orbax_safetensors as osf
from orbax_safetensors._src.compat import jaxcompat

pytestmark = pytest.mark.timeout(600)
MODES = st.sampled_from(["auto", "never", "always"])
# Two items of one Composite served by one handler instance: issue 25 point 1.
HANDLER_SETUPS = ["one-item", "two-items", "shared-handler"]


def _manager(root: str, setup: str, async_: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_)
    if setup == "one-item":
        return ocp.CheckpointManager(
            root, options=options, item_handlers=osf.SafetensorsCheckpointHandler()
        )
    if setup == "two-items":
        handlers = {
            "a": osf.SafetensorsCheckpointHandler(),
            "b": osf.SafetensorsCheckpointHandler(),
        }
    else:
        shared = osf.SafetensorsCheckpointHandler()
        handlers = {"a": shared, "b": shared}
    return ocp.CheckpointManager(root, options=options, item_handlers=handlers)


def _save_restore(setup: str, async_: bool, tree: Any, *, dtype: Any = None) -> Any:
    """Saves ``tree`` (as items a and b when two), restores with its abstract tree."""
    with tempfile.TemporaryDirectory() as d:
        mngr = _manager(d, setup, async_)
        try:
            if setup == "one-item":
                mngr.save(0, args=osf.SafetensorsSave(tree, dtype=dtype))
            else:
                other = {"copy": tree, "extra": np.arange(3, dtype=np.int16)}
                mngr.save(
                    0,
                    args=ocp.args.Composite(
                        a=osf.SafetensorsSave(tree, dtype=dtype),
                        b=osf.SafetensorsSave(other),
                    ),
                )
            mngr.wait_until_finished()
            report = osf.verify(d)
            assert report.ok and not report.skipped, report
            if setup == "one-item":
                return mngr.restore(0, args=osf.SafetensorsRestore(abstract(tree)))
            out = mngr.restore(
                0,
                args=ocp.args.Composite(
                    a=osf.SafetensorsRestore(abstract(tree)),
                    b=osf.SafetensorsRestore(abstract(other)),
                ),
            )
            assert_trees_equal(out["b"], other)
            return out["a"]
        finally:
            mngr.close()


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("setup", HANDLER_SETUPS)
@campaign(0.5)
@given(tree=manager_trees(), mode=MODES)
def test_manager_round_trip_is_bit_exact(async_: bool, setup: str, tree: Any, mode: str) -> None:
    with direct_io(mode):
        restored = _save_restore(setup, async_, tree)
    assert_trees_equal(restored, tree)


@campaign(0.4)
@given(tree=manager_trees(big=True), mode=MODES)
def test_arrays_around_the_direct_io_threshold(tree: Any, mode: str) -> None:
    with direct_io(mode):
        restored = _save_restore("one-item", True, tree)
    assert_trees_equal(restored, tree)


# --------------------------------------------------------------------------- include / exclude


def _names(tree: Any) -> dict[str, Any]:
    """Dotted name -> array leaf (the naming rule of core/tree.py for str-keyed trees)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out[".".join(_key(k) for k in path)] = leaf
    return out


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise AssertionError(k)


@st.composite
def _selection(draw: st.DrawFn, names: list[str]) -> tuple[list[str], list[str]]:
    """Include/exclude patterns that each match a name or a dotted prefix of one."""
    prefixes = sorted({".".join(n.split(".")[:i]) for n in names for i in range(1, 4)} - {""})
    pattern = st.sampled_from(prefixes).flatmap(
        lambda p: st.sampled_from([p, p + "*", "*" + p.split(".")[-1]])
    )
    return draw(st.lists(pattern, max_size=2)), draw(st.lists(pattern, max_size=2))


@campaign(0.5)
@given(tree=containers(arrays(), max_leaves=6).filter(lambda t: len(_names(t)) > 0), data=st.data())
def test_include_exclude_restore_only_the_selected_leaves(tree: Any, data: st.DataObject) -> None:
    import fnmatch

    names = _names({"t": tree})
    include, exclude = data.draw(_selection(sorted(names)))

    def hit(name: str, patterns: list[str]) -> bool:
        parts = name.split(".")
        heads = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(h, p) for h in heads for p in patterns)

    selected = {n for n in names if (not include or hit(n, include)) and not hit(n, exclude)}
    with tempfile.TemporaryDirectory() as d:
        mngr = ocp.CheckpointManager(d, item_handlers=osf.SafetensorsCheckpointHandler())
        try:
            mngr.save(0, args=osf.SafetensorsSave({"t": tree}))
            mngr.wait_until_finished()
            target = abstract({"t": tree})
            try:
                out = mngr.restore(
                    0,
                    args=osf.SafetensorsRestore(
                        target, include=include or None, exclude=exclude or None
                    ),
                )
            except osf.TargetMismatchError as e:
                # Documented: a pattern that selects nothing (e.g. excluded by every include).
                assert "match" in str(e) or "select" in str(e), e
                return
        finally:
            mngr.close()
    got, want = _names(out), _names(target)
    assert set(got) == set(want)
    for name, leaf in _names({"t": tree}).items():
        if name in selected:
            assert_leaf_equal(got[name], leaf, name)
        else:  # an unselected leaf comes back as given
            given_leaf = want[name]
            if isinstance(given_leaf, np.ndarray):
                assert_leaf_equal(got[name], given_leaf, name)
            else:
                assert got[name] == given_leaf, name


# --------------------------------------------------------------------------- dtype policies


def _policy_targets() -> list[np.dtype]:
    # Targets jnp.astype can produce (no float6 in XLA).
    out = [d for d in JAX_DTYPES if d.kind != "c"] + [np.dtype(np.float64), np.dtype(np.int64)]
    return out


def _cast(x: Any, want: np.dtype) -> Any:
    """jnp.astype with 64-bit types on; a jax leaf keeps its sharding."""
    value = as_x64(lambda: np.asarray(jnp.astype(jnp.asarray(np.asarray(x)), want)))
    if isinstance(x, jax.Array) and want.itemsize < 8:
        return jax.device_put(value, x.sharding)
    return value if isinstance(x, np.ndarray) else jnp.asarray(value)


def _expected(tree: Any, policy: Any) -> Any:
    single = not isinstance(policy, dict)
    want = np.dtype(policy if single else policy["*"])

    def one(x: Any) -> Any:
        if not isinstance(x, (jax.Array, np.ndarray)):
            return x
        floating = x.dtype in [d for d in NUMPY_DTYPES if d.kind == "f" or "float" in d.name]
        if (single and not floating) or x.dtype == want:
            return x
        return _cast(x, want)

    return jax.tree.map(one, tree)


@st.composite
def _policies(draw: st.DrawFn) -> Any:
    want = draw(st.sampled_from(_policy_targets()))
    floating = want.kind == "f" or "float" in want.name
    if floating and draw(st.booleans()):
        return want
    return {"*": want}


def _policy_ok(tree: Any, policy: Any) -> bool:
    """Whether the campaign expects this cast to succeed (else a documented refusal)."""
    want = np.dtype(policy if not isinstance(policy, dict) else policy["*"])
    for x in jax.tree.leaves(tree):
        if not isinstance(x, (jax.Array, np.ndarray)) or x.dtype == want:
            continue
        if isinstance(policy, dict) and x.dtype.kind == "c":
            return False  # complex -> real: refused (documented)
        if not storable(want, x.shape):
            return False  # sub-byte target of an odd count: refused (documented)
    return True


_POLICY_LEAVES = arrays([d for d in NUMPY_DTYPES if not d.name.startswith("float6")])


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@campaign(0.6)
@given(tree=containers(_POLICY_LEAVES, max_leaves=6), policy=_policies())
def test_dtype_policy_stores_jnp_astype(async_: bool, tree: Any, policy: Any) -> None:
    tree = {"t": tree}
    assume(_policy_ok(tree, policy))
    want = np.dtype(policy if not isinstance(policy, dict) else policy["*"])
    # Older JAX converts float8/float4 differently; the library follows JAX 0.10 (jax_casts).
    assume(all(compared(x.dtype, want) for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))
    expected = _expected(tree, policy)
    with tempfile.TemporaryDirectory() as d:
        mngr = ocp.CheckpointManager(
            d,
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=async_),
            item_handlers=osf.SafetensorsCheckpointHandler(),
        )
        try:
            mngr.save(0, args=osf.SafetensorsSave(tree, dtype=policy))
            mngr.wait_until_finished()
            out = mngr.restore(0, args=osf.SafetensorsRestore(abstract(expected)))
        finally:
            mngr.close()
        _assert_cast(out, expected, tree)
        path = tempfile.mktemp(dir=d, suffix=".safetensors")
        osf.save_file(tree, path, dtype=policy)
        _assert_cast(osf.load_file(path, target=abstract(expected)), expected, tree)


def _assert_cast(got: Any, want: Any, source: Any, *, nan_payloads: bool = False) -> None:
    """Bit for bit; with ``nan_payloads``, where the source is NaN the payloads may differ."""
    if not nan_payloads:
        assert_trees_equal(got, want)
        return
    assert_trees_equal(got, want, sharding=True, values=False)
    for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(source)):
        if not isinstance(x, (jax.Array, np.ndarray)):
            continue
        g, w, x = np.asarray(g), np.asarray(w), np.asarray(x)
        nan = np.zeros(x.shape, bool)
        if x.dtype.kind == "f" or "float" in x.dtype.name:
            nan = np.isnan(x.astype(np.float32)) if x.dtype.kind != "c" else nan
        keep = ~nan.reshape(-1)
        assert g.reshape(-1)[keep].tobytes() == w.reshape(-1)[keep].tobytes(), "bytes differ"


# --------------------------------------------------------------------------- against Orbax


# jax 0.7's set_mesh is a plain setter; orbax-checkpoint 0.11.40 uses it as a context manager
# when it saves a replicated slice: its save fails and leaves a global mesh set for the rest of
# the test's examples, under which later Orbax saves no longer give a reference to compare with.
_ORBAX_SAVE_BROKEN = jaxcompat.plain_set_mesh() is not None


@pytest.mark.skipif(
    _ORBAX_SAVE_BROKEN,
    reason=f"jax {jax.__version__}: orbax-checkpoint's own save of replicated slices is broken "
    "(set_mesh used as a context manager), no reference to compare with",
)
@campaign(0.6)
@given(
    tree=manager_trees(
        leaves=st.one_of(arrays(ORBAX_DTYPES, nonzero=True), st.integers(-5, 5)), nonzero=True
    )
)
def test_same_restore_as_orbax_standard_handler(tree: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        ours = ocp.CheckpointManager(d + "/ours", item_handlers=osf.SafetensorsCheckpointHandler())
        theirs = ocp.CheckpointManager(d + "/orbax")
        try:
            ours.save(0, args=osf.SafetensorsSave(tree))
            theirs.save(0, args=ocp.args.StandardSave(tree))
            ours.wait_until_finished()
            theirs.wait_until_finished()
            got = ours.restore(0, args=osf.SafetensorsRestore(abstract(tree)))
            want = theirs.restore(0, args=ocp.args.StandardRestore(abstract(tree)))
        finally:
            ours.close()
            theirs.close()
    assert_trees_equal(got, want)


@campaign(0.4)
@given(
    tree=containers(arrays([d for d in ORBAX_DTYPES if d.kind == "f"], nonzero=True), max_leaves=4),
    want=st.sampled_from([np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32)]),
)
def test_save_args_dtype_as_orbax_casts(tree: Any, want: np.dtype) -> None:
    tree = {"t": tree}
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(dtype=want), tree)
    cast = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, want, sharding=getattr(x, "sharding", None))
            if isinstance(x, jax.Array)
            else np.zeros(x.shape, want)
        ),
        tree,
    )
    with tempfile.TemporaryDirectory() as d:
        ours = ocp.CheckpointManager(d + "/ours", item_handlers=osf.SafetensorsCheckpointHandler())
        theirs = ocp.CheckpointManager(d + "/orbax")
        try:
            ours.save(0, args=osf.SafetensorsSave(tree, save_args=save_args))
            theirs.save(0, args=ocp.args.StandardSave(tree, save_args=save_args))
            ours.wait_until_finished()
            theirs.wait_until_finished()
            got = ours.restore(0, args=osf.SafetensorsRestore(cast))
            expected = theirs.restore(0, args=ocp.args.StandardRestore(cast))
        finally:
            ours.close()
            theirs.close()
    # Orbax's cast keeps a NaN's payload bits where jnp.astype (and ours) quiets it
    # (float8_e5m2 0x7d -> float16: Orbax 0x7d00, jnp 0x7e00): no defined result to compare.
    _assert_cast(got, expected, tree, nan_payloads=True)
