"""Exporting MaxText's Orbax-native checkpoints (issue 42, point 2, the source side): the
train state saved as MaxText saves it (``maxtext_checkpoints``: Orbax v1
``save_checkpointables``, a v0 ``CheckpointManager`` item ``items`` by ``PyTreeSave`` with
OCDBT + zarr3 or by ``StandardSave``) exports from the item, the step or the root, through
``export_pytorch`` and ``orbax-safetensors export``, byte-identical to the export of the same
parameters from memory; the optimizer state and step are left out and reported, nothing else
is. What each process of a multi-process export reads (``export_reads``) is decided here
from the stored chunks; the multi-process runs are ``tests/multihost/
test_maxtext_export_multihost.py``.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import maxtext_checkpoints as M
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.integrations import export_reads
from orbax_safetensors._src.integrations.links import Link

DIMS = M.Dims()
SAVES = ["v1", "v0", "standard"]


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return M.train_state(M.llama_params(DIMS))


@pytest.fixture(scope="module")
def reference(state, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("maxtext_ref") / "hf"
    report = osf.export_pytorch(M.unflatten(M.parameters(state)), out, M.hand_mapping(DIMS))
    assert report.ok and not report.ignored, report.problems()
    return out


def _save(how: str, root: Path, state: dict[str, Any]) -> Path:
    if how == "v1":
        if not M.has_v1_training():
            pytest.skip(M.NO_V1_TRAINING)
        return M.save_v1(root, 7, state)
    return M.save_v0(root, 7, state, how="pytree" if how == "v0" else how)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in b.iterdir())
    assert sorted(p.name for p in a.iterdir()) == names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _training(state: dict[str, Any]) -> list[str]:
    return sorted(n for n in M.flatten(state) if not n.startswith("params."))


@pytest.mark.parametrize("how", SAVES)
def test_each_maxtext_save_exports_its_parameters_from_item_step_and_root(
    how, state, reference, tmp_path
):
    step = _save(how, tmp_path / "ckpt", state)
    for name, source in {"item": step / M.ITEM, "step": step, "root": tmp_path / "ckpt"}.items():
        report = osf.export_pytorch(source, tmp_path / name, M.hand_mapping(DIMS))
        assert report.ok, report.problems()
        assert sorted(report.ignored) == _training(state), name
        assert len(report.moved) == len(M.llama_shapes(DIMS))
        _same_files(tmp_path / name, reference)


def test_the_cli_exports_a_v1_items_directory(state, reference, tmp_path, capsys):
    step = _save("v1", tmp_path / "ckpt", state)
    (tmp_path / "hf_config").mkdir()
    (tmp_path / "hf_config" / "config.json").write_text('{"model_type": "llama"}')
    code = cli.main(
        [
            "export",
            str(step / M.ITEM),
            str(tmp_path / "out"),
            "--mapping",
            "maxtext_checkpoints:hand_mapping",
            "--hf-config",
            str(tmp_path / "hf_config"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"exported {len(M.llama_shapes(DIMS))} tensors")
    for f in reference.iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()


def test_only_a_train_states_optimizer_state_and_step_are_left_out(state, tmp_path):
    params = M.unflatten(M.parameters(state))
    mapping = M.hand_mapping(DIMS)
    # in memory too: the same rule for a Flax TrainState-like tree
    report = osf.export_pytorch(state, tmp_path / "mem", mapping)
    assert report.ok and sorted(report.ignored) == _training(state)
    # without a top-level ``params`` nothing is training state: opt_state is unmapped
    other = {"model": params["params"], "opt_state": state["opt_state"]}
    with pytest.raises(osf.TargetMismatchError, match=r"opt_state\.0\.mu"):
        osf.export_pytorch(other, tmp_path / "other", mapping)
    # anything else beside the parameters (MaxText's nnx_aux: RNG state, batch statistics)
    # goes through the mapping: an error names it, never a silent drop
    aux = dict(state, nnx_aux={"batch_stats": {"mean": np.ones(4, np.float32)}})
    with pytest.raises(osf.TargetMismatchError, match=r"nnx_aux\.batch_stats\.mean"):
        osf.export_pytorch(aux, tmp_path / "aux", mapping)
    # a float ``step`` is not a counter
    floaty = dict(state, step=np.float32(3.0))
    with pytest.raises(osf.TargetMismatchError, match="step"):
        osf.export_pytorch(floaty, tmp_path / "floaty", mapping)


def test_an_orbax_item_reads_sharded_arrays_and_knows_its_chunks(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    x = np.arange(64 * 6, dtype=np.float32).reshape(64, 6)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
    M.save_v0(tmp_path / "ckpt", 1, {"x": sharded, "y": x})
    source = _sources.open_source(tmp_path / "ckpt" / "1" / M.ITEM)
    n = len(jax.devices())
    assert source.chunks["x"] == (64 // n, 6)  # one chunk per device's shard
    assert source.chunks["y"] == (64, 6)  # a host array: one chunk
    target = NamedSharding(mesh, PartitionSpec(None, None))
    got = source.read_sharded(["x", "y"], {"x": sharded.sharding, "y": target})
    assert got["x"].sharding == sharded.sharding and got["y"].sharding == target
    for name in ("x", "y"):
        np.testing.assert_array_equal(np.asarray(got[name]), x)


def test_chunk_shape_falls_back_to_one_chunk_when_the_metadata_does_not_say():
    def leaf(chunk):
        return types.SimpleNamespace(storage=types.SimpleNamespace(chunk_shape=chunk))

    assert _sources.chunk_shape(leaf((2, 3)), (4, 3)) == (2, 3)
    for bad in (None, (2,), (0, 3), (-1, 3)):
        assert _sources.chunk_shape(leaf(bad), (4, 3)) == (4, 3)
    assert _sources.chunk_shape(object(), (4, 3)) == (4, 3)


def test_reads_split_only_at_whole_chunks():
    import jax

    n = len(jax.devices())
    spec = export_reads.chunk_aligned_sharding((8 * n, 6), (8, 6), first=0).spec
    assert tuple(spec) == ("devices",)
    # chunks of two devices' rows: axis 0 cannot be split over every device; axis 1 neither
    assert export_reads.chunk_aligned_sharding((8 * n, 6), (16, 6), first=0) is None
    # the rows' axis first, then the others
    spec = export_reads.chunk_aligned_sharding((3, 4 * n), (3, 4), first=0).spec
    assert tuple(spec) == (None, "devices")
    assert export_reads.chunk_aligned_sharding((8 * n, 6), (8 * n, 6)) is None  # one chunk
    assert export_reads.chunk_aligned_sharding((0, 6), (1, 6)) is None


def test_links_read_whole_are_spread_over_the_processes_largest_first():
    def info(nbytes, dtype="U8"):
        return types.SimpleNamespace(nbytes=nbytes, shape=(nbytes,), dtype=dtype)

    sizes = {"a": 10, "b": 7, "c": 6, "d": 4, "e": 1}
    infos = {k: info(v) for k, v in sizes.items()}
    rule = osf.Rule("{x}", "{x}")
    links = [Link(rule, (k,), (k,)) for k in sizes]
    owners = export_reads.balanced_owners(links, infos, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}  # loads 14 and 14
    plan = export_reads.plan_reads(links, infos, chunks=None, processes=2, sharded=False)
    assert plan.owners == owners and not plan.shardings
    assert plan.writer(links[1], default=0) == 1
    # a source of byte ranges reads everything sharded, except a link merging LoRA adapters
    # and a dtype the devices would change (float64 without jax_enable_x64: never a cast)
    infos["f"] = info(8, "F64")
    links.append(Link(rule, ("f",), ("f",)))
    plan = export_reads.plan_reads(links, infos, chunks=None, processes=2, whole={"a"})
    assert set(plan.shardings) == {"b", "c", "d", "e"}
    assert set(plan.owners) == {"a", "f"} and plan.owners["a"] != plan.owners["f"]
