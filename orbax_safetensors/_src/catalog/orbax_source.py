"""An Orbax-native PyTree item as a table of tensors (:class:`OrbaxSource`), read through
TensorStore as Orbax's own restore reads it, a few stored chunks at a time, and only once the
item's files back what a read would allocate (the admission checks Orbax's restore through a
manager also runs: the claimed shape, the OCDBT data files, the stored chunks, the machine's
physical memory).
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog.listing import SourceKind, TensorInfo
from orbax_safetensors._src.compat import orbaxcompat as _orbaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import claims as _claims
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.storage import buffers as _buffers

# What an Orbax item's reads ask TensorStore for at a time: pieces of whole stored chunks of at
# most READ_PIECE_BYTES (a larger chunk is a piece alone), READ_PIECES_IN_FLIGHT at once (one
# decoding while the one before is copied); a box read whole would hold every chunk of it
# decoded beside the box.
READ_PIECE_BYTES = 8 << 20
READ_PIECES_IN_FLIGHT = 2


class OrbaxSource:
    """An Orbax-native PyTree item (``StandardSave``/``PyTreeSave``, or a checkpointable of
    Orbax v1), read through TensorStore as Orbax's restore reads it.

    Tensors carry the dotted names of Orbax's tree; Python scalars and strings are not
    tensors. ``chunks``: each tensor's stored chunk shape, the unit of every read. Arrays
    TensorStore cannot give as stored (typed PRNG keys, an Orbax without a read spec) go
    through Orbax's restore. No read runs a collective. Listing reads no chunk; a read that
    the item's files do not back (see the module docstring) raises a
    ``SafetensorsCheckpointError`` naming the tensor and its claim, or the missing file.
    """

    def __init__(self, path: epath.Path) -> None:
        import jax

        self.path = path = _steps.absolute(path)
        self.kind = SourceKind.ORBAX
        _steps.check_orbax_item(path)  # (before Orbax or TensorStore opens a file of it)
        self.tree = _orbax_metadata_tree(path)
        flat, _ = jax.tree_util.tree_flatten_with_path(self.tree)
        names = _tree.assign_names([tuple(p) for p, _ in flat])
        self.leaves: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self.tensors = {}
        self.chunks: dict[str, tuple[int, ...]] = {}
        for name, (keypath, leaf) in zip(names, flat):
            self.leaves[name] = (tuple(keypath), leaf)
            if is_orbax_array(leaf):
                self.tensors[name] = info = TensorInfo.of(name, leaf, "(orbax)")
                self.chunks[name] = chunk_shape(leaf, info.shape)
        self.metadata: dict[str, Any] = {}
        self._stores: dict[str, Any] = {}  # name -> its opened TensorStore, or None
        self._context: Any = None  # (with the item's storage flags, once a tensor is opened)
        self._storage: Any = None
        self._ocdbt: _claims.OcdbtFiles | None = None
        self._complete: set[str] = set()  # tensors every stored chunk of which is present
        self._lock = threading.Lock()

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        import jax

        out = {}
        for name in names:
            if self.store(name) is not None:
                out[name] = self.read_box(name, _runs.whole_index(self.tensors[name].shape))
        values = self.restore([n for n in names if n not in out])
        out.update(
            (n, np.asarray(jax.random.key_data(v) if _tree.is_prng_key(v) else v))
            for n, v in values.items()
        )
        return {n: out[n] for n in names}

    def store(self, name: str) -> Any:
        """The TensorStore of tensor ``name`` as Orbax's restore opens it (cached); None where
        reads of it go through Orbax's restore."""
        with self._lock:
            if name not in self._stores:
                self._stores[name] = self._open(name)
            return self._stores[name]

    def _open(self, name: str) -> Any:
        import tensorstore as ts

        info = self.tensors.get(name)
        leaf_name = getattr(self.leaves[name][1], "name", None) if name in self.leaves else None
        if info is None or not isinstance(leaf_name, str):
            return None
        if self._context is None:
            self._context = ts.Context(_claims.TENSORSTORE_CONTEXT)
            self._storage = _steps.array_storage(self.path)
        storage = self._storage
        _steps.orbax_array_path(self.path, leaf_name, where=self.path / _steps.ORBAX_METADATA_FILE)
        keys = _claims.array_keys(leaf_name)
        spec = _orbaxcompat.array_read_spec(
            self.path,
            leaf_name,
            use_zarr3=storage.use_zarr3,
            use_ocdbt=storage.use_ocdbt,
            fill_missing=storage.fill_missing,
            context=self._context,
        )
        if spec is None:
            return None
        if storage.use_ocdbt:  # (a missing data file named, before TensorStore reads it)
            if self._ocdbt is None:
                self._ocdbt = _claims.OcdbtFiles(self.path)
            self._ocdbt.check(keys, name)
        try:
            store = ts.open(spec, open=True, context=self._context).result()
        except ValueError as e:
            raise SafetensorsCheckpointError(
                f"{self.path}: tensor {name!r}: TensorStore cannot open its array: {e}"
            ) from None
        zarr = f"{keys}{'zarr.json' if storage.use_zarr3 else '.zarray'}"
        if storage.use_ocdbt:
            zarr += " in the item's OCDBT database"
        _claims.check_claim(str(self.path), name, info.shape, tuple(store.shape), zarr)
        if store.dtype.numpy_dtype != _dtypes.to_numpy(info.dtype):
            return None  # (not the array Orbax's metadata describes as stored: Orbax's restore)
        return store

    def _admit(self, name: str, boxes: Sequence[Sequence[slice]]) -> None:
        # Raises before a read of ``boxes`` (explicit bounds) of tensor ``name`` allocates
        # anything, unless the item's files back them (the class docstring).
        info = self.tensors[name]
        where = str(self.path)
        claim = _claims.describe(info.dtype, info.shape, info.nbytes)
        store = self.store(name)
        chunk = self.chunks[name]
        decoded = store.chunk_layout.read_chunk.shape if store is not None else None
        if decoded is not None:  # (the chunks TensorStore decodes: the zarr metadata's)
            chunk = tuple(int(c) for c in decoded)
        if store is not None and not self._storage.fill_missing:
            location = _claims.chunk_location(self.path, self.leaves[name][1].name, self._storage)
            if name not in self._complete:  # (one listing of a whole tensor, not one a box)
                whole = _runs.whole_index(info.shape)
                try:
                    _claims.check_stored(where, name, store, whole, claim, chunk, location)
                    self._complete.add(name)
                except SafetensorsCheckpointError:  # a box of the chunks present still reads
                    for box in boxes:
                        _claims.check_stored(where, name, store, box, claim, chunk, location)
        read = sum(_dtypes.nbytes(info.dtype, [s.stop - s.start for s in box]) for box in boxes)
        _claims.check_allocation(where, name, info.dtype, info.shape, read=read, chunk=chunk)

    def read_box(self, name: str, box: Sequence[slice]) -> np.ndarray:
        """The values of ``box`` (a slice per axis, steps of 1) of tensor ``name`` in its stored
        dtype, in a new 64-byte aligned array, read a few whole stored chunks at a time.
        """
        import tensorstore as ts

        info = self.tensors[name]
        box = _runs.normalize_index(tuple(box), info.shape)
        self._admit(name, [box])
        shape = tuple(s.stop - s.start for s in box)
        stored = _dtypes.to_numpy(info.dtype)
        out = _buffers.aligned_empty(math.prod(shape) * stored.itemsize).view(stored)
        out = out.reshape(shape)
        store = self.store(name)
        if store is None:  # Orbax's restore: the whole tensor, then the box
            out[...] = self.read([name])[name][box]
            return out
        if not out.size:
            return out
        dest = ts.array(out, copy=False, write=True)
        pending: collections.deque[Any] = collections.deque()
        for piece in chunk_pieces(box, self.chunks[name], stored.itemsize, READ_PIECE_BYTES):
            local = tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(piece, box))
            pending.append(dest[local].write(store[piece]))
            if len(pending) >= READ_PIECES_IN_FLIGHT:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        return out

    def restore(self, names: Sequence[str], *, as_jax: bool = False) -> dict[str, Any]:
        """The leaves ``names`` as Orbax restores them: arrays as host numpy arrays, or with
        ``as_jax`` those saved as ``jax.Array`` as single-device ones (PRNG keys stay keys)."""
        import jax
        import orbax.checkpoint as ocp

        device = jax.devices()[0]

        def restore_args(name: str, leaf: Any) -> Any:
            if is_orbax_array(leaf) and (not as_jax or leaf.sharding is None):
                return ocp.RestoreArgs(restore_type=np.ndarray)
            if is_orbax_array(leaf):
                return ocp.ArrayRestoreArgs(
                    sharding=jax.sharding.SingleDeviceSharding(device),
                    global_shape=tuple(leaf.shape),
                )
            return ocp.RestoreArgs()

        return self._restore(names, restore_args)

    def read_sharded(self, names: Sequence[str], shardings: Mapping[str, Any]) -> dict[str, Any]:
        """The arrays ``names`` as global ``jax.Array`` s laid out by ``shardings`` (by name),
        in their stored dtype: each process reads each distinct box of its devices once.
        """
        import jax
        import orbax.checkpoint as ocp

        out: dict[str, Any] = {}
        for name in names:
            if self.store(name) is None:
                continue
            shape, sharding = self.tensors[name].shape, shardings[name]
            held: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
            hosts, devices = [], []
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                box = _runs.normalize_index(index, shape)
                key = tuple((s.start, s.stop) for s in box)
                if key not in held:
                    held[key] = self.read_box(name, box)
                hosts.append(held[key])
                devices.append(device)
            arrays = _place.put(hosts, devices)
            out[name] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)

        def restore_args(name: str, leaf: Any) -> Any:
            return ocp.ArrayRestoreArgs(
                sharding=shardings[name], global_shape=tuple(int(d) for d in leaf.shape)
            )

        rest = [n for n in names if n not in out]
        boxes = {}  # what Orbax's restore allocates of each: this process's distinct boxes
        for name in rest:
            shape = self.tensors[name].shape
            mine = shardings[name].addressable_devices_indices_map(shape).values()
            distinct = {
                _runs.index_key(b): b for b in (_runs.normalize_index(i, shape) for i in mine)
            }
            boxes[name] = list(distinct.values())
        out.update(self._restore(rest, restore_args, boxes))
        return {n: out[n] for n in names}

    def _restore(
        self,
        names: Sequence[str],
        restore_args: Any,
        boxes: Mapping[str, Sequence[Sequence[slice]]] | None = None,
    ) -> dict[str, Any]:
        # Orbax's handler, not PyTreeCheckpointer: the Checkpointer's restore ends in a
        # barrier of every process, which a read by one process (or on a reading thread)
        # must not reach. Each array is admitted first (whole, or ``boxes``: what this
        # process holds of it): Orbax's restore allocates the claimed shape before it reads.
        import jax
        import orbax.checkpoint as ocp

        if not names:
            return {}
        for name in names:
            if name in self.tensors:
                whole = [_runs.whole_index(self.tensors[name].shape)]
                self._admit(name, boxes[name] if boxes is not None else whole)
        item = self.select(set(names), lambda name, leaf: 0)
        args = self.select(set(names), restore_args)
        handler = ocp.PyTreeCheckpointHandler()
        try:
            restored = handler.restore(
                self.path, args=_orbaxcompat.pytree_partial_restore(item, args)
            )
        finally:
            handler.close()
        out = {}
        flat, _ = jax.tree_util.tree_flatten_with_path(restored)
        by_path = {tuple(p): v for p, v in flat}
        for name in names:
            keypath, _ = self.leaves[name]
            out[name] = by_path[keypath]
        return out

    def name_of_path(self) -> dict[tuple[Any, ...], str]:
        """Each leaf's key path in ``self.tree`` mapped to its tensor name."""
        return {keypath: name for name, (keypath, _) in self.leaves.items()}

    def select(self, wanted: set[str], fn: Callable[[str, Any], Any]) -> Any:
        """``self.tree`` with only the leaves named in ``wanted``, each as ``fn(name, leaf)``;
        lists keep their length with None in unwanted places."""
        from jax.tree_util import DictKey, SequenceKey

        names = self.name_of_path()

        def walk(node: Any, path: tuple[Any, ...]) -> tuple[bool, Any]:
            if isinstance(node, dict):
                out = {}
                for k, v in node.items():
                    keep, sub = walk(v, (*path, DictKey(k)))
                    if keep:
                        out[k] = sub
                return bool(out), out
            if isinstance(node, (list, tuple)):
                items = [walk(v, (*path, SequenceKey(i))) for i, v in enumerate(node)]
                seq = [sub if keep else None for keep, sub in items]
                return any(keep for keep, _ in items), type(node)(seq)
            if node is None:
                return False, None
            name = names.get(path)
            if name not in wanted:
                return False, None
            return True, fn(name, node)

        return walk(self.tree, ())[1]


