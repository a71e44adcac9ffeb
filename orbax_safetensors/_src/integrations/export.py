"""A key mapping compiled into an export plan (:func:`compile_plan`: match, link, stack or
split, check, plan) and the exports that run it through the export engine:
:func:`export_pytorch` from a model, a pytree or a checkpoint (each process reading its
share: ``export_reads``), :func:`export_plan` for ``SafetensorsSave(mapping=)`` and
:func:`restore_item` for ``SafetensorsRestore(mapping=)`` (``KeyMapping``'s protocol methods).
docs/architecture.md, "One export, followed through", says why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations import export_reads as _export_reads
from orbax_safetensors._src.integrations import fidelity as _fidelity
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import load as _load
from orbax_safetensors._src.integrations import lora as _lora
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.integrations.links import Link
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import relayout as _relayout
from orbax_safetensors._src.storage import config as _config

HEADER_METADATA = {"format": "pt"}  # what transformers and safetensors.torch write
Shape = tuple[int, ...]


@_pieces.gc_paused()  # (the caller waits: see pipeline/pieces.gc_paused)
def export_pytorch(
    source: Any,
    directory: epath.PathLike,
    mapping: KeyMapping,
    *,
    hf_config: Any = None,
    generation_config: Any = None,
    dtype: _casting.DtypePolicy | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    prefix: str = "",
    step: int | None = None,
    item: str | None = None,
    strict: bool = True,
    variables: Any = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Writes a model, a pytree or a checkpoint as a Hugging Face model directory:
    ``model.safetensors`` (or shards plus ``model.safetensors.index.json`` above
    ``max_file_size``), header ``{"format": "pt"}``, and with ``hf_config`` ``config.json``,
    ``generation_config.json`` and the tokenizer's files: what ``from_pretrained`` loads.
    Earlier model files are replaced at once, other files kept. Host memory holds about
    ``batch_bytes`` of the source and the writes under way, not the model. LoRA adapters are
    merged into their kernels; a tied key whose value differs from its source is written,
    with a ``UserWarning`` and ``tie_word_embeddings: false``. In a multi-process job every
    process calls it alike and writes only the bytes of its own shards (no gather), to a
    file system every process sees or to ``s3://`` / ``gs://``.

    Args:
      source: an ``nnx.Module``, a pytree of arrays (sharded ``jax.Array`` s too), or a path:
        a ``.safetensors`` file, a checkpoint item (ours or Orbax-native), a step or a
        CheckpointManager root (its latest step). A train state exports its ``params``.
      directory: where to write.
      mapping: the rules, as ``load_pytorch`` takes them, applied in reverse.
      hf_config: a transformers config, a dict, a ``config.json`` or a model directory.
      generation_config: a ``GenerationConfig``, a dict or a path.
      dtype: a dtype policy over the Flax names, as ``SafetensorsSave`` takes it.
      max_file_size: split into shards above this many bytes (None: one file).
      prefix: only names starting with it are exported, without it.
      step: with a CheckpointManager root, the step (default: the latest committed one).
      item: with a step of several items, the item to export.
      strict: raise if a name has no rule; with ``strict=False`` skip it and report.
      variables: with a model, the ``nnx`` filter (default ``nnx.Param``, ``nnx.BatchStat``).
      batch_bytes: source bytes held in host memory at a time.

    Returns:
      A :class:`MappingReport` (``moved``: ``(flax name, torch key)`` pairs written).

    Raises:
      TargetMismatchError: with ``strict``, every problem at once, nothing written.
      ValueError: qwix LoRA adapters and no ``KeyMapping.lora_scale``.

    Example::

        osf.export_pytorch(model, "/tmp/hf", mapping, hf_config=config, dtype=jnp.bfloat16)
    """
    report = MappingReport()
    table = _flax_tables.flax_table(
        source, prefix=prefix, variables=variables, step=step, item=item
    )
    state = set(_flax_tables.training_state(table.infos))  # (optimizer state, step counter)
    report.ignored += [n for n in table.infos if n in state]
    shapes = {n: t.shape for n, t in table.infos.items() if n not in state}
    lora = _lora.plan(shapes, mapping, report, table.lora_params)
    infos = {n: t for n, t in table.infos.items() if n in shapes and n not in lora.skip}
    plan, links = compile_plan(
        mapping,
        {n: t.shape for n, t in infos.items()},
        {n: t.dtype for n, t in infos.items()},
        {n: table.values.get(n, t) for n, t in infos.items()},
        _casting.parse_policy(dtype),
        report,
        lora=lora,
        tie_values=functools.partial(_tie_values, table, lora),
        hf_config=hf_config,
        generation_config=generation_config,
        where=f"cannot export to {directory} through this mapping",
        strict=strict,
    )
    units = _units(table, plan, links, lora, batch_bytes)
    stats = _export.write(
        directory,
        plan,
        units,
        batch_bytes=batch_bytes,
        max_file_size=max_file_size,
        host_writes=table.source is not None,  # (in memory, the primary writes host values)
    )
    report.bytes_written += stats.bytes_written
    return report


