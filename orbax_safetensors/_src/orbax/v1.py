"""The Orbax v1 plugin: ``SafetensorsHandler``, a ``CheckpointableHandler`` for pytrees.

Thin glue over the v0 handler's save job and restore (the same validation, host copies, files,
checksums, multi-host writes and reads): what v1 adds is the ordering Orbax's v0
``AsyncCheckpointer`` does for a v0 handler: wait for every process's writes, finalize the job
on the primary, wait again. Needs orbax-checkpoint's v1 API (0.12.8); on an older Orbax the
module imports, and the handler and :func:`register_handler` raise an ``ImportError`` naming
the version.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp_v0
from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import errors as _errors
from orbax_safetensors._src.orbax import args as _args
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.orbax import v0 as _v0
from orbax_safetensors._src.pipeline import save_job as _save_job
from orbax_safetensors._src.pipeline.restore_options import Words

# The typestr Orbax records for this handler (``{__module__}.{__qualname__}``): the public
# name, so that a checkpoint does not record this private module's path.
HANDLER_TYPESTR = "orbax_safetensors.SafetensorsHandler"
# Typestrs that load through this handler: the v0 handler's, so CheckpointManager steps saved
# with SafetensorsSave load through ocp.load / ocp.load_checkpointables.
SECONDARY_TYPESTRS = (_steps.HANDLER_TYPESTR,)
# The checkpointable name ocp.save / ocp.load give the pytree.
STATE_NAME = "state"

# Barrier names: every process saves in the same order, so the n-th save has the same name
# everywhere.
_save_counter = itertools.count()


_PARTIAL_LOAD = "ctx.pytree.loading.partial_load = True"
_PAD_OR_TRUNCATE = "ctx.array.loading.enable_padding_and_truncation = True"


def _words(options: _orbaxcompat.V1LoadingOptions) -> Words:
    """The mismatch wording in v1's option names (SafetensorsRestore's is v0's)."""
    keys = f"set {_PARTIAL_LOAD} on the ocp.Context to load only the abstract keys"
    missing = f"set {_PARTIAL_LOAD} on the ocp.Context to return them as given"
    shape = f"set {_PAD_OR_TRUNCATE} on the ocp.Context you load in, to pad or truncate it"
    if not options.readable:
        unread = (
            " (this orbax-checkpoint's active Context could not be read here, so its "
            "loading options were not applied)"
        )
        keys, missing, shape = keys + unread, missing + unread, shape + unread
    return Words(keys=keys, missing=missing, shape=shape)


