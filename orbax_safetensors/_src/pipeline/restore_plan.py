"""The restore plan: :func:`restore_tree` matches every target leaf to a stored leaf by its
dotted name and plans it (a ``place.Plan``), collects every problem into one
``TargetMismatchError``, runs the distinct reads and rebuilds the tree. Structure as Orbax's
handlers compare it: ``None`` and empty nodes in the target stand for a saved leaf, ``None`` or
empty node (returned as given); against a saved subtree, or where the checkpoint has nothing,
they are a mismatch unless keys are not exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    Mismatch,
    MismatchKind,
    SchemaError,
    TargetMismatchError,
)
from orbax_safetensors._src.pipeline import place as _place
from orbax_safetensors._src.pipeline.place import Finish, Known, Plan, Read, Resize
from orbax_safetensors._src.pipeline.read import (
    ReadKind,
    ReadRequest,
    ReadStats,
    StoredTensor,
    read_metadata,
    read_tensors,
)
from orbax_safetensors._src.pipeline.restore_options import (
    STANDALONE_WORDS,
    Build,
    Keys,
    LeafRequest,
    RestoreOptions,
    Skip,
    mismatch_message,
)

# A tensor name -> its saved sharding over this job's devices (None: none saved, the default
# device); raises TargetMismatchError when this job's devices cannot reproduce it.
SavedSharding = Callable[[str], Any]

# --------------------------------------------------------------------------- one leaf


@dataclasses.dataclass(frozen=True, slots=True)
class _Key:
    """A typed PRNG key target: its shape, and where it goes."""

    shape: tuple[int, ...]
    sharding: Any


def _leaf_request(leaf: Any) -> LeafRequest | _Key | None:
    # What a target leaf asks for (None: a leaf that cannot take a tensor). A jax.Array or
    # ShapeDtypeStruct asks for a jax.Array of its shape and dtype on its sharding; without
    # one, as saved (numpy if saved as numpy). Numpy and Python values ask for their own kind.
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):  # the common case, first
        sharding = getattr(leaf, "sharding", None)
        if _tree.is_prng_key(leaf):
            return _Key(tuple(leaf.shape), sharding)
        build = Build.JAX if sharding is not None else Build.SAVED_ARRAY
        return LeafRequest(build, tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    if isinstance(leaf, LeafRequest):
        return leaf
    if isinstance(leaf, (bool, int, float)):
        return LeafRequest(Build.PYTHON, (), pytype=type(leaf))
    if isinstance(leaf, np.ndarray):
        return LeafRequest(Build.NUMPY, tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, np.generic):
        return LeafRequest(Build.SCALAR, (), leaf.dtype)
    if isinstance(leaf, str):
        return LeafRequest(Build.STR, ())
    return None


def _resolve(build: Build, saved_kind: _schema.ArrayKind | None) -> Build:
    # ``build`` made concrete by the saved leaf's kind (None: a Python value in the schema).
    if build is Build.SAVED_ARRAY:
        return Build.JAX if saved_kind is _schema.ArrayKind.JAX else Build.NUMPY
    if build is Build.SAVED:
        return _SAVED_BUILDS[saved_kind]
    return build


_SAVED_BUILDS: dict[_schema.ArrayKind | None, Build] = {
    _schema.ArrayKind.JAX: Build.JAX,
    _schema.ArrayKind.NUMPY: Build.NUMPY,
    _schema.ArrayKind.SCALAR: Build.SCALAR,
    None: Build.SAVED,  # an inline value as it is
}


def _host_local(what: str) -> str:
    return (
        f"saved as {what} (host-local: no sharding saved), and the target asks for a "
        "jax.Array without a sharding; give it a sharding, or ask for a numpy array "
        "(as Orbax requires)"
    )


def _kind(name: str, detail: str) -> Mismatch:
    return Mismatch(name, MismatchKind.KIND, detail)


def _inline_as(name: str, saved: _tree.SchemaLeaf, want: LeafRequest | _Key | None) -> Any:
    # A Python value kept in the schema, as ``want`` asks for it (Orbax's ScalarHandler);
    # raises TargetMismatchError carrying the one mismatch.
    value = _tree.inline_value(saved)
    if want is None or saved.kind == "str":
        return value
    if isinstance(want, _Key):
        raise TargetMismatchError(
            "", [_kind(name, "a Python value in the checkpoint, a PRNG key in the target")]
        )
    build = _resolve(want.build, None)
    if build in (Build.SAVED, Build.STR):
        return value
    if build is Build.PYTHON:
        assert want.pytype is not None
        try:
            return want.pytype(value)
        except (ValueError, OverflowError):  # int(nan), int(inf)
            detail = (
                f"checkpoint has the Python {saved.kind} {value!r}, target wants a "
                f"{want.pytype.__name__}"
            )
            raise TargetMismatchError("", [_kind(name, detail)]) from None
    if want.shape not in (None, ()):
        detail = (
            f"checkpoint has a Python {saved.kind} (shape ()), target wants {tuple(want.shape)}"
        )
        raise TargetMismatchError(
            "", [Mismatch(name, MismatchKind.SHAPE, detail, saved=(), wanted=want.shape)]
        )
    try:
        host = _casting.scalar_as(value, want.dtype)
    except OverflowError:
        wanted = "" if want.dtype is None else f" of dtype {want.dtype}"
        detail = (
            f"checkpoint has the Python int {value}, beyond 64 bits: a target{wanted} "
            "cannot hold it (restore it as a Python int)"
        )
        raise TargetMismatchError("", [_kind(name, detail)]) from None
    if build is Build.SCALAR:
        return host[()]
    if build is Build.NUMPY:
        return host
    if want.sharding is None and want.needs_sharding:
        raise TargetMismatchError("", [_kind(name, _host_local(f"a Python {saved.kind}"))])
    return jax.device_put(host, want.sharding or jax.local_devices()[0])


def _shape_problem(
    name: str, stored: StoredTensor, want: LeafRequest, build: Build, pad: bool
) -> Mismatch | None:
    # Why a stored array's shape cannot fill the target's (None: it can, padded or truncated
    # to it, as Orbax's strict=False does).
    assert want.shape is not None
    stored_shape = tuple(stored.shape)
    text = f"checkpoint has shape {stored_shape} ({stored.dtype}), target wants {want.shape}"

    def problem(detail: str, resizable: bool = False) -> Mismatch:
        return Mismatch(
            name,
            MismatchKind.SHAPE,
            detail,
            saved=stored_shape,
            wanted=want.shape,
            resizable=resizable,
        )

    if not pad:
        resizable = build in (Build.JAX, Build.NUMPY) and len(want.shape) == len(stored_shape)
        return problem(text, resizable)
    if build not in (Build.JAX, Build.NUMPY):
        return problem(f"{text}; only arrays can be padded or truncated")
    if len(want.shape) != len(stored_shape):
        return problem(
            f"{text}; padding or truncating keeps the rank ({len(stored_shape)} dimensions)"
        )
    return None


# --------------------------------------------------------------------------- the tree

_KEY = _schema.LeafKind.KEY


def is_empty(x: object) -> bool:
    """Whether a target leaf asks for nothing: ``None`` or an empty node (``{}``, ``[]``,
    ``()``, an empty NamedTuple such as optax's ``MaskedNode``)."""
    if x is None:
        return True
    kind = type(x)
    if kind is dict or kind is list:
        return not x
    return isinstance(x, tuple) and not x


def _target_leaf(x: object) -> bool:
    return is_empty(x) or isinstance(x, (LeafRequest, Skip))


class _Loader:
    """What one restore reads from (saved leaves, stored tensors, options, saved shardings)
    and its read requests, each distinct one once; a plan holds its slot."""

    def __init__(
        self,
        leaves: Mapping[str, _tree.SchemaLeaf],
        stored: Mapping[str, StoredTensor],
        options: RestoreOptions,
        stats: ReadStats | None,
        saved_sharding: SavedSharding | None,
    ) -> None:
        self.leaves, self.stored, self.options, self.stats = leaves, stored, options, stats
        self.saved_sharding = saved_sharding
        self.requests: list[ReadRequest] = []
        self.slots: dict[tuple, int] = {}

    def stored_for(self, leaf: _tree.SchemaLeaf) -> StoredTensor:
        # (restore_tree checked that every stored leaf is, and from_json that every alias
        # points at one)
        return self.stored[leaf.tensor_name]

    def request(self, leaf: _tree.SchemaLeaf, kind: ReadKind, sharding: Any, dtype: Any) -> int:
        stored = self.stored_for(leaf)
        if kind is ReadKind.JAX and self.leaves.get(leaf.tensor_name, leaf).kind is _KEY:
            sharding, dtype = None, None  # key data is read plainly, wrapped, then placed
        slot = (stored.name, kind, id(sharding) if sharding is not None else None, str(dtype))
        index = self.slots.get(slot)
        if index is None:
            index = self.slots[slot] = len(self.requests)
            request = ReadRequest(stored, kind, sharding, dtype, self.options.verify)
            self.requests.append(request)
        return index

    def saved_on(self, original: _tree.SchemaLeaf, stored: StoredTensor) -> Any:
        # Where ``original``, saved as a jax.Array, goes when the target gives no sharding
        # (None: the default device); raises TargetMismatchError where these devices cannot
        # rebuild its saved sharding.
        if self.saved_sharding is None:
            return None
        sharding = self.saved_sharding(original.name)
        if original.kind is _KEY:  # saved: the key data's sharding
            sharding = _place.key_sharding(sharding, len(stored.shape) - 1)
        return sharding

    def run(self) -> list[Any]:
        return read_tensors(self.requests, self.stats, self.options.io)


def restore_tree(
    schema: Mapping[str, Any] | None,
    stored: Mapping[str, StoredTensor],
    options: RestoreOptions | None = None,
    *,
    stats: ReadStats | None = None,
    saved_sharding: SavedSharding | None = None,
) -> Any:
    """Rebuilds a tree from ``stored`` tensors as ``options`` asks (None: the saved tree,
    checksums verified). ``schema``: None for a plain safetensors file (a flat dict back).
    Without a target the selected leaves come back in their saved containers (lists keep their
    length, None where unselected); with one, an unselected target leaf comes back as given.
    ``saved_sharding``: where a leaf saved as a ``jax.Array`` goes when the target gives no
    sharding (None: this process's first device).

    Raises:
      TargetMismatchError: listing every mismatch, worded for the standalone API (adapters
        reword it with ``restore_options.reworded``).
    """
    options = options or RestoreOptions()
    typed: _schema.Schema | None = None
    if schema is not None:
        typed = _schema.from_json(schema)  # read once: selection and rebuild use it typed
        leaves = typed.leaves
        for leaf in leaves.values():  # a damaged file fails whole, whatever the target asks
            if leaf.kind in _schema.STORED_KINDS and leaf.name not in stored:
                raise SchemaError(
                    f"schema leaf {leaf.name!r} refers to tensor {leaf.name!r}, which no file holds"
                )
    else:
        leaves = {
            n: _tree.SchemaLeaf(n, _tree.LeafKind.TENSOR, _tree.Tensor(n, _tree.ArrayKind.JAX))
            for n in stored
        }
    loader = _Loader(leaves, stored, options, stats, saved_sharding)
    if options.target is None:
        return _restore_saved(typed, loader)
    return _Targeted(typed, loader).restore()


def _restore_saved(schema: _schema.Schema | None, loader: _Loader) -> Any:
    # The saved tree (or a flat dict without a schema), its selected leaves only.
    leaves, select = loader.leaves, loader.options.select
    slots: dict[str, int] = {}
    shardings: dict[str, Any] = {}
    wanted: Mapping[str, _tree.SchemaLeaf] = leaves
    if select is not None:
        select.check(leaves if schema is None else _tree.selectable_names(schema))
        wanted = {n: leaf for n, leaf in leaves.items() if select.selects(n)}
        if schema is not None:
            schema = _tree.prune_schema(schema, select.selects)
            assert schema is not None  # (check: something is selected)
    for leaf in wanted.values():
        if leaf.kind not in _schema.INLINE_KINDS:
            original = leaves.get(leaf.tensor_name, leaf)
            node = original.node
            kind = ReadKind(node.array) if type(node) is _schema.Tensor else ReadKind.JAX
            if kind is ReadKind.JAX and not _jaxcompat.device_holds(
                _dtypes.to_numpy(loader.stored_for(leaf).dtype)
            ):  # (a dtype JAX lacks, as float6 on some versions: numpy, with ml_dtypes' type)
                kind = ReadKind.NUMPY
            sharding = None
            if kind is ReadKind.JAX:
                sharding = shardings[leaf.name] = loader.saved_on(original, loader.stored_for(leaf))
            slots[leaf.name] = loader.request(leaf, kind, sharding, None)
    values = loader.run()
    finished: dict[int, Any] = {}

    def get(leaf: _tree.SchemaLeaf) -> Any:
        slot = slots[leaf.name]
        if slot not in finished:  # aliases share one object
            value, node = values[slot], leaves.get(leaf.tensor_name, leaf).node
            if type(node) is _schema.PrngKey:
                value = _place.typed_key(leaf.name, value, node.impl, shardings.get(leaf.name))
            finished[slot] = value
        return finished[slot]

    if schema is None:
        return {name: get(leaf) for name, leaf in wanted.items()}
    return _tree.unflatten(schema, get, leaves)


class _Targeted:
    """One targeted restore: plans every target leaf, collects the mismatches, reads, and
    rebuilds the target's tree."""

    def __init__(self, schema: _schema.Schema | None, loader: _Loader) -> None:
        self.leaves, self.loader, self.options = loader.leaves, loader, loader.options
        # The saved None leaves and empty nodes (flax NNX's internal child of each Module
        # aside: no state of the user's), which the target must match too.
        self.empties: frozenset[str] = frozenset()
        if schema is not None:
            self.empties = frozenset(
                n
                for n in _tree.selectable_names(schema)
                if n not in self.leaves
                and not _jaxcompat.is_nnx_internal_attr(n.rsplit(".", 1)[-1])
            )
        self._prefixes: set[str] | None = None
        self.mismatches: list[Mismatch] = []
        self.covered: list[str] = []  # target names whose saved subtree is skipped

    def saved_under(self, name: str) -> bool:
        """Whether the checkpoint holds a subtree at ``name``."""
        if self._prefixes is None:
            self._prefixes = set()
            for saved in (*self.leaves, *self.empties):
                parts = saved.split(".")
                self._prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return name in self._prefixes

    def restore(self) -> Any:
        options = self.options
        flat = _tree.flatten_target(options.target, is_leaf=_target_leaf, structural=is_empty)
        select = options.select
        if select is not None:
            select.check(flat.names, "the restore target")
        plans: list[Plan] = []
        for name, tleaf in zip(flat.names, flat.leaves):
            if select is not None and not select.selects(name):  # as given, nothing read
                plans.append(Known(_given(tleaf)))
                continue
            plan = self.plan(name, tleaf)
            if isinstance(plan, Mismatch):
                self.mismatches.append(plan)
            else:
                plans.append(plan)
        if options.keys is Keys.EXACT:
            self.check_unexpected(set(flat.names))
        if self.mismatches:
            message = mismatch_message(self.mismatches, STANDALONE_WORDS)
            raise TargetMismatchError(message, self.mismatches)
        return flat.rebuild(_place.finished(plans, self.loader.run()))

    def plan(self, name: str, tleaf: Any) -> Plan | Mismatch:
        keys = self.options.keys
        if isinstance(tleaf, Skip) or is_empty(tleaf):
            given = _given(tleaf)
            if name in self.leaves or name in self.empties:
                return Known(given)  # nothing read, the marker returned (as Orbax skips it)
            if self.saved_under(name):
                self.covered.append(name)
                if keys is Keys.EXACT:
                    return Mismatch(
                        name,
                        MismatchKind.STRUCTURE,
                        f"the target has {_describe_empty(given)}, the checkpoint a subtree",
                        saved="subtree",
                        wanted=type(given).__name__,
                    )
                return Known(given)
            if keys is Keys.EXACT and not isinstance(tleaf, Skip):
                return Mismatch(name, MismatchKind.MISSING)
            return Known(given)
        want = _leaf_request(tleaf)
        saved = self.leaves.get(name)
        if saved is None:
            if name in self.empties:  # None or an empty node saved: None, as Orbax gives
                return Known(None)
            concrete = want is not None and not isinstance(
                tleaf, (jax.ShapeDtypeStruct, LeafRequest)
            )
            if keys is Keys.PARTIAL or (keys is Keys.LENIENT and concrete):
                return Known(_given(tleaf))
            return Mismatch(name, MismatchKind.MISSING)
        if saved.kind in _schema.INLINE_KINDS:
            try:
                return Known(_inline_as(name, saved, want))
            except TargetMismatchError as e:
                return e.mismatches[0]
        if want is None:
            return _kind(
                name, f"target leaf of type {type(tleaf).__name__} cannot receive a tensor"
            )
        return self.plan_tensor(name, want, saved)

    def plan_tensor(
        self, name: str, want: LeafRequest | _Key, saved: _tree.SchemaLeaf
    ) -> Plan | Mismatch:
        # How one stored tensor fills a target leaf, or the mismatch that prevents it.
        leaves, loader = self.leaves, self.loader
        pad = self.options.pad_or_truncate
        if isinstance(want, LeafRequest) and want.build is Build.STR:
            return _kind(name, "target leaf of type str cannot receive a tensor")
        stored = loader.stored_for(saved)
        original = leaves.get(saved.tensor_name, saved)
        node = original.node
        is_key = type(node) is _schema.PrngKey
        impl = node.impl if type(node) is _schema.PrngKey else ""
        saved_kind = node.array if type(node) is _schema.Tensor else _schema.ArrayKind.JAX
        stored_shape = tuple(stored.shape)
        typed_key = False
        resize_to: tuple[int, ...] | None = None
        if isinstance(want, _Key):
            build, wanted_sharding, dtype = Build.JAX, want.sharding, None
            if not is_key:
                return _kind(name, "an array in the checkpoint, a PRNG key in the target")
            typed_key = True
            if want.shape != stored_shape[:-1]:
                return Mismatch(
                    name,
                    MismatchKind.SHAPE,
                    f"checkpoint has a PRNG key of shape {stored_shape[:-1]}, "
                    f"target wants {want.shape}",
                    saved=stored_shape[:-1],
                    wanted=want.shape,
                )
        else:
            build = _resolve(want.build, saved_kind)
            wanted_sharding, dtype = want.sharding, want.dtype
            if is_key:
                key_shape = stored_shape[:-1]
                if want.shape is None or want.shape == stored_shape:
                    # Restore args, or a target of the key data's shape (what
                    # ocp.utils.to_shape_dtype_struct makes of a key): a jax.Array target gives
                    # the typed key back, a numpy one its key data, as Orbax does.
                    typed_key = build is Build.JAX
                    if not typed_key:  # the key data itself: still checked to be key data
                        data = jax.ShapeDtypeStruct(stored_shape, _dtypes.to_numpy(stored.dtype))
                        jax.eval_shape(lambda: _place.wrap_key(saved.name, data, impl))
                elif want.shape == key_shape:
                    return _kind(
                        name,
                        "a PRNG key in the checkpoint, an array in the target (give a typed key "
                        f"target, or one of the key data's shape {stored_shape})",
                    )
                else:
                    return Mismatch(
                        name,
                        MismatchKind.SHAPE,
                        f"checkpoint has a PRNG key of shape {key_shape} (key data "
                        f"{stored_shape}, {stored.dtype}), target wants {want.shape}",
                        saved=key_shape,
                        wanted=want.shape,
                    )
            elif want.shape is not None and want.shape != stored_shape:
                problem = _shape_problem(name, stored, want, build, pad or want.pad_or_truncate)
                if problem is not None:
                    return problem
                resize_to = want.shape
        sharding = wanted_sharding if build is Build.JAX else None
        if build is Build.JAX and sharding is None:
            if saved_kind is not _schema.ArrayKind.JAX:
                if isinstance(want, LeafRequest) and want.needs_sharding:
                    return _kind(name, _host_local("a numpy array"))
            else:
                try:
                    sharding = loader.saved_on(original, stored)
                except TargetMismatchError as e:
                    return Mismatch(name, MismatchKind.SHARDING, str(e))
        if typed_key or dtype == _dtypes.to_numpy(stored.dtype):
            dtype = None
        if resize_to is not None:
            slot = loader.request(saved, ReadKind.NUMPY, None, dtype)
            return Resize(slot, resize_to, build is Build.JAX, sharding)
        read_kind = ReadKind.NUMPY if build is Build.PYTHON else ReadKind(build.value)
        slot = loader.request(saved, read_kind, sharding, dtype)
        if typed_key:
            return Finish(slot, saved.name, impl, sharding)
        if build is Build.PYTHON:
            assert isinstance(want, LeafRequest)
            return Finish(slot, saved.name, pytype=want.pytype)
        return Read(slot)

    def check_unexpected(self, target_names: set[str]) -> None:
        select = self.options.select
        under = tuple(f"{n}." for n in self.covered)
        for n in (*self.leaves, *sorted(self.empties)):
            if (
                n not in target_names
                and not (under and n.startswith(under))
                and (select is None or select.selects(n))
            ):
                self.mismatches.append(Mismatch(n, MismatchKind.UNEXPECTED))


def _given(tleaf: Any) -> Any:
    # What a target leaf comes back as when nothing is read for it.
    if isinstance(tleaf, Skip):
        return tleaf.value
    if isinstance(tleaf, LeafRequest):
        return tleaf.given
    return tleaf


def _describe_empty(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (dict, list, tuple)) and not value:
        return f"an empty {type(value).__name__}"
    return repr(value)


def abstract_tree(directory: epath.PathLike, metadata: Mapping[str, Any] | None = None) -> Any:
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (inline values as saved); reads no
    tensor bytes."""
    metadata = metadata or read_metadata(directory)
    tensors = metadata["tensors"]
    leaves = _tree.validate_schema(metadata["schema"])

    def get(leaf: _tree.SchemaLeaf) -> Any:
        info = tensors.get(leaf.tensor_name)
        if not isinstance(info, dict):
            raise SchemaError(
                f"schema leaf {leaf.name!r} refers to unknown tensor {leaf.tensor_name!r}"
            )
        original = leaves.get(leaf.tensor_name, leaf).node
        if isinstance(original, _tree.PrngKey):
            impl = original.impl
            return jax.eval_shape(
                lambda: jax.random.wrap_key_data(
                    jax.numpy.zeros(info["shape"], jax.numpy.uint32), impl=impl
                )
            )
        return jax.ShapeDtypeStruct(tuple(info["shape"]), _dtypes.to_numpy(info["dtype"]))

    return _tree.unflatten(metadata["schema"], get, leaves)
