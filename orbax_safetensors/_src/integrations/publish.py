"""Publishing every step: a ``KeyMapping`` as the save and restore hooks of the Orbax args.

``SafetensorsSave(item, mapping=..., hf_config=...)`` makes a CheckpointManager item that is
a Hugging Face model directory. The Orbax layer cannot import this layer, so this module
registers ``KeyMapping`` with it (``orbax/mappings.py``) when the package is imported:

- :func:`export_plan` compiles the mapping, on the caller's line and from names, shapes and
  dtypes only, into the neutral ``pipeline/export_plan.ExportPlan``: which PyTorch tensors are
  written, in which dtype, and a function per link that computes them from the item's host
  arrays (LoRA adapters merged, the rule's ``to_torch``, tied keys dropped); the save job runs
  those functions on its writer thread, from the snapshot. For a multi-process save each
  group also carries how one shard maps on its own (``integrations/export_plan.shard_boxes``,
  a LoRA kernel shard merged first from the whole adapters: ``lora.merge_lora_block``) and
  how its outputs are re-laid-out on the devices (``sharded_export.relaid``), so that each
  process writes only its own bytes;
- :func:`restore_item` reads such an item (or any safetensors item) back into a target's
  layout with the load machinery of ``integrations/load.py``.

Example::

    mngr.save(step, args=ocp.args.Composite(
        state=osf.SafetensorsSave(train_state),
        hf=osf.SafetensorsSave(params, mapping=osf.preset_mapping("llama"), hf_config=config),
    ))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations import export_plan as _shards
from orbax_safetensors._src.integrations import fidelity as _fidelity
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import load as _load
from orbax_safetensors._src.integrations import lora as _lora
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations import pytorch as _pytorch
from orbax_safetensors._src.integrations import sharded_export as _sharded_export
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.orbax import mappings as _mappings
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export_plan as _export_plan
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.storage import config as _config

HEADER_METADATA = {"format": "pt"}  # what transformers and safetensors.torch write

Box = tuple[slice, ...]


def _with_adapters(
    names: Sequence[str],
    kernels: Mapping[str, Any],
    adapters: Mapping[str, Any],
    merges: Mapping[str, tuple[str, str]],
    merge: Callable[[Any, Any, Any, float], Any],
    scale: float,
) -> list[Any]:
    """``kernels[name]`` for each name, merged with its LoRA adapters (``merge(kernel, a, b,
    scale)``, ``a`` and ``b`` from ``adapters``) where ``merges`` names a pair for it."""
    return [
        merge(kernels[n], adapters[merges[n][0]], adapters[merges[n][1]], scale)
        if n in merges
        else kernels[n]
        for n in names
    ]


def _group(
    link: _links.Link,
    tied: dict[str, str],
    merges: dict[str, tuple[str, str]],
    scale: float,
    shapes: dict[str, tuple[int, ...]],
    out_shapes: dict[str, tuple[int, ...]],
) -> _export_plan.ExportGroup:
    adapters = [n for name in link.flax if name in merges for n in merges[name]]
    sources = (*link.flax, *adapters)
    outputs = tuple(k for k in link.torch if k not in tied)
    n = len(link.flax)
    flax_shapes = [shapes[name] for name in link.flax]

    def apply(arrays: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
        # One output at a time (a stacked source's slices are views; an output that stacks or
        # joins several sources is made when the writer asks for it).
        got = dict(zip(sources, arrays))
        flax = _with_adapters(link.flax, got, got, merges, _lora.merge_lora, scale)[:n]
        del arrays, got
        for j, key in enumerate(link.torch):
            if key not in tied:
                yield link.value(flax, j, to_torch=True)

    def per_shard(
        k: int, box: Box, data: np.ndarray, wholes: Mapping[str, np.ndarray]
    ) -> list[tuple[str, Box, np.ndarray]]:
        # One shard of link.flax[k] (merged with the rows and columns of the whole adapters
        # its box needs: bit-identical to that block of the whole merge), mapped on its own.
        name = link.flax[k]
        if name in merges:
            a, b = merges[name]
            data = _lora.merge_lora_block(data, box, wholes[a], wholes[b], scale, shapes[name])
        return [
            (link.torch[j], obox, values)
            for j, obox, values in _shards.shard_boxes(link, k, box, data, flax_shapes)
            if link.torch[j] not in tied
        ]

    def on_devices(arrays: Sequence[Any], wholes: Mapping[str, np.ndarray]) -> Iterator[Any]:
        # The outputs re-laid-out on the devices, one at a time; a kernel with adapters is
        # merged first, shard by shard on the host from the whole adapters (bit-identical to
        # the one-process merge), and put back on its devices.
        got = dict(zip(sources, arrays))
        flax = _with_adapters(link.flax, got, wholes, merges, _sharded_export.merged, scale)
        del got
        for key in outputs:
            yield _sharded_export.relaid(link, flax, link.torch.index(key), out_shapes[key])

    commutes = _shards.commutes(link, flax_shapes)
    return _export_plan.ExportGroup(
        sources,
        outputs,
        apply,
        whole=tuple(adapters),
        per_shard=per_shard if commutes else None,
        on_devices=on_devices,
    )


def export_plan(
    mapping: KeyMapping,
    validated: _checkpoint_save.ValidatedTree,
    dtype: _casting.DtypePolicy | None,
    hf_config: Any,
    *,
    generation_config: Any = None,
) -> _export_plan.ExportPlan:
    """The Hugging Face tensors of ``validated``'s arrays through ``mapping`` (see the module
    docstring); ``dtype`` is a policy over the item's dotted names; the small files
    (``config.json``, ``generation_config.json``, the tokenizer's) from ``hf_config`` and
    ``generation_config`` as ``osf.export_pytorch`` writes them (``model_files``).

    Raises:
      TargetMismatchError: every name no rule maps, fused part without its siblings, shape
        that does not fit (a fused split that does not fit ``hf_config``'s heads too) and
        LoRA adapter the mapping would drop, all at once.
      ValueError: qwix LoRA adapters and no ``KeyMapping.lora_scale``.
    """
    policy = _casting.parse_policy(dtype)
    arrays = validated.flat.arrays
    shapes = {n: tuple(int(d) for d in a.shape) for n, a in arrays.items()}
    report = MappingReport()
    found = _lora.plan(shapes, mapping, report)
    merges = dict(found.merges)
    lora = _sharded_export.Lora(merges, found.scale)
    planned = _pytorch.plan_export(
        mapping,
        shapes,
        {n: _dtypes.from_numpy(np.dtype(a.dtype), key=n) for n, a in arrays.items()},
        arrays,
        policy,
        report,
        lora=found,
        tie_values=lambda names: {n: _sharded_export.merged_value(arrays, n, lora) for n in names},
        hf_config=hf_config,
        show_stored=True,
    )
    specs = planned.specs
    tied = dict(planned.mapping.tied)
    out_shapes = {s.name: tuple(s.shape) for s in specs}
    groups = [_group(link, tied, merges, found.scale, shapes, out_shapes) for link in planned.links]
    if not report.ok:
        raise TargetMismatchError(
            "SafetensorsSave(mapping=...): the item does not fit this mapping:\n"
            + report.problems()
        )
    _fidelity.warn_untied(planned.untied, with_config=hf_config is not None)
    files = _model_files.model_files(
        hf_config,
        [s.dtype for s in specs],
        cast=policy is not None,
        generation_config=generation_config,
        untie=bool(planned.untied),
    )
    summary = f"KeyMapping: {len(arrays)} tensors -> {len(specs)} Hugging Face tensors"
    return _export_plan.ExportPlan(tuple(specs), tuple(groups), HEADER_METADATA, files, summary)


def restore_item(
    directory: epath.Path,
    target: Any,
    mapping: KeyMapping,
    *,
    strict: bool = True,
    verify: bool = True,
    io: _config.IOOptions | None = None,
    stats: _read.ReadStats | None = None,
) -> Any:
    """``target`` (a pytree, an abstract pytree, ``nnx.State``) filled from the item in
    ``directory`` through ``mapping`` (see ``load.load_tree``)."""
    options = _load.LoadOptions(
        strict=strict, where=str(directory), verify=verify, io=io, stats=stats
    )
    tree, _ = _load.load_tree(target, _sources.open_source(directory), mapping, options)
    return tree


_mappings.register_mapping(KeyMapping, _mappings.MappingHooks(export_plan, restore_item))
