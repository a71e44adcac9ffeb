"""Tuning of the object-storage engines: :class:`ObjectStoreOptions` (defined with the rest of
the I/O configuration in :mod:`orbax_safetensors._src.storage.config`, re-exported here).

``S3_MIN_PART`` and ``S3_MAX_PART`` are S3's part-size limits, the bounds ``part_size`` is
checked against.

Example::

    options = ObjectStoreOptions(max_in_flight=32)
"""

from __future__ import annotations

from orbax_safetensors._src.storage.config import (
    S3_MAX_PART,
    S3_MIN_PART,
    MiB,
    ObjectStoreOptions,
    default_object_store_options,
    set_object_store_options,
)

__all__ = [
    "S3_MAX_PART",
    "S3_MIN_PART",
    "MiB",
    "ObjectStoreOptions",
    "default_object_store_options",
    "set_object_store_options",
]
