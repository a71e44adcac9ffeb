"""``convert``: Orbax-native checkpoints to safetensors and back, for an item, a step or a
CheckpointManager root; legacy Flax msgpack files to safetensors. A step converts every item
of tensors and copies the others (e.g. JSON items); a root converts every committed step.
Output is written under a temporary sibling name and renamed once complete.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import uuid
from collections.abc import Callable

from etils import epath

from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax import v0 as _v0
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.tools import convert_items as _items
from orbax_safetensors._src.tools.inspection import progress_bar

__all__ = ["ConvertSummary", "Direction", "convert"]


class Direction(enum.StrEnum):
    """Which way a conversion goes (string-valued: summaries and messages show the value)."""

    SAFETENSORS = "safetensors"  # Orbax-native (or Flax msgpack) -> safetensors
    ORBAX = "orbax"  # safetensors -> Orbax-native


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did.

    Attributes:
      direction: ``"safetensors"`` (Orbax -> safetensors) or ``"orbax"`` (the reverse).
      items: converted item directories (relative to the destination; ``""`` for an item).
      copied: items copied unchanged (e.g. Orbax JSON items of a step).
      tensors: tensors converted.
      bytes: tensor bytes converted.

    Example::

        summary = convert("/orbax/100", "/st/100")
        summary.items, summary.tensors   # (['default'], 12)
    """

    direction: Direction
    items: list[str] = dataclasses.field(default_factory=list)
    copied: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


# ------------------------------------------------------------------ output that appears whole


