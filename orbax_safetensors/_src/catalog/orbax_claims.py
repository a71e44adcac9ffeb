"""What an Orbax-native item's arrays are checked against before a read allocates them.

An Orbax-native item claims each array's shape in metadata (the array's zarr metadata,
``.zarray`` / ``zarr.json``, in a directory per array or inside the item's OCDBT database,
which Orbax's metadata tree reports); its bytes are chunks in files: one file per chunk, or
values of the OCDBT database in its data files (``d/<id>``, ``ocdbt.process_<i>/d/<id>``),
found through its manifest (``manifest.ocdbt``) and B-tree nodes. Nothing else bounds a
claimed shape, and a chunk is compressed (a chunk of zeros takes a few bytes), so the bytes
on disk do not bound it either. Before any read of ``OrbaxSource`` allocates an array
(``read``, ``read_box``, ``read_sharded``, and Orbax's own restore through ``restore``):

1. Orbax's metadata and the zarr metadata TensorStore opens claim the same shape
   (:func:`check_claim`);
2. in an OCDBT item, every data file that holds the tensor's B-tree nodes and values exists
   and holds the bytes the manifest places in it (:class:`OcdbtFiles`), so a missing file
   is named, not reported as damaged metadata or an empty shard;
3. unless the item reads never-written chunks as the fill value (one saved without
   ``store_array_data_equal_to_fill_value``), every stored chunk the read needs exists
   (:func:`check_stored`: TensorStore's storage statistics, a listing of the chunks present,
   which costs no more than the keys the item really holds);
4. one read allocates at most :func:`max_read_bytes`, the machine's physical memory
   (:func:`check_allocation`): the documented limit for what no file can bound, a claim
   read as the fill value or chunks that decompress far beyond their size.

Each refusal is a ``SafetensorsCheckpointError`` naming the item, the tensor, its claimed
dtype, shape and bytes, and what was found instead. When Orbax cannot read an item's
metadata at all, :func:`missing_file` names the file that is missing (the OCDBT manifest,
a data file, an array's zarr metadata) where one is.

Example::

    files = OcdbtFiles(epath.Path("/ckpt/100/state"))
    files.check("params.w/", "params.w")   # raises naming a missing or short data file
"""

from __future__ import annotations

import json
import math
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

from etils import epath

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps

# Orbax's _METADATA value types stored as a zarr array each (strings are stored elsewhere).
_ARRAY_VALUE_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})


