"""The value transforms of ``integrations/transforms.py``: hand-computed examples, properties,
and bit-for-bit agreement with MaxText's own conversion hooks (when its wheel is at hand:
``tests/helpers/maxtext_reference.py``)."""

from __future__ import annotations

import maxtext_reference
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbax_safetensors._src.integrations import transforms
from orbax_safetensors._src.integrations.transforms import Offset, RopeInterleave, Scale, VocabRows

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = (np.dtype(np.float32), BF16, np.dtype(np.float16))


def rand(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).astype(dtype)


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


# --------------------------------------------------------------------------- Scale


def test_query_scale_by_hand():
    # head_dim 2: float32(1 / sqrt(2)) = 0.70710677, float32(sqrt(2)) = 1.4142135
    s = Scale.attention_query(2)
    one = np.ones(1, np.float32)
    assert s.to_flax(one)[0] == np.float32(0.70710677)
    assert s.to_torch(one)[0] == np.float32(1.4142135)
    # bfloat16: 0.70710677 rounds to 0.70703125; times 1.4142135 (0.99989...) rounds to 1.0
    into = s.to_flax(one.astype(BF16))
    assert into.dtype == BF16 and float(into[0]) == 0.70703125
    assert float(s.to_torch(into)[0]) == 1.0
    # head_dim 64: exact factors 1/8 and 8
    x = rand((3, 5), np.float32)
    np.testing.assert_array_equal(Scale.attention_query(64).to_flax(x), x / 8)
    np.testing.assert_array_equal(Scale.attention_query(64).to_torch(x / 8), x)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("head_dim", [8, 16, 128])
def test_query_scale_is_a_float32_product_rounded_to_the_dtype(dtype, head_dim):
    x = rand((4, 6), dtype)
    want_in = (x.astype(np.float32) * np.float32(1 / np.sqrt(head_dim))).astype(dtype)
    want_out = (x.astype(np.float32) * np.float32(np.sqrt(head_dim))).astype(dtype)
    s = Scale.attention_query(head_dim)
    assert s.to_flax(x).dtype == dtype
    np.testing.assert_array_equal(bits(s.to_flax(x)), bits(want_in))
    np.testing.assert_array_equal(bits(s.to_torch(x)), bits(want_out))


def test_query_scale_keeps_float64_in_float64():
    x = rand((3,), np.float64)
    np.testing.assert_array_equal(Scale.attention_query(8).to_flax(x), x * (1 / np.sqrt(8)))


def test_query_scale_refuses_a_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim must be positive"):
        Scale.attention_query(0)


# --------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.bool_], ids=str)
@pytest.mark.parametrize(
    "transform", [Scale.attention_query(16), Offset(1.0)], ids=["scale", "offset"]
)
def test_value_transforms_refuse_integer_and_bool_tensors(transform, dtype):
    # (computed in the dtype, 49 * 4 would wrap in int8 and a bool stay a bool)
    x = np.ones(3, dtype)
    for direction in (transform.to_flax, transform.to_torch):
        with pytest.raises(
            ValueError, match=f"floating-point tensors, not {np.dtype(dtype).name} ones"
        ):
            direction(x)