class SafetensorsHandler:
    """An Orbax v1 ``CheckpointableHandler`` storing a pytree as standard safetensors files plus
    ``orbax_safetensors.json``: exactly what ``SafetensorsCheckpointHandler`` stores.

    Register it globally with :func:`register_handler`, or per context with
    :func:`local_registry` (both also take over the ``"state"`` checkpointable that ``ocp.save``
    uses). Orbax constructs it without arguments: for options, register a subclass.

    Args:
      handler: the ``SafetensorsCheckpointHandler`` doing the work (its file size,
        checksums, primary host...); default ``SafetensorsCheckpointHandler()``.
      dtype: a save-time dtype policy for every save, as ``SafetensorsSave(dtype=...)`` takes
        it (Orbax v1's ``StorageOptions.dtype`` is not read).
      mapping: an ``osf.KeyMapping``: every save writes a Hugging Face model directory and
        every load reads one into the abstract tree's layout, as
        ``SafetensorsSave(item, mapping=...)`` / ``SafetensorsRestore(target, mapping=...)``.
      hf_config: with ``mapping``: as ``SafetensorsSave(hf_config=...)``.
      generation_config: with ``mapping``: as ``SafetensorsSave(generation_config=...)``.

    Example::

        class SmallFiles(osf.SafetensorsHandler):
            def __init__(self):
                super().__init__(osf.SafetensorsCheckpointHandler(max_file_size=1 << 30))

        class Servable(osf.SafetensorsHandler):  # a Hugging Face model directory
            def __init__(self):
                super().__init__(mapping=osf.preset_mapping("llama"), hf_config=config)
    """

    SECONDARY_TYPESTRS = SECONDARY_TYPESTRS

    def __init__(
        self,
        handler: _v0.SafetensorsCheckpointHandler | None = None,
        *,
        dtype: _casting.DtypePolicy | None = None,
        mapping: Any = None,
        hf_config: Any = None,
        generation_config: Any = None,
    ) -> None:
        _orbaxcompat.orbax_v1("orbax_safetensors.SafetensorsHandler")
        self._v0 = handler if handler is not None else _v0.SafetensorsCheckpointHandler()
        policy = _casting.parse_policy(dtype)
        _args.hf_mapping(
            "SafetensorsHandler",
            mapping,
            hf_config=hf_config,
            generation_config=generation_config,
        )
        # What every save passes to SafetensorsSave.
        self._save_options = {
            "dtype": policy,
            "mapping": mapping,
            "hf_config": hf_config,
            "generation_config": generation_config,
        }

    async def save(self, directory: Any, checkpointable: Any) -> Awaitable[None]:
        """Validates ``checkpointable`` and copies this process's shards to host (on the
        caller's thread); the returned awaitable writes, then finalizes on the primary."""
        args = _v0.SafetensorsSave(checkpointable, **self._save_options)
        job = self._v0.new_job(epath.Path(directory.path), args, _save_job.SaveMode.SNAPSHOT)
        commit_futures = _v0.start_save(job)
        barrier = f"orbax_safetensors_v1_save_{next(_save_counter)}"
        return self._background_save(directory, job, commit_futures, barrier)

    async def _background_save(
        self, directory: Any, job: _save_job.SaveJob, commit_futures: list[Any], barrier: str
    ) -> None:
        path = epath.Path(await directory.await_creation())
        for future in commit_futures:
            await asyncio.to_thread(future.result)
        await _sync_processes(f"{barrier}_written")
        if job.processes.is_primary:
            await asyncio.to_thread(job.finalize)
            await asyncio.to_thread(_write_pytree_marker, path)
        await _sync_processes(f"{barrier}_finalized")

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        """Returns an awaitable that reads the tree: into ``abstract_checkpointable``'s
        structure, shapes, dtypes and shardings, or (None) the saved tree as saved."""
        # Read on the caller's thread, inside its ``with ocp.Context(...)``.
        options = _orbaxcompat.v1_loading_options()
        args = _v0.SafetensorsRestore(
            abstract_checkpointable,
            strict=not options.pad_or_truncate,
            partial_restore=options.partial_load,
            mapping=self._save_options["mapping"],
        )
        path = epath.Path(directory)
        return asyncio.to_thread(self._v0.restore_safetensors, path, args, words=_words(options))

    async def metadata(self, directory: Any) -> Any:
        """The saved tree with ``jax.ShapeDtypeStruct`` leaves; reads no tensor bytes."""
        metadata = self._v0.metadata(epath.Path(directory))
        return metadata.tree if isinstance(metadata, _args.TreeMetadata) else metadata

    def is_handleable(self, checkpointable: Any) -> bool:
        """True for a pytree this handler can save (a ``SafetensorsSave`` accepts it)."""
        if checkpointable is None or _is_stateful(checkpointable):
            return False
        try:
            _v0.SafetensorsSave(checkpointable)
        except (_errors.SafetensorsCheckpointError, ValueError, TypeError):
            return False
        return True

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """True for a pytree of arrays, ``jax.ShapeDtypeStruct``, scalars, strings and
        ``ocp.PLACEHOLDER`` (a restore target); None (defer to the saved typestr) for anything
        else."""
        if _is_stateful(abstract_checkpointable):
            return False
        leaves = jax.tree.leaves(abstract_checkpointable)
        return (bool(leaves) and all(isinstance(x, _ABSTRACT_LEAVES) for x in leaves)) or None


SafetensorsHandler.__module__ = "orbax_safetensors"  # the recorded typestr (HANDLER_TYPESTR)

# A restore target's leaves: str loads the saved string, Orbax's PLACEHOLDER (``...``) skips its
# leaf, as SafetensorsRestore takes them.
_ABSTRACT_LEAVES = (
    jax.Array,
    jax.ShapeDtypeStruct,
    np.ndarray,
    np.generic,
    int,
    float,
    bool,
    str,
    type(...),
)


