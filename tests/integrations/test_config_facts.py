"""``integrations/config_facts.py``: a config's sizes read as validated numbers, and checked
against the Hugging Face tensors an export plans (the hostile cases through every verb:
``tests/hostile/test_config_claims.py``)."""

from __future__ import annotations

import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.integrations.config_facts import ConfigFacts

LLAMA = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
}


def llama_tensors(layers=2, vocab=96, width=64, q_rows=32):
    shapes = {"model.embed_tokens.weight": (vocab, 32), "lm_head.weight": (vocab, 32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, 32),
            p + "self_attn.k_proj.weight": (16, 32),
            p + "self_attn.v_proj.weight": (16, 32),
            p + "self_attn.o_proj.weight": (32, q_rows),
            p + "mlp.gate_proj.weight": (width, 32),
            p + "mlp.up_proj.weight": (width, 32),
            p + "mlp.down_proj.weight": (32, width),
            p + "input_layernorm.weight": (32,),
        }
    return shapes


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"vocab_size": -1}, "vocab_size is -1, not positive"),
        ({"vocab_size": 0}, "vocab_size is 0, not positive"),
        ({"vocab_size": "96"}, "vocab_size is '96', not a whole number"),
        ({"vocab_size": True}, "vocab_size is True, not a whole number"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers is 2.0"),
        ({"num_hidden_layers": -2}, "num_hidden_layers is -2, negative"),
        ({"num_experts": "8"}, "num_experts is '8', not a whole number"),
        ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
        ({"hidden_size": 30}, "hidden_size 30 does not split into num_attention_heads 4 heads"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', not true or false"),
    ],
)
def test_impossible_values_are_refused_when_read(changes, match):
    facts = ConfigFacts({**LLAMA, **changes})
    with pytest.raises(osf.ConfigError, match=match):
        facts.validated()
        facts.flag("tie_word_embeddings")


def test_sizes_read():
    facts = ConfigFacts.of(LLAMA)
    assert facts.attention() == (4, 2, 8) and facts.size("vocab_size") == 96
    assert ConfigFacts({"num_attention_heads": 4, "head_dim": 16}).attention() == (4, 4, 16)
    assert ConfigFacts({"model_type": "x"}).attention() is None
    assert ConfigFacts({"vocab_size": None}).size("vocab_size") is None  # (JSON null: not given)
    nested = ConfigFacts({"text_config": LLAMA}).language_model()
    assert nested.prefix == "text_config." and nested.attention() == (4, 2, 8)
    with pytest.raises(osf.ConfigError, match=r"text_config\.vocab_size is 0"):
        ConfigFacts({"text_config": {**LLAMA, "vocab_size": 0}}).validated()
    # a transformers config: every key, its defaults too (as the model it builds has them)
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, vocab_size=96)
    assert ConfigFacts.of(config).size("num_hidden_layers") == config.num_hidden_layers


def test_a_consistent_export_has_no_problems():
    assert ConfigFacts(LLAMA).tensor_problems(llama_tensors()) == []


@pytest.mark.parametrize(
    ("tensors", "line"),
    [
        (
            llama_tensors(vocab=48),
            "vocab_size 96, but model.embed_tokens.weight [48, 32] has 48 rows (and 1 more",
        ),
        (
            llama_tensors(q_rows=64),
            "num_attention_heads 4 x head_dim 8 = 32, but model.layers.0.self_attn.q_proj.weight "
            "[64, 32] has 64 rows (and 3 more tensors)",
        ),
        (llama_tensors(width=48), "intermediate_size 64, but model.layers.0.mlp.gate_proj"),
        (llama_tensors(layers=3), "num_hidden_layers 2, but the tensors hold layers 0 to 2 (3)"),
        (llama_tensors(layers=1), "num_hidden_layers 2, but the tensors hold layers 0 to 0 (1)"),
    ],
    ids=["vocab", "heads", "width", "more-layers", "fewer-layers"],
)
def test_contradictions_name_the_key_and_both_numbers(tensors, line):
    problems = ConfigFacts(LLAMA).tensor_problems(tensors)
    assert len(problems) == 1 and line in problems[0], problems


