"""A Hugging Face checkpoint as an Orbax checkpoint of a MaxText train state
(:func:`import_pytorch`), as MaxText's ``to_maxtext`` writes it, without holding the model on
one host: the tree the mapping implies, split over every device, filled by ``load.load_flat``
(each process reading its own shards) and saved by Orbax v1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core.errors import ConfigError, SafetensorsCheckpointError
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import load as _load
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations import presets as _presets
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.storage import replace as _replace

__all__ = ["import_pytorch"]

ITEM = "items"  # the checkpointable MaxText keeps its train state in


def import_pytorch(
    path: epath.PathLike,
    directory: epath.PathLike,
    mapping: KeyMapping | str,
    *,
    step: int = 0,
    dtype: _casting.DtypePolicy | None = None,
    scan_layers: bool | None = None,
    vocab_size: int | None = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Writes a Hugging Face checkpoint as step ``step`` of the Orbax checkpoint ``directory``
    in the layout MaxText 0.2.5's ``to_maxtext`` saves and its ``load_parameters_path``
    reads (``directory/<step>/items``): the checkpointable ``items`` holding ``{"step": step,
    **tree, "opt_state": {}}`` (``tree``: the mapping's, ``{"params": {"params": ...}}``, plus
    DeepSeek's ``MoEBiasVar``), ``custom_metadata`` ``{"scan_layers": ...}``, OCDBT and zarr3.

    Run it on every process of a ``jax.distributed`` job with the same arguments: every tensor
    is split over all devices, each process reads only the byte ranges of its own shards,
    ``batch_bytes`` at a time, and writes only them; host memory follows the batch. A failure
    leaves nothing behind (neither the step nor directories the call created).

    Args:
      path: a Hugging Face model directory (or a ``.safetensors`` file, or its index).
      directory: the checkpoint's root; its step ``step`` must not exist.
      mapping: a MaxText preset's name (``"maxtext-llama3"``..., built from ``path``'s
        ``config.json`` with ``scan_layers``, default True, and ``vocab_size``, the MaxText
        vocabulary where it pads past the config's), or a :class:`KeyMapping`.
      step: the step directory and the state's ``step``.
      dtype: a dtype policy over the tree's dotted names, as ``export_pytorch`` takes it
        (``"bfloat16"``: every floating-point tensor), applied after the transforms.
      scan_layers: recorded in ``custom_metadata`` (MaxText checks it against its config).
      vocab_size: with a preset's name, MaxText's vocabulary (the embedding gets zero rows).
      batch_bytes: tensor bytes read at a time, and the bound of Orbax's host copies.

    Returns:
      The :class:`MappingReport` of the load (``bytes_read``: this process's).

    Raises:
      SafetensorsCheckpointError: hostile or unfitting input, before anything is written (a
        key no rule maps, a config contradicting the tensors, a path outside ``path``), or
        an existing step; ImportError: an orbax-checkpoint without ``v1.training``.

    Example::

        osf.import_pytorch("/models/Qwen2.5-7B", "gs://bucket/qwen", "maxtext-qwen2")
        # MaxText: load_parameters_path=gs://bucket/qwen/0/items
    """
    v1 = _training_orbax()
    source = _sources.open_source(_load.source_path(path))
    if not isinstance(mapping, str):  # (a preset's name: resolve checks it, before building)
        _check_config(source, path)
    mapping, scan_layers = resolve(mapping, path, scan_layers, vocab_size, source=source)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")
    root = _steps.absolute(directory)  # (Orbax refuses a relative path)
    if (root / str(step)).exists():
        raise SafetensorsCheckpointError(
            f"{root / str(step)}: step {step} exists already (remove it or give another step)"
        )
    # A failure leaves nothing behind: the directories this call created
    # (storage/replace.made_parents) and what Orbax began of the step.
    # Orbax's threads still writing when a save fails are waited for before the removal.
    with (
        _replace.made_parents(root / str(step)),
        _removed_on_failure(root, step),
        _orbaxcompat.orbax_threads_joined_on_failure(),
    ):
        targets = _cast(
            _load.derived_targets(source.tensors, mapping), _casting.parse_policy(dtype)
        )
        links, _ = _load.plan_links(dict(source.tensors), targets, mapping)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
        targets = _spread(links, targets, source.tensors, mesh)
        options = _load.LoadOptions(batch_bytes=batch_bytes, where=str(path))
        values, report = _load.load_flat(source, targets, mapping, options)
        tree = _flax_tables.nested(values)
        clash = sorted({"step", "opt_state"} & set(tree))
        if clash:
            raise ValueError(f"the mapping makes {clash[0]!r}, which a train state holds itself")
        state = {"step": step, **tree, "opt_state": {}}
        metadata = None if scan_layers is None else {"scan_layers": bool(scan_layers)}
        # (Orbax refuses a device's shard as large as its bounds or larger)
        largest = max(
            (s.data.nbytes for v in values.values() for s in v.addressable_shards), default=0
        )
        context = _context(v1, max(batch_bytes, largest + 1))
        with v1.training.Checkpointer(root, context=context) as checkpointer:
            checkpointer.save_checkpointables(
                step, {ITEM: state}, custom_metadata=metadata, force=True
            )
    return report


