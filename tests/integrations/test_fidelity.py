"""An export never changes what the model computes, silently (issue 40 point 6,
``integrations/fidelity.py``), proved through transformers' ``from_pretrained``:

- a tied head fine-tuned apart from its embedding is written as ``lm_head.weight``, untied in
  ``config.json``, with a warning naming it and its largest difference (from memory, from a
  checkpoint, as a servable item): the served logits are the JAX model's;
- a fused GQA projection split that does not fit the config's heads, key/value heads and
  head_dim, or the rule's ``sizes=``, is an error naming the rule and the ``sizes=`` that fits,
  on load and on export.
"""

from __future__ import annotations

import json
import warnings

import hf_models
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors._src.integrations import fidelity, model_files
from orbax_safetensors._src.integrations.config_facts import ConfigFacts

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")

IDS = np.random.default_rng(0).integers(0, 96, size=(2, 9))


def hf_logits(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(torch.from_numpy(IDS)).logits.float().numpy()


def keys(directory):
    with safetensors.safe_open(str(directory / "model.safetensors"), "np") as f:
        return set(f.keys())


# --------------------------------------------------------------------------- tied heads


def fine_tuned_head_model():
    """A LLaMA port with its own ``lm_head`` (the embedding's transpose, then fine-tuned
    apart: the issue's Gemma 3 case), and its Hugging Face config, which says tied."""
    model = hf_models.CausalLM(hf_models.tiny_config(tied=False), rngs=nnx.Rngs(0))
    for index, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        key = jax.random.key(index)
        var.set_value(0.02 * jax.random.normal(key, var.get_value().shape))
    head = model.model.embed_tokens.embedding[...].T
    model.lm_head.kernel[...] = head + 0.01 * jax.random.normal(jax.random.key(99), head.shape)
    return hf_models.tiny_config(tied=True), model


TIED = osf.preset_mapping("llama", tie_word_embeddings=True)
WARNING = r"lm_head\.weight differs from model\.embed_tokens\.weight \(largest difference 0\.0"


def test_a_fine_tuned_tied_head_is_written_untied_with_a_warning(tmp_dir):
    """Issue 40's first silent answer: no lm_head.weight, report.ok, no warning, and
    transformers served the embedding as the head."""
    config, model = fine_tuned_head_model()
    with pytest.warns(UserWarning, match=WARNING + r".*tie_word_embeddings: false"):
        report = osf.export_pytorch(model, tmp_dir / "hf", TIED, hf_config=config)
    assert report.ok and report.untied == ["lm_head.weight"]
    assert "lm_head.weight" in keys(tmp_dir / "hf")
    written = json.loads((tmp_dir / "hf" / "config.json").read_text())
    assert written["tie_word_embeddings"] is False and config.tie_word_embeddings
    want = np.asarray(model(jnp.asarray(IDS)))
    hf_models.assert_outputs_close(hf_logits(tmp_dir / "hf"), want, rtol=1e-5, atol=1e-5)

    # From a checkpoint (read from its files) and as a servable item: the same.
    state = nnx.state(model, nnx.Param)
    with ocp.CheckpointManager(tmp_dir / "ckpt") as mngr:
        mngr.save(0, args=osf.SafetensorsSave(state))
    with pytest.warns(UserWarning, match=WARNING):
        osf.export_pytorch(tmp_dir / "ckpt", tmp_dir / "from_ckpt", TIED, hf_config=config)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with (
        ocp.CheckpointManager(tmp_dir / "run", options=options) as mngr,
        pytest.warns(UserWarning, match=WARNING),
    ):
        mngr.save(0, args=osf.SafetensorsSave(state, mapping=TIED, hf_config=config))
    for other in (tmp_dir / "from_ckpt", tmp_dir / "run" / "0" / "default"):
        assert "lm_head.weight" in keys(other)
        assert json.loads((other / "config.json").read_text())["tie_word_embeddings"] is False
        hf_models.assert_outputs_close(hf_logits(other), want, rtol=1e-5, atol=1e-5)


def test_without_a_config_the_warning_says_what_the_config_must_say(tmp_dir):
    _, model = fine_tuned_head_model()
    with pytest.warns(UserWarning, match=r"the config\.json you pair them with must say"):
        report = osf.export_pytorch(model, tmp_dir / "hf", TIED)
    assert report.untied == ["lm_head.weight"] and "lm_head.weight" in keys(tmp_dir / "hf")


def test_a_head_equal_to_its_embedding_stays_tied_without_a_warning(tmp_dir):
    config, model = fine_tuned_head_model()
    model.lm_head.kernel[...] = model.model.embed_tokens.embedding[...].T
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = osf.export_pytorch(model, tmp_dir / "hf", TIED, hf_config=config)
    assert report.ok and not report.untied and "lm_head.weight" not in keys(tmp_dir / "hf")
    assert json.loads((tmp_dir / "hf" / "config.json").read_text())["tie_word_embeddings"]
    np.testing.assert_allclose(
        hf_logits(tmp_dir / "hf"), np.asarray(model(jnp.asarray(IDS))), rtol=1e-5, atol=1e-5
    )


def test_untied_config_keeps_the_rest_and_a_nested_text_config():
    doc = {"model_type": "gemma3", "text_config": {"tie_word_embeddings": True, "x": 1}}
    assert model_files.untied_config(doc) == {
        "model_type": "gemma3",
        "tie_word_embeddings": False,
        "text_config": {"tie_word_embeddings": False, "x": 1},
    }
    assert doc["text_config"]["tie_word_embeddings"]  # (the caller's dict untouched)


# --------------------------------------------------------------------------- fused GQA


def gqa_config():
    # Issue 40's second silent answer: Q 64 and KV 16 columns fused, 96 in all, which also
    # split into three equal parts of 32.
    return transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=96,
        max_position_embeddings=64,
    )


