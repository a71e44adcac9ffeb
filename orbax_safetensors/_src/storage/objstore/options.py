"""Tuning of the object-storage engines: :class:`ObjectStoreOptions`, read from the
environment at first use and changed with :func:`set_object_store_options`.

``S3_MIN_PART`` and ``S3_MAX_PART`` are S3's part-size limits, the bounds ``part_size`` is
checked against.

Example::

    old = set_object_store_options(max_in_flight=32)
    assert get_object_store_options().max_in_flight == 32
"""

from __future__ import annotations  # keeps dataclass field types strings (_options_from_env)

import dataclasses
import os
from typing import Any

MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # every part of a multipart upload but the last
S3_MAX_PART = 5 << 30


@dataclasses.dataclass(frozen=True)
class ObjectStoreOptions:
    """Tuning for the object-storage engines (defaults suit a real bucket and the test servers).

    Every field can also be set for a whole job through an environment variable
    ``OSF_OBJSTORE_<FIELD>`` (e.g. ``OSF_OBJSTORE_MAX_IN_FLIGHT=32``), read at first use, or in
    one process with :func:`set_object_store_options`.

    Attributes:
      max_in_flight: HTTP requests one reader or writer runs at once (its thread pool size).
      part_size: target bytes per uploaded part / staged object / copied part.
      max_request_bytes: largest ranged GET; longer coalesced reads are split.
      max_gap: the longest gap between wanted runs that a ranged read may span (the gap is read
        and dropped); gaps are merged smallest first while a read stays within 1.5x the wanted
        bytes (``core.runs.ranged_reads``).
      max_attempts: tries per request (1 = no retry) on transient failures.
      backoff_initial: first retry delay in seconds; doubles per try, with jitter.
      backoff_max: longest retry delay in seconds.
      connect_timeout: seconds to open a connection.
      read_timeout: seconds without data before a request counts as failed (and is retried).
      gcs_min_object: a process's contiguous range shorter than this goes into its loose object
        instead of a staged object of its own (GCS multi-process writes).
      coordination_timeout: no longer used (the S3 upload ids now travel in a JAX collective,
        under JAX's own timeouts); kept so that existing settings still load.
    """

    max_in_flight: int = 8
    part_size: int = 64 * MiB
    max_request_bytes: int = 16 * MiB
    max_gap: int = 1 * MiB
    max_attempts: int = 5
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    gcs_min_object: int = 1 * MiB
    coordination_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("max_in_flight and max_attempts must be >= 1")
        if not 2 * S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size must be in [{2 * S3_MIN_PART}, {S3_MAX_PART}]")
        if self.max_request_bytes < 1 or self.max_gap < 0:
            raise ValueError("max_request_bytes must be >= 1 and max_gap >= 0")


def _options_from_env() -> ObjectStoreOptions:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ObjectStoreOptions):
        text = os.environ.get(f"OSF_OBJSTORE_{f.name.upper()}")
        if text is not None:
            kwargs[f.name] = float(text) if f.type == "float" else int(text)
    return ObjectStoreOptions(**kwargs)


_options: ObjectStoreOptions | None = None


def get_object_store_options() -> ObjectStoreOptions:
    """The options in force in this process."""
    global _options
    if _options is None:
        _options = _options_from_env()
    return _options


def set_object_store_options(**changes: Any) -> ObjectStoreOptions:
    """Changes object-storage options in this process; returns the previous options.

    Example::

        old = osf.set_object_store_options(max_in_flight=32, part_size=128 << 20)
    """
    global _options
    previous = get_object_store_options()
    _options = dataclasses.replace(previous, **changes)
    return previous
