"""Ready-made key mappings between Hugging Face checkpoints and JAX layouts: one module per
family group, each preset a plain function (a factory) with its own keyword arguments, and
one table of names.

- ``generic``: NNX ports that keep Hugging Face's module names (``"llama"``, ``"mistral"``,
  ``"qwen2"``, ``"qwen3"``, ``"phi3"``, ``"gemma3"``, ``"mixtral"``, ``"qwen2-moe"``,
  ``"qwen3-moe"``, ``"gpt2"``);
- ``tunix``: Tunix's NNX models (``"tunix-llama3"``, ``"tunix-qwen2"``, ``"tunix-qwen3"``,
  ``"tunix-gemma"``, ``"tunix-gemma3"``, ``"tunix-gemma4"``);
- ``maxtext``: MaxText's train states (``"maxtext-llama3"``, ``"maxtext-mistral"``,
  ``"maxtext-mixtral"``, ``"maxtext-qwen3"``, ``"maxtext-qwen3-moe"``, ``"maxtext-qwen2"``,
  ``"maxtext-gemma2"``, ``"maxtext-gemma3"``, ``"maxtext-deepseek3"``).

A new preset is a factory and a line in its group's ``PRESETS``; a new group is a module and
a line below.

Example::

    preset_mapping("maxtext-llama3", hf_config="/models/Llama-3.1-8B")
    maxtext.llama3("/models/Llama-3.1-8B")  # the same mapping
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

from orbax_safetensors._src.integrations.key_mapping import KeyMapping
from orbax_safetensors._src.integrations.presets import generic, maxtext, tunix

PRESETS: Mapping[str, Callable[..., KeyMapping]] = types.MappingProxyType(
    {**generic.PRESETS, **tunix.PRESETS, **maxtext.PRESETS}
)


def preset_mapping(name: str, **kwargs: Any) -> KeyMapping:
    """The ready-made mapping ``name`` (a key of :data:`PRESETS`): its factory called with
    ``kwargs``.

    Each preset takes its own keyword arguments, documented by its factory
    (``osf.hf.PRESETS[name]``): ``tie_word_embeddings=`` for the NNX ports and Tunix,
    ``head_dim=`` for Tunix (``hf_config=`` for Tunix's Gemma 4), ``hf_config=`` (required),
    ``scan_layers=`` and ``vocab_size=`` for MaxText, ``lora_scale=`` for every preset. A
    keyword given as None or False reads as not given, so one call can serve several presets.

    Raises:
      ValueError: an unknown name; a required keyword missing, or one the preset does not
        take (MaxText's read ``head_dim`` and ``tie_word_embeddings`` from ``hf_config``);
        whatever the factory refuses (a Tunix ``head_dim`` that is not a positive whole
        number, a MaxText config of another model type).
      ConfigError: a MaxText ``hf_config`` with an impossible size, naming the key.

    Example::

        osf.preset_mapping("qwen3", tie_word_embeddings=True)
        osf.preset_mapping("tunix-qwen3", head_dim=128, lora_scale=8 / 4)
        osf.preset_mapping("maxtext-llama3", hf_config="/models/Llama-3.1-8B")
    """
    factory = PRESETS.get(name)
    if factory is None:
        raise ValueError(f"no preset mapping {name!r} (presets: {', '.join(PRESETS)})")
    params = inspect.signature(factory).parameters
    required = {n for n, p in params.items() if p.default is p.empty}
    # None and False read as not given, except where an optional keyword takes them
    given = {
        k: v
        for k, v in kwargs.items()
        if not (v is None or v is False) or (k in params and k not in required)
    }
    missing = [n for n in params if n in required and n not in given]
    unknown = [k for k in given if k not in params]
    if missing or unknown:
        takes = ", ".join(f"{n}=" + (" (required)" if n in required else "") for n in params)
        problems = [f"{n}= is missing" for n in missing]
        problems += [f"{k}= is not one of them" for k in unknown]
        group = factory.__module__.rsplit(".", 1)[-1]
        raise ValueError(
            f"preset {name!r} takes {takes}; {', '.join(problems)} "
            f"(see osf.hf.presets.{group}.{factory.__name__})"
        )
    return factory(**given)


__all__ = ["PRESETS", "generic", "maxtext", "preset_mapping", "tunix"]
