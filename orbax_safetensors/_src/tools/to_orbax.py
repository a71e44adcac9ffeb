"""safetensors checkpoint (item, file or plain safetensors directory) -> Orbax-native item.

The tree is restored (host memory: the whole item) and saved with Orbax's
``StandardCheckpointHandler`` (``PyTreeCheckpointHandler`` when the tree holds strings, which
``StandardSave`` refuses). Leaves saved as ``nnx.Variable`` become ``{"value": x}`` dicts, as
Orbax stores them, so ``StandardCheckpointer().restore(path, abstract nnx.State)`` works; the
item's Orbax ``custom_metadata`` records which leaves those are, so converting it back gives
the same names (see ``nnx_values``).

Example::

    safetensors_item_to_orbax("/st/100/default", "/orbax/100/default")
    ocp.StandardCheckpointer().restore("/orbax/100/default", nnx.state(abstract_model))
"""

from __future__ import annotations

from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax.steps import PathKind
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.storage import router as _router
from orbax_safetensors._src.tools import convert_output as _output
from orbax_safetensors._src.tools import nnx_values as _nnx_values
from orbax_safetensors._src.tools import terminal as _terminal


def _has_strings(tree: Any) -> bool:
    return any(isinstance(x, str) for x in jax.tree_util.tree_leaves(tree))


def safetensors_item_to_orbax(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    wrap_values: bool | None = None,
    progress: bool | None = None,
    select: _select.Selection | None = None,
) -> _output.ConvertSummary:
    """Converts a safetensors checkpoint directory (or file) into an Orbax-native item.

    The whole item is restored in host memory, then saved with Orbax's
    ``StandardCheckpointHandler`` (``PyTreeCheckpointHandler`` when the tree holds strings);
    ``StandardRestore``/``StandardCheckpointer().restore(dst)`` read it back. The item's
    custom metadata records which leaves were NNX Variables, so converting it back to
    safetensors gives the names of ``src`` again.

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
    return _output.atomic(
        dst, lambda tmp: write_item(epath.Path(src), tmp, progress, wrap_values, select)[0]
    )


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
    if kind is PathKind.ITEM:
        # A checkpoint saved on devices this machine lacks (e.g. by a multi-host job) is
        # converted from this process's first device; Orbax then records that sharding.
        first = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        tree = _standalone.restore_directory(
            src, fallback_sharding=first, include=include, exclude=exclude
        )
        schema = _read.read_metadata(src)["schema"]
        return tree, _pruned(schema, select), n, size
    if kind is PathKind.FILE:
        schema, _ = _read.file_index(src, _router.read_header(src))
        tree = _standalone.load_file(src, include=include, exclude=exclude)
        return tree, _pruned(schema, select), n, size
    if kind is PathKind.SAFETENSORS_DIR:
        if select is not None:
            select.check(source.tensors, str(src))
        return source.read([t.name for t in infos]), None, n, size
    raise SafetensorsCheckpointError(f"{src} is {kind.noun}, not a safetensors checkpoint")


def _pruned(schema: Any, select: _select.Selection | None) -> Any:
    """``schema`` cut down to what ``select`` selects, as the selective restore cuts it."""
    if select is None or schema is None:
        return schema
    return _tree.prune_schema(schema, select.selects)


class _Name(str):
    """A tensor leaf's name standing in for its value (told apart from inline strings)."""


class _VariableKey(str):
    """The ``"value"`` key of a dict that wraps an NNX Variable (found again by type)."""


_VALUE = _VariableKey(_nnx_values.VALUE)


def variable_names(tree: Any) -> tuple[Any, list[str]]:
    """``tree`` with plain keys, and the dotted Orbax names of its leaves that sit in a dict
    :func:`wrap_variables` made (what ``nnx_values.custom_metadata`` records)."""
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


def wrap_variables(tree: Any, schema: Any, everything: bool) -> Any:
    """``tree`` (restored without a target from ``schema``) with each leaf saved as an NNX
    Variable (with ``everything``, each leaf) as a ``{"value": x}`` dict: what Orbax stores
    for an ``nnx.Variable``, and the path an abstract ``nnx.State`` asks Orbax for."""
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


def write_item(
    src: epath.Path,
    dst: epath.Path,
    progress: bool | None,
    wrap_values: bool | None = None,
    select: _select.Selection | None = None,
) -> tuple[_output.ConvertSummary, str]:
    """Writes the Orbax item ``dst`` from the safetensors ``src``
    (:func:`safetensors_item_to_orbax`' arguments); returns the summary and the typestr of the
    Orbax handler that wrote it (for the step's ``_CHECKPOINT_METADATA``)."""
    import orbax.checkpoint as ocp

    tree, schema, n, size = _restore_safetensors(src, select)
    if wrap_values is not False:
        tree = wrap_variables(tree, schema, everything=bool(wrap_values))
    tree, variables = variable_names(tree)
    custom = _nnx_values.custom_metadata(variables)  # converting back collapses exactly these
    strings = _has_strings(tree)
    with _terminal.progress_bar(size, f"convert {src.name}", progress) as bar:
        if strings:  # StandardSave refuses strings
            handler: Any = ocp.PyTreeCheckpointHandler()
            args: Any = ocp.args.PyTreeSave(tree, custom_metadata=custom)
        else:
            handler = ocp.StandardCheckpointHandler()
            args = ocp.args.StandardSave(tree, custom_metadata=custom)
        checkpointer = ocp.Checkpointer(handler)
        try:
            checkpointer.save(_steps.absolute(dst), args=args, force=True)
        finally:
            checkpointer.close()
        bar.update(size)
    summary = _output.ConvertSummary(_output.TO_ORBAX, [""], [], n, size)
    return summary, item_handler_typestr(_output.TO_ORBAX, strings)


def item_handler_typestr(direction: str, tree_has_strings: bool = False) -> str:
    """The handler typestr a step's ``_CHECKPOINT_METADATA`` records for a converted item."""
    if direction == _output.TO_SAFETENSORS:
        return _steps.HANDLER_TYPESTR
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler if tree_has_strings else ocp.StandardCheckpointHandler
    return f"{handler.__module__}.{handler.__qualname__}"
