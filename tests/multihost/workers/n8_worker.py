"""N processes save ``n8_values``' state through a CheckpointManager and restore it resharded.

Args (``ctx.args``): ``saves``: root URLs or directories to save step ``n8_values.STEP`` into
(async manager, ``max_to_keep=1``); ``restores``: roots to restore that step from (after the
saves), onto the restore shardings of ``n8_values.SHARDED`` over this job's devices in reverse
order. Each process reports, per root, the byte ranges it wrote and its object-store counters,
and per restore the tensors whose shards (every one it holds) or sharding are wrong.
"""

import time

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import n8_values as V  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402


def meshes(devices: list) -> dict[str, Mesh]:
    d = np.array(devices)
    return {"1d": Mesh(d, ("x",)), "2d": Mesh(d.reshape(-1, 2), ("a", "b"))}


saved_on, restored_on = meshes(jax.devices()), meshes(jax.devices()[::-1])


def sharding(on: dict[str, Mesh], placement: tuple[str, tuple]) -> NamedSharding:
    kind, spec = placement
    return NamedSharding(on[kind], P(*spec))


def state() -> dict:
    tree: dict = {}
    for name, (shape, _, saved, _) in V.SHARDED.items():
        v = V.value(name)
        tree[name] = jax.make_array_from_callback(
            shape, sharding(saved_on, saved), lambda i, v=v: v[i]
        )
    tree.update({name: V.value(name) for name in V.HOST})
    tree["step"] = V.STEP
    return tree


def target() -> dict:
    tree: dict = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding(restored_on, placement))
        for name, (shape, dtype, _, placement) in V.SHARDED.items()
    }
    tree.update({name: np.zeros(shape, dtype) for name, (shape, dtype) in V.HOST.items()})
    tree["step"] = 0
    return tree


def wrong(restored: dict, want: dict) -> list[str]:
    bad = [
        name
        for name in V.SHARDED
        if restored[name].sharding != want[name].sharding
        or not all(
            np.array_equal(np.asarray(s.data), V.value(name)[s.index])
            for s in restored[name].addressable_shards
        )
    ]
    bad += [n for n in V.HOST if not np.array_equal(restored[n], V.value(n))]
    return bad + ([] if restored["step"] == V.STEP else ["step"])


handler = osf.SafetensorsCheckpointHandler()
report: dict = {"process": jax.process_index(), "saves": {}, "restores": {}}
for root in ctx.args.get("saves", []):
    options = osf.manager_options_for(root, max_to_keep=1)
    osf.object_store_stats(reset=True)
    start = time.perf_counter()
    with ocp.CheckpointManager(root, options=options, item_handlers=handler) as mngr:
        mngr.save(V.STEP, args=osf.SafetensorsSave(state()))
        mngr.wait_until_finished()
    stats = osf.object_store_stats(reset=True)
    report["saves"][root] = {
        "seconds": round(time.perf_counter() - start, 2),
        "ranges": handler.last_write_stats.ranges,
        "uploaded": stats.bytes_uploaded,
        "requests": stats.requests,
        "reassembled": stats.bytes_reassembled,
    }
for root in ctx.args.get("restores", []):
    want = target()
    start = time.perf_counter()
    options = osf.manager_options_for(root)
    with ocp.CheckpointManager(root, options=options, item_handlers=handler) as mngr:
        restored = mngr.restore(V.STEP, args=osf.SafetensorsRestore(want))
    report["restores"][root] = {
        "seconds": round(time.perf_counter() - start, 2),
        "bad": wrong(restored, want),
        "read_stats": vars(handler.last_read_stats) if handler.last_read_stats else None,
    }
worker_lib.emit_result(report)
worker_lib.finish()