def _refuse_existing(dst: epath.Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")


def atomic(dst: epath.PathLike, write: Callable[[epath.Path], ConvertSummary]) -> ConvertSummary:
    """Runs ``write`` into a temporary sibling of ``dst`` (which must not exist, or be an empty
    directory) and renames it to ``dst``; on failure removes it, and the parent directories
    made for it, so ``dst`` never appears half written."""
    dst = epath.Path(dst)
    _refuse_existing(dst)
    tmp = dst.parent / f".{dst.name}.converting-{uuid.uuid4().hex[:8]}"
    with _replace.made_parents(dst):
        try:
            summary = write(tmp)
            if dst.exists():
                dst.rmdir()  # the empty directory checked above
            tmp.rename(dst)
        except BaseException:
            if tmp.is_dir():
                tmp.rmtree()
            elif tmp.exists():
                tmp.unlink()
            raise
    return summary


def _copy_tree(root: epath.Path, name: str, dst: epath.Path) -> None:
    """Copies the entry ``name`` of ``root`` (kept unchanged by a conversion) to ``dst``, every
    path checked to lie inside ``root`` and every file read as the library reads files (a
    link out of ``root`` or a FIFO is refused)."""
    src = _confine.inside(root, name)
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _copy_tree(root, f"{name}/{child.name}", dst / child.name)
    else:
        _confine.copy_file(src, dst)


# ------------------------------------------------------------------ items, steps and roots


# The kinds of item each direction converts (a step's other items are copied).
_CONVERTED = {
    Direction.SAFETENSORS: frozenset({PathKind.ORBAX}),
    Direction.ORBAX: frozenset({PathKind.ITEM, PathKind.FILE, PathKind.SAFETENSORS_DIR}),
}


def _direction_of(path: epath.Path, kind: PathKind, steps: list[epath.Path]) -> Direction:
    if kind is PathKind.ROOT:  # (``steps``: its committed steps)
        if not steps:
            raise SafetensorsCheckpointError(
                f"{path}: a CheckpointManager root with no committed step"
            )
        return _direction_of(steps[-1], _steps.classify(steps[-1]), [])
    kinds = set(_steps.list_items(path).values()) if kind is PathKind.STEP else {kind}
    for direction, converted in _CONVERTED.items():  # an Orbax item first
        if kinds & converted:
            return direction
    raise _steps.not_a_checkpoint(path)


def _committed_steps(src: epath.Path, kind: PathKind) -> list[epath.Path]:
    """The committed steps of the root ``src`` (none for anything else), each complete: a
    committed step that lacks what restoring it needs would be carried on as complete."""
    if kind is not PathKind.ROOT:
        _completeness.refuse_incomplete(src)
        return []
    committed = [s for s in _steps.scan_steps(src) if s.committed]
    for step in committed:
        _completeness.require_complete(step)
    return [s.path for s in committed]


# Converts one item, ``(src, dst)`` -> its tensors, bytes and the typestr of the handler that
# reads it back (for a step's ``_CHECKPOINT_METADATA``).
_ItemWriter = Callable[[epath.Path, epath.Path], tuple[int, int, str]]


def _convert_step(
    src: epath.Path,
    dst: epath.Path,
    write_item: _ItemWriter,
    summary: ConvertSummary,
    prefix: str = "",
) -> ConvertSummary:
    """Converts the step ``src`` into ``dst``, adding to ``summary`` (item names after
    ``prefix``): its items of tensors converted, every other entry copied."""
    dst.mkdir(parents=True, exist_ok=True)
    handlers: dict[str, str] = {}
    for name, kind in _steps.list_items(src).items():
        if kind not in _CONVERTED[summary.direction]:
            _copy_tree(src, name, dst / name)
            summary.copied.append(prefix + name)
            continue
        n, size, handlers[name] = write_item(src / name, dst / name)
        summary.items.append(prefix + name)
        summary.tensors += n
        summary.bytes += size
    for entry in src.iterdir():
        if not entry.is_dir() and entry.name != _steps.CHECKPOINT_METADATA_FILE:
            _copy_tree(src, entry.name, dst / entry.name)
    path = _confine.inside(src, _steps.CHECKPOINT_METADATA_FILE)
    if path.exists():  # the step's record of its items, naming the new handlers
        doc = _steps.read_json(path)
        if not isinstance(doc, dict):
            raise SafetensorsCheckpointError(
                f"{path}: unreadable or not a JSON object (the step's record of its items, which the "
                "converted step must name its new handlers in); the step cannot be converted"
            )
        if isinstance(doc.get("item_handlers"), dict):
            doc["item_handlers"].update(handlers)
        (dst / _steps.CHECKPOINT_METADATA_FILE).write_text(json.dumps(doc))
    return summary


def _convert_root(
    steps: list[epath.Path], tmp: epath.Path, write_item: _ItemWriter, summary: ConvertSummary
) -> ConvertSummary:
    tmp.mkdir(parents=True, exist_ok=True)
    for step in steps:
        if _steps.classify(step) is not PathKind.STEP:
            raise SafetensorsCheckpointError(
                f"{step}: a step that is not a directory of items cannot be converted "
                "as part of a root; convert it as an item"
            )
        _convert_step(step, tmp / step.name, write_item, summary, prefix=f"{step.name}/")
    return summary


# ------------------------------------------------------------------ legacy Flax msgpack


def _from_msgpack(
    src: epath.Path,
    dst: epath.Path,
    step: int | None,
    max_file_size: int | None,
    progress: bool | None,
    select: _select.Selection | None,
    dtype: _casting.Policy | None,
) -> ConvertSummary:
    """A Flax msgpack file, decoded whole (and checked) before anything is written, as one
    ``.safetensors`` file or as step ``step`` of a new CheckpointManager root ``dst``."""
    as_file = dst.suffix == ".safetensors"
    step = step if step is not None else _flax_msgpack.step_of(src)
    if not as_file and step is None:
        raise SafetensorsCheckpointError(
            f"{src}: no step in its name (checkpoint_<step>); pass --step (step=) or a "
            "destination ending in .safetensors"
        )
    if dst.exists() and (as_file or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    source = _flax_msgpack.MsgpackSource(src)
    tree, tensors = source.tree, source.tensors
    if select is not None:
        select.check(_flax_msgpack.flatten(tree), str(src))
        tree = _flax_msgpack.select(tree, select.selects)
        tensors = {n: t for n, t in tensors.items() if select.selects(n)}
    size = sum(t.nbytes for t in tensors.values())
    items = [] if as_file else [f"{step}/default"]
    summary = ConvertSummary(Direction.SAFETENSORS, items, [], len(tensors), size)

    def write(tmp: epath.Path) -> ConvertSummary:
        if as_file:
            _standalone.save_file(tree, tmp, {"converted_from": "flax-msgpack"}, dtype=dtype)
            return summary
        import orbax.checkpoint as ocp

        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
        handler = _v0.SafetensorsCheckpointHandler(max_file_size=max_file_size)
        with ocp.CheckpointManager(
            _steps.absolute(tmp), item_handlers=handler, options=options
        ) as mngr:
            mngr.save(step, args=_v0.SafetensorsSave(tree, dtype=dtype))
            mngr.wait_until_finished()
        return summary

    with progress_bar(size, f"convert {src.name}", progress) as bar:
        atomic(dst, write)
        bar.update(size)
    return summary


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
      src: an Orbax-native item, step or root (to safetensors, streamed a batch at a time); a
        safetensors item, file, step or root (to Orbax-native); or a legacy Flax msgpack file
        (``flax.serialization.to_bytes``, ``checkpoint_<step>``; to safetensors, decoded
        whole: host memory about twice the file).
      dst: what to write (must not exist, or be empty); for a Flax msgpack file, a
        ``.safetensors`` file or a directory that becomes a root holding the step.
      to: ``"safetensors"`` or ``"orbax"``; None picks it from what ``src`` holds.
      unwrap_values: to safetensors: None collapses the ``{"value": x}`` dicts (Orbax's form
        of ``nnx.Variable``) of an ``nnx.State`` or of Variables ``convert`` recorded, so
        names match ``nnx.state(model)`` and a round trip is the identity; True every such
        dict; False none.
      max_file_size: split safetensors output into files of at most this many bytes.
      batch_bytes: tensor bytes held in memory at once (to safetensors).
      progress: False: no progress bar; else a bar on stderr when it is a terminal.
      wrap_values: to Orbax: None wraps each leaf saved as an ``nnx.Variable`` in a
        ``{"value": x}`` dict, as Orbax stores it; True every leaf; False none.
      step: the step of a Flax msgpack file written to a directory (default: from its name).
      include: globs over dotted names, as in ``osf.load_file``: convert only what they
        select (only those bytes are read); a pattern matching no name of an item raises
        ``TargetMismatchError`` before ``dst`` appears.
      exclude: do not convert what these globs select (same rule).
      dtype: store tensors in another dtype (to safetensors only), a save-time dtype policy as
        in ``osf.save_file``, cast a batch at a time; each original dtype is recorded.

    Returns:
      A :class:`ConvertSummary`.

    Example::

        convert("/orbax_ckpts", "/st_ckpts")        # every step of a CheckpointManager root
        convert("/flax_ckpts/checkpoint_3", "/st_ckpts")   # a root holding step 3
        convert("/orbax/100", "/st-bf16/100", dtype="bfloat16")
    """
    select = _select.Selection.of(include, exclude)
    src, dst = epath.Path(src), epath.Path(dst)
    policy = _casting.parse_policy(dtype)  # before anything is written
    if _flax_msgpack.is_flax_msgpack(src):
        if to == Direction.ORBAX:
            raise SafetensorsCheckpointError(
                f"{src} is a Flax msgpack file; it converts to safetensors only"
            )
        return _from_msgpack(src, dst, step, max_file_size, progress, select, policy)
    kind = _steps.classify(src)
    steps = _committed_steps(src, kind)
    if to and to not in tuple(Direction):
        raise SafetensorsCheckpointError(f"to must be 'safetensors' or 'orbax', not {to!r}")
    direction = Direction(to) if to else _direction_of(src, kind, steps)
    if policy is not None and direction is not Direction.SAFETENSORS:
        raise SafetensorsCheckpointError(
            f"{policy.describe()}: a dtype policy applies to conversions to safetensors; "
            f"{src} converts to Orbax-native (restore it, cast, and save with Orbax instead)"
        )

    def write_item(item: epath.Path, out: epath.Path) -> tuple[int, int, str]:
        if direction is Direction.SAFETENSORS:
            n, size = _items.to_safetensors_item(
                item, out, unwrap_values, max_file_size, batch_bytes, progress, select, policy
            )
            return n, size, _steps.HANDLER_TYPESTR
        return _items.to_orbax_item(item, out, progress, wrap_values, select)

    if kind in _steps.TENSOR_KINDS:
        if kind not in _CONVERTED[direction]:
            raise SafetensorsCheckpointError(
                f"{src} is {kind.noun}; it cannot be converted to {direction}"
            )

        def write_one(tmp: epath.Path) -> ConvertSummary:
            n, size, _ = write_item(src, tmp)
            return ConvertSummary(direction, [""], [], n, size)

        return atomic(dst, write_one)
    if kind is PathKind.STEP:
        return atomic(
            dst, lambda tmp: _convert_step(src, tmp, write_item, ConvertSummary(direction))
        )
    if kind is PathKind.ROOT:
        return atomic(
            dst, lambda tmp: _convert_root(steps, tmp, write_item, ConvertSummary(direction))
        )
    raise _steps.not_a_checkpoint(src)
