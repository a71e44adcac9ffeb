"""``SafetensorsRestore``: the restore args of ``SafetensorsCheckpointHandler``.

Registered with the handler in :mod:`.v0` (as ``SafetensorsSave`` in :mod:`.save_args`), so a
``CheckpointManager`` routes it to the handler; :mod:`.restoring` translates it into the
pipeline's ``RestoreOptions``.

Example::

    state = mngr.restore(step, args=osf.SafetensorsRestore(abstract_state, partial_restore=True))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp

from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.orbax import args as _args
from orbax_safetensors._src.orbax import save_args as _save_args
from orbax_safetensors._src.orbax.tree_metadata import TreeMetadata
from orbax_safetensors._src.pipeline import export as _export
from orbax_safetensors._src.storage import config as _config


@dataclasses.dataclass(repr=False)
class SafetensorsRestore(ocp.args.CheckpointArgs):
    """Restore a safetensors checkpoint; Orbax's ``StandardRestore`` and ``PyTreeRestore``
    arguments, with their meanings.

    Attributes:
      item: None (the saved tree, rebuilt from its schema) or a target pytree whose leaves are
        arrays, numpy arrays, ``jax.ShapeDtypeStruct`` (with an optional sharding), Python
        scalars or ``ocp.ArrayRestoreArgs``; the result has the target's node types. A
        ``TreeMetadata`` (from ``handler.metadata`` or ``mngr.item_metadata``) works too.
      strict: as in ``StandardRestore``: an array whose stored shape differs from the
        target's raises (False: it is truncated or padded with zeros to the target's shape,
        same rank). Missing or unexpected keys are ``partial_restore``'s business.
      restore_args: as in ``PyTreeRestore``: a tree of ``ocp.RestoreArgs`` /
        ``ocp.ArrayRestoreArgs`` (e.g. from ``ocp.checkpoint_utils.construct_restore_args``).
        With ``item``, the structure (and the shapes and dtypes an ``ArrayRestoreArgs`` leaves
        open) come from ``item``, types, dtypes and shardings from ``restore_args``; alone, it
        is the target.
      partial_restore: as in ``PyTreeRestore``: restore only the target's keys (stored keys
        it lacks are not read); a target key the checkpoint lacks comes back as given.
        False: any key in one but not the other raises, naming them all.
      fallback_sharding: as in ``StandardRestore``: where an array goes whose saved sharding
        this job cannot reproduce (its devices are not all here) when the target gives none;
        None: that is an error naming the tensor.
      include, exclude: glob patterns (a string or a sequence) over dotted names, as in
        ``osf.load_file``: only the selected tensors are read. Without ``item`` the selected
        subtrees come back in their saved containers; with one, the patterns select among its
        leaves, and an unselected leaf comes back as given (as Orbax's ``PLACEHOLDER``).
      io_options: how this restore reads (``osf.IOOptions``: direct I/O mode, object-store
        options, tracing); None: the handler's.
      mapping: an ``osf.KeyMapping``: the item holds the mapping's PyTorch tensors (saved with
        ``SafetensorsSave(item, mapping=...)``, or any Hugging Face directory in an item);
        they are read back into ``item``'s layout (needed: arrays, ``jax.ShapeDtypeStruct``
        with shardings, numpy arrays, NNX variables), stacked and fused tensors joined, each
        process reading the byte ranges of its shards. ``partial_restore=True``: target
        leaves nothing maps to come back as given. ``restore_args``, ``include`` /
        ``exclude`` and ``fallback_sharding`` do not apply.

    The standalone ``load_file`` / ``load_model`` keep the safetensors and PyTorch meaning of
    ``strict`` (keys). Prints as a summary, never the arrays.
    """

    item: Any = None
    strict: bool = True
    restore_args: Any = None
    partial_restore: bool = False
    fallback_sharding: Any = None
    include: str | Sequence[str] | None = None
    exclude: str | Sequence[str] | None = None
    io_options: _config.IOOptions | None = None
    mapping: Any = None

    def __post_init__(self) -> None:
        _select.Selection.of(self.include, self.exclude)  # a bad pattern fails here
        if self.mapping is not None:
            _export.check_mapping(self.mapping)  # an unknown mapping type fails here
            unused = [
                n
                for n, v in (
                    ("restore_args", self.restore_args),
                    ("include", self.include),
                    ("exclude", self.exclude),
                    ("fallback_sharding", self.fallback_sharding),
                )
                if v is not None
            ]
            if self.item is None or unused:
                raise ValueError(
                    "SafetensorsRestore(mapping=...) restores into a target: give item= "
                    "(the JAX tree or its abstract tree)"
                    + (f"; {', '.join(unused)} do(es) not apply" if unused else "")
                )
        if isinstance(self.item, TreeMetadata) or _is_orbax_tree_metadata(self.item):
            self.item = self.item.tree
        if isinstance(self.restore_args, TreeMetadata) or _is_orbax_tree_metadata(
            self.restore_args
        ):
            self.restore_args = self.restore_args.tree

    def __repr__(self) -> str:
        def shown(value: Any, text: Any = repr) -> str | None:
            return None if value is None else text(value)

        return _args.args_repr(
            "SafetensorsRestore",
            [
                ("item", _args.tree_summary(self.item)),
                ("strict", str(self.strict)),
                ("restore_args", shown(self.restore_args, _args.tree_summary)),
                ("partial_restore", "True" if self.partial_restore else None),
                ("fallback_sharding", shown(self.fallback_sharding, str)),
                ("include", shown(self.include)),
                ("exclude", shown(self.exclude)),
                ("io_options", shown(self.io_options)),
                ("mapping", shown(self.mapping, lambda m: f"<{type(m).__name__}>")),
            ],
        )

    def __str__(self) -> str:
        return _save_args.with_registry_hint(repr(self))


def _is_orbax_tree_metadata(x: object) -> bool:
    # Orbax's own TreeMetadata (a runtime-checkable protocol of its private metadata module),
    # recognised by its members.
    return (
        x is not None
        and hasattr(x, "tree")
        and hasattr(x, "custom_metadata")
        and hasattr(type(x), "tree_flatten_with_keys")
    )
