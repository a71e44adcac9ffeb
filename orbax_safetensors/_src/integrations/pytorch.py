"""PyTorch / Hugging Face checkpoints into Flax NNX models and back, through one declarative
key mapping.

A :class:`KeyMapping` is a list of :class:`Rule` s. Each rule pairs a PyTorch key pattern with
a Flax name pattern and an optional :class:`Transform` (what to do to the tensor on the way):

- patterns are literal dotted names with placeholders: ``{i}`` matches one name component
  (``[^.]+``), ``{i:REGEX}`` matches ``REGEX``; both sides use the same placeholders, so every
  rule works in both directions;
- transforms have a ``to_flax`` and a ``to_torch`` side: :class:`Transpose` (``nn.Linear``
  weight ``(out, in)`` -> Flax kernel ``(in, out)``), :class:`SplitHeads` (``(heads * dim)``
  -> ``(heads, dim)`` for attention projections), :class:`Reshape` and :class:`Chain`.

The first rule that matches a key wins. :func:`load_pytorch` reads a ``state_dict`` saved with
``safetensors.torch.save_file`` (or a Hugging Face directory, sharded with
``model.safetensors.index.json`` or not) into an NNX model; :func:`export_pytorch` writes a
model (or a checkpoint) as a Hugging Face style directory that ``safetensors.torch.load_file``
and ``huggingface_hub.load_torch_model`` read. Both report every key that no rule maps, every model variable left
without a value and every shape that does not fit, all at once.

Example::

    mapping = osf.KeyMapping([
        osf.Rule("embed.weight", "embed.embedding"),
        *osf.Rule.linear("layers.{i}.attn.q_proj", "layers.{i}.attn.query", heads=4),
        *osf.Rule.layer_norm("layers.{i}.norm", "layers.{i}.norm"),
    ], ignore_torch=[r".*\\.num_batches_tracked"])
    osf.load_pytorch(model, "torch_model.safetensors", mapping)
    osf.export_pytorch(model, "/tmp/hf_export", mapping)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import astype as _astype
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    MappingReport,
    Reshape,
    Rule,
    SplitHeads,
    Transform,
    Transpose,
)
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

__all__ = [
    "Chain",
    "KeyMapping",
    "MappingReport",
    "Reshape",
    "Rule",
    "SplitHeads",
    "Transform",
    "Transpose",
    "export_pytorch",
    "load_pytorch",
]


# --------------------------------------------------------------------------- models


def _variable_filter(variables: Any) -> Any:
    from flax import nnx

    if variables is None:
        return (nnx.Param, nnx.BatchStat)
    return variables


def _model_variables(model: Any, variables: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """``{dotted name: (path, Variable)}`` of the model's variables selected by ``variables``."""
    from flax import nnx

    state = nnx.state(model, _variable_filter(variables))
    return {".".join(str(k) for k in path): (path, var) for path, var in nnx.to_flat_state(state)}


def _shape_after(
    transform: Transform, shape: tuple[int, ...], dtype: Any, to_flax: bool
) -> tuple[int, ...]:
    probe = np.broadcast_to(np.zeros((), dtype), shape)  # no memory: zero strides
    out = transform.to_flax(probe) if to_flax else transform.to_torch(probe)
    return tuple(int(d) for d in out.shape)


