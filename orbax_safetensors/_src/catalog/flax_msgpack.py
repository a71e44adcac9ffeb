"""Legacy Flax msgpack checkpoints (``flax.serialization.to_bytes``, ``flax.training``'s
``checkpoint_<step>``), decoded without Flax or pickle: only the three msgpack ext types Flax
writes are accepted (1 an ndarray ``(shape, dtype name, C-order bytes)``, 2 a Python complex,
3 a numpy scalar), a dtype must be a known numeric one, and each array's shape is checked
against the bytes present before a view on them is made. Arrays above Flax's
``MAX_CHUNK_SIZE`` are joined from its chunked form. The file is decoded whole (host memory
about twice its size); :class:`MsgpackSource` is it as a table of tensors.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
from etils import epath

from orbax_safetensors._src.catalog.listing import SourceKind, TensorInfo
from orbax_safetensors._src.core import sniff as _sniff
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError, UnsupportedLeafError
from orbax_safetensors._src.storage import confine as _confine

if TYPE_CHECKING:
    import numpy as np

_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3  # flax's _MsgpackExtType
_CHUNKED = "__msgpack_chunked_array__"
_MAX_RANK = 64
_MAX_DEPTH = 128  # nested maps; Flax state dicts are a few levels deep
_STEP_NAME = re.compile(r"^(?:.*?_)?(\d+)$")  # checkpoint_<step>, flax's default prefix


# The dtypes an ndarray ext may name: numeric numpy and ml_dtypes ones (never object, string,
# void or structured). Imported on the first decode: is_flax_msgpack, which `inspect` asks of
# every file, needs none of them, and importing ml_dtypes is slow.
_NUMPY_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_ML_DTYPES_NAMES = (
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu",
    "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4",
)  # fmt: skip


@functools.cache
def _accepted_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes
    import numpy as np

    table = {name: np.dtype(name) for name in _NUMPY_NAMES}
    for name in _ML_DTYPES_NAMES:
        if hasattr(ml_dtypes, name):
            table[name] = np.dtype(getattr(ml_dtypes, name))
    return table


class FlaxMsgpackError(SafetensorsCheckpointError):
    """A Flax msgpack file is truncated, forged or holds something this reader refuses."""


class _Ext:
    """An ext value kept undecoded until its dotted name is known (for error messages)."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


def looks_like_flax_msgpack(head: bytes) -> bool:
    """Whether a file's first bytes look like a Flax msgpack state dict (``sniff_bytes``)."""
    found = _sniff.sniff_bytes(head)
    return found is not None and found.kind == _sniff.Kind.FLAX_MSGPACK


def is_flax_msgpack(path: epath.PathLike) -> bool:
    """Whether ``path`` is a file that looks like a Flax msgpack checkpoint (``.safetensors``
    files never do)."""
    path = epath.Path(path)
    if path.suffix == ".safetensors" or not path.exists() or path.is_dir():
        return False
    head = _confine.read_file(path, head=_sniff.HEAD_BYTES)  # (a FIFO: refused, not waited on)
    return looks_like_flax_msgpack(head)


def step_of(path: epath.PathLike) -> int | None:
    """The step in a ``flax.training.checkpoints`` file name (``checkpoint_1000`` -> 1000)."""
    m = _STEP_NAME.match(epath.Path(path).name)
    return int(m.group(1)) if m else None


def read_file(path: epath.PathLike) -> dict[Any, Any]:
    """Decodes a Flax msgpack file into its state dict; a ``FlaxMsgpackError`` names the file
    (and the key, shape and dtype at fault) when it is truncated, forged or no state dict."""
    path = epath.Path(path)
    return decode(_confine.read_file(path, limit=None), where=str(path))


def decode(data: bytes | memoryview, *, where: str = "<bytes>") -> dict[Any, Any]:
    """Decodes Flax msgpack bytes into the state dict ``flax.serialization.msgpack_restore``
    would give (arrays are read-only views on the decoded bytes)."""
    try:
        tree = msgpack.unpackb(
            data,
            ext_hook=_Ext,
            raw=False,
            strict_map_key=False,
            use_list=True,
        )
    except msgpack.exceptions.ExtraData:
        raise FlaxMsgpackError(
            f"{where}: bytes follow the end of the msgpack data (a damaged or concatenated file)"
        ) from None
    except msgpack.exceptions.StackError:
        raise FlaxMsgpackError(
            f"{where}: not a valid msgpack file (nested too deeply for msgpack)"
        ) from None
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
        raise FlaxMsgpackError(
            f"{where}: not a valid msgpack file ({str(e) or type(e).__name__}); "
            "it may be truncated or damaged"
        ) from None
    if not isinstance(tree, dict):
        raise FlaxMsgpackError(
            f"{where}: holds a msgpack {type(tree).__name__}, not the map of a Flax state dict"
        )
    return _resolve(tree, "", where, 0)  # type: ignore[no-any-return]


