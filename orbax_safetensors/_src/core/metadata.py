"""The metadata a checkpoint carries: the directory's ``orbax_safetensors.json`` document
(built, checked, parsed, checksums merged in), the standalone file's ``__metadata__`` keys, and
the rule for file names read from a checkpoint (relative paths below their directory). Pure:
the callers read and write the bytes; ``storage/confine.py`` adds what the filesystem knows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core.errors import (
    IntegrityError,
    MetadataError,
    SchemaError,
    UnsafePathError,
    UnsupportedLeafError,
)
from orbax_safetensors._version import __version__

# -- a checkpoint directory -----------------------------------------------------------------

METADATA_FILE = "orbax_safetensors.json"
FORMAT_NAME = "orbax-safetensors"
FORMAT_VERSION = 1
SHARE_FILE_PREFIX = "crc32c.process_"  # + process index + ".json": a process's checksum share
DRAFT_FILE = METADATA_FILE + ".draft"  # the metadata before the checksums are merged in
MAX_METADATA_BYTES = 512 * 1024 * 1024
HEADER_METADATA = {"format": "flax"}  # every header's __metadata__, as safetensors.flax writes

# -- a standalone file's __metadata__ --------------------------------------------------------

SCHEMA_KEY = "orbax_safetensors.tree"
CHECKSUM_KEY = "orbax_safetensors.crc32c"
RESERVED_KEYS = (SCHEMA_KEY, CHECKSUM_KEY)


def file_metadata(
    schema: Mapping[str, Any], crcs: Mapping[str, str], user: Mapping[str, str] | None
) -> dict[str, str]:
    """A standalone file's ``__metadata__``: the format, the user's entries, the tree schema and
    the checksum table.

    Raises:
      UnsupportedLeafError: a user entry is not ``str -> str`` or uses a reserved key.
    """
    meta: dict[str, str] = dict(HEADER_METADATA)
    for k, v in (user or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UnsupportedLeafError(
                f"metadata must map str to str (safetensors' rule); got {k!r}: {type(v).__name__}"
            )
        if k in RESERVED_KEYS:
            raise UnsupportedLeafError(f"metadata key {k!r} is reserved by orbax_safetensors")
        meta[k] = v
    meta[SCHEMA_KEY] = json.dumps(schema, separators=(",", ":"))
    meta[CHECKSUM_KEY] = json.dumps(dict(crcs), separators=(",", ":"))
    return meta


def header_json(header: _header.Header, key: str, where: str) -> Any:
    """The JSON value stored under ``key`` of a header's ``__metadata__``, or None if absent.

    Raises:
      SchemaError: the value is not valid JSON (or nested too deeply).
    """
    text = header.metadata.get(key)
    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError:
        raise SchemaError(f"{where}: {key} is nested too deeply") from None
    except ValueError as e:
        raise SchemaError(f"{where}: {key} is not valid JSON ({e})") from None


def tensor_nbytes(t: Mapping[str, Any]) -> int:
    """The stored size of a tensor entry of the metadata document."""
    return _dtypes.nbytes(t["dtype"], t["shape"])


def is_plain_filename(name: object) -> bool:
    """Whether ``name`` is a plain file name inside the checkpoint directory (no path parts)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


def escape_problem(name: object) -> str | None:
    """What makes ``name`` (read from a checkpoint) no relative path below its directory
    (``"an absolute path"``, ``"a '..' part"``...), or None when it is one.
    """
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\0" in name:
        return "a NUL character"
    if "://" in name:
        return "a URL"
    if name.startswith(("/", "\\")):
        return "an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "a '..' part"
    return None


def escape_error(where: object, name: object, root: object, detail: str = "") -> UnsafePathError:
    """The one error for a name read from ``where`` (the file that holds it) that leads outside
    ``root`` (the directory that holds it); ``detail`` says how."""
    return UnsafePathError(
        f"{where}: names {name!r}, which leads outside {root}"
        + (f" ({detail})" if detail else "")
        + "; a name read from a checkpoint must stay inside the directory that holds it (no "
        "absolute path, '..', URL or symbolic link out of it)"
    )


def check_user_metadata(user_metadata: Mapping[str, Any] | None) -> None:
    """Raises MetadataError (a TypeError) when ``user_metadata`` is not JSON-serialisable."""
    try:
        json.dumps(dict(user_metadata or {}))
    except (TypeError, ValueError) as e:
        raise MetadataError(f"metadata must be JSON-serialisable: {e}") from e


