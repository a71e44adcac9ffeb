"""The safetensors wire format: building and strictly validating headers.

A file is ``u64 little-endian N`` + ``N bytes of JSON header`` + the data section. The header
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative
to the data section) plus an optional ``"__metadata__"`` of ``str -> str``. Written by hand, not
through the ``safetensors`` package: writers lay out every offset before any byte is written
(several processes fill one file), and readers validate headers read through ranged I/O.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core.errors import HeaderError, NotSafetensorsError

METADATA_KEY = "__metadata__"
# Same cap as the reference implementation: a header larger than this is refused unread.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# New files start their data section on a 4 KiB boundary (the header's JSON is padded with
# trailing spaces, which the format allows and every reader skips): O_DIRECT reads need file
# offsets aligned to the device's block, and 4 KiB covers every common block and page size.
# The reference writer pads to 8 only; files padded either way read the same.
DATA_ALIGNMENT = 4096
_MAX_ELEMENTS = 2**63 - 1  # numpy's and XLA's limit on elements (and on any one dimension)


class TensorEntry(NamedTuple):
    """One tensor's place in a file; ``begin``/``end`` are relative to the data section.

    Example::

        entry = osf.read_header("model.safetensors").tensors["w"]
        entry.dtype, entry.shape, entry.nbytes      # ('F32', (2, 3), 24)
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Header:
    """A validated header: tensors in file order, user metadata and where data starts.

    Example::

        header = osf.read_header("model.safetensors")
        header.metadata, header.data_start, list(header.tensors)
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int

    @property
    def data_size(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def build_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorEntry]]:
    """Lays out ``tensors`` in order: (the file's first ``data_start`` bytes, entries). Offsets
    depend only on names, dtypes and shapes, so every process computes the same layout."""
    entries: list[TensorEntry] = []
    offset = 0
    seen: set[str] = set()
    for name, dtype, shape in tensors:
        if name in seen:
            raise HeaderError(f"tensor name {name!r} appears twice in one file")
        if name == METADATA_KEY:
            raise HeaderError(f"{METADATA_KEY!r} cannot be a tensor name")
        seen.add(name)
        size = _dtypes.nbytes(dtype, shape)
        shape_t = tuple(int(d) for d in shape)
        entries.append(TensorEntry(name, dtype, shape_t, offset, offset + size))
        offset += size
    doc: dict[str, Any] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise HeaderError(
                    f"safetensors metadata must map str to str; got {k!r}: {type(v).__name__}"
                )
        doc[METADATA_KEY] = dict(metadata)
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % DATA_ALIGNMENT)
    if len(text) > MAX_HEADER_BYTES:
        raise HeaderError(f"header of {len(text)} bytes exceeds the {MAX_HEADER_BYTES} cap")
    return struct.pack("<Q", len(text)) + text, entries


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise HeaderError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def _all_non_negative_ints(values: list[Any]) -> bool:
    # A plain loop over exact ints (JSON gives no int subclasses but bool), not all() over a
    # generator: this runs for every tensor of every header, 10,000 times for 10,000 tensors.
    for v in values:  # noqa: SIM110
        if type(v) is not int or v < 0:
            return False
    return True


def parse_header(
    prefix: bytes, read: Callable[[int], bytes], file_size: int, *, where: str = "file"
) -> Header:
    """Validates a header and returns it. ``prefix``: the file's first 8 bytes; ``read(n)``:
    the ``n`` header bytes after them (called only once ``n`` is checked against ``file_size``
    and the cap); ``where``: the file's name, for messages.

    Raises:
      HeaderError: naming the first problem found.
    """
    if len(prefix) < 8 or file_size < 8:
        raise HeaderError(f"{where}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0:
        raise HeaderError(f"{where}: header length is 0")
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES} byte cap")
    if 8 + n > file_size:
        raise HeaderError(
            f"{where}: header length {n} runs past the end of the {file_size}-byte file"
        )
    raw = read(n)
    if len(raw) != n:
        raise HeaderError(f"{where}: file truncated inside the header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"{where}: header is not valid UTF-8 ({e})") from None
    if not text.startswith("{"):
        raise HeaderError(f"{where}: header does not start with a JSON object")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except HeaderError as e:
        raise HeaderError(f"{where}: {e}") from None
    except RecursionError:
        raise HeaderError(f"{where}: header JSON is nested too deeply") from None
    except ValueError as e:
        raise HeaderError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise HeaderError(f"{where}: header is not a JSON object")
    data_size = file_size - 8 - n
    metadata = _parse_metadata(doc.pop(METADATA_KEY, None), where)
    entries = [_parse_entry(name, info, data_size, where) for name, info in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            kind = (
                "overlaps the previous tensor"
                if entry.begin < expected
                else "leaves a hole before it"
            )
            raise HeaderError(
                f"{where}: tensor {entry.name!r} at offset {entry.begin} {kind} "
                f"(expected {expected})"
            )
        expected = entry.end
    if expected != data_size:
        raise HeaderError(
            f"{where}: tensors cover {expected} bytes but the data section holds {data_size} "
            "(truncated file or trailing bytes)"
        )
    return Header({t.name: t for t in entries}, metadata, 8 + n)


def parse_file(pread: Callable[[int, int], bytes], file_size: int, *, where: str) -> Header:
    """:func:`parse_header` of a file read through ``pread(offset, n)``.

    Raises:
      NotSafetensorsError: the file is recognisably something else.
      HeaderError: the header is malformed, inconsistent or hostile.
    """
    try:
        return parse_header(pread(0, 8), lambda n: pread(8, n), file_size, where=where)
    except HeaderError:
        # Only now: a valid header's length may begin with any byte.
        found = _sniff.sniff_bytes(pread(0, _sniff.HEAD_BYTES), where)
        if found is None:
            raise
    raise NotSafetensorsError(_sniff.message(where, found), found)


def _parse_metadata(meta: object, where: str) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise HeaderError(f"{where}: {METADATA_KEY} must be an object of strings")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise HeaderError(f"{where}: {METADATA_KEY}[{k!r}] is {type(v).__name__}, not a string")
    return meta


def _parse_entry(name: str, info: object, data_size: int, where: str) -> TensorEntry:
    if (
        type(info) is not dict
        or len(info) != 3
        or "dtype" not in info
        or "shape" not in info
        or "data_offsets" not in info
    ):
        raise HeaderError(
            f"{where}: tensor {name!r} must be an object with exactly dtype, shape, data_offsets"
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not _dtypes.is_known(dtype):
        raise HeaderError(f"{where}: tensor {name!r} has unknown dtype {dtype!r}")
    if type(shape) is not list or not _all_non_negative_ints(shape):
        raise HeaderError(
            f"{where}: tensor {name!r} shape {shape!r} is not a list of non-negative integers"
        )
    if len(shape) > 64:
        raise HeaderError(f"{where}: tensor {name!r} has {len(shape)} dimensions (max 64)")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not _all_non_negative_ints(offsets)
        or offsets[0] > offsets[1]
    ):
        raise HeaderError(
            f"{where}: tensor {name!r} data_offsets {offsets!r} are not [begin <= end]"
        )
    begin, end = offsets
    if end > data_size:
        raise HeaderError(
            f"{where}: tensor {name!r} ends at {end}, past the {data_size}-byte data section"
        )
    # Python ints cannot overflow; bounding by the data size keeps any claim honest.
    try:
        size = _dtypes.nbytes(dtype, shape)
    except ValueError as e:
        raise HeaderError(f"{where}: tensor {name!r}: {e}") from None
    if size != end - begin:
        raise HeaderError(
            f"{where}: tensor {name!r} is {dtype}{shape}: {size} bytes, "
            f"but its data_offsets span {end - begin}"
        )
    # Zero-size tensors pass the byte count whatever their other dimensions claim (any other
    # tensor's element count is bounded by the data section it spans).
    if size == 0 and _dtypes.num_elements([d for d in shape if d]) > _MAX_ELEMENTS:
        raise HeaderError(
            f"{where}: tensor {name!r} shape {shape} overflows (more than 2**63-1 elements)"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)
