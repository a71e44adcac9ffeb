"""Requests and bytes this process sent to object storage: :class:`ObjectStoreStats`,
read with :func:`object_store_stats` and added to with :func:`count`.

Example::

    object_store_stats(reset=True)
    count(get_requests=1, bytes_fetched=65536)
    assert object_store_stats().requests == 1
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class ObjectStoreStats:
    """Requests and bytes this process sent to object storage (cumulative, all threads).

    ``bytes_fetched`` counts every byte requested by ranged GETs (coalesced gaps included);
    ``bytes_uploaded`` every byte sent in PUTs and parts (``put_requests`` counts both,
    ``multipart_parts`` the S3 UploadPart requests among them); ``bytes_copied`` bytes copied
    server-side (UploadPartCopy); ``bytes_reassembled`` bytes the primary downloaded again to
    build S3 parts or GCS filler objects from other processes' loose ranges.
    """

    get_requests: int = 0
    bytes_fetched: int = 0
    put_requests: int = 0
    bytes_uploaded: int = 0
    multipart_parts: int = 0
    copy_requests: int = 0
    bytes_copied: int = 0
    compose_requests: int = 0
    head_requests: int = 0
    list_requests: int = 0
    delete_requests: int = 0
    other_requests: int = 0
    retries: int = 0
    bytes_reassembled: int = 0

    @property
    def requests(self) -> int:
        """All requests sent (retries included)."""
        return (
            self.get_requests
            + self.put_requests
            + self.copy_requests
            + self.compose_requests
            + self.head_requests
            + self.list_requests
            + self.delete_requests
            + self.other_requests
        )


_stats = ObjectStoreStats()
_lock = threading.Lock()  # guards _stats


def object_store_stats(reset: bool = False) -> ObjectStoreStats:
    """A snapshot of this process's object-storage counters; ``reset`` zeroes them after.

    Example::

        osf.object_store_stats(reset=True)
        osf.load_file("gs://bucket/w.safetensors", target=small_target)
        print(osf.object_store_stats().bytes_fetched)
    """
    global _stats
    with _lock:
        snapshot = dataclasses.replace(_stats)
        if reset:
            _stats = ObjectStoreStats()
    return snapshot


def count(**increments: int) -> None:
    """Adds ``increments`` to this process's counters (thread-safe)."""
    with _lock:
        for name, value in increments.items():
            setattr(_stats, name, getattr(_stats, name) + value)
