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
from orbax_safetensors._src.pipeline import export as _export
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
        a dtype, None or ``"keep"`` (first match wins), or a callable ``(dotted_name, leaf) ->
        dtype | None | "keep"``; ``"keep"`` alone keeps every dtype. With ``mapping``, the
        names are the item's (JAX-side) dotted names. Each tensor is cast as it is written (a synchronous save) or copied to host
        (an async save's snapshot holds the cast bytes), never as a cast copy of the whole
        state; each process casts its own shards. A bad policy raises here, before Orbax
        creates the step.
      io_options: how this save writes (``osf.IOOptions``: direct I/O mode, object-store
        options, tracing); None: the handler's.
      mapping: an ``osf.KeyMapping``: the item is written as a Hugging Face model directory
        (the mapping's PyTorch names and layouts, header format ``pt``, shards plus
        ``model.safetensors.index.json`` above the handler's ``max_file_size``), which
        ``transformers``' ``from_pretrained`` loads, plus ``orbax_safetensors.json``. Renames,
        transposes, stacked-layer and fused splits, LoRA merges and casts happen on the writer
        thread, from the host copies: ``save()`` waits for the copies only. Tied keys are not
        written. Every name that does not fit raises here, all at once. In a multi-process
        job every process calls ``save()`` and writes only its own bytes: each shard is
        mapped on its own (renames, transposes, stacked layers, fused parts, LoRA merges from
        the gathered rank-sized adapters, bit-identical to a one-process save), other
        transforms re-lay each tensor out on the devices during ``save()``; no gather of the
        model (a local or network file system; object storage is refused).
        ``SafetensorsRestore(target, mapping=...)`` reads it back into the JAX layout.
      hf_config: with ``mapping``: a transformers config object, a dict, or a path (a
        ``config.json``, or a model directory whose ``generation_config.json`` and tokenizer
        files are copied too), written as ``osf.export_pytorch`` writes it: ``config.json``
        as ``save_pretrained`` writes it (its ``dtype`` the stored dtype),
        ``generation_config.json``, the tokenizer's files. Read here, on the caller's line.
      generation_config: with ``mapping``: a transformers ``GenerationConfig``, a dict or a
        path, written as ``generation_config.json`` (default: as ``osf.export_pytorch``).

    Prints as a summary (``SafetensorsSave(item=<dict: 12 leaves, 3.4 MiB>)``), never the
    arrays.
    """

    item: Any
    save_args: Any = None
    custom_metadata: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] | None = None
    dtype: Any = None
    io_options: _config.IOOptions | None = None
    mapping: Any = None
    hf_config: Any = None
    generation_config: Any = None
    _validated: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _export: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

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
        if self.mapping is None:
            for name in ("hf_config", "generation_config"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"SafetensorsSave: {name}= writes a file of a Hugging Face model "
                        "directory, which needs mapping= (an osf.KeyMapping)"
                    )
            self._validated = _checkpoint_save.validate_save(
                item, self.custom_metadata, dtype=self.dtype
            )
            return
        # The policy names the item's tensors; the export plan applies it to their outputs.
        mapping = _export.check_mapping(self.mapping)
        self._validated = _checkpoint_save.validate_save(item, self.custom_metadata)
        self._export = mapping.export_plan(
            self._validated,
            self.dtype,
            self.hf_config,
            generation_config=self.generation_config,
        )

    @property
    def validated_tree(self) -> _checkpoint_save.ValidatedTree:
        """The tree as validated when these args were built (what the save writes)."""
        return self._validated  # type: ignore[no-any-return]

    @property
    def export_plan(self) -> _export.ExportPlan | None:
        """With ``mapping``: the tensors the save writes instead of the item's."""
        return self._export  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        policy = _casting.parse_policy(self.dtype)
        custom = self.custom_metadata
        return _args.args_repr(
            "SafetensorsSave",
            [
                ("item", _args.tree_summary(self.item)),
                (
                    "save_args",
                    None if self.save_args is None else _args.tree_summary(self.save_args),
                ),
                ("custom_metadata", None if custom is None else _args.tree_summary(dict(custom))),
                ("dtype", None if policy is None else policy.describe().removeprefix("dtype=")),
                ("io_options", None if self.io_options is None else repr(self.io_options)),
                ("mapping", None if self._export is None else f"<{self._export.summary}>"),
            ],
        )

    def __str__(self) -> str:
        return with_registry_hint(repr(self))


def with_registry_hint(summary: str) -> str:
    """``summary`` followed by how to let an item take Orbax's args too."""
    # Orbax's only error for an item already tied to another handler is
    # 'Item "default" and args "{args}" does not match with any registered handler!': it
    # formats the args with str(), so the fix travels there (repr() stays the bare summary).
    return f"{summary} [{REGISTRY_HINT}]"
