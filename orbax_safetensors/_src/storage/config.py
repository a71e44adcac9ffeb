"""I/O configuration: :class:`IOOptions` (direct I/O mode, object-store tuning, request
tracing), passed explicitly to every storage engine. The only module that reads environment
variables (``OSF_DIRECT_IO``, ``OSF_OBJSTORE_<FIELD>``, ``OSF_OBJSTORE_TRACE``, the cloud SDKs'
through :func:`env_var`), when a field left unset is needed: never at import, never kept. An
explicit field always wins.
"""

from __future__ import annotations  # keeps dataclass field types strings (_store_from_env)

import dataclasses
import os
import warnings
from typing import Any

MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # every part of a multipart upload but the last
S3_MAX_PART = 5 << 30
DIRECT_IO_ENV = "OSF_DIRECT_IO"
DIRECT_IO_MODES = ("auto", "never", "always")
OBJSTORE_ENV_PREFIX = "OSF_OBJSTORE_"
TRACE_ENV = "OSF_OBJSTORE_TRACE"


@dataclasses.dataclass(frozen=True)
class ObjectStoreOptions:
    """Tuning for the object-storage engines, passed as ``IOOptions(object_store=...)``; a
    field's default can be set for a job through ``OSF_OBJSTORE_<FIELD>``.

    Attributes:
      max_in_flight: HTTP requests one reader or writer runs at once (its thread pool size).
      part_size: target bytes per uploaded part / staged object / copied part.
      max_request_bytes: largest ranged GET; longer coalesced reads are split.
      max_gap: the longest gap between wanted runs one ranged read may span (reads stay within
        1.5x the wanted bytes).
      max_attempts: tries per request (1 = no retry) on transient failures.
      backoff_initial: first retry delay in seconds; doubles per try, with jitter.
      backoff_max: longest retry delay in seconds.
      connect_timeout: seconds to open a connection.
      read_timeout: seconds without data before a request counts as failed (and is retried).
      gcs_min_object: GCS, a save by several processes: a process's range shorter than this
        is no object of its own.

    Example::

        osf.IOOptions(object_store=osf.ObjectStoreOptions(max_in_flight=32, max_attempts=8))
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

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError("max_in_flight and max_attempts must be >= 1")
        if not 2 * S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size must be in [{2 * S3_MIN_PART}, {S3_MAX_PART}]")
        if self.max_request_bytes < 1 or self.max_gap < 0:
            raise ValueError("max_request_bytes must be >= 1 and max_gap >= 0")


@dataclasses.dataclass(frozen=True)
class IOOptions:
    """How files are read and written; a field left None takes its environment default.

    Attributes:
      direct_io: ``"auto"`` (direct reads of cold data, direct durable writes), ``"never"``
        or ``"always"`` (see ``docs/performance.md``); default ``OSF_DIRECT_IO``, else auto.
      object_store: :class:`ObjectStoreOptions` for ``s3://`` and ``gs://`` paths; default
        from ``OSF_OBJSTORE_<FIELD>``.
      trace: one line per object-store request and retry on stderr; default
        ``OSF_OBJSTORE_TRACE=1``.

    Example::

        osf.load_file(path, io_options=osf.IOOptions(direct_io="never"))
    """

    direct_io: str | None = None
    object_store: ObjectStoreOptions | None = None
    trace: bool | None = None

    def __post_init__(self) -> None:
        if self.direct_io is not None:
            direct_io_mode(self.direct_io)
        if self.object_store is not None and not isinstance(self.object_store, ObjectStoreOptions):
            raise TypeError(
                f"object_store={self.object_store!r}: expected an osf.ObjectStoreOptions"
            )


def env_var(name: str) -> str | None:
    """The environment variable ``name`` (the package's one reader of it)."""
    return os.environ.get(name)


def direct_io_mode(value: str | None) -> str:
    """The direct I/O mode ``value``, checked; None: ``OSF_DIRECT_IO``'s, else ``"auto"``.

    Raises:
      ValueError: naming the argument or the variable, for a value not in ``DIRECT_IO_MODES``.
    """
    name = "direct_io"
    if value is None:
        name, value = DIRECT_IO_ENV, (env_var(DIRECT_IO_ENV) or "auto").strip().lower() or "auto"
    if value not in DIRECT_IO_MODES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(DIRECT_IO_MODES)}")
    return value


# The deprecated set_object_store_options' value: this process's default object-store
# options, overriding OSF_OBJSTORE_* (None: not set).
_store_defaults: ObjectStoreOptions | None = None


def resolve(io: IOOptions | None) -> IOOptions:
    """``io`` with every field set: explicit fields as given, the others from the environment.

    Raises:
      ValueError: naming the variable, for a malformed environment default.
    """
    io = io if io is not None else IOOptions()
    direct_io = direct_io_mode(io.direct_io)
    store = io.object_store if io.object_store is not None else default_object_store_options()
    trace = io.trace if io.trace is not None else env_var(TRACE_ENV) == "1"
    return IOOptions(direct_io=direct_io, object_store=store, trace=trace)


def default_object_store_options() -> ObjectStoreOptions:
    """The object-store options where none are given: those the deprecated
    :func:`set_object_store_options` set, else ``OSF_OBJSTORE_<FIELD>`` over the defaults."""
    if _store_defaults is not None:
        return _store_defaults
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(ObjectStoreOptions):
        name = f"{OBJSTORE_ENV_PREFIX}{f.name.upper()}"
        text = env_var(name)
        if text is not None:
            try:
                kwargs[f.name] = float(text) if f.type == "float" else int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r}: expected a number") from None
    return ObjectStoreOptions(**kwargs)


def set_object_store_options(**changes: Any) -> ObjectStoreOptions:
    """Deprecated: pass ``osf.IOOptions(object_store=osf.ObjectStoreOptions(...))`` instead.
    Changes this process's default object-store options; returns the previous ones.

    Example::

        old = osf.set_object_store_options(max_in_flight=32)  # DeprecationWarning
    """
    global _store_defaults
    warnings.warn(
        "set_object_store_options is deprecated: pass io_options=osf.IOOptions("
        "object_store=osf.ObjectStoreOptions(...)) to save_file, load_file or the handler",
        DeprecationWarning,
        stacklevel=2,
    )
    previous = default_object_store_options()
    _store_defaults = dataclasses.replace(previous, **changes)
    return previous


def reset_object_store_defaults(options: ObjectStoreOptions | None = None) -> None:
    """Sets (None: clears) the defaults :func:`set_object_store_options` changed."""
    global _store_defaults
    _store_defaults = options
