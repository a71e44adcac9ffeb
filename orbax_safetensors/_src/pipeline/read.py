"""Where stored tensors lie (:class:`StoredTensor`: :func:`locate_in_directory`,
:func:`file_index`), and reading their bytes (:func:`read_tensors`: the runs each request's
devices need, one batched, gap-coalescing read per file, each tensor read whole checked against
its CRC32C as its parts arrive) into host buffers that ``place`` puts on the devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core.errors import (
    HeaderError,
    IntegrityError,
    SchemaError,
    UnsafePathError,
)
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.pipeline import relayout as _relayout
from orbax_safetensors._src.storage import buffers as _buffers
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import router as _router


class StoredTensor(NamedTuple):
    """Where a tensor's bytes are: file, absolute offset, dtype, shape, optional checksum."""

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
    """One tensor to materialise."""

    stored: StoredTensor
    kind: ReadKind = ReadKind.JAX
    sharding: jax.sharding.Sharding | None = None  # for JAX (None: the default device)
    dtype: np.dtype | None = None  # cast to it after reading (None: the stored dtype)
    verify: bool = True  # check the CRC32C when the whole tensor is read


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

    Example::

        stats = osf.ReadStats()
        osf.restore_directory("/tmp/ckpt", target=abstract, stats=stats)
    """

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0
    direct_bytes: int = 0
    header_reads: int = 0
    header_bytes: int = 0
    metadata_bytes: int = 0


# --------------------------------------------------------------------------- locating


def read_metadata(directory: epath.PathLike, *, stats: ReadStats | None = None) -> dict[str, Any]:
    """Reads and checks the metadata file of a checkpoint directory."""
    path = _confine.inside(directory, _metadata.METADATA_FILE)
    if not path.exists():
        raise FileNotFoundError(
            f"{directory} is not an orbax-safetensors checkpoint: no {_metadata.METADATA_FILE}"
        )
    raw = _confine.read_file(path, limit=_metadata.MAX_METADATA_BYTES)
    if stats is not None:
        stats.metadata_bytes += len(raw)
    return _metadata.parse_metadata(raw, path)


def locate_in_directory(
    directory: epath.PathLike,
    metadata: Mapping[str, Any],
    *,
    check_headers: bool = False,
    stats: ReadStats | None = None,
    io: _config.IOOptions | None = None,
) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint directory as a :class:`StoredTensor`.

    When the metadata places every tensor itself (``file_layout``), no header is read (a
    restore by N processes reads nothing that grows with N) and local files must have the
    recorded sizes; else, or with ``check_headers``, each file's header is read once and
    cross-checked against the metadata.
    """
    directory = epath.Path(directory)
    layout = metadata.get("file_layout") if _metadata.has_layout(metadata) else None
    headers: dict[str, _header.Header] = {}  # by file name, once the name has been checked
    paths: dict[str, epath.Path] = {}  # one Path object per file, shared by its tensors
    out: dict[str, StoredTensor] = {}
    for name, info in metadata["tensors"].items():
        filename = info.get("file") if isinstance(info, dict) else None
        if not isinstance(filename, str) or (
            filename not in paths
            and (not _metadata.is_plain_filename(filename) or filename not in metadata["files"])
        ):
            raise SchemaError(f"{directory}: tensor {name!r} names an invalid file {filename!r}")
        if filename not in paths:
            path = _confine.inside(directory, filename, where=directory / _metadata.METADATA_FILE)
            _check_file(directory, name, filename, path, layout)
            if layout is None or check_headers:
                headers[filename] = _router.read_header(path, io)
                if stats is not None:
                    stats.header_reads += 1
                    stats.header_bytes += headers[filename].data_start
            paths[filename] = path
        if filename in headers:
            out[name] = _from_header(
                directory, name, info, paths[filename], headers[filename], layout
            )
        else:  # checked by the metadata validator: inside the file, as its dtype and shape say
            assert layout is not None
            start = layout[filename]["data_start"] + info["data_offsets"][0]
            crc = _recorded_crc(directory, name, info)
            out[name] = StoredTensor(
                name, paths[filename], start, info["dtype"], tuple(info["shape"]), crc
            )
    return out


