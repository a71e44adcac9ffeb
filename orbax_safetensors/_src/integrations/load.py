"""PyTorch / Hugging Face checkpoints into any JAX target through a :class:`KeyMapping`
(:func:`load_pytorch`), and the tree a checkpoint implies (:func:`abstract_pytorch`).

Every problem is found before a byte is read. Then, a batch of links at a time, a target
sharded over several devices is read as PyTorch tensors sharded alike (its partition spec
pulled back through the rule) and the rule runs on the devices; any other target is read
whole to host, transformed in numpy and placed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations import fidelity as _fidelity
from orbax_safetensors._src.integrations import flax_tables as _flax_tables
from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations.key_mapping import KeyMapping, MappingReport
from orbax_safetensors._src.integrations.transforms import (
    IDENTITY,
    Chain,
    Offset,
    Reshape,
    RopeInterleave,
    Scale,
    SplitHeads,
    Transpose,
    VocabRows,
)
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.storage import config as _config

__all__ = ["abstract_pytorch", "load_pytorch"]


def load_pytorch(
    target: Any,
    path: epath.PathLike,
    mapping: KeyMapping,
    *,
    strict: bool = True,
    variables: Any = None,
    prefix: str = "",
    with_report: bool = False,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> Any:
    """Loads a PyTorch / Hugging Face safetensors checkpoint through ``mapping`` into an NNX
    model (in place) or into any pytree (returned).

    Args:
      target: an NNX module, its ``variables`` filled in place; a pytree of arrays, numpy
        arrays or ``jax.ShapeDtypeStruct`` s named by their key paths joined with ``.``,
        each leaf filled in its own dtype and sharding (each process reads its own shards);
        or None: the tree :func:`abstract_pytorch` gives, on the default device.
      path: a ``.safetensors`` file, a Hugging Face directory, its index file, or an item
        this library wrote.
      mapping: how PyTorch keys become the target's names.
      strict: raise if any key is unmapped, unexpected, missing or mis-shaped, before
        anything is read; with ``strict=False``, load what fits and report the rest.
      variables: with a module, the ``nnx`` filter of the variables to fill (default
        ``(nnx.Param, nnx.BatchStat)``).
      prefix: fill only target names starting with it, matched without it (``"params."``).
      with_report: with a pytree, return ``(tree, report)``.
      batch_bytes: tensor bytes read at a time.

    Returns:
      With a module, a :class:`MappingReport`; else the filled tree (``with_report``: and the
      report).

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once.

    Example::

        report = osf.load_pytorch(model, "pytorch_model.safetensors", mapping)
        params = osf.load_pytorch(abstract_params, "hf_dir", mapping, prefix="params.")
        params = osf.load_pytorch(None, "hf_dir", mapping)   # {"layers": {0: ...}}
    """
    from flax import nnx

    source = _sources.open_source(source_path(path))
    options = LoadOptions(strict=strict, batch_bytes=batch_bytes, where=str(path))
    if target is None:  # the tree the directory and the mapping imply
        targets = derived_targets(source.tensors, mapping)
        values, report = load_flat(source, targets, mapping, options)
        tree = _flax_tables.nested({prefix + n: v for n, v in values.items()})
        return (tree, report) if with_report else tree
    module = target if isinstance(target, nnx.Module) else None
    if module is not None:
        filt = (nnx.Param, nnx.BatchStat) if variables is None else variables
        target = nnx.state(module, filt)
    tree, report = load_tree(target, source, mapping, options, prefix=prefix)
    if module is not None:
        nnx.update(module, tree)
        return report
    return (tree, report) if with_report else tree


def abstract_pytorch(
    path: epath.PathLike,
    mapping: KeyMapping,
    *,
    strict: bool = True,
    prefix: str = "",
    with_report: bool = False,
) -> Any:
    """The abstract tree a PyTorch / Hugging Face checkpoint and ``mapping`` imply, from the
    files' headers alone: ``jax.ShapeDtypeStruct`` s of the stored dtypes in nested dicts of
    their dotted names (decimal keys as ``int`` s, as ``nnx.state`` has them). Give its leaves
    shardings and pass it to :func:`load_pytorch` to read the checkpoint sharded.

    Args:
      path: as :func:`load_pytorch` takes it.
      mapping: as :func:`load_pytorch` takes it.
      strict: raise if a key is unmapped or a stacked or fused group is incomplete or does
        not fit; with ``strict=False``, leave them out and report.
      prefix: put in front of every name (e.g. ``"params."``).
      with_report: return ``(tree, report)``.

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once.

    Example::

        abstract = osf.abstract_pytorch("hf_dir", mapping)
        sharded = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                              sharding=sharding), abstract)
        params = osf.load_pytorch(sharded, "hf_dir", mapping)
    """
    source = _sources.open_source(source_path(path))
    targets = derived_targets(source.tensors, mapping)
    _, report = plan_links(dict(source.tensors), targets, mapping)
    if strict and not report.ok:
        raise TargetMismatchError(
            f"{path}: the checkpoint does not fit this mapping\n" + report.problems()
        )
    tree = _flax_tables.nested(
        {prefix + n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in targets.items()}
    )
    return (tree, report) if with_report else tree


def source_path(path: epath.PathLike) -> epath.Path:
    """``path`` as ``open_source`` takes it: a Hugging Face index file names its directory."""
    path = epath.Path(path)
    if path.name.endswith(".index.json") and not path.is_dir():
        return path.parent
    return path


# --------------------------------------------------------------------------- loading


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
        """The target a leaf describes, or None for a leaf that is no tensor."""
        if isinstance(leaf, (np.ndarray, np.generic)):
            return cls(tuple(leaf.shape), np.dtype(leaf.dtype), None, True)
        if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                return None  # typed PRNG keys are training state, never model weights
            sharding = getattr(leaf, "sharding", None)
            return cls(tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype), sharding)
        return None


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How a load reads: ``strict`` raises on any mapping problem (else the report lists it);
    ``where`` names the source in errors; ``verify``, ``io``, ``stats``: the pipeline's."""

    strict: bool = True
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES
    where: str = ""
    verify: bool = True
    io: _config.IOOptions | None = None
    stats: _read.ReadStats | None = None


