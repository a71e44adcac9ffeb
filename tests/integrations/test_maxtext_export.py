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

import devices
import jax
import maxtext_checkpoints as M
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.catalog import orbax_source as _orbax_source
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

    assert _orbax_source.chunk_shape(leaf((2, 3)), (4, 3)) == (2, 3)
    for bad in (None, (2,), (0, 3), (-1, 3)):
        assert _orbax_source.chunk_shape(leaf(bad), (4, 3)) == (4, 3)
    assert _orbax_source.chunk_shape(object(), (4, 3)) == (4, 3)


def test_reads_split_only_at_whole_chunks():
    devices.take(2)  # (one device: every tensor is one chunk)
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
    # a source of byte ranges reads everything sharded, except a link merging LoRA adapters
    # and a dtype the devices would change (float64 without jax_enable_x64: never a cast)
    infos["f"] = info(8, "F64")
    links.append(Link(rule, ("f",), ("f",)))
    plan = export_reads.plan_reads(links, infos, chunks=None, processes=2, whole={"a"})
    assert set(plan.shardings) == {"b", "c", "d", "e"}
    assert set(plan.owners) == {"a", "f"} and plan.owners["a"] != plan.owners["f"]


# A llama of 16 scanned layers whose MLP kernels (8 MiB, 512 KiB a layer) are several times
# the batch below; stored with its layers split over the devices and chunks of at most one
# layer (MaxText's ["layers", "stage"] rule and its chunk_byte_size), so that a band of layers
# is whole chunks.
BAND_DIMS = M.Dims(layers=16, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=2048, vocab=96)
LAYER_BYTES = 64 * 2048 * 4  # one layer of an MLP kernel, float32


def _llama3(d: M.Dims) -> Any:
    return osf.preset_mapping("maxtext-llama3", hf_config=M.hf_config(d))


