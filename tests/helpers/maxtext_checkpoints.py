"""MaxText-layout train states, saved the ways MaxText saves them (a test helper: tests,
multi-process workers and benchmarks import it).

What MaxText's checkpoints hold (checked in ``maxtext==0.2.5``: ``common/checkpointing.py``,
``common/train_state_nnx.py``, ``checkpoint_conversion/utils/param_mapping.py``):

- the item ``items`` of a step is a Flax train state: ``step`` (int32), ``params`` =
  ``{"params": {"decoder": ..., "token_embedder": ...}}`` and ``opt_state`` (optax's
  ``adamw`` state: ``mu`` / ``nu`` carry the parameters' names, ``count`` is a counter);
- decoder layers are scanned on axis 1 (``param_scan_axis``): a ``(E, H, D)`` query kernel
  is stored ``(E, L, H, D)``, a norm scale ``(E,)`` as ``(E, L)``;
- 0.2.5 saves through Orbax v1: ``ocp.training.Checkpointer.save_checkpointables(step,
  {"items": state}, custom_metadata={"scan_layers": ...})`` with OCDBT and zarr3 on its
  context; earlier releases through a v0 ``CheckpointManager`` item ``items``
  (``PyTreeSave``, ``PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)``);
- a multi-host job shards the weights over its devices on their ``embed`` axis (FSDP), so
  Orbax stores each array in chunks of one device's shard: :func:`embed_axis` says which axis.

Example::

    dims = Dims()
    state = train_state(llama_params(dims))
    step_dir = save_v1(tmp_path / "ckpt", 7, state)      # tmp_path/ckpt/7, item "items"
    save_v0(tmp_path / "v0", 7, state, how="standard")
    # on every process of a multi-process job, the same state sharded as MaxText shards it:
    save_v1(root, 7, shard_state(state))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

ITEM = "items"  # the item (v1: checkpointable) MaxText saves its train state under
NO_V1_TRAINING = "needs orbax.checkpoint.v1.training.Checkpointer.save_checkpointables"


@dataclasses.dataclass(frozen=True)
class Dims:
    """A llama-like decoder's sizes (MaxText's names: ``emb_dim``, ``mlp_dim``...)."""

    layers: int = 2
    embed: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    mlp: int = 64
    vocab: int = 96


def llama_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """The shapes of a MaxText llama's parameters by dotted name under ``params.params``
    (``decoder.layers.*`` scanned on axis 1; untied ``logits_dense`` head)."""
    L, E = d.layers, d.embed
    layer = "decoder.layers."
    return {
        "token_embedder.embedding": (d.vocab, E),
        layer + "self_attention.query.kernel": (E, L, d.heads, d.head_dim),
        layer + "self_attention.key.kernel": (E, L, d.kv_heads, d.head_dim),
        layer + "self_attention.value.kernel": (E, L, d.kv_heads, d.head_dim),
        layer + "self_attention.out.kernel": (d.heads, L, d.head_dim, E),
        layer + "mlp.wi_0.kernel": (E, L, d.mlp),
        layer + "mlp.wi_1.kernel": (E, L, d.mlp),
        layer + "mlp.wo.kernel": (d.mlp, L, E),
        layer + "pre_self_attention_layer_norm.scale": (E, L),
        layer + "post_self_attention_layer_norm.scale": (E, L),
        "decoder.decoder_norm.scale": (E,),
        "decoder.logits_dense.kernel": (E, d.vocab),
    }


# The logical axes MaxText gives each parameter (layers at axis 1 once scanned); ``embed``
# is the one FSDP shards.
_AXES = {
    "token_embedder.embedding": ("vocab", "embed"),
    "self_attention.query.kernel": ("embed", "layers", "q_heads", "kv"),
    "self_attention.key.kernel": ("embed", "layers", "kv_heads", "kv"),
    "self_attention.value.kernel": ("embed", "layers", "kv_heads", "kv"),
    "self_attention.out.kernel": ("heads", "layers", "kv", "embed"),
    "mlp.wi_0.kernel": ("embed", "layers", "mlp"),
    "mlp.wi_1.kernel": ("embed", "layers", "mlp"),
    "mlp.wo.kernel": ("mlp", "layers", "embed"),
    "layer_norm.scale": ("norm", "layers"),
    "decoder_norm.scale": ("norm",),
    "logits_dense.kernel": ("embed", "vocab"),
}


def embed_axis(name: str) -> int | None:
    """The axis of parameter ``name`` (any dotted name ending in a MaxText parameter's,
    e.g. ``opt_state.0.mu.params.decoder.layers.mlp.wo.kernel``) that MaxText's FSDP shards
    (``embed``); None for norms (replicated)."""
    for suffix, axes in _AXES.items():
        if name.endswith(suffix):
            return axes.index("embed") if "embed" in axes else None
    raise KeyError(f"{name}: not a MaxText llama parameter")


def llama_params(d: Dims, *, seed: int = 0, dtype: Any = np.float32) -> dict[str, Any]:
    """``{"decoder": ..., "token_embedder": ...}``: numpy values of :func:`llama_shapes`,
    deterministic in ``seed`` (norm scales near 1, kernels small)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in llama_shapes(d).items():
        if name.endswith("scale"):
            value = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
        else:
            value = 0.05 * rng.standard_normal(shape, np.float32)
        flat[name] = value.astype(dtype)
    return unflatten(flat)


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """A nested dict from ``{dotted name: value}``."""
    from flax import traverse_util

    return dict(traverse_util.unflatten_dict(flat, sep="."))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted name: leaf}`` of nested dicts, lists and tuples (Orbax's names)."""
    if isinstance(tree, dict):
        items = list(tree.items())
    elif isinstance(tree, (list, tuple)):
        items = list(enumerate(tree))
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def train_state(params: dict[str, Any], *, step: int = 7) -> dict[str, Any]:
    """MaxText's train state around ``params`` (``{"decoder": ..., "token_embedder": ...}``):
    ``{"step", "params": {"params": params}, "opt_state"}``, the optimizer state optax's
    ``adamw`` (MaxText's default) after one update, as plain containers (what Orbax stores:
    ``opt_state.0.mu.params.decoder...``, ``opt_state.0.count``)."""
    import jax
    import jax.numpy as jnp
    import optax

    wrapped = {"params": params}
    tx = optax.adamw(optax.linear_schedule(1e-3, 0.0, 100), weight_decay=0.1)

    @jax.jit  # one compilation per tree, not one per operation and leaf shape
    def one_update(p: Any) -> Any:
        grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), p)
        return tx.update(grads, tx.init(p), p)[1]

    opt_state = one_update(jax.tree.map(jnp.asarray, wrapped))
    plain = jax.tree.map(np.asarray, _containers(opt_state))
    return {"step": np.asarray(step, np.int32), "params": wrapped, "opt_state": plain}


