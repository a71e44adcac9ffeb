"""PyTorch / Hugging Face tensors into any JAX target through a :class:`KeyMapping`: an NNX
module's variables, a pytree of arrays, or an abstract pytree of ``jax.ShapeDtypeStruct`` s
with shardings.

Each target leaf says what it wants (shape, dtype, sharding, or numpy). Every problem (keys no
rule maps, targets nothing fills, shapes that do not fit) is found before a byte is read. Then,
a batch of links at a time:

- a target sharded over several devices is read as PyTorch tensors sharded alike (the target's
  partition spec pulled back through the rule: a transpose permutes it, a stacked axis is
  dropped, fused parts keep it; a reshape reads the tensor replicated), through the pipeline's
  ranged reader, so each process reads the byte ranges of its own shards; the rule then runs
  on device (``jit``, ``jax.numpy``) into the target's sharding;
- any other target is read whole to host, transformed in numpy and placed (or kept numpy).

Example::

    flat = {"layer.kernel": Target((4, 3), np.dtype("float32"), sharding)}
    values, report = load_flat(source, flat, mapping)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations.key_mapping import (
    IDENTITY,
    Chain,
    KeyMapping,
    MappingReport,
    Reshape,
    SplitHeads,
    Transpose,
)
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.storage import config as _config


@dataclasses.dataclass(frozen=True)
class Target:
    """What one target leaf wants: its shape and dtype, and where it goes: a numpy array
    (``numpy``), else a ``jax.Array`` over ``sharding`` (None: the default device)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any = None
    numpy: bool = False

    @classmethod
    def of(cls, leaf: Any) -> Target | None:
        """The target a leaf describes (an array, a ``jax.ShapeDtypeStruct``, a numpy array),
        or None for a leaf that is no tensor (left as it is)."""
        if isinstance(leaf, (np.ndarray, np.generic)):
            return cls(tuple(leaf.shape), np.dtype(leaf.dtype), None, True)
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                return None  # typed PRNG keys are training state, never model weights
            sharding = getattr(leaf, "sharding", None)
            return cls(tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype), sharding)
        return None

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _with_tied(
    tensors: dict[str, _sources.TensorInfo], mapping: KeyMapping, targets: Mapping[str, Any]
) -> tuple[dict[str, _sources.TensorInfo], dict[str, str]]:
    # A tied key the file lacks reads the key it is tied to, when the target has its variable.
    table, alias = dict(tensors), {}
    for key, source in mapping.tied:
        target = mapping.to_flax(key)
        if key in table or source not in table or target is None or target[0] not in targets:
            continue
        table[key] = dataclasses.replace(table[source], name=key)
        alias[key] = source
    return table, alias


def plan_links(
    tensors: dict[str, _sources.TensorInfo],
    targets: Mapping[str, Target],
    mapping: KeyMapping,
) -> tuple[list[_links.Link], MappingReport]:
    """The links filling ``targets`` from ``tensors`` (the tied keys among them), and the
    report of every problem: keys no rule maps, names the target lacks, names two keys fill,
    shapes that do not fit, targets nothing fills."""
    links, report = _links.load_links(mapping, {k: t.shape for k, t in tensors.items()})
    moves: list[_links.Link] = []
    claimed: dict[str, str] = {}
    for link in links:
        key = link.torch[0]
        absent = [n for n in link.flax if n not in targets]
        if absent:
            refused = _refusal(link, tensors)
            if refused is not None:  # (a target derived from the files leaves such links out)
                report.mismatched.append(refused)
            else:
                report.unexpected += [f"{key} -> {n}" for n in absent]
            continue
        taken = [n for n in link.flax if n in claimed]
        if taken:
            report.mismatched += [f"{key} and {claimed[n]} both map to {n}" for n in taken]
            continue
        claimed.update(dict.fromkeys(link.flax, key))
        infos = [tensors[k] for k in link.torch]
        want = [targets[n].shape for n in link.flax]
        described = f"{key} {infos[0].dtype}{list(infos[0].shape)}"
        dtype = _dtypes.to_numpy(infos[0].dtype)
        try:
            got = link.flax_shapes([t.shape for t in infos], dtype)
        except ValueError as e:
            report.mismatched.append(f"{described} -> {', '.join(link.flax)}: {e}")
            continue
        if got != want:
            report.mismatched.append(
                f"{described} becomes {', '.join(str(list(g)) for g in got)} but "
                f"{', '.join(link.flax)} is {', '.join(str(list(w)) for w in want)}"
            )
            continue
        moves.append(link)
    report.missing = [n for n in targets if n not in claimed and not mapping.flax_ignored(n)]
    return moves, report


