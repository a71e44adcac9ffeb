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
import functools
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations import fidelity as _fidelity
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import lora as _lora
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations import sharded_export as _sharded_export
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

__all__ = ["export_pytorch"]


# --------------------------------------------------------------------------- export


def _merged_lora(table: _flax_tables.FlaxTable, found: _lora.LoraPlan) -> _flax_tables.FlaxTable:
    """``table`` with LoRA adapters folded into their kernels (see ``integrations/lora.py``):
    the adapters (and what the export refused) left out, each kernel read merged."""
    if not found.skip:
        return table
    merges = found.merges
    infos = {n: t for n, t in table.infos.items() if n not in found.skip}
    read = table.read

    def read_merged(names: Sequence[str]) -> dict[str, np.ndarray]:
        wanted = list(names) + [n for k in names if k in merges for n in merges[k]]
        got = read(wanted)
        out = {}
        for n in names:
            if n in merges:
                a, b = merges[n]
                out[n] = _lora.merge_lora(got[n], got[a], got[b], found.scale)
            else:
                out[n] = got[n]
        return out

    return dataclasses.replace(table, infos=infos, read=read_merged)


def _without_training_state(
    table: _flax_tables.FlaxTable, report: MappingReport
) -> _flax_tables.FlaxTable:
    """``table`` without a train state's optimizer state and step counter
    (``flax_tables.training_state``), which go to ``report.ignored``."""
    left_out = _flax_tables.training_state(table.infos)
    if not left_out:
        return table
    report.ignored += left_out
    gone = set(left_out)
    return dataclasses.replace(table, infos={n: t for n, t in table.infos.items() if n not in gone})