def _containers(node: Any) -> Any:
    # optax's NamedTuple states as Orbax saves them: dicts of their fields, in tuples.
    if hasattr(node, "_fields"):
        return {f: _containers(getattr(node, f)) for f in node._fields}
    if isinstance(node, (list, tuple)):
        return [_containers(v) for v in node]
    if isinstance(node, dict):
        return {k: _containers(v) for k, v in node.items()}
    return node


def parameters(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{dotted name: value}`` of the parameters of a train state, named from its top
    (``params.params.decoder...``): what an export of the checkpoint takes."""
    return {n: np.asarray(v) for n, v in flatten(state).items() if n.startswith("params.params.")}


def shard_state(
    state: dict[str, Any], fsdp: int | None = None, *, layers: bool = False
) -> dict[str, Any]:
    """``state`` as global ``jax.Array`` s sharded as MaxText shards a train state over every
    device of the job, a ``("data", "fsdp")`` mesh of ``fsdp`` devices (default: all) per
    data-parallel replica: each parameter (and its ``mu`` / ``nu``) split over ``fsdp`` on
    its ``embed`` axis where ``fsdp`` divides it, else replicated; counters replicated. With
    ``layers``, a scanned decoder tensor is split on its layers axis instead (MaxText's
    logical rule ``["layers", "stage"]``, a ``stage`` mesh axis of ``fsdp`` devices) where
    ``fsdp`` divides it: Orbax then stores it in chunks of whole layers. Every process of a
    job calls it with the same numpy ``state``."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    fsdp = len(devices) if fsdp is None else fsdp
    mesh = Mesh(np.array(devices).reshape(-1, fsdp), ("data", "fsdp"))

    def put(name: str, value: Any) -> Any:
        value = np.asarray(value)
        axis = None if value.ndim == 0 or name.endswith("count") else _embed_axis_or_none(name)
        if layers and value.ndim and ".decoder.layers." in f".{name}":
            axis = layers_axis(name)
        if axis is not None and value.shape[axis] % fsdp:
            axis = None
        spec = PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "fsdp")
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])

    flat = {n: put(n, v) for n, v in flatten(state).items()}
    return _rebuild(state, flat)


