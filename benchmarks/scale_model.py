"""Model states and mesh ownership for ``scale_sim.py``, without data.

:func:`model_specs` lists a training state's tensors (bf16 parameters plus f32 Adam ``mu``
and ``nu``) of a Llama-3-70B, Llama-3-405B or DeepSeek-V3 shape. :class:`Mesh` places N
processes x ``devices`` devices on a two-axis mesh and :meth:`Mesh.owners` says which process
writes which bytes of a tensor saved with a two-entry partition spec.

Example::

    specs = model_specs("llama3-70b")          # 2,169 TensorSpec, 706 GB
    mesh = Mesh.parse("fsdp=1024,tp=8", processes=1024, devices=8)
    starts, owners = mesh.owners(specs[0], ("fsdp", "tp"), relayout=True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core.plan import TensorSpec

# name -> (layers, hidden, mlp, heads, kv heads, head dim, vocab)
_LLAMA = {
    "llama3-70b": (80, 8192, 28672, 64, 8, 128, 128256),
    "llama3-405b": (126, 16384, 53248, 128, 8, 128, 128256),
}
MODELS = (*_LLAMA, "deepseek-v3")


def _llama(name: str) -> list[tuple[str, tuple[int, ...]]]:
    layers, hidden, mlp, heads, kv, head_dim, vocab = _LLAMA[name]
    out = [("embed/embedding", (vocab, hidden)), ("lm_head/kernel", (hidden, vocab))]
    out.append(("final_norm/scale", (hidden,)))
    for i in range(layers):
        p = f"layers_{i}"
        out += [
            (f"{p}/attn/q/kernel", (hidden, heads * head_dim)),
            (f"{p}/attn/k/kernel", (hidden, kv * head_dim)),
            (f"{p}/attn/v/kernel", (hidden, kv * head_dim)),
            (f"{p}/attn/o/kernel", (heads * head_dim, hidden)),
            (f"{p}/mlp/gate/kernel", (hidden, mlp)),
            (f"{p}/mlp/up/kernel", (hidden, mlp)),
            (f"{p}/mlp/down/kernel", (mlp, hidden)),
            (f"{p}/attn_norm/scale", (hidden,)),
            (f"{p}/mlp_norm/scale", (hidden,)),
        ]
    return out


def _deepseek_v3() -> list[tuple[str, tuple[int, ...]]]:
    # 61 layers (3 dense, 58 MoE with 256 routed experts stacked per layer + 1 shared expert),
    # hidden 7168, multi-head latent attention, vocabulary 129280.
    hidden, vocab, heads = 7168, 129280, 128
    out = [("embed/embedding", (vocab, hidden)), ("lm_head/kernel", (hidden, vocab))]
    out.append(("final_norm/scale", (hidden,)))
    for i in range(61):
        p = f"layers_{i}"
        out += [
            (f"{p}/attn/q_a/kernel", (hidden, 1536)),
            (f"{p}/attn/q_a_norm/scale", (1536,)),
            (f"{p}/attn/q_b/kernel", (1536, heads * 192)),
            (f"{p}/attn/kv_a/kernel", (hidden, 576)),
            (f"{p}/attn/kv_a_norm/scale", (512,)),
            (f"{p}/attn/kv_b/kernel", (512, heads * 256)),
            (f"{p}/attn/o/kernel", (heads * 128, hidden)),
            (f"{p}/attn_norm/scale", (hidden,)),
            (f"{p}/mlp_norm/scale", (hidden,)),
        ]
        if i < 3:
            out += [
                (f"{p}/mlp/gate/kernel", (hidden, 18432)),
                (f"{p}/mlp/up/kernel", (hidden, 18432)),
                (f"{p}/mlp/down/kernel", (18432, hidden)),
            ]
        else:
            out += [
                (f"{p}/moe/router/kernel", (hidden, 256)),
                (f"{p}/moe/experts/gate", (256, hidden, 2048)),
                (f"{p}/moe/experts/up", (256, hidden, 2048)),
                (f"{p}/moe/experts/down", (256, 2048, hidden)),
                (f"{p}/moe/shared/gate", (hidden, 2048)),
                (f"{p}/moe/shared/up", (hidden, 2048)),
                (f"{p}/moe/shared/down", (2048, hidden)),
            ]
    return out


def model_specs(model: str) -> list[TensorSpec]:
    """The state's tensors, in the order a pytree flattens them (sorted names): parameters
    in bfloat16, Adam's two moments in float32."""
    params = _deepseek_v3() if model == "deepseek-v3" else _llama(model)
    specs = []
    for group, dtype in (("params", "BF16"), ("opt_state/mu", "F32"), ("opt_state/nu", "F32")):
        specs += [TensorSpec(f"{group}/{n}", dtype, shape) for n, shape in params]
    return sorted(specs, key=lambda s: s.name)


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A two-axis device mesh over ``processes`` x ``devices`` devices, in row-major device
    order, process ``p`` holding devices ``p * devices`` to ``(p + 1) * devices - 1``."""

    names: tuple[str, str]
    sizes: tuple[int, int]
    processes: int
    devices: int

    @classmethod
    def parse(cls, text: str, processes: int, devices: int) -> Mesh:
        """From ``"fsdp=1024,tp=8"``; a size may be ``N`` (the processes) or left out (what
        the other axis leaves of processes x devices)."""
        total = processes * devices
        parts = [p.split("=") for p in text.split(",")]
        if len(parts) != 2:
            raise ValueError(f"--mesh wants two axes like fsdp=N,tp=8, got {text!r}")
        names = (parts[0][0].strip(), parts[1][0].strip())
        raw = [p[1].strip() if len(p) > 1 else "" for p in parts]
        sizes = [processes if r.upper() == "N" else int(r) if r else 0 for r in raw]
        if sizes[0] == 0:
            sizes[0] = total // max(1, sizes[1])
        if sizes[1] == 0:
            sizes[1] = total // max(1, sizes[0])
        if sizes[0] * sizes[1] != total:
            raise ValueError(f"mesh {names}={sizes} does not hold {processes} x {devices} devices")
        s1 = sizes[1]
        if s1 % devices and devices % s1:
            raise ValueError(f"axis {names[1]}={s1}: a process's devices would not be a block")
        return cls(names, (sizes[0], sizes[1]), processes, devices)

    def coords(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per process: first and last coordinate of its devices along axis 0, then axis 1."""
        ids = np.arange(self.processes)[:, None] * self.devices + np.arange(self.devices)
        c0, c1 = ids // self.sizes[1], ids % self.sizes[1]
        return c0.min(1), c0.max(1), c1.min(1), c1.max(1)

    def axis_size(self, name: str | None) -> int:
        return 1 if name is None else self.sizes[self.names.index(name)]

    def owners(
        self, spec: TensorSpec, partition: tuple[str | None, ...], *, relayout: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, owners, runs)``: the byte ranges of ``spec`` each writing process owns
        (tensor-relative starts, sorted, tiling the tensor) and, per process, the runs it
        writes in place (``pwritev`` calls on local disk).

        A dimension is split into ``ceil(dim / axis size)`` blocks (the last ones shorter or
        empty, as jax's uneven shardings); a process owns the box of its devices' blocks; of
        processes holding the same box the lowest writes it (replica 0). When boxes cut the
        columns, local disk writes one run per row; with ``relayout`` (object stores) each
        writer's bytes are one contiguous block of rows instead, in process order, its share
        (the ranges returned either way; ``runs`` counts the rows without ``relayout``).
        """
        lo0, hi0, lo1, hi1 = _COORDS_CACHE.setdefault(self, self.coords())
        shape = spec.shape
        item = _dtypes.bits(spec.dtype) // 8
        n = self.processes
        boxes = []
        for dim in range(2):
            if dim >= len(shape):
                boxes.append((np.zeros(n, np.int64), np.ones(n, np.int64), 1))
                continue
            size = shape[dim]
            axis = partition[dim] if dim < len(partition) else None
            if axis is None:
                boxes.append((np.zeros(n, np.int64), np.full(n, size, np.int64), size))
                continue
            k = self.names.index(axis)
            block = -(-size // self.sizes[k])
            first, last = (lo0, hi0) if k == 0 else (lo1, hi1)
            a = np.minimum(first * block, size)
            b = np.minimum((last + 1) * block, size)
            boxes.append((a, b, size))
        (r0, r1, _), (k0, k1, cols) = boxes
        rest = math.prod(shape[2:]) * item
        key = np.stack([r0, r1, k0, k1], axis=1)
        _, first_of = np.unique(key, axis=0, return_index=True)
        writers = np.sort(first_of)
        writers = writers[(r1[writers] > r0[writers]) & (k1[writers] > k0[writers])]
        share = (r1 - r0)[writers] * (k1 - k0)[writers] * rest
        if int(share.sum()) != spec.nbytes:
            raise AssertionError(f"{spec.name}: boxes hold {share.sum()} of {spec.nbytes} bytes")
        full_rows = bool(((k0[writers] == 0) & (k1[writers] == cols)).all())
        runs = np.zeros(n, np.int64)
        if full_rows:
            starts = r0[writers] * cols * rest
            order = np.argsort(starts, kind="stable")
            runs[writers] = 1
            return starts[order], writers[order], runs
        runs[writers] = (r1 - r0)[writers]  # written in place: one run per row
        # (without ``relayout`` the byte ranges are runs per row: only their counts are kept)
        return np.cumsum(share) - share, writers, runs


_COORDS_CACHE: dict[Mesh, Any] = {}
