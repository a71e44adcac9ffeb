"""Orbax-native PyTree item (``StandardSave``/``PyTreeSave``, OCDBT or not) -> safetensors
checkpoint directory.

The tree is read from Orbax's own metadata (no target needed); tensors keep Orbax's dotted
names and are streamed a batch at a time (Orbax's ``partial_restore``) into the planned files,
so memory stays bounded by the batch size, not the checkpoint size. Python scalars stay inline
in the schema; typed PRNG keys stay keys; saved ``NamedSharding`` layouts are recorded. An
``nnx.State`` saved by Orbax (each Variable a ``{"value": x}`` dict) gets the names
``nnx.state(model)`` has here, its leaves recorded as Variables (see ``nnx_values``).

Example::

    orbax_item_to_safetensors("/orbax/100/default", "/st/100/default")
    tree = osf.restore_directory("/st/100/default")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import orbax_source as _orbax_source
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.tools import convert_output as _output
from orbax_safetensors._src.tools import nnx_values as _nnx_values
from orbax_safetensors._src.tools import terminal as _terminal


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
    return _sharding.named_sharding_json(
        sharding.axis_names, np.asarray(sharding.shape).tolist(), sharding.partition_spec
    )


def orbax_item_to_safetensors(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    unwrap_values: bool | None = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
    progress: bool | None = None,
    select: _select.Selection | None = None,
    dtype: _casting.DtypePolicy | None = None,
) -> _output.ConvertSummary:
    """Converts one Orbax-native PyTree item into a safetensors checkpoint directory.

    Args:
      src: the Orbax item directory (it holds ``_METADATA``).
      dst: the checkpoint directory to create (must not exist, or be empty).
      unwrap_values: collapse ``{"value": x}`` dicts (Orbax's form of ``nnx.Variable``) so the
        names match ``nnx.state(model)`` here (``layers.0.kernel``, not ``...kernel.value``),
        recording those leaves as Variables. None (default): when the item is an
        ``nnx.State`` (every leaf so wrapped) or ``convert`` recorded its Variables; True:
        every such dict; False: none.
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
    return _output.atomic(
        dst,
        lambda tmp: write_item(
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


def unwrapped_paths(source: _orbax_source.OrbaxSource, unwrap_values: bool | None) -> set[Any]:
    """The paths of the ``{"value": x}`` dicts of ``source`` to collapse (``nnx_values``)."""
    leaves = {n: _nnx_values.raw_path(kp) for n, (kp, _) in source.leaves.items()}
    recorded = _nnx_values.recorded_variables(source.path)
    return _nnx_values.unwrapped_paths(leaves, source.tree, unwrap_values, recorded)


def write_item(
    src: epath.Path,
    dst: epath.Path,
    unwrap_values: bool | None,
    max_file_size: int | None,
    batch_bytes: int,
    progress: bool | None,
    select: _select.Selection | None = None,
    dtype: _casting.Policy | None = None,
) -> _output.ConvertSummary:
    """Writes the safetensors item ``dst`` (a directory, created) from the Orbax item ``src``
    (:func:`orbax_item_to_safetensors`' arguments); ``dst`` appears partly written on failure,
    so callers write into a temporary directory."""
    source = _orbax_source.OrbaxSource(src)
    collapse = unwrapped_paths(source, unwrap_values)
    saved_tree = source.tree
    if select is not None:
        select.check(source.leaves, str(src))
        wanted = {n for n in source.leaves if select.selects(n)}
        saved_tree = _orbax_source.select_leaves(
            source.tree, wanted, source.name_of_path(), lambda leaf: leaf
        )
    inline_names = [n for n in source.leaves if n not in source.tensors]
    if select is not None:
        inline_names = [n for n in inline_names if select.selects(n)]
    inline = source.restore(inline_names)
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
        return _nnx_values.unwrap(tree, collapse) if unwrap else tree

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
        collapse,
    )
    _checkpoint_save.finalize(dst, metadata, [share])
    return _output.ConvertSummary(_output.TO_SAFETENSORS, [""], [], len(specs), total)


def _safetensors_metadata(
    source: _orbax_source.OrbaxSource,
    tree: Any,
    to_orbax: dict[str, str],
    plan: _plan.CheckpointPlan,
    specs: list[_plan.TensorSpec],
    dtype: _casting.Policy | None,
    collapse: set[Any],
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
    schema = _schema.from_json(flat.schema)
    node = schema.tree
    if collapse:  # unwrapped: the collapsed dicts are recorded as NNX Variables
        node = _nnx_values.mark_variables(node, collapse)
    node = _schema.map_leaves(node, lambda leaf: _as_jax(leaf, jax_names))
    flat.schema = _schema.to_json(dataclasses.replace(schema, tree=node))
    shardings = {s.name: _orbax_sharding(source.leaves[to_orbax[s.name]][1]) for s in specs}
    return _metadata.build_metadata(
        plan, specs, flat.schema, shardings, {"converted_from": "orbax"}
    )