def test_experts():
    config = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4}
    tensors = {"model.layers.0.block_sparse_moe.gate.weight": (4, 32)}
    for e in range(4):
        for w, shape in (("w1", (64, 32)), ("w3", (64, 32)), ("w2", (32, 64))):
            tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] = shape
    facts = ConfigFacts({**config, "num_hidden_layers": 1})
    assert facts.tensor_problems(tensors) == []
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    tensors.pop("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    tensors.pop("model.layers.0.block_sparse_moe.experts.3.w3.weight")
    (problem,) = facts.tensor_problems(tensors)
    assert "num_local_experts 4, but layer 0 holds experts 0 to 2 (3)" in problem
    # Qwen MoE: the experts' width is moe_intermediate_size
    qwen = ConfigFacts({**LLAMA, "model_type": "qwen3_moe", "num_experts": 1, "num_hidden_layers": 1,
                        "moe_intermediate_size": 16})  # fmt: skip
    moe = {"model.layers.0.mlp.experts.0.gate_proj.weight": (64, 32)}
    (problem,) = qwen.tensor_problems(moe)
    assert "moe_intermediate_size 16, but model.layers.0.mlp.experts.0.gate_proj" in problem


def test_layouts_it_does_not_know_are_left_alone():
    # multi-head latent attention (DeepSeek): q_proj rows are not heads * head_dim
    mla = {**LLAMA, "model_type": "deepseek_v3", "head_dim": 64}
    assert ConfigFacts(mla).tensor_problems(llama_tensors(q_rows=64 * 3)) == []
    # a vision tower's layers, a per-layer MLP width list (Gemma 3n), predictor layers
    tower = {"model.vision_tower.encoder.layers.5.self_attn.q_proj.weight": (7, 7)}
    assert ConfigFacts(LLAMA).tensor_problems({**llama_tensors(), **tower}) == []
    lists = {**LLAMA, "intermediate_size": [48, 48]}
    assert ConfigFacts(lists).tensor_problems(llama_tensors(width=48)) == []
    nextn = {**LLAMA, "num_nextn_predict_layers": 1}
    assert ConfigFacts(nextn).tensor_problems(llama_tensors(layers=3)) == []
    # counts only compared with the tensors: zero shapes nothing a dense model has
    dense = {**LLAMA, "num_experts": 0, "moe_intermediate_size": 0, "num_nextn_predict_layers": 0}
    assert ConfigFacts(dense).tensor_problems(llama_tensors()) == []
    (problem,) = ConfigFacts({**LLAMA, "intermediate_size": 0}).tensor_problems(llama_tensors())
    assert "intermediate_size 0, but model.layers.0.mlp.gate_proj.weight [64, 32] has 64" in problem


def test_a_huge_count_is_compared_not_built():
    # 10**12 layers or experts: compared with what the tensors hold, nothing of that size made
    huge = 10**12
    (problem,) = ConfigFacts({**LLAMA, "num_hidden_layers": huge}).tensor_problems(llama_tensors())
    assert f"num_hidden_layers {huge}, but the tensors hold layers 0 to 1 (2)" in problem
    nextn = {**LLAMA, "num_nextn_predict_layers": huge}
    assert ConfigFacts(nextn).tensor_problems(llama_tensors(layers=3)) == []
    for key in ("num_local_experts", "num_experts"):
        config = {**LLAMA, "model_type": "mixtral", "num_hidden_layers": 1, key: huge}
        tensors = {"model.layers.0.block_sparse_moe.experts.0.w1.weight": (64, 32)}
        (problem,) = ConfigFacts(config).tensor_problems(tensors)
        assert f"{key} {huge}, but layer 0 holds experts 0 to 0 (1)" in problem


def test_deepseek_latent_attention_and_routed_experts():
    # transformers' DeepseekV3Attention: 4 heads, q_lora_rank 12, kv_lora_rank 8, qk_nope 6,
    # qk_rope 4, v 5; 2 routed experts
    config = {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32,
              "num_attention_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 8,
              "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
              "n_routed_experts": 2, "moe_intermediate_size": 16, "num_hidden_layers": 1}  # fmt: skip
    p = "model.layers.0."
    tensors = {
        p + "self_attn.q_a_proj.weight": (12, 32),
        p + "self_attn.q_a_layernorm.weight": (12,),
        p + "self_attn.q_b_proj.weight": (40, 12),
        p + "self_attn.kv_a_proj_with_mqa.weight": (12, 32),
        p + "self_attn.kv_a_layernorm.weight": (8,),
        p + "self_attn.kv_b_proj.weight": (44, 8),
        p + "self_attn.o_proj.weight": (32, 20),
        p + "mlp.gate.weight": (2, 32),
        **{f"{p}mlp.experts.{e}.gate_proj.weight": (16, 32) for e in range(2)},
    }
    assert ConfigFacts(config).tensor_problems(tensors) == []
    (problem,) = ConfigFacts({**config, "num_attention_heads": 2}).tensor_problems(
        {p + "self_attn.o_proj.weight": (32, 20)}
    )
    assert (
        "num_attention_heads 2 x (v_head_dim 5) = 10, but model.layers.0.self_attn.o_proj"
        in problem
    )
    problems = ConfigFacts({**config, "n_routed_experts": 3}).tensor_problems(tensors)
    assert any("n_routed_experts 3, but layer 0 holds experts 0 to 1 (2)" in x for x in problems)
    assert any("n_routed_experts 3, but model.layers.0.mlp.gate.weight" in x for x in problems)
    # no query LoRA (V2-Lite): q_proj holds the heads; an absent size claims nothing
    lite = {**config, "q_lora_rank": None}
    assert ConfigFacts(lite).tensor_problems({p + "self_attn.q_proj.weight": (40, 32)}) == []
    with pytest.raises(osf.ConfigError, match="q_lora_rank is 0, not positive"):
        ConfigFacts({**config, "q_lora_rank": 0}).validated()