def max_read_bytes() -> int | None:
    """The most bytes one read of an Orbax-native array may allocate: the machine's physical
    memory (``os.sysconf``), or None where the system does not report it."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def describe(dtype: str, shape: Sequence[int], nbytes: int) -> str:
    """A claimed array for messages: ``F32[1048576, 1048576] (4398046511104 bytes)``."""
    return f"{dtype}{list(shape)} ({nbytes} bytes)"


def check_allocation(
    where: str,
    name: str,
    dtype: str,
    shape: Sequence[int],
    *,
    boxes: Sequence[Sequence[slice]],
    chunk: Sequence[int],
) -> None:
    """Raises unless a read of ``boxes`` of tensor ``name`` (claimed ``dtype[shape]``, stored
    in chunks of ``chunk``) fits :func:`max_read_bytes`: the boxes, plus one chunk decoded
    whole (a chunk is the unit TensorStore decodes, however little of it a box takes)."""
    limit = max_read_bytes()
    read = sum(_dtypes.nbytes(dtype, tuple(s.stop - s.start for s in box)) for box in boxes)
    if limit is None or not read:
        return
    decoded = _dtypes.nbytes(dtype, tuple(chunk))
    if read + decoded > limit:
        claim = describe(dtype, shape, _dtypes.nbytes(dtype, tuple(shape)))
        raise SafetensorsCheckpointError(
            f"{where}: tensor {name!r} claims {claim}; this read of {read} bytes, with a "
            f"chunk of {list(chunk)} decoded ({decoded} bytes), needs more than this machine's "
            f"{limit} bytes of physical memory: refused before allocating (the claim is "
            "forged, or the array too large to read here)"
        )


def check_claim(
    where: str, name: str, claimed: Sequence[int], stored: Sequence[int], zarr_file: str
) -> None:
    """Raises unless Orbax's metadata shape ``claimed`` of tensor ``name`` is the shape
    ``stored`` that its zarr metadata ``zarr_file`` gives."""
    if tuple(claimed) != tuple(stored):
        raise SafetensorsCheckpointError(
            f"{where}: tensor {name!r}: Orbax's metadata claims shape {list(claimed)} but its "
            f"zarr metadata ({zarr_file}) gives shape {list(stored)}: the item is damaged or "
            "forged"
        )


def check_stored(
    where: str,
    name: str,
    store: Any,
    box: Sequence[slice],
    claim: str,
    chunk: Sequence[int],
    location: str,
) -> None:
    """Raises unless every stored chunk of ``box`` of tensor ``name`` (``store``: its opened
    TensorStore; ``claim``: its :func:`describe`; ``chunk``: its chunk shape; ``location``:
    where its chunks live, for the message) is present. Lists the chunks present; reads
    none."""
    if not math.prod(s.stop - s.start for s in box):
        return
    try:
        stats = store[tuple(box)].storage_statistics(query_fully_stored=True).result()
    except ValueError as e:
        raise SafetensorsCheckpointError(
            f"{where}: tensor {name!r}: its stored chunks cannot be listed in {location}: {e}"
        ) from None
    if not stats.fully_stored:
        part = ", ".join(f"{s.start}:{s.stop}" for s in box)
        raise SafetensorsCheckpointError(
            f"{where}: tensor {name!r} claims {claim}, but chunks of [{part}] (chunks of "
            f"{list(chunk)}) are missing from {location}: refused before allocating (the item "
            "is damaged, partly deleted or forged)"
        )


class OcdbtFiles:
    """The data files of the OCDBT database of item ``path``, checked against its manifest:
    :meth:`check` walks the B-tree under one key prefix and raises naming the first data
    file a node or value of it lies in that is missing or shorter than the manifest says.
    Nodes and file sizes are kept, so the tensors of one item share the walk's reads."""

    def __init__(self, path: epath.Path) -> None:
        self.path = path
        self._base: Any = None
        self._nodes: dict[str, Any] = {}
        self._sizes: dict[str, int | None] = {}
        self._checked: set[str] = set()
        self._root: tuple[str, int] | None = None

    def check(self, prefix: str, name: str | None = None) -> None:
        """Checks every B-tree node on the way to the keys under ``prefix`` (all keys: "")
        and every value stored there, for tensor ``name`` (messages)."""
        import tensorstore as ts

        if self._base is None:
            manifest = self.path / _steps.OCDBT_MANIFEST_FILE
            if not manifest.exists():
                raise SafetensorsCheckpointError(
                    f"{self.path}: OCDBT manifest file {_steps.OCDBT_MANIFEST_FILE} is missing"
                    + (f" (reading tensor {name!r})" if name else "")
                )
            self._base = ts.KvStore.open(kvstore_url(self.path)).result()
            try:
                doc = ts.ocdbt.dump(self._base).result()
            except ValueError as e:
                raise SafetensorsCheckpointError(
                    f"{manifest}: not a readable OCDBT manifest ({e})"
                ) from None
            latest = (doc.get("versions") or [{}])[-1]
            location = latest.get("root", {}).get("location")
            if location is not None:
                self._root = (location, int(latest.get("root_height", 0)))
        if prefix in self._checked:
            return
        if self._root is not None:
            low = prefix.encode()
            self._walk(*self._root, b"", None, low, _successor(low), name)
        self._checked.add(prefix)

    def _walk(
        self,
        location: str,
        height: int,
        acc: bytes,
        hi: bytes | None,
        low: bytes,
        high: bytes | None,
        name: str | None,
    ) -> None:
        # The node at ``location`` (of ``height``: each level down is one lower, as
        # TensorStore requires, so a forged tree cannot loop) holds keys acc + key below
        # ``hi``; only its part that meets [low, high) is read.
        node = self._node(location, name)
        if node.get("height") != height or height < 0:
            raise SafetensorsCheckpointError(
                f"{self.path}: its OCDBT database has a B-tree node ({location}) of height "
                f"{node.get('height')!r} where {height} is expected"
            )
        entries = node.get("entries") or []
        for i, entry in enumerate(entries):
            key = acc + bytes(entry.get("key", b""))
            if height > 0 and "location" in entry:
                stop = acc + bytes(entries[i + 1]["key"]) if i + 1 < len(entries) else hi
                if (high is None or key < high) and (stop is None or stop > low):
                    child = acc + bytes(entry.get("subtree_common_prefix", b""))
                    self._walk(entry["location"], height - 1, child, stop, low, high, name)
            elif "indirect_value" in entry and low <= key and (high is None or key < high):
                self._present(entry["indirect_value"], name, key.decode(errors="replace"))

    def _node(self, location: str, name: str | None) -> Any:
        import tensorstore as ts

        if location not in self._nodes:
            self._present(location, name, None)
            try:
                self._nodes[location] = ts.ocdbt.dump(self._base, location).result()
            except ValueError as e:
                raise SafetensorsCheckpointError(
                    f"{self.path}: a B-tree node of its OCDBT database ({location}) cannot be "
                    f"read: {e}"
                ) from None
        return self._nodes[location]

    def _present(self, location: str, name: str | None, key: str | None) -> None:
        # ``location``: "<kind>:<base path>:<relative path>:<offset>:<length>", the two paths
        # percent-encoded (TensorStore's dump format).
        parts = location.split(":")
        try:
            base, relative = (urllib.parse.unquote(p) for p in parts[1:3])
            offset, length = int(parts[3]), int(parts[4])
        except (IndexError, ValueError):
            raise SafetensorsCheckpointError(
                f"{self.path}: its OCDBT database holds an invalid data reference {location!r}"
            ) from None
        file = base + relative
        what = f"the value of key {key!r}" if key is not None else "a B-tree node"
        whose = f" of tensor {name!r}" if name else ""
        if file not in self._sizes:
            path = self.path / file
            self._sizes[file] = path.stat().length if path.is_file() else None
        size = self._sizes[file]
        if size is None:
            raise SafetensorsCheckpointError(
                f"{self.path}: OCDBT data file {file} is missing: it holds {what}{whose}"
            )
        if offset + length > size:
            raise SafetensorsCheckpointError(
                f"{self.path}: OCDBT data file {file} holds {size} bytes, but its manifest "
                f"places {what}{whose} at bytes [{offset}, {offset + length})"
            )