@_gcpause.paused  # (the caller waits: see pipeline/gcpause.py)
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
    """Writes a model, a pytree or a checkpoint as a Hugging Face model directory.

    The directory gets ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` above ``max_file_size``), with header metadata
    ``{"format": "pt"}``, and with ``hf_config`` the small files of a model directory
    (``config.json`` as ``save_pretrained`` writes it, ``generation_config.json``, and the
    tokenizer's files of an ``hf_config`` directory: ``integrations/model_files.py``): what
    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads (and
    ``safetensors.torch.load_file``, ``huggingface_hub.load_torch_model``). Other files in the
    directory are kept; earlier ``model*.safetensors`` files and index are replaced, and every
    file appears at once (written beside the directory and swapped in). Tensors
    are read half a batch at a time, the next half read while one is transformed (on up to 4
    threads) and written: host memory holds about a batch and the writes under way, not the
    model (a stacked tensor of an Orbax-native item a band of layers at a time where its
    stored chunks allow it: ``integrations/export_reads.py``; a tensor larger than half a
    batch that its chunks do not cut is read alone). LoRA adapters are merged into their kernels (``integrations/lora.py``: flax's
    ``nnx.LoRALinear`` and ``nnx.LoRA``, qwix's, as Tunix applies them; scaled by
    ``KeyMapping.lora_scale``). Tied keys (``KeyMapping.tied``) are not written, unless the
    model's value differs from the key it is tied to (a head fine-tuned apart from its
    embedding): then it is written (``report.untied``), ``config.json`` gets
    ``tie_word_embeddings: false``, and a ``UserWarning`` names the key and its largest
    difference, so that the files compute what the model does.

    In a multi-process JAX job every process calls it with the same arguments and writes only
    the bytes of the shards it owns (``integrations/sharded_export.py``): no gather, the same
    bytes as a one-process export; ``directory`` must be on a file system every process sees,
    or on ``s3://`` or ``gs://`` (each process uploads its own bytes; the index and the
    small files are written once every file is complete).

    A train state exports its parameters: when the source's top level holds ``params``
    (MaxText's ``{"step", "params", "opt_state"}``, a Flax ``TrainState``), everything under
    ``opt_state`` and an integer ``step`` are left out and listed in ``report.ignored``;
    anything else goes through the mapping (``flax_tables.training_state``).

    Args:
      source: an ``nnx.Module``; any pytree of arrays (dicts, Linen params, ``nnx.State``,
        ``TrainState.params``, sharded ``jax.Array`` s) named by its dotted key paths; or a
        path: a ``.safetensors`` file, a checkpoint item, an Orbax-native item (v0
        ``StandardSave`` / ``PyTreeSave``, or a v1 checkpointable such as MaxText's
        ``<step>/items``), a step directory or a CheckpointManager root (its latest
        committed step). In a multi-process job each process reads only its share of a
        checkpoint (``integrations/export_reads.py``).
      directory: where to write.
      mapping: the same mapping :func:`load_pytorch` uses, applied in reverse.
      hf_config: a transformers config object (``LlamaConfig(...)``: its non-default keys,
        as ``save_pretrained`` writes them), a dict (as given), or a path: a ``config.json``,
        or a model directory whose ``config.json``, ``generation_config.json`` and tokenizer
        files are copied. ``config.json``'s ``dtype`` is set to the stored floating-point
        dtype when unset or when ``dtype`` changes what is stored, its ``architectures`` to
        the causal-LM class of its ``model_type`` when unset.
      generation_config: written as ``generation_config.json``: a transformers
        ``GenerationConfig``, a dict, or a path (the file or its directory). Default: the
        ``hf_config`` directory's, else, with transformers installed, the one
        ``save_pretrained`` writes for the model config (``from_model_config``).
      dtype: a dtype policy over the Flax-side dotted names, as ``SafetensorsSave`` takes: one
        dtype (every floating-point tensor), ``{glob: dtype, None or "keep"}`` (first match
        wins) or a callable ``(name, value) -> dtype | None``. Default: keep.
      max_file_size: split into shards above this many bytes (None: one file).
      prefix: only names starting with it are exported, without it (e.g. ``"model."`` for a
        ``{"model": ..., "optimizer": ...}`` checkpoint or pytree).
      step: with a CheckpointManager root, the step (default: the latest committed one).
      item: with a step (or root) of several items, the item to export.
      strict: raise if a Flax name has no rule; with ``strict=False`` skip it and report.
      variables: with a model, the ``nnx`` filter of variables to export (default
        ``(nnx.Param, nnx.BatchStat)``).
      batch_bytes: tensor bytes of the source held in host memory at a time (two halves),
        and the bound of the writes under way (half of it, at most 64 MiB) and of a
        re-layout on the devices (a quarter of it per process).

    Returns:
      A :class:`MappingReport` (``moved`` pairs are ``(flax name, torch key)``).

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once (nothing written):
        names no rule maps, shapes that do not fit, a fused split that does not fit
        ``hf_config``'s heads, LoRA adapters ``ignore_flax`` would drop.
      ValueError: qwix LoRA adapters and no ``KeyMapping.lora_scale``.

    Example::

        osf.export_pytorch(model, "/tmp/hf", mapping, hf_config=config, dtype=jnp.bfloat16)
        transformers.AutoModelForCausalLM.from_pretrained("/tmp/hf")
    """
    import jax

    directory = epath.Path(directory)
    policy = _casting.parse_policy(dtype)
    report = MappingReport()
    table = _flax_tables.flax_table(
        source, prefix=prefix, variables=variables, step=step, item=item
    )
    table = _without_training_state(table, report)
    found = _lora.plan(
        {n: t.shape for n, t in table.infos.items()}, mapping, report, table.lora_params
    )
    lora = _sharded_export.Lora(found.merges, found.scale)
    table = _merged_lora(table, found)
    infos = table.infos

    def tie_values(names: Sequence[str]) -> Mapping[str, Any]:
        # (in memory: the arrays as they are, sharded too, a kernel merged with its adapters)
        if table.source is not None:
            return table.read(names)
        return {n: _sharded_export.merged_value(table.values, n, lora) for n in names}

    planned = plan_export(
        mapping,
        {n: t.shape for n, t in infos.items()},
        {n: t.dtype for n, t in infos.items()},
        {n: table.values.get(n, t) for n, t in infos.items()},
        policy,
        report,
        lora=found,
        tie_values=tie_values,
        hf_config=hf_config,
    )
    if strict and not report.ok:
        raise TargetMismatchError(
            f"cannot export to {directory} through this mapping:\n" + report.problems()
        )
    _fidelity.warn_untied(planned.untied, with_config=hf_config is not None)
    specs = planned.specs
    plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata={"format": "pt"})
    extra: dict[str, str | bytes] = {}
    if len(plan.files) > 1:
        extra[_plan.INDEX_FILE_NAME] = json.dumps(plan.index_json(), indent=2)
    extra.update(
        _model_files.model_files(
            hf_config,
            [s.dtype for s in specs],
            cast=policy is not None,
            generation_config=generation_config,
            untie=bool(planned.untied),
        )
    )
    job = _sharded_export.ExportJob(plan, planned.links, table, dict(planned.mapping.tied))
    if jax.process_count() > 1:  # every process writes its own bytes (sharded_export)
        stats = _sharded_export.write_processes(
            directory, job, report, extra, lora=lora, batch_bytes=batch_bytes
        )
        report.bytes_written = stats.bytes_written
        return report
    # Earlier model files and index are replaced whole, other files kept (storage/replace.py).
    with _replace.replacing_directory(directory) as out:
        _write(out, job, report, batch_bytes, lora.merges)
        _checkpoint_save.write_small_files(out, extra)
    return report


