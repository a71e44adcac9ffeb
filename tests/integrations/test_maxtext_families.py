"""The MaxText presets of issue 48 (``maxtext-qwen2``, ``maxtext-gemma2``, ``maxtext-gemma3``,
``maxtext-deepseek3``) against MaxText 0.2.5's own conversion (its name tables, hooks and
shape tables, run by ``tests/helpers/maxtext_reference.py``) on tiny random transformers
models, both directions, scanned and unscanned: ``load_pytorch`` of the Hugging Face
directory gives MaxText's ``to_maxtext`` tensors bit for bit (float32 files, and bfloat16 ones
for Gemma, whose hooks round), the export of a train state saved as MaxText saves it gives its
``to_huggingface`` tensors bit for bit, and ``from_pretrained`` of the export computes the
model's logits. The facts MaxText's tables do not cover are checked by hand: DeepSeek's
router bias (``MoEBiasVar``), Gemma 3's names of transformers 4 and 5."""

from __future__ import annotations

import copy
import re

import devices
import jax
import maxtext_checkpoints
import maxtext_layout
import maxtext_reference as reference
import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as osf

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not maxtext_checkpoints.has_v1_training(), reason=maxtext_checkpoints.NO_V1_TRAINING
)

BF16 = np.dtype(ml_dtypes.bfloat16)
KINDS = ("qwen2", "gemma2", "gemma3", "deepseek3")
EXACT = ("qwen2", "deepseek3")  # no value changes: the export is the original model
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
GEMMA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
             sliding_window=4)  # fmt: skip
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(
        **SIZES, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "gemma2": lambda: transformers.Gemma2Config(**SIZES, **GEMMA, num_hidden_layers=4),
    # 13 layers: six scanned stacks of two, one left over
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(**SIZES, **GEMMA, num_hidden_layers=13),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94,
    ),
    "deepseek3": lambda: transformers.DeepseekV3Config(
        **SIZES, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, tie_word_embeddings=False,
    ),
}  # fmt: skip
# MaxText's shapes, by hand (E 32, heads 4 of 8, 2 key/value heads, MLP 64)
SHAPES = {
    ("qwen2", True): {"decoder.layers.self_attention.key.bias": (2, 2, 8)},
    ("qwen2", False): {"decoder.layers_1.self_attention.query.bias": (4, 8)},
    ("gemma2", True): {"decoder.layers.self_attention_global.query.kernel": (32, 2, 4, 8),
                       "decoder.layers.pre_ffw_norm_local.scale": (32, 2)},
    ("gemma2", False): {"decoder.layers_1.mlp_local.wo.kernel": (64, 32)},
    ("gemma3", True): {"decoder.layers.layers_5.self_attention.query_norm.scale": (8, 2),
                       "decoder.layers_remainder.layers_0.mlp.wi_0.kernel": (32, 64),
                       "vision_encoder.Gemma3VisionEncoderLayer_0.pos_embedding": (1, 4, 16)},
    ("gemma3", False): {"decoder.layers_12.self_attention.out.kernel": (4, 8, 32)},
    ("deepseek3", True): {"decoder.dense_layers.self_attention.wq_b.kernel": (12, 1, 4, 10),
                          "decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wo": (4, 2, 16, 32),
                          "decoder.moe_layers.self_attention.out.kernel": (4, 2, 5, 32)},
    ("deepseek3", False): {"decoder.moe_layers_1.self_attention.wkv_a.kernel": (32, 12)},
}  # fmt: skip
BIAS = "decoder.moe_layers{}.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"  # DeepSeek's router bias
SCANS = pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
CASES = [(k, d) for k in KINDS for d in (None, BF16) if d is None or k.startswith("gemma")]


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def flat(tree):
    return {k: np.asarray(v) for k, v in maxtext_checkpoints.flatten(tree).items()}


