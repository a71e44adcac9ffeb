"""Flax trees as tables of tensors by dotted name: what an export reads from
(:func:`flax_table`: an NNX module, a pytree of arrays or a checkpoint path, plus a batch
reader), the names of a tree's leaves and back (:func:`tree_leaves`, :func:`nested`), and
``save_model`` / ``load_model``: an NNX module's whole state in one ``.safetensors`` file,
mirroring ``safetensors.torch``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from etils import epath

if TYPE_CHECKING:  # flax.nnx is slow to import: only when these helpers run
    from flax import nnx

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.casting import DtypePolicy
from orbax_safetensors._src.pipeline.standalone import load_file, save_file


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


def in_memory(
    values: dict[str, Any], where: str, lora_params: frozenset[str] = frozenset()
) -> FlaxTable:
    """The table of arrays ``values`` by name (``where``: how reports name their source)."""
    infos = {n: _sources.TensorInfo.of(n, x, where) for n, x in values.items()}

    def read(names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: np.asarray(values[n]) for n in names}

    return FlaxTable(infos, read, values, where, lora_params=lora_params)


def tree_leaves(tree: Any) -> tuple[list[tuple[str, Any, Any]], Any]:
    """``tree``'s leaves as ``(dotted name, leaf, value)``, and its treedef: an
    ``nnx.Variable`` is one leaf whose value is the array it holds, RNG state
    (``nnx.RngState``: training state, never model weights) has the value None, and any
    other leaf is its own value (a numpy one in the machine's byte order)."""
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
        value = _tree.native_byte_order(
            _jaxcompat.nnx_value(leaf) if isinstance(leaf, variables) else leaf
        )
        out.append((_tree.join_path(path), leaf, None if isinstance(leaf, rng_state) else value))
    return out, treedef


def nested(flat: Mapping[str, Any]) -> dict[Any, Any]:
    """The nested dicts of dotted names ``flat``: ``{"a.0.b": x}`` -> ``{"a": {0: {"b": x}}}``
    (all-decimal keys as ``int`` s); ``ValueError`` for a name that prefixes another."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{'.'.join(parents[: i + 1])} is a tensor and holds {name}")
            node = child
        if last in node:
            raise ValueError(f"{name} is a tensor and holds {sorted(node[last])[0]!r}")
        node[last] = value

    def keyed(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        numbers = all(k.isdecimal() and str(int(k)) == k for k in node)
        return {(int(k) if numbers else k): keyed(v) for k, v in node.items()}

    return keyed(tree)


def _tree_values(tree: Any, lora_params: set[str] | None = None) -> dict[str, Any]:
    import jax

    out = {}
    for name, leaf, value in tree_leaves(tree)[0]:
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            continue  # Python scalars, strings, None: not tensors
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            continue  # typed PRNG keys are training state, never model weights
        if not name.isascii():
            _tree.check_tensor_name(name)
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
    """The tensors of ``source`` by Flax name; with ``prefix``, only names starting with it,
    without it. ``source`` is an ``nnx.Module`` (its variables of the ``variables`` filter,
    default ``nnx.Param`` and ``nnx.BatchStat``), a pytree (its array leaves named by key path;
    ``nnx.Variable`` s by their value; RNG state and typed PRNG keys left out), or a path (a
    file, an item, a plain directory, an Orbax-native item, a step directory with ``item=``, a
    CheckpointManager root with ``step=`` or its latest committed step).

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
    return in_memory(values, where, frozenset(lora_params))


TRAIN_STATE_PARAMS = "params"
OPTIMIZER_STATE = "opt_state"
STEP = "step"


def training_state(infos: Mapping[str, _sources.TensorInfo]) -> list[str]:
    """The names of ``infos`` that are a train state's optimizer state and step counter, not
    parameters: when the top level holds ``params`` (a Flax ``TrainState``, MaxText's
    ``{"step", "params", "opt_state"}``), every name under ``opt_state`` and ``step`` when
    it is a 0-d integer. Other top-level entries (MaxText's ``nnx_aux``) go through the
    mapping as parameters do.
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


def save_model(
    model: nnx.Module,
    path: epath.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: DtypePolicy | None = None,
) -> None:
    """Saves every variable of an ``nnx.Module`` to one ``.safetensors`` file.

    Args:
      model: the module (its current state is saved; the module is not changed).
      path: the file to write.
      metadata: extra ``str -> str`` header metadata.
      dtype: a dtype policy, as in ``save_file`` (e.g. ``jnp.bfloat16`` for bf16 weights of an
        f32 model); ``load_model`` gives each variable the model's dtype back.

    Example::

        osf.save_model(model, "mlp-bf16.safetensors", dtype=jnp.bfloat16)
    """
    from flax import nnx

    save_file(nnx.state(model), path, metadata, dtype=dtype)


def load_model(
    model: nnx.Module, path: epath.PathLike, strict: bool = True, *, verify: bool = True
) -> nnx.Module:
    """Loads a file written by :func:`save_model` into ``model`` in place (and returns it).

    Each variable keeps its dtype, sharding and place in the module graph; shared variables
    stay shared. With ``verify`` (the default) every tensor is checked against its CRC32C as
    :func:`load_file` checks it (one file of a checkpoint directory against the checksums its
    directory records).

    Raises:
      TargetMismatchError: naming every missing, unexpected or mis-shaped key when the file
        does not fit the model (with ``strict=False`` unexpected keys are skipped and missing
        ones keep the model's values).
      IntegrityError: a tensor's bytes do not match their checksum (naming it and the file).

    Example::

        model = MLP(rngs=nnx.Rngs(0))   # any instance of the saved module's class
        osf.load_model(model, "mlp-bf16.safetensors")
    """
    from flax import nnx

    state = nnx.state(model)
    restored = load_file(path, target=state, strict=strict, verify=verify)
    nnx.update(model, restored)
    return model