def chunk_pieces(
    box: Sequence[slice], chunk: Sequence[int], itemsize: int, max_bytes: int
) -> list[tuple[slice, ...]]:
    """``box`` (explicit bounds) cut at stored chunk boundaries into pieces of at most
    ``max_bytes`` where a chunk is not larger: along the first axis it crosses chunks on,
    consecutive chunks grouped; a group still larger is cut the same way along the next axes.
    """

    def nbytes(b: Sequence[slice]) -> int:
        return itemsize * math.prod(s.stop - s.start for s in b)

    def cut(b: tuple[slice, ...], axis: int) -> list[tuple[slice, ...]]:
        if nbytes(b) <= max_bytes or axis >= len(b):
            return [b]
        s, c = b[axis], int(chunk[axis])
        edges = [s.start, *range((s.start // c + 1) * c, s.stop, c), s.stop]
        if len(edges) <= 2:
            return cut(b, axis + 1)
        unit = nbytes(b) // max(1, s.stop - s.start)  # the bytes of one index along axis
        out: list[tuple[slice, ...]] = []
        start = edges[0]
        for lo, hi in itertools.pairwise(edges):
            if lo > start and (hi - start) * unit > max_bytes:
                out.append((*b[:axis], slice(start, lo), *b[axis + 1 :]))
                start = lo
        out.append((*b[:axis], slice(start, s.stop), *b[axis + 1 :]))
        return [piece for group in out for piece in cut(group, axis + 1)]

    return cut(tuple(box), 0)


def _orbax_metadata_tree(path: epath.Path) -> Any:
    # Orbax's metadata tree of the item (ArrayMetadata, ScalarMetadata...); where Orbax cannot
    # read it, the error names the file that is missing, else the damage.
    import orbax.checkpoint as ocp

    problem = (
        f"{path}: Orbax cannot read this item's metadata ({_steps.ORBAX_METADATA_FILE} is missing "
        "or damaged)"
    )
    try:
        meta = ocp.PyTreeCheckpointer().metadata(path)
    except Exception as error:  # Orbax raises many types on a damaged file
        # (ValueError/TypeError/KeyError on bad JSON, AttributeError on JSON of another shape)
        raise SafetensorsCheckpointError(
            _completeness.missing_file(path) or f"{problem}: {error}"
        ) from error
    meta = getattr(meta, "item_metadata", meta)
    tree = getattr(meta, "tree", meta)
    if tree is None:  # (Orbax returns no tree when it cannot read the arrays' own metadata)
        raise SafetensorsCheckpointError(_completeness.missing_file(path) or problem)
    return tree


def chunk_shape(leaf: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape of an Orbax metadata leaf's stored array (a multi-process save stores
    each device's shard as one), or ``shape`` where the metadata does not say."""
    chunk = getattr(getattr(leaf, "storage", None), "chunk_shape", None)
    if chunk is None or len(chunk) != len(shape) or any(int(c) < 1 for c in chunk):
        return shape
    return tuple(int(c) for c in chunk)


def is_orbax_array(leaf: Any) -> bool:
    """Whether an Orbax metadata leaf describes an array (jax or numpy), not a scalar/string."""
    from orbax.checkpoint import metadata as ocp_metadata

    return isinstance(leaf, ocp_metadata.ArrayMetadata) and not isinstance(
        leaf, ocp_metadata.ScalarMetadata
    )
