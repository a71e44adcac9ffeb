"""Multi-process benchmark worker: async CheckpointManager save, then two kinds of restore.

Started by ``benchmarks/multihost_bench.py`` through ``tests/multihost/launcher.run_workers``.
Every process builds the same LLaMA-like state (2-D float32 tensors sharded ``P('data', None)``
over an ``(N, 2)`` mesh), saves it ``repeats`` times (one step each) and restores every step
(a) with the save sharding and (b) with ``P(None, 'model')`` on the transposed ``(2, N)`` mesh.
Restored shards are compared with the source bytes. Timed phases start after a global barrier.

Args (``ctx.args``): ``root`` (CheckpointManager directory), ``size`` (target total bytes),
``repeats``.
"""

import time

import worker_lib

ctx = worker_lib.init()

import math  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

pid = jax.process_index()
nproc = jax.process_count()


def shapes(size: int, n: int) -> dict[str, tuple[int, int]]:
    """LLaMA-like 2-D tensors (14 d^2 float32 in all) with d a multiple of 8*lcm(n, 2).

    Example: ``shapes(64 << 20, 2)`` -> ``{"embed": (4d, d), ..., "mlp.down": (2d, d)}``.
    """
    unit = 8 * math.lcm(n, 2)
    d = max(unit, int(math.sqrt(size / 4 / 14)) // unit * unit)
    return {
        "embed": (4 * d, d),
        "attn.q": (d, d),
        "attn.k": (d, d),
        "attn.v": (d, d),
        "attn.o": (d, d),
        "mlp.gate": (d, 2 * d),
        "mlp.up": (d, 2 * d),
        "mlp.down": (2 * d, d),
    }


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        node = out
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def barrier(name: str) -> None:
    multihost_utils.sync_global_devices(name)


def check(restored: dict[str, Any], source: dict[str, np.ndarray], want: dict[str, Any]) -> int:
    """Number of addressable shards whose bytes or sharding differ from the source."""
    bad = 0
    for name, leaf in flatten(restored).items():
        if leaf.sharding != want[name]:
            bad += 1
            continue
        for s in leaf.addressable_shards:
            bad += not np.array_equal(np.asarray(s.data), source[name][s.index])
    return bad


def main(args: dict[str, Any]) -> dict[str, Any]:
    devices = np.array(jax.devices()).reshape(nproc, -1)
    save_mesh = Mesh(devices, ("data", "model"))
    other_mesh = Mesh(devices.T, ("data", "model"))
    specs = shapes(args["size"], nproc)
    rng = np.random.default_rng(0)
    source = {n: rng.standard_normal(s, dtype=np.float32) for n, s in specs.items()}
    same = {n: NamedSharding(save_mesh, P("data", None)) for n in specs}
    other = {n: NamedSharding(other_mesh, P(None, "model")) for n in specs}

    def abstract(shardings: dict[str, Any]) -> dict[str, Any]:
        return nest(
            {
                n: jax.ShapeDtypeStruct(s, np.float32, sharding=shardings[n])
                for n, s in specs.items()
            }
        )

    handler = osf.SafetensorsCheckpointHandler()
    options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(args["root"], item_handlers=handler, options=options)
    saves: list[dict[str, Any]] = []
    for step in range(args["repeats"]):
        state = nest(
            {
                n: jax.make_array_from_callback(a.shape, same[n], lambda idx, a=a: a[idx])
                for n, a in source.items()
            }
        )
        jax.block_until_ready(state)
        barrier(f"save{step}")
        t0 = time.perf_counter()
        mngr.save(step, args=osf.SafetensorsSave(state))
        t1 = time.perf_counter()
        mngr.wait_until_finished()
        t2 = time.perf_counter()
        os.sync()
        t3 = time.perf_counter()
        ws = handler.last_write_stats
        saves.append(
            {
                "blocking_s": t1 - t0,
                "total_s": t2 - t0,
                "sync_s": t3 - t2,
                "bytes_written": ws.bytes_written,
                "header_bytes": ws.header_bytes,
            }
        )
        del state
    restores: dict[str, list[dict[str, Any]]] = {"same": [], "other": []}
    for step in range(args["repeats"]):
        for mode, shardings in (("same", same), ("other", other)):
            barrier(f"restore{step}{mode}")
            t0 = time.perf_counter()
            restored = mngr.restore(step, args=osf.SafetensorsRestore(abstract(shardings)))
            jax.block_until_ready(restored)
            t1 = time.perf_counter()
            rs = handler.last_read_stats
            restores[mode].append(
                {
                    "time_s": t1 - t0,
                    "bytes_needed": rs.bytes_needed,
                    "bytes_read": rs.bytes_read,
                    "requests": rs.requests,
                    "bad_shards": check(restored, source, shardings),
                }
            )
            del restored
    mngr.close()
    return {
        "process_index": pid,
        "process_count": nproc,
        "shapes": {n: list(s) for n, s in specs.items()},
        "total_bytes": sum(a.nbytes for a in source.values()),
        "saves": saves,
        "restores": restores,
    }


worker_lib.emit_result(main(ctx.args))
worker_lib.finish()