def load_tree(
    tree: Any,
    source: Any,
    mapping: KeyMapping,
    options: LoadOptions,
    *,
    prefix: str = "",
) -> tuple[Any, MappingReport]:
    """``tree`` with its tensor leaves (named by dotted key path; with ``prefix``, only those
    under it, matched without it) read from ``source`` through ``mapping``, and the report;
    NNX variables stay variables, other leaves come back as given."""
    flat, treedef = _flax_tables.tree_leaves(tree)
    targets: dict[str, Target] = {}
    positions: dict[str, int] = {}
    for i, (name, _, value) in enumerate(flat):
        target = Target.of(value) if name.startswith(prefix) else None
        if target is not None:
            targets[name[len(prefix) :]] = target
            positions[name[len(prefix) :]] = i
    values, report = load_flat(source, targets, mapping, options)
    leaves = [leaf for _, leaf, _ in flat]
    for name, value in values.items():
        _, leaf, held = flat[positions[name]]
        variable = leaf is not held  # (an nnx.Variable holds its value: kept as a variable)
        leaves[positions[name]] = leaf.replace(value) if variable else value
    return jax.tree_util.tree_unflatten(treedef, leaves), report


def load_flat(
    source: Any,
    targets: Mapping[str, Target],
    mapping: KeyMapping,
    options: LoadOptions,
) -> tuple[dict[str, Any], MappingReport]:
    """The values of ``targets`` (by Flax name) read from ``source`` (a ``TensorSource``)
    through ``mapping``, a batch of links at a time, and the report. Raises
    ``TargetMismatchError`` (with ``strict``) listing every problem, before any read."""
    tensors, alias = _with_tied(source.tensors, mapping, targets)
    moves, report = plan_links(tensors, targets, mapping)
    report.mismatched += _fidelity.tied_head_differences(
        source, mapping, lambda keys: _read_keys(source, {}, options, keys)
    )
    if options.strict and not report.ok:
        raise TargetMismatchError(
            f"{options.where or source.path}: the checkpoint does not fit the target through this "
            "mapping:\n" + report.problems()
        )
    stats = options.stats if options.stats is not None else _read.ReadStats()
    options = dataclasses.replace(options, stats=stats)  # (counted for the report)
    read = functools.partial(_read_keys, source, alias, options)
    values: dict[str, Any] = {}
    sharded = isinstance(source, _sources.SafetensorsSource)
    for group in _links.link_batches(
        moves, lambda k: tensors[k].nbytes, options.batch_bytes, torch_side=True
    ):
        on_host = [
            not (sharded and _device_path(link, [targets[n] for n in link.flax])) for link in group
        ]
        keys = sorted({k for link, h in zip(group, on_host) if h for k in link.torch})
        arrays = dict(zip(keys, read(keys)))
        for link, host in zip(group, on_host):
            wants = [targets[n] for n in link.flax]
            if host:
                outs = link.values([arrays[k] for k in link.torch], to_torch=False)
                for name, value, want in zip(link.flax, outs, wants):
                    values[name] = _place(value, want)
            else:
                values.update(zip(link.flax, _devices_fill(link, wants, tensors, read, options)))
            report.moved += link.pairs()
        del arrays
    report.bytes_read = stats.bytes_read
    return values, report


