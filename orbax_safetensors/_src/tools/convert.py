"""Converting between Orbax-native checkpoints and safetensors checkpoints, both ways.

- Orbax-native (``StandardSave``/``PyTreeSave``, OCDBT or not) -> safetensors: the tree is read
  from Orbax's own metadata (no target needed), tensors keep Orbax's dotted names and are
  streamed a batch at a time (Orbax's ``partial_restore``) into the planned files, so memory
  stays bounded by the batch size, not the checkpoint size. Python scalars stay inline in the
  schema; typed PRNG keys stay keys; saved ``NamedSharding`` layouts are recorded.
- safetensors -> Orbax: the tree is restored (host memory: the whole item) and saved with
  Orbax's ``StandardCheckpointer`` (``PyTreeCheckpointer`` when the tree holds strings, which
  ``StandardSave`` refuses). Leaves saved as ``nnx.Variable`` become ``{"value": x}`` dicts, as
  Orbax stores them, so ``StandardCheckpointer().restore(path, abstract nnx.State)`` works.
- legacy Flax msgpack (``flax.serialization.to_bytes``, ``flax.training.checkpoints``) ->
  safetensors: the file is decoded whole (see ``catalog/flax_msgpack.py``, which executes
  nothing), then written as one ``.safetensors`` file or as a step of a new CheckpointManager
  root.

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

from orbax_safetensors._src.catalog import flax_msgpack as _flax_msgpack
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax import v0 as _v0
from orbax_safetensors._src.pipeline import checkpoint_restore as _checkpoint_restore
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.storage import router as _router
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
        if _is_value_dict(tree):
            return tree["value"]
        return {k: _unwrap_value_dicts(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap_value_dicts(v) for v in tree)
    return tree


def _is_value_dict(node: Any) -> bool:
    return (
        isinstance(node, dict)
        and len(node) == 1
        and "value" in node
        and not isinstance(node["value"], (dict, list, tuple))
    )


def _mark_variables(node: dict[str, Any], original: Any) -> dict[str, Any]:
    """The schema ``node`` of an unwrapped tree with each collapsed ``{"value": x}`` dict of
    ``original`` recorded as an NNX Variable (``var``), as a save of ``nnx.state`` records it:
    converting back to Orbax wraps exactly those leaves again."""
    if _is_value_dict(original):
        return {"t": "var", "v": node}
    kind = node.get("t")
    if kind == "dict" and isinstance(original, dict):
        return {
            **node,
            "v": [
                _mark_variables(child, original[key]) if key in original else child
                for key, child in zip(node["k"], node["v"])
            ],
        }
    if kind in ("list", "tuple") and isinstance(original, (list, tuple)):
        return {**node, "v": [_mark_variables(c, o) for c, o in zip(node["v"], original)]}
    return node


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
    select: _select.Selection | None = None,
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
      select: convert only the leaves it selects (by Orbax's dotted names), in their saved
        containers; only their bytes are read.
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
            epath.Path(src),
            tmp,
            unwrap_values,
            max_file_size,
            batch_bytes,
            progress,
            select,
            policy,
        ),
    )


def _orbax_item_to_safetensors(
    src: epath.Path,
    dst: epath.Path,
    unwrap_values: bool,
    max_file_size: int | None,
    batch_bytes: int,
    progress: bool | None,
    select: _select.Selection | None = None,
    dtype: _casting.Policy | None = None,
) -> ConvertSummary:
    from orbax_safetensors._src.core import tree as _tree

    source = _sources.OrbaxSource(src)
    saved_tree = source.tree
    if select is not None:
        select.check(source.leaves, str(src))
        wanted = {n for n in source.leaves if select.selects(n)}
        saved_tree = _sources.select_leaves(
            source.tree, wanted, source.name_of_path(), lambda leaf: leaf
        )
    inline_names = [n for n in source.leaves if n not in source.tensors]
    if select is not None:
        inline_names = [n for n in inline_names if select.selects(n)]
    inline = source.restore(inline_names)
    orbax_name_of: dict[int, str] = {}

    def skeleton(keys: dict[str, str], unwrap: bool = unwrap_values) -> Any:
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

        tree = jax.tree_util.tree_map_with_path(leaf, saved_tree)
        return _unwrap_value_dicts(tree) if unwrap else tree

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
    metadata = _safetensors_metadata(
        source,
        skeleton(key_impls),
        to_orbax,
        plan,
        specs,
        dtype,
        original=skeleton({}, unwrap=False) if unwrap_values else None,
    )
    _checkpoint_save.finalize(dst, metadata, [share])
    return ConvertSummary(_TO_SAFETENSORS, [""], [], len(specs), total)


def _safetensors_metadata(
    source: _sources.OrbaxSource,
    tree: Any,
    to_orbax: dict[str, str],
    plan: _plan.CheckpointPlan,
    specs: list[_plan.TensorSpec],
    dtype: _casting.Policy | None,
    original: Any = None,
) -> dict[str, Any]:
    flat, casts = _casting.apply_policy(_tree.capture(tree), dtype)
    if original is not None:  # unwrapped: the collapsed dicts are recorded as NNX Variables
        flat.schema["tree"] = _mark_variables(flat.schema["tree"], original)
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
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    wrap_values: bool | None = None,
    progress: bool | None = None,
    select: _select.Selection | None = None,
) -> ConvertSummary:
    """Converts a safetensors checkpoint directory (or file) into an Orbax-native item.

    The whole item is restored in host memory, then saved with ``ocp.StandardCheckpointer``
    (``ocp.PyTreeCheckpointer`` when the tree holds strings); ``StandardRestore``/
    ``StandardCheckpointer().restore(dst)`` read it back.

    Args:
      src: the safetensors item directory, file or plain safetensors directory.
      dst: the Orbax item directory to create (must not exist, or be empty).
      wrap_values: None: leaves saved as ``nnx.Variable`` (``save_file(nnx.state(model))``,
        ``SafetensorsSave(nnx.state(model))``, ``convert --unwrap-values``) become
        ``{"value": x}`` dicts, as Orbax stores them, so Orbax restores the item with an
        abstract ``nnx.State``; True: every leaf is wrapped so (for files that record no
        Variables, e.g. written from ``nnx.to_pure_dict``); False: no leaf is.
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.

    Example::

        safetensors_item_to_orbax("/st/100/default", "/orbax/100/default")
        ocp.StandardCheckpointer().restore("/orbax/100/default", nnx.state(abstract_model))
    """
    src = epath.Path(src)
    dst = epath.Path(dst)
    tmp = _fresh_destination(dst)
    try:
        summary, _ = _safetensors_item_to_orbax(src, tmp, progress, wrap_values, select)
        _commit(tmp, dst)
    except BaseException:
        if tmp.exists():
            tmp.rmtree()
        raise
    return summary


def _restore_safetensors(
    src: epath.Path, select: _select.Selection | None = None
) -> tuple[Any, Any, int, int]:
    """The tree of a safetensors item, file or directory (only what ``select`` selects), its
    schema pruned alike (None for plain safetensors files), its tensor count and bytes."""
    kind = _steps.classify(src)
    source = _sources.open_source(src)
    infos = [t for n, t in source.tensors.items() if select is None or select.selects(n)]
    n, size = len(infos), sum(t.nbytes for t in infos)
    include = (select.include or None) if select else None
    exclude = (select.exclude or None) if select else None
    if kind == "item":
        # A checkpoint saved on devices this machine lacks (e.g. by a multi-host job) is
        # converted from this process's first device; Orbax then records that sharding.
        first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        tree = _checkpoint_restore.restore_directory(
            src, fallback_sharding=first, include=include, exclude=exclude
        )
        schema = _checkpoint_restore.read_metadata(src)["schema"]
        return tree, _pruned(schema, select), n, size
    if kind == "file":
        schema, _ = _standalone.file_index(src, _router.read_header(src))
        tree = _standalone.load_file(src, include=include, exclude=exclude)
        return tree, _pruned(schema, select), n, size
    if kind == "safetensors-dir":
        if select is not None:
            select.check(source.tensors, str(src))
        return source.read([t.name for t in infos]), None, n, size
    raise SafetensorsCheckpointError(f"{src} is a {kind}, not a safetensors checkpoint")


def _pruned(schema: Any, select: _select.Selection | None) -> Any:
    """``schema`` cut down to what ``select`` selects, as the selective restore cuts it."""
    if select is None or schema is None:
        return schema
    return _tree.prune_schema(schema, select.selects)


class _Name(str):
    """A tensor leaf's name standing in for its value (told apart from inline strings)."""