def layers_axis(name: str) -> int | None:
    """The layers axis of a scanned parameter ``name`` (as :func:`embed_axis` takes it), or
    None for one that is not scanned."""
    for suffix, axes in _AXES.items():
        if name.endswith(suffix):
            return axes.index("layers") if "layers" in axes else None
    raise KeyError(f"{name}: not a MaxText llama parameter")


def _embed_axis_or_none(name: str) -> int | None:
    try:
        return embed_axis(name)
    except KeyError:
        return None


def _rebuild(template: Any, flat: dict[str, Any], prefix: str = "") -> Any:
    if isinstance(template, dict):
        return {
            k: _rebuild(v, flat, f"{prefix}.{k}" if prefix else str(k)) for k, v in template.items()
        }
    if isinstance(template, (list, tuple)):
        return [
            _rebuild(v, flat, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(template)
        ]
    return flat[prefix]


def has_v1_training() -> bool:
    """Whether the installed Orbax has ``ocp.v1.training.Checkpointer.save_checkpointables``
    (orbax-checkpoint 0.11.11 has no ``training``)."""
    try:
        from orbax.checkpoint import v1
    except ImportError:
        return False
    checkpointer = getattr(getattr(v1, "training", None), "Checkpointer", None)
    return hasattr(checkpointer, "save_checkpointables")


def can_import() -> bool:
    """Whether ``osf.import_pytorch`` runs here: ``v1.training`` (:func:`has_v1_training`)
    and the v1 API the library needs beside it (0.11.40 has ``training`` but not
    ``ocp.v1.save``, and the import refuses it, naming the version)."""
    from orbax_safetensors._src.compat import orbaxcompat

    return has_v1_training() and orbaxcompat.has_orbax_v1()


NO_IMPORT = "osf.import_pytorch needs orbax-checkpoint >= 0.12.8 (ocp.v1.save, v1.training)"


def save_v1(
    root: Path | str,
    step: int,
    state: dict[str, Any],
    *,
    scan_layers: bool = True,
    chunk_bytes: int | None = None,
) -> Path:
    """Saves ``state`` as MaxText 0.2.5 does (``ocp.training.Checkpointer`` with OCDBT and
    zarr3, ``save_checkpointables(step, {"items": state}, custom_metadata={"scan_layers":
    ...})``); returns the step directory. ``chunk_bytes``: MaxText's
    ``checkpoint_storage_target_data_file_size_bytes``, Orbax's ``chunk_byte_size`` (each
    device's shard stored in chunks of at most that many bytes, cut along its sharded axes
    first). Every process of a job calls it."""
    from orbax.checkpoint import v1

    # (the keyword form: orbax-checkpoint 0.11.40's Context has no ``.array`` to set)
    Saving = v1.options.ArrayOptions.Saving
    storage = (
        {}
        if chunk_bytes is None
        else {"storage_options": Saving.StorageOptions(chunk_byte_size=chunk_bytes)}
    )
    saving = Saving(use_ocdbt=True, use_zarr3=True, **storage)
    context = v1.Context(array_options=v1.options.ArrayOptions(saving=saving))
    checkpointer = v1.training.Checkpointer(Path(root), context=context)
    try:
        checkpointer.save_checkpointables(
            step, {ITEM: state}, custom_metadata={"scan_layers": scan_layers}
        )
        checkpointer.wait()
    finally:
        checkpointer.close()
    return Path(root) / str(step)


def save_v0(
    root: Path | str,
    step: int,
    state: dict[str, Any],
    *,
    how: str = "pytree",
    chunk_bytes: int | None = None,
) -> Path:
    """Saves ``state`` as MaxText releases before Orbax v1 did: a v0 ``CheckpointManager``
    item ``items`` written by ``PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)``
    (``how="pytree"``: ``PyTreeSave``, with ``chunk_bytes`` as each leaf's
    ``SaveArgs(chunk_byte_size=...)``, see :func:`save_v1`) or by ``StandardSave``
    (``how="standard"``); returns the step directory. Every process of a job calls it."""
    import jax
    import orbax.checkpoint as ocp

    if how == "pytree":
        handler: Any = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
        save_args = None
        if chunk_bytes is not None:
            save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_bytes), state)
        args: Any = ocp.args.PyTreeSave(state, save_args=save_args)
    elif how == "standard":
        handler = ocp.StandardCheckpointHandler()
        args = ocp.args.StandardSave(state)
    else:
        raise ValueError(f"how={how!r}: 'pytree' or 'standard'")
    if chunk_bytes is not None and how != "pytree":
        raise ValueError("chunk_bytes needs how='pytree'")
    with ocp.CheckpointManager(
        Path(root).absolute(), item_names=(ITEM,), item_handlers={ITEM: handler}
    ) as manager:
        manager.save(step, args=ocp.args.Composite(**{ITEM: args}))
        manager.wait_until_finished()
    return Path(root) / str(step)


