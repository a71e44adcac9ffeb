"""PyTorch / Hugging Face checkpoints into Flax NNX models and back, through one declarative
key mapping.

A :class:`KeyMapping` is a list of :class:`Rule` s. Each rule pairs a PyTorch key pattern with
a Flax name pattern and an optional :class:`Transform` (what to do to the tensor on the way):

- patterns are literal dotted names with placeholders: ``{i}`` matches one name component
  (``[^.]+``), ``{i:REGEX}`` matches ``REGEX``; both sides use the same placeholders, so every
  rule works in both directions;
- transforms have a ``to_flax`` and a ``to_torch`` side: :class:`Transpose` (``nn.Linear``
  weight ``(out, in)`` -> Flax kernel ``(in, out)``), :class:`SplitHeads` (``(heads * dim)``
  -> ``(heads, dim)`` for attention projections), :class:`Reshape` and :class:`Chain`.

The first rule that matches a key wins. :func:`load_pytorch` reads a ``state_dict`` saved with
``safetensors.torch.save_file`` (or a Hugging Face directory, sharded with
``model.safetensors.index.json`` or not) into an NNX model; :func:`export_pytorch` writes a
model (or a checkpoint) as a Hugging Face style directory that ``safetensors.torch.load_file``
and ``huggingface_hub.load_torch_model`` read. Both report every key that no rule maps, every model variable left
without a value and every shape that does not fit, all at once.

Example::

    mapping = osf.KeyMapping([
        osf.Rule("embed.weight", "embed.embedding"),
        *osf.Rule.linear("layers.{i}.attn.q_proj", "layers.{i}.attn.query", heads=4),
        *osf.Rule.layer_norm("layers.{i}.norm", "layers.{i}.norm"),
    ], ignore_torch=[r".*\\.num_batches_tracked"])
    osf.load_pytorch(model, "torch_model.safetensors", mapping)
    osf.export_pytorch(model, "/tmp/hf_export", mapping)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core import astype as _astype
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.storage import interface as _interface
from orbax_safetensors._src.storage import replace as _replace
from orbax_safetensors._src.storage import router as _router

_PLACEHOLDER = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


# --------------------------------------------------------------------------- transforms


class Transform(Protocol):
    """A reversible tensor transform: ``to_flax(to_torch(x))`` gives ``x`` back."""

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        """The PyTorch tensor ``x`` as the Flax variable wants it."""
        ...

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        """The Flax value ``x`` as PyTorch stores it."""
        ...


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Permutes axes: ``Transpose()`` reverses them (``nn.Linear`` weight ``(out, in)`` ->
    kernel ``(in, out)``); ``Transpose((2, 3, 1, 0))`` turns a ``Conv2d`` weight
    ``(out, in, kh, kw)`` into an NNX ``Conv`` kernel ``(kh, kw, in, out)``."""

    axes: tuple[int, ...] | None = None

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.axes)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        if self.axes is None:
            return np.transpose(x)
        return np.transpose(x, np.argsort(self.axes))


@dataclasses.dataclass(frozen=True)
class SplitHeads:
    """Splits axis ``axis`` of size ``heads * dim`` into ``(heads, dim)`` (and merges it back
    for PyTorch), as NNX ``MultiHeadAttention`` stores its projections: query/key/value kernels
    ``(features, heads, dim)`` and biases ``(heads, dim)``, the output kernel
    ``(heads, dim, features)``."""

    heads: int
    axis: int = -1

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % x.ndim
        size = x.shape[axis]
        if size % self.heads:
            raise ValueError(f"axis {axis} of size {size} does not split into {self.heads} heads")
        return x.reshape(*x.shape[:axis], self.heads, size // self.heads, *x.shape[axis + 1 :])

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % (x.ndim - 1)
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Reshapes between two fixed shapes (``-1`` allowed on either side)."""

    flax_shape: tuple[int, ...]
    torch_shape: tuple[int, ...]

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.flax_shape)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.torch_shape)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Several transforms: applied in order towards Flax, in reverse order towards PyTorch."""

    transforms: tuple[Any, ...]

    def __init__(self, *transforms: Transform) -> None:
        object.__setattr__(self, "transforms", tuple(transforms))

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        for t in self.transforms:
            x = t.to_flax(x)
        return x

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        for t in reversed(self.transforms):
            x = t.to_torch(x)
        return x


@dataclasses.dataclass(frozen=True)
class _Identity:
    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return x


IDENTITY = _Identity()


# --------------------------------------------------------------------------- rules


@functools.lru_cache(maxsize=4096)
def _compile(pattern: str) -> tuple[re.Pattern[str], list[str]]:
    parts: list[str] = []
    names: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(pattern):
        parts.append(re.escape(pattern[pos : m.start()]))
        name, regex = m.group(1), m.group(2) or r"[^.]+"
        if name in names:
            parts.append(f"(?P={name})")
        else:
            parts.append(f"(?P<{name}>{regex})")
            names.append(name)
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts)), names


