"""orbax-safetensors: JAX pytrees as standard safetensors files, standalone or through Orbax.

Example::

    import orbax_safetensors as osf
    osf.save_file(state, "ckpt.safetensors")
    state = osf.load_file("ckpt.safetensors", target=abstract_state)
"""

from orbax_safetensors._src.core.errors import (
    DeletedArrayError,
    HeaderError,
    IntegrityError,
    MetadataError,
    NotSafetensorsError,
    SafetensorsCheckpointError,
    SchemaError,
    TargetMismatchError,
    UnsupportedLeafError,
)
from orbax_safetensors._src.core.header import Header, TensorEntry
from orbax_safetensors._src.integrations import publish as _publish  # noqa: F401 (mapping=)
from orbax_safetensors._src.integrations.key_mapping import (
    Chain,
    KeyMapping,
    MappingReport,
    Reshape,
    Rule,
    SplitHeads,
    Transform,
    Transpose,
)
from orbax_safetensors._src.integrations.nnx import load_model, save_model
from orbax_safetensors._src.integrations.presets import preset_mapping
from orbax_safetensors._src.integrations.pytorch import (
    abstract_pytorch,
    export_pytorch,
    load_pytorch,
)
from orbax_safetensors._src.integrations.transforms import Offset, RopeInterleave, Scale, VocabRows
from orbax_safetensors._src.orbax.object_storage import manager_options_for
from orbax_safetensors._src.orbax.restoring import load_file, restore_directory
from orbax_safetensors._src.orbax.v0 import (
    SafetensorsCheckpointHandler,
    SafetensorsRestore,
    SafetensorsSave,
    handler_registry,
)
from orbax_safetensors._src.orbax.v1 import SafetensorsHandler, local_registry, register_handler
from orbax_safetensors._src.pipeline.pieces import WriteStats
from orbax_safetensors._src.pipeline.reader import ReadStats
from orbax_safetensors._src.pipeline.save_job import save_directory
from orbax_safetensors._src.pipeline.standalone import load_metadata, save_file
from orbax_safetensors._src.storage.config import IOOptions
from orbax_safetensors._src.storage.objstore.calls import ObjectStoreError
from orbax_safetensors._src.storage.objstore.options import (
    ObjectStoreOptions,
    set_object_store_options,
)
from orbax_safetensors._src.storage.objstore.stats import ObjectStoreStats, object_store_stats
from orbax_safetensors._src.storage.router import read_header
from orbax_safetensors._src.tools.convert import ConvertSummary, convert
from orbax_safetensors._src.tools.verify import VerifyReport, verify
from orbax_safetensors._version import __version__

__all__ = [
    "Chain",
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
    "UnsupportedLeafError",
    "VerifyReport",
    "VocabRows",
    "WriteStats",
    "__version__",
    "abstract_pytorch",
    "convert",
    "export_pytorch",
    "handler_registry",
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