def export_plan(
    mapping: KeyMapping,
    validated: _checkpoint_save.ValidatedTree,
    dtype: _casting.DtypePolicy | None,
    hf_config: Any,
    *,
    generation_config: Any = None,
) -> _export.ExportPlan:
    """The Hugging Face tensors and files of ``validated``'s arrays through ``mapping``, as
    :func:`export_pytorch` writes them; ``dtype``: a policy over the item's dotted names.

    Raises:
      TargetMismatchError: every name that does not fit, all at once.
      ValueError: qwix LoRA adapters and no ``KeyMapping.lora_scale``.
    """
    arrays = validated.flat.arrays
    shapes = {n: tuple(int(d) for d in a.shape) for n, a in arrays.items()}
    report = MappingReport()
    lora = _lora.plan(shapes, mapping, report)
    plan, _ = compile_plan(
        mapping,
        shapes,
        {n: _dtypes.from_numpy(np.dtype(a.dtype), key=n) for n, a in arrays.items()},
        arrays,
        _casting.parse_policy(dtype),
        report,
        lora=lora,
        tie_values=lambda names: {n: _merged_value(arrays, n, lora) for n in names},
        hf_config=hf_config,
        generation_config=generation_config,
        where="SafetensorsSave(mapping=...): the item does not fit this mapping",
        show_stored=True,
    )
    return plan


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
    """``target`` (a pytree, an abstract one, ``nnx.State``) filled from the item in
    ``directory`` through ``mapping``, as ``load_pytorch`` fills a pytree."""
    options = _load.LoadOptions(
        strict=strict, where=str(directory), verify=verify, io=io, stats=stats
    )
    tree, _ = _load.load_tree(target, _sources.open_source(directory), mapping, options)
    return tree


# --------------------------------------------------------------------------- the plan


