"""Every private or version-dependent Orbax name the package touches, in one place.

The supported stacks (orbax-checkpoint 0.11.11 to 0.12) differ in what they offer. Each name is
looked up here, behind a guard, with a fallback that gives the same results
(``tests/orbax/test_compat.py`` checks each on every CI stack); Orbax is imported by the
functions, never with the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import re
import threading
from collections.abc import Iterator
from typing import Any


def _installed_orbax() -> str:
    """The installed orbax-checkpoint's version, read without importing it ("unknown": none)."""
    try:
        return importlib.metadata.version("orbax-checkpoint")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover (a required dependency)
        return "unknown"


# -- PyTreeRestore(partial_restore=True) (newer than orbax-checkpoint 0.11.11) ----------------


def pytree_partial_restore(item: Any, restore_args: Any) -> Any:
    """``ocp.args.PyTreeRestore`` restoring only the leaves ``item`` holds (through an empty
    ``transforms`` on an Orbax without ``partial_restore``)."""
    import orbax.checkpoint as ocp

    fields = {f.name for f in dataclasses.fields(ocp.args.PyTreeRestore)}
    if "partial_restore" in fields:
        return ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return pytree_partial_restore_fallback(item, restore_args)


def pytree_partial_restore_fallback(item: Any, restore_args: Any) -> Any:
    """:func:`pytree_partial_restore` through ``transforms={}`` (every supported Orbax)."""
    import orbax.checkpoint as ocp

    return ocp.args.PyTreeRestore(item=item, restore_args=restore_args, transforms={})


# -- which steps Orbax lists as committed (changed in orbax-checkpoint 0.12.3) ----------------

# The first Orbax whose all_steps() asks the manager's TemporaryPath class.
ORBAX_CLASS_AWARE_COMMIT = (0, 12, 3)


