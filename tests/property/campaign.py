"""Shared strategies, settings and comparisons of the property campaign (``tests/property``).

Settings: every campaign test takes its example count from one hypothesis profile,
``OSF_PROPERTY_PROFILE`` (``ci``, the default, bounded for a 2-core CI machine; ``stack``, a
quarter of that, for CI's runs on the older stacks, where the point is the versions rather than
the search; ``long`` for local runs, 25 times the examples). ``deadline=None`` throughout: a
first save compiles. Each failure the campaign found is a named test in ``test_regressions.py``.

Example::

    @campaign(weight=1.0)
    @given(tree=manager_trees())
    def test_x(tree): ...
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_casts import x64

# --------------------------------------------------------------------------- settings

PROFILE = os.environ.get("OSF_PROPERTY_PROFILE", "ci")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "osf-ci", max_examples=20, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True
)
settings.register_profile(
    "osf-long", max_examples=500, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True
)


settings.register_profile(
    "osf-stack", max_examples=5, deadline=None, suppress_health_check=_SUPPRESS, print_blob=True
)


def campaign(weight: float = 1.0) -> settings:
    """The profile's settings with ``weight`` times its example count (at least 2)."""
    base = settings.get_profile(f"osf-{PROFILE}" if PROFILE in ("long", "stack") else "osf-ci")
    return settings(base, max_examples=max(2, int(base.max_examples * weight)))


# --------------------------------------------------------------------------- dtypes

_NUMPY_NAMES = [
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64",
]  # fmt: skip
_ML_NAMES = [
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
]  # fmt: skip
# Every dtype core/dtypes.py stores (on this ml_dtypes).
NUMPY_DTYPES = [np.dtype(getattr(np, n)) for n in _NUMPY_NAMES] + [
    np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES if hasattr(ml_dtypes, n)
]
# What a jax.Array holds without x64 on this jax (float6 has no XLA type).
JAX_DTYPES = [
    d
    for d in NUMPY_DTYPES
    if d.itemsize < 8 or d == np.complex64
    if not d.name.startswith("float6") and hasattr(jnp, d.name.replace("bool_", "bool"))
]
JAX_DTYPES = [d for d in JAX_DTYPES if d.name != "uint64" and d.name != "int64"]
FLOAT_DTYPES = [d for d in NUMPY_DTYPES if d.kind == "f" or d.name.startswith(("float", "bf"))]
# What Orbax's StandardCheckpointHandler saves (tensorstore has no float6; zero-size arrays are
# refused as well, see ``nonzero``).
ORBAX_DTYPES = [d for d in NUMPY_DTYPES if not d.name.startswith("float6")]
_SUB_BYTE_BITS = {"float4_e2m1fn": 4, "float6_e2m3fn": 6, "float6_e3m2fn": 6}


def bits(dtype: np.dtype) -> int:
    """Bits per element on disk."""
    return _SUB_BYTE_BITS.get(dtype.name, dtype.itemsize * 8)