def compile_plan(
    mapping: KeyMapping,
    shapes: Mapping[str, Shape],
    held: Mapping[str, str],
    values: Mapping[str, Any],
    policy: _casting.Policy | None,
    report: MappingReport,
    *,
    lora: _lora.LoraPlan,
    tie_values: Callable[[Sequence[str]], Mapping[str, Any]],
    hf_config: Any,
    generation_config: Any,
    where: str,
    strict: bool = True,
    show_stored: bool = False,
) -> tuple[_export.ExportPlan, list[Link]]:
    """The plan of the Flax tensors of ``shapes`` (``held``: their safetensors dtypes;
    ``values``: what a callable ``policy`` sees) through ``mapping``, and the links it writes
    (see the module docstring); problems go to ``report`` (a shape mismatch names the held
    dtype, or the stored one with ``show_stored``).

    Raises:
      ConfigError: a size of ``hf_config`` that is impossible (before any tensor is read).
      TargetMismatchError: with ``strict``, ``where`` and every problem.
    """
    # 1, 2. match and link
    links, found = mapped_links(mapping, shapes, skip=lora.skip, renamed=lora.renamed)
    report.ignored += found.ignored
    report.unmapped += found.unmapped
    report.mismatched += found.mismatched
    # 3. stack or split: each link's PyTorch shapes in the stored dtypes, and whether it maps
    # a Flax shard on its own
    names = list(shapes)
    numpy_dtypes = {n: _dtypes.to_numpy(held[n]) for n in names}
    casts = _casting.resolve(
        policy, names, list(numpy_dtypes.values()), [shapes[n] for n in names],
        [values.get(n) for n in names],
    )  # fmt: skip
    stored = {
        n: held[n] if c is None else _dtypes.from_numpy(c, key=n) for n, c in zip(names, casts)
    }
    shown = stored if show_stored else held
    taken: dict[str, str] = {}
    shaped: list[tuple[Link, list[Shape], bool]] = []
    for link in links:
        first = link.flax[0]
        clash = [k for k in link.torch if k in taken]
        if clash:
            report.mismatched += [f"{first} and {taken[k]} both map to {k}" for k in clash]
            continue
        taken.update(dict.fromkeys(link.torch, first))
        flax_shapes = [shapes[n] for n in link.flax]
        try:
            torch_shapes = link.torch_shapes(flax_shapes, numpy_dtypes[first])
            shaped.append((link, torch_shapes, _links.commutes(link, flax_shapes)))
        except ValueError as e:
            described = f"{first} {shown[first]}{list(shapes[first])}"
            report.mismatched.append(f"{described} -> {link.torch[0]}: {e}")
    # 4. check: the config's sizes (before a tied tensor is read), the ties, what is written
    facts = None if hf_config is None else ConfigFacts.of(hf_config).validated()
    untied = _fidelity.tie_differences(mapping, links, tie_values) if mapping.tied else {}
    tied = {key: to for key, to in mapping.tied if key not in untied}  # (the ties kept)
    specs: list[_plan.TensorSpec] = []
    kept: list[Link] = []
    commuting: set[int] = set()
    for link, torch_shapes, commutes in shaped:
        written = [(k, s) for k, s in zip(link.torch, torch_shapes) if k not in tied]
        if not written:
            report.ignored += list(link.flax)
            continue
        specs += [_plan.TensorSpec(k, stored[link.flax[0]], s) for k, s in written]
        kept.append(link)
        if commutes:
            commuting.add(id(link))
    report.untied += list(untied)
    sizes = {s.name: tuple(s.shape) for s in specs}
    if facts is not None:
        report.mismatched += facts.tensor_problems(sizes)
    report.mismatched += _fidelity.fused_config_problems(
        kept, sizes, shapes, numpy_dtypes.__getitem__, facts
    )
    if strict and not report.ok:
        raise TargetMismatchError(f"{where}:\n" + report.problems())
    _fidelity.warn_untied(untied, with_config=hf_config is not None)
    # 5. plan
    report.moved += [(n, k) for link in kept for k in link.torch if k in sizes for n in link.flax]
    groups = [_group(link, sizes, lora, shapes, id(link) in commuting) for link in kept]
    files = _model_files.model_files(
        hf_config,
        [s.dtype for s in specs],
        cast=policy is not None,
        generation_config=generation_config,
        untie=bool(untied),
    )
    summary = f"KeyMapping: {len(shapes)} tensors -> {len(specs)} Hugging Face tensors"
    plan = _export.ExportPlan(tuple(specs), tuple(groups), HEADER_METADATA, files, summary)
    return plan, kept