def _resolve(node: Any, name: str, where: str, depth: int) -> Any:
    """Decodes every ext value of ``node`` and joins chunked arrays, naming the key on error."""
    if isinstance(node, _Ext):
        return _decode_ext(node, name, where)
    if isinstance(node, (dict, list)) and depth >= _MAX_DEPTH:
        raise FlaxMsgpackError(
            f"{where}: key {name[:100]!r}...: nested deeper than {_MAX_DEPTH} levels"
        )
    if isinstance(node, dict):
        out = {k: _resolve(v, _join(name, k), where, depth + 1) for k, v in node.items()}
        return _unchunk(out, name, where) if _CHUNKED in out else out
    if isinstance(node, list):
        return [_resolve(v, _join(name, i), where, depth + 1) for i, v in enumerate(node)]
    if isinstance(node, msgpack.Timestamp):  # ext type -1, decoded by msgpack itself
        raise FlaxMsgpackError(
            f"{where}: key {name!r}: msgpack Timestamp (ext type -1) is not a value Flax writes "
            "(ndarrays, complex numbers and numpy scalars are ext types 1-3)"
        )
    return node


def _join(name: str, key: Any) -> str:
    return f"{name}.{key}" if name else str(key)


def _decode_ext(ext: _Ext, name: str, where: str) -> Any:
    if ext.code == _EXT_NDARRAY:
        return _ndarray(ext.data, name, where)
    if ext.code == _EXT_NPSCALAR:
        arr = _ndarray(ext.data, name, where)
        if arr.shape != ():
            raise FlaxMsgpackError(f"{where}: key {name!r}: a numpy scalar with shape {arr.shape}")
        return arr[()]
    if ext.code == _EXT_COMPLEX:
        try:
            parts = msgpack.unpackb(ext.data, raw=True)
        except (ValueError, TypeError, msgpack.exceptions.UnpackException):
            parts = None
        if (
            not isinstance(parts, list)
            or len(parts) != 2
            or not all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in parts)
        ):
            raise FlaxMsgpackError(f"{where}: key {name!r}: a damaged complex number")
        return complex(parts[0], parts[1])
    raise FlaxMsgpackError(
        f"{where}: key {name!r}: msgpack ext type {ext.code} is not one Flax writes "
        f"({_EXT_NDARRAY} ndarray, {_EXT_COMPLEX} complex, {_EXT_NPSCALAR} numpy scalar)"
    )


def _ndarray(data: bytes, name: str, where: str) -> np.ndarray:
    """Flax's ndarray ext: msgpack ``[shape, dtype name, bytes]``; the array is a view."""
    import numpy as np

    problem = f"{where}: key {name!r}: a damaged array"
    unpacker = msgpack.Unpacker(raw=True, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        if unpacker.read_array_header() != 3:
            raise FlaxMsgpackError(f"{problem} (not a [shape, dtype, bytes] triple)")
        shape = unpacker.unpack()
        dtype_name = unpacker.unpack()
        offset = unpacker.tell()
    except (ValueError, TypeError, msgpack.exceptions.UnpackException, StopIteration):
        raise FlaxMsgpackError(f"{problem} (truncated)") from None
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_RANK
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise FlaxMsgpackError(f"{problem}: shape {shape!r} is not a list of sizes")
    dtype_text = dtype_name.decode("ascii", "replace") if isinstance(dtype_name, bytes) else ""
    dtype = _accepted_dtypes().get(dtype_text)
    if dtype is None:
        raise FlaxMsgpackError(
            f"{where}: key {name!r}: dtype {dtype_name!r} is not a numeric dtype this reader "
            f"accepts ({', '.join(_accepted_dtypes())})"
        )
    _check_extent(shape, dtype, problem)
    start, length = _bytes_header(data, offset, problem)
    expected = math.prod(shape) * dtype.itemsize
    if length != expected or start + length != len(data):
        raise FlaxMsgpackError(
            f"{where}: key {name!r}: shape {tuple(shape)} of {dtype.name} needs {expected} "
            f"bytes, the file holds {min(length, len(data) - start)}"
        )
    return np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape)


_MAX_EXTENT = 2**63 - 1  # numpy's limit on (product of dimensions) * itemsize, zeros as 1


def _check_extent(shape: list[int], dtype: np.dtype, problem: str) -> None:
    """Refuses a shape numpy cannot represent even with no element (a dimension of 2**64 - 1)."""
    extent = math.prod(max(d, 1) for d in shape) * dtype.itemsize
    if extent > _MAX_EXTENT:
        raise FlaxMsgpackError(
            f"{problem}: shape {tuple(shape)} of {dtype.name} is beyond any array's size "
            f"(a dimension times the others exceeds {_MAX_EXTENT} bytes)"
        )


