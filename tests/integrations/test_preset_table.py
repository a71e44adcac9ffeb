"""The presets' table (issue 47 point 6): every name is a factory of one family group
(``osf.hf.presets.generic``, ``tunix``, ``maxtext``) with its own documented keyword
arguments, ``preset_mapping(name, **kwargs)`` calls it and refuses a keyword it does not take,
and the command line passes each preset what it takes from ``--hf-config``. What each
preset maps is proved against the models themselves in ``test_presets.py``,
``test_transformers.py``, ``test_tunix.py`` and ``test_maxtext.py``; no transformers here."""

from __future__ import annotations

import inspect
import re

import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.tools import mapping_flags

CONFIG = {  # a tiny Qwen 3 config, as a dict
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size": 32,
    "vocab_size": 96,
}
GEMMA4 = {  # a tiny Gemma 4 text config, its one global layer with a key for a value
    **CONFIG, "model_type": "gemma4_text", "num_hidden_layers": 2, "attention_k_eq_v": True,
    "layer_types": ["sliding_attention", "full_attention"], "num_global_key_value_heads": 1,
}  # fmt: skip
# The keywords a call for each group gives
KWARGS = {
    "generic": {"tie_word_embeddings": True, "lora_scale": 2.0},
    "tunix": {"head_dim": 8, "tie_word_embeddings": True, "lora_scale": 2.0},
    "maxtext": {"scan_layers": False, "vocab_size": 128, "lora_scale": 2.0},
}
PRIVATE = re.compile(r"_src|integrations/|pipeline/|orbax/\w+\.py|\.py:\d+")


def group(factory):
    return factory.__module__.rsplit(".", 1)[-1]


def config_for(name):
    types = {"llama3": "llama", "qwen3-moe": "qwen3_moe", "deepseek3": "deepseek_v3"}
    layers = {"num_hidden_layers": 2, "first_k_dense_replace": 1}  # (Gemma's, DeepSeek's)
    return {**CONFIG, **layers, "model_type": types.get(name[8:], name[8:])}


@pytest.mark.parametrize("name", list(osf.hf.PRESETS))
def test_each_name_calls_its_factory(name):
    factory = osf.hf.PRESETS[name]
    assert getattr(getattr(osf.hf.presets, group(factory)), factory.__name__) is factory
    takes = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in KWARGS[group(factory)].items() if k in takes}
    if "hf_config" in takes:
        kwargs["hf_config"] = GEMMA4 if name == "tunix-gemma4" else config_for(name)
    mapping = osf.hf.preset_mapping(name, **kwargs)
    assert mapping == factory(**kwargs) and mapping.lora_scale == 2.0
    assert osf.preset_mapping is osf.hf.preset_mapping
    # None and False read as not given: one call serves every group
    common = {"tie_word_embeddings": False, "head_dim": None, "hf_config": None, "lora_scale": None}
    if group(factory) == "generic":
        assert osf.hf.preset_mapping(name, **common) == factory(tie_word_embeddings=False)


def test_the_table_is_read_only_and_joins_the_groups():
    with pytest.raises(TypeError):
        osf.hf.PRESETS["mine"] = osf.hf.presets.generic.dense  # type: ignore[index]
    groups = (osf.hf.presets.generic, osf.hf.presets.tunix, osf.hf.presets.maxtext)
    assert dict(osf.hf.PRESETS) == {k: v for g in groups for k, v in g.PRESETS.items()}


def test_a_keyword_the_preset_does_not_take_is_refused_naming_what_it_takes():
    with pytest.raises(ValueError, match=r"no preset mapping 'llama4' \(presets: llama, "):
        osf.hf.preset_mapping("llama4")
    with pytest.raises(
        ValueError,
        match=r"preset 'qwen3' takes tie_word_embeddings=, lora_scale=; head_dim= is not one "
        r"of them, hf_config= is not one of them \(see osf\.hf\.presets\.generic\.dense\)",
    ):
        osf.hf.preset_mapping("qwen3", head_dim=64, hf_config={})
    with pytest.raises(ValueError, match=r"takes head_dim= \(required\), .*head_dim= is missing"):
        osf.hf.preset_mapping("tunix-qwen3", head_dim=None)
    with pytest.raises(ValueError, match=r"takes hf_config= \(required\).*tie_word_embeddings"):
        osf.hf.preset_mapping("maxtext-qwen3", hf_config=CONFIG, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="needs head_dim="):  # the factory's own check
        osf.hf.presets.tunix.llama3(head_dim=0)
    # False is given to a preset that takes it: GPT-2's head untied
    untied = osf.hf.preset_mapping("gpt2", tie_word_embeddings=False)
    assert untied.to_torch("lm_head.kernel")[0] == "lm_head.weight" and not untied.tied
    assert osf.hf.presets.generic.gpt2().tied == (("lm_head.weight", "transformer.wte.weight"),)


