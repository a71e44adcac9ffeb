"""``SafetensorsSave``: the args of a safetensors save under Orbax's ``CheckpointManager``,
validated where they are built (registered with the handler in ``v0.py``).

Example::

    mngr.save(step, args=osf.SafetensorsSave(state, custom_metadata={"epoch": 3}))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.orbax import args as _args
from orbax_safetensors._src.pipeline import checkpoint_save as _checkpoint_save
from orbax_safetensors._src.storage import config as _config

REGISTRY_HINT = (
    "an item that also takes Orbax's StandardSave/PyTreeSave args needs "
    "ocp.CheckpointManager(..., handler_registry=osf.handler_registry())"
)


@dataclasses.dataclass(repr=False)
class SafetensorsSave(ocp.args.CheckpointArgs):
    """Save ``item`` (any pytree) as safetensors; Orbax's ``StandardSave`` arguments.

    Attributes:
      item: the pytree to save.
      save_args: as in ``StandardSave``: a tree like ``item`` of ``ocp.SaveArgs`` (or None).
        ``SaveArgs(dtype=...)`` casts the leaf before saving, as Orbax does; the zarr
        options (``chunk_byte_size``, ``shard_axes``) and ``aggregate`` raise a
        ``ValueError`` saying what to do instead.
      custom_metadata: optional JSON-serialisable dict stored in ``orbax_safetensors.json``,
        returned by ``handler.metadata(...).custom_metadata`` (Orbax's name).
      metadata: the same as ``custom_metadata`` (this library's earlier name); pass one.
        ``custom_metadata`` holds the value either way.
      dtype: a save-time dtype policy, as in ``osf.save_file``: one dtype (every
        floating-point array is stored in it), a mapping of glob patterns over dotted names to
        a dtype or None (first match wins), or a callable ``(dotted_name, leaf) -> dtype |
        None``. Each tensor is cast as it is written (a synchronous save) or copied to host
        (an async save's snapshot holds the cast bytes), never as a cast copy of the whole
        state; each process casts its own shards. A bad policy raises here, before Orbax
        creates the step.
      io_options: how this save writes (``osf.IOOptions``: direct I/O mode, object-store
        options, tracing); None: the handler's.

    Prints as a summary (``SafetensorsSave(item=<dict: 12 leaves, 3.4 MiB>)``), never the
    arrays.
    """

    item: Any
    save_args: Any = None
    custom_metadata: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] | None = None
    dtype: Any = None
    io_options: _config.IOOptions | None = None
    _validated: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.custom_metadata is None:
            self.custom_metadata = self.metadata
        elif self.metadata is not None and self.metadata != self.custom_metadata:
            raise ValueError(
                "SafetensorsSave: pass custom_metadata (Orbax's name) or metadata, not both"
            )
        # Validate here, on the caller's line: once CheckpointManager.save() has started its
        # background step-directory creation, an error inside async_save can leave the process
        # waiting in Orbax's barriers at exit.
        item = _args.apply_save_args(self.item, self.save_args)
        self._validated = _checkpoint_save.validate_save(
            item, self.custom_metadata, dtype=self.dtype
        )

    @property
    def validated_tree(self) -> _checkpoint_save.ValidatedTree:
        """The tree as validated when these args were built (what the save writes)."""
        return self._validated  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        parts = [f"item={_args.tree_summary(self.item)}"]
        if self.save_args is not None:
            parts.append(f"save_args={_args.tree_summary(self.save_args)}")
        if self.custom_metadata is not None:
            parts.append(f"custom_metadata={_args.tree_summary(dict(self.custom_metadata))}")
        if self.dtype is not None:
            parts.append(_casting.parse_policy(self.dtype).describe())  # type: ignore[union-attr]
        if self.io_options is not None:
            parts.append(f"io_options={self.io_options!r}")
        return f"SafetensorsSave({', '.join(parts)})"

    def __str__(self) -> str:
        return with_registry_hint(repr(self))


def with_registry_hint(summary: str) -> str:
    """``summary`` followed by how to let an item take Orbax's args too."""
    # Orbax's only error for an item already tied to another handler is
    # 'Item "default" and args "{args}" does not match with any registered handler!': it
    # formats the args with str(), so the fix travels there (repr() stays the bare summary).
    return f"{summary} [{REGISTRY_HINT}]"