def _from_header(
    directory: epath.Path,
    name: str,
    info: Mapping[str, Any],
    path: epath.Path,
    header: _header.Header,
    layout: Mapping[str, Any] | None,
) -> StoredTensor:
    # A tensor placed by its file's header, which must agree with the metadata's entry.
    entry = _checked_entry(directory, name, info, header, layout)
    crc = _recorded_crc(directory, name, info)
    return StoredTensor(name, path, header.data_start + entry.begin, entry.dtype, entry.shape, crc)


def _recorded_crc(where: object, name: str, info: Mapping[str, Any]) -> int | None:
    # A tensor's CRC32C as recorded (None: saved without checksums).
    text = info.get("crc32c")
    return None if text is None else _crc(where, name, text)


def _crc(where: object, name: str, text: object) -> int:
    crc = _checksum.from_hex(text)
    if crc is None:
        raise SchemaError(f"{where}: checksum of {name!r} is malformed: {text!r}")
    return crc


def locate_in_directory_file(
    path: epath.PathLike, header: _header.Header
) -> dict[str, StoredTensor] | None:
    """The tensors of ``path``, one file of a checkpoint directory, placed by its ``header``,
    with the checksums the directory's metadata records; None when no metadata beside ``path``
    lists it. Metadata that cannot be read or disagrees with the header is an error, never a
    reason to read the file unchecked.

    Raises:
      SchemaError, HeaderError: the metadata is malformed, or disagrees with ``header``.
      UnsafePathError: it is a special file, or a symbolic link out of the directory.
    """
    path = epath.Path(path)
    directory = path.parent
    if not (directory / _metadata.METADATA_FILE).exists():
        return None
    try:
        metadata = read_metadata(directory)
        if path.name not in metadata["files"]:
            return None
        layout = metadata.get("file_layout") if _metadata.has_layout(metadata) else None
        out: dict[str, StoredTensor] = {}
        for name, info in metadata["tensors"].items():
            if isinstance(info, dict) and info.get("file") == path.name:
                out[name] = _from_header(directory, name, info, path, header, layout)
        unplaced = [name for name in header.tensors if name not in out]
        if unplaced:
            raise HeaderError(
                f"{path}: holds tensor {unplaced[0]!r}, which {_metadata.METADATA_FILE} does "
                "not place in this file"
            )
        return out
    except (HeaderError, SchemaError, UnsafePathError) as e:
        if type(e) not in (HeaderError, SchemaError, UnsafePathError):
            raise
        raise type(e)(
            f"{e}\n{path.name} lies in a checkpoint directory whose {_metadata.METADATA_FILE} "
            "would record its checksums, and that metadata cannot vouch for it: the file or "
            f"the metadata is damaged (orbax_safetensors.verify('{directory}') says which); "
            "load_file(..., verify=False) reads the file without checking it"
        ) from None


def _check_file(
    directory: epath.Path,
    name: str,
    filename: str,
    path: epath.Path,
    layout: Mapping[str, Any] | None,
) -> None:
    # A listed file must exist as a regular file. Local files are also checked against the
    # recorded size (one stat). On object storage, where each check is a request per file and
    # process, the ranged reads themselves fail on a missing or shorter object.
    if layout is not None and _router.is_object_url(path):
        return
    if _router.is_local(path):
        size = _local_size(path)
        expected = layout[filename]["size"] if layout is not None else size
        if size is not None and size != expected:
            raise SchemaError(
                f"{directory}: {filename!r} is {size} bytes but {_metadata.METADATA_FILE} "
                f"records {expected}; the file was changed or truncated"
            )
        if size is not None:
            return
    if not _router.is_regular_file(path):
        raise SchemaError(
            f"{directory}: tensor {name!r} is stored in {filename!r}, which does not "
            "exist or is not a regular file"
        )


def _local_size(path: epath.Path) -> int | None:
    # The size of a local regular file, None when it is missing. Something else (a FIFO, a
    # directory) is refused as every read of a file refuses it.
    try:
        st = os.stat(os.fspath(path))
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _confine.not_regular_error(path, st.st_mode)
    return st.st_size