def _successor(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with ``prefix`` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


def kvstore_url(path: epath.Path) -> str:
    """The TensorStore KvStore URL of the directory ``path`` (local or an object store)."""
    text = str(path)
    return (text if "://" in text else "file://" + os.path.abspath(text)).rstrip("/") + "/"


def missing_file(path: epath.Path) -> str | None:
    """Why Orbax could not read the metadata of item ``path`` whose ``_METADATA`` is sound,
    when a file it needs is missing: the OCDBT manifest or a data file of the database, or an
    array's zarr metadata (its name from ``_METADATA``); None when none is (or ``_METADATA``
    itself is missing or damaged: that is the problem to report)."""
    try:
        doc = json.loads((path / _steps.ORBAX_METADATA_FILE).read_text())
        entries = list(doc["tree_metadata"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    storage = _steps.array_storage(path)
    if storage.use_ocdbt:
        try:
            OcdbtFiles(path).check("")
        except SafetensorsCheckpointError as e:
            return str(e)
        return None
    meta = "zarr.json" if storage.use_zarr3 else ".zarray"
    for entry in entries:
        try:
            value_type = entry["value_metadata"]["value_type"]
            array = ".".join(str(k["key"]) for k in entry["key_metadata"])
        except (KeyError, TypeError):
            continue
        plain = array and "/" not in array and "\\" not in array and array.strip(".")
        if value_type in _ARRAY_VALUE_TYPES and plain and not (path / array / meta).exists():
            return f"{path}: the zarr metadata of array {array!r} ({array}/{meta}) is missing"
    return None