def test_rope_interleave_by_hand():
    x = np.arange(8)
    np.testing.assert_array_equal(RopeInterleave().to_flax(x), [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(RopeInterleave().to_torch(np.array([0, 4, 1, 5, 2, 6, 3, 7])), x)
    # on another axis
    y = np.arange(12).reshape(4, 3)
    np.testing.assert_array_equal(RopeInterleave(axis=0).to_flax(y), y[[0, 2, 1, 3]])


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    half=st.integers(1, 6),
)
def test_rope_interleave_is_a_permutation_both_ways(lead, half):
    shape = (*lead, 2 * half)
    x = np.arange(int(np.prod(shape))).reshape(shape)
    inter = RopeInterleave().to_flax(x)
    # position 2k holds the first half's k, position 2k + 1 the second half's k
    for k in range(half):
        np.testing.assert_array_equal(inter[..., 2 * k], x[..., k])
        np.testing.assert_array_equal(inter[..., 2 * k + 1], x[..., half + k])
    np.testing.assert_array_equal(RopeInterleave().to_torch(inter), x)


def test_rope_interleave_refuses_an_odd_axis():
    with pytest.raises(ValueError, match="odd size"):
        RopeInterleave().to_flax(np.zeros((2, 3)))


# --------------------------------------------------------------------------- vocabulary


def test_vocab_rows_cut_and_pad():
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    np.testing.assert_array_equal(VocabRows(6).to_torch(x), x[:6])
    np.testing.assert_array_equal(VocabRows(6).to_flax(x[:6]), x[:6])
    padded = VocabRows(6, padded=8).to_flax(x[:6])
    assert padded.shape == (8, 2) and not padded[6:].any()
    np.testing.assert_array_equal(padded[:6], x[:6])
    # the logits kernel: vocabulary on the last axis
    k = x.T
    np.testing.assert_array_equal(VocabRows(6, axis=-1).to_torch(k), k[:, :6])
    # a shorter vocabulary than the config's is padded with zeros on export
    assert VocabRows(10).to_torch(x).shape == (10, 2)


def test_vocab_rows_probe_pads_without_allocating():
    probe = np.broadcast_to(np.zeros((), np.float32), (60000, 1 << 20))
    out = VocabRows(60000, padded=61440).to_flax(probe)
    assert out.shape == (61440, 1 << 20) and not any(out.strides)


@pytest.mark.parametrize(
    ("rows", "transform", "direction"),
    [
        (96, VocabRows(48), "to_torch"),  # a config's vocabulary cutting real rows
        (96, VocabRows(1 << 40), "to_torch"),  # one claiming what it would allocate
        (96, VocabRows(96, padded=1 << 40), "to_flax"),  # a load padded to a claim
        (96, VocabRows(1 << 40), "to_flax"),  # a file the config contradicts
        (96, VocabRows(-5), "to_torch"),
        (1 << 20, VocabRows((1 << 20) - 4096), "to_torch"),  # past PADDING_ROWS
    ],
    ids=["smaller", "larger", "padded", "load", "negative", "rows"],
)
def test_vocab_rows_refuse_more_than_a_padding(rows, transform, direction):
    # a broadcast probe, as the shape arithmetic plans with: refused before anything is made
    probe = np.broadcast_to(np.zeros((), np.float32), (rows, 4))
    with pytest.raises(ValueError, match="vocab_size"):
        getattr(transform, direction)(probe)


def test_padding_limit():
    assert transforms.padding_problem(96, 128, "v") is None  # MaxText's padding in the tests
    assert transforms.padding_problem(256000, 256128, "v") is None  # Gemma's
    assert transforms.padding_problem(262144, 262208, "v") is None  # Gemma 3's, cut
    assert "differ by 2049" in transforms.padding_problem(1 << 20, (1 << 20) + 2049, "v")
    assert "differ by 33" in transforms.padding_problem(96, 129, "v")  # a quarter of 129: 32
    assert "not a positive" in transforms.padding_problem(96, 0, "v")


# --------------------------------------------------------------------------- offset


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_offset_in_the_dtype(dtype):
    x = rand((7,), dtype)
    got = Offset(1.0).to_flax(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(bits(got), bits((x + np.asarray(1.0, dtype)).astype(dtype)))
    np.testing.assert_array_equal(
        bits(Offset(1.0).to_torch(got)), bits((got - np.asarray(1.0, dtype)).astype(dtype))
    )


# --------------------------------------------------------------------------- on the devices


@pytest.mark.parametrize(
    "transform",
    [Scale.attention_query(8), RopeInterleave(), VocabRows(5), VocabRows(6, 8), Offset(1.0)],
    ids=repr,
)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_jax_arrays_under_jit_give_the_numpy_bits(transform, dtype):
    # a multi-process export applies the transforms to jax arrays on the devices
    import jax
    import jax.numpy as jnp

    x = rand((6, 4), dtype, seed=3)
    for fn in (transform.to_flax, transform.to_torch):
        got = jax.jit(fn)(jnp.asarray(x))
        assert got.dtype == fn(x).dtype
        np.testing.assert_array_equal(bits(np.asarray(got)), bits(fn(x)))


# --------------------------------------------------------------------------- MaxText's hooks


def _hooks(name, saving_to_hf, config, maxtext_config=None):
    pm = maxtext_reference.param_mapping()
    return getattr(pm, name)(config, maxtext_config, scan_layers=False, saving_to_hf=saving_to_hf)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("head_dim", [8, 16, 128])
def test_scale_and_rope_equal_maxtext_llama31_hooks(dtype, head_dim):
    import types

    import jax.numpy as jnp

    config = {"num_hidden_layers": 1, "head_dim": head_dim}
    key = "params-decoder-layers_0-self_attention-query-kernel"
    to_hf = _hooks("LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN", True, config)[key]
    to_mt = _hooks("LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN", False, config)[key]
    scale_to_hf, rope_to_hf = to_hf[0], to_hf[1]  # [scale_query_layer, adjust_rope, reshape]
    rope_to_mt, scale_to_mt = to_mt[1], to_mt[2]  # reversed
    x = rand((6, 3, head_dim), dtype, seed=head_dim)
    ours = Scale.attention_query(head_dim)
    np.testing.assert_array_equal(
        bits(ours.to_torch(x)), bits(np.asarray(scale_to_hf(jnp.asarray(x), None)))
    )
    np.testing.assert_array_equal(bits(ours.to_flax(x)), bits(scale_to_mt(x, None)))
    np.testing.assert_array_equal(
        bits(RopeInterleave().to_torch(x)), bits(np.asarray(rope_to_hf(jnp.asarray(x), None)))
    )
    np.testing.assert_array_equal(
        bits(RopeInterleave().to_flax(x)), bits(np.asarray(rope_to_mt(x, None)))
    )
    # Mixtral's query scale (MaxText's config carries head_dim there)
    mixtral = types.SimpleNamespace(num_experts=2, head_dim=head_dim)
    cfg = {"num_hidden_layers": 1, "hidden_size": 6}
    to_hf = _hooks("MIXTRAL_MAXTEXT_TO_HF_PARAM_HOOK_FN", True, cfg, mixtral)[key][1]
    to_mt = _hooks("MIXTRAL_MAXTEXT_TO_HF_PARAM_HOOK_FN", False, cfg, mixtral)[key][1]
    np.testing.assert_array_equal(
        bits(ours.to_torch(x)), bits(np.asarray(to_hf(jnp.asarray(x), None)))
    )
    np.testing.assert_array_equal(bits(ours.to_flax(x)), bits(np.asarray(to_mt(x, None))))


def test_vocab_rows_equal_maxtext_qwen_embedding_hook():
    config = {"num_hidden_layers": 1}
    key = "params-token_embedder-embedding"
    to_hf = _hooks("QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN", True, config)[key]
    to_mt = _hooks("QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN", False, config)[key]
    x = rand((12, 4), BF16)
    np.testing.assert_array_equal(bits(VocabRows(9).to_torch(x)), bits(to_hf(x, (9, 4))))
    np.testing.assert_array_equal(
        bits(VocabRows(12, padded=16).to_flax(x)), bits(to_mt(x, (16, 4)))
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_offset_equals_maxtext_gemma3_norm_hook(dtype):
    import jax.numpy as jnp

    config = {"text_config": {"num_hidden_layers": 1, "hidden_size": 4}, "vision_config": {}}
    key = "params-decoder-decoder_norm-scale"
    to_hf = _hooks("GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN", True, config)[key]
    to_mt = _hooks("GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN", False, config)[key]
    x = rand((9,), dtype)
    # MaxText runs its hooks on jax arrays (to_huggingface.py slices them with jax.lax)
    np.testing.assert_array_equal(
        bits(Offset(1.0).to_torch(x)), bits(np.asarray(to_hf(jnp.asarray(x), (9,))))
    )
    np.testing.assert_array_equal(
        bits(Offset(1.0).to_flax(x)), bits(np.asarray(to_mt(jnp.asarray(x), (9,))))
    )
