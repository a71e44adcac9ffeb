"""orbax-safetensors: JAX pytrees as standard safetensors files, standalone or through Orbax.

Example::

    import orbax_safetensors as osf
    osf.save_file(state, "ckpt.safetensors")
    state = osf.load_file("ckpt.safetensors", target=abstract_state)
"""

from orbax_safetensors._api import load_file, load_metadata, read_header, save_file
from orbax_safetensors._errors import (
    HeaderError,
    IntegrityError,
    SafetensorsCheckpointError,
    SchemaError,
    TargetMismatchError,
    UnsupportedLeafError,
)

__version__ = "0.1.0"

__all__ = [
    "HeaderError",
    "IntegrityError",
    "SafetensorsCheckpointError",
    "SchemaError",
    "TargetMismatchError",
    "UnsupportedLeafError",
    "__version__",
    "load_file",
    "load_metadata",
    "read_header",
    "save_file",
]
