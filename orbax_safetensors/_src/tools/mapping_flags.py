"""The command line's ``--mapping`` and ``--hf-config`` (``export``, ``convert``, ``import``):
a preset name or ``module:attr``, and the model's ``config.json``. The presets themselves and
their table live in the integrations layer; reading these options is the CLI's job.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Any

from etils import epath

from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping
from orbax_safetensors._src.integrations.presets import PRESETS, preset_mapping
from orbax_safetensors._src.storage import confine as _confine


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