RULE = r"rule 'model\.layers\.\{i\}\.self_attn\.\{p:q_proj\|k_proj\|v_proj\}\.weight' -> 'qkv'"


def test_a_fused_split_that_does_not_fit_is_an_error_naming_the_rule(tmp_dir):
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(gqa_config()).eval()
    reference.save_pretrained(tmp_dir / "ref")
    abstract = hf_models.scanned_llama_abstract(gqa_config())
    assert abstract["qkv"].shape == (2, 64, 96)
    equal = hf_models.scanned_llama_mapping(qkv_sizes=None)
    wrong = hf_models.scanned_llama_mapping(qkv_sizes=(48, 24, 24))
    right = hf_models.scanned_llama_mapping(qkv_sizes=(64, 16, 16))

    # On load: the parts are 64, 16, 16 wide; a rule without sizes= (or other sizes) would
    # export them split otherwise.
    with pytest.raises(osf.TargetMismatchError, match=RULE + r".*\[64, 16, 16\].*give sizes="):
        osf.load_pytorch(abstract, tmp_dir / "ref", equal)
    with pytest.raises(
        osf.TargetMismatchError, match=RULE + r".*not the rule's sizes=\(48, 24, 24\): give sizes="
    ):
        osf.load_pytorch(abstract, tmp_dir / "ref", wrong)
    params = osf.load_pytorch(abstract, tmp_dir / "ref", right)

    # On export: checked against the config's 4 heads, 1 key/value head of head_dim 16.
    for mapping, split in ((equal, "equal parts"), (wrong, r"sizes=\(48, 24, 24\)")):
        with pytest.raises(
            osf.TargetMismatchError,
            match=RULE + rf" splits qkv \[2, 64, 96\] into {split}: .*q_proj\.weight \[\d+, 64\], "
            r"but the config's 4 heads, 1 key/value heads of head_dim 16 make it 64 rows"
            r" .*give sizes=\(64, 16, 16\)",
        ):
            osf.export_pytorch(params, tmp_dir / "bad", mapping, hf_config=gqa_config())
    assert not (tmp_dir / "bad").exists()
    report = osf.export_pytorch(params, tmp_dir / "hf", right, hf_config=gqa_config())
    assert report.ok
    with torch.no_grad():
        want = reference(torch.from_numpy(IDS)).logits.numpy()
    hf_models.assert_outputs_close(hf_logits(tmp_dir / "hf"), want, rtol=1e-5, atol=1e-5)


def test_attention_sizes_of_configs():
    def sizes(config):
        return ConfigFacts.of(config).language_model().attention()

    assert sizes(gqa_config()) == (4, 1, 16)
    assert sizes({"num_attention_heads": 8, "hidden_size": 64}) == (8, 8, 8)
    nested = {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}}
    assert sizes(nested) == (8, 4, 32)
    assert sizes({"model_type": "x"}) is None


def test_a_nested_text_config_checks_the_language_models_projections_only():
    from orbax_safetensors._src.integrations import links

    parts = ".self_attn.{p:q_proj|k_proj|v_proj}.weight"
    mapping = osf.KeyMapping(
        [
            osf.Rule("model.language_model.layers.0" + parts, "lm.qkv", osf.Transpose(), fused="p", axis=-1),
            osf.Rule("model.vision_tower.layers.0" + parts, "vis.qkv", osf.Transpose(), fused="p", axis=-1),
        ]
    )  # fmt: skip
    shapes = {"lm.qkv": (64, 96), "vis.qkv": (64, 96)}  # split in equal parts of 32
    found, report = links.find_links(mapping, shapes, flax_side=True)
    assert report.ok
    torch_shapes = {
        k: s for link in found for k, s in zip(link.torch, link.torch_shapes([shapes[link.flax[0]]], np.float32))
    }  # fmt: skip
    config = {"text_config": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}}
    problems = fidelity.fused_config_problems(
        found, torch_shapes, shapes, lambda n: np.float32, ConfigFacts.of(config)
    )
    assert len(problems) == 1 and "'lm.qkv'" in problems[0], problems
    assert "give sizes=(64, 16, 16)" in problems[0]
