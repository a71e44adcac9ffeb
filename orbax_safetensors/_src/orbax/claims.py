"""What an Orbax-native item's files can hold, checked before anything reads it: the one
admission check shared by this library's own reads of Orbax-native arrays (the catalog) and
by Orbax's restore of an item that a ``CheckpointManager`` passes to this library's handler.

An item claims each array's shape in metadata, and a chunk is compressed (a chunk of zeros
takes a few bytes), so neither the metadata nor the bytes on disk bound what a read allocates.
Before a read allocates an array: Orbax's metadata and the zarr metadata claim the same shape
(:func:`check_claim`); in an OCDBT item, the data files that hold it exist and are long enough
(:class:`OcdbtFiles`); unless the item reads missing chunks as the fill value, every stored
chunk the read needs exists (:func:`check_stored`); and the read fits the machine's physical
memory (:func:`check_allocation`). :func:`admit_restore` applies them to a whole item.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from etils import epath

from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps

# Orbax's own TensorStore context for OCDBT items (ts_utils.get_ts_context): its file I/O
# concurrency, and a cache of the B-tree nodes that find the chunks, so that the reads of one
# tensor's boxes find them once.
TENSORSTORE_CONTEXT = {
    "file_io_concurrency": {"limit": 128},
    "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
}


def max_read_bytes() -> int | None:
    """The most bytes one read may allocate: the machine's physical memory (None: unknown)."""
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
    read: int,
    chunk: Sequence[int],
) -> None:
    """Raises unless a read of ``read`` bytes of tensor ``name`` fits :func:`max_read_bytes`
    with one chunk of ``chunk`` decoded whole beside it (TensorStore decodes whole chunks)."""
    limit = max_read_bytes()
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
    """Raises unless Orbax's metadata and the zarr metadata ``zarr_file`` claim one shape."""
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
    """Raises unless every stored chunk of ``box`` of the opened ``store`` is present (a
    listing: no chunk is read); the other arguments word the message."""
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


def array_keys(name: str) -> str:
    """The prefix of the keys of Orbax's array ``name`` under its item (in the OCDBT database,
    or as files): ``"<name>/"``, and ``""`` for the name ``""`` (the item's own)."""
    return f"{name}/" if name else ""


def pytree_leaves(doc: dict[str, Any]) -> dict[str, str]:
    """Each stored leaf an Orbax ``_METADATA`` records (its keys joined with ``.``: the name of
    its directory or OCDBT key) -> its value type."""
    tree = doc.get("tree_metadata")
    leaves = {}
    for entry in tree.values() if isinstance(tree, dict) else ():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not isinstance(value, dict):
            continue
        if value.get("skip_deserialize") is True or not isinstance(value.get("value_type"), str):
            continue
        name = ".".join(str(k.get("key")) for k in keys if isinstance(k, dict))
        leaves[name] = value["value_type"]
    return leaves


# ------------------------------------------------------------------ an Orbax item's OCDBT database


class Ref(NamedTuple):
    """A place in a data file of an OCDBT database: a B-tree node, or the value of ``key``."""

    file: str
    offset: int
    length: int
    key: str | None