def _refusal(link: _links.Link, tensors: Mapping[str, _sources.TensorInfo]) -> str | None:
    # Why the link's shape arithmetic refuses its stored tensors (a transform they contradict:
    # a config's head_dim or vocabulary), or None.
    infos = [tensors[k] for k in link.torch]
    try:
        link.flax_shapes([t.shape for t in infos], _dtypes.to_numpy(infos[0].dtype))
    except ValueError as e:
        return (
            f"{link.torch[0]} {infos[0].dtype}{list(infos[0].shape)} -> {', '.join(link.flax)}: {e}"
        )
    return None


# --------------------------------------------------------------------------- shardings


def _pull_spec(transform: Any, spec: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The partition spec of a tensor whose ``transform.to_flax`` has partition ``spec``, or
    None when the transform moves elements across axes (a reshape: read replicated)."""
    if transform is IDENTITY or transform is None:
        return spec
    if isinstance(transform, Transpose):
        axes = transform.axes if transform.axes is not None else tuple(reversed(range(len(spec))))
        if len(axes) != len(spec):
            return None
        out: list[Any] = [None] * len(spec)
        for j, a in enumerate(axes):
            out[a] = spec[j]
        return tuple(out)
    if isinstance(transform, Chain):
        for t in reversed(transform.transforms):
            pulled = _pull_spec(t, spec)
            if pulled is None:
                return None
            spec = pulled
        return spec
    return None


def _on_device(transform: Any) -> bool:
    # Transforms known to run on jax arrays under jit (array methods only).
    if isinstance(transform, Chain):
        return all(_on_device(t) for t in transform.transforms)
    return transform is IDENTITY or isinstance(transform, (Transpose, SplitHeads, Reshape))


def _spec(sharding: jax.sharding.NamedSharding, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _fits(mesh: Any, spec: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    # Axes that do not divide evenly are read unsharded.
    out = []
    for entry, n in zip(spec, shape):
        names = entry if isinstance(entry, tuple) else (entry,)
        size = int(np.prod([mesh.shape[a] for a in names if a is not None]))
        out.append(entry if n % size == 0 else None)
    return tuple(out)


def _torch_shardings(
    link: _links.Link, targets: Sequence[Target], shapes: Sequence[tuple[int, ...]]
) -> list[Any]:
    """The sharding each PyTorch tensor of ``link`` is read with (see the module docstring):
    the first target's partition spec without its stacked axes (a slot's spec), pulled back
    through the rule's transform, with unsharded axes where the PyTorch tensor stacks."""
    first = targets[0].sharding
    mesh = first.mesh
    ndim = len(targets[0].shape)
    spec = _spec(first, ndim)
    spec = tuple(spec[a] for a in link.flax_gather.slot_axes(ndim))
    pulled = _pull_spec(link.rule.transform_or_identity, spec)
    out = []
    for shape in shapes:
        entries: tuple[Any, ...] = ()
        if pulled is not None and len(pulled) + len(link.torch_gather.stacks) == len(shape):
            stacked = set(link.torch_gather.stack_axes(len(shape)))
            slot = iter(pulled)
            entries = tuple(None if a in stacked else next(slot) for a in range(len(shape)))
            entries = _fits(mesh, entries, shape)
        out.append(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries)))
    return out