@dataclasses.dataclass(frozen=True)
class PlannedExport:
    """What :func:`plan_export` plans: the PyTorch tensors written (``specs``), the ``links``
    computing them, the ``mapping`` applied (the given one, without the ties of ``untied``)
    and ``untied``: tied keys written all the same (see ``fidelity.tie_differences``)."""

    specs: list[_plan.TensorSpec]
    links: list[_links.Link]
    mapping: KeyMapping
    untied: dict[str, tuple[str, float]]


def plan_export(
    mapping: KeyMapping,
    shapes: Mapping[str, tuple[int, ...]],
    held: Mapping[str, str],
    values: Mapping[str, Any],
    policy: _casting.Policy | None,
    report: MappingReport,
    *,
    lora: _lora.LoraPlan,
    tie_values: Callable[[Sequence[str]], Mapping[str, Any]],
    hf_config: Any,
    show_stored: bool = False,
) -> PlannedExport:
    """:func:`plan_tensors` with what keeps an export computing what the model computes
    (``integrations/fidelity.py``): a tied key whose value differs from the key it is tied
    to (``tie_values(names)``: the Flax tensors, LoRA merged) is written
    (``report.untied``), and the sizes ``hf_config`` claims of the planned tensors that they
    contradict (``config_facts.ConfigFacts.tensor_problems``: the config.json written with
    them) and fused splits that do not fit its heads go to ``report.mismatched``; ``lora``:
    the merges (``lora.plan``).

    Raises:
      ConfigError: a size of ``hf_config`` that is impossible (before any tensor is read).

    Example::

        planned = plan_export(mapping, shapes, held, {}, None, report, lora=found,
                              tie_values=table.read, hf_config=config)
    """
    # The config's sizes are checked before a tied tensor is read (ConfigError), and against
    # the tensors the plan writes (what its config.json will claim of them) below.
    facts = None if hf_config is None else ConfigFacts.of(hf_config).validated()
    untied: dict[str, tuple[str, float]] = {}
    if mapping.tied:
        links, _ = mapped_links(mapping, shapes, skip=lora.skip, renamed=lora.renamed)
        untied = _fidelity.tie_differences(mapping, links, tie_values)
    applied = _fidelity.untied(mapping, list(untied))
    specs, links = plan_tensors(
        applied,
        shapes,
        held,
        values,
        policy,
        report,
        skip=lora.skip,
        renamed=lora.renamed,
        show_stored=show_stored,
    )
    report.untied += list(untied)
    written = {s.name: tuple(s.shape) for s in specs}
    if facts is not None:
        report.mismatched += facts.tensor_problems(written)
    report.mismatched += _fidelity.fused_config_problems(
        links, written, shapes, lambda n: _dtypes.to_numpy(held[n]), facts
    )
    return PlannedExport(specs, links, applied, untied)