def _fill(pattern: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], pattern)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rename rule: a PyTorch key pattern, a Flax name pattern and a transform.

    Attributes:
      torch: e.g. ``"layers.{i}.mlp.fc1.weight"``.
      flax: e.g. ``"layers.{i}.mlp.fc1.kernel"`` (the same placeholders).
      transform: applied to the tensor (default: none).

    Example::

        Rule("layers.{i}.fc.weight", "blocks.{i}.dense.kernel", Transpose())
        Rule("h.{i:\\d+}.ln.weight", "h.{i}.ln.scale")     # a placeholder with its own regex
    """

    torch: str
    flax: str
    transform: Any = None

    def __post_init__(self) -> None:
        (_, torch_names), (_, flax_names) = _compile(self.torch), _compile(self.flax)
        if set(torch_names) != set(flax_names):
            raise ValueError(
                f"rule {self.torch!r} -> {self.flax!r}: both sides need the same placeholders "
                f"(torch has {sorted(torch_names)}, flax has {sorted(flax_names)})"
            )

    def match_torch(self, key: str) -> str | None:
        """The Flax name for PyTorch ``key``, or None if the rule does not apply."""
        m = _compile(self.torch)[0].fullmatch(key)
        return None if m is None else _fill(self.flax, m.groupdict())

    def match_flax(self, name: str) -> str | None:
        """The PyTorch key for Flax ``name``, or None if the rule does not apply."""
        m = _compile(self.flax)[0].fullmatch(name)
        return None if m is None else _fill(self.torch, m.groupdict())

    @property
    def transform_or_identity(self) -> Transform:
        return self.transform if self.transform is not None else IDENTITY

    # ---- rules for common layers

    @staticmethod
    def linear(
        torch: str, flax: str, *, heads: int | None = None, heads_on: str = "output"
    ) -> list[Rule]:
        """``nn.Linear`` ``{torch}.weight/bias`` -> NNX ``{flax}.kernel/bias``.

        With ``heads``, the head split of NNX ``MultiHeadAttention``: ``heads_on="output"`` for
        the query/key/value projections (kernel ``(in, heads, dim)``, bias ``(heads, dim)``),
        ``"input"`` for the output projection (kernel ``(heads, dim, out)``).
        """
        if heads is None:
            return [
                Rule(f"{torch}.weight", f"{flax}.kernel", Transpose()),
                Rule(f"{torch}.bias", f"{flax}.bias"),
            ]
        if heads_on == "output":
            return [
                Rule(
                    f"{torch}.weight", f"{flax}.kernel", Chain(Transpose(), SplitHeads(heads, -1))
                ),
                Rule(f"{torch}.bias", f"{flax}.bias", SplitHeads(heads, 0)),
            ]
        if heads_on == "input":
            return [
                Rule(f"{torch}.weight", f"{flax}.kernel", Chain(Transpose(), SplitHeads(heads, 0))),
                Rule(f"{torch}.bias", f"{flax}.bias"),
            ]
        raise ValueError(f"heads_on must be 'output' or 'input', not {heads_on!r}")

    @staticmethod
    def layer_norm(torch: str, flax: str) -> list[Rule]:
        """``nn.LayerNorm`` ``weight/bias`` -> NNX ``LayerNorm`` ``scale/bias``."""
        return [Rule(f"{torch}.weight", f"{flax}.scale"), Rule(f"{torch}.bias", f"{flax}.bias")]

    @staticmethod
    def embedding(torch: str, flax: str) -> list[Rule]:
        """``nn.Embedding`` ``weight`` -> NNX ``Embed`` ``embedding``."""
        return [Rule(f"{torch}.weight", f"{flax}.embedding")]


@dataclasses.dataclass(frozen=True)
class KeyMapping:
    """An ordered list of rules plus keys deliberately left out.

    Attributes:
      rules: tried in order; the first match wins.
      ignore_torch: regexes (full match) of PyTorch keys that are not loaded and not reported,
        e.g. ``r".*\\.num_batches_tracked"``.
      ignore_flax: regexes of Flax names that are neither loaded nor exported.
    """

    rules: tuple[Rule, ...]
    ignore_torch: tuple[str, ...] = ()
    ignore_flax: tuple[str, ...] = ()

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        ignore_torch: Iterable[str] = (),
        ignore_flax: Iterable[str] = (),
    ) -> None:
        object.__setattr__(self, "rules", tuple(rules))
        object.__setattr__(self, "ignore_torch", tuple(ignore_torch))
        object.__setattr__(self, "ignore_flax", tuple(ignore_flax))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise TypeError(f"KeyMapping takes Rule objects, got {r!r}")

    def torch_ignored(self, key: str) -> bool:
        return any(re.fullmatch(p, key) for p in self.ignore_torch)

    def flax_ignored(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignore_flax)

    def to_flax(self, key: str) -> tuple[str, Transform] | None:
        """``(flax name, transform)`` for a PyTorch key, or None when no rule matches."""
        for rule in self.rules:
            name = rule.match_torch(key)
            if name is not None:
                return name, rule.transform_or_identity
        return None

    def to_torch(self, name: str) -> tuple[str, Transform] | None:
        """``(PyTorch key, transform)`` for a Flax name, or None when no rule matches."""
        for rule in self.rules:
            key = rule.match_flax(name)
            if key is not None:
                return key, rule.transform_or_identity
        return None


# --------------------------------------------------------------------------- reports


@dataclasses.dataclass
class MappingReport:
    """What a load or export moved, and what it could not.

    Attributes:
      moved: ``(source key, destination key)`` pairs written.
      unmapped: source keys that no rule maps (PyTorch keys on load, Flax names on export).
      unexpected: ``"source -> destination"`` where the destination does not exist in the
        model (load only).
      missing: model variables that received no value (load only).
      mismatched: shape problems, each naming both keys and both shapes.
      ignored: keys skipped on purpose (``ignore_torch``/``ignore_flax``).
    """

    moved: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unmapped: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every key was mapped and every model variable received a value."""
        return not (self.unmapped or self.unexpected or self.missing or self.mismatched)

    def problems(self) -> str:
        """One readable block listing every problem (empty when :attr:`ok`)."""
        lines = []
        for title, keys in (
            ("no rule maps these keys", self.unmapped),
            ("mapped to names the model does not have", self.unexpected),
            ("model variables nothing maps to", self.missing),
            ("shapes that do not fit", self.mismatched),
        ):
            if keys:
                lines.append(f"{title} ({len(keys)}):")
                lines += [f"  {k}" for k in keys]
        return "\n".join(lines)