def _device_path(link: _links.Link, targets: Sequence[Target]) -> bool:
    shardings = [t.sharding for t in targets]
    return (
        all(not t.numpy for t in targets)
        and all(isinstance(s, jax.sharding.NamedSharding) for s in shardings)
        and len({id(s.mesh) for s in shardings}) == 1
        and len(shardings[0].device_set) > 1
        and _on_device(link.rule.transform_or_identity)
    )


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_flat` and :func:`load_tree` load: ``strict`` raises on any mapping
    problem (else the report lists it); ``batch_bytes`` of tensors held at a time; ``where``
    names the source in errors; ``verify``, ``io`` and ``stats`` go to the pipeline's reader.

    Example::

        values, report = load_flat(source, flat, mapping, LoadOptions(strict=False))
    """

    strict: bool = True
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES
    where: str = ""
    verify: bool = True
    io: _config.IOOptions | None = None
    stats: _read.ReadStats | None = None


@dataclasses.dataclass
class _Reads:
    """How a load reads its source: ranged and sharded when the source is safetensors."""

    source: Any
    alias: dict[str, str]
    options: LoadOptions

    def stored(self, key: str) -> Any:
        stored = getattr(self.source, "stored", None)
        return None if stored is None else stored[self.alias.get(key, key)]

    def host(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        if getattr(self.source, "stored", None) is None:  # an Orbax or msgpack source
            got = self.source.read(sorted({self.alias.get(k, k) for k in keys}))
            return {k: got[self.alias.get(k, k)] for k in keys}
        requests = [
            _read.ReadRequest(self.stored(k), _read.ReadKind.NUMPY, verify=self.options.verify)
            for k in keys
        ]
        return dict(zip(keys, _read.read_tensors(requests, self.options.stats, self.options.io)))

    def sharded(self, keys: Sequence[str], shardings: Sequence[Any]) -> list[jax.Array]:
        requests = [
            _read.ReadRequest(self.stored(k), _read.ReadKind.JAX, s, verify=self.options.verify)
            for k, s in zip(keys, shardings)
        ]
        return _read.read_tensors(requests, self.options.stats, self.options.io)


def _place(value: np.ndarray, target: Target) -> Any:
    value = np.asarray(value)
    if value.dtype != target.dtype:
        value = value.astype(target.dtype)
    if target.numpy:
        return value
    if target.sharding is None:
        return jax.device_put(value)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda i: value[i])


def _run_on_device(link: _links.Link, targets: Sequence[Target], arrays: Sequence[Any]) -> Any:
    dtypes = tuple(t.dtype for t in targets)
    shardings = tuple(t.sharding for t in targets)
    try:
        fn = _jitted(link.anonymous(), dtypes, shardings)
    except TypeError:  # a rule holding an unhashable transform: compiled for this link alone
        fn = _jitted.__wrapped__(link.anonymous(), dtypes, shardings)
    return fn(*arrays)


@functools.lru_cache(maxsize=256)
def _jitted(link: _links.Link, dtypes: tuple[np.dtype, ...], shardings: tuple[Any, ...]) -> Any:
    # One compiled function per anonymous link (rule, counts, tensor counts: not its names)
    # and target layout, shared by every link of that layout (the layers of a model that is
    # not scanned).
    import jax.numpy as jnp

    def apply(*xs: Any) -> tuple[Any, ...]:
        outs = link.to_flax(list(xs), xp=jnp)
        return tuple(o.astype(d) for o, d in zip(outs, dtypes))

    return jax.jit(apply, out_shardings=shardings)


def load_flat(
    source: Any,
    targets: Mapping[str, Target],
    mapping: KeyMapping,
    options: LoadOptions | None = None,
) -> tuple[dict[str, Any], MappingReport]:
    """The values of ``targets`` (by Flax name) read from ``source`` (a catalog
    ``TensorSource``) through ``mapping``, and the report.

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once, before any read.
    """
    from orbax_safetensors._src.core.errors import TargetMismatchError

    options = options or LoadOptions()
    tensors, alias = _with_tied(source.tensors, mapping, targets)
    moves, report = plan_links(tensors, targets, mapping)
    if options.strict and not report.ok:
        raise TargetMismatchError(
            f"{options.where or source.path}: the checkpoint does not fit the target through this "
            "mapping:\n" + report.problems()
        )
    reads = _Reads(source, alias, options)
    values: dict[str, Any] = {}
    sharded = getattr(source, "stored", None) is not None
    for group in _links.link_batches(
        moves, lambda k: tensors[k].nbytes, options.batch_bytes, torch_side=True
    ):
        on_host = [
            not (sharded and _device_path(link, [targets[n] for n in link.flax])) for link in group
        ]
        arrays = reads.host(sorted({k for link, h in zip(group, on_host) if h for k in link.torch}))
        for link, host in zip(group, on_host):
            wants = [targets[n] for n in link.flax]
            if host:
                outs = link.to_flax([arrays[k] for k in link.torch])
                for name, value, want in zip(link.flax, outs, wants):
                    values[name] = _place(value, want)
            else:
                shapes = [tensors[k].shape for k in link.torch]
                read = reads.sharded(list(link.torch), _torch_shardings(link, wants, shapes))
                values.update(zip(link.flax, _run_on_device(link, wants, read)))
            report.moved += link.pairs()
        del arrays
    return values, report


# --------------------------------------------------------------------------- trees


def derived_targets(
    tensors: Mapping[str, _sources.TensorInfo], mapping: KeyMapping
) -> dict[str, Target]:
    """The target ``tensors`` (by PyTorch key) and ``mapping`` imply: every Flax tensor the
    mapping's links make of them (stacked and fused ones joined), of the shape the link gives
    and the stored dtype (the promotion of a link's dtypes if they differ), on the default
    device. Names the mapping ignores are left out; tensors no rule maps and links whose
    shapes do not fit too (:func:`plan_links` reports them)."""
    links, _ = _links.load_links(mapping, {k: t.shape for k, t in tensors.items()})
    targets: dict[str, Target] = {}
    for link in links:
        infos = [tensors[k] for k in link.torch]
        dtype = np.result_type(*(_dtypes.to_numpy(t.dtype) for t in infos))
        try:
            shapes = link.flax_shapes([t.shape for t in infos], dtype)
        except ValueError:
            continue
        for name, shape in zip(link.flax, shapes):
            if not mapping.flax_ignored(name):
                targets.setdefault(name, Target(tuple(shape), np.dtype(dtype)))
    return targets


def nested(flat: Mapping[str, Any]) -> dict[Any, Any]:
    """The nested dicts of dotted names ``flat``: ``{"a.0.b": x}`` -> ``{"a": {0: {"b": x}}}``.
    The keys of a dict whose keys are all decimal numbers are ``int`` s (as ``nnx.state``
    and ``nnx.to_pure_dict`` key a list's items, so that ``nnx.update`` takes the tree), the
    others strings; joined with ``.`` again, the key paths are the names.

    Raises:
      ValueError: a name that is also the prefix of another (``a`` and ``a.b``).
    """
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{'.'.join(parents[: i + 1])} is a tensor and holds {name}")
            node = child
        if last in node:
            raise ValueError(f"{name} is a tensor and holds {sorted(node[last])[0]!r}")
        node[last] = value

    def keyed(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        numbers = all(k.isdecimal() and str(int(k)) == k for k in node)
        return {(int(k) if numbers else k): keyed(v) for k, v in node.items()}

    return keyed(tree)


def _entry_text(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def load_tree(
    tree: Any,
    source: Any,
    mapping: KeyMapping,
    options: LoadOptions | None = None,
    *,
    prefix: str = "",
) -> tuple[Any, MappingReport]:
    """``tree`` with its tensor leaves read from ``source`` through ``mapping`` (see
    :func:`load_flat`), and the report. Leaves are named by their key paths joined with ``.``
    (NNX variables by their value, kept as variables); with ``prefix`` only names starting
    with it are filled, matched without it. Other leaves (and, with ``strict=False``, tensors
    nothing fills) come back as given."""
    from orbax_safetensors._src.compat import jaxcompat as _jaxcompat

    variables = _jaxcompat.nnx_variable_types()
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, variables)
    )
    targets: dict[str, Target] = {}
    positions: dict[str, int] = {}
    for i, (path, leaf) in enumerate(flat):
        name = ".".join(_entry_text(k) for k in path) or "value"
        if not name.startswith(prefix):
            continue
        value = _jaxcompat.nnx_value(leaf) if isinstance(leaf, variables) else leaf
        if isinstance(leaf, _rng_types()):
            continue  # RNG keys and counts are training state, never model weights
        target = Target.of(value)
        if target is not None:
            targets[name[len(prefix) :]] = target
            positions[name[len(prefix) :]] = i
    values, report = load_flat(source, targets, mapping, options)
    leaves = [leaf for _, leaf in flat]
    for name, value in values.items():
        i = positions[name]
        leaf = leaves[i]
        leaves[i] = leaf.replace(value) if isinstance(leaf, variables) else value  # type: ignore[attr-defined]
    return jax.tree_util.tree_unflatten(treedef, leaves), report


def _rng_types() -> tuple[type, ...]:
    import sys

    nnx = sys.modules.get("flax.nnx")
    return (nnx.RngState,) if nnx is not None else ()