def _bytes_header(data: bytes, offset: int, problem: str) -> tuple[int, int]:
    """(start, length) of the msgpack bin (or raw str) value at ``offset``."""
    if offset >= len(data):
        raise FlaxMsgpackError(f"{problem} (no bytes)")
    marker = data[offset]
    if 0xA0 <= marker <= 0xBF:  # fixstr: older writers stored the bytes as raw str
        return offset + 1, marker & 0x1F
    widths = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
    width = widths.get(marker)
    if width is None or offset + 1 + width > len(data):
        raise FlaxMsgpackError(f"{problem} (its bytes are missing)")
    length = int.from_bytes(data[offset + 1 : offset + 1 + width], "big")
    return offset + 1 + width, length


def _unchunk(node: dict[Any, Any], name: str, where: str) -> np.ndarray:
    """Joins flax's chunked form of an array larger than ``MAX_CHUNK_SIZE``."""
    import numpy as np

    problem = f"{where}: key {name!r}: a damaged chunked array"
    shape_d, chunks_d = node.get("shape"), node.get("chunks")
    if not isinstance(shape_d, dict) or not isinstance(chunks_d, dict):
        raise FlaxMsgpackError(f"{problem} (no shape or chunks)")
    try:
        shape = [shape_d[str(i)] for i in range(len(shape_d))]
        chunks = [chunks_d[str(i)] for i in range(len(chunks_d))]
    except KeyError as e:
        raise FlaxMsgpackError(f"{problem} (entry {e} missing)") from None
    if len(shape) > _MAX_RANK or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise FlaxMsgpackError(f"{problem}: shape {shape!r} is not a list of sizes")
    if not chunks or not all(isinstance(c, np.ndarray) and c.ndim == 1 for c in chunks):
        raise FlaxMsgpackError(f"{problem} (its chunks are not 1-D arrays)")
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) != 1:
        raise FlaxMsgpackError(f"{problem} (chunks of several dtypes: {sorted(map(str, dtypes))})")
    _check_extent(shape, chunks[0].dtype, problem)
    total = sum(c.size for c in chunks)
    if total != math.prod(shape):
        raise FlaxMsgpackError(
            f"{where}: key {name!r}: chunks hold {total} elements of {chunks[0].dtype}, "
            f"shape {tuple(shape)} needs {math.prod(shape)}"
        )
    return np.concatenate(chunks).reshape(shape)


def flatten(tree: dict[Any, Any]) -> dict[str, Any]:
    """``flax.traverse_util.flatten_dict(tree, sep=".")`` (empty dicts left out, as there)."""
    return dict(_items(tree, ""))


def select(tree: dict[Any, Any], keep: Callable[[str], bool]) -> dict[Any, Any]:
    """``tree`` with only the leaves whose :func:`flatten` names ``keep`` accepts; dicts left
    empty are dropped."""

    def walk(node: dict[Any, Any], prefix: str) -> dict[Any, Any]:
        kept: dict[Any, Any] = {}
        for k, v in node.items():
            name = _join(prefix, k)
            if isinstance(v, dict):
                if sub := walk(v, name):
                    kept[k] = sub
            elif keep(name):
                kept[k] = v
        return kept

    return walk(tree, "")


def _items(node: dict[Any, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for k, v in node.items():
        name = _join(prefix, k)
        if isinstance(v, dict) and v:
            yield from _items(v, name)
        elif not isinstance(v, dict):
            yield name, v


class MsgpackSource:
    """A legacy Flax msgpack file as a table of tensors named as :func:`flatten` names them,
    decoded whole. ``tree``: the state dict, a Python complex as a ``complex64`` scalar where
    that is exact (safetensors has no complex128).
    """

    def __init__(self, path: epath.Path) -> None:
        import numpy as np

        self.path = path
        self.kind = SourceKind.FLAX_MSGPACK
        self.tree = _exact_complex64(read_file(path), str(path))
        self.values = {
            name: np.asarray(v)
            for name, v in flatten(self.tree).items()
            if isinstance(v, (np.ndarray, np.generic))
        }
        self.tensors = {n: TensorInfo.of(n, v, path.name) for n, v in self.values.items()}
        self.metadata: dict[str, Any] = {}

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: self.values[n] for n in names}


def _exact_complex64(node: Any, where: str, name: str = "") -> Any:
    import numpy as np

    if isinstance(node, dict):
        return {k: _exact_complex64(v, where, _join(name, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_exact_complex64(v, where, _join(name, i)) for i, v in enumerate(node)]
    if isinstance(node, complex):
        value = np.complex64(node)
        if complex(value) != node:
            raise UnsupportedLeafError(
                f"{where}: key {name!r}: complex {node!r} is not exact in complex64, and "
                "safetensors has no complex128"
            )
        return value
    return node
