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

from typing import Any

from etils import epath

from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.core.errors import TargetMismatchError
from orbax_safetensors._src.integrations import hf_load as _hf_load
from orbax_safetensors._src.integrations.key_mapping import KeyMapping

__all__ = ["abstract_pytorch", "load_pytorch"]


def _source_path(path: epath.PathLike) -> epath.Path:
    # A Hugging Face index file names its directory.
    path = epath.Path(path)
    if path.name.endswith(".index.json") and not path.is_dir():
        return path.parent
    return path


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
    """Loads a PyTorch/Hugging Face safetensors checkpoint into an NNX model (in place) or into
    any pytree (returned).

    Args:
      target: an NNX module, filled in place; or any pytree (dicts, Linen ``params``,
        ``nnx.State``, ``TrainState.params``) of arrays, numpy arrays or
        ``jax.ShapeDtypeStruct`` s (with shardings), named by their key paths joined with
        ``.``: a tree of the same structure comes back, each leaf of its target's dtype and
        sharding (numpy leaves stay numpy; a struct without sharding goes to the default
        device). A sharded target is read sharded: each process reads the byte ranges of
        its own shards (a reshaping rule reads the tensor whole), and the rule runs on device.
        None: the tree the checkpoint and the mapping imply (:func:`abstract_pytorch`),
        filled with ``jax.Array`` s of the stored dtypes on the default device.
      path: a ``.safetensors`` file (e.g. ``safetensors.torch.save_file(model.state_dict())``),
        a directory of them (Hugging Face style, sharded with
        ``model.safetensors.index.json`` or a single ``model.safetensors``), that index file,
        or an item this library wrote.
      mapping: how PyTorch keys become the target's names (stacked layers and fused
        projections are joined, tied keys the file lacks read the key they are tied to).
      strict: raise if any key is unmapped, unexpected, missing or mis-shaped (checked before
        anything is read); with ``strict=False``, load what fits (the rest stays as given)
        and report.
      variables: with a module, an ``nnx`` filter of the variables to fill (default
        ``(nnx.Param, nnx.BatchStat)``; RNG state is left alone).
      prefix: only target names starting with it are filled, matched without it (e.g.
        ``"params."`` for Linen's ``{"params": ...}``).
      with_report: with a pytree, return ``(tree, report)``.
      batch_bytes: tensor bytes read at a time (whole-tensor reads).

    Returns:
      With a module, a :class:`MappingReport`; with a pytree or None, the filled tree (and
      the report with ``with_report``).

    Raises:
      TargetMismatchError: with ``strict``, listing every problem at once (naming keys,
        names and shapes).

    Example::

        report = osf.load_pytorch(model, "pytorch_model.safetensors", mapping)
        params = osf.load_pytorch(abstract_params, "hf_dir", mapping, prefix="params.")
        params = osf.load_pytorch(None, "hf_dir", mapping)   # {"layers": {"mlp": ...}}
    """
    from flax import nnx

    source = _sources.open_source(_source_path(path))
    options = _hf_load.LoadOptions(strict=strict, batch_bytes=batch_bytes, where=str(path))
    if target is None:  # the tree the directory and the mapping imply
        targets = _hf_load.derived_targets(source.tensors, mapping)
        values, report = _hf_load.load_flat(source, targets, mapping, options)
        tree = _hf_load.nested({prefix + n: v for n, v in values.items()})
        return (tree, report) if with_report else tree
    module = target if isinstance(target, nnx.Module) else None
    if module is not None:
        filt = (nnx.Param, nnx.BatchStat) if variables is None else variables
        target = nnx.state(module, filt)
    tree, report = _hf_load.load_tree(target, source, mapping, options, prefix=prefix)
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
    """The abstract tree that a PyTorch/Hugging Face checkpoint and a mapping imply: what
    ``load_pytorch(None, path, mapping)`` fills, from the files' headers alone (no tensor is
    read). Give its leaves shardings and pass it to :func:`load_pytorch` to read the
    checkpoint sharded.

    Every Flax tensor the mapping's rules make of the checkpoint's tensors (stacked and fused
    ones joined) is a ``jax.ShapeDtypeStruct`` of the shape the rule gives and the stored
    dtype, in nested dicts of its dotted name (with ``prefix`` in front): ``{"layers": {0:
    {"mlp": ...}}}``; the keys of a dict whose keys are all decimal numbers are ``int`` s, as
    ``nnx.state`` keys a list's items, so ``nnx.update(model, tree)`` takes a filled tree.

    Args:
      path: as :func:`load_pytorch` takes it.
      mapping: the rules, as :func:`load_pytorch` takes them.
      strict: raise if a key is unmapped or a stack or fused group is incomplete or does not
        fit; with ``strict=False`` leave them out and report.
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
    import jax

    source = _sources.open_source(_source_path(path))
    targets = _hf_load.derived_targets(source.tensors, mapping)
    _, report = _hf_load.plan_links(dict(source.tensors), targets, mapping)
    if strict and not report.ok:
        raise TargetMismatchError(
            f"{path}: the checkpoint does not fit this mapping\n" + report.problems()
        )
    tree = _hf_load.nested(
        {prefix + n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in targets.items()}
    )
    return (tree, report) if with_report else tree