class OcdbtFiles:
    """The data files of the OCDBT database of the Orbax item ``path`` (``d/<id>``,
    ``ocdbt.process_<i>/d/<id>``), found through its manifest and B-tree with TensorStore's
    ``ocdbt.dump`` (nodes read, values only located). ``kvstore``: the spec of the item's
    directory (default: its URL). Nodes and file sizes are kept, so the tensors of one item
    share the walk's reads.
    """

    def __init__(self, path: epath.Path, kvstore: Any = None) -> None:
        self.path = path
        self._kvstore = kvstore if kvstore is not None else kvstore_url(path)
        self._base: Any = None
        self._root: tuple[str, int] | None = None
        self._nodes: dict[str, Any] = {}
        self._sizes: dict[str, int | None] = {}
        self._checked: set[str] = set()

    def _open(self, name: str | None) -> None:
        import tensorstore as ts

        manifest = self.path / _steps.OCDBT_MANIFEST_FILE
        if not manifest.exists():
            raise SafetensorsCheckpointError(
                f"{self.path}: OCDBT manifest file {_steps.OCDBT_MANIFEST_FILE} is missing"
                + (f" (reading tensor {name!r})" if name else "")
            )
        try:
            self._base = ts.KvStore.open(self._kvstore).result()
            doc = ts.ocdbt.dump(self._base).result()
        except (ValueError, TypeError) as e:
            raise SafetensorsCheckpointError(
                f"{manifest}: not a readable OCDBT manifest ({e})"
            ) from None
        versions = [v for v in doc.get("versions") or () if isinstance(v, dict)]
        latest = max(versions, key=lambda v: v.get("generation_number", 0), default={})
        location = (latest.get("root") or {}).get("location")
        if isinstance(location, str):
            self._root = (location, int(latest.get("root_height", 0)))

    def walk(
        self,
        visit: Callable[[Ref], bool],
        low: bytes = b"",
        high: bytes | None = None,
        *,
        strict: bool = True,
        name: str | None = None,
    ) -> None:
        """Calls ``visit`` on each node on the way to the keys in ``[low, high)`` and on each
        of their values; a node is read only where ``visit`` returns True for it. A malformed
        reference or node raises with ``strict``, else ends its subtree.

        Raises:
          SafetensorsCheckpointError: no readable manifest; with ``strict``, a bad node.
        """
        import tensorstore as ts

        if self._base is None:
            self._open(name)
        seen: set[str] = set()

        def walk_node(location: str, height: int, acc: bytes, hi: bytes | None) -> None:
            # The node holds keys acc + key below ``hi``. Each level down is one lower (as
            # TensorStore requires) and each node is read once a walk, so a forged tree can
            # neither loop nor multiply the walk.
            ref = self._ref(location, None, strict)
            if location in seen or ref is None or not visit(ref):
                return
            seen.add(location)
            if location not in self._nodes:
                try:
                    self._nodes[location] = ts.ocdbt.dump(self._base, location).result()
                except (ValueError, TypeError) as e:
                    if not strict:
                        return
                    raise SafetensorsCheckpointError(
                        f"{self.path}: a B-tree node of its OCDBT database ({location}) "
                        f"cannot be read: {e}"
                    ) from None
            node = self._nodes[location]
            if node.get("height") != height or height < 0:
                if not strict:
                    return
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
                        walk_node(entry["location"], height - 1, child, stop)
                elif "indirect_value" in entry and low <= key and (high is None or key < high):
                    value = self._ref(entry["indirect_value"], key.decode(errors="replace"), strict)
                    if value is not None:
                        visit(value)

        if self._root is not None:
            walk_node(*self._root, b"", None)

    def _ref(self, location: str, key: str | None, strict: bool) -> Ref | None:
        # A dumped location, "<kind>:<base>:<relative>:<offset>:<length>" (the paths
        # percent-encoded); one that is malformed or leaves the database raises, or is None.
        parts = location.split(":")
        try:
            base, relative = (urllib.parse.unquote(p) for p in parts[1:3])
            file = f"{base.rstrip('/')}/{relative}" if base else relative
            ref = Ref(file, int(parts[3]), int(parts[4]), key)
        except (IndexError, ValueError):
            ref = None
        names = ref.file.split("/") if ref else ()
        if ref and not (ref.file.startswith("/") or "\\" in ref.file or {"", ".", ".."} & {*names}):
            return ref
        if strict:
            raise SafetensorsCheckpointError(
                f"{self.path}: its OCDBT database holds an invalid data reference {location!r}"
            )
        return None

    def check(self, prefix: str, name: str | None = None) -> None:
        """Raises naming the first data file that a node or value of the keys under
        ``prefix`` (all keys: "") lies in and that is missing or shorter than the manifest
        says (``name``: the tensor read, for the message)."""
        if prefix in self._checked:
            return
        low = prefix.encode()
        self.walk(lambda ref: self._present(ref, name), low, _successor(low), name=name)
        self._checked.add(prefix)

    def _present(self, ref: Ref, name: str | None) -> bool:
        what = f"the value of key {ref.key!r}" if ref.key is not None else "a B-tree node"
        whose = f" of tensor {name!r}" if name else ""
        if ref.file not in self._sizes:
            self._sizes[ref.file] = _file_size(self.path / ref.file)
        size = self._sizes[ref.file]
        if size is None:
            raise SafetensorsCheckpointError(
                f"{self.path}: OCDBT data file {ref.file} is missing: it holds {what}{whose}"
            )
        if ref.offset + ref.length > size:
            raise SafetensorsCheckpointError(
                f"{self.path}: OCDBT data file {ref.file} holds {size} bytes, but its manifest "
                f"places {what}{whose} at bytes [{ref.offset}, {ref.offset + ref.length})"
            )
        return True


