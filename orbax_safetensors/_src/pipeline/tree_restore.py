"""Rebuilding a pytree from stored tensors, with or without a target.

Without a target the stored schema gives back the saved containers. With one
(``RestoreOptions.target``), every target leaf is matched to a stored leaf by its dotted name
(see :mod:`.restore_options` for the leaves understood, :mod:`.restore_plan` for what each
becomes); all problems (missing, unexpected, mis-shaped keys, a leaf against a subtree) are
collected as :class:`~.core.errors.Mismatch` records and raised at once in one
``TargetMismatchError``, which the API adapters word in their own option names.

Structure, as Orbax's handlers compare it: ``None`` and empty nodes in the target stand for a
saved leaf, ``None`` or empty node (nothing is read, they come back as given); against a saved
subtree, or where the checkpoint has nothing, they are a mismatch unless keys are not exact. A
target leaf where ``None`` or an empty node was saved comes back as None.

Example::

    tree = restore_tree(schema, stored)
    tree = restore_tree(schema, stored, RestoreOptions(target=abstract, keys=Keys.PARTIAL))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from orbax_safetensors._src.compat import jaxcompat as _jaxcompat
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import select as _select
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    Mismatch,
    MismatchKind,
    SchemaError,
    TargetMismatchError,
)
from orbax_safetensors._src.pipeline.reader import (
    ReadKind,
    ReadRequest,
    ReadStats,
    StoredTensor,
    read_tensors,
)
from orbax_safetensors._src.pipeline.restore_options import (
    STANDALONE_WORDS,
    Keys,
    LeafRequest,
    RestoreOptions,
    Skip,
    mismatch_message,
)
from orbax_safetensors._src.pipeline.restore_plan import (
    Known,
    Plan,
    Read,
    Resize,
    SavedSharding,
    inline_as,
    key_sharding,
    leaf_request,
    pad_or_truncate,
    plan_tensor,
    wrap_key,
)
from orbax_safetensors._src.storage import config as _config

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


def _leaf_of(stored: StoredTensor) -> _tree.SchemaLeaf:
    return _tree.SchemaLeaf(
        stored.name, _tree.LeafKind.TENSOR, _tree.Tensor(stored.name, _tree.ArrayKind.JAX)
    )


class _Loader:
    def __init__(
        self,
        leaves: Mapping[str, _tree.SchemaLeaf],
        stored: Mapping[str, StoredTensor],
        verify: bool,
        stats: ReadStats | None,
        io: _config.IOOptions | None = None,
    ) -> None:
        self.leaves, self.stored, self.verify, self.stats = leaves, stored, verify, stats
        self.io = io
        self.requests: list[ReadRequest] = []
        self.slots: dict[tuple, int] = {}

    def stored_for(self, leaf: _tree.SchemaLeaf) -> StoredTensor:
        name = leaf.tensor_name
        if name not in self.stored:
            raise SchemaError(
                f"schema leaf {leaf.name!r} refers to tensor {name!r}, which no file holds"
            )
        return self.stored[name]

    def request(self, leaf: _tree.SchemaLeaf, kind: ReadKind, sharding: Any, dtype: Any) -> int:
        stored = self.stored_for(leaf)
        if kind is ReadKind.JAX and self.leaves.get(leaf.tensor_name, leaf).kind is _KEY:
            sharding, dtype = None, None  # key data is read plainly, wrapped, then placed
        slot = (stored.name, kind, id(sharding) if sharding is not None else None, str(dtype))
        index = self.slots.get(slot)
        if index is None:
            index = self.slots[slot] = len(self.requests)
            self.requests.append(ReadRequest(stored, kind, sharding, dtype, self.verify))
        return index

    def run(self) -> list[Any]:
        return read_tensors(self.requests, self.stats, self.io)


def _finish(
    leaf: _tree.SchemaLeaf, leaves: Mapping[str, _tree.SchemaLeaf], value: Any, sharding: Any = None
) -> Any:
    original = leaves.get(leaf.tensor_name, leaf).node
    if type(original) is _schema.PrngKey:
        key = wrap_key(leaf.name, value, original.impl)
        return jax.device_put(key, sharding) if sharding is not None else key
    return value


def restore_tree(
    schema: Mapping[str, Any] | None,
    stored: Mapping[str, StoredTensor],
    options: RestoreOptions | None = None,
    *,
    stats: ReadStats | None = None,
    saved_sharding: SavedSharding | None = None,
) -> Any:
    """Rebuilds a tree from ``stored`` tensors (see the module docstring).

    Args:
      schema: the stored tree schema, or None for a plain safetensors file (a flat dict).
      stored: every stored tensor by name.
      options: the target, key handling, selection, verification (None: the saved tree,
        everything read, checksums verified). Without a target the selected leaves come back
        in their saved containers (dicts lose unselected entries, lists keep their length
        with None in unselected places); with one, the selection is among the target's
        leaves, and an unselected target leaf comes back as given, nothing read for it.
      stats: accumulates bytes read and needed.
      saved_sharding: where to place a leaf saved as a ``jax.Array`` when the target gives no
        sharding; None: this process's first device.

    Raises:
      TargetMismatchError: listing every mismatch (``.mismatches``), worded for the
        standalone API (an adapter rewords it with ``restore_options.reworded``).
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
        leaves = {name: _leaf_of(s) for name, s in stored.items()}
    loader = _Loader(leaves, stored, options.verify, stats, options.io)
    if options.target is None:
        return _restore_untargeted(typed, leaves, loader, saved_sharding, options.select)
    return _Targeted(typed, leaves, loader, saved_sharding, options).restore()