def _wrap_values(tree: Any, schema: Any, everything: bool) -> Any:
    """``tree`` (restored without a target from ``schema``) with each leaf saved as an NNX
    Variable (with ``everything``, each leaf) as a ``{"value": x}`` dict: what Orbax stores
    for an ``nnx.Variable``, and the path an abstract ``nnx.State`` asks Orbax for."""
    if schema is None:  # a plain safetensors file: a flat dict, no Variables recorded
        if not everything:
            return tree
        return {k: {"value": v} for k, v in tree.items()}

    def wrap(node: dict[str, Any], inside_var: bool = False) -> dict[str, Any]:
        kind = node["t"]
        if kind == "var":
            return {"t": "dict", "k": ["value"], "v": [wrap(node["v"], inside_var=True)]}
        if kind in ("dict", "list", "tuple", "node"):
            return {**node, "v": [wrap(c, inside_var) for c in node["v"]]}
        if everything and not inside_var and kind != "none":
            return {"t": "dict", "k": ["value"], "v": [node]}
        return node

    names = _tree.unflatten(schema, lambda leaf: _Name(leaf.name))
    name_leaves = jax.tree_util.tree_leaves(names)
    value_leaves = jax.tree_util.tree_leaves(tree)
    if len(name_leaves) != len(value_leaves):  # pragma: no cover - the same schema built both
        raise AssertionError("internal: the restored tree does not follow its schema")
    values = {str(n): v for n, v in zip(name_leaves, value_leaves) if isinstance(n, _Name)}
    wrapped = {**schema, "tree": wrap(schema["tree"])}
    return _tree.unflatten(wrapped, lambda leaf: values[leaf.name])


