"""N processes save states of many same-shape tensors, each process's piece of a tensor far
under an upload window, to S3 and GCS; the save joins them on the devices (``core.relayout``,
``pipeline.relayout``). Each process reports the engine's counters beside what the simulation
(``benchmarks/scale_sim.plan_save``: no data, no JAX) plans for it, the device memory the
joins compiled to, and checks restores onto the saved and onto another sharding.

Args (``ctx.args``): ``roots`` (checkpoint root URLs), ``part_size``, ``max_file_size``,
``repo`` (the repository, for ``benchmarks``), ``matrices`` (how many 1 MiB matrices).
"""

import worker_lib

ctx = worker_lib.init()

import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import objstore_values as vals  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import upload_requests  # noqa: E402  (tests/helpers)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.core import metadata as core_metadata  # noqa: E402
from orbax_safetensors._src.core import plan as core_plan  # noqa: E402
from orbax_safetensors._src.pipeline import relayout as pipeline_groups  # noqa: E402
from orbax_safetensors._src.storage.objstore import spread  # noqa: E402
from orbax_safetensors._src.storage.objstore import upload_plan as up  # noqa: E402

sys.path.insert(0, ctx.args["repo"])
from benchmarks import scale_model, scale_sim  # noqa: E402

n = ctx.num_processes
mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
# Every tensor of a state has the state's partition (1-D ones its first entry), as in the
# simulation; ``matrices`` (80 by default) x 1 MiB f32 matrices (20 MiB per process at N = 4:
# one range of two S3 parts once joined, 64-256 KiB pieces before), 24 bf16 ones and 16 norms
# (small groups: each written whole by one process).
PARTITIONS = {"rows": ("data", "model"), "cols": ("model", "data")}
SHAPES = (
    [(f"w{i:03d}", (512, 512), np.float32) for i in range(ctx.args.get("matrices", 80))]
    + [(f"h{i:02d}", (256, 512), vals.BF16) for i in range(24)]
    + [(f"n{i:02d}", (512,), np.float32) for i in range(16)]
)


def spec_of(partition, shape):
    return P(*partition[: len(shape)])


def build(partition) -> dict:
    tree = {}
    for name, shape, dtype in SHAPES:
        value = vals.value(name, shape, dtype, 0)
        sharding = NamedSharding(mesh, spec_of(partition, shape))
        tree[name] = jax.make_array_from_callback(shape, sharding, lambda i, v=value: v[i])
    return tree


def mixed_bytes(plan) -> int:
    # bytes of the windows several processes' bytes make up (built by one of them)
    return sum(int((f.wstop() - f.wstart)[~f.pure].sum()) for f in plan.files if f.whole_owner < 0)


def simulated(partition, kind, part_size, max_file_size, joined=True) -> dict:
    specs = core_plan.specs_of((name, np.dtype(dtype), shape) for name, shape, dtype in SHAPES)
    sim_mesh = scale_model.Mesh(("data", "model"), (n, 2), n, 2)
    _, owners, _ = scale_sim.plan_save(
        specs,
        sim_mesh,
        partition,
        joined=joined,
        max_file_size=max_file_size,
        metadata=dict(core_metadata.HEADER_METADATA),
    )
    return executed(up.plan_uploads(kind, up.UploadLimits(part_size=part_size), owners, n))


def executed(plan) -> dict:
    mine = upload_requests.requests_of(plan, jax.process_index())
    return {
        "bytes_uploaded": sum(r.upload for r in mine),
        "bytes_fetched": sum(r.download for r in mine),
        "requests": {k.value: sum(r.kind is k for r in mine) for k in upload_requests.RequestKind},
        "mixed_bytes": mixed_bytes(plan),
    }


def join_memory(partition) -> dict:
    # What one group's join compiles to on a device: its collectives and buffers.
    tree = build(partition)
    names = [name for name, _, _ in SHAPES if name.startswith("w")]
    xs = [tree[name] for name in names]
    group = pipeline_groups.array_groups(
        [x.shape for x in xs], ["F32"] * len(xs), [pipeline_groups.group_key(x, "F32") for x in xs]
    )[0]
    members = [xs[i] for i in group.members]
    rows = jax.sharding.Mesh(np.array(list(mesh.devices.flat)), ("rows",))
    target = NamedSharding(rows, P("rows"))
    compiled = jax.jit(pipeline_groups._concat, out_shardings=target).lower(*members).compile()
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    return {
        "all_gather": text.count("all-gather"),
        "all_to_all": text.count("all-to-all"),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "group_bytes": group.nbytes,
        "devices": group.devices,
    }


part_size, max_file_size = ctx.args["part_size"], ctx.args["max_file_size"]
io = osf.IOOptions(object_store=osf.ObjectStoreOptions(part_size=part_size))
handler = osf.SafetensorsCheckpointHandler(max_file_size=max_file_size, io_options=io)
report: dict = {
    "process": jax.process_index(),
    "saves": [],
    "join": join_memory(PARTITIONS["rows"]),
}
for root in ctx.args["roots"]:
    kind = up.StoreKind.S3 if root.startswith("s3://") else up.StoreKind.GCS
    for label, partition in PARTITIONS.items():
        options = osf.manager_options_for(root, max_to_keep=1, enable_async_checkpointing=True)
        with ocp.CheckpointManager(
            f"{root}/{label}", options=options, item_handlers=handler
        ) as mngr:
            osf.object_store_stats(reset=True)
            mngr.save(0, args=osf.SafetensorsSave(build(partition)))
            mngr.wait_until_finished()
            measured = dataclasses.asdict(osf.object_store_stats(reset=True))
            plan, me = spread.last_plan()
            bad = []
            # onto the saved sharding and another one whose across-process axis cuts the first
            # dimension (restores onto column stripes: many device moves in a row, covered by
            # tests/multihost/test_relayout_moves.py)
            other = ("data", None) if label == "rows" else PARTITIONS["rows"]
            restores = (partition, other) if label == "rows" else (other,)
            for restore_partition in restores:
                target = {
                    name: jax.ShapeDtypeStruct(
                        shape,
                        dtype,
                        sharding=NamedSharding(mesh, spec_of(restore_partition, shape)),
                    )
                    for name, shape, dtype in SHAPES
                }
                restored = mngr.restore(0, args=osf.SafetensorsRestore(target))
                bad += [
                    (name, restore_partition)
                    for name, shape, dtype in SHAPES
                    if not all(
                        np.array_equal(
                            np.asarray(s.data), vals.value(name, shape, dtype, 0)[s.index]
                        )
                        for s in restored[name].addressable_shards
                    )
                ]
        report["saves"].append(
            {
                "root": root,
                "state": label,
                "measured": measured,
                "executed": executed(plan),
                "simulated": simulated(partition, kind, part_size, max_file_size),
                "unjoined": simulated(partition, kind, part_size, max_file_size, joined=False),
                "checkpoint_bytes": plan and sum(f.size for f in plan.files),
                "bad": bad,
            }
        )
worker_lib.emit_result(report)
worker_lib.finish()