def mapped_links(
    mapping: KeyMapping,
    shapes: Mapping[str, Shape],
    *,
    skip: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> tuple[list[Link], MappingReport]:
    """``links.find_links`` over the Flax tensors of ``shapes`` but ``skip``, each matched
    by the name ``renamed`` gives it (a module a LoRA wrapper wraps: ``lora.LoraPlan``); the
    links and the report name them as ``shapes`` does."""
    renamed = renamed or {}
    named: dict[str, Shape] = {}
    original: dict[str, str] = {}
    clashes = []
    for n, shape in shapes.items():
        if n in skip:
            continue
        seen = renamed.get(n, n)
        if seen in original:
            clashes.append(f"{original[seen]} and {n} are both exported as {seen}")
            continue
        named[seen], original[seen] = shape, n
    links, found = _links.find_links(mapping, named, flax_side=True)
    back = [dataclasses.replace(link, flax=tuple(original[n] for n in link.flax)) for link in links]
    found.ignored = [original.get(n, n) for n in found.ignored]
    found.unmapped = [original.get(n, n) for n in found.unmapped]
    found.mismatched += clashes
    return back, found


@dataclasses.dataclass(frozen=True)
class _Output:
    # Output ``j`` of ``link`` with jax.numpy: hashable, so that the links of one layout
    # (anonymous: pipeline/relayout.compiled) share one compiled re-layout.
    link: Link
    j: int

    def __call__(self, arrays: list[Any]) -> Any:
        return _links.device_value(self.link, arrays, self.j)


def _group(
    link: Link,
    written: Mapping[str, Shape],
    lora: _lora.LoraPlan | None,
    shapes: Mapping[str, Shape] | None,
    commutes: bool = False,
) -> _export.ExportGroup:
    """``link`` as a group writing its keys of ``written`` (``{key: shape}``; the others are
    tied), its kernels merged with their LoRA adapters (``lora``); with the Flax ``shapes``,
    also on the devices, and one shard at a time where it ``commutes``."""
    merges = dict(lora.merges) if lora is not None else {}
    scale = lora.scale if lora is not None else 1.0
    adapters = tuple(n for name in link.flax if name in merges for n in merges[name])
    flax_shapes = None if shapes is None else [tuple(shapes[n]) for n in link.flax]
    out = _LinkOutputs(link, written, merges, scale, (*link.flax, *adapters), flax_shapes)
    on_devices = None if flax_shapes is None else out.on_devices
    per_shard = out.per_shard if commutes and flax_shapes is not None else None
    return _export.ExportGroup(out.sources, out.outputs, out.apply, adapters, per_shard, on_devices)


@dataclasses.dataclass(frozen=True)
class _LinkOutputs:
    # How one link computes the PyTorch tensors it writes: on the host (apply), one Flax
    # shard at a time (per_shard) or on the devices (on_devices), each kernel merged first
    # with its LoRA adapters (merges: {kernel: (lora_a, lora_b)}).
    link: Link
    written: Mapping[str, Shape]
    merges: Mapping[str, tuple[str, str]]
    scale: float
    sources: tuple[str, ...]
    flax_shapes: list[Shape] | None

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(k for k in self.link.torch if k in self.written)

    def _flax(self, arrays: Sequence[Any], adapter: Mapping[str, Any], merge: Any) -> list[Any]:
        got = dict(zip(self.sources, arrays))
        return [
            merge(got[n], adapter[self.merges[n][0]], adapter[self.merges[n][1]], self.scale)
            if n in self.merges
            else got[n]
            for n in self.link.flax
        ]

    def apply(self, arrays: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
        # One output at a time (a stacked source's slices are views).
        values = self._flax(arrays, dict(zip(self.sources, arrays)), _lora.merge_lora)
        del arrays
        for j, key in enumerate(self.link.torch):
            if key in self.written:
                yield self.link.value(values, j, to_torch=True)

    def per_shard(
        self, k: int, box: Any, data: np.ndarray, wholes: Mapping[str, Any] | None, cast: Any
    ) -> list[tuple[str, Any, Any]]:
        # (a kernel shard merged with the rows and columns of the whole adapters its box
        # needs: bit-identical to that block of the whole merge)
        link, shapes = self.link, self.flax_shapes
        assert shapes is not None
        if wholes is not None and link.flax[k] in self.merges:
            a, b = self.merges[link.flax[k]]
            data = _lora.merge_lora_block(data, box, wholes[a], wholes[b], self.scale, shapes[k])
        if cast is not None and data.dtype != cast:
            data = _casting.astype(data, cast)
        pieces = _links.shard_boxes(link, k, box, data, shapes)
        return [(link.torch[j], b, v) for j, b, v in pieces if link.torch[j] in self.written]

    def on_devices(
        self, arrays: Sequence[Any], wholes: Mapping[str, Any], dtype: Any, band_bytes: Any
    ) -> Iterator[tuple[str, int, Any]]:
        link = self.link
        values = self._flax(arrays, wholes, _merged)
        for key in self.outputs:
            j = link.torch.index(key)
            slot = _slot(link, values, j)
            fn = _Output(link.anonymous(), j)
            rows = _relayout.relaid_rows(fn, values, self.written[key], dtype, band_bytes, slot)
            try:
                yield from ((key, start, value) for start, value in rows)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{', '.join(link.flax)} -> {key}: the rule's transform "
                    f"{link.rule.transform!r} does not run on sharded jax.Arrays ({e}); "
                    "use Transpose, Reshape, SplitHeads or Chain of them"
                ) from e


def _slot(link: Link, arrays: Sequence[Any], j: int) -> _relayout.Slot | None:
    # Where one slot of the link's one Flax tensor makes PyTorch tensor ``j`` alone: every
    # slot then shares one compiled re-layout (a whole re-layout compiles one per slot).
    if len(arrays) != 1 or not link.torch_gather.trivial or link.flax_gather.fused is not None:
        return None
    shape = tuple(int(d) for d in arrays[0].shape)
    stacked = tuple(link.flax_gather.stack_axes(len(shape)))
    box = [slice(0, d) for d in shape]
    for axis, i in zip(stacked, link.flax_gather.slots[j]):
        box[axis] = slice(i, i + 1)
    one = Link(link.rule, link.flax, (link.torch[j],), tuple((n, 1) for n, _ in link.counts))
    rows = _links.row_axis(link, [shape]) if _links.commutes(link, [shape]) else None
    return _relayout.Slot(_Output(one.anonymous(), 0), tuple(box), stacked, rows)


# --------------------------------------------------------------------------- LoRA values


def _merged(kernel: Any, a: np.ndarray, b: np.ndarray, scale: float) -> Any:
    # ``lora.merge_lora`` with the kernel's sharding: a kernel sharded over processes is
    # merged shard by shard on the host (bit-identical to the whole merge) and put back.
    if not _export.is_global(kernel):
        return _lora.merge_lora(np.asarray(kernel), a, b, scale)
    blocks = []
    for shard in kernel.addressable_shards:
        box = _runs.normalize_index(shard.index, kernel.shape)
        block = _lora.merge_lora_block(np.asarray(shard.data), box, a, b, scale, kernel.shape)
        blocks.append(jax.device_put(block, shard.device))
    return jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, blocks)