def load_pytorch(
    model: Any,
    path: epath.PathLike,
    mapping: KeyMapping,
    *,
    strict: bool = True,
    variables: Any = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Loads a PyTorch/Hugging Face safetensors checkpoint into an NNX model, in place.

    Args:
      model: the NNX module to fill (its variables keep their dtype and sharding; values are
        cast to the variable's dtype).
      path: a ``.safetensors`` file (e.g. ``safetensors.torch.save_file(model.state_dict())``)
        or a directory of them (Hugging Face style, sharded with
        ``model.safetensors.index.json`` or a single ``model.safetensors``).
      mapping: how PyTorch keys become the model's variable names.
      strict: raise if any key is unmapped, unexpected, missing or mis-shaped (checked before
        anything is loaded); with ``strict=False``, load what fits and return the report.
      variables: an ``nnx`` filter of the variables to fill (default ``(nnx.Param,
        nnx.BatchStat)``; RNG state is left alone).
      batch_bytes: tensor bytes read at a time.

    Returns:
      A :class:`MappingReport`.

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once.

    Example::

        report = osf.load_pytorch(model, "pytorch_model.safetensors", mapping)
        assert report.ok
    """
    import jax
    from flax import nnx

    source = _sources.open_source(path)
    model_vars = _model_variables(model, variables)
    report = MappingReport()
    moves: list[tuple[str, str, Transform]] = []
    claimed: dict[str, str] = {}
    for key, info in source.tensors.items():
        if mapping.torch_ignored(key):
            report.ignored.append(key)
            continue
        target = mapping.to_flax(key)
        if target is None:
            report.unmapped.append(key)
            continue
        name, transform = target
        if name not in model_vars:
            report.unexpected.append(f"{key} -> {name}")
            continue
        if name in claimed:
            report.mismatched.append(f"{key} and {claimed[name]} both map to {name}")
            continue
        claimed[name] = key
        var = model_vars[name][1]
        want = tuple(var.get_value().shape)
        try:
            got = _shape_after(transform, info.shape, _dtypes.to_numpy(info.dtype), True)
        except ValueError as e:
            report.mismatched.append(f"{key} {info.dtype}{list(info.shape)} -> {name}: {e}")
            continue
        if got != want:
            report.mismatched.append(
                f"{key} {info.dtype}{list(info.shape)} becomes {list(got)} but {name} is {list(want)}"
            )
            continue
        moves.append((key, name, transform))
    report.missing = [n for n in model_vars if n not in claimed and not mapping.flax_ignored(n)]
    if strict and not report.ok:
        raise TargetMismatchError(
            f"{path}: the checkpoint does not fit the model through this mapping\n"
            + report.problems()
        )
    updates = []
    by_key = {key: (name, transform) for key, name, transform in moves}
    for group in _sources.batches([source.tensors[k] for k, _, _ in moves], batch_bytes):
        arrays = source.read([t.name for t in group])
        for t in group:
            name, transform = by_key[t.name]
            path_, var = model_vars[name]
            current = var.get_value()
            value = np.asarray(transform.to_flax(arrays.pop(t.name))).astype(current.dtype)
            sharding = getattr(current, "sharding", None)
            placed = (
                jax.device_put(value, sharding)
                if sharding is not None
                else jax.numpy.asarray(value)
            )
            updates.append((path_, var.replace(placed)))
            report.moved.append((t.name, name))
    if updates:
        nnx.update(model, nnx.from_flat_state(updates))
    return report


# --------------------------------------------------------------------------- export


def _flax_source(
    source: Any, prefix: str, variables: Any
) -> tuple[dict[str, _sources.TensorInfo], Any]:
    """(tensor table, read function) for an NNX model or a checkpoint path."""
    from flax import nnx

    if isinstance(source, nnx.Module):
        model_vars = _model_variables(source, variables)
        values = {n: v.get_value() for n, (_, v) in model_vars.items()}
        infos = {}
        for n, x in values.items():
            dtype = _dtypes.from_numpy(x.dtype, key=n)
            shape = tuple(int(d) for d in x.shape)
            infos[n] = _sources.TensorInfo(n, dtype, shape, _dtypes.nbytes(dtype, shape), "(model)")

        def read_model(names: Sequence[str]) -> dict[str, np.ndarray]:
            return {n: np.asarray(values[n]) for n in names}

        return infos, read_model
    src = _sources.open_source(source)
    infos = {
        n[len(prefix) :]: dataclasses.replace(t, name=n[len(prefix) :])
        for n, t in src.tensors.items()
        if n.startswith(prefix)
    }

    def read_checkpoint(names: Sequence[str]) -> dict[str, np.ndarray]:
        got = src.read([prefix + n for n in names])
        return {n: got[prefix + n] for n in names}

    return infos, read_checkpoint


def export_pytorch(
    source: Any,
    directory: epath.PathLike,
    mapping: KeyMapping,
    *,
    prefix: str = "",
    dtype: Any = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    strict: bool = True,
    variables: Any = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Writes an NNX model (or a checkpoint) as a Hugging Face style safetensors directory.

    The directory gets ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` above ``max_file_size``), with header metadata
    ``{"format": "pt"}``, ready for ``safetensors.torch.load_file`` / ``load_state_dict`` or
    ``huggingface_hub.load_torch_model`` (the layout ``transformers`` loads from). Other files in the directory (``config.json``...)
    are kept; earlier ``model*.safetensors`` files and index are replaced.

    Args:
      source: an ``nnx.Module``, or a checkpoint path (file, item directory, Orbax item)
        whose tensor names are the model's variable names after ``prefix``.
      directory: where to write.
      mapping: the same mapping :func:`load_pytorch` uses, applied in reverse.
      prefix: with a checkpoint path, only names starting with it are exported (e.g.
        ``"model."`` for a ``{"model": ..., "optimizer": ...}`` checkpoint), without it.
      dtype: cast every tensor to this dtype (e.g. ``jnp.bfloat16``); default: keep.
      max_file_size: split into shards above this many bytes (None: one file).
      strict: raise if a Flax name has no rule; with ``strict=False`` skip it and report.
      variables: with a model, the ``nnx`` filter of variables to export (default
        ``(nnx.Param, nnx.BatchStat)``).
      batch_bytes: tensor bytes held in memory at a time (checkpoint sources).

    Returns:
      A :class:`MappingReport` (``moved`` pairs are ``(flax name, torch key)``).

    Example::

        osf.export_pytorch(model, "/tmp/hf", mapping)
        torch_model.load_state_dict(safetensors.torch.load_file("/tmp/hf/model.safetensors"))
    """
    directory = epath.Path(directory)
    infos, read = _flax_source(source, prefix, variables)
    report = MappingReport()
    moves: list[tuple[str, str, Transform]] = []
    taken: dict[str, str] = {}
    specs = []
    out_dtype = None if dtype is None else np.dtype(dtype)
    for name, info in infos.items():
        if mapping.flax_ignored(name):
            report.ignored.append(name)
            continue
        target = mapping.to_torch(name)
        if target is None:
            report.unmapped.append(name)
            continue
        key, transform = target
        if key in taken:
            report.mismatched.append(f"{name} and {taken[key]} both map to {key}")
            continue
        taken[key] = name
        try:
            shape = _shape_after(transform, info.shape, _dtypes.to_numpy(info.dtype), False)
        except ValueError as e:
            report.mismatched.append(f"{name} {info.dtype}{list(info.shape)} -> {key}: {e}")
            continue
        st_dtype = info.dtype if out_dtype is None else _dtypes.from_numpy(out_dtype, key=name)
        specs.append(_plan.TensorSpec(key, st_dtype, shape))
        moves.append((name, key, transform))
    if strict and not report.ok:
        raise TargetMismatchError(
            f"cannot export to {directory} through this mapping\n" + report.problems()
        )
    # Earlier model files and index are replaced whole, other files kept (storage/replace.py).
    with _replace.replacing_directory(directory) as out:
        plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata={"format": "pt"})
        local = _router.is_local(out)
        by_name = {name: (key, transform) for name, key, transform in moves}
        groups = _sources.batches(
            [infos[n] for n, _, _ in moves], batch_bytes if local else 1 << 62
        ) or [[]]
        for i, group in enumerate(groups):
            arrays = read([t.name for t in group])
            pieces: dict[int, list[_interface.Piece]] = {}
            if i == 0:
                for f, file_plan in enumerate(plan.files):
                    pieces[f] = [_interface.header_piece(file_plan.header)]
            for t in group:
                key, transform = by_name[t.name]
                value = np.asarray(transform.to_torch(arrays.pop(t.name)))
                if out_dtype is not None:
                    value = _astype.astype(value, out_dtype)
                file_plan, entry = plan.locate(key)
                raw = _dtypes.pack(np.ascontiguousarray(value), entry.dtype)
                pieces.setdefault(plan.file_of[key], []).append(
                    _interface.Piece(file_plan.data_start + entry.begin, raw)
                )
                report.moved.append((t.name, key))
            last = i == len(groups) - 1
            for f, file_plan in enumerate(plan.files):
                if f in pieces or last:
                    _router.write_file(
                        out / file_plan.filename,
                        pieces.get(f, []),
                        size=file_plan.size,
                        checksums=False,
                        sync=last,
                    )
        if len(plan.files) > 1:
            (out / _plan.INDEX_FILE_NAME).write_text(json.dumps(plan.index_json(), indent=2))
    return report