def mapped_links(
    mapping: KeyMapping,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    skip: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> tuple[list[_links.Link], MappingReport]:
    """``links.export_links`` over the Flax tensors of ``shapes`` but ``skip``, each matched
    by the name ``renamed`` gives it (a module a LoRA wrapper wraps: ``lora.LoraPlan``); the
    links and the report name them as ``shapes`` does."""
    renamed = renamed or {}
    named: dict[str, tuple[int, ...]] = {}
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
    links, found = _links.export_links(mapping, named)
    back = [dataclasses.replace(link, flax=tuple(original[n] for n in link.flax)) for link in links]
    found.ignored = [original.get(n, n) for n in found.ignored]
    found.unmapped = [original.get(n, n) for n in found.unmapped]
    found.mismatched += clashes
    return back, found


def plan_tensors(
    mapping: KeyMapping,
    shapes: Mapping[str, tuple[int, ...]],
    held: Mapping[str, str],
    values: Mapping[str, Any],
    policy: _casting.Policy | None,
    report: MappingReport,
    *,
    skip: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
    show_stored: bool = False,
) -> tuple[list[_plan.TensorSpec], list[_links.Link]]:
    """The PyTorch tensors an export writes, and the links that compute them, planned from
    the Flax names' ``shapes``, ``held`` safetensors dtypes and ``values`` (for ``policy``);
    names in ``skip`` (merged LoRA adapters) are cast but not mapped, names in ``renamed``
    mapped by their new name. Problems go to ``report`` (a mismatch names the held dtype,
    or the stored one with ``show_stored``).

    Example::

        specs, links = plan_tensors(mapping, {"w": (2, 3)}, {"w": "F32"}, {}, None, report)
    """
    links, found = mapped_links(mapping, shapes, skip=skip, renamed=renamed)
    report.ignored += found.ignored
    report.unmapped += found.unmapped
    report.mismatched += found.mismatched
    names = list(shapes)
    numpy_dtypes = {n: _dtypes.to_numpy(held[n]) for n in names}
    casts = _casting.resolve(
        policy,
        names,
        [numpy_dtypes[n] for n in names],
        [shapes[n] for n in names],
        [values.get(n) for n in names],
    )
    stored = {
        n: held[n] if c is None else _dtypes.from_numpy(c, key=n) for n, c in zip(names, casts)
    }
    shown = stored if show_stored else held
    tied = dict(mapping.tied)
    taken: dict[str, str] = {}
    specs: list[_plan.TensorSpec] = []
    kept_links: list[_links.Link] = []
    for link in links:
        first = link.flax[0]
        described = f"{first} {shown[first]}{list(shapes[first])}"
        clash = [k for k in link.torch if k in taken]
        if clash:
            report.mismatched += [f"{first} and {taken[k]} both map to {k}" for k in clash]
            continue
        taken.update(dict.fromkeys(link.torch, first))
        try:
            torch_shapes = link.torch_shapes([shapes[n] for n in link.flax], numpy_dtypes[first])
        except ValueError as e:
            report.mismatched.append(f"{described} -> {link.torch[0]}: {e}")
            continue
        kept = [(k, s) for k, s in zip(link.torch, torch_shapes) if k not in tied]
        if not kept:
            report.ignored += list(link.flax)
            continue
        specs += [_plan.TensorSpec(k, stored[first], s) for k, s in kept]
        kept_links.append(link)
    return specs, kept_links


def _write(
    directory: epath.Path,
    job: _sharded_export.ExportJob,
    report: MappingReport,
    batch_bytes: int,
    whole: Collection[str] = (),
) -> None:
    """Writes the files of ``job.plan``: each tensor becomes pieces at its file offsets
    (``pipeline/pieces``), cast to its planned dtype and laid out C-contiguous there, and is
    written by the checkpoint writer's threads (``checkpoint_save.write_process_share``) while
    the next is computed, as the next batch of the source is read (a stacked link of an
    Orbax-native item a band of slots at a time; not the kernels of ``whole``, which LoRA
    adapters merge into). Into a local directory, large tensors are cast band by band into
    buffers reused once written (``band_piece``)."""
    lent, in_flight = None, None
    if _router.is_local(directory):  # (other writers keep the pieces until the file is closed)
        # Bands of at most a share of the writes under way (sharded_export.in_flight), a few
        # of them written at once: enough to keep a local device busy, and every buffer
        # reused band after band (BANDS_IN_FLIGHT).
        writes = _sharded_export.in_flight(batch_bytes)
        band = max(1, min(_pieces.BAND_BYTES, writes // _pieces.BANDS_IN_FLIGHT))
        in_flight = band * _pieces.BANDS_IN_FLIGHT
        idle = _pieces.BANDS_IN_FLIGHT + _pieces.TRANSFORM_THREADS + 2
        lent = _buffers.LentBuffers(band, max_idle=idle)
    stats = _sharded_export.write_pieces(
        job.plan,
        _host_pieces(job, batch_bytes, lent, whole),
        directory,
        batch_bytes,
        primary=True,
        lent=lent,
        max_in_flight=in_flight,
    )
    report.bytes_written += stats.bytes_written
    report.moved += job.moved()


def _host_pieces(
    job: _sharded_export.ExportJob,
    batch_bytes: int,
    lent: _buffers.LentBuffers | None,
    whole: Collection[str],
) -> Iterator[tuple[int, list[_interface.Piece]]]:
    # Batches of links, each batch's source tensors read (one batch ahead, on a reading
    # thread, while both fit in ``batch_bytes``) while the one before is transformed and
    # written: host memory holds two half-size batches of the source and the writes under
    # way (sharded_export.in_flight; plus one band or tensor per transform thread and the
    # writer's part-filled 8 MiB batch). A stacked link of an Orbax-native item larger than
    # half a batch is read a band of slots at a time (sharded_export.host_reads).
    table, tied, plan = job.table, job.tied, job.plan
    reads = _sharded_export.host_reads(job, batch_bytes, whole)
    units = _sharded_export.host_units(job, reads, batch_bytes)
    read = functools.partial(_sharded_export.read_unit, table, reads, 0)
    sizes = [u.nbytes for u in units]
    values_of = _sharded_export.read_ahead(read, units, sizes, batch_bytes)

    def tasks() -> Iterator[Any]:
        for i, unit in enumerate(units):
            if i and sizes[i - 1] + sizes[i] > batch_bytes:
                # (not read ahead: every cast of the unit before is done before this one is
                # read, so that the arrays they view are freed first)
                yield _pieces.DRAIN
            arrays = next(values_of)
            for link in unit.links:
                yield from link_tasks(link, [arrays.pop(n) for n in link.flax])

    def link_tasks(link: _links.Link, flax: list[Any]) -> Iterator[Any]:
        for j, key in enumerate(link.torch):  # one PyTorch tensor at a time
            if key in tied:
                continue
            value = np.asarray(link.value(flax, j, to_torch=True))
            if lent is None or not _pieces.cast_in_bands(plan, key, value):
                yield key, value, None
                continue
            itemsize = _dtypes.to_numpy(plan.locate(key)[1].dtype).itemsize
            for rows in _pieces.band_rows(value.shape, itemsize, lent.capacity):
                yield key, value, rows

    def pieces(task: tuple[str, np.ndarray, tuple[int, int] | None]) -> _pieces.FilePieces:
        key, value, rows = task
        if rows is None or lent is None:
            return _pieces.tensor_pieces(plan, key, [(None, value)])
        return _pieces.band_piece(plan, key, value, rows, lent)

    yield from _pieces.ordered_map(pieces, tasks())  # (cast on several cores at once)