def storable(dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    """Whether safetensors can store ``shape`` of ``dtype`` (sub-byte types fill whole bytes)."""
    return int(np.prod(shape, dtype=np.int64)) * bits(dtype) % 8 == 0


def random_values(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Every bit pattern of ``dtype`` (NaNs, infinities, -0.0, subnormals), reproducibly."""
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.itemsize, np.uint8)
    if dtype == np.bool_:
        raw &= 1
    elif dtype.name in _SUB_BYTE_BITS:
        raw &= (1 << _SUB_BYTE_BITS[dtype.name]) - 1
    return raw.view(dtype).reshape(shape)


# --------------------------------------------------------------------------- shapes


def _sizes(itemsize: int, big: bool) -> st.SearchStrategy[int]:
    small = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 16])
    block = 4096 // itemsize
    blocks = st.sampled_from([block - 1, block, block + 1])
    if not big:
        return st.one_of(small, small, small, blocks)
    mib = (1 << 20) // itemsize
    return st.sampled_from([mib - 1, mib, mib + 1, mib + block + 1])


@st.composite
def shapes(
    draw: st.DrawFn, dtype: np.dtype, big: bool = False, nonzero: bool = False
) -> tuple[int, ...]:
    """Rank 0-3, sizes 0, 1, odd and around 4 KiB (``big``: one dimension around the 1 MiB
    direct I/O threshold, the others 1); sub-byte dtypes get a whole number of bytes.
    ``nonzero``: no zero-size dimension (Orbax refuses zero-size arrays)."""
    itemsize = max(1, dtype.itemsize)
    if big:
        rank = draw(st.integers(1, 2))
        dims = [1] * rank
        dims[draw(st.integers(0, rank - 1))] = draw(_sizes(itemsize, True))
        shape = tuple(dims)
    else:
        rank = draw(st.integers(0, 3))
        dims = [draw(_sizes(itemsize, False)) for _ in range(rank)]
        dims = [max(d, 1) for d in dims] if nonzero else dims
        while int(np.prod(dims, dtype=np.int64)) * itemsize > 64 << 10:
            dims[int(np.argmax(dims))] = 2  # two block-sized dimensions: keep it small
        shape = tuple(dims)
    if not storable(dtype, shape):
        shape = (*shape[:-1], 8) if shape else (8,)
    return shape


# --------------------------------------------------------------------------- shardings


@contextlib.contextmanager
def direct_io(mode: str) -> Iterator[None]:
    """``OSF_DIRECT_IO=mode`` for the block (read whenever a file is opened)."""
    old = os.environ.get("OSF_DIRECT_IO")
    os.environ["OSF_DIRECT_IO"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["OSF_DIRECT_IO"]
        else:
            os.environ["OSF_DIRECT_IO"] = old


def _meshes() -> list[Mesh]:
    devices = np.array(jax.devices())
    out = [Mesh(devices.reshape(-1), ("x",))]
    if devices.size == 8:
        out += [Mesh(devices.reshape(2, 4), ("x", "y")), Mesh(devices.reshape(4, 2), ("x", "y"))]
    return out


@st.composite
def shardings(draw: st.DrawFn, shape: tuple[int, ...], bits: int = 8) -> Any:
    """None (default placement), a replicated, or a NamedSharding that splits dimensions
    divisible by a mesh axis (zero-size dimensions included)."""
    choice = draw(st.sampled_from(["default", "replicated", "split", "split"]))
    if choice == "default":
        return None
    mesh = draw(st.sampled_from(_meshes()))
    if choice == "replicated":
        return NamedSharding(mesh, P())
    spec: list[Any] = []
    free = list(mesh.axis_names)
    for i, d in enumerate(shape):
        # A shard of a sub-byte dtype must start and end on whole bytes (documented refusal).
        inner = int(np.prod(shape[i + 1 :], dtype=np.int64)) * bits
        fits = [a for a in free if d % mesh.shape[a] == 0 and inner % 8 == 0]
        pick = draw(st.sampled_from([None, *fits]))
        if pick is not None:
            free.remove(pick)
        spec.append(pick)
    return NamedSharding(mesh, P(*spec))


# --------------------------------------------------------------------------- leaves and trees

Pair = collections.namedtuple("Pair", ["first", "second"])


@struct.dataclass
class Box:
    """A flax.struct dataclass node."""

    x: Any
    y: Any


@st.composite
def jax_arrays(
    draw: st.DrawFn, dtypes: list[np.dtype] | None = None, big: bool = False, nonzero: bool = False
) -> Any:
    dtype = draw(st.sampled_from(dtypes if dtypes is not None else JAX_DTYPES))
    shape = draw(shapes(dtype, big=big, nonzero=nonzero))
    value = random_values(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    sharding = draw(shardings(shape, bits(dtype)))
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


@st.composite
def numpy_arrays(
    draw: st.DrawFn, dtypes: list[np.dtype] | None = None, nonzero: bool = False
) -> np.ndarray:
    dtype = draw(st.sampled_from(dtypes if dtypes is not None else NUMPY_DTYPES))
    shape = draw(shapes(dtype, nonzero=nonzero))
    return random_values(dtype, shape, draw(st.integers(0, 2**32 - 1)))


def arrays(dtypes: list[np.dtype] | None = None, nonzero: bool = False) -> st.SearchStrategy[Any]:
    """jax arrays (often sharded over the 8 devices) and numpy arrays of every dtype."""
    jd = [d for d in (dtypes if dtypes is not None else JAX_DTYPES) if d in JAX_DTYPES] or None
    return st.one_of(
        jax_arrays(jd, nonzero=nonzero),
        jax_arrays(jd, nonzero=nonzero),
        numpy_arrays(dtypes, nonzero=nonzero),
    )


# Python scalars a tree may hold beside arrays (stored inline in the schema).
python_scalars = st.one_of(
    st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, width=32)
)


_keys = st.text(alphabet="abcxyz_", min_size=1, max_size=4)


def containers(leaves: st.SearchStrategy[Any], max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """dicts, lists, tuples, namedtuples, flax.struct dataclasses and None / empty nodes."""
    empty = st.sampled_from([None, {}, [], ()])
    return st.recursive(
        st.one_of(leaves, leaves, leaves, empty),
        lambda c: st.one_of(
            st.dictionaries(_keys, c, min_size=1, max_size=4),
            st.lists(c, min_size=1, max_size=3),
            st.lists(c, min_size=1, max_size=3).map(tuple),
            st.builds(Pair, c, c),
            st.builds(Box, c, c),
        ),
        max_leaves=max_leaves,
    )


@st.composite
def nnx_states(draw: st.DrawFn) -> Any:
    """``nnx.state`` of a small model (Param and BatchStat variables) in a float dtype."""
    from flax import nnx

    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
    din, dout = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    rngs = nnx.Rngs(draw(st.integers(0, 100)))

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.dense = nnx.Linear(din, dout, param_dtype=dtype, rngs=rngs)
            self.norm = nnx.BatchNorm(dout, param_dtype=dtype, rngs=rngs)

    return nnx.state(Model())


@st.composite
def optax_states(draw: st.DrawFn, nonzero: bool = False) -> Any:
    """An optimizer state (namedtuples, EmptyState, int32 counts) of random float params."""
    import optax

    sizes = st.integers(1 if nonzero else 0, 5)
    params = {
        k: jnp.asarray(random_values(np.dtype(np.float32), (n,), n))
        for k, n in draw(st.dictionaries(_keys, sizes, min_size=1, max_size=3)).items()
    }
    make = draw(
        st.sampled_from(
            [
                lambda: optax.adam(1e-3),
                lambda: optax.sgd(0.1, momentum=0.9),
                lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
            ]
        )
    )
    return make().init(params)


def manager_trees(
    leaves: st.SearchStrategy[Any] | None = None, big: bool = False, nonzero: bool = False
) -> st.SearchStrategy[dict[str, Any]]:
    """A dict root of random containers, maybe an nnx.State, an optax state, a large array."""
    parts = {
        "tree": containers(
            leaves if leaves is not None else st.one_of(arrays(nonzero=nonzero), python_scalars)
        ),
        "model": st.one_of(st.none(), nnx_states()),
        "opt": st.one_of(st.none(), optax_states(nonzero)),
    }
    if big:
        parts["big"] = jax_arrays([np.dtype(np.float32), np.dtype(np.uint8)], big=True)
    return st.fixed_dictionaries(parts)


# --------------------------------------------------------------------------- comparisons


def abstract(tree: Any) -> Any:
    """A restore target: jax leaves as ShapeDtypeStructs with their sharding, others as is."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)


def assert_leaf_equal(
    got: Any, want: Any, where: str, *, sharding: bool = True, values: bool = True
) -> None:
    """Same kind (jax / numpy / other), dtype, shape, bytes and (jax) sharding."""
    assert isinstance(got, jax.Array) == isinstance(want, jax.Array), (
        f"{where}: {type(got).__name__} != {type(want).__name__}"
    )
    if not isinstance(want, (jax.Array, np.ndarray, np.generic)):
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"
        return
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (
        f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
    )
    if values:
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), f"{where}: bytes differ"
    if sharding and isinstance(want, jax.Array) and want.size:
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (
            f"{where}: sharding {got.sharding} != {want.sharding}"
        )


def assert_trees_equal(got: Any, want: Any, *, sharding: bool = True, values: bool = True) -> None:
    """Same structure (node types included) and every leaf as :func:`assert_leaf_equal`."""
    got_paths, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_paths, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def, f"structures differ:\n{got_def}\n{want_def}"
    for (path, g), (_, w) in zip(got_paths, want_paths):
        assert_leaf_equal(g, w, jax.tree_util.keystr(path), sharding=sharding, values=values)


def as_x64(fn: Callable[[], Any]) -> Any:
    """``fn()`` with 64-bit types enabled (jnp.astype of float64 / int64 sources)."""
    with x64():
        return fn()
