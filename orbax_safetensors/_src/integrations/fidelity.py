"""What keeps an export from changing what the model computes, silently: tied keys whose
values differ (:func:`tie_differences`, written untied with a warning: :func:`warn_untied`; on a
load, a head ignored as the embedding's copy that is none: :func:`tied_head_differences`)
and fused query/key/value splits that contradict the config's heads
(:func:`fused_config_problems`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_safetensors._src.integrations import links as _links
from orbax_safetensors._src.integrations import model_files as _model_files
from orbax_safetensors._src.integrations.config_facts import ConfigFacts
from orbax_safetensors._src.integrations.key_mapping import KeyMapping

Shape = tuple[int, ...]


# --------------------------------------------------------------------------- tied keys


def tie_differences(
    mapping: KeyMapping,
    links: Sequence[_links.Link],
    values: Callable[[Sequence[str]], Mapping[str, Any]],
) -> dict[str, tuple[str, float]]:
    """``{tied key: (the key it is tied to, largest absolute difference)}`` for each tied
    PyTorch key that ``links`` write whose value is not the other key's (``inf``: the shapes
    differ, or the export does not write the other key). ``values(names)`` gives the Flax
    tensors (numpy or ``jax.Array``, sharded too: compared on the devices)."""
    where = {k: (link, j) for link in links for j, k in enumerate(link.torch)}
    out = {}
    for key, source in mapping.tied:
        if key not in where:
            continue  # the model has no tensor of its own there: nothing to write
        if source not in where:
            out[key] = (source, math.inf)
            continue
        (link, j), (other, i) = where[key], where[source]
        got = values(sorted({*link.flax, *other.flax}))
        difference = largest_difference(
            _torch_value(link, [got[n] for n in link.flax], j),
            _torch_value(other, [got[n] for n in other.flax], i),
        )
        if difference != 0:
            out[key] = (source, difference)
    return out


# A head a tied model's files may hold, and the embeddings it would be a copy of (plain,
# transformers 4 and 5 multimodal, GPT-2)
_TIED_HEADS = {
    "lm_head.weight": (
        "model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "transformer.wte.weight",
    ),
    "language_model.lm_head.weight": (
        "language_model.model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
    ),
}


def tied_head_differences(
    source: Any, mapping: KeyMapping, read: Callable[[list[str]], Sequence[np.ndarray]]
) -> list[str]:
    """The load side of :func:`tie_differences`: a problem for each head ``mapping`` ignores
    as the embedding's copy (the config of ``source``'s directory says tied) that is no such
    copy in ``source``'s files (``read(keys)``: their values), which a load would drop
    (transformers keeps such a head too)."""
    heads = [
        (head, embedding)
        for head, embeddings in _TIED_HEADS.items()
        if head in source.tensors and mapping.torch_ignored(head)
        for embedding in [e for e in embeddings if e in source.tensors][:1]
    ]
    config = epath.Path(source.path) / _model_files.CONFIG_FILE_NAME
    if not heads or not epath.Path(source.path).is_dir() or not config.is_file():
        return []
    facts = ConfigFacts.of(config)
    key = "tie_word_embeddings"
    if not facts.flag(key, facts.language_model().flag(key)):
        return []
    problems = []
    for head, embedding in heads:
        x, y = read([head, embedding])
        difference = largest_difference(x, y)
        if difference != 0:
            how = "has another shape than" if x.shape != y.shape else "differs from"
            problems.append(
                f"{head} {list(x.shape)} {how} {embedding} {list(y.shape)}, though "
                f"{config} says tie_word_embeddings true: the mapping ignores the head as the "
                "embedding's copy, which would drop it (transformers does not tie them either); "
                "give a config with tie_word_embeddings false and a mapping of the head"
            )
    return problems


def _torch_value(link: _links.Link, arrays: list[Any], j: int) -> Any:
    if any(not isinstance(a, np.ndarray) for a in arrays):
        return _links.device_value(link, arrays, j)  # (jax.numpy: sharded arrays too)
    return link.value(arrays, j, to_torch=True)


def largest_difference(x: Any, y: Any) -> float:
    """The largest absolute difference of ``x`` and ``y``: 0.0 for equal values (NaN equal
    to NaN at the same place), inf for other shapes or a NaN against a number."""
    # Host arrays are compared a block of rows at a time, device arrays in one fused
    # reduction: no float32 copy of a whole embedding either way.
    if tuple(x.shape) != tuple(y.shape):
        return math.inf
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
        return float(np.asarray(_device_gap()(x, y)))
    if x.ndim == 0:
        return float(_gap(np, x, y))
    step = max(1, _BLOCK_BYTES // max(1, 4 * math.prod(x.shape[1:])))
    gaps = [_gap(np, x[i : i + step], y[i : i + step]) for i in range(0, x.shape[0], step)]
    return float(max(gaps, default=0.0))


_BLOCK_BYTES = 16 << 20  # (float32 bytes of a block of rows compared on the host)


def _gap(xp: Any, x: Any, y: Any) -> Any:
    a, b = x.astype(xp.float32), y.astype(xp.float32)
    same = (a == b) | (xp.isnan(a) & xp.isnan(b))
    gap = xp.where(same, 0.0, xp.abs(a - b))
    return xp.max(xp.where(xp.isnan(gap), xp.inf, gap), initial=0.0)


@functools.cache
def _device_gap() -> Any:
    # (one jitted reduction, made once: XLA fuses the casts and compares, no whole copies)
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x, y: _gap(jnp, jnp.asarray(x), jnp.asarray(y)))


def warn_untied(differences: Mapping[str, tuple[str, float]], *, with_config: bool) -> None:
    """Warns that the keys of :func:`tie_differences` are written, untied."""
    if not differences:
        return
    listed = "; ".join(
        f"{key} differs from {source} (largest difference {d:.3g})"
        if math.isfinite(d)
        else f"{key}: {source} is not exported or has another shape"
        for key, (source, d) in differences.items()
    )
    then = (
        "config.json says tie_word_embeddings: false"
        if with_config
        else "the config.json you pair them with must say tie_word_embeddings: false"
    )
    warnings.warn(
        f"the mapping ties keys whose values differ: {listed}. They are written, untied, so "
        f"that the export computes what the model does; {then}",
        UserWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- fused splits


def _probe(fn: Any, shape: Shape, dtype: Any) -> Shape:
    return tuple(int(d) for d in np.shape(fn(np.broadcast_to(np.zeros((), dtype), shape))))


def _joins_torch_parts(link: _links.Link) -> bool:
    # Whether the link's Flax tensors each join a fused rule's parts held apart in PyTorch.
    rule = link.rule
    return rule.fused is not None and rule.fused in rule.gathered_by(flax=True)


def _part_keys(link: _links.Link) -> list[str]:
    """The first PyTorch key of each fused part of ``link``, in the rule's order of parts."""
    rule = link.rule
    first: dict[str, str] = {}
    for key in link.torch:
        groups = rule.groups(key, flax=False) or {}
        part = groups.get(rule.fused or "")
        if part is not None:
            first.setdefault(part, key)
    return [first[p] for p in rule.parts if p in first]


