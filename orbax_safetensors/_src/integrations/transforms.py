"""The tensor transforms a :class:`Rule` applies to one slice: re-layouts (:class:`Transpose`,
:class:`SplitHeads`, :class:`Reshape`, :class:`Chain` of several) and value transforms for
models that store their weights other than as Hugging Face does (:class:`Scale`,
:class:`RopeInterleave`, :class:`VocabRows`, :class:`Offset`). Each has ``to_flax`` (towards
the JAX side) and ``to_torch`` (towards Hugging Face), runs on numpy and on jax arrays (an
export on the devices applies it) and keeps the tensor's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np


class Transform(Protocol):
    """A reversible tensor transform: ``to_flax(to_torch(x))`` gives ``x`` back.

    Example::

        @dataclasses.dataclass(frozen=True)
        class Negate:  # a Transform of your own, for a Rule
            def to_flax(self, x): return -x
            def to_torch(self, x): return -x
    """

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
    ``(out, in, kh, kw)`` into an NNX ``Conv`` kernel ``(kh, kw, in, out)``.

    Example::

        Rule("{p:.*_proj}.weight", "{p}.kernel", Transpose())
    """

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
    ``(heads, dim, features)``. Give the number of ``heads``, the ``head_dim`` (one rule
    then fits query heads and fewer key/value heads alike, e.g. Tunix's
    ``(embed, heads, head_dim)`` attention kernels), or both (the axis must then be exactly
    that many heads of that size). A tensor they do not fit is refused both ways (a
    ``ValueError`` naming the axis and the sizes): a merge checks the heads and head size it
    is given, so a wrong ``head_dim`` never merges silently.

    Example::

        SplitHeads(4, -1).to_flax(np.zeros((6, 12))).shape          # (6, 4, 3)
        SplitHeads(head_dim=3, axis=0).to_flax(np.zeros((12, 6))).shape   # (4, 3, 6)
    """

    heads: int | None = None
    axis: int = -1
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.heads is None and self.head_dim is None:
            raise ValueError("SplitHeads takes heads=, head_dim= or both")
        for name in ("heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value or value <= 0):
                raise ValueError(
                    f"SplitHeads: {name} must be a positive whole number, got {value!r}"
                )

    def _sizes(self) -> str:
        if self.heads is None:
            return f"heads of head_dim {self.head_dim}"
        return f"{self.heads} heads" + (
            "" if self.head_dim is None else f" of head_dim {self.head_dim}"
        )

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % x.ndim
        size = int(x.shape[axis])
        if self.head_dim is not None:
            dim = int(self.head_dim)
            heads = size // dim if self.heads is None else int(self.heads)
        else:
            heads = int(self.heads or 0)
            dim = size // heads
        if heads * dim != size or not dim:
            raise ValueError(f"axis {axis} of size {size} does not split into {self._sizes()}")
        return x.reshape(*x.shape[:axis], heads, dim, *x.shape[axis + 1 :])

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % (x.ndim - 1)
        heads, dim = int(x.shape[axis]), int(x.shape[axis + 1])
        if (self.heads is not None and heads != self.heads) or (
            self.head_dim is not None and dim != self.head_dim
        ):
            raise ValueError(
                f"axes {axis} and {axis + 1} hold {heads} heads of head_dim {dim}, not "
                f"{self._sizes()}"
            )
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Reshapes between two fixed shapes (``-1`` allowed on either side).

    Example::

        Reshape(flax_shape=(4, 8, 32), torch_shape=(32, 32)).to_flax(w).shape  # (4, 8, 32)
    """

    flax_shape: tuple[int, ...]
    torch_shape: tuple[int, ...]

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.flax_shape)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.torch_shape)


@dataclasses.dataclass(frozen=True)
class Chain:
    """Several transforms: applied in order towards Flax, in reverse order towards PyTorch.

    Example::

        Chain(Transpose(), SplitHeads(head_dim=64))  # (heads * 64, emb) -> (emb, heads, 64)
    """

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


