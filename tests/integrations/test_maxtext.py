"""The MaxText presets (``maxtext-llama3``, ``maxtext-mistral``, ``maxtext-mixtral``,
``maxtext-qwen3``, ``maxtext-qwen3-moe``), end to end: a random tiny transformers model, its
tensors in MaxText's layout (``tests/helpers/maxtext_layout.py``, MaxText's forward conversion), a
train state saved as MaxText saves it (``tests/helpers/maxtext_checkpoints.py``), exported (Python and
command line), loaded by ``from_pretrained``: every tensor equal, bit for bit, to what MaxText's
own conversion writes, the logits equal; and ``load_pytorch`` filling a train state's
parameters from the Hugging Face directory. With MaxText's wheel at hand
(``OSF_MAXTEXT_WHEEL``, ``tests/helpers/maxtext_reference.py``) the layout's facts are checked against
MaxText's own hooks too."""

from __future__ import annotations

import json

import devices
import jax
import maxtext_checkpoints
import maxtext_layout
import maxtext_reference
import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not maxtext_checkpoints.has_v1_training(), reason=maxtext_checkpoints.NO_V1_TRAINING
)

BF16 = np.dtype(ml_dtypes.bfloat16)
KINDS = maxtext_layout.KINDS
PADDED = {"qwen3": 128}  # a MaxText vocabulary padded past the config's (96)
TIED = {"qwen3"}  # Qwen 3's small models tie their embeddings (MaxText: logits_via_embedding)


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def assert_same_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(bits(got[k]), bits(want[k]), err_msg=k)


class Case:
    """A tiny model of ``kind`` saved by transformers in ``tmp/hf``, and its tensors in
    MaxText's layout."""

    def __init__(self, tmp, kind, *, scan_layers=True, dtype=None):
        self.kind, self.scan_layers, self.dtype = kind, scan_layers, dtype
        self.model = maxtext_layout.tiny_model(kind, tied=kind in TIED)
        self.config = self.model.config
        self.hf_dir = tmp / "hf"
        self.model.save_pretrained(self.hf_dir)
        self.hf = maxtext_layout.hf_tensors(self.hf_dir)
        self.params = maxtext_layout.to_maxtext(
            kind,
            self.hf,
            self.config,
            scan_layers=scan_layers,
            vocab=PADDED.get(kind),
            dtype=dtype,
        )
        self.preset = "maxtext-" + kind

    def state(self):
        return maxtext_checkpoints.train_state(self.params)

    def reference(self, dtype=None):
        """What MaxText's conversion writes (``weight_dtype`` ``dtype``)."""
        return maxtext_layout.to_hf(self.kind, self.params, self.config, dtype=dtype)


