"""Issue 17: ``osf.SafetensorsHandler``, the Orbax v1 ``CheckpointableHandler``, end to end.

Real Orbax v1 (``ocp.save`` / ``save_async`` / ``load``, ``load_checkpointables``, the training
``Checkpointer``), real files read back with ``safetensors`` itself. On an orbax-checkpoint
without the v1 API (the 0.11.11 floor) only the version-error tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp_v0
import pytest
from handler_helpers import HAS_V1, needs_v1  # (tests/orbax/ is on sys.path)
from safetensors.numpy import load_file as st_load_file

import orbax_safetensors as osf
from orbax_safetensors._src.compat import orbaxcompat

lacks_v1 = pytest.mark.skipif(
    HAS_V1, reason="the installed orbax-checkpoint has the v1 API: nothing to refuse"
)


def _tree() -> dict[str, Any]:
    return {
        "dense": {"kernel": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4)},
        "layers": [jnp.ones(5, jnp.bfloat16), np.arange(4, dtype=np.int32)],
        "step": 7,
    }


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree
    )


def _assert_same(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.asarray(g).dtype == np.asarray(w).dtype


def _assert_safetensors_item(item_dir: Path, tree: Any) -> None:
    """The item directory holds standard safetensors files (read by ``safetensors`` itself)
    plus our JSON, with every array under its dotted name."""
    names = sorted(os.listdir(item_dir))
    assert "orbax_safetensors.json" in names
    files = [n for n in names if n.endswith(".safetensors")]
    assert files, names
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(st_load_file(str(item_dir / name)))
    report = osf.verify(item_dir)  # our metadata: schema and CRC32C checksums match the files
    assert report.ok, report.problems
    np.testing.assert_array_equal(tensors["dense.kernel"], np.asarray(tree["dense"]["kernel"]))
    np.testing.assert_array_equal(tensors["layers.1"], np.asarray(tree["layers"][1]))
    assert tensors["layers.0"].shape == (5,)


@pytest.fixture
def v1() -> Any:
    from orbax.checkpoint import v1 as ocp

    ctx = ocp.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        yield ocp


@needs_v1
@pytest.mark.parametrize("mode", ["save", "save_async"])
def test_save_load_round_trip_per_context(v1: Any, tmp_path: Path, mode: str) -> None:
    tree = _tree()
    if mode == "save":
        v1.save(tmp_path / "ckpt", tree)
    else:
        v1.save_async(tmp_path / "ckpt", tree).result()
    _assert_safetensors_item(tmp_path / "ckpt" / "state", tree)
    _assert_same(v1.load(tmp_path / "ckpt", _abstract(tree)), tree)


@needs_v1
def test_load_without_abstract_gives_saved_containers(v1: Any, tmp_path: Path) -> None:
    tree = _tree()
    v1.save(tmp_path / "ckpt", tree)
    got = v1.load(tmp_path / "ckpt")
    assert isinstance(got, dict) and isinstance(got["layers"], list)
    _assert_same(got, tree)


@needs_v1
def test_same_files_as_v0_handler(v1: Any, tmp_path: Path) -> None:
    tree = _tree()
    v1.save(tmp_path / "v1", tree)
    with ocp_v0.CheckpointManager(tmp_path / "v0") as mngr:
        mngr.save(0, args=ocp_v0.args.Composite(state=osf.SafetensorsSave(tree)))
        mngr.wait_until_finished()
    a, b = tmp_path / "v1" / "state", tmp_path / "v0" / "0" / "state"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    meta_a = json.loads((a / "orbax_safetensors.json").read_text())
    meta_b = json.loads((b / "orbax_safetensors.json").read_text())
    assert meta_a == meta_b


@needs_v1
def test_global_registration_in_fresh_process(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, os
        import numpy as np
        from orbax.checkpoint import v1 as ocp
        import orbax_safetensors as osf
        osf.register_handler()
        osf.register_handler()  # twice: still one entry per name
        tree = {{"w": np.arange(6, dtype=np.float32).reshape(2, 3)}}
        ocp.save({str(tmp_path / "g")!r}, tree)
        print(json.dumps(sorted(os.listdir({str(tmp_path / "g" / "state")!r}))))
        got = ocp.load({str(tmp_path / "g")!r})
        np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"])
        """
    )
    path = [str(Path(osf.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert "model.safetensors" in names and "orbax_safetensors.json" in names


@needs_v1
def test_metadata_and_mismatch_errors(v1: Any, tmp_path: Path) -> None:
    tree = {"w": np.ones((2, 3), np.float32)}
    v1.save(tmp_path / "ckpt", tree)
    meta = v1.metadata(tmp_path / "ckpt").metadata
    assert meta == {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}
    wrong = {"w": jax.ShapeDtypeStruct((4, 3), np.float32)}
    with pytest.raises(osf.TargetMismatchError, match=r"w: checkpoint has shape \(2, 3\)"):
        v1.load(tmp_path / "ckpt", wrong)


def _load_both(tmp_path: Path, tree: Any, abstract: Any, option: str | None = None) -> Any:
    """``ocp.load`` of ``tree`` saved by Orbax's own v1 handler and by ours, each loaded in an
    ``ocp.Context`` with ``option`` (a dotted name) set to True: (Orbax's result or error,
    ours or error)."""
    from orbax.checkpoint import v1 as ocp

    ocp.save(tmp_path / "orbax", tree)
    ours = ocp.Context()
    ours.checkpointables.registry = osf.local_registry()
    with ours:
        ocp.save(tmp_path / "ours", tree)
    results = []
    for name, registry in (("orbax", None), ("ours", osf.local_registry())):
        ctx = ocp.Context()
        if option is not None:
            group, loading, field = option.split(".")
            setattr(getattr(getattr(ctx, group), loading), field, True)
        if registry is not None:
            ctx.checkpointables.registry = registry
        with ctx:
            try:
                results.append(ocp.load(tmp_path / name, abstract))
            except Exception as e:  # the error itself is compared
                results.append(e)
    return results


@needs_v1
def test_load_honours_the_contexts_padding_option_as_orbax_does(tmp_path: Path) -> None:
    """``ArrayOptions.Loading(enable_padding_and_truncation=True)``: a stored shape that differs
    from the abstract one is padded or truncated, as by Orbax's own v1 handler; without it
    both raise, and ours names the option."""

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"w": jnp.arange(6, dtype=jnp.float32), "b": jnp.arange(4, dtype=jnp.int32)}
    abstract = {
        "w": jax.ShapeDtypeStruct((8,), np.float32, sharding=one),
        "b": jax.ShapeDtypeStruct((2,), np.int32, sharding=one),
    }
    orbax, ours = _load_both(
        tmp_path / "pad", tree, abstract, "array.loading.enable_padding_and_truncation"
    )
    assert not isinstance(orbax, Exception), orbax
    _assert_same(ours, orbax)
    np.testing.assert_array_equal(np.asarray(ours["w"]), [0, 1, 2, 3, 4, 5, 0, 0])
    orbax, ours = _load_both(tmp_path / "strict", tree, abstract)
    assert isinstance(orbax, Exception), orbax
    assert isinstance(ours, osf.TargetMismatchError)
    assert "ctx.array.loading.enable_padding_and_truncation = True" in str(ours)
    assert "strict=False" not in str(ours)  # v0's name, not this API's


@needs_v1
def test_load_honours_the_contexts_partial_load_option_as_orbax_does(tmp_path: Path) -> None:
    """``PyTreeOptions.Loading(partial_load=True)``: only the abstract tree's keys load."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"w": jnp.arange(6, dtype=jnp.float32), "b": jnp.arange(4, dtype=jnp.int32)}
    abstract = {"w": jax.ShapeDtypeStruct((6,), np.float32, sharding=one)}
    orbax, ours = _load_both(tmp_path / "partial", tree, abstract, "pytree.loading.partial_load")
    assert not isinstance(orbax, Exception), orbax
    _assert_same(ours, orbax)
    assert set(ours) == {"w"}
    orbax, ours = _load_both(tmp_path / "whole", tree, abstract)
    assert isinstance(orbax, Exception), orbax
    assert isinstance(ours, osf.TargetMismatchError)
    assert "ctx.pytree.loading.partial_load = True" in str(ours)
    assert "partial_restore" not in str(ours)


@needs_v1
@pytest.mark.parametrize("kind", ["str", "placeholder", "all placeholders"])
def test_an_abstract_tree_with_strings_or_placeholders_loads_as_orbax_does(
    tmp_path: Path, kind: str
) -> None:
    """A str leaf of the abstract tree loads the saved string, ``ocp.PLACEHOLDER`` skips its
    leaf: as Orbax's own v1 handler (the load was handed to Orbax's, which failed)."""
    tree = {"w": jnp.ones(2), "run_name": "exp-1"}
    w = jax.ShapeDtypeStruct((2,), jnp.float32)
    abstract = {
        "str": {"w": w, "run_name": "x"},
        "placeholder": {"w": w, "run_name": ocp_v0.PLACEHOLDER},
        "all placeholders": {"w": ocp_v0.PLACEHOLDER, "run_name": ocp_v0.PLACEHOLDER},
    }[kind]
    orbax, ours = _load_both(tmp_path, tree, abstract)
    assert not isinstance(orbax, Exception), orbax
    assert not isinstance(ours, Exception), ours
    _assert_same(ours, orbax)
    assert ours["run_name"] == ("exp-1" if kind == "str" else ocp_v0.PLACEHOLDER)


@needs_v1
def test_the_active_context_is_read_through_the_fence() -> None:
    """The private ``get_context`` that :func:`orbaxcompat.v1_loading_options` reads exists on
    this stack (else the options would silently stop applying: this test catches that)."""
    from orbax.checkpoint import v1 as ocp

    assert orbaxcompat.v1_loading_options() == orbaxcompat.V1LoadingOptions()
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        options = orbaxcompat.v1_loading_options()
    assert options.readable and options.partial_load and not options.pad_or_truncate


def test_replace_named_handler_without_an_entry_list_says_to_register_per_context() -> None:
    """The fallback of the one private v1 registry name used (``_registry``): a registry that
    keeps its entries otherwise (as a future Orbax may) gets a clear error, not a crash."""

    class EntriesElsewhere:  # a CheckpointableHandler registry with its entries kept privately
        def __init__(self) -> None:
            self._entries = {"state": object}

        def has(self, name: str) -> bool:
            return name in self._entries

        def add(self, handler: type, checkpointable_name: str, **kwargs: Any) -> None:
            raise AssertionError("must not be reached")

    with pytest.raises(ValueError, match=r"osf.local_registry\(\)"):
        orbaxcompat.replace_named_handler(EntriesElsewhere(), "state", osf.SafetensorsHandler, [])


@needs_v1
def test_replace_named_handler_keeps_other_entries() -> None:
    from orbax.checkpoint import v1 as ocp

    registry = ocp.handlers.local_registry()
    before = [e for e in registry.get_all_entries() if e[1] != "state"]
    orbaxcompat.replace_named_handler(registry, "state", osf.SafetensorsHandler, [])
    assert registry.get("state") is osf.SafetensorsHandler
    assert [e for e in registry.get_all_entries() if e[1] != "state"] == before


@needs_v1
def test_handleable_checks() -> None:
    handler = osf.SafetensorsHandler()
    assert handler.is_handleable(_tree())
    assert not handler.is_handleable(None)
    assert handler.is_abstract_handleable(_abstract(_tree()))


@needs_v1
def test_v0_step_loads_through_v1(v1: Any, tmp_path: Path) -> None:
    tree = _tree()
    with ocp_v0.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, args=ocp_v0.args.Composite(params=osf.SafetensorsSave(tree)))
        mngr.wait_until_finished()
    got = v1.load_checkpointables(tmp_path / "3")
    _assert_same(got["params"], tree)


@needs_v1
def test_v1_step_restores_through_checkpoint_manager(v1: Any, tmp_path: Path) -> None:
    tree = _tree()
    v1.save(tmp_path / "5", tree)
    with ocp_v0.CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() == 5
        got = mngr.restore(
            5, args=ocp_v0.args.Composite(state=osf.SafetensorsRestore(_abstract(tree)))
        )
    _assert_same(got["state"], tree)


class _SmallFiles(osf.SafetensorsHandler):
    """A configured handler, as users register one: files of at most 64 bytes of data."""

    def __init__(self) -> None:
        super().__init__(osf.SafetensorsCheckpointHandler(max_file_size=64))


def _flat_tree() -> dict[str, np.ndarray]:
    return {"a": np.arange(30, dtype=np.float32), "b": np.arange(40, dtype=np.int32)}


@needs_v1
def test_configured_subclass_splits_files(tmp_path: Path) -> None:
    from orbax.checkpoint import v1 as ocp

    tree = _flat_tree()
    ctx = ocp.Context()
    ctx.checkpointables.registry = osf.local_registry(_SmallFiles)
    with ctx:
        ocp.save(tmp_path / "ckpt", tree)
        got = ocp.load(tmp_path / "ckpt", _abstract(tree))
    names = sorted(os.listdir(tmp_path / "ckpt" / "state"))
    assert "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) == 2
    _assert_same(got, tree)
    # What the subclass saved loads through the plain handler too (its secondary typestrs).
    ctx = ocp.Context()
    ctx.checkpointables.registry = osf.local_registry()
    with ctx:
        _assert_same(ocp.load(tmp_path / "ckpt"), tree)


@needs_v1
@pytest.mark.parametrize("handler_type", [osf.SafetensorsHandler, _SmallFiles])
def test_orbax_safetensors_layout_reads_our_items(
    tmp_path: Path, handler_type: type[osf.SafetensorsHandler]
) -> None:
    from orbax.checkpoint import v1 as ocp

    tree = _flat_tree()
    ctx = ocp.Context()
    ctx.checkpointables.registry = osf.local_registry(handler_type)
    with ctx:
        ocp.save(tmp_path / "ckpt", tree)
    split = (tmp_path / "ckpt" / "state" / "model.safetensors.index.json").exists()
    assert split == (handler_type is _SmallFiles)
    with ocp.Context(checkpoint_layout="safetensors"):
        got = ocp.load(tmp_path / "ckpt" / "state")
    _assert_same(dict(got), tree)


@needs_v1
def test_training_checkpointer_with_retention(v1: Any, tmp_path: Path) -> None:
    ctx = v1.Context()
    ctx.checkpointables.registry = osf.local_registry()
    policy = v1.training.preservation_policies.LatestN(2)
    with v1.training.Checkpointer(tmp_path, preservation_policy=policy, context=ctx) as ckptr:
        for step in range(4):
            tree = {"w": np.full((3,), step, np.float32), "step": step}
            ckptr.save(step, tree)
        ckptr.wait()
        steps = [c.step for c in ckptr.checkpoints]
        assert steps == [2, 3]
        got = ckptr.load(3, _abstract(tree))
    _assert_same(got, {"w": np.full((3,), 3, np.float32), "step": 3})
    assert (
        st_load_file(str(tmp_path / "3" / "state" / "model.safetensors"))["w"].tolist() == [3] * 3
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "3"]


@lacks_v1
def test_old_orbax_refuses_with_version() -> None:
    for make in (osf.SafetensorsHandler, osf.register_handler, osf.local_registry):
        with pytest.raises(ImportError, match=r"orbax-checkpoint >= 0\.12\.8"):
            make()


def test_package_imports_on_every_orbax() -> None:
    assert osf.SafetensorsHandler.__module__ == "orbax_safetensors"
    assert "SafetensorsHandler" in osf.__all__


class _Servable(osf.SafetensorsHandler):
    """A handler given a mapping: every save is a Hugging Face model directory."""

    def __init__(self) -> None:
        mapping = osf.KeyMapping([osf.Rule("w.weight", "w.kernel", osf.Transpose())])
        super().__init__(mapping=mapping, hf_config={"model_type": "llama"})


@needs_v1
def test_a_handler_with_a_mapping_saves_and_loads_a_servable_item(tmp_path: Path) -> None:
    from orbax.checkpoint import v1 as ocp

    kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
    ctx = ocp.Context()
    ctx.checkpointables.registry = osf.local_registry(_Servable)
    with ctx:
        ocp.save(tmp_path / "ckpt", {"w": {"kernel": kernel}})
        got = ocp.load(tmp_path / "ckpt", {"w": {"kernel": jax.ShapeDtypeStruct((3, 4), "f4")}})
    item = tmp_path / "ckpt" / "state"
    tensors = st_load_file(str(item / "model.safetensors"))
    assert list(tensors) == ["w.weight"]
    np.testing.assert_array_equal(tensors["w.weight"], kernel.T)  # the PyTorch layout
    assert json.loads((item / "config.json").read_text())["model_type"] == "llama"
    np.testing.assert_array_equal(np.asarray(got["w"]["kernel"]), kernel)
    with pytest.raises(ValueError, match="needs mapping="):
        osf.SafetensorsHandler(hf_config={"model_type": "llama"})
