"""From stored bytes to arrays: read exactly the byte runs each target needs, place them.

For every requested tensor the reader works out the boxes this process's devices need
(``sharding.addressable_devices_indices_map``), reads each distinct box once into a
64-byte-aligned buffer (all runs of one file go through one batched, gap-coalescing read), and
hands the buffers to ``jax.device_put(..., may_alias=True)``, which on CPU shares them instead of
copying. A tensor read whole is checked against its CRC32C.

Example::

    value, = read_tensors([ReadRequest(stored, sharding=None, kind=ReadKind.NUMPY)])
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core.errors import IntegrityError
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.pipeline import relayout as _relayout
from orbax_safetensors._src.pipeline import staging as _staging
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import router as _router


class StoredTensor(NamedTuple):
    """Where a tensor's bytes are: file, absolute offset, dtype, shape, optional checksum.

    Named tuples here and in :class:`ReadRequest`: immutable and cheap to create, one per
    tensor of a restore.
    """

    name: str
    path: epath.Path
    offset: int
    dtype: str
    shape: tuple[int, ...]
    crc32c: int | None = None

    @property
    def nbytes(self) -> int:
        return _dtypes.nbytes(self.dtype, self.shape)


class ReadKind(enum.StrEnum):
    """What a read request materialises (a ``str`` enum: ``"numpy"`` still compares equal)."""

    JAX = "jax"  # a jax.Array
    NUMPY = "numpy"  # a numpy array
    SCALAR = "scalar"  # a numpy scalar


class ReadRequest(NamedTuple):
    """One tensor to materialise.

    Attributes:
      stored: where its bytes are.
      kind: a :class:`ReadKind`.
      sharding: for ``"jax"``: where to place it (None: the default device).
      dtype: cast to this dtype after reading (None: keep the stored dtype).
      verify: check the CRC32C when the whole tensor is read.
    """

    stored: StoredTensor
    kind: ReadKind = ReadKind.JAX
    sharding: jax.sharding.Sharding | None = None
    dtype: np.dtype | None = None
    verify: bool = True


@dataclasses.dataclass
class ReadStats:
    """Tensor bytes this process asked the files for, against the bytes its targets needed.

    Attributes:
      bytes_read: bytes requested from the files, including the small gaps that coalescing
        reads rather than skips (headers and metadata are not counted).
      bytes_needed: bytes of the distinct boxes this process's devices need (a whole tensor
        when it needs all of it).
      requests: ranged read requests issued (one per coalesced batch of runs).
      direct_bytes: of ``bytes_read``, the bytes read from local files through ``O_DIRECT``
        (cold data; see ``OSF_DIRECT_IO`` in ``docs/performance.md``).
      header_reads: safetensors headers read to find the tensors (0 when the checkpoint's
        metadata places every tensor itself).
      header_bytes: bytes of those headers (length prefix, JSON and padding).
      metadata_bytes: bytes of the checkpoint's metadata file read.
    """

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0
    direct_bytes: int = 0
    header_reads: int = 0
    header_bytes: int = 0
    metadata_bytes: int = 0


@dataclasses.dataclass(slots=True)
class _Box:
    index: _runs.Index
    buffer: np.ndarray  # flat aligned uint8: the box's bytes in row-major order

    @property
    def key(self) -> tuple:
        return _runs.index_key(self.index)


@dataclasses.dataclass(slots=True)
class _ReadBuffers:
    """Where one request's bytes are read to."""

    whole: np.ndarray | None  # the buffer of the whole tensor, when it is read whole (one run)
    boxes: list[_Box]  # otherwise: the boxes read from the file
    device_keys: dict[Any, tuple] | None  # device -> index key of its box (None: no sharding)


def _read_buffers(
    req: ReadRequest,
    whole: Callable[[ReadRequest], np.ndarray],
    single_device: _sharding.ShardingMemo[bool],
) -> _ReadBuffers:
    # ``whole(req)``: the buffer a whole-tensor read lands in (an arena's, or a staging ring's).
    shape = req.stored.shape
    if req.kind != ReadKind.JAX or req.sharding is None or single_device(req.sharding):
        return _ReadBuffers(whole(req), [], None)
    whole_index = _runs.whole_index(tuple(shape))
    device_keys: dict[Any, tuple] = {}
    boxes: dict[tuple, _Box] = {}
    for device, index in req.sharding.addressable_devices_indices_map(shape).items():
        norm = _runs.normalize_index(index or (), shape)
        device_keys[device] = _runs.index_key(norm)
        boxes.setdefault(device_keys[device], _Box(norm, np.empty(0, np.uint8)))
    if req.sharding.is_fully_addressable or _runs.index_key(whole_index) in boxes:
        # This process needs every byte: one whole read (verifiable) serves every box.
        return _ReadBuffers(whole(req), [], device_keys)
    for box in boxes.values():
        box.buffer = _buffers.aligned_empty(
            _dtypes.nbytes(req.stored.dtype, _runs.box_shape(box.index))
        )
    return _ReadBuffers(None, list(boxes.values()), device_keys)


