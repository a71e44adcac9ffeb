"""The rows of every table of tensors (:class:`TensorInfo`), and one ``.safetensors`` file
listed from its header alone (:func:`list_file`): a local file with ``os.pread`` and the core
alone (no JAX, Orbax, NumPy, not even the storage layer), so that ``inspect FILE`` answers at
once; other paths through the storage router.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
from typing import TYPE_CHECKING, Any

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core.errors import SchemaError, UnsafePathError
from orbax_safetensors._src.storage import confine as _confine

if TYPE_CHECKING:
    from etils import epath


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: dotted name, safetensors dtype, shape, size and file (relative);
    ``cast_from``: its dtype before a save-time dtype policy cast it (None: saved as is)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    cast_from: str | None = None

    @classmethod
    def of(cls, name: str, value: Any, file: str) -> TensorInfo:
        """The row of an array (anything with a ``shape`` and a numpy ``dtype``)."""
        dtype = _dtypes.from_numpy(value.dtype, key=name)
        shape = tuple(int(d) for d in value.shape)
        return cls(name, dtype, shape, _dtypes.nbytes(dtype, shape), file)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.nbytes,
            "file": self.file,
        }
        if self.cast_from is not None:
            out["cast_from"] = self.cast_from
        return out


class SourceKind(enum.StrEnum):
    """What a table of tensors lists (shown in reports as the string itself)."""

    FILE = "file"
    ITEM = "item"
    SAFETENSORS_DIR = "safetensors-dir"
    ORBAX = "orbax"
    FLAX_MSGPACK = "flax-msgpack"


@dataclasses.dataclass(frozen=True)
class FileTable:
    """The tensors of one safetensors file and its user metadata (``__metadata__`` without the
    entries this library reserves)."""

    path: epath.Path | pathlib.PurePath
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any]
    kind: SourceKind = SourceKind.FILE


def schema_facts(schema: Any) -> tuple[dict[str, str], dict[str, str]]:
    """What the tools show of a schema document: ``{tensor name: its dtype before a save-time
    cast}`` and ``{alias name: the tensor it points at}`` (tied weights); empty when it is
    absent or unreadable (the tools still list the tensors)."""
    try:
        leaves = _schema.from_json(schema).leaves if schema is not None else {}
    except SchemaError:
        return {}, {}
    origins = {
        name: leaf.node.cast_from
        for name, leaf in leaves.items()
        if isinstance(leaf.node, _schema.Tensor) and leaf.node.cast_from is not None
    }
    aliases = {
        name: leaf.tensor_name for name, leaf in leaves.items() if leaf.kind is _schema.LeafKind.REF
    }
    if not all(_dtypes.is_known(origin) for origin in origins.values()):
        origins = {}
    return {name: str(origin) for name, origin in origins.items()}, aliases


def header_facts(
    header: _header.Header, where: str
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """A header's user metadata (``__metadata__`` without this library's entries) and the
    :func:`schema_facts` of its schema."""
    try:
        schema = _metadata.header_json(header, _metadata.SCHEMA_KEY, where)
    except SchemaError:
        schema = None
    user = {k: v for k, v in header.metadata.items() if k not in _metadata.RESERVED_KEYS}
    return user, *schema_facts(schema)


def list_file(path: epath.PathLike) -> FileTable:
    """The tensors of the safetensors file ``path``, from its header alone; raises
    ``NotSafetensorsError`` (something else), ``HeaderError`` or ``OSError``."""
    path, header = _read_header(path)
    user, origins, _ = header_facts(header, str(path))
    tensors = {
        name: TensorInfo(name, e.dtype, e.shape, e.nbytes, path.name, origins.get(name))
        for name, e in header.tensors.items()
    }
    return FileTable(path, tensors, user)


def _read_header(path: epath.PathLike) -> tuple[epath.Path | pathlib.PurePath, _header.Header]:
    """``path`` and its header: a local regular file read here, anything else through the
    storage router."""
    name = os.fspath(path)
    if "://" not in name:
        try:
            fd, info = _confine.open_regular(name)
        except (OSError, UnsafePathError):
            fd = None  # the router raises the error every tool words the same way
        if fd is not None:
            local = pathlib.PurePath(name)
            with open(fd, "rb") as f:  # (a buffered read returns n bytes, fewer only at the end)

                def pread(offset: int, nbytes: int) -> bytes:
                    f.seek(offset)
                    return f.read(nbytes)

                header = _header.parse_file(pread, info.st_size, where=str(local))
            return local, header
    from etils import epath

    from orbax_safetensors._src.storage import router

    return epath.Path(path), router.read_header(path)
