"""``orbax-safetensors export``'s options: ``--hf-config`` (a ``config.json``, or a model
directory whose config, generation config and tokenizer files are copied), and ``--mapping``,
a preset name (``osf.hf.PRESETS``; a preset's sizes and ``tie_word_embeddings`` come from the
config) or ``module:attr`` naming an ``osf.KeyMapping`` (or a function of no arguments that
returns one), imported like ``python -c 'import module'`` from the current directory.

Example::

    orbax-safetensors export /ckpt out/ --mapping llama --hf-config config.json --item state
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Any

from etils import epath

from orbax_safetensors._src.integrations import config_facts as _config_facts
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations import presets as _presets
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.tools import inspection as _inspection


def read_hf_config(path: str | None) -> dict[str, Any] | None:
    """The ``config.json`` at ``path`` (a file, or a directory holding one), or None;
    ValueError when it is missing or not a JSON object."""
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
    """The mapping ``spec`` names (a preset, or ``module:attr``), with ``lora_scale`` as its
    ``KeyMapping.lora_scale`` when given.

    Raises:
      ValueError: an unknown preset, a module that does not import, no KeyMapping there.
      ConfigError: an impossible size in ``hf_config`` that a preset reads.
    """
    mapping = _named_mapping(spec, hf_config)
    if lora_scale is None:
        return mapping
    return dataclasses.replace(mapping, lora_scale=lora_scale)


def _named_mapping(spec: str, hf_config: dict[str, Any] | None) -> KeyMapping:
    if ":" not in spec:
        if spec not in _presets.PRESETS:
            raise ValueError(
                f"--mapping {spec!r}: neither a preset ({', '.join(_presets.PRESETS)}) nor module:attr"
            )
        # Each keyword the preset takes that the config gives (its sizes read through
        # ConfigFacts: an impossible one is a ConfigError).
        facts = _config_facts.ConfigFacts(hf_config or {}, "--hf-config")
        takes = inspect.signature(_presets.PRESETS[spec]).parameters
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
        return _presets.preset_mapping(spec, **kwargs)
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
    return value


def _takes_no_arguments(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
    )


def summary(out: str, report: MappingReport) -> str:
    """The line ``export`` prints: tensors written, their bytes, the files of ``out``."""
    files = sorted(p for p in epath.Path(out).iterdir() if p.is_file())
    size = sum(p.stat().length for p in files if p.suffix == ".safetensors")
    return (
        f"exported {_inspection.counted(len(report.moved), 'tensor')} ({_inspection.human_bytes(size)}) to "
        f"{out}: " + ", ".join(p.name for p in files)
    )