def _single_device(sharding: jax.sharding.Sharding) -> bool:
    # One device holds the whole array: device_put to the sharding itself, no assembly.
    return len(sharding.device_set) == 1 and sharding.is_fully_addressable


def _row_blocks(req: ReadRequest) -> jax.sharding.Sharding | None:
    """The sharding to read ``req`` with before moving its shards between processes, or None
    to read its target boxes directly.

    For a tensor on object storage whose target sharding spans processes and cuts every row
    into runs (its across-host axis is not the first), reading the boxes takes about one
    request per row within 1.5x the bytes (``core.runs.ranged_reads``). Instead every process
    reads one contiguous block of rows (its devices' consecutive share) in one range, and a
    collective moves the shards to the target sharding. Decided from global facts only (the
    path's scheme, the sharding, the shape: ``core.relayout.row_block_layout``, as a save
    decides), so every process decides alike and calls the collective in the same order.
    Extra memory: while one tensor is resharded, its row blocks beside its target shards (one
    tensor's share of a process at a time).
    """
    if req.kind != ReadKind.JAX or not _router.is_object_url(req.stored.path):
        return None
    return _relayout.row_block_sharding(req.sharding, req.stored.shape, req.stored.dtype)


def read_tensors(
    requests: Sequence[ReadRequest],
    stats: ReadStats | None = None,
    io: _config.IOOptions | None = None,
) -> list[Any]:
    """Reads every request (grouped by file, one batched read per file) and returns values;
    ``io``: the direct I/O mode and object-store options (None: the defaults).

    On object storage, tensors whose target boxes are column stripes across processes are read
    by row blocks and resharded on the devices (:func:`_row_blocks`)."""
    rows = [_row_blocks(r) for r in requests]
    targets = requests
    requests = [
        r if s is None else ReadRequest(r.stored, r.kind, s, r.dtype, r.verify)
        for r, s in zip(requests, rows)
    ]
    values = _read_tensors(requests, stats, io)
    for i, s in enumerate(rows):
        target = targets[i].sharding
        if s is not None and target is not None:  # a collective, in the same order everywhere
            values[i] = _relayout.move(values[i], target)
    return values


def _read_tensors(
    requests: Sequence[ReadRequest], stats: ReadStats | None, io: _config.IOOptions | None
) -> list[Any]:
    arena = _buffers.BufferArena()
    single_device = _sharding.ShardingMemo(_single_device)  # many tensors share a few shardings
    with _Files(io, stats) as files:
        staged = _staging.staged(requests)
        if staged is None:
            buffers = [_read_buffers(r, _arena_buffer(arena), single_device) for r in requests]
            files.read(requests, buffers)
            return _place_all(requests, buffers)
        with _staging.ring_for(requests, staged) as ring:
            return _read_staged(requests, staged, ring, arena, single_device, files)


def _arena_buffer(arena: _buffers.BufferArena) -> Callable[[ReadRequest], np.ndarray]:
    return lambda req: arena.empty(req.stored.nbytes, file_offset=req.stored.offset)


