"""Flax NNX helpers mirroring ``safetensors.torch``: ``save_model`` / ``load_model``.

A model's whole state (parameters, BatchNorm statistics, RNG keys and counts) is saved under
the dotted names of ``nnx.to_pure_dict(nnx.state(model))``, e.g. ``layers.0.kernel``; shared
(tied) variables are stored once and stay shared after loading.

Example::

    model = MLP(rngs=nnx.Rngs(0))
    osf.save_model(model, "mlp.safetensors")
    fresh = MLP(rngs=nnx.Rngs(1))
    osf.load_model(fresh, "mlp.safetensors")   # fresh(x) == model(x), bit for bit
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from etils import epath

if TYPE_CHECKING:  # flax.nnx is slow to import: only when these helpers run
    from flax import nnx

from orbax_safetensors._src.core.casting import DtypePolicy
from orbax_safetensors._src.pipeline.standalone import load_file, save_file


def save_model(
    model: nnx.Module,
    path: epath.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: DtypePolicy | None = None,
) -> None:
    """Saves every variable of an ``nnx.Module`` to one ``.safetensors`` file.

    Args:
      model: the module (its current state is saved; the module is not changed).
      path: the file to write.
      metadata: extra ``str -> str`` header metadata.
      dtype: a dtype policy, as in ``save_file`` (e.g. ``jnp.bfloat16`` for bf16 weights of an
        f32 model); ``load_model`` gives each variable the model's dtype back.

    Example::

        osf.save_model(model, "mlp-bf16.safetensors", dtype=jnp.bfloat16)
    """
    from flax import nnx

    save_file(nnx.state(model), path, metadata, dtype=dtype)


def load_model(
    model: nnx.Module, path: epath.PathLike, strict: bool = True, *, verify: bool = True
) -> nnx.Module:
    """Loads a file written by :func:`save_model` into ``model`` in place (and returns it).

    Each variable keeps its dtype, sharding and place in the module graph; shared variables
    stay shared. With ``verify`` (the default) every tensor is checked against its CRC32C as
    :func:`load_file` checks it (one file of a checkpoint directory against the checksums its
    directory records).

    Raises:
      TargetMismatchError: naming every missing, unexpected or mis-shaped key when the file
        does not fit the model (with ``strict=False`` unexpected keys are skipped and missing
        ones keep the model's values).
      IntegrityError: a tensor's bytes do not match their checksum (naming it and the file).

    Example::

        model = MLP(rngs=nnx.Rngs(0))   # any instance of the saved module's class
        osf.load_model(model, "mlp-bf16.safetensors")
    """
    from flax import nnx

    state = nnx.state(model)
    restored = load_file(path, target=state, strict=strict, verify=verify)
    nnx.update(model, restored)
    return model