def build_metadata(
    plan: _plan.CheckpointPlan,
    specs: Sequence[_plan.TensorSpec],
    schema: Mapping[str, Any],
    shardings: Mapping[str, dict[str, Any] | None],
    user_metadata: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The metadata document of a checkpoint directory, less checksums (:func:`add_checksums`).

    Each tensor's ``data_offsets`` and each file's ``file_layout`` let a restore find every
    tensor without reading a header. ``shardings``: each tensor's
    :func:`.sharding.sharding_to_json` description or None.
    """
    shardings, devices = _sharding.split_devices(shardings)
    shardings, device_meshes = _sharding.intern_device_ids(shardings)
    tensors: dict[str, dict[str, Any]] = {
        s.name: {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "file": plan.files[plan.file_of[s.name]].filename,
            "sharding": shardings.get(s.name),
        }
        for s in specs
    }
    for name, device in devices.items():
        tensors[name]["device"] = device
    for s in specs:
        entry = plan.files[plan.file_of[s.name]].entries[s.name]
        tensors[s.name]["data_offsets"] = [entry.begin, entry.end]
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "files": [f.filename for f in plan.files],
        "file_layout": {
            f.filename: {"data_start": f.data_start, "size": f.size} for f in plan.files
        },
        "schema": schema,
        "tensors": tensors,
        "device_meshes": device_meshes,
        "metadata": None if user_metadata is None else dict(user_metadata),
    }


def parse_metadata(raw: bytes, where: object) -> dict[str, Any]:
    """Parses and checks the metadata document ``raw`` (the content of ``where``).

    Raises:
      SchemaError: not valid JSON, not this format, a version this library does not read, or
        the tensors, files or schema missing.
    """
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise SchemaError(f"{where}: nested too deeply") from None
    except ValueError as e:
        raise SchemaError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SchemaError(f"{where}: not an {FORMAT_NAME} metadata file")
    version = doc.get("format_version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise SchemaError(
            f"{where}: format_version {version!r} is not one this library reads (1..{FORMAT_VERSION})"
        )
    if not isinstance(doc.get("tensors"), dict) or not isinstance(doc.get("files"), list):
        raise SchemaError(f"{where}: tensors/files missing")
    if not isinstance(doc.get("schema"), dict):
        raise SchemaError(f"{where}: the tree schema is missing")
    validate_entries(doc, where)
    return doc


def validate_entries(doc: Mapping[str, Any], where: object) -> None:
    """Checks every field of a metadata document a restore relies on (the one validator restore
    and ``verify`` share); the schema is checked by ``tree.validate_schema``.

    Raises:
      SchemaError: naming the tensor and the field.
    """
    files = doc["files"]
    for filename in files:
        escape = escape_problem(filename)
        if escape is not None and isinstance(filename, str) and filename:
            raise escape_error(where, filename, str(where).rpartition("/")[0], escape)
        if not is_plain_filename(filename):
            raise SchemaError(f"{where}: lists an invalid file name {filename!r}")
    meshes = doc.get("device_meshes")
    if meshes is not None and not (
        isinstance(meshes, list)
        and all(isinstance(m, list) and all(type(i) is int for i in m) for m in meshes)
    ):
        raise SchemaError(f"{where}: device_meshes is not a list of lists of device ids")
    user = doc.get("metadata")
    if user is not None and not isinstance(user, dict):
        raise SchemaError(f"{where}: metadata is {type(user).__name__}, not a JSON object")
    listed = set(files)
    for name, info in doc["tensors"].items():
        _validate_tensor(name, info, listed, meshes, where)
    _validate_layout(doc, where)


def has_layout(doc: Mapping[str, Any]) -> bool:
    """Whether a checked metadata document places every tensor itself (``file_layout``, each
    tensor's ``data_offsets``); False for checkpoints written before these fields."""
    return doc.get("file_layout") is not None


def _validate_layout(doc: Mapping[str, Any], where: object) -> None:
    # file_layout and data_offsets come together or not at all (checkpoints written before
    # them have neither). When present they must describe files a header could: each tensor's
    # offsets as long as its dtype and shape say, the tensors of a file tiling its data section
    # exactly up to the recorded size. A restore that trusts them then reads inside the files.
    layout = doc.get("file_layout")
    tensors = doc["tensors"]
    if layout is None:
        for name, info in tensors.items():
            if "data_offsets" in info:
                raise SchemaError(
                    f"{where}: tensor {name!r} has data_offsets but the document has no file_layout"
                )
        return
    files = doc["files"]
    if not isinstance(layout, dict) or sorted(layout) != sorted(files):
        raise SchemaError(f"{where}: file_layout must describe exactly the listed files {files!r}")
    spans: dict[str, list[tuple[int, int, str]]] = {f: [] for f in files}
    for filename, info in layout.items():
        start = info.get("data_start") if isinstance(info, dict) else None
        size = info.get("size") if isinstance(info, dict) else None
        if not (
            type(start) is int
            and type(size) is int
            and 8 <= start <= 8 + _header.MAX_HEADER_BYTES
            and size >= start
        ):
            raise SchemaError(
                f"{where}: file_layout of {filename!r} is malformed: {info!r} (needs integers "
                "8 <= data_start <= size, data_start within the header size limit)"
            )
    for name, info in tensors.items():
        offsets = info.get("data_offsets")
        nbytes = tensor_nbytes(info)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and offsets[0] >= 0
            and offsets[1] - offsets[0] == nbytes
        ):
            raise SchemaError(
                f"{where}: tensor {name!r} has data_offsets {offsets!r}; a {info['dtype']}"
                f"{info['shape']} tensor needs [begin, begin + {nbytes}] with 0 <= begin"
            )
        spans[info["file"]].append((offsets[0], offsets[1], name))
    for filename, found in spans.items():
        found.sort()
        pos = 0
        for begin, end, name in found:
            if begin != pos:
                what = "overlaps the tensor before it" if begin < pos else "leaves a hole before it"
                raise SchemaError(
                    f"{where}: tensor {name!r} at data_offsets {[begin, end]} in {filename!r} {what}"
                )
            pos = end
        data = layout[filename]["size"] - layout[filename]["data_start"]
        if pos != data:
            raise SchemaError(
                f"{where}: the tensors of {filename!r} cover {pos} bytes of data but file_layout "
                f"gives it {data} ({layout[filename]})"
            )


def _validate_tensor(
    name: str, info: object, files: set[str], meshes: object, where: object
) -> None:
    if not isinstance(info, dict):
        raise SchemaError(f"{where}: tensor {name!r} has no entry (got {info!r})")
    dtype, shape = info.get("dtype"), info.get("shape")
    if not _dtypes.is_known(dtype):
        raise SchemaError(f"{where}: tensor {name!r} has an unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SchemaError(f"{where}: tensor {name!r} has a malformed shape {shape!r}")
    filename = info.get("file")
    if not isinstance(filename, str) or filename not in files:
        raise SchemaError(f"{where}: tensor {name!r} names an invalid file {filename!r}")
    crc = info.get("crc32c")
    if crc is not None and _checksum.from_hex(crc) is None:
        raise SchemaError(f"{where}: checksum of {name!r} is malformed: {crc!r}")
    if "device" in info and type(info["device"]) is not int:
        raise SchemaError(
            f"{where}: tensor {name!r}: device id {info['device']!r} is not an integer"
        )
    try:
        _sharding.check_sharding_json(info.get("sharding"), meshes, rank=len(shape))
    except SchemaError as e:
        raise SchemaError(f"{where}: tensor {name!r} has a malformed sharding: {e}") from None


def add_checksums(
    metadata: dict[str, Any], shares: Sequence[dict[str, Any]], where: object
) -> None:
    """Merges every process's checksum share into ``metadata`` (each tensor's ``crc32c``) when
    every share has checksums.

    Raises:
      IntegrityError: the processes did not write every byte of a tensor exactly once.
    """
    if shares and all(doc["checksums"] for doc in shares):
        written = dict.fromkeys(metadata["tensors"], 0)
        crcs = dict.fromkeys(metadata["tensors"], 0)
        for doc in shares:
            for name, (nbytes, share) in doc["tensors"].items():
                written[name] += nbytes
                crcs[name] ^= share
        for name, info in metadata["tensors"].items():
            if written[name] != tensor_nbytes(info):
                raise IntegrityError(
                    f"{where}: the processes wrote {written[name]} bytes of tensor {name!r} "
                    f"({info['dtype']}{info['shape']}, {tensor_nbytes(info)} bytes); every byte "
                    "must be written exactly once"
                )
            info["crc32c"] = _checksum.to_hex(crcs[name])
