"""``osf.import_pytorch`` (issue 48 point 3): a Hugging Face directory written as the
checkpoint MaxText 0.2.5's ``to_maxtext`` saves, on tiny random transformers models, scanned
and not:

- MaxText's own reader of it (``load_params_from_path`` and ``verify_and_sync_scan_layers``
  run from its wheel: ``tests/helpers/maxtext_loader.py``) restores into the model's abstract
  parameters (sharded as MaxText shards them) what ``load_pytorch`` gives in one process, bit
  for bit, and checks ``scan_layers``; the layout is MaxText's (``{"step", "params",
  "opt_state": {}}`` in the checkpointable ``items``), DeepSeek's router bias in
  ``MoEBiasVar``;
- the checkpoint exported back through the same preset gives the original tensors bit for
  bit, or, for Gemma (norms stored ``1 + w``: a float32 rounding), the model's logits;
- the transforms ran on the devices (the tensors split over 8), with the host's bits: Gemma's
  bfloat16 scales and offsets too;
- what is refused is refused before anything is written.

Several processes: ``tests/multihost/test_maxtext_import_multihost.py``.
"""

from __future__ import annotations

import json

import devices
import jax
import maxtext_checkpoints
import maxtext_layout
import maxtext_loader
import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as osf

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")

V1 = pytest.mark.skipif(not maxtext_checkpoints.can_import(), reason=maxtext_checkpoints.NO_IMPORT)
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **SIZES, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        query_pre_attn_scalar=8, sliding_window=4, num_hidden_layers=4,
    ),
    "deepseek3": lambda: transformers.DeepseekV3Config(
        **SIZES, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, tie_word_embeddings=False,
    ),
}  # fmt: skip
# (kind, scan_layers, the files' dtype, MaxText's vocabulary where padded past the config's);
# llama3 with head_dim 16: a query scale that round trips
CASES = [("llama3", True, None, None), ("deepseek3", True, None, None),
         ("gemma2", False, None, 104), ("gemma2", True, ml_dtypes.bfloat16, None)]  # fmt: skip
IDS = ["llama3-scanned", "deepseek3-scanned", "gemma2-unscanned-padded", "gemma2-bf16-scanned"]