def _spread(
    links: Sequence[_links.Link],
    targets: Mapping[str, _load.Target],
    tensors: Mapping[str, _sources.TensorInfo],
    mesh: jax.sharding.Mesh,
) -> dict[str, _load.Target]:
    """``targets`` split over every device of ``mesh`` (a one-axis mesh), each on the axis that
    has its link's PyTorch tensors read in the largest pieces: their first axis where the
    transform lets a split pull back to it (each process then reads its own rows), else a
    later one; a tensor no split pulls back through (a reshape, a split of stacked layers only)
    on its largest axis the devices divide, read whole; one they divide nowhere replicated."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    out = {n: dataclasses.replace(t, sharding=replicated) for n, t in targets.items()}
    count, name = mesh.size, mesh.axis_names[0]
    for link in links:
        wants = [out[n] for n in link.flax]
        shapes = [tensors[k].shape for k in link.torch]
        best: tuple[tuple[float, int], list[_load.Target]] | None = None
        for axis in range(len(wants[0].shape) if count > 1 else 0):
            if any(len(w.shape) <= axis or w.shape[axis] % count for w in wants):
                continue
            spec = jax.sharding.PartitionSpec(*[None] * axis, name)
            trial = [
                dataclasses.replace(w, sharding=jax.sharding.NamedSharding(mesh, spec))
                for w in wants
            ]
            reads = (
                _load.torch_shardings(link, trial, shapes)
                if _load.on_device(link.rule.transform_or_identity)
                else []
            )
            first = min((_split_axis(s) for s in reads), default=math.inf)
            rank = (first, -wants[0].shape[axis])
            if best is None or rank < best[0]:
                best = (rank, trial)
        if best is not None:
            out.update(zip(link.flax, best[1]))
    return out


def _split_axis(sharding: jax.sharding.NamedSharding) -> float:
    return next((a for a, e in enumerate(sharding.spec) if e is not None), math.inf)


def model_directory(path: epath.PathLike) -> epath.Path:
    """The directory whose ``config.json`` describes the model at ``path``: ``path`` itself,
    or the directory of a ``.safetensors`` file or index file given in its place."""
    path = epath.Path(path)
    return path if path.is_dir() else path.parent


def _check_config(source: _sources.TensorSource, path: epath.PathLike) -> None:
    # The sizes the directory's config.json claims (which the presets are built of) against
    # its tensors (config_facts.py): a forged vocab_size or layer count is refused, not
    # written into MaxText's layout.
    config = model_directory(path) / _model_files.CONFIG_FILE_NAME
    if not config.exists():
        return
    facts = ConfigFacts.of(config).validated()
    problems = facts.tensor_problems({k: tuple(t.shape) for k, t in source.tensors.items()})
    if problems:
        raise ConfigError("; ".join(problems))


@contextlib.contextmanager
def _removed_on_failure(root: epath.Path, step: int) -> Iterator[None]:
    # Step ``step`` did not exist before the call: what is there under its name when the
    # block raises is ours (the primary removes it, Orbax's temporary directory too).
    try:
        yield
    except BaseException:
        if jax.process_index() == 0 and root.exists():
            for child in root.iterdir():
                if child.name == str(step) or child.name.startswith(f"{step}{_steps.TMP_SUFFIX}"):
                    if child.is_dir():
                        child.rmtree(missing_ok=True)
                    else:
                        child.unlink(missing_ok=True)
        raise


def resolve(
    mapping: KeyMapping | str,
    path: epath.PathLike,
    scan_layers: bool | None,
    vocab_size: Any,
    *,
    source: _sources.TensorSource | None = None,
) -> tuple[KeyMapping, bool | None]:
    """The mapping and ``scan_layers`` :func:`import_pytorch` takes ``mapping`` (a MaxText
    preset's name or a :class:`KeyMapping`) and ``scan_layers`` for. A preset is built once
    ``path``'s ``config.json`` has been checked against its tensors (``source``, opened here
    where not given): the layers it lays out are the tensors', never a forged count.

    Raises:
      ValueError: a name that is no MaxText preset's; a config the tensors contradict; what
        the preset refuses of the config.
    """
    if not isinstance(mapping, str):
        return mapping, scan_layers
    if mapping not in _presets.PRESETS or not mapping.startswith("maxtext-"):
        names = ", ".join(n for n in _presets.PRESETS if n.startswith("maxtext-"))
        raise ValueError(f"mapping {mapping!r}: not a MaxText preset ({names}) nor module:attr")
    _check_config(source or _sources.open_source(_load.source_path(path)), path)
    scan_layers = True if scan_layers is None else scan_layers
    built = _presets.preset_mapping(
        mapping, hf_config=model_directory(path), scan_layers=scan_layers, vocab_size=vocab_size
    )
    return built, scan_layers


def _training_orbax() -> Any:
    v1 = _orbaxcompat.orbax_v1("osf.import_pytorch")
    if not hasattr(getattr(v1, "training", None), "Checkpointer"):
        raise ImportError(
            "osf.import_pytorch needs orbax-checkpoint's orbax.checkpoint.v1.training."
            f"Checkpointer (>= {_orbaxcompat.ORBAX_V1_TESTED}), which MaxText 0.2.5 saves with"
        )
    return v1


def _cast(targets: Mapping[str, _load.Target], policy: Any) -> dict[str, _load.Target]:
    names = list(targets)
    dtypes = _casting.resolve(
        policy,
        names,
        [t.dtype for t in targets.values()],
        [t.shape for t in targets.values()],
        [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in targets.values()],
    )
    return {
        n: t if d is None else _load.Target(t.shape, d)
        for (n, t), d in zip(targets.items(), dtypes)
    }


def _context(v1: Any, batch_bytes: int) -> Any:
    # MaxText's storage (OCDBT, zarr3). Orbax's copies of the arrays to the host and its
    # writes under way, a batch at a time each: unbounded, a save holds them all at once
    # (OCDBT keeps every write's encoded bytes until its commit).
    context = v1.Context()
    context.array.saving.use_ocdbt = True
    context.array.saving.use_zarr3 = True
    context.memory.transfer_concurrent_bytes = int(batch_bytes)
    context.memory.write_concurrent_bytes = int(batch_bytes)
    return context