def _read_staged(
    requests: Sequence[ReadRequest],
    staged: list[bool],
    ring: _buffers.StagingRing,
    arena: _buffers.BufferArena,
    single_device: _sharding.ShardingMemo[bool],
    files: _Files,
) -> list[Any]:
    """Reads in waves through ``ring`` (``staged[i]``: request i's whole tensor goes through
    it): a wave is read, its transfers to the devices start, and the next wave is read while
    they run; ring space is taken again once the transfers out of it are done."""
    results: list[Any] = [None] * len(requests)

    def whole(req: ReadRequest, stage: bool) -> np.ndarray:
        if stage:
            return ring.take(req.stored.nbytes, file_offset=req.stored.offset)
        return arena.empty(req.stored.nbytes, file_offset=req.stored.offset)

    def read_wave(wave: list[int]) -> None:
        wave_requests = [requests[i] for i in wave]
        buffers = [
            _read_buffers(requests[i], functools.partial(whole, stage=staged[i]), single_device)
            for i in wave
        ]
        files.read(wave_requests, buffers)
        placed = _place_all(wave_requests, buffers)  # transfers start, and run on
        for k, i in enumerate(wave):
            results[i] = _staging.off_the_ring(placed[k]) if staged[i] else placed[k]
        ring.hold(functools.partial(jax.block_until_ready, placed))

    # File order (each file read front to back), in waves of at most a share of the ring.
    order = sorted(
        range(len(requests)),
        key=lambda i: (str(requests[i].stored.path), requests[i].stored.offset),
    )
    budget = ring.capacity // _staging.WAVES_IN_FLIGHT
    wave: list[int] = []
    wave_bytes = 0
    for i in order:
        size = requests[i].stored.nbytes if staged[i] else 0
        if wave and wave_bytes + size > budget:
            read_wave(wave)
            wave, wave_bytes = [], 0
        wave.append(i)
        wave_bytes += size
    if wave:
        read_wave(wave)
    return results


class _Files:
    """The files of one read, each opened once (a staged read reads each in several waves);
    ``read`` fills buffers from them and counts into ``stats``."""

    def __init__(self, io: _config.IOOptions | None, stats: ReadStats | None) -> None:
        self._io = io
        self._stats = stats
        self._stack = contextlib.ExitStack()
        self._readers: dict[epath.Path, Any] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _reader(self, path: epath.Path) -> Any:
        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = self._stack.enter_context(
                _router.open_reader(path, io=self._io)
            )
        return reader

    def read(self, requests: Sequence[ReadRequest], buffers: list[_ReadBuffers]) -> None:
        """Fills ``buffers`` (one per request), one batched read per file, checking the
        CRC32C of each tensor read whole."""
        # Per file: (file offset, buffer, the request whose CRC32C it holds whole, or None).
        by_file: dict[epath.Path, list[tuple[int, np.ndarray, ReadRequest | None]]] = {}
        for req, rbuf in zip(requests, buffers):
            entries = by_file.setdefault(req.stored.path, [])
            if rbuf.whole is not None:  # one run, the whole tensor: the common case, no numpy
                checked = req.verify and req.stored.crc32c is not None
                entries.append((req.stored.offset, rbuf.whole, req if checked else None))
                continue
            for box in rbuf.boxes:
                offsets, length = _runs.byte_runs(req.stored.dtype, req.stored.shape, box.index)
                for k, off in enumerate(offsets.tolist()):
                    view = box.buffer[k * length : (k + 1) * length]
                    entries.append((req.stored.offset + off, view, None))
        stats = self._stats
        for path, file_runs in by_file.items():
            reader = self._reader(path)
            runs, on_run = _checked_runs(file_runs)
            before = (reader.bytes_read, reader.requests, getattr(reader, "direct_bytes", 0))
            reader.read_runs(runs, on_run=on_run)
            if stats is not None:
                stats.bytes_read += reader.bytes_read - before[0]
                stats.requests += reader.requests - before[1]
                stats.direct_bytes += getattr(reader, "direct_bytes", 0) - before[2]
        if stats is not None:
            stats.bytes_needed += sum(b.buffer.nbytes for p in buffers for b in p.boxes)
            stats.bytes_needed += sum(p.whole.nbytes for p in buffers if p.whole is not None)


class _TensorCheck:
    """The CRC32C check of one tensor read whole, in parts: each part's CRC is taken by the
    thread that read it, while its bytes are still in that CPU's cache (so the checks of a few
    large tensors run on every reading thread), and the last part in combines them."""

    def __init__(self, req: ReadRequest, parts: int) -> None:
        self.req = req
        self._parts: dict[int, tuple[int, int]] = {}  # part offset -> (length, CRC32C)
        self._left = parts
        self._lock = threading.Lock()

    def part_read(self, offset: int, data: np.ndarray) -> None:
        crc = _checksum.crc32c(data)
        with self._lock:
            self._parts[offset] = (data.nbytes, crc)
            self._left -= 1
            if self._left:
                return
        runs = [(o, n, c) for o, (n, c) in self._parts.items()]
        _verify(self.req, _checksum.combine_runs(runs, self.req.stored.nbytes))


