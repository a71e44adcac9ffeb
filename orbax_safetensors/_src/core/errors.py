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

from typing import Any


class SafetensorsCheckpointError(ValueError):
    """Base class of every error raised by orbax_safetensors about data or files."""


class HeaderError(SafetensorsCheckpointError):
    """A ``.safetensors`` file's header is malformed, inconsistent or hostile."""


class NotSafetensorsError(HeaderError):
    """The path is not a safetensors file but something recognisable (a Flax msgpack
    checkpoint, a pickle, a zip, an Orbax directory...); the message says what and what to
    run instead. ``found`` holds the finding (``kind``, ``description``, ``suggestion``)."""

    def __init__(self, message: str, found: Any = None) -> None:
        super().__init__(message)
        self.found = found


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