def hf_config(d: Dims) -> dict[str, Any]:
    """The Hugging Face llama config (a dict) of a llama of ``d``'s sizes: what the
    ``maxtext-llama3`` preset takes (``osf.preset_mapping("maxtext-llama3",
    hf_config=hf_config(d))``), untied head."""
    return {
        "model_type": "llama",
        "hidden_size": d.embed,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "vocab_size": d.vocab,
        "tie_word_embeddings": False,
    }


def hand_mapping(d: Dims | None = None) -> Any:
    """A hand-written ``osf.KeyMapping`` of :func:`llama_shapes`' parameters (named from the
    train state's top: ``params.params...``; ``d``: default ``Dims()``) until the MaxText
    presets exist. Each scanned
    tensor becomes one PyTorch tensor with the layers first, through each kind of export
    path: ``Transpose`` (commutes with a box: shards written where they land), ``SplitHeads``
    (re-laid-out on the devices), a renamed norm and the head."""
    import orbax_safetensors as osf

    d = Dims() if d is None else d
    p, layer = "params.params.", "params.params.decoder.layers."

    def heads(n: int) -> Any:
        # (E, L, n, D) -> (L, n * D, E): the layers first, then HF's (out, in) weight
        return osf.Chain(osf.SplitHeads(n, 1), osf.Transpose((3, 0, 1, 2)))

    to_layers_first = osf.Transpose((2, 0, 1))  # (X, L, Y) -> (L, Y, X)
    t = osf.Transpose()
    return osf.KeyMapping(
        [
            osf.Rule("model.embed_tokens.weight", p + "token_embedder.embedding"),
            osf.Rule("layers.q_proj", layer + "self_attention.query.kernel", heads(d.heads)),
            osf.Rule("layers.k_proj", layer + "self_attention.key.kernel", heads(d.kv_heads)),
            osf.Rule("layers.v_proj", layer + "self_attention.value.kernel", heads(d.kv_heads)),
            # (H, L, D, E) -> (L, E, H * D)
            osf.Rule(
                "layers.o_proj",
                layer + "self_attention.out.kernel",
                osf.Chain(osf.SplitHeads(d.heads, 2), osf.Transpose((2, 0, 3, 1))),
            ),
            osf.Rule("layers.gate_proj", layer + "mlp.wi_0.kernel", to_layers_first),
            osf.Rule("layers.up_proj", layer + "mlp.wi_1.kernel", to_layers_first),
            osf.Rule("layers.down_proj", layer + "mlp.wo.kernel", to_layers_first),
            osf.Rule("layers.input_norm", layer + "pre_self_attention_layer_norm.scale", t),
            osf.Rule("layers.post_norm", layer + "post_self_attention_layer_norm.scale", t),
            osf.Rule("model.norm.weight", p + "decoder.decoder_norm.scale"),
            osf.Rule("lm_head.weight", p + "decoder.logits_dense.kernel", osf.Transpose()),
        ]
    )