def derived_targets(
    tensors: Mapping[str, _sources.TensorInfo], mapping: KeyMapping
) -> dict[str, Target]:
    """The targets ``tensors`` (by PyTorch key) and ``mapping`` imply: each Flax tensor a link
    makes, in the stored dtype (promoted across the link); ignored names and links that do
    not fit left out."""
    links, _ = _links.find_links(mapping, {k: t.shape for k, t in tensors.items()}, flax_side=False)
    targets: dict[str, Target] = {}
    for link in links:
        infos = [tensors[k] for k in link.torch]
        dtype = np.result_type(*(_dtypes.to_numpy(t.dtype) for t in infos))
        try:
            shapes = link.shapes([t.shape for t in infos], dtype, to_torch=False)
        except ValueError:
            continue
        for name, shape in zip(link.flax, shapes):
            if not mapping.flax_ignored(name):
                targets.setdefault(name, Target(tuple(shape), np.dtype(dtype)))
    return targets


# --------------------------------------------------------------------------- planning


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
    """The links filling ``targets`` from ``tensors``, and the report of every problem."""
    links, report = _links.find_links(
        mapping, {k: t.shape for k, t in tensors.items()}, flax_side=False
    )
    moves: list[_links.Link] = []
    claimed: dict[str, str] = {}
    for link in links:
        key = link.torch[0]
        infos = [tensors[k] for k in link.torch]
        described = f"{key} {infos[0].dtype}{list(infos[0].shape)}"
        try:  # (a transform the stored tensors contradict: a config's head_dim or vocabulary)
            dtype = _dtypes.to_numpy(infos[0].dtype)
            got, refused = link.shapes([t.shape for t in infos], dtype, to_torch=False), None
        except ValueError as e:
            got, refused = [], f"{described} -> {', '.join(link.flax)}: {e}"
        absent = [n for n in link.flax if n not in targets]
        if absent:  # (a target derived from the files leaves refused links out)
            if refused is not None:
                report.mismatched.append(refused)
            else:
                report.unexpected += [f"{key} -> {n}" for n in absent]
            continue
        taken = [n for n in link.flax if n in claimed]
        if taken:
            report.mismatched += [f"{key} and {claimed[n]} both map to {n}" for n in taken]
            continue
        claimed.update(dict.fromkeys(link.flax, key))
        want = [targets[n].shape for n in link.flax]
        if refused is not None:
            report.mismatched.append(refused)
        elif got != want:
            report.mismatched.append(
                f"{described} becomes {', '.join(str(list(g)) for g in got)} but "
                f"{', '.join(link.flax)} is {', '.join(str(list(w)) for w in want)}"
            )
        else:
            moves.append(link)
    report.missing = [n for n in targets if n not in claimed and not mapping.flax_ignored(n)]
    return moves, report


# --------------------------------------------------------------------------- shardings


# Transforms that keep every axis where it is (values scaled or shifted, rows padded or cut,
# features permuted within an axis): a partition spec passes through them unchanged.
_IN_PLACE = (Scale, Offset, VocabRows, RopeInterleave)


