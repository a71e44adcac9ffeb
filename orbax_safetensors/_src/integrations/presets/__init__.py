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
a line below. The command line's ``--mapping`` and ``--hf-config`` are read here too.

Example::

    preset_mapping("maxtext-llama3", hf_config="/models/Llama-3.1-8B")
    maxtext.llama3("/models/Llama-3.1-8B")  # the same mapping
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping
from orbax_safetensors._src.integrations.presets import generic, maxtext, tunix
from orbax_safetensors._src.storage import confine as _confine

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


def read_hf_config(path: str | None) -> dict[str, Any] | None:
    """The command line's ``--hf-config``: the ``config.json`` at ``path`` (a file, or a
    directory holding one), or None; ValueError when it is missing or not a JSON object."""
    if path is None:
        return None
    p = epath.Path(path)
    if not p.exists():
        raise ValueError(f"--hf-config {path}: no such file or directory")
    if p.is_dir():
        p = _confine.inside(p, _model_files.CONFIG_FILE_NAME)
    return _model_files.read_json(p, "--hf-config")


def resolve_mapping(
    spec: str, hf_config: dict[str, Any] | None = None, lora_scale: float | None = None
) -> KeyMapping:
    """The command line's ``--mapping``: the mapping ``spec`` names, with ``lora_scale`` as
    its ``KeyMapping.lora_scale`` when given. A preset gets each keyword it takes from
    ``hf_config``; ``module:attr`` names a ``KeyMapping`` (or a function of no arguments
    returning one), imported like ``python -c 'import module'`` from the current directory.

    Raises:
      ValueError: an unknown preset, a module that does not import, no KeyMapping there.
      ConfigError: an impossible size in ``hf_config`` that a preset reads.
    """
    if ":" not in spec:
        if spec not in PRESETS:
            raise ValueError(
                f"--mapping {spec!r}: neither a preset ({', '.join(PRESETS)}) nor module:attr"
            )
        # Each keyword the preset takes that the config gives (its sizes read through
        # ConfigFacts: an impossible one is a ConfigError).
        facts = ConfigFacts(hf_config or {}, "--hf-config")
        takes = inspect.signature(PRESETS[spec]).parameters
        kwargs: dict[str, Any] = {}
        if "hf_config" in takes:
            if hf_config is None:
                raise ValueError(f"--mapping {spec!r} needs --hf-config (the model's config.json)")
            kwargs["hf_config"] = facts
        if "tie_word_embeddings" in takes:  # absent: the preset's default (GPT-2's: tied)
            tie = takes["tie_word_embeddings"].default
            kwargs["tie_word_embeddings"] = facts.flag("tie_word_embeddings", tie)
        if "head_dim" in takes:  # (a multimodal config's: its text_config's)
            kwargs["head_dim"] = facts.language_model().head_dim()
            if kwargs["head_dim"] is None:
                raise ValueError(
                    f"--mapping {spec!r} needs --hf-config with head_dim (or hidden_size and "
                    "num_attention_heads)"
                )
        return preset_mapping(spec, lora_scale=lora_scale, **kwargs)
    module_name, _, attr = spec.partition(":")
    added = "" not in sys.path and "." not in sys.path
    if added:
        sys.path.insert(0, "")  # the current directory, as ``python -c`` has it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure is the user's module's
        raise ValueError(f"--mapping {spec!r}: cannot import {module_name!r} ({e})") from None
    finally:
        if added:
            sys.path.remove("")
    value: Any = module
    for part in attr.split("."):
        if not hasattr(value, part):
            raise ValueError(f"--mapping {spec!r}: {module_name} has no attribute {attr!r}")
        value = getattr(value, part)
    if callable(value) and not isinstance(value, KeyMapping) and _takes_no_arguments(value):
        value = value()
    if not isinstance(value, KeyMapping):
        raise ValueError(
            f"--mapping {spec!r} names an object of type {type(value).__name__}, not an "
            "osf.KeyMapping"
        )
    return value if lora_scale is None else dataclasses.replace(value, lora_scale=lora_scale)


def _takes_no_arguments(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
    )


__all__ = ["PRESETS", "generic", "maxtext", "preset_mapping", "tunix"]