def _safetensors_item_to_orbax(
    src: epath.Path,
    dst: epath.Path,
    progress: bool | None,
    wrap_values: bool | None = None,
    select: _select.Selection | None = None,
) -> tuple[ConvertSummary, str]:
    import orbax.checkpoint as ocp

    tree, schema, n, size = _restore_safetensors(src, select)
    if wrap_values is not False:
        tree = _wrap_values(tree, schema, everything=bool(wrap_values))
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


# --------------------------------------------------------------------------- Flax msgpack


def flax_msgpack_to_safetensors(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    step: int | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    progress: bool | None = None,
    select: _select.Selection | None = None,
    dtype: _casting.Policy | None = None,
) -> ConvertSummary:
    """Converts a legacy Flax msgpack file into a ``.safetensors`` file or a new
    CheckpointManager root holding one step.

    The file is decoded whole (host memory: about twice its size) before anything is
    written; a truncated or forged file raises and writes nothing. Tensors get the dotted
    names ``flax.traverse_util.flatten_dict(state_dict, sep=".")`` gives; Python scalars and
    strings are kept in the tree schema, so ``load_file``/``SafetensorsRestore`` without a
    target give the state dict back.

    Args:
      src: a ``flax.serialization.to_bytes`` or ``flax.training.checkpoints`` file.
      dst: a path ending in ``.safetensors`` (one file), or a directory to create as a
        CheckpointManager root (the step under ``<dst>/<step>/default``).
      step: the step for a directory ``dst`` (default: from ``checkpoint_<step>``).
      max_file_size: split a directory's files at this size.
      progress: False: no progress bar; True or None: a bar on stderr when it is a terminal.
      select: convert only the leaves it selects (``convert(include=..., exclude=...)``).
      dtype: a parsed save-time dtype policy (``convert(dtype=...)``).

    Example::

        flax_msgpack_to_safetensors("ckpts/checkpoint_3", "st_ckpts")   # st_ckpts/3/default
        flax_msgpack_to_safetensors("flax_model.msgpack", "model.safetensors")
    """
    src, dst = epath.Path(src), epath.Path(dst)
    as_file = dst.suffix == ".safetensors"
    step = step if step is not None else _flax_msgpack.step_of(src)
    if not as_file and step is None:
        raise SafetensorsCheckpointError(
            f"{src}: no step in its name (checkpoint_<step>); pass --step (step=) or a "
            "destination ending in .safetensors"
        )
    if dst.exists() and (as_file or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists; choose a new destination")
    source = _sources.MsgpackSource(src)  # decoded (and checked) before anything is written
    tree, tensors = source.tree, source.tensors
    if select is not None:
        select.check(_flax_msgpack.flatten(tree), str(src))
        tree = _flax_msgpack.select(tree, select.selects)
        tensors = {n: t for n, t in tensors.items() if select.selects(n)}
    size = sum(t.nbytes for t in tensors.values())
    summary = ConvertSummary(_TO_SAFETENSORS, [], [], len(tensors), size)  # a file: no items
    with _terminal.progress_bar(size, f"convert {src.name}", progress) as bar:
        if as_file:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".{dst.name}.converting-{uuid.uuid4().hex[:8]}"
            try:
                _standalone.save_file(tree, tmp, {"converted_from": "flax-msgpack"}, dtype=dtype)
                tmp.rename(dst)
            finally:
                if tmp.exists():
                    tmp.unlink()
        elif step is not None:  # (a directory without a step was refused above)
            summary.items = [f"{step}/default"]

            def write_root(tmp: epath.Path) -> ConvertSummary:
                _save_step(tree, tmp, step, max_file_size, dtype)
                return summary

            _atomic(dst, write_root)
        bar.update(size)
    return summary


def _save_step(
    tree: Any,
    root: epath.Path,
    step: int,
    max_file_size: int | None,
    dtype: _casting.Policy | None = None,
) -> None:
    """Saves ``tree`` as step ``step`` of a new CheckpointManager root, through Orbax."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    handler = _v0.SafetensorsCheckpointHandler(max_file_size=max_file_size)
    with ocp.CheckpointManager(
        _steps.absolute(root), item_handlers=handler, options=options
    ) as mngr:
        mngr.save(step, args=_v0.SafetensorsSave(tree, dtype=dtype))
        mngr.wait_until_finished()


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
    src: epath.Path,
    dst: epath.Path,
    direction: str,
    options: dict[str, Any],
    wrap_values: bool | None = None,
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
      unwrap_values: collapse ``{"value": x}`` dicts (Orbax's form of ``nnx.Variable``) so
        the names match ``nnx.state(model)`` here (Orbax -> safetensors only).
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
        "select": select,
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
        return safetensors_item_to_orbax(
            src, dst, wrap_values=wrap_values, progress=progress, select=select
        )
    if kind == "step":
        return _atomic(dst, lambda tmp: _convert_step(src, tmp, direction, options, wrap_values))
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
                step_summary = _convert_step(step, tmp / step.name, direction, options, wrap_values)
                total.items += [f"{step.name}/{i}" for i in step_summary.items]
                total.copied += [f"{step.name}/{i}" for i in step_summary.copied]
                total.tensors += step_summary.tensors
                total.bytes += step_summary.bytes
            return total

        return _atomic(dst, write_root)
    raise SafetensorsCheckpointError(f"{src}: nothing to convert (a {kind})")