def _band_checkpoint(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    state = {"step": np.int32(7), "params": {"params": M.llama_params(BAND_DIMS)}}
    sharded = M.shard_state(state, layers=True)
    if M.has_v1_training():
        step = M.save_v1(tmp_path / "ckpt", 7, sharded, chunk_bytes=LAYER_BYTES)
    else:
        step = M.save_v0(tmp_path / "ckpt", 7, sharded, chunk_bytes=LAYER_BYTES)
    return state, step / M.ITEM


def test_a_stacked_link_is_exported_a_band_of_layers_at_a_time(tmp_path):
    from traced_memory import traced_peak

    devices.take(2)  # the layers split over the devices (MaxText's rule): chunks of layers
    state, item = _band_checkpoint(tmp_path)
    mapping = _llama3(BAND_DIMS)
    reference = tmp_path / "ref"
    assert osf.export_pytorch(state, reference, mapping).ok
    source = _sources.open_source(item)
    wi = "params.params.decoder.layers.mlp.wi_0.kernel"
    assert source.chunks[wi][1] == 1  # (chunks of one layer: bands of whole chunks)
    batch = 2 * LAYER_BYTES  # bands of 1 layer, a sixteenth of a kernel
    peaks = {}
    for batch_bytes in (batch, 64 * batch):
        out = tmp_path / f"out_{batch_bytes}"
        peaks[batch_bytes] = traced_peak(
            lambda out=out, b=batch_bytes: osf.export_pytorch(item, out, mapping, batch_bytes=b)
        )
        _same_files(out, reference)
    # the numpy memory the export holds (tracemalloc: the bands read, the layers being cast,
    # the writes under way): a few layers, under half a kernel, where a batch that holds the
    # kernels whole holds two of them (one read ahead)
    kernel = BAND_DIMS.layers * LAYER_BYTES
    assert peaks[64 * batch] >= 2 * kernel, peaks
    assert peaks[batch] <= kernel // 2, peaks


# A llama whose embedding and head (8 MiB each, float32) are each larger than the batch
# below, so that each is a read of its own, one after the other.
WIDE_DIMS = M.Dims(layers=1, embed=128, heads=2, kv_heads=1, head_dim=64, mlp=256, vocab=16384)


def test_one_process_frees_a_read_before_the_next_large_one(tmp_path):
    from traced_memory import traced_peak

    devices.take(2)
    state = {"step": np.int32(7), "params": {"params": M.llama_params(WIDE_DIMS)}}
    if M.has_v1_training():
        step = M.save_v1(tmp_path / "ckpt", 7, M.shard_state(state))
    else:
        step = M.save_v0(tmp_path / "ckpt", 7, M.shard_state(state))
    mapping = _llama3(WIDE_DIMS)
    reference = tmp_path / "ref"
    assert osf.export_pytorch(state, reference, mapping, dtype="bfloat16").ok
    tensor = WIDE_DIMS.vocab * WIDE_DIMS.embed * 4
    batch = tensor // 4
    out = tmp_path / "out"
    peak = traced_peak(
        lambda: osf.export_pytorch(step / M.ITEM, out, mapping, dtype="bfloat16", batch_bytes=batch)
    )
    _same_files(out, reference)
    # the numpy memory of a one-process export: the tensor read (the head, then the
    # embedding, each alone), the bands being cast and written (a share of the batch), where
    # one that keeps the head's last output while it reads the embedding holds two tensors
    assert peak <= tensor + 2 * batch, (peak, tensor)


def test_bands_are_whole_chunks_split_evenly_over_the_processes():
    def info(shape):
        return types.SimpleNamespace(shape=shape, dtype="F32", nbytes=4 * int(np.prod(shape)))

    rule = osf.Rule("layers.{i}.w", "w", osf.Transpose(), stacked={"i": 1})
    link = Link(rule, ("w",), tuple(f"layers.{i}.w" for i in range(16)), (("i", 16),))
    infos = {"w": info((8, 16, 32))}  # 1 KiB a layer, 16 KiB in all
    layer = 8 * 32 * 4
    got = export_reads.plan_bands([link], infos, {"w": (8, 2, 32)}, processes=2, budget=5 * layer)
    # chunks of 2 layers, 4 per process; 2 chunks (4 layers) fit the budget
    assert got["w"] == export_reads.Bands("i", (((0, 4), (4, 8)), ((8, 12), (12, 16))))
    # a band is at least one chunk; with several processes a link that fits the budget is
    # banded too (each writes its own layers: no collective), in one process it is not
    got = export_reads.plan_bands([link], infos, {"w": (8, 4, 32)}, processes=1, budget=layer)
    assert got["w"].of_process == (((0, 4), (4, 8), (8, 12), (12, 16)),)
    chunks = {"w": (8, 2, 32)}
    got = export_reads.plan_bands([link], infos, chunks, processes=2, budget=64 * layer)
    assert got["w"].of_process == (((0, 8),), ((8, 16),))
    assert not export_reads.plan_bands([link], infos, chunks, processes=1, budget=64 * layer)
    # chunks across every layer (an FSDP save: a device's shard of each layer), chunk counts
    # that do not split evenly, a LoRA kernel: not banded
    for chunk, processes in (((1, 16, 32), 2), ((8, 8, 32), 4), ((8, 6, 32), 2)):
        assert not export_reads.plan_bands(
            [link], infos, {"w": chunk}, processes=processes, budget=layer
        ), chunk
    assert not export_reads.plan_bands([link], infos, {"w": (8, 1, 32)}, processes=1,
                                       budget=layer, whole={"w"})  # fmt: skip
    # a band's link: its slots' PyTorch tensors, from the band of the Flax tensor alone
    x = np.random.default_rng(0).standard_normal((8, 16, 32)).astype(np.float32)
    band = link.band("i", 4, 8)
    assert band.torch == link.torch[4:8]
    for j in range(4):
        np.testing.assert_array_equal(
            band.value([x[:, 4:8]], j, to_torch=True), link.value([x], 4 + j, to_torch=True)
        )
    box = got_box = export_reads.Bands("i", ()).boxes(link, [(8, 16, 32)], (4, 8))
    assert got_box == [(slice(0, 8), slice(4, 8), slice(0, 32))], box


def test_an_orbax_box_is_read_a_few_whole_chunks_at_a_time():
    pieces = _orbax_source.chunk_pieces((slice(1, 9), slice(0, 4)), (2, 4), 4, 64)
    assert pieces == [
        (slice(1, 4), slice(0, 4)),
        (slice(4, 8), slice(0, 4)),
        (slice(8, 9), slice(0, 4)),
    ]
    # a chunk larger than a piece is a piece alone; one spanning the first axis is cut on
    # the next axis that crosses chunks
    assert _orbax_source.chunk_pieces((slice(0, 8), slice(0, 4)), (4, 4), 4, 16) == [
        (slice(0, 4), slice(0, 4)),
        (slice(4, 8), slice(0, 4)),
    ]
    assert _orbax_source.chunk_pieces((slice(0, 8), slice(0, 8)), (8, 4), 4, 128) == [
        (slice(0, 8), slice(0, 4)),
        (slice(0, 8), slice(4, 8)),
    ]
    assert _orbax_source.chunk_pieces((slice(0, 2), slice(0, 2)), (2, 2), 4, 1 << 20) == [
        (slice(0, 2), slice(0, 2))
    ]
