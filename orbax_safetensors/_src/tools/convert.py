"""Converting between Orbax-native checkpoints and safetensors checkpoints, both ways.

- Orbax-native (``StandardSave``/``PyTreeSave``, OCDBT or not) -> safetensors: the tree is read
  from Orbax's own metadata (no target needed), tensors keep Orbax's dotted names and are
  streamed a batch at a time (Orbax's ``partial_restore``) into the planned files, so memory
  stays bounded by the batch size, not the checkpoint size. Python scalars stay inline in the
  schema; typed PRNG keys stay keys; saved ``NamedSharding`` layouts are recorded.
- safetensors -> Orbax: the tree is restored (host memory: the whole item) and saved with
  Orbax's ``StandardCheckpointer`` (``PyTreeCheckpointer`` when the tree holds strings, which
  ``StandardSave`` refuses).

Paths may be items, steps (every tensor item converted, other items such as JSON copied) or
CheckpointManager roots (every step). Output appears atomically: it is written under a
temporary sibling name and renamed when complete.

Example::

    convert("/old/orbax/100", "/new/safetensors/100")     # a step, Orbax -> safetensors
    convert("/new/safetensors/100/default", "/back/default")   # and back
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.tools import terminal as _terminal

_TO_SAFETENSORS = "safetensors"
_TO_ORBAX = "orbax"


@dataclasses.dataclass
class ConvertSummary:
    """What a conversion did.

    Attributes:
      direction: ``"safetensors"`` (Orbax -> safetensors) or ``"orbax"`` (the reverse).
      items: converted item directories (relative to the destination; ``""`` for an item).
      copied: items copied unchanged (e.g. Orbax JSON items of a step).
      tensors: tensors converted.
      bytes: tensor bytes converted.
    """

    direction: str
    items: list[str] = dataclasses.field(default_factory=list)
    copied: list[str] = dataclasses.field(default_factory=list)
    tensors: int = 0
    bytes: int = 0


# --------------------------------------------------------------------------- helpers


def _fresh_destination(dst: epath.Path) -> epath.Path:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst.parent / f".{dst.name}.converting-{uuid.uuid4().hex[:8]}"


def _commit(tmp: epath.Path, dst: epath.Path) -> None:
    if dst.exists():
        dst.rmdir()  # the empty directory checked by _fresh_destination
    tmp.rename(dst)


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _copy_tree(child, dst / child.name)
    else:
        src.copy(dst, overwrite=True)


def _atomic(dst: epath.PathLike, write: Callable[[epath.Path], ConvertSummary]) -> ConvertSummary:
    dst = epath.Path(dst)
    tmp = _fresh_destination(dst)
    try:
        summary = write(tmp)
        _commit(tmp, dst)
    except BaseException:
        if tmp.exists():
            tmp.rmtree()
        raise
    return summary


# --------------------------------------------------------------------------- Orbax -> safetensors


def _placeholder(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    # A read-only zero-stride view: right dtype and shape, one element of memory.
    return np.broadcast_to(np.zeros((), dtype), shape)


def _unwrap_value_dicts(tree: Any) -> Any:
    """Replaces every ``{"value": x}`` dict (how Orbax stores an ``nnx.Variable``) by ``x``."""
    if isinstance(tree, dict):
        if (
            len(tree) == 1
            and "value" in tree
            and not isinstance(tree["value"], (dict, list, tuple))
        ):
            return tree["value"]
        return {k: _unwrap_value_dicts(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap_value_dicts(v) for v in tree)
    return tree


def _set_array_kinds(node: Any, jax_names: set[str]) -> None:
    if isinstance(node, dict):
        if node.get("t") == "tensor" and node.get("name") in jax_names:
            node["array"] = "jax"
        for v in node.values():
            _set_array_kinds(v, jax_names)
    elif isinstance(node, list):
        for v in node:
            _set_array_kinds(v, jax_names)


def _orbax_sharding(leaf: Any) -> dict[str, Any] | None:
    from orbax.checkpoint import metadata as ocp_metadata

    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, ocp_metadata.NamedShardingMetadata):
        return None
    return _sharding.named_sharding_json(
        sharding.axis_names, np.asarray(sharding.shape).tolist(), sharding.partition_spec
    )


def orbax_item_to_safetensors(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    unwrap_values: bool = False,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
    progress: bool | None = None,
    dtype: _casting.DtypePolicy | None = None,
) -> ConvertSummary:
    """Converts one Orbax-native PyTree item into a safetensors checkpoint directory.

    Args:
      src: the Orbax item directory (it holds ``_METADATA``).
      dst: the checkpoint directory to create (must not exist, or be empty).
      unwrap_values: collapse ``{"value": x}`` dicts (Orbax's form of ``nnx.Variable``) so the
        names match ``nnx.state(model)`` here (``layers.0.kernel``, not ``...kernel.value``).
      max_file_size: split into ``model-0000i-of-0000n.safetensors`` files above this size.
      batch_bytes: tensor bytes held in memory at once.
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.
      dtype: a save-time dtype policy, as in ``osf.save_file`` (each batch is cast as it is
        written); a callable is given a placeholder of each leaf's stored shape and dtype.

    Example::

        orbax_item_to_safetensors("/orbax/100/default", "/st/100/default")
        tree = osf.restore_directory("/st/100/default")
    """
    policy = _casting.parse_policy(dtype)  # before the destination exists
    return _atomic(
        dst,
        lambda tmp: _orbax_item_to_safetensors(
            epath.Path(src), tmp, unwrap_values, max_file_size, batch_bytes, progress, policy
        ),
    )


def _orbax_item_to_safetensors(
    src: epath.Path,
    dst: epath.Path,
    unwrap_values: bool,
    max_file_size: int | None,
    batch_bytes: int,
    progress: bool | None,
    dtype: _casting.Policy | None = None,
) -> ConvertSummary:
    from orbax_safetensors._src.core import tree as _tree

    source = _sources.OrbaxSource(src)
    inline_names = [n for n in source.leaves if n not in source.tensors]
    inline = source.restore(inline_names)
    orbax_name_of: dict[int, str] = {}

    def skeleton(keys: dict[str, str]) -> Any:
        # The Orbax tree with placeholders for arrays (PRNG keys as tiny real keys) and the
        # restored values of scalars/strings.
        names = source.name_of_path()

        def leaf(path: Any, meta: Any) -> Any:
            name = names[tuple(path)]
            if name not in source.tensors:
                return inline[name]
            info = source.tensors[name]
            if name in keys:
                data = jax.numpy.zeros(info.shape, jax.numpy.uint32)
                value = jax.random.wrap_key_data(data, impl=keys[name])
            else:
                value = _placeholder(info.shape, _dtypes.to_numpy(info.dtype))
            orbax_name_of[id(value)] = name
            return value

        tree = jax.tree_util.tree_map_with_path(leaf, source.tree)
        return _unwrap_value_dicts(tree) if unwrap_values else tree

    first, casts = _casting.apply_policy(_tree.capture(skeleton({})), dtype)
    to_orbax = {ours: orbax_name_of[id(v)] for ours, v in first.arrays.items()}
    specs = _casting.stored_specs(first.arrays, casts)
    plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata=_metadata.HEADER_METADATA)
    sizes = {s.name: s.nbytes for s in specs}
    key_impls: dict[str, str] = {}
    groups = _sources.batches(
        [source.tensors[to_orbax[s.name]] for s in specs], max_bytes=batch_bytes
    ) or [[]]
    from_orbax = {v: k for k, v in to_orbax.items()}
    total = sum(sizes.values())
    dst.mkdir(parents=True, exist_ok=True)
    with _terminal.progress_bar(total, f"convert {src.name}", progress) as bar:

        def batch_pieces() -> Iterator[tuple[int, list[Any]]]:
            # One batch of tensors in host memory at a time; one writer for all of them.
            for group in groups:
                values = source.restore([t.name for t in group], as_jax=True)
                arrays = {}
                for orbax_name, value in values.items():
                    ours = from_orbax[orbax_name]
                    if _tree.is_prng_key(value):
                        key_impls[orbax_name] = str(jax.random.key_impl(value))
                        value = jax.random.key_data(value)
                    arrays[ours] = np.asarray(value)
                del values
                yield from _pieces.iter_host_pieces(plan, arrays, copy=False)
                bar.update(sum(a.nbytes for a in arrays.values()))
                del arrays

        prepared = _checkpoint_save.PreparedSave(
            plan, batch_pieces(), {}, sizes, is_primary=True, process_index=0, checksums=True
        )
        share = _checkpoint_save.write_process_share(
            prepared, dst, persist_share=False, max_in_flight=batch_bytes
        )
    # The PRNG key implementations are known once their batches were read.
    metadata = _safetensors_metadata(source, skeleton(key_impls), to_orbax, plan, specs, dtype)
    _checkpoint_save.finalize(dst, metadata, [share])
    return ConvertSummary(_TO_SAFETENSORS, [""], [], len(specs), total)


def _safetensors_metadata(
    source: _sources.OrbaxSource,
    tree: Any,
    to_orbax: dict[str, str],
    plan: _plan.CheckpointPlan,
    specs: list[_plan.TensorSpec],
    dtype: _casting.Policy | None,
) -> dict[str, Any]:
    flat, casts = _casting.apply_policy(_tree.capture(tree), dtype)
    final_specs = _casting.stored_specs(flat.arrays, casts)
    if final_specs != specs:  # the same tree, keys in place of placeholders
        raise AssertionError("internal: tensor layout changed between planning and writing")
    jax_names = {
        ours
        for ours, orbax_name in to_orbax.items()
        if source.leaves[orbax_name][1].sharding is not None
    }
    _set_array_kinds(flat.schema["tree"], jax_names)
    shardings = {s.name: _orbax_sharding(source.leaves[to_orbax[s.name]][1]) for s in specs}
    return _metadata.build_metadata(
        plan, specs, flat.schema, shardings, {"converted_from": "orbax"}
    )


# --------------------------------------------------------------------------- safetensors -> Orbax


def _has_strings(tree: Any) -> bool:
    return any(isinstance(x, str) for x in jax.tree_util.tree_leaves(tree))


def safetensors_item_to_orbax(
    src: epath.PathLike, dst: epath.PathLike, *, progress: bool | None = None
) -> ConvertSummary:
    """Converts a safetensors checkpoint directory (or file) into an Orbax-native item.

    The whole item is restored in host memory, then saved with ``ocp.StandardCheckpointer``
    (``ocp.PyTreeCheckpointer`` when the tree holds strings); ``StandardRestore``/
    ``StandardCheckpointer().restore(dst)`` read it back.

    Example::

        safetensors_item_to_orbax("/st/100/default", "/orbax/100/default")
    """
    src = epath.Path(src)
    dst = epath.Path(dst)
    tmp = _fresh_destination(dst)
    try:
        summary, _ = _safetensors_item_to_orbax(src, tmp, progress)
        _commit(tmp, dst)
    except BaseException:
        if tmp.exists():
            tmp.rmtree()
        raise
    return summary


def _restore_safetensors(src: epath.Path) -> tuple[Any, int, int]:
    kind = _steps.classify(src)
    source = _sources.open_source(src)
    n, size = len(source.tensors), sum(t.nbytes for t in source.tensors.values())
    if kind == "item":
        # A checkpoint saved on devices this machine lacks (e.g. by a multi-host job) is
        # converted from this process's first device; Orbax then records that sharding.
        first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        tree = _checkpoint_restore.restore_directory(src, fallback_sharding=first)
        return tree, n, size
    if kind == "file":
        return _standalone.load_file(src), n, size
    if kind == "safetensors-dir":
        return source.read(list(source.tensors)), n, size
    raise SafetensorsCheckpointError(f"{src} is a {kind}, not a safetensors checkpoint")


def _safetensors_item_to_orbax(
    src: epath.Path, dst: epath.Path, progress: bool | None
) -> tuple[ConvertSummary, str]:
    import orbax.checkpoint as ocp

    tree, n, size = _restore_safetensors(src)
    strings = _has_strings(tree)
    with _terminal.progress_bar(size, f"convert {src.name}", progress) as bar:
        checkpointer = ocp.PyTreeCheckpointer() if strings else ocp.StandardCheckpointer()
        try:
            checkpointer.save(_steps.absolute(dst), tree, force=True)
            if hasattr(checkpointer, "wait_until_finished"):  # the async StandardCheckpointer
                checkpointer.wait_until_finished()
        finally:
            checkpointer.close()
        bar.update(size)
    return ConvertSummary(_TO_ORBAX, [""], [], n, size), _item_handler_typestr(_TO_ORBAX, strings)


# --------------------------------------------------------------------------- steps and roots


def _direction_of(path: epath.Path, kind: str) -> str:
    if kind == "orbax":
        return _TO_SAFETENSORS
    if kind in ("item", "file", "safetensors-dir"):
        return _TO_ORBAX
    if kind == "step":
        kinds = set(_steps.list_items(path).values())
        if "orbax" in kinds:
            return _TO_SAFETENSORS
        if kinds & {"item", "safetensors-dir"}:
            return _TO_ORBAX
        raise SafetensorsCheckpointError(f"{path}: a step with no tensor items to convert")
    if kind == "root":
        steps = _steps.list_steps(path)
        if not steps:
            raise SafetensorsCheckpointError(f"{path}: a root with no steps")
        step = steps[-1][1]
        return _direction_of(step, _steps.classify(step))
    raise SafetensorsCheckpointError(
        f"{path} is not an Orbax or safetensors checkpoint (file, item, step or root)"
    )


def _item_handler_typestr(direction: str, tree_has_strings: bool = False) -> str:
    if direction == _TO_SAFETENSORS:
        return _steps.HANDLER_TYPESTR
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler if tree_has_strings else ocp.StandardCheckpointHandler
    return f"{handler.__module__}.{handler.__qualname__}"


def _convert_step(
    src: epath.Path, dst: epath.Path, direction: str, options: dict[str, Any]
) -> ConvertSummary:
    summary = ConvertSummary(direction)
    dst.mkdir(parents=True, exist_ok=True)
    source_kind = "orbax" if direction == _TO_SAFETENSORS else None
    handlers: dict[str, str] = {}
    for name, kind in _steps.list_items(src).items():
        converts = kind == source_kind if source_kind else kind in ("item", "safetensors-dir")
        if not converts:
            _copy_tree(src / name, dst / name)
            summary.copied.append(name)
            continue
        if direction == _TO_SAFETENSORS:
            item_summary = _orbax_item_to_safetensors(src / name, dst / name, **options)
            handlers[name] = _item_handler_typestr(direction)
        else:
            item_summary, handlers[name] = _safetensors_item_to_orbax(
                src / name, dst / name, options.get("progress")
            )
        summary.items.append(name)
        summary.tensors += item_summary.tensors
        summary.bytes += item_summary.bytes
    for entry in src.iterdir():
        if not entry.is_dir() and entry.name != _steps.CHECKPOINT_METADATA_FILE:
            entry.copy(dst / entry.name, overwrite=True)
    _write_step_metadata(src, dst, handlers)
    return summary


def _write_step_metadata(src: epath.Path, dst: epath.Path, handlers: dict[str, str]) -> None:
    path = src / _steps.CHECKPOINT_METADATA_FILE
    if not path.exists():
        return
    doc = json.loads(path.read_text())
    item_handlers = doc.get("item_handlers")
    if isinstance(item_handlers, dict):
        item_handlers.update(handlers)
    (dst / _steps.CHECKPOINT_METADATA_FILE).write_text(json.dumps(doc))


def convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    to: str | None = None,
    unwrap_values: bool = False,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
    progress: bool | None = None,
    dtype: _casting.DtypePolicy | None = None,
) -> ConvertSummary:
    """Converts ``src`` (an item, step or CheckpointManager root) into ``dst``.

    Args:
      src: an Orbax-native item/step/root (converted to safetensors) or a safetensors
        item/file/step/root (converted to Orbax-native).
      dst: where to write the same kind of thing (must not exist, or be empty).
      to: ``"safetensors"`` or ``"orbax"``; None picks it from what ``src`` holds.
      unwrap_values: collapse ``{"value": x}`` dicts (Orbax's form of ``nnx.Variable``) so
        the names match ``nnx.state(model)`` here (Orbax -> safetensors only).
      max_file_size: split safetensors output into files of at most this many bytes.
      batch_bytes: tensor bytes held in memory at once (Orbax -> safetensors).
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.
      dtype: store the tensors in another dtype (to safetensors only): a save-time dtype
        policy as in ``osf.save_file`` (one dtype for every floating-point tensor, glob
        patterns over dotted names, or a callable); cast a batch at a time, each tensor's
        original dtype recorded.

    Returns:
      A :class:`ConvertSummary`.

    Example::

        convert("/orbax_ckpts", "/st_ckpts")        # every step of a CheckpointManager root
        convert("/orbax/100", "/st-bf16/100", dtype="bfloat16")   # bf16 export
    """
    src = epath.Path(src)
    policy = _casting.parse_policy(dtype)  # before anything is written
    kind = _steps.classify(src)
    direction = to or _direction_of(src, kind)
    if direction not in (_TO_SAFETENSORS, _TO_ORBAX):
        raise ValueError(f"to must be 'safetensors' or 'orbax', not {direction!r}")
    if policy is not None and direction != _TO_SAFETENSORS:
        raise ValueError(
            f"dtype={policy.describe()}: a dtype policy applies to conversions to safetensors; "
            f"{src} converts to Orbax-native (restore it, cast, and save with Orbax instead)"
        )
    options: dict[str, Any] = {
        "unwrap_values": unwrap_values,
        "max_file_size": max_file_size,
        "batch_bytes": batch_bytes,
        "progress": progress,
        "dtype": policy,
    }
    if kind in _steps.TENSOR_KINDS:
        expected = (
            ("orbax",) if direction == _TO_SAFETENSORS else ("item", "file", "safetensors-dir")
        )
        if kind not in expected:
            raise SafetensorsCheckpointError(
                f"{src} is a {kind}; it cannot be converted to {direction}"
            )
        if direction == _TO_SAFETENSORS:
            return orbax_item_to_safetensors(src, dst, **options)
        return safetensors_item_to_orbax(src, dst, progress=progress)
    if kind == "step":
        return _atomic(dst, lambda tmp: _convert_step(src, tmp, direction, options))
    if kind == "root":

        def write_root(tmp: epath.Path) -> ConvertSummary:
            total = ConvertSummary(direction)
            tmp.mkdir(parents=True, exist_ok=True)
            for _, step in _steps.list_steps(src):
                if _steps.classify(step) != "step":
                    raise SafetensorsCheckpointError(
                        f"{step}: a step that is not a directory of items cannot be converted "
                        "as part of a root; convert it as an item"
                    )
                step_summary = _convert_step(step, tmp / step.name, direction, options)
                total.items += [f"{step.name}/{i}" for i in step_summary.items]
                total.copied += [f"{step.name}/{i}" for i in step_summary.copied]
                total.tensors += step_summary.tensors
                total.bytes += step_summary.bytes
            return total

        return _atomic(dst, write_root)
    raise SafetensorsCheckpointError(f"{src}: nothing to convert (a {kind})")