def _merged_value(values: Mapping[str, Any], name: str, lora: _lora.LoraPlan) -> Any:
    # values[name], merged with its adapters (a collective when they are sharded over
    # processes: every process calls it alike)
    if name not in lora.merges:
        return values[name]
    a, b = (_export.gathered(values[n]) for n in lora.merges[name])
    return _merged(values[name], a, b, lora.scale)


def _tie_values(
    table: _flax_tables.FlaxTable, lora: _lora.LoraPlan, names: Sequence[str]
) -> Mapping[str, Any]:
    # The Flax tensors ``names`` as the export writes them, LoRA merged (in memory: the
    # arrays as they are, sharded too)
    if table.source is None:
        return {n: _merged_value(table.values, n, lora) for n in names}
    got = table.read([*names, *(a for n in names if n in lora.merges for a in lora.merges[n])])
    return {n: _merged_value(got, n, lora) for n in names}


# --------------------------------------------------------------------------- what is read


def _units(
    table: _flax_tables.FlaxTable,
    plan: _export.ExportPlan,
    links: Sequence[Link],
    lora: _lora.LoraPlan,
    batch_bytes: int,
) -> list[_export.Unit]:
    """The engine's units of ``links`` (``plan``'s groups) as this process reads them:
    batches of half ``batch_bytes`` of Flax tensors, a band of a stacked link at a time, the
    LoRA adapters beside their kernel."""
    me, processes = jax.process_index(), jax.process_count()
    budget = max(1, batch_bytes // 2)
    reads = _export_reads.table_reads(
        table, links, processes=processes, whole=lora.merges, budget=budget
    )
    owners = dict(reads.owners)  # (an adapter is read by its kernel's reader)
    for kernel, pair in lora.merges.items():
        if kernel in owners:
            owners.update(dict.fromkeys(pair, owners[kernel]))
    reads = dataclasses.replace(reads, owners=owners)
    by_link = {id(link): group for link, group in zip(links, plan.groups)}
    sizes = {s.name: tuple(s.shape) for s in plan.outputs}

    def group_of(link: Link) -> _export.ExportGroup:  # (a band's: computed on the host)
        return by_link.get(id(link)) or _group(link, sizes, None, None)

    def read(names: tuple[str, ...], boxes: Any) -> dict[str, Any]:
        adapters = [a for n in names if n in lora.merges for a in lora.merges[n]]
        return _export_reads.read(table, reads, me, processes == 1, [*names, *adapters], boxes)

    held = _export_reads.held(table, reads, me)
    return _export_reads.read_units(links, table.infos, reads, me, budget, held, group_of, read)