@dataclasses.dataclass(frozen=True)
class Scale:
    """Multiplies by ``to_flax_factor`` towards the JAX side and by ``to_torch_factor`` towards
    PyTorch. Each factor is rounded to float32 and the product taken in float32 (float64 for a
    float64 tensor), then rounded to the tensor's dtype: what MaxText's conversion hooks do, so
    an export gives their bits (``to_torch(to_flax(x))`` is ``x`` only where the factors are
    powers of two).

    Example::

        Scale.attention_query(64).to_flax(np.ones(2, np.float32))   # [0.125, 0.125]
    """

    to_flax_factor: float
    to_torch_factor: float

    @classmethod
    def attention_query(cls, head_dim: int) -> Scale:
        """The attention's ``1 / sqrt(head_dim)`` folded into the query kernel (MaxText's
        Llama, Mistral and Mixtral): times ``1 / sqrt(head_dim)`` into the kernel, times
        ``sqrt(head_dim)`` out of it, each factor computed in float64 and rounded to float32."""
        if int(head_dim) <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim!r}")
        root = math.sqrt(int(head_dim))
        return cls(1.0 / root, root)

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        return _scaled(x, self.to_flax_factor)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return _scaled(x, self.to_torch_factor)


def _floating(x: Any, what: str) -> None:
    # A factor or an offset applied in an integer or bool dtype rounds and wraps the values
    # (MaxText and transformers compute in floating point): refused, as a link's planning
    # probes the transform with the stored dtype, before a byte is read.
    if np.dtype(x.dtype).kind in "biu":
        raise ValueError(
            f"{what} applies to floating-point tensors, not {np.dtype(x.dtype).name} ones "
            "(the values would be rounded and wrap)"
        )