def bits(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def flat(tree):
    return maxtext_checkpoints.flatten(jax.tree.map(np.asarray, tree))


def stored(step_dir):
    """The train state of a MaxText step as Orbax reads it: ``step``, ``opt_state``, and the
    parameters' metadata by dotted name (``params`` dropped)."""
    from orbax.checkpoint import v1 as ocp

    context = ocp.Context()
    context.pytree.loading.partial_load = True
    with context:
        state = ocp.load(step_dir, {"step": 0, "opt_state": {}}, checkpointable_name="items")
    params = ocp.metadata(step_dir, checkpointable_name="items").metadata["params"]
    return state | {"params": maxtext_checkpoints.flatten(params)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def model(kind, dtype=None):
        if (kind, dtype) not in made:
            torch.manual_seed(0)
            if kind == "llama3":
                net = maxtext_layout.tiny_model(kind, head_dim=16)
            else:
                net = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
                with torch.no_grad():  # random norms and biases (ones would hide a swap)
                    for name, p in net.named_parameters():
                        if "norm" in name or name.endswith("bias"):
                            p.copy_(0.1 * torch.randn_like(p) + (kind != "gemma2"))
            where = tmp_path_factory.mktemp(kind)
            (net if dtype is None else net.to(torch.bfloat16)).save_pretrained(where)
            made[kind, dtype] = (net, where)
        return made[kind, dtype]

    return model


def maxtext_abstract(tree):
    """MaxText's abstract parameters of the same shapes: float32 (its ``weight_dtype``), split
    over two devices on the first axis they divide (its FSDP)."""
    mesh = jax.sharding.Mesh(np.array(devices.take(2)), ("fsdp",))

    def abstract(x):
        axis = next((a for a, n in enumerate(x.shape) if n % 2 == 0), None)
        spec = jax.sharding.PartitionSpec(*([None] * axis + ["fsdp"]) if axis is not None else ())
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, np.float32, sharding=sharding)

    return jax.tree.map(abstract, tree)


@V1
@pytest.mark.parametrize(("kind", "scan_layers", "dtype", "vocab"), CASES, ids=IDS)
def test_maxtexts_reader_restores_the_import_and_an_export_gives_the_model(
    models, tmp_path, kind, scan_layers, dtype, vocab
):
    net, hf = models(kind, dtype)
    root = tmp_path / "ckpt"
    report = osf.import_pytorch(
        hf, root, f"maxtext-{kind}", step=3, scan_layers=scan_layers, vocab_size=vocab
    )
    assert report.ok, report.problems()
    items = root / "3" / "items"
    meta = json.loads((root / "3" / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"] == {"scan_layers": scan_layers}
    assert sorted(meta["item_handlers"]) == ["items"]
    mapping = osf.preset_mapping(
        f"maxtext-{kind}", hf_config=hf, scan_layers=scan_layers, vocab_size=vocab
    )
    want = osf.load_pytorch(None, hf, mapping)  # one process, on the host
    embedding = want["params"]["params"]["token_embedder"]["embedding"]
    assert embedding.shape[0] == (vocab or 96)  # (zero rows past the config's)
    # (a) MaxText's own reader, into the model's abstract parameters
    assert maxtext_loader.verify_scan_layers(items, scan_layers=scan_layers) is scan_layers
    with pytest.raises(ValueError, match="saved with scan_layers"):
        maxtext_loader.verify_scan_layers(items, scan_layers=not scan_layers)
    got = maxtext_loader.load_params_from_path(items, maxtext_abstract(want["params"]))
    assert sorted(got) == (["MoEBiasVar", "params"] if kind == "deepseek3" else ["params"])
    want_flat, got_flat = flat(want["params"]), flat(got)
    assert sorted(got_flat) == sorted(want_flat)
    state = stored(root / "3")
    assert state["step"] == 3 and state["opt_state"] == {}
    for name, value in want_flat.items():
        assert state["params"][name].dtype == value.dtype, name  # as stored: not cast
        np.testing.assert_array_equal(bits(got_flat[name].astype(value.dtype)), bits(value), name)
    # (b) back through the same preset
    out = tmp_path / "out"
    assert osf.export_pytorch(items, out, mapping, hf_config=hf).ok
    original, exported = maxtext_layout.hf_tensors(hf), maxtext_layout.hf_tensors(out)
    assert sorted(exported) == sorted(original)
    if kind != "gemma2":
        for key, value in original.items():
            np.testing.assert_array_equal(bits(exported[key]), bits(value), key)
    elif dtype is None:  # Gemma's norms, 1 + w in float32: the logits (docs/huggingface.md)
        served = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.tensor([[1, 5, 9, 2, 77, 31, 4, 60]])
        with torch.no_grad():
            got_logits, want_logits = served(ids).logits.numpy(), net(ids).logits.numpy()
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


@V1
def test_dtype_and_refusals_write_nothing(models, tmp_path):
    _, hf = models("llama3")
    root = tmp_path / "ckpt"
    mapping = osf.preset_mapping("maxtext-llama3", hf_config=hf, scan_layers=False)
    report = osf.import_pytorch(hf, root, mapping, dtype="bfloat16", batch_bytes=1 << 12)
    assert report.ok and report.bytes_read == sum(v.nbytes for v in maxtext_layout.hf_tensors(hf).values())  # fmt: skip
    meta = json.loads((root / "0" / "_CHECKPOINT_METADATA").read_text())
    assert meta.get("custom_metadata") in (None, {})  # a mapping: scan_layers not given
    want = osf.load_pytorch(None, hf, mapping)["params"]  # cast after the transforms
    got = flat(maxtext_loader.load_params_from_path(root / "0" / "items", maxtext_abstract(want)))
    for name, value in flat(want).items():
        assert stored(root / "0")["params"][name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(
            got[name], value.astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    with pytest.raises(osf.SafetensorsCheckpointError, match=r"step 0 exists already"):
        osf.import_pytorch(hf, root, "maxtext-llama3")
    with pytest.raises(
        ValueError, match=r"'llama': not a MaxText preset \(maxtext-llama3, .*\) nor module:attr"
    ):
        osf.import_pytorch(hf, tmp_path / "other", "llama")
    with pytest.raises(ValueError, match=r"maps 'qwen2' models; the config is a 'llama'"):
        osf.import_pytorch(hf, tmp_path / "other", "maxtext-qwen2")
    # a key no rule maps: refused before anything is read or written
    import safetensors.numpy

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((hf / "config.json").read_text())
    tensors = maxtext_layout.hf_tensors(hf) | {"model.extra.weight": np.zeros(2, np.float32)}
    safetensors.numpy.save_file(tensors, str(odd / "model.safetensors"))
    with pytest.raises(osf.TargetMismatchError, match=r"model\.extra\.weight"):
        osf.import_pytorch(odd, tmp_path / "other", "maxtext-llama3")
    assert not (tmp_path / "other").exists()
    before = sorted(p.name for p in root.iterdir())  # a checkpoint's other steps are kept
    with pytest.raises(osf.TargetMismatchError, match=r"model\.extra\.weight"):
        osf.import_pytorch(odd, root, "maxtext-llama3", step=1)
    assert sorted(p.name for p in root.iterdir()) == before == ["0"]


def test_an_orbax_without_v1_training_is_named():
    if maxtext_checkpoints.can_import():
        pytest.skip("this orbax-checkpoint has what the import needs (the older stacks have not)")
    with pytest.raises(ImportError, match=r"orbax-checkpoint >= 0\.12\.8.*installed"):
        osf.import_pytorch("unused", "unused", "maxtext-llama3")


def _hostile(models, tmp_path, case):
    """A copy of the tiny LLaMA's directory made hostile in one way."""
    import safetensors.numpy

    _, hf = models("llama3")
    config = json.loads((hf / "config.json").read_text())
    tensors = maxtext_layout.hf_tensors(hf)
    d = tmp_path / case
    d.mkdir()
    claims = {"vocab": {"vocab_size": config["vocab_size"] - 1}, "layers": {"num_hidden_layers": 3},
              "heads": {"num_attention_heads": 3}, "tied": {"tie_word_embeddings": True}, "string": {"num_attention_heads": "4"}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config | claims.get(case, {})))
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    if case == "outside":  # an index naming a file out of the directory
        index = {"weight_map": {k: "../llama3/model.safetensors" for k in tensors}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "model.safetensors").rename(d / "unused.bin")
    elif case == "symlink":  # the model file a link to one out of the directory
        (d / "model.safetensors").unlink()
        (d / "model.safetensors").symlink_to(hf / "model.safetensors")
    elif case == "int_query":  # the query scale would multiply in int8
        for i in (0, 1):
            q = f"model.layers.{i}.self_attn.q_proj.weight"
            tensors[q] = np.arange(tensors[q].size, dtype=np.int8).reshape(tensors[q].shape)
        safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    elif case == "last_layer":  # a tensor only the last layer lacks
        del tensors["model.layers.1.mlp.down_proj.weight"]
        safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    elif case == "truncated":
        (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100])
    return d


HOSTILE = {
    "outside": r"model\.safetensors\.index\.json: names '\.\./llama3/model\.safetensors', which leads outside",
    "symlink": r"model\.safetensors.*(symbolic link|outside)",
    "vocab": r"config\.json: vocab_size 95, but .* has 96 rows",
    "layers": r"config\.json: num_hidden_layers 3, but the tensors hold layers 0 to 1 \(2\)",
    "heads": r"config\.json: num_key_value_heads 2 does not divide num_attention_heads 3",
    "string": r"config\.json: num_attention_heads is '4', not a whole number",
    "tied": r"lm_head\.weight \[96, 32\] differs from model\.embed_tokens\.weight \[96, 32\], though .*config\.json says tie_word_embeddings true",
    "int_query": r"model\.layers\.0\.self_attn\.q_proj\.weight I8\[.*Scale applies to floating-point tensors, not int8",
    "last_layer": r"model\.layers\.1\.mlp\.down_proj\.weight absent: the files hold",
    "truncated": r"model\.safetensors: tensor '.*' ends at \d+, past the \d+-byte data section",
}  # fmt: skip


@V1
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_is_one_error_line_and_leaves_nothing(models, tmp_path, capsys, case):
    from orbax_safetensors._src.tools import cli

    hf = _hostile(models, tmp_path, case)
    capsys.readouterr()  # (what building the model printed)
    out = tmp_path / "new" / "ckpt"  # neither exists: both must be gone after the failure
    assert cli.main(["import", str(hf), str(out), "--mapping", "maxtext-llama3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("orbax-safetensors import: error: "), err
    assert __import__("re").search(HOSTILE[case], err), err
    assert not (tmp_path / "new").exists()
    with pytest.raises(osf.SafetensorsCheckpointError):  # the same from Python
        osf.import_pytorch(hf, out, "maxtext-llama3")
    assert not (tmp_path / "new").exists()


@V1
@pytest.mark.parametrize(
    ("kind", "claim", "message"),
    [
        ("gemma2", {"num_hidden_layers": 10**9},
         r"num_hidden_layers 1000000000, but the tensors hold layers 0 to 3 \(4\)"),
        ("deepseek3", {"num_hidden_layers": 10**9},
         r"num_hidden_layers 1000000000, but the tensors hold layers 0 to 2 \(3\)"),
        ("deepseek3", {"num_nextn_predict_layers": 10**9},
         r"num_nextn_predict_layers is 1000000000, more than num_hidden_layers 3"),
    ],
    ids=["gemma2-layers", "deepseek3-layers", "deepseek3-nextn"],
)  # fmt: skip
def test_a_forged_count_is_refused_before_the_preset_is_built(
    models, tmp_path, capsys, kind, claim, message
):
    # the config is checked against the tensors before the preset lays out its layers
    import shutil

    _, hf = models(kind)
    forged = tmp_path / "forged"
    shutil.copytree(hf, forged)
    config = json.loads((hf / "config.json").read_text())
    (forged / "config.json").write_text(json.dumps(config | claim))
    with pytest.raises(osf.ConfigError, match=message):
        osf.import_pytorch(forged, tmp_path / "ckpt", f"maxtext-{kind}")
    from orbax_safetensors._src.tools import cli  # the command line builds it first itself

    capsys.readouterr()
    assert (
        cli.main(["import", str(forged), str(tmp_path / "ckpt"), "--mapping", f"maxtext-{kind}"])
        == 2
    )
    assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "ckpt").exists()


@V1
def test_the_command_line_writes_what_maxtext_reads(models, tmp_path, capsys):
    from orbax_safetensors._src.tools import cli

    _, hf = models("llama3")
    capsys.readouterr()  # (what building the model printed)
    root = tmp_path / "ckpt"
    argv = ["import", str(hf), str(root), "--mapping", "maxtext-llama3", "--step", "2"]
    assert cli.main([*argv, "--no-scan-layers", "--dtype", "bfloat16"]) == 0
    items = root / "2" / "items"
    assert f"load_parameters_path={items}" in capsys.readouterr().out
    assert maxtext_loader.verify_scan_layers(items, scan_layers=False) is False
    mapping = osf.preset_mapping("maxtext-llama3", hf_config=hf, scan_layers=False)
    want = osf.load_pytorch(None, hf, mapping)["params"]
    got = flat(maxtext_loader.load_params_from_path(items, maxtext_abstract(want)))
    for name, value in flat(want).items():
        np.testing.assert_array_equal(
            got[name], value.astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    assert cli.main(argv) == 2  # step 2 exists: refused, left as it was
    assert "step 2 exists already" in capsys.readouterr().err
    assert cli.main(["import", str(hf), str(tmp_path / "x"), "--mapping", "llama"]) == 2
    assert "not a MaxText preset" in capsys.readouterr().err and not (tmp_path / "x").exists()


@V1
def test_a_relative_checkpoint_directory_is_imported(models, tmp_path, monkeypatch, capsys):
    # (Orbax refuses a relative path: the import makes it absolute, as it is typed on the CLI)
    from orbax_safetensors._src.tools import cli

    _, hf = models("llama3")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["import", str(hf), "ckpt", "--mapping", "maxtext-llama3"]) == 0, (
        capsys.readouterr().err
    )
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["0"]
    assert stored(tmp_path / "ckpt" / "0")["step"] == 0


@V1
def test_a_weights_or_index_file_is_imported_with_its_directorys_config(models, tmp_path):
    # (the preset and the config check read the config.json beside the file, not the file)
    import safetensors

    _, hf = models("llama3")
    assert osf.import_pytorch(hf / "model.safetensors", tmp_path / "ckpt", "maxtext-llama3").ok
    d = _hostile(models, tmp_path, "layers")
    with safetensors.safe_open(d / "model.safetensors", "np") as f:
        index = {"weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("model.safetensors", "model.safetensors.index.json"):
        with pytest.raises(osf.SafetensorsCheckpointError, match=HOSTILE["layers"]):
            osf.import_pytorch(d / name, tmp_path / "other", "maxtext-llama3")
    assert not (tmp_path / "other").exists()