def maxtext_name(key):  # any of transformers' Gemma 3 names -> those of MaxText's tables
    key = re.sub(r"^language_model\.model\.", "model.language_model.", key)
    key = re.sub(r"^(model\.)?vision_tower\.(vision_model\.)?", "model.vision_tower.vision_model.", key)  # fmt: skip
    return re.sub(r"^multi_modal_projector\.", "model.multi_modal_projector.", key)


def written_name(key):  # MaxText's names -> those an export writes (the published files')
    key = re.sub(r"^model\.language_model\.", "language_model.model.", key)
    return re.sub(r"^model\.(vision_tower|multi_modal_projector)\.", r"\1.", key)


class Model:
    """A random tiny model of ``kind`` (norms and biases random too), saved by transformers
    in float32 and bfloat16."""

    def __init__(self, kind, root):
        torch.manual_seed(0)
        self.config = CONFIGS[kind]()
        self.model = transformers.AutoModelForCausalLM.from_config(self.config).eval()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p) + (0 if kind.startswith("gemma") else 1))
        self.dirs = {None: root / "f32", BF16: root / "bf16"}
        self.model.save_pretrained(self.dirs[None])
        copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(self.dirs[BF16])
        # what MaxText's tables read: transformers 5's Qwen 2 has its biases unconditionally
        self.table_config = self.config.to_dict()
        if kind == "qwen2":
            self.table_config |= {"attention_bias": True, "head_dim": 8}

    def tensors(self, dtype=None):
        return maxtext_layout.hf_tensors(self.dirs[dtype])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def model(kind):
        if kind not in made:
            made[kind] = Model(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return model


def loaded(kind, m, scan_layers, dtype=None):
    mapping = osf.preset_mapping("maxtext-" + kind, hf_config=m.dirs[None], scan_layers=scan_layers)
    tree, report = osf.load_pytorch(None, m.dirs[dtype], mapping, with_report=True)
    assert report.ok, report.problems()
    return jax.tree.map(np.asarray, tree["params"]), mapping


def router_bias(m, hf):
    """DeepSeek's router bias from the Hugging Face tensors, ``(moe layers, experts)``."""
    first = m.config.first_k_dense_replace
    layers = range(first, m.config.num_hidden_layers)
    return np.stack([hf[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in layers])


# --------------------------------------------------------------------------- load


@SCANS
@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=lambda v: str(v or "f32"))
def test_load_is_maxtexts_own_conversion(models, kind, dtype, scan_layers):
    reference.param_mapping()  # (skips at once without MaxText's wheel)
    m = models(kind)
    params, _ = loaded(kind, m, scan_layers, dtype)
    hf = m.tensors(dtype)
    ours = reference._flat(params["params"])
    theirs = reference.to_maxtext(
        kind, {maxtext_name(k): v for k, v in hf.items()}, m.table_config, params["params"],
        scan_layers=scan_layers,
    )  # fmt: skip
    for name in ours:
        assert ours[name].dtype == (dtype or np.float32), name
        np.testing.assert_array_equal(bits(ours[name]), bits(theirs[name]), err_msg=name)
    # every name of MaxText's table whose tensors the files hold, none other
    table, _ = reference._tables(kind, m.table_config, scan_layers, saving_to_hf=False)
    held = {maxtext_name(k) for k in hf}
    applicable = {k for k, v in table.items() if set(np.ravel(v)) <= held}
    bias = {k for k in applicable if k.endswith("gate-bias")}  # (MoEBiasVar, below)
    assert set(ours) == applicable - bias
    for name, shape in SHAPES[kind, scan_layers].items():
        assert np.shape(flat(params["params"])[name]) == shape, name
    if kind == "deepseek3":  # 0.2.5: a MoEBiasVar, its layers on axis 0
        got = flat(params["MoEBiasVar"])
        want = router_bias(m, hf)
        if scan_layers:
            np.testing.assert_array_equal(got[BIAS.format("")], want)
        else:
            for j, row in enumerate(want):
                np.testing.assert_array_equal(got[BIAS.format(f"_{j}")], row)


# --------------------------------------------------------------------------- export


def legacy_bias(params):
    """``params`` with DeepSeek's router bias in the ``params`` collection, as MaxText's
    tables name it (scanned: ``(experts, layers)``, a Param's layers on axis 1)."""
    tree = {"params": jax.tree.map(lambda x: x, params["params"])}
    for name, value in flat(params.get("MoEBiasVar", {})).items():
        node = tree["params"]
        *path, leaf = name.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value.T
    return tree


@SCANS
@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=lambda v: str(v or "f32"))
def test_export_is_maxtexts_own_conversion(models, tmp_path, kind, dtype, scan_layers):
    reference.param_mapping()  # (skips at once without MaxText's wheel)
    m = models(kind)
    params, mapping = loaded(kind, m, scan_layers)
    params = jax.tree.map(lambda x: x.astype(dtype or x.dtype), params)
    count = np.asarray(7, np.int32)
    mu = jax.tree.map(np.zeros_like, params)
    state = {"step": count, "params": params, "opt_state": [{"count": count, "mu": mu}]}
    step = maxtext_checkpoints.save_v1(tmp_path / "ckpt", 7, state, scan_layers=scan_layers)
    out = tmp_path / "out"
    report = osf.export_pytorch(step / "items", out, mapping, hf_config=m.dirs[None])
    assert report.ok, report.problems()
    want = reference.to_hf(
        kind, legacy_bias(params)["params"], m.table_config, scan_layers=scan_layers
    )
    got = maxtext_layout.hf_tensors(out)
    assert sorted(got) == sorted(map(written_name, want))
    for name, value in want.items():
        assert got[written_name(name)].dtype == value.dtype, name
        np.testing.assert_array_equal(bits(got[written_name(name)]), bits(value), err_msg=name)
    if dtype is not None:
        return
    # served: transformers loads every weight, and computes the model's logits
    served, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.tensor([[1, 5, 9, 2, 77, 31, 4, 60]])
    with torch.no_grad():
        got_logits, want_logits = served(ids).logits.numpy(), m.model(ids).logits.numpy()
    if kind in EXACT:
        np.testing.assert_array_equal(got_logits, want_logits)
    else:  # Gemma's norms stored as 1 + w: float32 rounding of the weights (docs)
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gemma3", "deepseek3"])
def test_sharded_targets_and_sharded_exports(models, tmp_path, kind):
    # the transforms on the devices (a load into MaxText's sharded abstract state, an export
    # of its sharded arrays): the host's bits
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices.take(2)), ("fsdp",))
    m = models(kind)
    params, mapping = loaded(kind, m, True)

    def sharding(x):  # the first axis two devices split
        axis = next((a for a, n in enumerate(x.shape) if n % 2 == 0), None)
        spec = PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "fsdp")
        return NamedSharding(mesh, spec)

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), params)  # fmt: skip
    got = osf.load_pytorch({"params": abstract}, m.dirs[None], mapping)["params"]
    for g, want, a in zip(*map(jax.tree.leaves, (got, params, abstract))):
        assert g.sharding == a.sharding and np.array_equal(bits(np.asarray(g)), bits(want))
    for name, tree in (("host", params), ("devices", got)):
        assert osf.export_pytorch({"params": tree}, tmp_path / name, mapping).ok
    host, on_devices = (maxtext_layout.hf_tensors(tmp_path / n) for n in ("host", "devices"))
    assert sorted(host) == sorted(on_devices)
    assert all(np.array_equal(bits(v), bits(on_devices[k])) for k, v in host.items())