def _scaled(x: Any, factor: float) -> Any:
    _floating(x, "Scale")
    work = np.float64 if x.dtype == np.float64 else np.float32
    return (x.astype(work) * work(factor)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeInterleave:
    """The two layouts of rotary embeddings' pairs along axis ``axis`` (the head dimension):
    Hugging Face rotates halves (``x[:d/2]`` with ``x[d/2:]``), Meta's and MaxText's LLaMA 3.1
    RoPE rotates neighbours (``x[0::2]`` with ``x[1::2]``). ``to_flax`` interleaves the halves
    (``[a0, a1, b0, b1]`` -> ``[a0, b0, a1, b1]``), ``to_torch`` gathers them back: a
    permutation of the query and key projections' output features, values unchanged.

    Example::

        RopeInterleave().to_flax(np.arange(6))    # [0, 3, 1, 4, 2, 5]
    """

    axis: int = -1

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        axis, n = self._axis(x)
        order = np.arange(n).reshape(2, n // 2).T.reshape(-1)  # 0, n/2, 1, n/2 + 1, ...
        return x[(slice(None),) * axis + (order,)]

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        axis, n = self._axis(x)
        order = np.arange(n).reshape(n // 2, 2).T.reshape(-1)  # 0, 2, 4, ..., 1, 3, 5, ...
        return x[(slice(None),) * axis + (order,)]

    def _axis(self, x: np.ndarray) -> tuple[int, int]:
        axis = self.axis % x.ndim
        if x.shape[axis] % 2:
            raise ValueError(f"rotary pairs: axis {axis} of shape {list(x.shape)} has an odd size")
        return axis, int(x.shape[axis])


# How far a padded vocabulary may be from the config's (docs/huggingface.md): MaxText and
# other trainers pad the embedding up to a multiple (128 rows, or 128 per model-parallel
# device) or by a block of rows (Gemma's 256128 for 256000), and some cut a few off (Gemma 3's
# 262144 for 262208). A larger difference is a config that contradicts the checkpoint.
PADDING_ROWS = 2048
PADDING_SHARE = 4  # (and at most a quarter of the larger of the two)


def padding_problem(rows: int, claimed: int, what: str) -> str | None:
    """Why a tensor of ``rows`` vocabulary rows cannot become one of ``claimed`` (``what``
    names the claim: ``"vocab_size 96"``): a claim that is not positive, or one farther from
    the rows than a padding goes (:data:`PADDING_ROWS`, and a quarter of the larger); None
    when it can.
    """
    if claimed <= 0:
        return f"{what} is not a positive number of rows"
    gap = abs(int(rows) - int(claimed))
    if gap <= min(PADDING_ROWS, max(rows, claimed) // PADDING_SHARE):
        return None
    return (
        f"{what} and the tensor's {rows} rows differ by {gap}: more than a padded "
        f"vocabulary's (at most {PADDING_ROWS} rows and a quarter of the larger); the config "
        "contradicts the checkpoint"
    )


@dataclasses.dataclass(frozen=True)
class VocabRows:
    """A vocabulary axis padded past the tokenizer's: towards PyTorch the tensor has the
    config's ``vocab`` rows along ``axis`` (the rows past it dropped; a shorter one padded
    with zeros), towards the JAX side ``padded`` rows (None: as many as it has).

    Either way the rows change by a padding at most (:func:`padding_problem`: at most
    :data:`PADDING_ROWS` rows and a quarter of the larger count), and a tensor read from a
    Hugging Face file has the config's ``vocab`` rows within a padding too: a ``vocab`` or
    ``padded`` farther from the tensor's rows is a config that contradicts the checkpoint,
    refused with a ``ValueError`` (in the shape arithmetic a load or an export plans with,
    before anything is read), never rows silently dropped or a claim allocated.

    Example::

        VocabRows(3).to_torch(np.ones((4, 2)))              # 3 rows
        VocabRows(6, padded=8).to_flax(np.ones((6, 2)))     # 8 rows, the last 2 zeros
    """

    vocab: int
    padded: int | None = None
    axis: int = 0

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        _check_rows(x, int(self.vocab), self.axis, f"the config's vocab_size {self.vocab}")
        if self.padded is None:
            return x
        return _rows(x, int(self.padded), self.axis, f"the padded vocab_size={self.padded}")

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        return _rows(x, int(self.vocab), self.axis, f"the config's vocab_size {self.vocab}")


def _check_rows(x: Any, n: int, axis: int, what: str) -> int:
    axis %= x.ndim
    problem = padding_problem(int(x.shape[axis]), n, what)
    if problem is not None:
        raise ValueError(f"axis {axis}: {problem}")
    return axis


def _rows(x: Any, n: int, axis: int, what: str) -> Any:
    axis = _check_rows(x, n, axis, what)
    have = x.shape[axis]
    if have >= n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    shape = (*x.shape[:axis], n, *x.shape[axis + 1 :])
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - have)
    if not isinstance(x, np.ndarray):  # a jax.Array (an export's transform on the devices)
        import jax.numpy as jnp

        return jnp.pad(x, widths)
    if x.size and not any(x.strides) and not x.flat[0]:
        # a broadcast zero (a shape probe) pads to a broadcast zero: nothing allocated
        return np.broadcast_to(np.zeros((), x.dtype), shape)
    return np.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class Offset:
    """Adds ``to_flax_offset`` towards the JAX side and subtracts it towards PyTorch, in the
    tensor's dtype: norms stored as ``1 + w`` (MaxText's Gemma) against Hugging Face's ``w``.

    Example::

        Offset(1.0).to_flax(np.zeros(2, np.float32))    # [1., 1.]
    """

    to_flax_offset: float

    def to_flax(self, x: np.ndarray) -> np.ndarray:
        _floating(x, "Offset")
        return (x + np.asarray(self.to_flax_offset, x.dtype)).astype(x.dtype)

    def to_torch(self, x: np.ndarray) -> np.ndarray:
        _floating(x, "Offset")
        return (x - np.asarray(self.to_flax_offset, x.dtype)).astype(x.dtype)