def _restore_untargeted(
    schema: _schema.Schema | None,
    leaves: Mapping[str, _tree.SchemaLeaf],
    loader: _Loader,
    saved_sharding: SavedSharding | None,
    select: _select.Selection | None = None,
) -> Any:
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
            if kind is ReadKind.JAX and saved_sharding is not None:
                sharding = saved_sharding(original.name)
                if original.kind is _KEY:  # saved: the key data's sharding
                    sharding = key_sharding(sharding, len(loader.stored_for(leaf).shape) - 1)
                shardings[leaf.name] = sharding
            slots[leaf.name] = loader.request(leaf, kind, sharding, None)
    values = loader.run()
    finished: dict[int, Any] = {}

    def get(leaf: _tree.SchemaLeaf) -> Any:
        slot = slots[leaf.name]
        if slot not in finished:  # aliases share one object
            finished[slot] = _finish(leaf, leaves, values[slot], shardings.get(leaf.name))
        return finished[slot]

    if schema is None:
        return {name: get(leaf) for name, leaf in wanted.items()}
    return _tree.unflatten(schema, get, leaves)


class _Targeted:
    """One targeted restore: plans every target leaf, collects the mismatches, reads, and
    rebuilds the target's tree."""

    def __init__(
        self,
        schema: _schema.Schema | None,
        leaves: Mapping[str, _tree.SchemaLeaf],
        loader: _Loader,
        saved_sharding: SavedSharding | None,
        options: RestoreOptions,
    ) -> None:
        self.leaves, self.loader, self.options = leaves, loader, options
        self.saved_sharding = saved_sharding
        # The saved None leaves and empty nodes (flax NNX's internal child of each Module
        # aside: no state of the user's), which the target must match too.
        self.empties: frozenset[str] = frozenset()
        if schema is not None:
            self.empties = frozenset(
                n
                for n in _tree.selectable_names(schema)
                if n not in leaves and not _jaxcompat.is_nnx_internal_attr(n.rsplit(".", 1)[-1])
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
        return flat.rebuild(self.run(plans))

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
        want = leaf_request(tleaf)
        saved = self.leaves.get(name)
        if saved is None:
            if name in self.empties:  # None or an empty node saved: None, as Orbax gives
                return Known(None)
            given = _given(tleaf)
            concrete = want is not None and not isinstance(
                tleaf, (jax.ShapeDtypeStruct, LeafRequest)
            )
            if keys is Keys.PARTIAL or (keys is Keys.LENIENT and concrete):
                return Known(given)
            return Mismatch(name, MismatchKind.MISSING)
        if saved.kind in _schema.INLINE_KINDS:
            try:
                return Known(inline_as(name, saved, want))
            except TargetMismatchError as e:
                return e.mismatches[0]
        if want is None:
            return Mismatch(
                name,
                MismatchKind.KIND,
                f"target leaf of type {type(tleaf).__name__} cannot receive a tensor",
            )
        return plan_tensor(
            name,
            want,
            saved,
            self.leaves,
            self.loader,
            self.saved_sharding,
            self.options.pad_or_truncate,
        )

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

    def run(self, plans: list[Plan]) -> list[Any]:
        values = self.loader.run()
        out: list[Any] = []
        finished: dict[tuple, Any] = {}
        for plan in plans:
            if isinstance(plan, Read):
                out.append(values[plan.slot])  # the common case (aliases share it)
            elif isinstance(plan, Known):
                out.append(plan.value)
            elif isinstance(plan, Resize):  # read whole on the host, then padded or truncated
                out.append(
                    pad_or_truncate(values[plan.slot], plan.shape, plan.build, plan.sharding)
                )
            elif plan.pytype is not None:
                out.append(plan.pytype(values[plan.slot].item()))
            else:
                once = (plan.slot, id(plan.sharding))
                if once not in finished:  # aliases share one object
                    finished[once] = _finish(
                        plan.saved, self.leaves, values[plan.slot], plan.sharding
                    )
                out.append(finished[once])
        return out


def _given(tleaf: Any) -> Any:
    """What a target leaf comes back as when nothing is read for it."""
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