# --------------------------------------------------------------------------- models


def _variable_filter(variables: Any) -> Any:
    from flax import nnx

    if variables is None:
        return (nnx.Param, nnx.BatchStat)
    return variables


def _model_variables(model: Any, variables: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """``{dotted name: (path, Variable)}`` of the model's variables selected by ``variables``."""
    from flax import nnx

    state = nnx.state(model, _variable_filter(variables))
    return {".".join(str(k) for k in path): (path, var) for path, var in nnx.to_flat_state(state)}


def _shape_after(
    transform: Transform, shape: tuple[int, ...], dtype: Any, to_flax: bool
) -> tuple[int, ...]:
    probe = np.broadcast_to(np.zeros((), dtype), shape)  # no memory: zero strides
    out = transform.to_flax(probe) if to_flax else transform.to_torch(probe)
    return tuple(int(d) for d in out.shape)


def load_pytorch(
    model: Any,
    path: epath.PathLike,
    mapping: KeyMapping,
    *,
    strict: bool = True,
    variables: Any = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Loads a PyTorch/Hugging Face safetensors checkpoint into an NNX model, in place.

    Args:
      model: the NNX module to fill (its variables keep their dtype and sharding; values are
        cast to the variable's dtype).
      path: a ``.safetensors`` file (e.g. ``safetensors.torch.save_file(model.state_dict())``)
        or a directory of them (Hugging Face style, sharded with
        ``model.safetensors.index.json`` or a single ``model.safetensors``).
      mapping: how PyTorch keys become the model's variable names.
      strict: raise if any key is unmapped, unexpected, missing or mis-shaped (checked before
        anything is loaded); with ``strict=False``, load what fits and return the report.
      variables: an ``nnx`` filter of the variables to fill (default ``(nnx.Param,
        nnx.BatchStat)``; RNG state is left alone).
      batch_bytes: tensor bytes read at a time.

    Returns:
      A :class:`MappingReport`.

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once.

    Example::

        report = osf.load_pytorch(model, "pytorch_model.safetensors", mapping)
        assert report.ok
    """
    import jax
    from flax import nnx

    source = _sources.open_source(path)
    model_vars = _model_variables(model, variables)
    report = MappingReport()
    moves: list[tuple[str, str, Transform]] = []
    claimed: dict[str, str] = {}
    for key, info in source.tensors.items():
        if mapping.torch_ignored(key):
            report.ignored.append(key)
            continue
        target = mapping.to_flax(key)
        if target is None:
            report.unmapped.append(key)
            continue
        name, transform = target
        if name not in model_vars:
            report.unexpected.append(f"{key} -> {name}")
            continue
        if name in claimed:
            report.mismatched.append(f"{key} and {claimed[name]} both map to {name}")
            continue
        claimed[name] = key
        var = model_vars[name][1]
        want = tuple(var.get_value().shape)
        try:
            got = _shape_after(transform, info.shape, _dtypes.to_numpy(info.dtype), True)
        except ValueError as e:
            report.mismatched.append(f"{key} {info.dtype}{list(info.shape)} -> {name}: {e}")
            continue
        if got != want:
            report.mismatched.append(
                f"{key} {info.dtype}{list(info.shape)} becomes {list(got)} but {name} is {list(want)}"
            )
            continue
        moves.append((key, name, transform))
    report.missing = [n for n in model_vars if n not in claimed and not mapping.flax_ignored(n)]
    if strict and not report.ok:
        raise TargetMismatchError(
            f"{path}: the checkpoint does not fit the model through this mapping\n"
            + report.problems()
        )
    updates = []
    by_key = {key: (name, transform) for key, name, transform in moves}
    for group in _sources.batches([source.tensors[k] for k, _, _ in moves], batch_bytes):
        arrays = source.read([t.name for t in group])
        for t in group:
            name, transform = by_key[t.name]
            path_, var = model_vars[name]
            current = var.get_value()
            value = np.asarray(transform.to_flax(arrays.pop(t.name))).astype(current.dtype)
            sharding = getattr(current, "sharding", None)
            placed = (
                jax.device_put(value, sharding)
                if sharding is not None
                else jax.numpy.asarray(value)
            )
            updates.append((path_, var.replace(placed)))
            report.moved.append((t.name, name))
    if updates:
        nnx.update(model, nnx.from_flat_state(updates))
    return report


# --------------------------------------------------------------------------- export


def _flax_source(
    source: Any, prefix: str, variables: Any
) -> tuple[dict[str, _sources.TensorInfo], Any]:
    """(tensor table, read function) for an NNX model or a checkpoint path."""
    from flax import nnx

    if isinstance(source, nnx.Module):
        model_vars = _model_variables(source, variables)
        values = {n: v.get_value() for n, (_, v) in model_vars.items()}
        infos = {}
        for n, x in values.items():
            dtype = _dtypes.from_numpy(x.dtype, key=n)
            shape = tuple(int(d) for d in x.shape)
            infos[n] = _sources.TensorInfo(n, dtype, shape, _dtypes.nbytes(dtype, shape), "(model)")

        def read_model(names: Sequence[str]) -> dict[str, np.ndarray]:
            return {n: np.asarray(values[n]) for n in names}

        return infos, read_model
    src = _sources.open_source(source)
    infos = {
        n[len(prefix) :]: dataclasses.replace(t, name=n[len(prefix) :])
        for n, t in src.tensors.items()
        if n.startswith(prefix)
    }

    def read_checkpoint(names: Sequence[str]) -> dict[str, np.ndarray]:
        got = src.read([prefix + n for n in names])
        return {n: got[prefix + n] for n in names}

    return infos, read_checkpoint


def export_pytorch(
    source: Any,
    directory: epath.PathLike,
    mapping: KeyMapping,
    *,
    prefix: str = "",
    dtype: Any = None,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    strict: bool = True,
    variables: Any = None,
    batch_bytes: int = _sources.DEFAULT_BATCH_BYTES,
) -> MappingReport:
    """Writes an NNX model (or a checkpoint) as a Hugging Face style safetensors directory.

    The directory gets ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` above ``max_file_size``), with header metadata
    ``{"format": "pt"}``, ready for ``safetensors.torch.load_file`` / ``load_state_dict`` or
    ``huggingface_hub.load_torch_model`` (the layout ``transformers`` loads from). Other files in the directory (``config.json``...)
    are kept; earlier ``model*.safetensors`` files and index are replaced.

    Args:
      source: an ``nnx.Module``, or a checkpoint path (file, item directory, Orbax item)
        whose tensor names are the model's variable names after ``prefix``.
      directory: where to write.
      mapping: the same mapping :func:`load_pytorch` uses, applied in reverse.
      prefix: with a checkpoint path, only names starting with it are exported (e.g.
        ``"model."`` for a ``{"model": ..., "optimizer": ...}`` checkpoint), without it.
      dtype: cast every tensor to this dtype (e.g. ``jnp.bfloat16``); default: keep.
      max_file_size: split into shards above this many bytes (None: one file).
      strict: raise if a Flax name has no rule; with ``strict=False`` skip it and report.
      variables: with a model, the ``nnx`` filter of variables to export (default
        ``(nnx.Param, nnx.BatchStat)``).
      batch_bytes: tensor bytes held in memory at a time (checkpoint sources).

    Returns:
      A :class:`MappingReport` (``moved`` pairs are ``(flax name, torch key)``).

    Example::

        osf.export_pytorch(model, "/tmp/hf", mapping)
        torch_model.load_state_dict(safetensors.torch.load_file("/tmp/hf/model.safetensors"))
    """
    directory = epath.Path(directory)
    infos, read = _flax_source(source, prefix, variables)
    report = MappingReport()
    moves: list[tuple[str, str, Transform]] = []
    taken: dict[str, str] = {}
    specs = []
    out_dtype = None if dtype is None else np.dtype(dtype)
    for name, info in infos.items():
        if mapping.flax_ignored(name):
            report.ignored.append(name)
            continue
        target = mapping.to_torch(name)
        if target is None:
            report.unmapped.append(name)
            continue
        key, transform = target
        if key in taken:
            report.mismatched.append(f"{name} and {taken[key]} both map to {key}")
            continue
        taken[key] = name
        try:
            shape = _shape_after(transform, info.shape, _dtypes.to_numpy(info.dtype), False)
        except ValueError as e:
            report.mismatched.append(f"{name} {info.dtype}{list(info.shape)} -> {key}: {e}")
            continue
        st_dtype = info.dtype if out_dtype is None else _dtypes.from_numpy(out_dtype, key=name)
        specs.append(_plan.TensorSpec(key, st_dtype, shape))
        moves.append((name, key, transform))
    if strict and not report.ok:
        raise TargetMismatchError(
            f"cannot export to {directory} through this mapping\n" + report.problems()
        )
    # Earlier model files and index are replaced whole, other files kept (storage/replace.py).
    with _replace.replacing_directory(directory) as out:
        plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata={"format": "pt"})
        local = _router.is_local(out)
        by_name = {name: (key, transform) for name, key, transform in moves}
        groups = _sources.batches(
            [infos[n] for n, _, _ in moves], batch_bytes if local else 1 << 62
        ) or [[]]
        for i, group in enumerate(groups):
            arrays = read([t.name for t in group])
            pieces: dict[int, list[_interface.Piece]] = {}
            if i == 0:
                for f, file_plan in enumerate(plan.files):
                    pieces[f] = [_interface.header_piece(file_plan.header)]
            for t in group:
                key, transform = by_name[t.name]
                value = np.asarray(transform.to_torch(arrays.pop(t.name)))
                if out_dtype is not None:
                    value = _astype.astype(value, out_dtype)
                file_plan, entry = plan.locate(key)
                raw = _dtypes.pack(np.ascontiguousarray(value), entry.dtype)
                pieces.setdefault(plan.file_of[key], []).append(
                    _interface.Piece(file_plan.data_start + entry.begin, raw)
                )
                report.moved.append((t.name, key))
            last = i == len(groups) - 1
            for f, file_plan in enumerate(plan.files):
                if f in pieces or last:
                    _router.write_file(
                        out / file_plan.filename,
                        pieces.get(f, []),
                        size=file_plan.size,
                        checksums=False,
                        sync=last,
                    )
        if len(plan.files) > 1:
            (out / _plan.INDEX_FILE_NAME).write_text(json.dumps(plan.index_json(), indent=2))
    return report