def test_the_command_line_gives_each_preset_what_it_takes_from_the_config():
    assert mapping_flags.resolve_mapping("gpt2", None) == osf.hf.presets.generic.gpt2()
    assert mapping_flags.resolve_mapping("gpt2", {"tie_word_embeddings": False}) == (
        osf.hf.presets.generic.gpt2(tie_word_embeddings=False)
    )
    tied = {**CONFIG, "tie_word_embeddings": True}
    assert mapping_flags.resolve_mapping("qwen3", tied) == osf.hf.presets.generic.dense(
        tie_word_embeddings=True
    )
    assert mapping_flags.resolve_mapping("tunix-qwen3", tied, lora_scale=2.0) == (
        osf.hf.presets.tunix.qwen3(head_dim=8, tie_word_embeddings=True, lora_scale=2.0)
    )
    assert mapping_flags.resolve_mapping("maxtext-qwen3", CONFIG) == (
        osf.hf.presets.maxtext.qwen3(CONFIG)
    )
    with pytest.raises(ValueError, match="'maxtext-qwen3' needs --hf-config"):
        mapping_flags.resolve_mapping("maxtext-qwen3", None)
    with pytest.raises(ValueError, match="'tunix-llama3' needs --hf-config with head_dim"):
        mapping_flags.resolve_mapping("tunix-llama3", {"vocab_size": 96})
    # Gemma 3's head_dim from a multimodal config's text_config; Gemma 4 built of its config
    nested = {"model_type": "gemma3", "text_config": CONFIG}
    assert mapping_flags.resolve_mapping("tunix-gemma3", nested) == osf.hf.presets.tunix.gemma3(
        head_dim=8
    )
    gemma4 = mapping_flags.resolve_mapping("tunix-gemma4", GEMMA4)
    assert gemma4 == osf.hf.presets.tunix.gemma4(GEMMA4)
    assert gemma4.to_flax("model.layers.1.self_attn.k_proj.weight")[0] == "layers.1.attn.k_einsum.w"
    with pytest.raises(ValueError, match="'tunix-gemma4' needs a Hugging Face Gemma 4 config"):
        osf.hf.presets.tunix.gemma4({**GEMMA4, "layer_types": None})


# A count a preset lays out one name or rule for each of, refused past what it can be: the
# key and its value, before anything of that size is built
BOUNDED = {
    "gemma2-layers": ("maxtext-gemma2", {"num_hidden_layers": 10**9},
                      r"num_hidden_layers is 1000000000, more than the 1024 layers"),
    "gemma3-layers": ("maxtext-gemma3", {"num_hidden_layers": 10**9},
                      r"num_hidden_layers is 1000000000, more than the 1024 layers"),
    "deepseek3-layers": ("maxtext-deepseek3", {"num_hidden_layers": 10**9},
                         r"num_hidden_layers is 1000000000, more than the 1024 layers"),
    "deepseek3-nextn": ("maxtext-deepseek3", {"num_nextn_predict_layers": 10**9},
                        r"num_nextn_predict_layers is 1000000000, more than num_hidden_layers 2"),
    "gemma4-shared": ("tunix-gemma4", {"num_kv_shared_layers": 3},
                      r"num_kv_shared_layers is 3, more than num_hidden_layers 2"),
    "gemma4-shared-huge": ("tunix-gemma4", {"num_kv_shared_layers": 10**9},
                           r"num_kv_shared_layers is 1000000000, more than num_hidden_layers 2"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BOUNDED))
def test_counts_a_preset_lays_out_are_bounded(case):
    name, changes, message = BOUNDED[case]
    config = GEMMA4 if name == "tunix-gemma4" else config_for(name)
    with pytest.raises(osf.ConfigError, match=message):
        osf.hf.preset_mapping(name, hf_config={**config, **changes})
    # the bound itself is laid out (Gemma 3 scanned: cheaply); every layer shared is too
    if name == "tunix-gemma4":
        shared = osf.hf.preset_mapping(name, hf_config={**config, "num_kv_shared_layers": 2})
        assert shared.flax_ignored("layers.0.attn.kv_einsum.w")
    elif name == "maxtext-gemma3":
        most = {**config, "num_hidden_layers": osf.hf.presets.maxtext.MOST_LAYERS}
        osf.hf.preset_mapping(name, hf_config=most, scan_layers=True)


def documents(factory, param):
    """``param`` is in ``factory``'s Args, or in those of the factory whose arguments it says
    it shares (``Its arguments are :func:`llama3`'s``)."""
    doc = inspect.getdoc(factory) or ""
    if re.search(rf"^\s*{param}:", doc, re.MULTILINE):
        return True
    shared = re.search(r"arguments are :func:`(\w+)`'s", doc)
    module = getattr(osf.hf.presets, group(factory))
    return bool(shared) and documents(getattr(module, shared.group(1)), param)


# osf.hf's names whose docstrings are still to be cut down with the export engine's rewrite
PENDING = {"export_pytorch", "load_pytorch"}


def test_factories_and_the_namespace_document_their_contract():
    """Each factory, ``osf.hf`` itself and its names: a docstring of at most 40 lines, with an
    example, naming no private module; each factory names its presets and documents every
    argument."""
    names = [getattr(osf.hf, n) for n in osf.hf.__all__ if n not in {*PENDING, "PRESETS"}]
    for obj in [osf.hf, *names, *set(osf.hf.PRESETS.values())]:
        doc = inspect.getdoc(obj) or ""
        assert len(doc.splitlines()) <= 40, obj
        assert "Example::" in doc, obj
        assert not PRIVATE.search(doc), (obj, PRIVATE.search(doc))
    for name, factory in osf.hf.PRESETS.items():
        assert f'"{name}"' in inspect.getdoc(factory), name
        for param in inspect.signature(factory).parameters:
            assert documents(factory, param), (name, param)