def _pull_spec(transform: Any, spec: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The partition spec of a tensor whose ``transform.to_flax`` has partition ``spec``, or
    None when the transform moves elements across axes (a reshape: read replicated). A split
    of heads pulls back to its heads' partition, unsharded where the head's own axis is split."""
    perm = _links.axis_permutation(transform, len(spec))  # (PyTorch axis d is Flax axis perm[d])
    if perm is not None:
        return tuple(spec[p] for p in perm)
    if isinstance(transform, _IN_PLACE):
        return spec
    if isinstance(transform, SplitHeads):
        axis = transform.axis % (len(spec) - 1)
        heads, dim = spec[axis], spec[axis + 1]
        return (*spec[:axis], heads if dim is None else None, *spec[axis + 2 :])
    if isinstance(transform, Chain):
        for t in reversed(transform.transforms):
            pulled = _pull_spec(t, spec)
            if pulled is None:
                return None
            spec = pulled
        return spec
    return None


def on_device(transform: Any) -> bool:
    """Whether ``transform`` is known to run on jax arrays under ``jit``."""
    if isinstance(transform, Chain):
        return all(on_device(t) for t in transform.transforms)
    return transform is IDENTITY or isinstance(
        transform, (Transpose, SplitHeads, Reshape, *_IN_PLACE)
    )


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


def torch_shardings(
    link: _links.Link, targets: Sequence[Target], shapes: Sequence[tuple[int, ...]]
) -> list[Any]:
    """The sharding each PyTorch tensor of ``link`` (of ``shapes``) is read with: the first
    target's partition spec without its stacked axes, pulled back through the rule's
    transform, unsharded where the PyTorch tensor stacks."""
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
        and on_device(link.rule.transform_or_identity)
    )


# --------------------------------------------------------------------------- reading


def _read_keys(
    source: Any,
    alias: Mapping[str, str],
    options: LoadOptions,
    keys: Sequence[str],
    shardings: Sequence[Any] | None = None,
) -> list[Any]:
    """``keys`` of ``source`` (a tied key read as its ``alias``), each a host numpy array or,
    with a sharding, a ``jax.Array``: ranged reads from safetensors files; any other source
    (Orbax, Flax msgpack) through ``source.read``, on the host."""
    names = [alias.get(k, k) for k in keys]
    if not isinstance(source, _sources.SafetensorsSource):
        got = source.read(sorted(set(names)))
        return [got[n] for n in names]
    requests = [
        _read.ReadRequest(
            source.stored[n],
            _read.ReadKind.NUMPY if s is None else _read.ReadKind.JAX,
            s,
            verify=options.verify,
        )
        for n, s in zip(names, shardings or [None] * len(names))
    ]
    return _read.read_tensors(requests, options.stats, options.io)


def _place(value: np.ndarray, target: Target) -> Any:
    value = np.asarray(value)
    if value.dtype != target.dtype:
        value = _casting.astype(value, target.dtype)  # jax's cast, as every restore's
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


def _devices_fill(
    link: _links.Link,
    wants: Sequence[Target],
    tensors: Mapping[str, _sources.TensorInfo],
    read: Callable[..., list[Any]],
    options: LoadOptions,
) -> list[Any]:
    # The Flax tensors of ``link``, computed on the devices from its PyTorch tensors read
    # sharded. A stacked link larger than the batch goes a band of its longest unsplit stack
    # at a time, written in place: the host holds a band's reads, not the link's.
    band = _band(link, wants, tensors, options.batch_bytes)
    if band is None:
        shapes = [tensors[k].shape for k in link.torch]
        got = read(list(link.torch), torch_shardings(link, wants, shapes))
        return list(_run_on_device(link, wants, got))
    name, axis, count, size = band
    outs = [_zeros(w.shape, w.dtype, w.sharding)() for w in wants]
    for start in range(0, count, size):
        stop = min(start + size, count)
        part = link.band(name, start, stop)
        sized = [
            dataclasses.replace(w, shape=(*w.shape[:axis], stop - start, *w.shape[axis + 1 :]))
            for w in wants
        ]
        shapes = [tensors[k].shape for k in part.torch]
        pieces = read(list(part.torch), torch_shardings(part, sized, shapes))
        got = _run_on_device(part, sized, pieces)
        outs = [_update(w.sharding, axis)(o, g, start) for w, o, g in zip(wants, outs, got)]
    return outs


def _band(
    link: _links.Link,
    wants: Sequence[Target],
    tensors: Mapping[str, _sources.TensorInfo],
    batch_bytes: int,
) -> tuple[str, int, int, int] | None:
    # (placeholder, its axis, its count, values a band) of a link to fill band by band
    total = sum(tensors[k].nbytes for k in link.torch)
    if total <= batch_bytes:
        return None
    ndim = len(wants[0].shape)
    spec = _spec(wants[0].sharding, ndim)
    stacks = [
        (count, name, axis)
        for (name, _, count), axis in zip(
            link.flax_gather.stacks, link.flax_gather.stack_axes(ndim)
        )
        if spec[axis] is None and count > 1
    ]
    if not stacks:
        return None
    count, name, axis = max(stacks)
    return name, axis, count, max(1, batch_bytes * count // total)


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> Any:
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _update(sharding: Any, axis: int) -> Any:
    # ``whole`` with ``band`` written at ``start`` along ``axis``, in place (donated)
    def update(whole: Any, band: Any, start: Any) -> Any:
        return jax.lax.dynamic_update_slice_in_dim(whole, band, start, axis)

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=256)
def _jitted(link: _links.Link, dtypes: tuple[np.dtype, ...], shardings: tuple[Any, ...]) -> Any:
    # One compiled function per anonymous link and target layout, shared by every link of
    # that layout (the layers of a model that is not scanned).
    import jax.numpy as jnp

    def apply(*xs: Any) -> tuple[Any, ...]:
        outs = link.values(list(xs), to_torch=False, xp=jnp)
        return tuple(o.astype(d) for o, d in zip(outs, dtypes))

    return jax.jit(apply, out_shardings=shardings)
