"""MaxText 0.2.5's own reader of a parameters checkpoint (``load_parameters_path``), run from its
wheel: the test reference for ``osf.import_pytorch``.

MaxText itself does not run here (its wheel needs Python >= 3.12 and its whole stack), so the
functions that read the checkpoint are taken from the wheel's source and executed as written:
``common/checkpointing.py``'s ``load_params_from_path`` (the path normalised to the step,
``checkpointable_name="items"``, the stored shapes checked against the model's before the load,
``ocp.load`` of ``{"params": <collections>}`` under ``partial_load=True``, the collections the
checkpoint lacks looked up in ``params``, every model weight required after it) with each
function it calls, ``load_checkpoint_metadata``, ``common/checkpoint_context.py``'s
``build_context`` and ``utils/model_creation_utils.py``'s ``verify_and_sync_scan_layers``. The
MaxText modules they import besides are stubs: its logging, and its sharding and quantization
modules, which only a quantized checkpoint reaches (a stub raises if called). What MaxText
builds around them, the model's abstract parameters, is the caller's: a Linen tree of
collections (``{"params": {...}, "MoEBiasVar": {...}}``) of ``jax.ShapeDtypeStruct`` s.

Example::

    params = maxtext_loader.load_params_from_path(f"{root}/0/items", abstract)   # skips w/o wheel
    maxtext_loader.verify_scan_layers(f"{root}/0/items", scan_layers=True)
"""

from __future__ import annotations

import ast
import collections
import functools
import os
import types
from typing import Any

import maxtext_reference
import optional_deps

CHECKPOINTING = "maxtext/common/checkpointing.py"
CONTEXT = "maxtext/common/checkpoint_context.py"
CREATION = "maxtext/utils/model_creation_utils.py"
# What the reader runs of checkpointing.py: load_params_from_path and every function it calls
FUNCTIONS = (
    "load_params_from_path", "load_checkpoint_metadata", "_normalize_checkpoint_root",
    "_deep_merge_dicts", "_weight_mismatches", "_lookup_path", "_alias_legacy_collections",
    "_unalias_legacy_collections", "_raise_weight_problems", "_is_custom_projector_problem",
    "_raise_on_weight_mismatch", "_filter_lora_trainable_state", "_augment_want_with_scales",
    "_augment_target_with_scales", "_scale_sharding", "maybe_dequantize_restored_params",
    "_log_unconsumed_checkpoint_weights",
)  # fmt: skip


class _Unused(types.ModuleType):
    """A MaxText module these functions reach only for quantized checkpoints."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"MaxText's {self.__name__}.{name} is not emulated here")


def functions(member: str, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
    """Runs the top-level functions ``names`` of the wheel's ``member`` (``maxtext/...py``), as
    written, in ``namespace`` (which supplies what they use). Skips the calling test without
    MaxText's wheel."""
    found = maxtext_reference.source(member)
    if found is None:
        optional_deps.missing(
            "MaxText's wheel (maxtext==0.2.5)",
            "pip download --no-deps --python-version 3.12 --only-binary=:all: maxtext==0.2.5, "
            f"then set {maxtext_reference.ENV} to the wheel",
        )
    text, path = found
    tree = ast.parse(text)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == set(names), set(names) - {n.name for n in body}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)


@functools.lru_cache(maxsize=1)
def _reader() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from etils import epath
    from flax import nnx
    from flax.nnx import variablelib
    from orbax.checkpoint import pathways
    from orbax.checkpoint import v1 as ocp

    context: dict[str, Any] = {"ocp": ocp, "ocp_pathways": pathways}
    found = maxtext_reference.source(CONTEXT)
    if found is not None:  # (else _functions skips below)
        exec(compile(found[0], found[1], "exec"), context)  # (all of checkpoint_context.py)
    namespace: dict[str, Any] = {
        "Any": Any, "collections": collections, "os": os, "epath": epath, "jax": jax,
        "jnp": jnp, "nnx": nnx, "variablelib": variablelib, "ocp": ocp,
        "checkpoint_context": types.SimpleNamespace(**context),
        "max_logging": types.SimpleNamespace(log=lambda *a, **k: None),
        "maxtext_sharding": _Unused("maxtext_sharding"),
        "quantizations": _Unused("quantizations"),
    }  # fmt: skip
    functions(CHECKPOINTING, FUNCTIONS, namespace)
    checkpointing = types.SimpleNamespace(**namespace)
    creation = {"checkpointing": checkpointing, "max_logging": namespace["max_logging"]}
    functions(CREATION, ("verify_and_sync_scan_layers",), creation)
    namespace["verify_and_sync_scan_layers"] = creation["verify_and_sync_scan_layers"]
    return namespace


def load_params_from_path(path: Any, abstract_params: Any) -> Any:
    """MaxText's ``load_params_from_path(path, abstract_params, checkpoint_storage_concurrent_gb
    =None)``: the restored parameters (Linen: a tree of collections), or its ValueError naming
    the weights that do not fit. The calling test skips without MaxText's wheel."""
    return _reader()["load_params_from_path"](str(path), abstract_params, None)


def verify_scan_layers(path: Any, *, scan_layers: bool) -> bool:
    """MaxText's ``verify_and_sync_scan_layers`` for a run that sets ``scan_layers`` itself:
    the ``scan_layers`` the run goes on with, or its ValueError on a checkpoint saved the other
    way. The calling test skips without MaxText's wheel."""
    config = types.SimpleNamespace(load_parameters_path=str(path), scan_layers=scan_layers)
    return _reader()["verify_and_sync_scan_layers"](config).scan_layers