def logits(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.tensor([[1, 5, 9, 2, 77, 31, 4, 60]])
    with torch.no_grad():
        return model(ids).logits.float().numpy(), model


def served(directory, reference: dict, tmp):
    """``from_pretrained`` of ``directory`` against ``from_pretrained`` of the reference tensors
    (same config): no missing or unexpected keys, every parameter equal, the logits equal."""
    import safetensors.numpy

    ref_dir = tmp / "reference"
    ref_dir.mkdir(exist_ok=True)
    safetensors.numpy.save_file(reference, str(ref_dir / "model.safetensors"), {"format": "pt"})
    (ref_dir / "config.json").write_text((directory / "config.json").read_text())
    _, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got_logits, got = logits(directory)
    want_logits, want = logits(ref_dir)
    want_state = want.state_dict()
    for k, v in got.state_dict().items():
        np.testing.assert_array_equal(
            bits(v.view(torch.int16) if v.dtype == torch.bfloat16 else v.numpy()),
            bits(
                want_state[k].view(torch.int16)
                if want_state[k].dtype == torch.bfloat16
                else want_state[k].numpy()
            ),
            err_msg=k,
        )
    np.testing.assert_array_equal(got_logits, want_logits)
    return got_logits


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("kind", [k for k in KINDS if k in maxtext_reference.ENTRIES])
def test_the_tests_layout_is_maxtexts_own_conversion(tmp_path, kind):
    # tests/helpers/maxtext_layout.py against MaxText's own tables and hooks, both directions
    for scan_layers in (True, False):
        for dtype in (None, BF16):
            case = Case(tmp_path, kind, scan_layers=scan_layers, dtype=dtype)
            config = case.config.to_dict()
            theirs = maxtext_reference.to_maxtext(
                kind, case.hf, config, case.params, scan_layers=scan_layers
            )
            ours = maxtext_reference._flat(case.params)
            assert sorted(ours) == sorted(theirs)
            for k in ours:
                np.testing.assert_array_equal(
                    bits(ours[k]), bits(theirs[k].astype(ours[k].dtype)), err_msg=k
                )
            if kind in PADDED and not case.config.tie_word_embeddings:
                continue  # MaxText's Qwen hooks do not cut a padded logits_dense
            assert_same_tensors(
                case.reference(),
                maxtext_reference.to_hf(kind, case.params, config, scan_layers=scan_layers),
            )


def test_the_layout_round_trips_where_the_query_scale_is_a_power_of_two(tmp_path):
    # head_dim 16: the factors 1/4 and 4 are exact; LLaMA's head_dim 8 is not (its reference
    # is MaxText's, not the original model)
    case = Case(tmp_path, "mistral")
    assert_same_tensors(case.reference(), case.hf)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["f32", "bf16"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("kind", KINDS)
def test_export_is_maxtexts_conversion(tmp_path, kind, scan_layers, dtype):
    # f32: a float32 checkpoint exported as is; bf16: a bfloat16 checkpoint (MaxText's
    # weight_dtype) for scanned layers, a float32 one exported as bfloat16 (the hooks in
    # float32, then the cast: MaxText's order) for unscanned ones
    stored = BF16 if dtype and scan_layers else None
    case = Case(tmp_path, kind, scan_layers=scan_layers, dtype=stored)
    step = maxtext_checkpoints.save_v1(tmp_path / "ckpt", 7, case.state(), scan_layers=scan_layers)
    out = tmp_path / "out"
    mapping = osf.preset_mapping(case.preset, hf_config=case.hf_dir)
    report = osf.export_pytorch(
        step / "items",
        out,
        mapping,
        hf_config=case.config,
        dtype=None if stored is not None or dtype is None else BF16,
    )
    assert report.ok, report.problems()
    reference = case.reference(dtype=BF16 if dtype else None)
    assert_same_tensors(maxtext_layout.hf_tensors(out), reference)
    got = served(out, reference, tmp_path)
    if kind == "mistral" and dtype is None:  # an exact round trip: the original model's logits
        want, _ = logits(case.hf_dir)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("kind", ["llama3", "qwen3-moe"])
def test_export_from_the_command_line(tmp_path, capsys, kind, scan_layers):
    case = Case(tmp_path, kind, scan_layers=scan_layers)
    step = maxtext_checkpoints.save_v1(tmp_path / "ckpt", 7, case.state(), scan_layers=scan_layers)
    out = tmp_path / "out"
    argv = ["export", step / "items", out, "--mapping", case.preset, "--hf-config", case.hf_dir]
    code = cli.main([str(a) for a in (*argv, "--dtype", "bfloat16")])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "exported" in printed
    reference = case.reference(dtype=BF16)
    assert_same_tensors(maxtext_layout.hf_tensors(out), reference)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    served(out, reference, tmp_path)


@pytest.mark.parametrize("how", ["pytree", "standard"])
def test_export_of_a_v0_checkpoint(tmp_path, how):
    # MaxText before 0.2.5: a v0 CheckpointManager item "items"
    case = Case(tmp_path, "mixtral")
    step = maxtext_checkpoints.save_v0(tmp_path / "ckpt", 3, case.state(), how=how)
    out = tmp_path / "out"
    mapping = osf.preset_mapping(case.preset, hf_config=case.config)
    assert osf.export_pytorch(step / "items", out, mapping, hf_config=case.config).ok
    assert_same_tensors(maxtext_layout.hf_tensors(out), case.reference())


def test_an_untied_head_with_a_tied_config_is_refused(tmp_path):
    # a checkpoint with logits_dense exported through a config that ties the embeddings would
    # serve another model (the embedding as the head): refused, naming the tensor
    case = Case(tmp_path, "llama3")
    config = case.config.to_dict() | {"tie_word_embeddings": True}
    mapping = osf.preset_mapping(case.preset, hf_config=config)
    with pytest.raises(osf.TargetMismatchError, match="logits_dense"):
        osf.export_pytorch({"params": {"params": case.params}}, tmp_path / "out", mapping)


# --------------------------------------------------------------------------- load


def _zeros_like(tree):
    return jax.tree.map(lambda x: np.zeros_like(x), tree)


@pytest.mark.parametrize("dtype", [None, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_fills_a_train_states_params(tmp_path, kind, scan_layers, dtype):
    # the start of a fine-tune: a MaxText train state (zeros) filled from the Hugging Face
    # directory; the values are MaxText's forward conversion's (hooks, then the weight dtype),
    # the optimizer state and the step untouched
    case = Case(tmp_path, kind, scan_layers=scan_layers, dtype=dtype)
    want = case.state()
    target = {**want, "params": _zeros_like(want["params"])}
    mapping = osf.preset_mapping(
        case.preset, hf_config=case.hf_dir, scan_layers=scan_layers, vocab_size=PADDED.get(kind)
    )
    got, report = osf.load_pytorch(target, case.hf_dir, mapping, with_report=True)
    assert report.ok, report.problems()
    got_flat = maxtext_checkpoints.flatten(got)
    for name, value in maxtext_checkpoints.flatten(want).items():
        np.testing.assert_array_equal(bits(np.asarray(got_flat[name])), bits(value), err_msg=name)


@pytest.mark.parametrize("kind", ["llama3", "mixtral"])
def test_load_into_an_abstract_state_sharded_as_maxtext_shards_it(tmp_path, kind):
    # MaxText's abstract train state (FSDP: each parameter split on its embed axis over the
    # devices): every parameter comes back a jax.Array of its target's sharding, MaxText's bits
    devices.take(2)
    case = Case(tmp_path, kind)
    want = maxtext_checkpoints.shard_state(case.state())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want
    )
    mapping = osf.preset_mapping(case.preset, hf_config=case.hf_dir)
    got = maxtext_checkpoints.flatten(osf.load_pytorch(abstract, case.hf_dir, mapping))
    for name, value in maxtext_checkpoints.flatten(want).items():
        if name.startswith("params."):
            assert got[name].sharding == value.sharding, name
            np.testing.assert_array_equal(bits(np.asarray(got[name])), bits(np.asarray(value)))


def test_load_needs_scan_layers_false_for_unscanned_layers(tmp_path):
    case = Case(tmp_path, "qwen3", scan_layers=False)
    mapping = osf.preset_mapping(case.preset, hf_config=case.hf_dir, vocab_size=128)
    with pytest.raises(osf.TargetMismatchError, match=r"decoder\.layers\.self_attention"):
        osf.load_pytorch(case.state(), case.hf_dir, mapping)


# --------------------------------------------------------------------------- the preset's API


def test_preset_arguments_and_config_errors(tmp_path):
    config = maxtext_layout.tiny_config("llama3")
    with pytest.raises(ValueError, match="takes hf_config="):
        osf.preset_mapping("maxtext-llama3")
    with pytest.raises(ValueError, match="takes hf_config="):
        osf.preset_mapping("maxtext-llama3", hf_config=config, head_dim=8)
    with pytest.raises(ValueError, match="maps 'qwen3' models; the config is a 'llama'"):
        osf.preset_mapping("maxtext-qwen3", hf_config=config)
    with pytest.raises(ValueError, match="needs a Hugging Face config with vocab_size"):
        osf.preset_mapping("maxtext-llama3", hf_config={"model_type": "llama"})
    with pytest.raises(ValueError, match=r"a directory without config\.json"):
        osf.preset_mapping("maxtext-llama3", hf_config=tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        osf.preset_mapping("maxtext-llama3", hf_config=tmp_path / "missing.json")
    # the config as an object, a dict, a file or a directory: the same mapping
    config.save_pretrained(tmp_path)
    forms = [config, config.to_dict(), tmp_path / "config.json", str(tmp_path)]
    mappings = [osf.preset_mapping("maxtext-llama3", hf_config=c) for c in forms]
    assert all(m == mappings[0] for m in mappings)
    name = "params.params.decoder.layers.self_attention.query.kernel"
    assert mappings[0].to_torch(name)[0] == "model.layers.0.self_attn.q_proj.weight"
    name = "params.params.decoder.layers_1.mlp.wo.kernel"
    assert mappings[0].to_torch(name)[0] == "model.layers.1.mlp.down_proj.weight"


def test_cli_maxtext_preset_needs_hf_config(tmp_path, capsys):
    code = cli.main(["export", str(tmp_path), str(tmp_path / "out"), "--mapping", "maxtext-qwen3"])
    _, err = capsys.readouterr()
    assert code == 2 and "needs --hf-config" in err