def _write_pytree_marker(path: epath.Path) -> None:
    # ocp.load finds the pytree of a checkpoint by the "_METADATA" file Orbax's PyTreeHandler
    # writes (orbax_layout.has_pytree_metadata_file), whatever handler then loads it. This one
    # only says what the item is: Orbax's own PyTreeHandler cannot read it as a tree (it has
    # no "tree_metadata"), and this library reads orbax_safetensors.json first.
    marker = {
        "format": "orbax_safetensors",
        "note": (
            "safetensors files plus orbax_safetensors.json: load with orbax_safetensors "
            "(osf.SafetensorsHandler, or SafetensorsRestore under CheckpointManager)"
        ),
    }
    (path / _steps.ORBAX_METADATA_FILE).write_text(json.dumps(marker, indent=1))


def _is_stateful(obj: Any) -> bool:
    # Orbax's StatefulCheckpointable (objects that save themselves): never ours.
    return callable(getattr(obj, "save", None)) and callable(getattr(obj, "load", None))


async def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        await asyncio.to_thread(ocp_v0.multihost.sync_global_processes, name)


def register_handler(
    handler_type: type[SafetensorsHandler] | None = None, *, checkpointable_name: str | None = None
) -> None:
    """Registers :class:`SafetensorsHandler` in Orbax v1's global registry, with the v0
    handler's typestr as a secondary typestr (so ``CheckpointManager`` steps saved with
    ``SafetensorsSave`` load too).

    Args:
      handler_type: :class:`SafetensorsHandler` (default) or a subclass of it.
      checkpointable_name: only for checkpointables of this name; None: any pytree, and
        ``"state"``, the name ``ocp.save``, ``ocp.load`` and ``ocp.training.Checkpointer``
        use (Orbax's own ``PyTreeHandler`` had it; it keeps loading Orbax-native items by
        their typestr).

    Example::

        osf.register_handler()
        ocp.save(path, state)  # safetensors files plus orbax_safetensors.json
    """
    v1 = _orbaxcompat.orbax_v1("orbax_safetensors.register_handler")
    handler_type = handler_type or SafetensorsHandler
    registry = v1.handlers.global_registry()
    secondary = _secondary_typestrs(handler_type)
    if checkpointable_name is None:
        if handler_type not in [t for t, name in registry.get_all_entries() if not name]:
            registry.add(handler_type, secondary_typestrs=secondary)
        checkpointable_name = STATE_NAME
    _orbaxcompat.replace_named_handler(registry, checkpointable_name, handler_type, secondary)


def _secondary_typestrs(handler_type: type[SafetensorsHandler]) -> list[str]:
    # A subclass also loads what SafetensorsHandler itself saved.
    extra = [HANDLER_TYPESTR] if handler_type is not SafetensorsHandler else []
    return [*SECONDARY_TYPESTRS, *extra]


def local_registry(
    handler_type: type[SafetensorsHandler] | None = None, *, include_global_registry: bool = True
) -> Any:
    """A new Orbax v1 registry (``ocp.handlers.local_registry()``) in which
    :class:`SafetensorsHandler` handles any pytree and the ``"state"`` checkpointable, for one
    ``ocp.Context``; the global registry is left alone.

    Args:
      handler_type: :class:`SafetensorsHandler` (default) or a subclass of it.
      include_global_registry: keep the globally registered handlers (Orbax's own, for
        Orbax-native items and other checkpointables), minus the one for ``"state"``.

    Example::

        ctx = ocp.Context()
        ctx.checkpointables.registry = osf.local_registry()
        with ctx:
            ocp.save(path, state)
            state = ocp.load(path, abstract_state)
    """
    v1 = _orbaxcompat.orbax_v1("orbax_safetensors.local_registry")
    handler_type = handler_type or SafetensorsHandler
    source = v1.handlers.global_registry() if include_global_registry else None
    registry = v1.handlers.local_registry(include_global_registry=False)
    secondary = _secondary_typestrs(handler_type)
    if source is not None:
        # Orbax's entries (its PyTreeHandler still loads Orbax-native items by typestr),
        # except the one for "state" and any of ours.
        for entry, name in source.get_all_entries():
            if name == STATE_NAME or issubclass(entry, SafetensorsHandler):
                continue
            registry.add(
                entry,
                checkpointable_name=name,
                secondary_typestrs=source.get_secondary_typestrs(entry) or None,
            )
    registry.add(handler_type, secondary_typestrs=secondary)
    registry.add(handler_type, checkpointable_name=STATE_NAME, secondary_typestrs=secondary)
    return registry
