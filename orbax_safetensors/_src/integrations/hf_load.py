"""PyTorch / Hugging Face tensors into any JAX target through a :class:`KeyMapping`: an NNX
module's variables, a pytree of arrays, or an abstract pytree of ``jax.ShapeDtypeStruct`` s
with shardings.

Each target leaf says what it wants (shape, dtype, sharding, or numpy). Every problem (keys no
rule maps, targets nothing fills, shapes that do not fit) is found before a byte is read. Then,
a batch of links at a time:

- a target sharded over several devices is read as PyTorch tensors sharded alike (the target's
  partition spec pulled back through the rule: a transpose permutes it, a stacked layer drops
  axis 0, fused parts keep it; a reshape reads the tensor replicated), through the pipeline's
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
from orbax_safetensors._src.integrations import fidelity as _fidelity
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
from orbax_safetensors._src.pipeline import reader as _reader
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
    links, report = _links.load_links(mapping, tensors)
    moves: list[_links.Link] = []
    claimed: dict[str, str] = {}
    for link in links:
        key = link.torch[0]
        absent = [n for n in link.flax if n not in targets]
        if absent:
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
        split = _fidelity.fused_load_problem(link, [t.shape for t in infos], dtype)
        if split is not None:
            report.mismatched.append(split)
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
    """The sharding each PyTorch tensor of ``link`` is read with (see the module docstring)."""
    first = targets[0].sharding
    mesh = first.mesh
    spec = _spec(first, len(targets[0].shape))
    rule = link.rule
    if link.parts_on_torch and rule.stacked is not None:
        spec = spec[1:]  # each layer is one PyTorch tensor
    pulled = _pull_spec(rule.transform_or_identity, spec)
    out = []
    for shape in shapes:
        entries = pulled if pulled is not None and len(pulled) == len(shape) else ()
        entries = _fits(mesh, entries, shape) if entries else ()
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
    stats: _reader.ReadStats | None = None


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
            _reader.ReadRequest(self.stored(k), _reader.ReadKind.NUMPY, verify=self.options.verify)
            for k in keys
        ]
        return dict(zip(keys, _reader.read_tensors(requests, self.options.stats, self.options.io)))

    def sharded(self, keys: Sequence[str], shardings: Sequence[Any]) -> list[jax.Array]:
        requests = [
            _reader.ReadRequest(self.stored(k), _reader.ReadKind.JAX, s, verify=self.options.verify)
            for k, s in zip(keys, shardings)
        ]
        return _reader.read_tensors(requests, self.options.stats, self.options.io)


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
        fn = _jitted(link.rule, link.layers, len(link.flax), len(link.torch), dtypes, shardings)
    except TypeError:  # a rule holding an unhashable transform: compiled for this link alone
        fn = _jitted.__wrapped__(
            link.rule, link.layers, len(link.flax), len(link.torch), dtypes, shardings
        )
    return fn(*arrays)


@functools.lru_cache(maxsize=256)
def _jitted(
    rule: Any,
    layers: int,
    n_flax: int,
    n_torch: int,
    dtypes: tuple[np.dtype, ...],
    shardings: tuple[Any, ...],
) -> Any:
    # One compiled function per rule and target layout, shared by every link of that rule (the
    # layers of a model that is not scanned): a link's arithmetic depends on its rule, layer
    # count and tensor counts only, not its names.
    import jax.numpy as jnp

    link = _links.Link(
        rule,
        tuple(f"flax{i}" for i in range(n_flax)),
        tuple(f"torch{i}" for i in range(n_torch)),
        layers,
    )

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
            "mapping\n" + report.problems()
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