def _checked_runs(
    file_runs: list[tuple[int, np.ndarray, ReadRequest | None]],
) -> tuple[list[tuple[int, np.ndarray]], Callable[[int], None] | None]:
    """A file's runs for ``read_runs``, each checked tensor cut into parts of an even share of
    the file's bytes per reading thread (4-16 MiB), and the ``on_run`` that checks them."""
    if all(req is None for _, _, req in file_runs):
        return [(offset, buf) for offset, buf, _ in file_runs], None
    part = _runs.share_bytes(sum(buf.nbytes for _, buf, _ in file_runs), _router.READ_THREADS)
    runs: list[tuple[int, np.ndarray]] = []
    parts: dict[int, tuple[_TensorCheck, int, np.ndarray]] = {}  # run number -> its part
    for offset, buf, req in file_runs:
        if req is None:
            runs.append((offset, buf))
            continue
        spans = _runs.piece_spans(offset, buf.nbytes, part)
        check = _TensorCheck(req, len(spans))
        for start, end in spans:
            parts[len(runs)] = (check, start, buf[start:end])
            runs.append((offset + start, buf[start:end]))

    def on_run(i: int) -> None:
        if (found := parts.get(i)) is not None:
            check, start, data = found
            check.part_read(start, data)

    return runs, on_run


def _verify(req: ReadRequest, actual: int) -> None:
    expected = req.stored.crc32c
    assert expected is not None
    if actual != expected:
        raise IntegrityError(
            f"tensor {req.stored.name!r} in {req.stored.path.name}: CRC32C mismatch "
            f"(recorded {_checksum.to_hex(expected)}, read {_checksum.to_hex(actual)}); "
            "the file is damaged"
        )


def _host_value(req: ReadRequest, raw: np.ndarray, box_shape: tuple[int, ...]) -> np.ndarray:
    value = _dtypes.unpack(raw, req.stored.dtype, box_shape)
    if req.dtype is not None and value.dtype != req.dtype:
        value = value.astype(req.dtype)
    return value


def _shard_targets(sharding: Any, devices: list[Any]) -> list[Any]:
    """Where each device's shard of an array over ``sharding`` goes: the device, or its memory
    of the sharding's kind (e.g. ``pinned_host``) when that is not the device's own."""
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or kind == "device":
        return devices
    return [jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in devices]


def _place_all(requests: Sequence[ReadRequest], buffers: list[_ReadBuffers]) -> list[Any]:
    results: list[Any] = [None] * len(requests)
    default = jax.local_devices()[0]  # jax.devices()[0] may belong to another process
    # Every placement goes into one call (far cheaper than a device_put per small array):
    # values[k] goes to targets[k]. Per request placed: (request, first k, shards to assemble
    # into one array over its sharding, or None for an array placed whole on one device).
    values: list[np.ndarray] = []
    targets: list[Any] = []
    spans: list[tuple[int, int, int | None]] = []
    for i, (req, rbuf) in enumerate(zip(requests, buffers)):
        if rbuf.whole is not None:
            full = _host_value(req, rbuf.whole, req.stored.shape)
            if req.kind != ReadKind.JAX:
                results[i] = full[()] if req.kind == ReadKind.SCALAR else full
            elif rbuf.device_keys is None:  # one device: put to the sharding itself
                spans.append((i, len(values), None))
                values.append(full)
                targets.append(req.sharding or default)
            else:
                devices = list(rbuf.device_keys)
                boxes = {
                    k: full[tuple(slice(a, b) for a, b in k)]
                    for k in set(rbuf.device_keys.values())
                }
                spans.append((i, len(values), len(devices)))
                values.extend(boxes[rbuf.device_keys[d]] for d in devices)
                targets.extend(_shard_targets(req.sharding, devices))
        else:
            assert rbuf.device_keys is not None
            host = {b.key: _host_value(req, b.buffer, _runs.box_shape(b.index)) for b in rbuf.boxes}
            devices = list(rbuf.device_keys)
            spans.append((i, len(values), len(devices)))
            values.extend(host[rbuf.device_keys[d]] for d in devices)
            targets.extend(_shard_targets(req.sharding, devices))
    placed = _place.put(values, targets)
    for i, start, shards in spans:
        if shards is None:
            results[i] = placed[start]
        else:
            req = requests[i]
            assert req.sharding is not None
            results[i] = jax.make_array_from_single_device_arrays(
                req.stored.shape, req.sharding, placed[start : start + shards]
            )
    return results