def _checked_entry(
    directory: epath.Path,
    name: str,
    info: Mapping[str, Any],
    header: _header.Header,
    layout: Mapping[str, Any] | None,
) -> _header.TensorEntry:
    # The header's entry of a tensor, which must agree with the metadata's.
    filename = info["file"]
    entry = header.tensors.get(name)
    if entry is None:
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} is listed in the metadata but not in the file"
        )
    if entry.dtype != info.get("dtype") or list(entry.shape) != info.get("shape"):
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} is {entry.dtype}{list(entry.shape)} in the "
            f"file but {info.get('dtype')}{info.get('shape')} in the metadata"
        )
    if layout is not None and (
        [entry.begin, entry.end] != info["data_offsets"]
        or header.data_start != layout[filename]["data_start"]
    ):
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} lies at data_offsets "
            f"{[entry.begin, entry.end]} after a {header.data_start}-byte header in the file, "
            f"but at {info['data_offsets']} after {layout[filename]['data_start']} in the metadata"
        )
    return entry


def locate_in_file(
    path: epath.Path, header: _header.Header, crcs: Mapping[str, Any] | None
) -> dict[str, StoredTensor]:
    """The tensors of one file, with their checksums when known."""
    out = {}
    for name, e in header.tensors.items():
        crc = _crc(path, name, crcs[name]) if crcs is not None and name in crcs else None
        out[name] = StoredTensor(name, path, header.data_start + e.begin, e.dtype, e.shape, crc)
    return out


@_pieces.gc_paused()
def file_index(
    path: epath.Path,
    header: _header.Header,
    *,
    strict: bool = True,
    directory_checksums: bool = False,
) -> tuple[Any, dict[str, StoredTensor]]:
    """The schema (None if the file has none, or when not ``strict``) and the tensors of a
    standalone file, with their checksums when it records them.

    ``strict=False`` (tools listing any safetensors file) skips the schema and a checksum entry
    that is not an object. ``directory_checksums``: a file without checksums of its own takes
    those its checkpoint directory's metadata records (:func:`locate_in_directory_file`).
    """
    schema = _metadata.header_json(header, _metadata.SCHEMA_KEY, str(path)) if strict else None
    crcs = _metadata.header_json(header, _metadata.CHECKSUM_KEY, str(path))
    if crcs is not None and not isinstance(crcs, dict):
        if strict:
            raise SchemaError(f"{path}: {_metadata.CHECKSUM_KEY} is not an object")
        crcs = None
    if crcs is None and directory_checksums:
        stored = locate_in_directory_file(path, header)
        if stored is not None:
            return schema, stored
    return schema, locate_in_file(path, header, crcs)


# --------------------------------------------------------------------------- reading


def read_tensors(
    requests: Sequence[ReadRequest],
    stats: ReadStats | None = None,
    io: _config.IOOptions | None = None,
) -> list[Any]:
    """The values of ``requests``, read file by file; ``io``: None for the defaults."""
    # On object storage, a tensor whose target sharding spans processes and cuts every row
    # into runs would take about one request per row: every process reads one block of rows
    # in one range instead, and a collective moves the shards to the target sharding. Decided
    # from global facts only (scheme, sharding, shape: as a save decides), so every process
    # calls the collectives alike, in the same order.
    rows = [
        _relayout.row_block_sharding(r.sharding, r.stored.shape, r.stored.dtype)
        if r.kind == ReadKind.JAX and _router.is_object_url(r.stored.path)
        else None
        for r in requests
    ]
    moved = [
        r if s is None else ReadRequest(r.stored, r.kind, s, r.dtype, r.verify)
        for r, s in zip(requests, rows)
    ]
    values = _read_tensors(moved, stats, io)
    for i, s in enumerate(rows):
        target = requests[i].sharding
        if s is not None and target is not None:
            values[i] = _relayout.move(values[i], target)
    return values


def _read_tensors(
    requests: Sequence[ReadRequest], stats: ReadStats | None, io: _config.IOOptions | None
) -> list[Any]:
    arena = _buffers.BufferArena()
    single_device = _sharding.ShardingMemo(_place.on_one_device)  # a few shardings, many tensors
    with _Files(io, stats) as files:
        staged = _place.staged(requests)
        if staged is None:
            fresh = functools.partial(_arena_buffer, arena)
            buffers = [_place.host_buffers(r, fresh, single_device) for r in requests]
            files.read(requests, buffers)
            return _place.place_read(requests, buffers)
        with _place.ring_for(requests, staged) as ring:
            return _read_staged(requests, staged, ring, arena, single_device, files)


