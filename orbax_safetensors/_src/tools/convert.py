"""Converting between Orbax-native checkpoints and safetensors checkpoints, both ways, for an
item, a step or a CheckpointManager root; and legacy Flax msgpack files to safetensors.

- Orbax-native -> safetensors: ``from_orbax`` (streamed a batch at a time; an ``nnx.State``
  gets ``nnx.state(model)``'s names, see ``nnx_values``);
- safetensors -> Orbax-native: ``to_orbax`` (restored whole, saved by Orbax; NNX Variables as
  Orbax stores them, recorded so a round trip is the identity);
- legacy Flax msgpack -> safetensors: ``from_msgpack``.

Steps convert every tensor item (other items, such as JSON, are copied) and name the new
handlers in ``_CHECKPOINT_METADATA``; roots convert every step. Output appears atomically: it
is written under a temporary sibling name and renamed when complete (``convert_output``).

Example::

    convert("/old/orbax/100", "/new/safetensors/100")     # a step, Orbax -> safetensors
    convert("/new/safetensors/100/default", "/back/default")   # and back
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from orbax_safetensors._src.catalog import completeness as _completeness
from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.tools import from_orbax as _from_orbax
from orbax_safetensors._src.tools import to_orbax as _to_orbax
from orbax_safetensors._src.tools.convert_output import TO_ORBAX as _TO_ORBAX
from orbax_safetensors._src.tools.convert_output import TO_SAFETENSORS as _TO_SAFETENSORS
from orbax_safetensors._src.tools.convert_output import ConvertSummary, Direction, atomic, copy_tree
from orbax_safetensors._src.tools.from_msgpack import flax_msgpack_to_safetensors
from orbax_safetensors._src.tools.from_orbax import orbax_item_to_safetensors
from orbax_safetensors._src.tools.to_orbax import safetensors_item_to_orbax

__all__ = [
    "ConvertSummary",
    "convert",
    "flax_msgpack_to_safetensors",
    "orbax_item_to_safetensors",
    "safetensors_item_to_orbax",
]


# --------------------------------------------------------------------------- steps and roots


def _direction_of(path: epath.Path, kind: PathKind) -> Direction:
    if kind is PathKind.ORBAX:
        return _TO_SAFETENSORS
    if kind in (PathKind.ITEM, PathKind.FILE, PathKind.SAFETENSORS_DIR):
        return _TO_ORBAX
    if kind is PathKind.STEP:
        kinds = set(_steps.list_items(path).values())
        if PathKind.ORBAX in kinds:
            return _TO_SAFETENSORS
        if kinds & {PathKind.ITEM, PathKind.SAFETENSORS_DIR}:
            return _TO_ORBAX
        raise _steps.not_a_checkpoint(path)
    if kind is PathKind.ROOT:
        steps = _steps.list_steps(path)
        if not steps:
            raise SafetensorsCheckpointError(
                f"{path}: a CheckpointManager root with no committed step"
            )
        step = steps[-1][1]
        return _direction_of(step, _steps.classify(step))
    raise _steps.not_a_checkpoint(path)


def _refuse_incomplete_steps(src: epath.Path, kind: PathKind) -> None:
    """Refuses a root with a committed step, or a step, that lacks what restoring it needs: a
    conversion would carry it on as a complete checkpoint."""
    if kind is PathKind.ROOT:
        for step in _steps.scan_steps(src):
            if step.committed:
                _completeness.require_complete(step)
    elif (entry := _steps.step_entry(src)) is not None and entry.committed:
        _completeness.require_complete(entry)


def _convert_step(
    src: epath.Path,
    dst: epath.Path,
    direction: Direction,
    options: dict[str, Any],
    wrap_values: bool | None = None,
) -> ConvertSummary:
    summary = ConvertSummary(direction)
    dst.mkdir(parents=True, exist_ok=True)
    source_kind = PathKind.ORBAX if direction == _TO_SAFETENSORS else None
    handlers: dict[str, str] = {}
    for name, kind in _steps.list_items(src).items():
        converts = (
            kind == source_kind
            if source_kind
            else kind in (PathKind.ITEM, PathKind.SAFETENSORS_DIR)
        )
        if not converts:
            copy_tree(src, name, dst / name)
            summary.copied.append(name)
            continue
        if direction == _TO_SAFETENSORS:
            item_summary = _from_orbax.write_item(src / name, dst / name, **options)
            handlers[name] = _to_orbax.item_handler_typestr(direction)
        else:
            item_summary, handlers[name] = _to_orbax.write_item(
                src / name,
                dst / name,
                options.get("progress"),
                wrap_values,
                options.get("select"),
            )
        summary.items.append(name)
        summary.tensors += item_summary.tensors
        summary.bytes += item_summary.bytes
    for entry in src.iterdir():
        if not entry.is_dir() and entry.name != _steps.CHECKPOINT_METADATA_FILE:
            copy_tree(src, entry.name, dst / entry.name)
    _write_step_metadata(src, dst, handlers)
    return summary


def _write_step_metadata(src: epath.Path, dst: epath.Path, handlers: dict[str, str]) -> None:
    path = _confine.inside(src, _steps.CHECKPOINT_METADATA_FILE)
    if not path.exists():
        return
    doc = json.loads(_confine.read_file(path))
    item_handlers = doc.get("item_handlers")
    if isinstance(item_handlers, dict):
        item_handlers.update(handlers)
    (dst / _steps.CHECKPOINT_METADATA_FILE).write_text(json.dumps(doc))


def convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    to: str | None = None,
    unwrap_values: bool | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
    progress: bool | None = None,
    wrap_values: bool | None = None,
    step: int | None = None,
    include: _select.Patterns = None,
    exclude: _select.Patterns = None,
    dtype: _casting.DtypePolicy | None = None,
) -> ConvertSummary:
    """Converts ``src`` (an item, step or CheckpointManager root) into ``dst``.

    Args:
      src: an Orbax-native item/step/root (converted to safetensors), a safetensors
        item/file/step/root (converted to Orbax-native), or a legacy Flax msgpack file
        (``flax.serialization.to_bytes``, ``flax.training.checkpoints``' ``checkpoint_<step>``;
        converted to safetensors, decoded whole: host memory about twice the file).
      dst: where to write the same kind of thing (must not exist, or be empty). For a Flax
        msgpack file: a ``.safetensors`` file, or a directory that becomes a CheckpointManager
        root holding the step.
      to: ``"safetensors"`` or ``"orbax"``; None picks it from what ``src`` holds.
      unwrap_values: Orbax -> safetensors: None (default) collapses the ``{"value": x}``
        dicts (Orbax's form of ``nnx.Variable``) of an item that stores an ``nnx.State``
        (every leaf so wrapped) or whose Variables ``convert`` recorded, so names match
        ``nnx.state(model)`` here and a round trip is the identity; True collapses every
        such dict; False none (Orbax's own names, ``...kernel.value``).
      max_file_size: split safetensors output into files of at most this many bytes.
      batch_bytes: tensor bytes held in memory at once (Orbax -> safetensors).
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.
      wrap_values: safetensors -> Orbax: None wraps each leaf saved as an ``nnx.Variable``
        (also those collapsed by ``unwrap_values``) in a ``{"value": x}`` dict, as Orbax
        stores it, so ``StandardCheckpointer().restore(path, abstract nnx.State)`` works;
        True wraps every leaf (for files that record no Variables); False none.
      step: the step of a Flax msgpack file written into a directory (default: from the
        ``checkpoint_<step>`` file name).
      include: convert only the tensors (and Python values) these globs over dotted names
        select, as in ``osf.load_file``, in their saved containers; only their bytes are
        read. In a step or root they apply to every converted item, and a pattern matching
        no name of an item raises ``TargetMismatchError`` before DST appears.
      exclude: do not convert what these globs select (same rule).
      dtype: store the tensors in another dtype (to safetensors only): a save-time dtype
        policy as in ``osf.save_file`` (one dtype for every floating-point tensor, glob
        patterns over dotted names, or a callable); cast a batch at a time, each tensor's
        original dtype recorded.

    Returns:
      A :class:`ConvertSummary`.

    Example::

        convert("/orbax_ckpts", "/st_ckpts")        # every step of a CheckpointManager root
        convert("/flax_ckpts/checkpoint_3", "/st_ckpts")   # a root holding step 3
        convert("flax_model.msgpack", "model.safetensors")
        convert("/orbax/100", "/st-bf16/100", dtype="bfloat16")   # bf16 export
    """
    select = _select.Selection.of(include, exclude)
    src = epath.Path(src)
    policy = _casting.parse_policy(dtype)  # before anything is written
    if _flax_msgpack.is_flax_msgpack(src):
        if to == _TO_ORBAX:
            raise SafetensorsCheckpointError(
                f"{src} is a Flax msgpack file; it converts to safetensors only"
            )
        return flax_msgpack_to_safetensors(
            src,
            dst,
            step=step,
            max_file_size=max_file_size,
            progress=progress,
            select=select,
            dtype=policy,
        )
    kind = _steps.classify(src)
    _refuse_incomplete_steps(src, kind)
    if to and to not in tuple(Direction):
        raise SafetensorsCheckpointError(f"to must be 'safetensors' or 'orbax', not {to!r}")
    direction = Direction(to) if to else _direction_of(src, kind)
    if policy is not None and direction != _TO_SAFETENSORS:
        raise SafetensorsCheckpointError(
            f"{policy.describe()}: a dtype policy applies to conversions to safetensors; "
            f"{src} converts to Orbax-native (restore it, cast, and save with Orbax instead)"
        )
    options: dict[str, Any] = {
        "unwrap_values": unwrap_values,
        "max_file_size": max_file_size,
        "batch_bytes": batch_bytes,
        "progress": progress,
        "select": select,
        "dtype": policy,
    }
    if kind in _steps.TENSOR_KINDS:
        expected = (
            (PathKind.ORBAX,)
            if direction is Direction.SAFETENSORS
            else (PathKind.ITEM, PathKind.FILE, PathKind.SAFETENSORS_DIR)
        )
        if kind not in expected:
            raise SafetensorsCheckpointError(
                f"{src} is {kind.noun}; it cannot be converted to {direction}"
            )
        if direction == _TO_SAFETENSORS:
            return orbax_item_to_safetensors(src, dst, **options)
        return safetensors_item_to_orbax(
            src, dst, wrap_values=wrap_values, progress=progress, select=select
        )
    if kind is PathKind.STEP:
        return atomic(dst, lambda tmp: _convert_step(src, tmp, direction, options, wrap_values))
    if kind is PathKind.ROOT:

        def write_root(tmp: epath.Path) -> ConvertSummary:
            total = ConvertSummary(direction)
            tmp.mkdir(parents=True, exist_ok=True)
            for _, step in _steps.list_steps(src):
                if _steps.classify(step) is not PathKind.STEP:
                    raise SafetensorsCheckpointError(
                        f"{step}: a step that is not a directory of items cannot be converted "
                        "as part of a root; convert it as an item"
                    )
                step_summary = _convert_step(step, tmp / step.name, direction, options, wrap_values)
                total.items += [f"{step.name}/{i}" for i in step_summary.items]
                total.copied += [f"{step.name}/{i}" for i in step_summary.copied]
                total.tensors += step_summary.tensors
                total.bytes += step_summary.bytes
            return total

        return atomic(dst, write_root)
    raise _steps.not_a_checkpoint(src)
