"""What an export reads from: an NNX module, any pytree of arrays, or a checkpoint path, as a
table of tensors by dotted Flax name plus a batch reader.

- an ``nnx.Module``: its variables selected by an ``nnx`` filter (default ``nnx.Param`` and
  ``nnx.BatchStat``; ``nnx.LoRAParam`` is an ``nnx.Param``);
- a pytree (dicts, lists, Linen ``params``, ``nnx.State``, ``TrainState.params``): its array
  leaves, named by their key paths joined with ``.`` (``nnx.Variable`` leaves by their value;
  RNG state and typed PRNG keys left out);
- a path: a ``.safetensors`` file, a checkpoint item, a plain safetensors directory, an
  Orbax-native item, a step directory (``item=`` picks one of several items) or a
  CheckpointManager root (its latest committed step, or ``step=``).

Example::

    table = flax_table({"params": {"w": jnp.ones((2, 3))}})
    table.infos["params.w"].shape        # (2, 3)
    table.read(["params.w"])             # {"params.w": np.ndarray}
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import tree as _tree


@dataclasses.dataclass
class FlaxTable:
    """Tensors by Flax name: their infos, a reader of host arrays, and (for in-memory
    sources) the values themselves, which callable dtype policies see; for a path, the
    opened ``source`` and the ``prefix`` its names carry (a multi-process export reads each
    process's boxes from it); ``lora_params``: the names of ``nnx.LoRAParam`` variables
    (a module's, or an ``nnx.State``'s)."""

    infos: dict[str, _sources.TensorInfo]
    read: Callable[[Sequence[str]], dict[str, np.ndarray]]
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    where: str = "(model)"
    source: Any = None
    prefix: str = ""
    lora_params: frozenset[str] = frozenset()


def _is_path(source: Any) -> bool:
    return isinstance(source, (str, epath.PathLikeCls)) or hasattr(source, "__fspath__")


def _in_memory(
    values: dict[str, Any], where: str, lora_params: frozenset[str] = frozenset()
) -> FlaxTable:
    infos = {n: _sources.TensorInfo.of(n, x, where) for n, x in values.items()}

    def read(names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: np.asarray(values[n]) for n in names}

    return FlaxTable(infos, read, values, where, lora_params=lora_params)


def tree_leaves(tree: Any) -> tuple[list[tuple[str, Any, Any]], Any]:
    """``tree``'s leaves as ``(dotted name, leaf, value)``, and its treedef: an
    ``nnx.Variable`` is one leaf whose value is the array it holds, RNG state
    (``nnx.RngState``: training state, never model weights) has the value None, and any
    other leaf is its own value."""
    import jax

    # A tree holds nnx variables only once flax.nnx is loaded: a plain tree need not load it.
    nnx = sys.modules.get("flax.nnx")
    variables = _jaxcompat.nnx_variable_types() if nnx is not None else ()
    rng_state = (nnx.RngState,) if nnx is not None else ()
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, variables)
    )
    out = []
    for path, leaf in flat:
        value = _jaxcompat.nnx_value(leaf) if isinstance(leaf, variables) else leaf
        out.append((_tree.join_path(path), leaf, None if isinstance(leaf, rng_state) else value))
    return out, treedef


def _tree_values(tree: Any, lora_params: set[str] | None = None) -> dict[str, Any]:
    import jax

    out = {}
    for name, leaf, value in tree_leaves(tree)[0]:
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            continue  # Python scalars, strings, None: not tensors
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            continue  # typed PRNG keys are training state, never model weights
        out[name] = value
        variable = leaf is not value  # (an nnx.Variable holds its value)
        if variable and lora_params is not None and _jaxcompat.nnx_is_lora_param(leaf):
            lora_params.add(name)
    return out


def model_values(model: Any, variables: Any, lora_params: set[str] | None = None) -> dict[str, Any]:
    """``{dotted name: value}`` of an NNX module's variables selected by ``variables``; the
    names of its ``nnx.LoRAParam`` s go to ``lora_params``."""
    from flax import nnx

    filt = (nnx.Param, nnx.BatchStat) if variables is None else variables
    state = nnx.state(model, filt)
    out = {}
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(k) for k in path)
        out[name] = _jaxcompat.nnx_value(var)
        if lora_params is not None and _jaxcompat.nnx_is_lora_param(var):
            lora_params.add(name)
    return out


def flax_table(
    source: Any,
    *,
    prefix: str = "",
    variables: Any = None,
    step: int | None = None,
    item: str | None = None,
) -> FlaxTable:
    """The tensors of ``source`` by Flax name (see the module docstring); with ``prefix``, only
    names starting with it, without it.

    Raises:
      SafetensorsCheckpointError: a path that holds no tensors, or no ``step`` or ``item``
        of that name (``catalog.sources.open_source``).
      TypeError: a source that is none of these.
    """
    lora_params: set[str] = set()
    if _is_nnx_module(source):
        values = model_values(source, variables, lora_params)
    elif _is_path(source):
        src = _sources.open_source(source, step=step, item=item, latest=True)
        infos = {
            n[len(prefix) :]: dataclasses.replace(t, name=n[len(prefix) :])
            for n, t in src.tensors.items()
            if n.startswith(prefix)
        }

        def read_checkpoint(names: Sequence[str]) -> dict[str, np.ndarray]:
            got = src.read([prefix + n for n in names])
            return {n: got[prefix + n] for n in names}

        return FlaxTable(infos, read_checkpoint, {}, str(src.path), src, prefix)
    else:
        values = _tree_values(source, lora_params)
        if not values and source is not None and not isinstance(source, (dict, list, tuple)):
            raise TypeError(
                f"cannot export a {type(source).__name__}: give an nnx.Module, a pytree of "
                "arrays or a checkpoint path"
            )
    if prefix:
        values = {n[len(prefix) :]: v for n, v in values.items() if n.startswith(prefix)}
        lora_params = {n[len(prefix) :] for n in lora_params if n.startswith(prefix)}
    where = "(model)" if _is_nnx_module(source) else "(pytree)"
    return _in_memory(values, where, frozenset(lora_params))


TRAIN_STATE_PARAMS = "params"
OPTIMIZER_STATE = "opt_state"
STEP = "step"


def training_state(infos: Mapping[str, _sources.TensorInfo]) -> list[str]:
    """The names of ``infos`` that are a train state's optimizer state and step counter, not
    parameters: when the top level holds ``params`` (a Flax ``TrainState``, MaxText's
    ``{"step", "params", "opt_state"}``), every name under ``opt_state`` and ``step`` when
    it is a 0-d integer. Other top-level entries (MaxText's ``nnx_aux``) go through the
    mapping as parameters do.

    Example::

        training_state(flax_table("/ckpt/7/items").infos)  # ["opt_state.0.count", ..., "step"]
    """
    tops = {n.split(".", 1)[0] for n in infos}
    if TRAIN_STATE_PARAMS not in tops:
        return []
    out = []
    for name, info in infos.items():
        counter = name == STEP and not info.shape and info.dtype[0] in "IU"
        if counter or name.startswith(OPTIMIZER_STATE + "."):
            out.append(name)
    return out


def _is_nnx_module(source: Any) -> bool:
    # Only an imported flax.nnx makes modules: a path or a pytree need not import it.
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(source, nnx.Module)