def random_sharded_state(
    d: Dims, *, step: int = 7, seed: int = 0, layers: bool = False
) -> dict[str, Any]:
    """A train state of :func:`llama_shapes` built shard by shard on every process of a job
    (no process holds more than its shards: for states too large for one host), sharded as
    :func:`shard_state` shards (``embed`` over every device; with ``layers``, a scanned
    tensor on its layers axis): parameters, ``mu`` and ``nu`` random, each box's values from
    ``seed``, the name and the box, the same on every process; the structure of
    :func:`train_state`'s (optax ``adamw``)."""
    import zlib

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("fsdp",))

    def put(name: str, shape: tuple[int, ...], scale: float) -> Any:
        axis = _embed_axis_or_none(name)
        if layers and ".decoder.layers." in f".{name}":
            axis = layers_axis(name)
        if axis is not None and shape[axis] % len(devices):
            axis = None
        spec = PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "fsdp")

        def block(index: Any) -> np.ndarray:
            starts = [s.start or 0 for s in index]
            box = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            rng = np.random.default_rng([seed, zlib.crc32(name.encode()), *starts])
            return (scale * rng.standard_normal(box, np.float32)).astype(np.float32)

        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), block)

    def tree(prefix: str, scale: float) -> dict[str, Any]:
        shapes = llama_shapes(d)
        return unflatten({n: put(prefix + n, s, scale) for n, s in shapes.items()})

    def counter(value: int) -> Any:
        return jax.device_put(np.asarray(value, np.int32), NamedSharding(mesh, PartitionSpec()))

    return {
        "step": counter(step),
        "params": {"params": tree("params.", 0.05)},
        "opt_state": [
            {
                "count": counter(step),
                "mu": {"params": tree("mu.", 1e-3)},
                "nu": {"params": tree("nu.", 1e-6)},
            },
            {},
            {"count": counter(step)},
        ],
    }


def lora_tree(seed: int = 0) -> dict[str, Any]:
    """A small tree with a LoRA-adapted kernel (``x.kernel`` with ``x.lora.lora_a`` /
    ``lora_b``) beside a plain one (``y``), for :data:`LORA_MAPPING`."""
    rng = np.random.default_rng(seed)
    return {
        "x": {
            "kernel": rng.standard_normal((32, 48), np.float32),
            "lora": {
                "lora_a": rng.standard_normal((32, 2), np.float32),
                "lora_b": rng.standard_normal((2, 48), np.float32),
            },
        },
        "y": rng.standard_normal((16, 8), np.float32),
    }


def _lora_mapping() -> Any:
    import orbax_safetensors as osf

    rules = [osf.Rule("x.weight", "x.kernel", osf.Transpose()), osf.Rule("y.weight", "y")]
    return osf.KeyMapping(rules, lora_scale=0.5)


LORA_MAPPING = _lora_mapping()