# The rows each attention projection's PyTorch weight (out, in) and bias (out,) has, by its
# module's name: query heads, or key/value heads, times head_dim.
_QUERY = frozenset({"q_proj", "query"})
_KEY_VALUE = frozenset({"k_proj", "v_proj", "key", "value"})


def _rows(key: str, heads: int, kv: int) -> int | None:
    # the heads of the attention projection a PyTorch key names (None: not one)
    module = key.rsplit(".", 2)[-2] if "." in key else ""
    return heads if module in _QUERY else kv if module in _KEY_VALUE else None


# A nested text_config's heads are the language model's: its keys name one of these (a vision
# tower's projections have heads of their own).
_TEXT_MODULES = frozenset({"language_model", "text_model"})


def fused_config_problems(
    links: Sequence[_links.Link],
    torch_shapes: Mapping[str, Shape],
    flax_shapes: Mapping[str, Shape],
    dtype_of: Callable[[str], Any],
    facts: ConfigFacts | None,
) -> list[str]:
    """One line per rule whose fused split writes query/key/value projections of other sizes
    than the heads, key/value heads and head_dim of the config's language model make
    (``torch_shapes``: what the export writes, by key), naming the rule and the ``sizes=``
    that fits."""
    model = None if facts is None else facts.language_model()
    found = None if model is None else model.attention()
    if model is None or found is None:
        return []
    (heads, kv, head_dim), nested = found, bool(model.prefix)
    out: dict[int, str] = {}  # (by the rule's id: a user's transform need not hash)
    for link in links:
        rule = link.rule
        if not _joins_torch_parts(link) or id(rule) in out:
            continue
        wrong = []
        for key in link.torch:
            rows, shape = _rows(key, heads, kv), torch_shapes.get(key)
            if nested and _TEXT_MODULES.isdisjoint(key.split(".")):
                continue  # (not the language model's projection)
            if rows is None or not shape or shape[0] == rows * head_dim:
                continue
            wrong.append((key, shape, rows * head_dim))
        if not wrong:
            continue
        key, shape, want = wrong[0]
        name = link.flax[0]
        fix = _fitting_sizes(
            link, torch_shapes, flax_shapes[name], dtype_of(name), heads, kv, head_dim
        )
        out[id(rule)] = (
            f"rule {rule.torch!r} -> {rule.flax!r} splits {name} {list(flax_shapes[name])} into "
            f"{'sizes=' + str(rule.sizes) if rule.sizes else 'equal parts'}: {key} "
            f"{list(shape)}, but the config's {heads} heads, {kv} key/value heads of head_dim "
            f"{head_dim} make it {want} rows"
            + (f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else "")
            + (f": give sizes={fix}" if fix else "")
        )
    return list(out.values())


def _fitting_sizes(
    link: _links.Link,
    torch_shapes: Mapping[str, Shape],
    flax_shape: Shape,
    dtype: Any,
    heads: int,
    kv: int,
    head_dim: int,
) -> tuple[int, ...] | None:
    # The rule's sizes= that gives each part the config's rows, if the Flax tensor holds them.
    rule = link.rule
    fn = rule.transform_or_identity.to_flax
    sizes = []
    for key in _part_keys(link):
        rows, shape = _rows(key, heads, kv), torch_shapes.get(key)
        if rows is None or not shape:
            return None
        try:
            part = _probe(fn, (rows * head_dim, *shape[1:]), dtype)
        except ValueError:
            return None
        sizes.append(part[rule.axis % len(part)])
    layer = [flax_shape[a] for a in link.flax_gather.slot_axes(len(flax_shape))]
    if not layer or sum(sizes) != layer[rule.axis % len(layer)]:
        return None
    return tuple(sizes)
