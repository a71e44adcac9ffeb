"""One item converted either way: an Orbax-native PyTree item into this library's item (streamed
a batch of tensors at a time), or a safetensors item, file or directory into an Orbax-native
item (restored whole, saved by Orbax); and the names an ``nnx.State`` gets on each side
(Orbax stores an ``nnx.Variable`` as a ``{"value": x}`` dict: see :func:`unwrapped_paths`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import orbax_source as _orbax_source
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError, UnsupportedLeafError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.storage import router as _router
from orbax_safetensors._src.tools.inspection import progress_bar

RECORD_KEY = "orbax_safetensors"  # our entry of an Orbax item's custom_metadata
VARIABLES_KEY = "nnx_variables"  # its list of the dotted names of NNX Variable leaves
VALUE = "value"

Path = tuple[Any, ...]  # raw keys: dict keys and sequence indices


# ------------------------------------------------------------------ NNX Variables' names


def raw_path(keypath: Iterable[Any]) -> Path:
    """A jax key path as plain keys (``DictKey('a')`` -> ``'a'``, ``SequenceKey(0)`` -> 0)."""
    out = []
    for entry in keypath:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                out.append(getattr(entry, attr))
                break
        else:
            out.append(str(entry))
    return tuple(out)


def _recorded_variables(item: Any) -> list[str] | None:
    """The dotted Orbax names of the Variable leaves recorded in an Orbax item's custom
    metadata (:func:`to_orbax_item` records them), or None (an item Orbax wrote itself)."""
    doc = _steps.read_json(epath.Path(item) / _steps.ORBAX_METADATA_FILE)
    custom = doc.get("custom_metadata") if isinstance(doc, dict) else None
    record = custom.get(RECORD_KEY) if isinstance(custom, dict) else None
    names = record.get(VARIABLES_KEY) if isinstance(record, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def _wrapped(paths: Iterable[Path], parents: Mapping[Path, Any]) -> list[Path]:
    # The parents of leaves that are the only "value" entry of a dict.
    out = []
    for path in paths:
        if path and path[-1] == VALUE:
            parent = parents.get(path[:-1])
            if isinstance(parent, dict) and len(parent) == 1:
                out.append(path[:-1])
    return out


def _dicts(tree: Any, path: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    if isinstance(tree, dict):
        out[path] = tree
        for k, v in tree.items():
            out.update(_dicts(v, (*path, k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_dicts(v, (*path, i)))
    return out


def _leaf_paths(source: _orbax_source.OrbaxSource) -> dict[str, Path]:
    return {n: raw_path(kp) for n, (kp, _) in source.leaves.items()}


def unwrapped_paths(source: _orbax_source.OrbaxSource, unwrap: bool | None) -> set[Path]:
    """The paths of the ``{"value": x}`` dicts of ``source``'s tree to collapse: with ``unwrap``
    None, those of the leaves the item records as Variables (an item :func:`to_orbax_item`
    wrote), else all when every leaf is so wrapped (an ``nnx.State``); True all; False none."""
    if unwrap is False:
        return set()
    leaves = _leaf_paths(source)
    parents = _dicts(source.tree)
    candidates = _wrapped(leaves.values(), parents)
    if unwrap:
        return set(candidates)
    recorded = _recorded_variables(source.path)
    if recorded is not None:
        return set(_wrapped({leaves[n] for n in recorded if n in leaves}, parents))
    if leaves and len(candidates) == len(leaves) and () not in candidates:
        return set(candidates)  # an nnx.State (a lone {"value": x} item is not one)
    return set()


def _unwrap(tree: Any, paths: set[Path], path: Path = ()) -> Any:
    """``tree`` with the dict at each of ``paths`` replaced by its ``"value"`` entry."""
    if path in paths and isinstance(tree, dict):
        return tree[VALUE]
    if isinstance(tree, dict):
        return {k: _unwrap(v, paths, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap(v, paths, (*path, i)) for i, v in enumerate(tree))
    return tree


def _mark_variables(node: _schema.Node, paths: set[Path], path: Path = ()) -> _schema.Node:
    """The schema of an unwrapped tree with the leaf at each of ``paths`` recorded as an NNX
    Variable, so converting back wraps exactly those leaves again."""
    if path in paths:
        return _schema.VarNode(node)
    if isinstance(node, _schema.DictNode):
        return _schema.DictNode(
            node.keys,
            tuple(
                [_mark_variables(c, paths, (*path, k)) for k, c in zip(node.keys, node.children)]
            ),
        )
    if isinstance(node, (_schema.ListNode, _schema.TupleNode)):
        return _schema.with_children(
            node,
            tuple([_mark_variables(c, paths, (*path, i)) for i, c in enumerate(node.children)]),
        )
    return node


def converted_names(source: _orbax_source.OrbaxSource) -> dict[str, str]:
    """Each tensor name of ``source`` mapped to the name converting it to safetensors gives it
    (``linear1.kernel.value`` -> ``linear1.kernel`` in an ``nnx.State``); empty when every
    name stays."""
    from jax.tree_util import DictKey, SequenceKey

    paths = unwrapped_paths(source, None)
    if not paths:
        return {}
    leaves = _leaf_paths(source)
    new = [p[:-1] if p[:-1] in paths and p and p[-1] == VALUE else p for p in leaves.values()]
    keys = [tuple(SequenceKey(k) if isinstance(k, int) else DictKey(k) for k in p) for p in new]
    return dict(zip(leaves, _tree.assign_names(keys)))


# ------------------------------------------------------------------ Orbax-native -> safetensors


def _placeholder(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    # A read-only zero-stride view: right dtype and shape, one element of memory.
    return np.broadcast_to(np.zeros((), dtype), shape)


def _as_jax(leaf: _schema.Leaf, jax_names: set[str]) -> _schema.Leaf:
    if isinstance(leaf, _schema.Tensor) and leaf.name in jax_names:
        return _schema.Tensor(leaf.name, _schema.ArrayKind.JAX, leaf.cast_from)
    return leaf


def _orbax_sharding(leaf: Any) -> dict[str, Any] | None:
    from orbax.checkpoint import metadata as ocp_metadata

    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, ocp_metadata.NamedShardingMetadata):
        return None
    types = getattr(sharding, "axis_types", None)  # (recorded by orbax-checkpoint 0.11.40 on)
    return _sharding.named_sharding_json(
        sharding.axis_names,
        np.asarray(sharding.shape).tolist(),
        sharding.partition_spec,
        axis_types=None if types is None else [getattr(t, "name", str(t)) for t in types],
    )


def to_safetensors_item(
    src: epath.Path,
    dst: epath.Path,
    unwrap_values: bool | None,
    max_file_size: int | None,
    batch_bytes: int,
    progress: bool | None,
    select: _select.Selection | None = None,
    dtype: _casting.Policy | None = None,
) -> tuple[int, int]:
    """Writes this library's item ``dst`` (created; partly written on failure) from the Orbax
    item ``src``, a batch of tensors in memory at a time; returns its tensors and bytes."""
    source = _orbax_source.OrbaxSource(src)
    collapse = unwrapped_paths(source, unwrap_values)
    saved_tree, wanted = source.tree, set(source.leaves)
    if select is not None:
        select.check(source.leaves, str(src))
        wanted = {n for n in source.leaves if select.selects(n)}
        saved_tree = source.select(wanted, lambda name, leaf: leaf)
    inline = source.restore([n for n in source.leaves if n in wanted and n not in source.tensors])
    orbax_name_of: dict[int, str] = {}

    def skeleton(keys: dict[str, str], unwrap: bool = True) -> Any:
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
        return _unwrap(tree, collapse) if unwrap else tree

    _, first, casts = _casting.apply_policy(_tree.capture(skeleton({})), dtype)
    to_orbax = {ours: orbax_name_of[id(v)] for ours, v in first.arrays.items()}
    specs = _casting.stored_specs(first.arrays, casts)
    plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata=_metadata.HEADER_METADATA)
    sizes = {s.name: s.nbytes for s in specs}
    key_impls: dict[str, str] = {}
    infos = [source.tensors[to_orbax[s.name]] for s in specs]
    groups = _plan.batched(infos, lambda t: t.nbytes, batch_bytes) or [[]]
    from_orbax = {v: k for k, v in to_orbax.items()}
    total = sum(sizes.values())
    dst.mkdir(parents=True, exist_ok=True)
    with progress_bar(total, f"convert {src.name}", progress) as bar:

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
                yield from _pieces.iter_host_pieces(plan, arrays)
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
        source, skeleton(key_impls), to_orbax, plan, specs, dtype, collapse
    )
    _checkpoint_save.finalize(dst, metadata, [share])
    return len(specs), total


def _safetensors_metadata(
    source: _orbax_source.OrbaxSource,
    tree: Any,
    to_orbax: dict[str, str],
    plan: _plan.CheckpointPlan,
    specs: list[_plan.TensorSpec],
    dtype: _casting.Policy | None,
    collapse: set[Any],
) -> dict[str, Any]:
    _, flat, casts = _casting.apply_policy(_tree.capture(tree), dtype)
    final_specs = _casting.stored_specs(flat.arrays, casts)
    if final_specs != specs:  # the same tree, keys in place of placeholders
        raise AssertionError("internal: tensor layout changed between planning and writing")
    jax_names = {
        ours
        for ours, orbax_name in to_orbax.items()
        if source.leaves[orbax_name][1].sharding is not None
    }
    schema = _schema.from_json(flat.schema)
    node = schema.tree
    if collapse:  # unwrapped: the collapsed dicts are recorded as NNX Variables
        node = _mark_variables(node, collapse)
    node = _schema.map_leaves(node, lambda leaf: _as_jax(leaf, jax_names))
    flat.schema = _schema.to_json(dataclasses.replace(schema, tree=node))
    shardings = {s.name: _orbax_sharding(source.leaves[to_orbax[s.name]][1]) for s in specs}
    return _metadata.build_metadata(
        plan, specs, flat.schema, shardings, {"converted_from": "orbax"}
    )


# ------------------------------------------------------------------ safetensors -> Orbax-native


def _restore_safetensors(
    src: epath.Path, select: _select.Selection | None = None
) -> tuple[Any, Any, int, int]:
    """The tree of a safetensors item, file or directory (only what ``select`` selects), its
    schema pruned alike (None for plain safetensors files), its tensor count and bytes."""
    kind = _steps.classify(src)
    source = _sources.open_source(src)
    include = (select.include or None) if select else None
    exclude = (select.exclude or None) if select else None
    if kind is PathKind.ITEM:
        # A checkpoint saved on devices this machine lacks (e.g. by a multi-host job) is
        # converted from this process's first device; Orbax then records that sharding.
        first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        tree = _standalone.restore_directory(
            src, fallback_sharding=first, include=include, exclude=exclude
        )
        schema = _read.read_metadata(src)["schema"]
    elif kind is PathKind.FILE:
        schema, _ = _read.file_index(src, _router.read_header(src))
        tree = _standalone.load_file(src, include=include, exclude=exclude)
    elif kind is PathKind.SAFETENSORS_DIR:
        if select is not None:
            select.check(source.tensors, str(src))
        schema, tree = None, None
    else:
        raise SafetensorsCheckpointError(f"{src} is {kind.noun}, not a safetensors checkpoint")
    pruned = _pruned(schema, select)
    if isinstance(pruned, _schema.Schema):  # an alias selected by its own name reads its tensor
        names = {leaf.tensor_name for leaf in pruned.leaves.values()}
    else:
        names = {n for n in source.tensors if select is None or select.selects(n)}
    infos = [t for n, t in source.tensors.items() if n in names]
    if tree is None:
        tree = source.read([t.name for t in infos])
    return tree, pruned, len(infos), sum(t.nbytes for t in infos)


def _pruned(schema: Any, select: _select.Selection | None) -> Any:
    """``schema`` cut down to what ``select`` selects, as the selective restore cuts it: typed,
    since a kept alias may point at a tensor not kept (restored by the alias's own name), which
    the checks of a JSON document refuse."""
    if select is None or schema is None:
        return schema
    return _tree.prune_schema(_schema.from_json(schema), select.selects)


class _Name(str):
    """A tensor leaf's name standing in for its value (told apart from inline strings)."""


class _VariableKey(str):
    """The ``"value"`` key of a dict that wraps an NNX Variable (found again by type)."""


_VALUE = _VariableKey(VALUE)


def _variable_names(tree: Any) -> tuple[Any, list[str]]:
    """``tree`` with plain keys, and the dotted Orbax names of its leaves that sit in a dict
    :func:`_wrap_variables` made."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    paths = [tuple(p) for p, _ in flat]
    names = _tree.assign_names(paths)
    wrapped = [
        n
        for n, p in zip(names, paths)
        if p and isinstance(getattr(p[-1], "key", None), _VariableKey)
    ]
    return _plain_keys(tree), wrapped


def _plain_keys(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {
            (str(k) if isinstance(k, _VariableKey) else k): _plain_keys(v) for k, v in tree.items()
        }
    if type(tree) in (list, tuple):
        return type(tree)(_plain_keys(v) for v in tree)
    return tree


def _wrap_variables(tree: Any, schema: Any, everything: bool) -> Any:
    """``tree`` (restored without a target from ``schema``) with each leaf saved as an NNX
    Variable (with ``everything``, each leaf) as a ``{"value": x}`` dict, as Orbax stores it."""
    if schema is None:  # a plain safetensors file: a flat dict, no Variables recorded
        if not everything:
            return tree
        return {k: {_VALUE: v} for k, v in tree.items()}

    def wrap(node: _schema.Node, inside_var: bool = False) -> _schema.Node:
        if isinstance(node, _schema.VarNode):
            return _schema.DictNode((_VALUE,), (wrap(node.child, inside_var=True),))
        if isinstance(
            node, (_schema.DictNode, _schema.ListNode, _schema.TupleNode, _schema.CustomNode)
        ):
            return _schema.with_children(node, tuple([wrap(c, inside_var) for c in node.children]))
        if everything and not inside_var and not isinstance(node, _schema.NoneNode):
            return _schema.DictNode((_VALUE,), (node,))
        return node

    if not isinstance(schema, _schema.Schema):
        schema = _schema.from_json(schema)
    names = _tree.unflatten(schema, lambda leaf: _Name(leaf.name))
    name_leaves = jax.tree_util.tree_leaves(names)
    value_leaves = jax.tree_util.tree_leaves(tree)
    if len(name_leaves) != len(value_leaves):  # pragma: no cover - the same schema built both
        raise AssertionError("internal: the restored tree does not follow its schema")
    values = {str(n): v for n, v in zip(name_leaves, value_leaves) if isinstance(n, _Name)}
    wrapped = _schema.Schema(wrap(schema.tree), schema.leaves, schema.version)
    return _tree.unflatten(wrapped, lambda leaf: values[leaf.name])


def _numpy_scalar_as_array(x: Any) -> Any:
    if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_)):
        return np.asarray(x)
    return x


def _describe(x: Any) -> str:
    # A leaf as the messages show it: ``float32[0,4]``, ``Python int``.
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return f"{x.dtype}[{','.join(str(d) for d in np.shape(x))}]"
    return f"Python {type(x).__name__}"


def _orbax_problem(x: Any) -> str | None:
    """Why Orbax cannot store the leaf ``x`` (None: it can)."""
    import tensorstore as ts

    if isinstance(x, bool) or not isinstance(x, (int, np.ndarray, np.generic, jax.Array)):
        return None
    if isinstance(x, int):
        if np.asarray(x).dtype == object:  # as Orbax turns a Python int into an array
            return f"Python int {x} lies outside int64 and uint64, which Orbax stores ints as"
        return None
    if _tree.is_prng_key(x):
        return None
    if x.size == 0:
        return f"{_describe(x)} holds no elements, and Orbax refuses zero-size arrays"
    try:
        ts.dtype(np.dtype(x.dtype).name)
    except ValueError:
        return f"{_describe(x)}: TensorStore, which Orbax writes arrays with, has no {x.dtype}"
    return None


_SHOWN = 10  # problems a refusal lists (one error line, however many leaves)


def check_orbax_storable(tree: Any, src: epath.Path) -> None:
    """Raises unless Orbax can store every leaf of ``tree`` (read from ``src``) apart: Orbax
    names each array by its keys joined with ``"."`` (``{"a.b": x, "a": {"b": y}}`` gives both
    ``a.b``, and one value would silently replace the other), refuses zero-size arrays, and
    writes arrays through TensorStore (no ``float6_*``) and ints as int64/uint64.

    Raises:
      UnsupportedLeafError: naming every such leaf (both paths of names that collide), its dtype
        and shape; nothing was written.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    seen: dict[str, tuple[Any, Any]] = {}
    problems = []
    for path, leaf in flat:
        name = ".".join(str(k) for k in raw_path(path))
        if name in seen:
            other, first = seen[name]
            problems.append(
                f"the leaves at {jax.tree_util.keystr(other)} ({_describe(first)}) and "
                f"{jax.tree_util.keystr(path)} ({_describe(leaf)}) both get the Orbax name "
                f"{name!r} (Orbax names a leaf by its keys joined with '.'), so one would "
                "overwrite the other; rename one of them"
            )
            continue
        seen[name] = (path, leaf)
        why = _orbax_problem(leaf)
        if why is not None:
            problems.append(f"{name!r}: {why}")
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise UnsupportedLeafError(
            f"{src} cannot be converted to Orbax-native (nothing was written): "
            + "; ".join(problems[:_SHOWN])
            + more
        )


def to_orbax_item(
    src: epath.Path,
    dst: epath.Path,
    progress: bool | None,
    wrap_values: bool | None = None,
    select: _select.Selection | None = None,
) -> tuple[int, int, str]:
    """Writes the Orbax item ``dst`` from the safetensors ``src`` (restored whole); returns its
    tensors, bytes and the typestr of the Orbax handler that wrote it (for the step's
    ``_CHECKPOINT_METADATA``)."""
    import orbax.checkpoint as ocp

    tree, schema, n, size = _restore_safetensors(src, select)
    if wrap_values is not False:
        tree = _wrap_variables(tree, schema, everything=bool(wrap_values))
    tree, variables = _variable_names(tree)
    check_orbax_storable(tree, src)  # before Orbax writes anything
    # A numpy scalar as the 0-d array StandardSave makes of it (PyTreeSave would store a Python
    # scalar, or refuse np.bool_), so it comes back as one whichever handler writes the item.
    tree = jax.tree_util.tree_map(_numpy_scalar_as_array, tree)
    # Converting back collapses exactly these.
    custom = {RECORD_KEY: {VARIABLES_KEY: sorted(variables)}}
    with progress_bar(size, f"convert {src.name}", progress) as bar:
        if any(isinstance(x, str) for x in jax.tree_util.tree_leaves(tree)):
            handler: Any = ocp.PyTreeCheckpointHandler()  # StandardSave refuses strings
            args: Any = ocp.args.PyTreeSave(tree, custom_metadata=custom)
        else:
            handler = ocp.StandardCheckpointHandler()
            args = ocp.args.StandardSave(tree, custom_metadata=custom)
        checkpointer = ocp.Checkpointer(handler)
        try:
            with _orbaxcompat.orbax_threads_joined_on_failure():
                checkpointer.save(_steps.absolute(dst), args=args, force=True)
        finally:
            checkpointer.close()
        bar.update(size)
    kind = type(handler)
    return n, size, f"{kind.__module__}.{kind.__qualname__}"