@functools.cache
def orbax_uses_legacy_commit_rule() -> bool:
    """Whether the installed orbax-checkpoint (its distribution's version: no import) is older
    than 0.12.3, whose ``all_steps()`` lists every final-named step directory except one on
    gs:// without ``commit_success.txt``, whatever the manager's ``temporary_path_class``."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", _installed_orbax())
    return m is not None and tuple(int(g) for g in m.groups()) < ORBAX_CLASS_AWARE_COMMIT


# -- Orbax's v1 API (orbax.checkpoint.v1; save / save_async / load in orbax-checkpoint 0.12.8) --

# The oldest orbax-checkpoint whose v1 API this package is tested with.
ORBAX_V1_TESTED = "0.12.8"
# What the v1 handler uses of ``orbax.checkpoint.v1``.
ORBAX_V1_NAMES = ("save", "save_async", "load", "handlers")


def orbax_v1(what: str = "the Orbax v1 API") -> Any:
    """The ``orbax.checkpoint.v1`` module, or an ``ImportError`` saying which version ``what``
    needs when the installed orbax-checkpoint lacks it (or one of :data:`ORBAX_V1_NAMES`).
    """
    installed = _installed_orbax()
    try:
        from orbax.checkpoint import v1
    except ImportError as e:
        raise ImportError(
            f"{what} needs orbax-checkpoint >= {ORBAX_V1_TESTED} (its orbax.checkpoint.v1 API); "
            f"the installed orbax-checkpoint {installed} has no orbax.checkpoint.v1. "
            f"Upgrade with: pip install 'orbax-checkpoint>={ORBAX_V1_TESTED},<0.13'"
        ) from e
    missing = [name for name in ORBAX_V1_NAMES if not hasattr(v1, name)]
    if missing:
        raise ImportError(
            f"{what} needs orbax-checkpoint >= {ORBAX_V1_TESTED}; the installed orbax-checkpoint "
            f"{installed} has an orbax.checkpoint.v1 without "
            + ", ".join(f"ocp.v1.{name}" for name in missing)
            + f". Upgrade with: pip install 'orbax-checkpoint>={ORBAX_V1_TESTED},<0.13'"
        )
    return v1


def has_orbax_v1() -> bool:
    """Whether the installed orbax-checkpoint has the v1 API :func:`orbax_v1` gives."""
    try:
        orbax_v1()
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class V1LoadingOptions:
    """What a v1 ``load`` takes from the active ``ocp.Context``.

    Attributes:
      partial_load: ``PyTreeOptions.Loading.partial_load``: load only the abstract tree's keys.
      pad_or_truncate: ``ArrayOptions.Loading.enable_padding_and_truncation``.
      readable: False when this orbax-checkpoint's context could not be read (then both are
        False, and a mismatch raises instead of being tolerated: never a silent change).
    """

    partial_load: bool = False
    pad_or_truncate: bool = False
    readable: bool = True


def v1_loading_options() -> V1LoadingOptions:
    """The loading options of the active v1 ``ocp.Context`` (Orbax's defaults outside one),
    read as Orbax's own handlers read them, from a private module the v1 API does not export;
    if it moves, the defaults apply with ``readable=False``."""
    try:
        from orbax.checkpoint.experimental.v1._src.context import context as v1_context

        active = v1_context.get_context()
        return V1LoadingOptions(
            partial_load=bool(active.pytree_options.loading.partial_load),
            pad_or_truncate=bool(active.array_options.loading.enable_padding_and_truncation),
        )
    except (ImportError, AttributeError, TypeError):
        return V1LoadingOptions(readable=False)


def replace_named_handler(
    registry: Any, name: str, handler_type: type, secondary_typestrs: list[str]
) -> None:
    """Makes ``handler_type`` the handler of checkpointable ``name`` in a v1 registry that may
    hold another (the global one gives ``"state"`` to ``PyTreeHandler``, and ``add`` refuses a
    second entry) by dropping the old entry from its private list; a ``ValueError`` saying to
    register per context where there is no such list."""
    entries = getattr(registry, "_registry", None)
    if registry.has(name):
        if not isinstance(entries, list):
            raise ValueError(
                f"cannot replace the handler Orbax registered for checkpointable {name!r} in "
                f"this orbax-checkpoint's registry: register per context instead, with "
                f"ctx.checkpointables.registry = osf.local_registry()"
            )
        entries[:] = [entry for entry in entries if entry[1] != name]
    registry.add(handler_type, checkpointable_name=name, secondary_typestrs=secondary_typestrs)


# -- the TensorStore spec of an Orbax array (ocp.type_handlers, public; moved across versions) --


def array_read_spec(
    directory: Any,
    name: str,
    *,
    use_zarr3: bool,
    use_ocdbt: bool,
    fill_missing: bool,
    context: Any = None,
) -> dict[str, Any] | None:
    """The TensorStore spec (JSON) with which Orbax's restore opens the array ``name`` of the
    item ``directory`` (an ``epath.Path``; ``context``: its ``tensorstore.Context``), built by
    ``ocp.type_handlers.get_json_tspec_read``; None where that helper or its ``ParamInfo`` take
    other fields (then read through Orbax's restore: the same values).
    """
    try:
        import orbax.checkpoint as ocp

        handlers = ocp.type_handlers
        info = handlers.ParamInfo(
            name=name,
            path=directory / name,
            parent_dir=directory,
            use_zarr3=use_zarr3,
            ts_context=context,
        )
        spec = handlers.get_json_tspec_read(
            info, use_ocdbt=use_ocdbt, raise_array_data_missing_error=not fill_missing
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return dict(spec) if isinstance(spec, dict) else None


# -- Orbax's background writes (its threads, by their classes' module) -----------------------


@contextlib.contextmanager
def orbax_threads_joined_on_failure() -> Iterator[None]:
    """On an exception inside, waits for the background threads Orbax started meanwhile before
    passing it on: a save that fails part way has started writing other arrays, which would
    otherwise go on writing (recreating directories) after the caller removed its output."""
    before = set(threading.enumerate())
    try:
        yield
    except BaseException:
        for thread in threading.enumerate():
            if thread not in before and type(thread).__module__.startswith("orbax."):
                # Thread's own join: Orbax's re-raises the thread's error in place of this one
                # (its waits for other processes end at Orbax's coordination timeout).
                threading.Thread.join(thread)
        raise