def _arena_buffer(arena: _buffers.BufferArena, req: ReadRequest) -> np.ndarray:
    return arena.empty(req.stored.nbytes, file_offset=req.stored.offset)


def _read_staged(
    requests: Sequence[ReadRequest],
    staged: list[bool],
    ring: _buffers.StagingRing,
    arena: _buffers.BufferArena,
    single_device: _sharding.ShardingMemo[bool],
    files: _Files,
) -> list[Any]:
    # Reads in waves through ``ring`` (``staged[i]``: request i goes through it): the next
    # wave is read while the transfers of those before run; ring space is reused once they end.
    results: list[Any] = [None] * len(requests)

    def whole(req: ReadRequest, stage: bool) -> np.ndarray:
        if stage:
            return ring.take(req.stored.nbytes, file_offset=req.stored.offset)
        return _arena_buffer(arena, req)

    def read_wave(wave: list[int]) -> None:
        wave_requests = [requests[i] for i in wave]
        buffers = [
            _place.host_buffers(
                requests[i], functools.partial(whole, stage=staged[i]), single_device
            )
            for i in wave
        ]
        files.read(wave_requests, buffers)
        placed = _place.place_read(wave_requests, buffers)  # transfers start, and run on
        for k, i in enumerate(wave):
            results[i] = _place.off_the_ring(placed[k]) if staged[i] else placed[k]
        ring.hold(functools.partial(jax.block_until_ready, placed))

    # File order (each file read front to back), in waves of at most a share of the ring.
    order = sorted(
        range(len(requests)),
        key=lambda i: (str(requests[i].stored.path), requests[i].stored.offset),
    )
    budget = ring.capacity // _place.WAVES_IN_FLIGHT
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


class _Files(contextlib.ExitStack):
    """The files of one read, each opened once; ``read`` fills buffers and counts ``stats``."""

    def __init__(self, io: _config.IOOptions | None, stats: ReadStats | None) -> None:
        super().__init__()
        self._io = io
        self._stats = stats
        self._readers: dict[epath.Path, Any] = {}

    def _reader(self, path: epath.Path) -> Any:
        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = self.enter_context(
                _router.open_reader(path, io=self._io)
            )
        return reader

    def read(self, requests: Sequence[ReadRequest], buffers: list[_place.HostBuffers]) -> None:
        """Fills ``buffers`` (one per request), one batched read per file."""
        # Per file: (file offset, buffer, the request whose CRC32C it holds whole, or None).
        by_file: dict[epath.Path, list[tuple[int, np.ndarray, ReadRequest | None]]] = {}
        for req, rbuf in zip(requests, buffers):
            entries = by_file.setdefault(req.stored.path, [])
            if rbuf.whole is not None:  # one run, the whole tensor: the common case, no numpy
                checked = req.verify and req.stored.crc32c is not None
                entries.append((req.stored.offset, rbuf.whole, req if checked else None))
                continue
            for box in rbuf.boxes:
                offsets, length = _runs.byte_runs(
                    req.stored.dtype, req.stored.shape, box.index, req.stored.name
                )
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
    thread that read it, while its bytes are in that CPU's cache; the last part combines."""

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
        stored = self.req.stored
        runs = [(o, n, c) for o, (n, c) in self._parts.items()]
        actual = _checksum.combine_runs(runs, stored.nbytes)
        if actual != stored.crc32c:
            assert stored.crc32c is not None
            raise IntegrityError(
                f"tensor {stored.name!r} in {stored.path.name}: CRC32C mismatch (recorded "
                f"{_checksum.to_hex(stored.crc32c)}, read {_checksum.to_hex(actual)}); "
                "the file is damaged"
            )


def _checked_runs(
    file_runs: list[tuple[int, np.ndarray, ReadRequest | None]],
) -> tuple[list[tuple[int, np.ndarray]], Callable[[int], None] | None]:
    # A file's runs for read_runs, each checked tensor cut into parts of an even share of the
    # file's bytes per reading thread, and the on_run that checks them.
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
