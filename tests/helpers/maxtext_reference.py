"""MaxText's own conversion hooks, the reference the MaxText presets are checked against.

MaxText (``pip download --no-deps --python-version 3.12 --only-binary=:all: maxtext==0.2.5``)
is a pure-Python wheel for Python >= 3.12 that does not install here; its
``maxtext/checkpoint_conversion/utils/param_mapping.py`` imports only numpy and JAX, so it is
read straight from the wheel (or an unzipped copy) that ``OSF_MAXTEXT_WHEEL`` names, and run
as a module of its own. Without it the tests that need it skip; the other tests check the
same facts against formulas of their own (``tests/helpers/maxtext_layout.py``).

Example::

    pm = maxtext_reference.param_mapping()    # skips the test when absent
    hooks = pm.LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(cfg, None, scan_layers=True, saving_to_hf=True)
"""

from __future__ import annotations

import functools
import os
import types
import zipfile
from pathlib import Path

import optional_deps  # (tests/ is on sys.path)

ENV = "OSF_MAXTEXT_WHEEL"
UTILS = "maxtext/checkpoint_conversion/utils/"


def source(member: str) -> tuple[str, str] | None:
    """The text and the path of ``member`` (``maxtext/...py``) of the wheel (or unzipped copy)
    ``OSF_MAXTEXT_WHEEL`` names; None when it names none."""
    where = os.environ.get(ENV)
    if not where:
        return None
    path = Path(where)
    if path.is_dir():
        return (path / member).read_text(), f"{path}/{member}"
    with zipfile.ZipFile(path) as wheel:
        return wheel.read(member).decode(), f"{path}/{member}"


@functools.lru_cache(maxsize=4)
def _load(name: str) -> types.ModuleType | None:
    found = source(f"{UTILS}{name}.py")
    if found is None:
        return None
    module = types.ModuleType(f"maxtext_{name}")
    module.__file__ = found[1]
    exec(compile(found[0], module.__file__, "exec"), module.__dict__)  # (MaxText's own file)
    return module


def _module(name: str) -> types.ModuleType:
    module = _load(name)
    if module is None:
        optional_deps.missing(
            "MaxText's wheel (maxtext==0.2.5)",
            "pip download --no-deps --python-version 3.12 --only-binary=:all: maxtext==0.2.5, "
            f"then set {ENV} to the wheel",
        )
    return module


def param_mapping() -> types.ModuleType:
    """MaxText's ``param_mapping`` module; the calling test skips when ``OSF_MAXTEXT_WHEEL``
    names none."""
    return _module("param_mapping")


# MaxText's table entries of each kind (Mistral has none: its conversion is a standalone
# script for Meta's checkpoints).
ENTRIES = {
    "llama3": "LLAMA31",
    "mixtral": "MIXTRAL",
    "qwen3": "QWEN",
    "qwen3-moe": "QWEN",
    "qwen2": "QWEN",
    "gemma2": "GEMMA2",
    "gemma3": "GEMMA3",
    "deepseek3": "DEEPSEEK",
}


def _tables(kind: str, hf_config: dict, scan_layers: bool, saving_to_hf: bool, dtype=None):
    pm = param_mapping()
    entry = ENTRIES[kind]
    maxtext_config = types.SimpleNamespace(
        scan_layers=scan_layers,
        param_scan_axis=1,
        num_experts=hf_config.get("num_local_experts", hf_config.get("num_experts", 0)),
        head_dim=hf_config.get("head_dim") or hf_config["text_config"]["head_dim"],
        weight_dtype=dtype,
    )
    table = getattr(pm, f"{entry}_MAXTEXT_TO_HF_PARAM_MAPPING")(
        hf_config, maxtext_config, scan_layers
    )
    hooks = getattr(pm, f"{entry}_MAXTEXT_TO_HF_PARAM_HOOK_FN")(
        hf_config, maxtext_config, scan_layers, saving_to_hf=saving_to_hf
    )
    return table, hooks


def _flat(params: dict) -> dict:
    import jax

    return {
        "params-" + "-".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def _apply(weight, fns, target):
    for fn in fns if isinstance(fns, list) else [fns] if fns else []:
        weight = fn(weight, target)
    return weight


def to_maxtext(kind: str, hf: dict, hf_config: dict, like: dict, *, scan_layers: bool) -> dict:
    """MaxText's names (``params-decoder-...``) and values of the Hugging Face tensors ``hf``
    through MaxText's own hooks (``saving_to_hf=False``) and stacking (``to_maxtext.py``: layers
    on axis 1, experts on axis 0 before them), for the names and shapes ``like`` (a ``params``
    tree) has. The calling test skips without MaxText's wheel."""
    import numpy as np

    table, hooks = _tables(kind, hf_config, scan_layers, saving_to_hf=False)
    out = {}
    for key, want in _flat(like).items():
        targets, fns, shape = table[key], hooks.get(key), tuple(np.shape(want))
        if isinstance(targets, str):
            out[key] = np.asarray(_apply(hf[targets], fns, shape))
        elif isinstance(targets[0], str):
            axis = 1 if scan_layers and len(shape) > 1 else 0
            part = shape[:axis] + shape[axis + 1 :]
            out[key] = np.stack([np.asarray(_apply(hf[t], fns, part)) for t in targets], axis)
        else:
            part = shape[2:]
            out[key] = np.stack(
                [np.stack([np.asarray(_apply(hf[t], fns, part)) for t in ts]) for ts in targets]
            )
    return out


def to_hf(kind: str, params: dict, hf_config: dict, *, scan_layers: bool, dtype=None) -> dict:
    """The Hugging Face tensors MaxText's ``to_huggingface.py`` writes from a ``params`` tree
    (``decoder``, ``token_embedder``): its name table, hooks and shape table, driven as its
    ``utils.process_maxtext_param`` drives them (a scanned tensor sliced on axis 1, experts on
    axis 0, each slice through the hooks with its target shape, then cast to ``dtype``, the
    ``weight_dtype``). The calling test skips without MaxText's wheel."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    table, hooks = _tables(kind, hf_config, scan_layers, saving_to_hf=True, dtype=dtype)
    shape_of = getattr(_module("hf_shape"), f"{ENTRIES[kind]}_HF_WEIGHTS_TO_SHAPE")(hf_config)
    flat = _flat(params)
    out: dict = {}

    def emit(hf_key, weight, fns):
        target = shape_of[hf_key]
        weight = _apply(weight, fns, target)
        if dtype is not None:
            weight = weight.astype(dtype)
        out[hf_key] = np.asarray(weight).reshape(target)

    for key, targets in table.items():
        if key not in flat:  # (to_huggingface keeps the names the checkpoint has)
            continue
        weight, fns = jnp.asarray(flat[key]), hooks.get(key)
        if isinstance(targets, str):
            emit(targets, weight, fns)
        elif isinstance(targets[0], str):  # layers on axis 1, or experts of one layer on 0
            axis = 1 if scan_layers and weight.ndim > 1 else 0
            for i, hf_key in enumerate(targets):
                emit(hf_key, jax.lax.index_in_dim(weight, i, axis, keepdims=False), fns)
        else:  # experts (axis 0), then layers (axis 1, now 0)
            for e, layer_keys in enumerate(targets):
                expert = jax.lax.index_in_dim(weight, e, 0, keepdims=False)
                for i, hf_key in enumerate(layer_keys):
                    emit(hf_key, jax.lax.index_in_dim(expert, i, 0, keepdims=False), fns)
    return out
