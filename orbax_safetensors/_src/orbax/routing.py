"""Orbax's own args in a root that also holds safetensors steps: ``StandardSave`` /
``StandardRestore`` and ``PyTreeSave`` / ``PyTreeRestore`` go to Orbax's own handlers, which the
safetensors handler keeps (:class:`OrbaxRouter`), and one registry ties every args type of an
item to that handler (:func:`registry_for`).

Example::

    router = OrbaxRouter()
    if orbax_kind(args) is not None:
        return router.async_save(directory, args)   # an Orbax-native step
    ...
    if router.finalize(directory):                 # Orbax's handler saved it
        return
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Coroutine, Iterable
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat


class OrbaxKind(enum.StrEnum):
    """Which of Orbax's handlers takes an args object."""

    STANDARD = "standard"  # StandardSave / StandardRestore: StandardCheckpointHandler
    PYTREE = "pytree"  # PyTreeSave / PyTreeRestore: PyTreeCheckpointHandler


# Orbax's args types a safetensors item also takes in a mixed root (see registry_for).
ORBAX_ARGS = (
    ocp.args.StandardSave,
    ocp.args.StandardRestore,
    ocp.args.PyTreeSave,
    ocp.args.PyTreeRestore,
)


def orbax_kind(args: object) -> OrbaxKind | None:
    """The kind of Orbax's own args (a mixed root's), else None."""
    if isinstance(args, (ocp.args.StandardSave, ocp.args.StandardRestore)):
        return OrbaxKind.STANDARD
    if isinstance(args, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)):
        return OrbaxKind.PYTREE
    return None


class OrbaxRouter:
    """Orbax's own handlers, made when first needed, and which of them saved each item
    directory still to finalize. Thread-safe: one router serves any number of items and
    concurrent saves (each directory is one save)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: dict[OrbaxKind, Any] = {}
        self._saved: dict[str, Any] = {}  # item directory -> the Orbax handler that saved it

    def handler(self, kind: OrbaxKind | str) -> Any:
        """Orbax's handler for ``kind`` (made once, kept until :meth:`close`)."""
        kind = OrbaxKind(kind)
        with self._lock:
            handler = self._handlers.get(kind)
            if handler is None:
                make = (
                    ocp.StandardCheckpointHandler
                    if kind is OrbaxKind.STANDARD
                    else ocp.PyTreeCheckpointHandler
                )
                handler = self._handlers[kind] = make()
            return handler

    def _saving(self, directory: epath.Path, args: Any) -> Any:
        kind = orbax_kind(args)
        if kind is None:
            raise TypeError(f"not one of Orbax's args: {type(args).__name__}")
        handler = self.handler(kind)
        with self._lock:
            self._saved[str(directory)] = handler
        return handler

    def async_save(self, directory: epath.Path, args: Any) -> Coroutine[Any, Any, Any]:
        """Orbax's handler's ``async_save`` for Orbax's args; its finalize is remembered."""
        return _mesh_kept(self._saving(directory, args).async_save(directory, args=args))

    def save(self, directory: epath.Path, args: Any) -> None:
        """Orbax's handler's ``save`` for Orbax's args; its finalize is remembered."""
        with _jaxcompat.global_mesh_kept():
            self._saving(directory, args).save(directory, args=args)

    def forget(self, directory: epath.Path) -> None:
        """``directory`` is saved by another handler now (e.g. a retry with other args)."""
        with self._lock:
            self._saved.pop(str(directory), None)

    def finalize(self, directory: epath.Path) -> bool:
        """Finalizes ``directory`` if one of Orbax's handlers saved it; whether it did."""
        with self._lock:
            handler = self._saved.pop(str(directory), None)
        if handler is None:
            return False
        handler.finalize(directory)
        return True

    def close(self) -> None:
        """Closes Orbax's handlers (new ones are made if used again)."""
        with self._lock:
            handlers, self._handlers = list(self._handlers.values()), {}
        for handler in handlers:
            handler.close()


async def _mesh_kept(save: Coroutine[Any, Any, Any]) -> Any:
    # Orbax's save runs while this coroutine is awaited: a global mesh it leaves set (Orbax
    # 0.11.40 on jax 0.7, see jaxcompat.global_mesh_kept) is undone on the same thread.
    with _jaxcompat.global_mesh_kept():
        return await save


def registry_for(handler: Any, item: str, own_args: Iterable[type]) -> Any:
    """A ``CheckpointHandlerRegistry`` giving item ``item``'s ``own_args`` types and Orbax's
    (:data:`ORBAX_ARGS`) to ``handler``.

    One handler for every args type: Orbax finalizes, restores without args and reads metadata
    through one handler per item (the first or the last registered); ours passes Orbax's args
    to Orbax's handlers and reads either kind of step.
    """
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args_type in (*own_args, *ORBAX_ARGS):
        registry.add(item, args_type, handler)
    return registry
