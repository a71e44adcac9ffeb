"""Multi-host checkpoint worker: async CheckpointManager saves with SafetensorsSave, then
restores of this job's checkpoint and of another process count's, in several target forms.

Every process reports what it wrote (byte ranges, checked here against the shards it owns) and,
per restore, the problems found (empty when every addressable shard is right), the bytes read
against the bytes needed (both from the handler's ReadStats and from an independent byte-mask
oracle built from the files' headers), and what the restored leaves look like.

Each saved state's jax.Arrays are deleted as soon as ``save()`` returns (before the async
writes finish): the host copies must already be complete.

Args (``ctx.args``):
  save_root: CheckpointManager directory to save into (or null: no save).
  save_steps: steps to save (values depend on the step); max_to_keep; max_file_size.
  restores: list of ``{"root", "step", "saved_processes", "modes"}``; modes among
    ``"other_mesh"`` (ShapeDtypeStructs on a transposed mesh with other partition specs),
    ``"restore_args"`` (``ocp.checkpoint_utils.construct_restore_args`` of this job's save
    layout), ``"no_target"``, ``"no_sharding"`` (ShapeDtypeStructs without shardings) and
    ``"partial"`` (two large tensors only, ``partial_restore=True``) and ``"select"`` (the
    whole target on the other mesh, ``include`` / ``exclude`` choosing two tensors and a
    scalar; every other leaf must come back as given).
  v1_path: (optional) also save a globally sharded tree once through Orbax's v1 API
    (``ocp.v1.save`` with ``osf.local_registry()``) into this directory and load it back onto
    a sharded abstract tree; reported as ``result["v1"]`` (``{"skipped": reason}`` on an
    orbax-checkpoint without the v1 API).
  dtype_root: (optional) also save once under ``dtype=bfloat16`` into this root and restore
    it into the float32 target on the other mesh; reported as ``result["dtype_save"]``.
"""

import time

import worker_lib

_T0 = time.monotonic()
ctx = worker_lib.init()
_T_INIT = time.monotonic()

import itertools  # noqa: E402
import json  # noqa: E402
import struct  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import mh_common as C  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

MAX_GAP = 4096  # the reader's documented gap-coalescing threshold (core/runs.DEFAULT_MAX_GAP)
ITEM = "default"  # CheckpointManager's item directory for a single (non-Composite) item

_T_IMPORT = time.monotonic()
pid = jax.process_index()
nproc = jax.process_count()
timings: dict[str, float] = {
    "init": round(_T_INIT - _T0, 3),
    "imports": round(_T_IMPORT - _T_INIT, 3),
}


def timed(label: str, t0: float) -> None:
    timings[label] = round(time.monotonic() - t0, 3)


# ----------------------------------------------------------------------------- file oracle


