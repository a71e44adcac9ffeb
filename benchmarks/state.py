"""Deterministic benchmark states: LLaMA-like trees and many-small-tensor trees.

Every tensor is described by a :class:`TensorSpec` (dotted name, shape, dtype, index) and its
bytes are a pure function of ``(seed, index)``, so any process can rebuild any single tensor (for
verification) or the abstract tree (for restores) without generating the whole state.

Data is "random mantissa": random sign and mantissa bits with the exponent drawn from a narrow
range (magnitudes in [2**-8, 1)), which looks like trained weights to a compressor, i.e. it is
essentially incompressible, as real checkpoints are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: dtype name -> (unsigned integer type of the same width, mantissa bits, exponent bias)
_FLOAT_LAYOUT: dict[str, tuple[type[np.unsignedinteger[Any]], int, int]] = {
    "float32": (np.uint32, 23, 127),
    "bfloat16": (np.uint16, 7, 127),
    "float16": (np.uint16, 10, 15),
}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_FLOAT_LAYOUT)


def np_dtype(name: str) -> np.dtype[Any]:
    """Returns the numpy dtype for ``name`` (``bfloat16`` comes from ``ml_dtypes``)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class TensorSpec:
    """One leaf of a benchmark state.

    Attributes:
      name: dotted path of the leaf in the nested dict (``"layers.layer_00.attn.q_proj.kernel"``).
      shape: array shape.
      dtype: dtype name, one of :data:`SUPPORTED_DTYPES`.
      index: position in the state; with the seed it determines the bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    index: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return self.size * np_dtype(self.dtype).itemsize


def parse_size(text: str) -> int:
    """Parses ``"256M"``, ``"1G"``, ``"512K"`` or a plain byte count (binary units)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": KIB, "M": MIB, "G": GIB, "T": GIB * 1024}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    """Formats a byte count compactly in binary units (``268435456`` -> ``"256M"``)."""
    for unit, scale in (("G", GIB), ("M", MIB), ("K", KIB)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{nbytes}B"


def write_results(out: str, rows: Any, text: str) -> None:
    """A benchmark's ``rows`` as ``<out>/results.json`` and its report ``text`` as
    ``<out>/results.md`` (nothing when ``out`` is empty)."""
    if not out:
        return
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    (out_dir / "results.md").write_text(text + "\n")


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, round(value / multiple) * multiple)


def llama_specs(total_bytes: int, dtype: str, layers: int = 12) -> list[TensorSpec]:
    """Specs of a LLaMA-like tree whose total size is close to ``total_bytes``.

    The tree has an embedding, ``layers`` decoder blocks (attention q/k/v/o, gated MLP
    gate/up/down, two RMSNorm scales) a final norm and an untied LM head: ``9 * layers + 3``
    tensors (111 for the default 12 layers). The hidden size is picked for a vocabulary of about
    8x the hidden size (LLaMA's ratio); the vocabulary is then adjusted so the total lands within
    one embedding row of ``total_bytes``.

    Args:
      total_bytes: requested state size in bytes.
      dtype: dtype name of every tensor.
      layers: number of decoder blocks.

    Returns:
      The specs, in a stable order.
    """
    itemsize = np_dtype(dtype).itemsize
    n_params = total_bytes // itemsize
    # Total ~= 2*V*d + layers*(4*d*d + 3*d*f) with V ~ 8d, f ~ 8d/3  =>  (16 + 12*layers) * d^2.
    d_est = math.sqrt(n_params / (16 + 12 * layers))
    mult = 64 if d_est >= 512 else 16 if d_est >= 64 else 4
    d = max(mult, int(d_est // mult) * mult)
    f = _round_to(8 * d / 3, mult)
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    vocab = max(1, (n_params - layers * per_layer - d) // (2 * d))

    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.embedding", (vocab, d))]
    for i in range(layers):
        p = f"layers.layer_{i:02d}"
        shapes += [
            (f"{p}.attn_norm.scale", (d,)),
            (f"{p}.attn.q_proj.kernel", (d, d)),
            (f"{p}.attn.k_proj.kernel", (d, d)),
            (f"{p}.attn.v_proj.kernel", (d, d)),
            (f"{p}.attn.o_proj.kernel", (d, d)),
            (f"{p}.mlp_norm.scale", (d,)),
            (f"{p}.mlp.gate_proj.kernel", (d, f)),
            (f"{p}.mlp.up_proj.kernel", (d, f)),
            (f"{p}.mlp.down_proj.kernel", (f, d)),
        ]
    shapes += [("final_norm.scale", (d,)), ("lm_head.kernel", (d, vocab))]
    return [TensorSpec(n, s, dtype, i) for i, (n, s) in enumerate(shapes)]


def many_small_specs(count: int, nbytes: int, dtype: str) -> list[TensorSpec]:
    """Specs of ``count`` 1-D tensors of ``nbytes`` each, grouped 100 per sub-dict."""
    n = max(1, nbytes // np_dtype(dtype).itemsize)
    return [
        TensorSpec(f"group_{i // 100:04d}.tensor_{i % 100:02d}", (n,), dtype, i)
        for i in range(count)
    ]


def partial_selection(specs: list[TensorSpec], fraction: float) -> list[TensorSpec]:
    """``ceil(fraction * len(specs))`` tensors (at least one), evenly spread over the state."""
    k = max(1, math.ceil(fraction * len(specs)))
    n = len(specs)
    return [specs[int((j + 0.5) * n / k)] for j in range(k)]


def generate(spec: TensorSpec, seed: int) -> np.ndarray:
    """Random-mantissa data for one tensor, a pure function of ``(seed, spec.index)``.

    Uses the SFC64 bit generator's raw output and edits it in place in 1 MiB chunks: allocating
    and first-touching temporaries is the slow part on this VM.
    """
    utype, mant_bits, bias = _FLOAT_LAYOUT[spec.dtype]
    width = np.dtype(utype).itemsize * 8
    bitgen = np.random.SFC64(np.random.SeedSequence([seed, spec.index]))
    words = bitgen.random_raw(-(-spec.nbytes // 8))
    bits = words.view(np.uint8)[: spec.nbytes].view(utype)
    keep = utype((1 << (width - 1)) | ((1 << mant_bits) - 1))  # sign + mantissa
    chunk = MIB // np.dtype(utype).itemsize
    scratch = np.empty(min(chunk, bits.size), dtype=utype)
    for start in range(0, bits.size, chunk):
        part = bits[start : start + chunk]
        exponent = scratch[: part.size]
        np.right_shift(part, utype(mant_bits), out=exponent)
        exponent &= utype(7)
        np.subtract(utype(bias - 1), exponent, out=exponent)
        exponent <<= utype(mant_bits)
        part &= keep
        part |= exponent
    return bits.view(np_dtype(spec.dtype)).reshape(spec.shape)


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (or an already flat dict with dotted keys) -> ``{"a.b": leaf}``."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


def make_state(specs: list[TensorSpec], seed: int) -> dict[str, Any]:
    """The nested dict of ``jax.Array`` leaves on the default device (blocked until ready)."""
    import jax

    device = jax.devices()[0]
    flat: dict[str, Any] = {}
    for spec in specs:
        host = generate(spec, seed)
        leaf = jax.device_put(host, device)
        if leaf.unsafe_buffer_pointer() == host.ctypes.data:
            # On CPU, device_put aliases 64-byte aligned numpy buffers (even with
            # may_alias=False in jax 0.10); a training state lives in XLA-owned buffers.
            leaf = leaf.copy()
        flat[spec.name] = leaf
    state = unflatten(flat)
    jax.block_until_ready(state)
    return state


def make_abstract(specs: list[TensorSpec]) -> dict[str, Any]:
    """The nested dict of ``jax.ShapeDtypeStruct`` (with a single-device sharding)."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return unflatten(
        {s.name: jax.ShapeDtypeStruct(s.shape, np_dtype(s.dtype), sharding=sharding) for s in specs}
    )


def case_specs(case: dict[str, Any]) -> list[TensorSpec]:
    """Specs for a case dict (``kind`` ``"llama"`` or ``"many_small"``, see ``run.py``)."""
    if case["kind"] == "llama":
        return llama_specs(case["size"], case["dtype"], case.get("layers", 12))
    if case["kind"] == "many_small":
        return many_small_specs(case["count"], case["tensor_bytes"], case["dtype"])
    raise ValueError(f"unknown case kind {case['kind']!r}")
