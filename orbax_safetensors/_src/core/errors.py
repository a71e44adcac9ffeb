"""The library's exceptions: one hierarchy under :class:`SafetensorsCheckpointError`, every
class a ``ValueError``. :class:`MetadataError` is also a ``TypeError``, and ``ObjectStoreError``
(``orbax_safetensors._src.storage.objstore.calls``) is also an ``OSError``, so code that
catches the built-in class still does.

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


class DeletedArrayError(UnsupportedLeafError):
    """A ``jax.Array`` leaf has been deleted (donated); nothing was written."""


class MetadataError(SafetensorsCheckpointError, TypeError):
    """User metadata of a checkpoint directory is not JSON-serialisable."""


class TargetMismatchError(SafetensorsCheckpointError):
    """The restore target disagrees with the checkpoint (keys, shapes, dtypes)."""


class IntegrityError(SafetensorsCheckpointError):
    """Stored bytes do not match their recorded checksum."""