def read_headers(item_dir: Path) -> dict[str, tuple[str, int, str, tuple[int, ...]]]:
    """tensor name -> (file name, absolute begin offset, dtype, shape), parsed here by hand."""
    out = {}
    for f in sorted(item_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (
                    f.name,
                    8 + n + info["data_offsets"][0],
                    info["dtype"],
                    tuple(info["shape"]),
                )
    return out


def box_bytes(shape: tuple[int, ...], dtype: np.dtype, index: tuple[slice, ...]) -> np.ndarray:
    """Byte offsets (inside the row-major tensor) of every byte of the box ``index``."""
    itemsize = np.dtype(dtype).itemsize
    all_bytes = np.arange(int(np.prod(shape)) * itemsize, dtype=np.int64)
    return all_bytes.reshape(*shape, itemsize)[tuple(index)].reshape(-1)


def intervals(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in a boolean mask."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


class Masks:
    """One boolean byte mask per file of a checkpoint step."""

    def __init__(self, item_dir: Path, stored_dtypes: bool = False) -> None:
        # stored_dtypes: mark boxes in the files' dtypes (a save under a dtype policy)
        self.stored_dtypes = stored_dtypes
        self.headers = read_headers(item_dir)
        self.masks = {
            f.name: np.zeros(f.stat().st_size, dtype=bool) for f in item_dir.glob("*.safetensors")
        }

    def mark(self, name: str, index: tuple[slice, ...] | None) -> None:
        fname, begin, stored, shape = self.headers[name]
        s, dtype = C.tensor_shape_dtype(name)
        assert s == shape, (name, s, shape)
        if self.stored_dtypes:
            dtype = {"BF16": C.BF16, "I32": np.int32, "I8": np.int8}[stored]
        index = tuple(slice(0, d) for d in shape) if index is None else index
        self.masks[fname][begin + box_bytes(shape, dtype, index)] = True

    def ranges(self) -> list[tuple[str, int, int]]:
        return [(f, a, b - a) for f in sorted(self.masks) for a, b in intervals(self.masks[f])]

    def needed_and_slack(self) -> tuple[int, int]:
        needed = slack = 0
        for m in self.masks.values():
            runs = intervals(m)
            needed += sum(b - a for a, b in runs)
            slack += sum(c - b for (_, b), (c, _) in itertools.pairwise(runs) if c - b <= MAX_GAP)
        return needed, slack


def merge(ranges: list[Any]) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for f, off, n in sorted((r[0], int(r[1]), int(r[2])) for r in ranges):
        if out and out[-1][0] == f and out[-1][1] + out[-1][2] == off:
            out[-1] = (f, out[-1][1], out[-1][2] + n)
        else:
            out.append((f, off, n))
    return out


# ----------------------------------------------------------------------------- saving


def owned_boxes(state: dict[str, Any]) -> dict[str, list[tuple[slice, ...] | None]]:
    """What this process must write: replica-0 addressable shards; host leaves on the primary."""
    flat = C.flatten_dict(state)
    out: dict[str, list[Any]] = {}
    for name in C.SHARDED:
        out[name] = [s.index for s in flat[name].addressable_shards if s.replica_id == 0]
    for name in [*C.HOST_NUMPY, *C.HOST_JAX]:
        out[name] = [None] if pid == 0 else []
    return out


def save_all(args: dict[str, Any]) -> dict[str, Any]:
    root = Path(args["save_root"])
    handler = osf.SafetensorsCheckpointHandler(max_file_size=args.get("max_file_size"))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=args["max_to_keep"], enable_async_checkpointing=True
    )
    t0 = time.monotonic()
    mngr = ocp.CheckpointManager(root, item_handlers=handler, options=options)
    timed("save manager", t0)
    per_step: dict[int, Any] = {}
    t0 = time.monotonic()
    for step in args["save_steps"]:
        state = C.build_state(step)
        owned = owned_boxes(state)
        mngr.save(step, args=osf.SafetensorsSave(state, metadata={"step": step, "n": nproc}))
        stats = handler.last_write_stats
        # save() returned: host copies are complete, so the caller may free its arrays now.
        for leaf in jax.tree_util.tree_leaves(state):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        per_step[step] = {"owned": owned, "stats": stats}
    mngr.wait_until_finished()
    timed("saves", t0)
    kept = list(mngr.all_steps())
    mngr.close()
    out: dict[str, Any] = {"kept_steps": kept, "steps": {}}
    for step in kept:
        item_dir = root / str(step) / ITEM
        masks = Masks(item_dir)
        for name, boxes in per_step[step]["owned"].items():
            for box in boxes:
                masks.mark(name, box)
        stats = per_step[step]["stats"]
        written = merge(stats.ranges)
        out["steps"][str(step)] = {
            "ranges": written,
            "bytes_written": stats.bytes_written,
            "header_bytes": stats.header_bytes,
            "owned_ranges": masks.ranges(),
            "writes_only_owned": written == masks.ranges(),
            "files": sorted(p.name for p in item_dir.iterdir()),
        }
    return out


# ----------------------------------------------------------------------------- restoring


def other_mesh() -> Mesh:
    """A mesh unlike the save meshes: ('a' = local device, 'b' = process), devices transposed."""
    devices = np.array(jax.devices()).reshape(nproc, -1).T
    return Mesh(devices, ("a", "b"))


OTHER_SPECS = {
    "params.emb": P("b", "a"),
    "params.w_col": P("b", None),
    "params.w_row": P(None, "a"),
    "params.bias": P("a"),
    "opt.count_vec": P(("b", "a")),
    "opt.mu": P(None, "b"),
    "opt.deep": P("a", "b", None),
    "big.rows": P("b", None),
    "big.cols": P(None, "b"),
}


def abstract_target(shardings: dict[str, Any] | None, names: list[str] | None = None) -> Any:
    """The restore target; ``shardings=None``: jax leaves without a sharding."""
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    flat: dict[str, Any] = {}
    for name, (shape, dtype, _, _) in C.SHARDED.items():
        if names is None or name in names:
            sharding = shardings[name] if shardings is not None else None
            flat[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    if names is None:
        for name, (shape, dtype) in C.HOST_NUMPY.items():
            flat[name] = np.zeros(shape, dtype)
        for name, (shape, dtype) in C.HOST_JAX.items():
            sharding = local if shardings is not None else None
            flat[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        flat.update(C.SCALARS)
    return C.nest(flat)


def check_tree(restored: Any, step: int, names: list[str] | None = None) -> list[str]:
    flat = C.flatten_dict(restored)
    problems: list[str] = []
    expected_names = (
        set(names)
        if names is not None
        else (set(C.SHARDED) | set(C.HOST_NUMPY) | set(C.HOST_JAX) | set(C.SCALARS))
    )
    if set(flat) != expected_names:
        problems.append(f"keys {sorted(flat)} != {sorted(expected_names)}")
    for name in expected_names & set(flat):
        leaf = flat[name]
        if name in C.SCALARS:
            want = C.scalars(step)[name]
            if leaf != want or type(leaf) is not type(want):
                problems.append(f"{name}: {leaf!r} != {want!r}")
            continue
        if name in C.HOST_NUMPY and not isinstance(leaf, np.ndarray):
            problems.append(f"{name}: host leaf came back as {type(leaf).__name__}")
        if name in C.HOST_JAX and not (isinstance(leaf, jax.Array) and leaf.is_fully_addressable):
            problems.append(f"{name}: host-local jax.Array came back as {leaf!r}")
        if name in C.SHARDED and not isinstance(leaf, jax.Array):
            problems.append(f"{name}: came back as {type(leaf).__name__}")
        problems.extend(C.check_array(name, leaf, step))
    return problems


def oracle_reads(item_dir: Path, restored: Any) -> tuple[int, int]:
    """(needed, coalescing slack) of this process for ``restored``'s leaves, from byte masks."""
    masks = Masks(item_dir)
    for name, leaf in C.flatten_dict(restored).items():
        if name in C.SCALARS:
            continue
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            boxes = {
                tuple((s.start, s.stop) for s in idx): idx
                for idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
            }
            for idx in boxes.values():
                masks.mark(name, idx)
        else:
            masks.mark(name, None)
    return masks.needed_and_slack()


def describe(restored: Any) -> dict[str, Any]:
    out = {}
    for name, leaf in C.flatten_dict(restored).items():
        if isinstance(leaf, jax.Array):
            s = leaf.sharding
            out[name] = {
                "type": "jax",
                "spec": str(s.spec) if isinstance(s, NamedSharding) else None,
                "mesh": dict(s.mesh.shape) if isinstance(s, NamedSharding) else None,
                "dtype": str(leaf.dtype),
            }
        else:
            out[name] = {"type": type(leaf).__name__}
    return out


def restore_one(spec: dict[str, Any]) -> dict[str, Any]:
    root, step = Path(spec["root"]), spec["step"]
    item_dir = root / str(step) / ITEM
    handler = osf.SafetensorsCheckpointHandler()
    t0 = time.monotonic()
    mngr = ocp.CheckpointManager(root, item_handlers=handler)
    timed(f"manager {spec['saved_processes']}", t0)
    out: dict[str, Any] = {}
    saved_specs = C.save_shardings()
    other = {n: NamedSharding(other_mesh(), OTHER_SPECS[n]) for n in C.SHARDED}
    for mode in spec["modes"]:
        t0 = time.monotonic()
        names = None
        res: dict[str, Any] = {}
        try:
            if mode == "other_mesh":
                restored = mngr.restore(step, args=osf.SafetensorsRestore(abstract_target(other)))
            elif mode == "restore_args":
                target = abstract_target(saved_specs)
                restore_args = ocp.checkpoint_utils.construct_restore_args(target)
                restored = mngr.restore(
                    step, args=osf.SafetensorsRestore(restore_args=restore_args)
                )
            elif mode == "no_target":
                restored = mngr.restore(step, args=osf.SafetensorsRestore())
            elif mode == "no_sharding":  # ShapeDtypeStructs without shardings
                restored = mngr.restore(step, args=osf.SafetensorsRestore(abstract_target(None)))
            elif mode == "partial":
                names = ["big.rows", "big.cols"]
                target = abstract_target(other, names)
                restored = mngr.restore(
                    step, args=osf.SafetensorsRestore(target, partial_restore=True)
                )
            elif mode == "select":
                names = ["big.rows", "params.bias", "step_count"]
                target = abstract_target(other)
                args = osf.SafetensorsRestore(
                    target, include=["big", "params.bias", "step_*"], exclude="big.cols"
                )
                flat = C.flatten_dict(mngr.restore(step, args=args))
                given = C.flatten_dict(target)
                res["not_as_given"] = [
                    n for n in given if n not in names and flat[n] is not given[n]
                ]
                restored = C.nest({n: flat[n] for n in names})
            else:
                raise ValueError(f"unknown mode {mode}")
        except osf.TargetMismatchError as e:
            res["error"] = f"{type(e).__name__}: {e}"
            out[mode] = res
            continue
        stats = handler.last_read_stats
        needed, slack = oracle_reads(item_dir, restored)
        res.update(
            problems=check_tree(restored, step, names),
            bytes_read=stats.bytes_read,
            bytes_needed=stats.bytes_needed,
            requests=stats.requests,
            header_reads=stats.header_reads,
            header_bytes=stats.header_bytes,
            metadata_bytes=stats.metadata_bytes,
            oracle_needed=needed,
            oracle_slack=slack,
            leaves=describe(restored),
        )
        timed(f"restore {spec['saved_processes']}:{step}:{mode}", t0)
        out[mode] = res
    mngr.close()
    return out


def v1_round_trip(path: str) -> dict[str, Any]:
    """One ``ocp.v1.save`` + ``ocp.v1.load`` through ``osf.SafetensorsHandler`` in this job."""
    try:
        registry = osf.local_registry()  # ImportError naming the version on an older Orbax
    except ImportError as e:
        return {"skipped": str(e)}
    from orbax.checkpoint import v1 as ocp_v1

    rows, cols = 8 * nproc, 6
    expected = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    mesh = Mesh(np.array(jax.devices()).reshape(nproc, -1), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", None))
    arr = jax.make_array_from_callback(expected.shape, sharding, lambda index: expected[index])
    tree = {"w": arr, "bias": np.arange(5, dtype=np.int32)}
    context = ocp_v1.Context()
    context.checkpointables.registry = registry
    t0 = time.monotonic()
    with context:
        ocp_v1.save(path, tree)
        abstract = {
            "w": jax.ShapeDtypeStruct(expected.shape, expected.dtype, sharding=sharding),
            "bias": jax.ShapeDtypeStruct((5,), np.int32),
        }
        loaded = ocp_v1.load(path, abstract)
    timed("v1 save+load", t0)
    return {
        "shards_ok": all(
            np.array_equal(np.asarray(s.data), expected[s.index])
            for s in loaded["w"].addressable_shards
        ),
        "sharding_ok": loaded["w"].sharding == sharding,
        "bias_ok": np.array_equal(np.asarray(loaded["bias"]), np.arange(5, dtype=np.int32)),
    }


def dtype_policy_save(root: Path) -> dict[str, Any]:
    """An async save under ``dtype=bfloat16`` (each process casts its own shards; arrays
    deleted once save() returns), restored into the float32 target on the other mesh."""
    import jax.numpy as jnp

    handler = osf.SafetensorsCheckpointHandler()
    mngr = ocp.CheckpointManager(root, item_handlers=handler)
    state = C.build_state(0)
    owned = owned_boxes(state)
    mngr.save(0, args=osf.SafetensorsSave(state, dtype=jnp.bfloat16))
    stats = handler.last_write_stats
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    mngr.wait_until_finished()
    masks = Masks(root / "0" / ITEM, stored_dtypes=True)
    for name, boxes in owned.items():
        for box in boxes:
            masks.mark(name, box)
    other = {n: NamedSharding(other_mesh(), OTHER_SPECS[n]) for n in C.SHARDED}
    restored = mngr.restore(0, args=osf.SafetensorsRestore(abstract_target(other)))
    mngr.close()
    return {
        "bytes_written": stats.bytes_written,
        "writes_only_owned": merge(stats.ranges) == masks.ranges(),
        "problems": check_tree(restored, 0),
        "leaves": describe(restored),
    }


result: dict[str, Any] = {"process_index": pid, "process_count": nproc}
if ctx.args.get("save_root"):
    result["save"] = save_all(ctx.args)
if ctx.args.get("v1_path"):
    result["v1"] = v1_round_trip(ctx.args["v1_path"])
if ctx.args.get("dtype_root"):
    result["dtype_save"] = dtype_policy_save(Path(ctx.args["dtype_root"]))
result["restores"] = [restore_one(r) for r in ctx.args.get("restores", [])]
result["timings"] = timings
worker_lib.emit_result(result)
worker_lib.finish()
