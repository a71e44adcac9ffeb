"""How ``SafetensorsSave(item, mapping=...)`` and ``SafetensorsRestore(target, mapping=...)``
reach a mapping type that a higher layer defines.

The Orbax layer may not import ``integrations/`` (where ``KeyMapping`` lives), so a mapping
type registers two hooks here, as Orbax registers args classes with their handler:
``export_plan`` compiles the mapping, on the caller's line, into a neutral
``pipeline/export_plan.ExportPlan`` that the save job runs on its writer thread; ``restore``
reads a saved item back into a target's layout. ``integrations/publish.py`` registers
``KeyMapping`` when the package is imported.

Example::

    register_mapping(KeyMapping, MappingHooks(export_plan=compile_plan, restore=restore_item))
    hooks_for(mapping).export_plan(mapping, validated, dtype, hf_config, generation_config=None)
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from orbax_safetensors._src.pipeline import export_plan as _export_plan


@dataclasses.dataclass(frozen=True)
class MappingHooks:
    """What a mapping type does for the Orbax args.

    Attributes:
      export_plan: ``(mapping, validated tree, dtype policy, hf_config, *,
        generation_config) -> ExportPlan``; raises naming every tensor that does not fit
        (before Orbax creates the step).
      restore: ``(item directory, target, mapping, *, strict, verify, io) -> tree`` with the
        target's structure (``strict=False``: target leaves nothing maps to come back as
        given).
    """

    export_plan: Callable[..., _export_plan.ExportPlan]
    restore: Callable[..., Any]


_lock = threading.Lock()
_hooks: dict[type, MappingHooks] = {}


def register_mapping(mapping_type: type, hooks: MappingHooks) -> None:
    """Lets ``mapping=`` take instances of ``mapping_type`` (a later registration wins)."""
    with _lock:
        _hooks[mapping_type] = hooks


def hooks_for(mapping: Any) -> MappingHooks:
    """The hooks of ``mapping``'s type (or of its nearest registered base class).

    Raises:
      TypeError: naming the type when none is registered.
    """
    with _lock:
        for cls in type(mapping).__mro__:
            if cls in _hooks:
                return _hooks[cls]
        known = ", ".join(sorted(c.__name__ for c in _hooks)) or "none registered"
    raise TypeError(
        f"mapping= takes an osf.KeyMapping (known mapping types: {known}), not "
        f"{type(mapping).__name__}"
    )
