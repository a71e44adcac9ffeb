"""orbax-safetensors: JAX pytrees as standard safetensors files, standalone or through Orbax.

Example::

    import orbax_safetensors as osf
    osf.save_file(state, "ckpt.safetensors")
    state = osf.load_file("ckpt.safetensors", target=abstract_state)
    osf.hf.export_pytorch(state, "hf_dir", osf.hf.preset_mapping("llama"))

The Hugging Face and PyTorch names are also one namespace, ``osf.hf`` (``orbax_safetensors.hf``).

The errors and the version are imported with the package; every other public name is imported
from its module when first used (``osf.save_file``, ``from orbax_safetensors import
save_file``), so that ``import orbax_safetensors`` and the command line do not pay for JAX and
Orbax until a name needs them. A name whose module fails to import (a broken install) raises
that module's ``ImportError`` where it is used. The handler still joins Orbax's registry of
handler types once both packages are imported, in either order, so that
``mngr.restore(step)`` without args reads our steps after only ``import orbax_safetensors``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from orbax_safetensors._src.core.errors import (
    ConfigError,
    DeletedArrayError,
    HeaderError,
    IntegrityError,
    MetadataError,
    NotSafetensorsError,
    SafetensorsCheckpointError,
    SchemaError,
    TargetMismatchError,
    UnsafePathError,
    UnsupportedLeafError,
)
from orbax_safetensors._version import __version__

if TYPE_CHECKING:
    from orbax_safetensors import hf
    from orbax_safetensors._src.core.header import Header, TensorEntry
    from orbax_safetensors._src.integrations.flax_tables import load_model, save_model
    from orbax_safetensors._src.orbax.steps import manager_options_for
    from orbax_safetensors._src.orbax.v0 import (
        SafetensorsCheckpointHandler,
        SafetensorsRestore,
        SafetensorsSave,
        handler_registry,
    )
    from orbax_safetensors._src.orbax.v1 import SafetensorsHandler, local_registry, register_handler
    from orbax_safetensors._src.pipeline.pieces import WriteStats
    from orbax_safetensors._src.pipeline.read import ReadStats
    from orbax_safetensors._src.pipeline.standalone import (
        load_file,
        load_metadata,
        restore_directory,
        save_directory,
        save_file,
    )
    from orbax_safetensors._src.storage.config import (
        IOOptions,
        ObjectStoreOptions,
        set_object_store_options,
    )
    from orbax_safetensors._src.storage.objstore.common import (
        ObjectStoreError,
        ObjectStoreStats,
        object_store_stats,
    )
    from orbax_safetensors._src.storage.router import read_header
    from orbax_safetensors._src.tools.convert import ConvertSummary, convert
    from orbax_safetensors._src.tools.verify import VerifyReport, verify
    from orbax_safetensors.hf import (  # osf.hf's names, each also at the top level
        Chain,
        KeyMapping,
        MappingReport,
        Offset,
        Reshape,
        RopeInterleave,
        Rule,
        Scale,
        SplitHeads,
        Transform,
        Transpose,
        VocabRows,
        abstract_pytorch,
        export_pytorch,
        import_pytorch,
        load_pytorch,
        preset_mapping,
    )

# Each public name (errors and version apart) -> the module under ``orbax_safetensors._src``
# that defines it; a sub-namespace of the package maps to its own name (``osf.hf``).
_LAZY: dict[str, str] = {
    name: module
    for module, names in {
        "hf": ("hf",),
        "core.header": ("Header", "TensorEntry"),
        "integrations.key_mapping": ("KeyMapping", "MappingReport", "Rule"),
        "integrations.transforms": (
            "Chain",
            "Offset",
            "Reshape",
            "RopeInterleave",
            "Scale",
            "SplitHeads",
            "Transform",
            "Transpose",
            "VocabRows",
        ),
        "integrations.flax_tables": ("load_model", "save_model"),
        "integrations.presets": ("preset_mapping",),
        "integrations.load": ("abstract_pytorch", "load_pytorch"),
        "integrations.export": ("export_pytorch",),
        "integrations.hf_import": ("import_pytorch",),
        "orbax.steps": ("manager_options_for",),
        "orbax.v0": (
            "SafetensorsCheckpointHandler",
            "SafetensorsRestore",
            "SafetensorsSave",
            "handler_registry",
        ),
        "orbax.v1": ("SafetensorsHandler", "local_registry", "register_handler"),
        "pipeline.pieces": ("WriteStats",),
        "pipeline.read": ("ReadStats",),
        "pipeline.standalone": (
            "load_file",
            "load_metadata",
            "restore_directory",
            "save_directory",
            "save_file",
        ),
        "storage.config": ("IOOptions", "ObjectStoreOptions", "set_object_store_options"),
        "storage.objstore.common": ("ObjectStoreError", "ObjectStoreStats", "object_store_stats"),
        "storage.router": ("read_header",),
        "tools.convert": ("ConvertSummary", "convert"),
        "tools.verify": ("VerifyReport", "verify"),
    }.items()
    for name in names
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module_name == name:  # a sub-namespace: the module is the value
        return importlib.import_module(f"{__name__}.{name}")
    module = importlib.import_module(f"{__name__}._src.{module_name}")
    value = getattr(module, name)
    globals()[name] = value  # later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_HANDLER_MODULE = f"{__name__}._src.orbax.v0"  # importing it registers the handler with Orbax


class _RegisterWithOrbax(importlib.abc.MetaPathFinder):
    """Imports the handler's module right after ``orbax.checkpoint`` is first imported (why a
    hook: docs/architecture.md, "Registering with Orbax"). It finds nothing itself: it wraps
    the loader the other finders give ``orbax.checkpoint``, and leaves ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        if fullname != "orbax.checkpoint" or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)  # once: and the search below does not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is not None and isinstance(spec.loader, importlib.abc.Loader):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """``orbax.checkpoint``'s loader, then the handler's module imported."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        importlib.import_module(_HANDLER_MODULE)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._loader, name)


if "orbax.checkpoint" in sys.modules:
    importlib.import_module(_HANDLER_MODULE)
elif not any(isinstance(f, _RegisterWithOrbax) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithOrbax())


__all__ = [
    "Chain",
    "ConfigError",
    "ConvertSummary",
    "DeletedArrayError",
    "Header",
    "HeaderError",
    "IOOptions",
    "IntegrityError",
    "KeyMapping",
    "MappingReport",
    "MetadataError",
    "NotSafetensorsError",
    "ObjectStoreError",
    "ObjectStoreOptions",
    "ObjectStoreStats",
    "Offset",
    "ReadStats",
    "Reshape",
    "RopeInterleave",
    "Rule",
    "SafetensorsCheckpointError",
    "SafetensorsCheckpointHandler",
    "SafetensorsHandler",
    "SafetensorsRestore",
    "SafetensorsSave",
    "Scale",
    "SchemaError",
    "SplitHeads",
    "TargetMismatchError",
    "TensorEntry",
    "Transform",
    "Transpose",
    "UnsafePathError",
    "UnsupportedLeafError",
    "VerifyReport",
    "VocabRows",
    "WriteStats",
    "__version__",
    "abstract_pytorch",
    "convert",
    "export_pytorch",
    "handler_registry",
    "hf",
    "import_pytorch",
    "load_file",
    "load_metadata",
    "load_model",
    "load_pytorch",
    "local_registry",
    "manager_options_for",
    "object_store_stats",
    "preset_mapping",
    "read_header",
    "register_handler",
    "restore_directory",
    "save_directory",
    "save_file",
    "save_model",
    "set_object_store_options",
    "verify",
]
