"""The small files of a Hugging Face model directory beside the weights an export writes:
``config.json``, ``generation_config.json`` and the tokenizer's files, as
``save_pretrained`` would write them, from ``hf_config`` (a transformers config, a dict, a
``config.json`` or a model directory). Every file is returned as bytes, written with the
weights so that a reader never sees a directory half written.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from typing import Any

from etils import epath

from orbax_safetensors._src.storage import confine as _confine

CONFIG_FILE_NAME = "config.json"
GENERATION_CONFIG_FILE_NAME = "generation_config.json"
# What transformers' tokenizers and processors save (their ``vocab_files_names`` and the
# files ``PreTrainedTokenizerBase.save_pretrained`` adds), for the tokenizers of causal LMs.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
    "tiktoken.model",
    "preprocessor_config.json",
    "processor_config.json",
)
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # (its *.jinja files)

_FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def model_files(
    hf_config: Any,
    dtypes: Sequence[str],
    cast: bool,
    *,
    generation_config: Any = None,
    untie: bool = False,
) -> dict[str, bytes]:
    """``{file name: content}`` of the small files an export writes (``config.json``,
    ``generation_config.json``, the tokenizer's); ``dtypes`` are the stored safetensors dtypes of the tensors, ``cast`` whether a
    dtype policy changed them; ``untie``: tied keys were written all the same (a head that
    differs from its embedding: ``fidelity.tie_differences``), so ``config.json`` says
    ``tie_word_embeddings: false``. Empty when both configs are None.

    Raises:
      TypeError: ``hf_config`` or ``generation_config`` of another type.
      ValueError: a path that does not exist, a directory without ``config.json``, a file that
        is not a JSON object; naming the path.
    """
    files: dict[str, bytes] = {}
    doc, config, directory = _config_doc(hf_config)
    if doc is not None:
        if untie:
            doc = untied_config(doc)
        _fill_architectures(doc)
        _set_dtype(doc, dtypes, cast)
        files[CONFIG_FILE_NAME] = _json_bytes(doc)
    generation = _generation_config(
        generation_config, directory, config if config is not None else doc
    )
    if generation is not None:
        files[GENERATION_CONFIG_FILE_NAME] = generation
    if directory is not None:
        files.update(tokenizer_files(directory))
    return files


def untied_config(doc: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``doc`` with ``tie_word_embeddings`` false (in a nested
    ``text_config`` too, where it says so: Gemma 3, LLaVA)."""
    doc = dict(doc)
    doc["tie_word_embeddings"] = False
    text = doc.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        doc["text_config"] = {**text, "tie_word_embeddings": False}
    return doc


def tokenizer_files(directory: epath.PathLike) -> dict[str, bytes]:
    """The tokenizer's files in ``directory`` (:data:`TOKENIZER_FILES` and
    ``additional_chat_templates/*.jinja``), by their names relative to it.
    """
    directory = epath.Path(directory)
    names = list(TOKENIZER_FILES)
    templates = _confine.inside(directory, CHAT_TEMPLATES_DIR)
    if templates.is_dir():
        names += [f"{CHAT_TEMPLATES_DIR}/{p.name}" for p in sorted(templates.glob("*.jinja"))]
    found = {name: _confine.inside(directory, name) for name in names}
    return {name: _confine.read_file(path) for name, path in found.items() if path.exists()}


def read_json(path: epath.PathLike, what: str = "hf_config") -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what`` names the argument in errors).

    Raises:
      ValueError: a missing file, or one that is not a JSON object.
    """
    p = epath.Path(path)
    if not p.exists():
        raise ValueError(f"{what} {p}: no such file or directory")
    raw = _confine.read_file(p)  # (a FIFO or directory: refused, never waited on)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} {p}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {p}: not a JSON object")
    return doc


def config_keys(hf_config: Any) -> dict[str, Any] | None:
    """The keys of ``hf_config`` as the model it configures has them: a path's
    ``config.json`` (a directory's), a dict as given, a transformers config's ``to_dict()``
    (its defaults too, unlike the ``config.json`` written); None for None.

    Raises:
      ValueError: a path that does not exist, a directory without ``config.json``, a file
        that is not a JSON object; naming the path.
      TypeError: a value of another type.
    """
    if hasattr(hf_config, "to_dict") and not isinstance(hf_config, dict):
        return dict(hf_config.to_dict())
    return _config_doc(hf_config)[0]


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _config_doc(hf_config: Any) -> tuple[dict[str, Any] | None, Any, epath.Path | None]:
    """``config.json``'s document, the config object it came from (or None), and the model
    directory ``hf_config`` names (or None)."""
    if hf_config is None:
        return None, None, None
    if _is_path(hf_config):
        p = epath.Path(hf_config)
        if not p.is_dir():
            return read_json(p), None, None  # (a missing path: "no such file or directory")
        config = _confine.inside(p, CONFIG_FILE_NAME)
        if not config.exists():
            raise ValueError(f"hf_config {p}: a directory without {CONFIG_FILE_NAME}")
        return read_json(config), None, p
    if isinstance(hf_config, dict):
        return dict(hf_config), None, None
    if hasattr(hf_config, "to_json_string"):  # transformers: only the non-default keys
        return json.loads(hf_config.to_json_string(use_diff=True)), hf_config, None
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict()), hf_config, None
    raise TypeError(
        "hf_config must be a transformers config object, a dict or a path (a config.json or "
        f"a model directory), not {type(hf_config).__name__}"
    )


def _set_dtype(doc: dict[str, Any], dtypes: Sequence[str], cast: bool) -> None:
    # The stored floating-point dtype (the one most tensors have) when unset, or when a dtype
    # policy changed what is stored.
    floats = [_FLOAT_NAMES[d] for d in dtypes if d in _FLOAT_NAMES]
    if not floats:
        return
    stored = max(sorted(set(floats)), key=floats.count)
    for key in ("dtype", "torch_dtype"):
        if (key == "dtype" and doc.get(key) is None) or (cast and key in doc):
            doc[key] = stored


def _causal_lm_class(model_type: Any) -> str | None:
    """transformers' ``AutoModelForCausalLM`` class name for ``model_type``, where
    transformers is installed and has one."""
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto import modeling_auto
    except (ImportError, OSError, RuntimeError):  # (absent, or its torch does not load)
        return None
    names = getattr(modeling_auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {})
    name = names.get(model_type)
    return name if isinstance(name, str) else None


def _fill_architectures(doc: dict[str, Any]) -> None:
    # save_pretrained names the model's class; serving engines (vLLM, SGLang) pick theirs by it
    if doc.get("architectures") is None:
        name = _causal_lm_class(doc.get("model_type"))
        if name is not None:
            doc["architectures"] = [name]


def _generation_config(given: Any, directory: epath.Path | None, model_config: Any) -> bytes | None:
    if given is not None:
        if _is_path(given):
            p = epath.Path(given)
            if p.is_dir():
                p = _confine.inside(p, GENERATION_CONFIG_FILE_NAME)
            return _json_bytes(read_json(p, "generation_config"))
        if isinstance(given, dict):
            return _json_bytes(given)
        if hasattr(given, "to_json_string"):
            return _generation_json(given)
        raise TypeError(
            "generation_config must be a transformers GenerationConfig, a dict or a path, not "
            f"{type(given).__name__}"
        )
    stored = None if directory is None else _confine.inside(directory, GENERATION_CONFIG_FILE_NAME)
    if stored is not None and stored.exists():
        return _confine.read_file(stored)
    if model_config is None:
        return None
    is_dict = isinstance(model_config, dict)
    model_type = (
        model_config.get("model_type") if is_dict else getattr(model_config, "model_type", None)
    )
    if not isinstance(model_type, str) or _causal_lm_class(model_type) is None:
        return None  # (not a model transformers generates with)
    import transformers

    if is_dict:  # the config object, as the model would hold it
        rest = {k: v for k, v in model_config.items() if k != "model_type"}
        with contextlib.suppress(TypeError, ValueError, KeyError):  # (one it does not take)
            model_config = transformers.AutoConfig.for_model(model_type, **rest)
    return _generation_json(transformers.GenerationConfig.from_model_config(model_config))


def _generation_json(config: Any) -> bytes:
    # GenerationConfig.save_pretrained: the keys that differ from the defaults, without the
    # compile options (not serialised)
    doc = json.loads(config.to_json_string(use_diff=True))
    doc.pop("compile_config", None)
    return _json_bytes(doc)


def _json_bytes(doc: dict[str, Any]) -> bytes:
    # (transformers' own format: sorted keys, two-space indent, a final newline)
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
