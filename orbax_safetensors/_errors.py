"""The library's exceptions: one hierarchy, every class a ``ValueError``.

Messages name the offending key, file, shape and dtype, and say what was expected.

Example::

    try:
        osf.load_file("model.safetensors", target)
    except osf.TargetMismatchError as e:
        print(e)  # lists every missing, unexpected and mis-shaped key at once
"""

from __future__ import annotations


class SafetensorsCheckpointError(ValueError):
    """Base class of every error raised by orbax_safetensors about data or files."""


class HeaderError(SafetensorsCheckpointError):
    """A ``.safetensors`` file's header is malformed, inconsistent or hostile."""


class SchemaError(SafetensorsCheckpointError):
    """The JSON tree schema stored with a checkpoint is malformed or inconsistent."""


class UnsupportedLeafError(SafetensorsCheckpointError):
    """A pytree leaf (or its dtype) cannot be stored; nothing was written."""


class TargetMismatchError(SafetensorsCheckpointError):
    """The restore target disagrees with the checkpoint (keys, shapes, dtypes)."""


class IntegrityError(SafetensorsCheckpointError):
    """Stored bytes do not match their recorded checksum."""
