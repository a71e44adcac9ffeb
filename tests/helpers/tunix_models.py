"""Tunix's own NNX model classes (``google-tunix``), for the ``tunix-*`` preset tests.

CI installs Tunix without its dependencies (``pip install --no-deps google-tunix``, see
``.ci/run``): its package ``__init__`` imports the trainers (metrax, grain, datasets, ...),
which the model modules do not need. So when ``import tunix`` fails on a missing dependency,
the model modules are imported under a bare ``tunix`` package object (its ``__init__`` not run):
Tunix's ``models``, ``utils``, ``generate`` and ``oss`` folders are namespace packages, and the
model modules need only jax, flax, jaxtyping, safetensors, huggingface_hub and fsspec. Where
Tunix is not installed (the README's ``pip install -e ".[test]"`` leaves it out) the tests skip
as ``optional_deps`` skips, naming the install command; if the model modules themselves do not
import, they skip naming the reason.

Importing a Tunix model module sets Flax's ``flax_always_shard_variable`` to False (Tunix's
``env_utils.setup_sharding_environment``); :func:`tunix_flags` restores it after a test, so
the rest of the suite runs with the flag it had.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import optional_deps  # (tests/ is on sys.path)
import pytest

TUNIX_INSTALL = "pip install --no-deps google-tunix==0.1.7 jaxtyping"
EINOPS_INSTALL = "pip install einops"  # (Tunix's Gemma 3 module imports it)


def _bare_package() -> None:
    spec = importlib.util.find_spec("tunix")
    if spec is None or spec.loader is None:
        optional_deps.missing("google-tunix", TUNIX_INSTALL)
    try:
        import tunix  # noqa: F401 (a full install imports as usual)
    except ImportError:
        # the trainers' dependencies are missing: a package object without its __init__
        for name in [n for n in sys.modules if n == "tunix" or n.startswith("tunix.")]:
            del sys.modules[name]
        sys.modules["tunix"] = importlib.util.module_from_spec(spec)


def model_modules() -> tuple[ModuleType, ModuleType]:
    """``(tunix.models.llama3.model, tunix.models.qwen3.model)``, or a skip naming why.

    Test modules call it at import (``LLAMA3, QWEN3 = tunix_models.model_modules()``): the
    skip is then the whole module's, reported with its reason (``allow_module_level``).
    """
    return model_module("llama3"), model_module("qwen3")


def model_module(family: str) -> ModuleType:
    """``tunix.models.<family>.model``, or a skip naming why (a missing einops, which Tunix's
    Gemma 3 imports, as a missing optional dependency)."""
    import flax
    import jax

    before = _shard_flag(flax)
    try:
        _bare_package()
        return importlib.import_module(f"tunix.models.{family}.model")
    except ImportError as e:
        if getattr(e, "name", None) == "einops":
            optional_deps.missing("einops", EINOPS_INSTALL)
        pytest.skip(
            f"Tunix's model modules do not import with jax {jax.__version__}, flax "
            f"{flax.__version__}: {e}",
            allow_module_level=True,
        )
    finally:
        _set_shard_flag(flax, before)


# The tiny Gemma-family and Qwen 2 models of the tunix-* presets' tests: the preset, then the
# variant: Gemma's query, key and value fused (as many key/value heads as heads); Gemma 4 with
# a global layer's key as its value (fewer, larger heads), per-layer inputs and MoE, or with
# KV-shared layers twice as wide.
TINY = ("gemma", "gemma-qkv", "gemma3", "qwen2", "gemma4", "gemma4-shared")
_SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4)


def tiny(case: str, seed: int = 1) -> tuple[Any, Any, Any]:
    """``(transformers config, Tunix model, mapping)`` of the tiny ``case`` (of :data:`TINY`):
    float32, Tunix's runtime settings matching Hugging Face's (query scale ``head_dim``,
    RoPE bases, soft caps, windows longer than the tests' sequences); its parameters as
    :func:`_built` sets them."""
    import jax.numpy as jnp
    import transformers

    import orbax_safetensors as osf

    preset = "tunix-" + case.split("-")[0]
    kv = 4 if case == "gemma-qkv" else 2
    heads = dict(num_heads=4, head_dim=8, num_kv_heads=kv)
    tunix = dict(num_layers=2, num_embed=96, embed_dim=32, hidden_dim=64, **heads)
    if case in ("gemma", "gemma-qkv"):
        g = model_module("gemma")
        config = transformers.Gemma2Config(
            **_SIZES, num_hidden_layers=2, num_key_value_heads=kv, head_dim=8,
            query_pre_attn_scalar=8, sliding_window=16, attn_logit_softcapping=50.0,
        )  # fmt: skip
        types = (g.AttentionType.LOCAL_SLIDING, g.AttentionType.GLOBAL)
        cfg = g.ModelConfig(**tunix, final_logit_softcap=30.0, use_post_attn_norm=True,
                            use_post_ffw_norm=True, attention_types=types,
                            attn_logits_soft_cap=50.0, sliding_window_size=16)  # fmt: skip
        model = _built(g.Gemma, cfg, seed)
        return config, model, osf.preset_mapping(preset, head_dim=8, fused_qkv=kv == 4)
    if case == "gemma3":
        g = model_module("gemma3")
        config = transformers.Gemma3TextConfig(
            **_SIZES, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
            query_pre_attn_scalar=8, sliding_window=16,
        )  # fmt: skip
        cfg = g.ModelConfig(**tunix, sliding_window_size=16, param_dtype=jnp.float32,
                            global_base_frequency=1_000_000)  # fmt: skip
        return config, _built(g.Gemma3, cfg, seed), osf.preset_mapping(preset, head_dim=8)
    if case == "qwen2":
        q = model_module("qwen2")
        rope = {"rope_type": "default", "rope_theta": 10_000}
        config = transformers.Qwen2Config(
            **_SIZES, num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-6,
            rope_parameters=rope, tie_word_embeddings=False,
        )  # fmt: skip
        cfg = q.ModelConfig(
            num_layers=2, vocab_size=96, embed_dim=32, hidden_dim=64, **heads,
            rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=False,
        )  # fmt: skip
        return config, _built(q.Qwen2, cfg, seed), osf.preset_mapping(preset, head_dim=8)
    g = model_module("gemma4")
    local, full = g.AttentionType.LOCAL_SLIDING, g.AttentionType.GLOBAL
    if case == "gemma4":
        hf = dict(num_hidden_layers=3, attention_k_eq_v=True, num_global_key_value_heads=1,
                  hidden_size_per_layer_input=4, enable_moe_block=True, num_experts=4,
                  top_k_experts=2, moe_intermediate_size=16)  # fmt: skip
        tunix.update(num_layers=3, attention_pattern=(local, local, full), num_global_kv_heads=1,
                     k_eq_v_global=True, per_layer_input_dim=4, enable_moe=True, num_experts=4,
                     expert_dim=16, num_experts_per_tok=2, moe_dense_hidden_dim=64)  # fmt: skip
    else:
        hf = dict(num_hidden_layers=4, num_kv_shared_layers=2, use_double_wide_mlp=True,
                  hidden_size_per_layer_input=0)  # fmt: skip
        tunix.update(num_layers=4, attention_pattern=(local, full), frac_shared_layers=0.5,
                     override_kv_shared_ffw_hidden=128)  # fmt: skip
    n = hf["num_hidden_layers"]
    types = [
        ("full" if p == full else "sliding") + "_attention" for p in tunix["attention_pattern"]
    ]
    config = transformers.Gemma4TextConfig(
        **_SIZES, num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=16,
        layer_types=(types * n)[:n], vocab_size_per_layer_input=96, final_logit_softcapping=30.0,
        **hf,
    )  # fmt: skip
    cfg = g.ModelConfig(**tunix, sliding_window_size=16, global_key_size=16)
    return config, _built(g.Gemma4, cfg, seed), osf.preset_mapping(preset, hf_config=config)


def _built(cls: Any, config: Any, seed: int) -> Any:
    # ``cls(config)`` with its parameters from numpy, seeded: kernels and embeddings
    # 0.1 * N(0, 1), vectors (norms, scales, biases) ones. Tunix's initialisers, run eagerly,
    # would compile once per shape, which costs more than a tiny test itself; built
    # abstractly, nothing compiles.
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        value = 0.1 * rng.standard_normal(shape) if len(shape) > 1 else np.ones(shape)
        var.set_value(jnp.asarray(value, dtype))
    return model


def _shard_flag(flax: ModuleType) -> bool | None:
    return getattr(flax.config, "flax_always_shard_variable", None)


def _set_shard_flag(flax: ModuleType, value: bool | None) -> None:
    if value is not None:
        flax.config.update("flax_always_shard_variable", value)


@contextlib.contextmanager
def tunix_flags() -> Iterator[None]:
    """Flax configured as Tunix's model modules configure it, restored on exit."""
    import flax

    before = _shard_flag(flax)
    _set_shard_flag(flax, False if before is not None else None)
    try:
        yield
    finally:
        _set_shard_flag(flax, before)