def _file_size(path: epath.Path) -> int | None:
    """The size of the file ``path``; None when there is none (the stat is the test: some
    etils releases take any path that is not a directory for a file)."""
    try:
        return None if path.is_dir() else int(path.stat().length)
    except FileNotFoundError:
        return None


def _successor(prefix: bytes) -> bytes | None:
    """The smallest key above every key that starts with ``prefix`` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else None


def kvstore_url(path: epath.Path) -> str:
    """The TensorStore KvStore URL of the directory ``path`` (local or an object store)."""
    text = str(path)
    return (text if "://" in text else "file://" + os.path.abspath(text)).rstrip("/") + "/"


# ------------------------------------------------------------------ Orbax's restore of an item

_ARRAY_VALUES = frozenset(("jax.Array", "np.ndarray"))  # the value types TensorStore stores


def chunk_location(path: epath.Path, name: str, storage: _steps.ArrayStorage) -> str:
    """Where the chunks of array ``name`` of item ``path`` live, for messages."""
    if storage.use_ocdbt:
        return f"the item's OCDBT database (keys {array_keys(name)}...)"
    return str(path / name)


def admit_restore(path: epath.PathLike) -> None:
    """Raises before Orbax's restore of the Orbax-native item ``path`` allocates an array its
    files do not back: each array's data files and stored chunks must be there (unless the item
    reads missing chunks as the fill value), and each array's share of the job's processes,
    with one chunk decoded, must fit this machine's physical memory (an array larger than one
    host restores across several). Reads only metadata, the OCDBT B-tree and chunk listings.

    Raises:
      SafetensorsCheckpointError: naming the item, the array, its claimed dtype, shape and
        bytes, and the missing chunks or file or the memory it exceeds.
    """
    import jax
    import tensorstore as ts

    path = _steps.absolute(path)
    doc = _steps.read_json(path / _steps.ORBAX_METADATA_FILE)
    leaves = pytree_leaves(doc) if isinstance(doc, dict) else {}
    arrays = sorted(n for n, kind in leaves.items() if kind in _ARRAY_VALUES)
    if not arrays:
        return  # (an unreadable _METADATA is Orbax's restore's to report)
    storage = _steps.array_storage(path)
    ocdbt = OcdbtFiles(path) if storage.use_ocdbt else None
    context = ts.Context(TENSORSTORE_CONTEXT)
    for name in arrays:
        if ocdbt is not None:  # (a missing data file named before TensorStore opens it)
            ocdbt.check(array_keys(name), name)
        spec = _orbaxcompat.array_read_spec(
            path,
            name,
            use_zarr3=storage.use_zarr3,
            use_ocdbt=storage.use_ocdbt,
            fill_missing=storage.fill_missing,
            context=context,
        )
        if spec is None:  # (an Orbax without the helper: nothing to open the array with)
            return
        try:
            store = ts.open(spec, open=True, context=context).result()
        except ValueError as e:
            raise SafetensorsCheckpointError(
                f"{path}: array {name!r}: TensorStore cannot open it: {e}"
            ) from None
        shape = tuple(int(n) for n in store.shape)
        dtype = _dtypes.from_numpy(store.dtype.numpy_dtype, key=name)
        decoded = store.chunk_layout.read_chunk.shape or shape  # (the chunks TensorStore decodes)
        chunk = tuple(int(c or n) for c, n in zip(decoded, shape))
        nbytes = _dtypes.nbytes(dtype, shape)
        claim = describe(dtype, shape, nbytes)
        if not storage.fill_missing:
            whole = tuple(slice(0, n) for n in shape)
            location = chunk_location(path, name, storage)
            check_stored(str(path), name, store, whole, claim, chunk, location)
        share = -(-nbytes // jax.process_count())  # (the least the largest share holds)
        check_allocation(str(path), name, dtype, shape, read=share, chunk=chunk)