def test_deepseek_router_bias_from_either_collection_and_mtp_layers_left_out(models, tmp_path):
    m = models("deepseek3")
    params, mapping = loaded("deepseek3", m, True)
    # an older Linen checkpoint keeps the bias as a Param: the same files
    for name, tree in (("var", params), ("param", legacy_bias(params))):
        assert osf.export_pytorch({"params": tree}, tmp_path / name, mapping).ok
    a, b = (maxtext_layout.hf_tensors(tmp_path / n) for n in ("var", "param"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    # a published V3 file holds a multi-token prediction layer past num_hidden_layers
    import safetensors.numpy

    mtp = m.dirs[None].parent / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text((m.dirs[None] / "config.json").read_text())
    extra = {"model.layers.3.eh_proj.weight": np.zeros((32, 64), np.float32)}
    safetensors.numpy.save_file(m.tensors() | extra, str(mtp / "model.safetensors"))
    tree, report = osf.load_pytorch(None, mtp, mapping, with_report=True)
    assert report.ok and report.ignored == list(extra), report.problems()
    same = flat(jax.tree.map(np.asarray, tree["params"]))
    assert all(np.array_equal(v, same[k]) for k, v in flat(params).items())


def test_deepseek_without_a_query_lora(tmp_path):
    # q_lora_rank None (as V2): Hugging Face's q_proj is MaxText's self_attention.query
    reference.param_mapping()
    config = CONFIGS["deepseek3"]()
    config.q_lora_rank = None
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    mapping = osf.preset_mapping("maxtext-deepseek3", hf_config=tmp_path, scan_layers=True)
    params = jax.tree.map(np.asarray, osf.load_pytorch(None, tmp_path, mapping))["params"]
    ours = reference._flat(params["params"])
    assert ours["params-decoder-moe_layers-self_attention-query-kernel"].shape == (32, 2, 4, 10)
    hf = maxtext_layout.hf_tensors(tmp_path)
    theirs = reference.to_maxtext("deepseek3", hf, config.to_dict(), params["params"],
                                  scan_layers=True)  # fmt: skip
    assert all(np.array_equal(bits(v), bits(theirs[k])) for k, v in ours.items())
    assert osf.export_pytorch({"params": params}, tmp_path / "out", mapping).ok
    written = maxtext_layout.hf_tensors(tmp_path / "out")
    assert sorted(written) == sorted(hf)
    assert all(np.array_equal(bits(v), bits(hf[k])) for k, v in written.items())


# DeepSeek claims the tensors contradict (4 heads, q_lora_rank 12, kv_lora_rank 8, qk_nope 6,
# qk_rope 4, v 5, 4 routed experts): the key, the claim and the tensors' number
DEEPSEEK_CLAIMS = {
    "heads": ({"num_attention_heads": 2, "num_key_value_heads": 2},
              r"num_attention_heads 2 x \(qk_nope_head_dim 6 \+ qk_rope_head_dim 4\) = 20, but "
              r"model\.layers\.0\.self_attn\.q_b_proj\.weight \[40, 12\] has 40 rows"),
    "experts": ({"n_routed_experts": 8}, r"n_routed_experts 8, but layer 1 holds experts 0 to 3"),
    "q_lora_rank": ({"q_lora_rank": 10}, r"q_lora_rank 10, but .* has 12 rows"),
    "kv_lora_rank": ({"kv_lora_rank": 4}, r"kv_lora_rank 4 \+ qk_rope_head_dim 4 = 8, but .*kv_a_proj_with_mqa.* has 12 rows"),
    "rope": ({"qk_rope_head_dim": 2}, r"qk_rope_head_dim 2\) = 32, but .* has 40 rows"),
    "v_head_dim": ({"v_head_dim": 4}, r"num_attention_heads 4 x \(v_head_dim 4\) = 16, but .*o_proj.* has 20 columns"),
}  # fmt: skip


def test_deepseek_claims_are_checked_against_the_tensors(models, tmp_path):
    # an export's config (its config.json) and a load's preset: refused, naming the claim
    m = models("deepseek3")
    params, mapping = loaded("deepseek3", m, True)
    config = m.config.to_dict()
    for name, (changes, message) in DEEPSEEK_CLAIMS.items():
        out = tmp_path / name
        with pytest.raises(osf.TargetMismatchError, match=message):
            osf.export_pytorch({"params": params}, out, mapping, hf_config=config | changes)
        assert not out.exists()
    # the preset's heads carry the per-head sizes: a load refuses heads of the wrong size
    for changes in ({"num_attention_heads": 2, "num_key_value_heads": 2}, {"v_head_dim": 4}):
        wrong = osf.preset_mapping("maxtext-deepseek3", hf_config=config | changes)
        with pytest.raises(osf.TargetMismatchError, match=r"wkv_b\.kernel|out\.kernel"):
            osf.load_pytorch(None, m.dirs[None], wrong)


def test_gemma3_reads_the_names_of_transformers_4_and_5(models, tmp_path):
    import safetensors.numpy

    m = models("gemma3")
    params, mapping = loaded("gemma3", m, False)
    hf = m.tensors()
    forms = {  # MaxText's tables (transformers 4.5x in memory); the published files
        "maxtext": maxtext_name,
        "hub": lambda k: re.sub(r"^vision_tower\.", "vision_tower.vision_model.", k),
        "memory": lambda k: maxtext_name(k).replace(
            ".vision_tower.vision_model.", ".vision_tower."
        ),
    }
    for form, rename in forms.items():
        d = tmp_path / form
        d.mkdir()
        (d / "config.json").write_text((m.dirs[None] / "config.json").read_text())
        safetensors.numpy.save_file({rename(k): v for k, v in hf.items()}, str(d / "model.safetensors"))  # fmt: skip
        tree = flat(jax.tree.map(np.asarray, osf.load_pytorch(None, d, mapping)["params"]))
        assert all(np.array_equal(v, tree[k]) for k, v in flat(params).items()), form
    # the language model alone (Gemma3ForCausalLM): Hugging Face's model.*, no vision encoder
    text = transformers.Gemma3ForCausalLM(m.config.text_config).eval()
    text.save_pretrained(tmp_path / "text")
    mapping = osf.preset_mapping("maxtext-gemma3", hf_config=tmp_path / "text")
    assert not any("vision" in r.flax for r in mapping.rules)
    tree = osf.load_pytorch(None, tmp_path / "text", mapping)
    assert osf.export_pytorch(tree, tmp_path / "out", mapping, hf_config=tmp_path / "text").ok
    served = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(served) is transformers.Gemma3ForCausalLM
    ids = torch.tensor([[1, 5, 9, 2, 77, 31, 4, 60]])
    with torch.no_grad():
        got, want = served(ids).logits.numpy(), text(ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_config_errors():
    gemma2 = CONFIGS["gemma2"]().to_dict()
    with pytest.raises(osf.ConfigError, match=r"num_hidden_layers is 3, not an even number"):
        osf.preset_mapping("maxtext-gemma2", hf_config=gemma2 | {"num_hidden_layers": 3})
    deepseek = CONFIGS["deepseek3"]().to_dict() | {"first_k_dense_replace": 4}
    with pytest.raises(
        osf.ConfigError, match=r"first_k_dense_replace is 4, more than num_hidden_layers 3"
    ):
        osf.preset_mapping("maxtext-deepseek3", hf_config=deepseek)
    with pytest.raises(ValueError, match=r"needs a Hugging Face config with num_hidden_layers"):
        osf.preset_mapping("maxtext-gemma2", hf_config=gemma2 | {"num_hidden_layers": None})
    with pytest.raises(ValueError, match=r"maps 'gemma3' or 'gemma3_text' models; .* 'gemma2'"):
        osf.preset_mapping("maxtext-gemma3", hf_config=gemma2)
    vision = CONFIGS["gemma3"]().to_dict()
    vision["vision_config"]["num_attention_heads"] = 0
    with pytest.raises(osf.ConfigError, match=r"vision_config\.num_attention_heads is 0"):
        osf.preset_mapping("maxtext-gemma3", hf_config=vision)
