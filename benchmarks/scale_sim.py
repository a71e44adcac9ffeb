#!/usr/bin/env python
"""Simulates one checkpoint save by N processes with the real planning code, without data.

Builds a model's training state as shapes only (bf16 parameters and f32 Adam moments), places
it on a two-axis mesh of N processes x 8 devices, and runs what every process of a real save
computes: the file plan (``core.plan.plan_files``, default file size), every process's bytes
of every file, and on object storage the upload plan
(``storage.objstore.upload_plan.plan_uploads``: part windows, their builders, loose bundles,
compose trees, the request list of every process). Prints one JSON object (``--json``) or a
table: per-process bytes uploaded and downloaded, requests, request totals by kind, part and
compose figures, the restore's header and metadata bytes, and the planning time.

Sharding: ``--mesh NAME=SIZE,NAME=SIZE`` is the mesh (row-major; process p holds devices
8p..8p+7; a size ``N`` is the process count; default ``fsdp=N,tp=8``); ``--sharding A,B`` the
partition spec of every tensor's first two dimensions (mesh axis names, or ``none``); a 1-D
tensor takes ``A`` only. Dimensions split unevenly get ceil-sized blocks. ``fsdp,tp`` cuts rows
across hosts (one range per tensor and process); ``tp,fsdp`` cuts columns across hosts: on
object storage each process's bytes of such a tensor are modelled as one contiguous block of
rows of its share size (the save-side re-layout of issue 27 point 2); on local disk as one
run per row.

Example::

    python benchmarks/scale_sim.py --processes 1024 --model llama3-70b --store gs --sharding fsdp,tp --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from benchmarks.scale_model import MODELS, Mesh, model_specs  # noqa: E402
from orbax_safetensors._src.core import metadata as _metadata  # noqa: E402
from orbax_safetensors._src.core import plan as _plan  # noqa: E402
from orbax_safetensors._src.core import relayout as _relayout  # noqa: E402
from orbax_safetensors._src.storage.objstore import upload_plan as _up  # noqa: E402

sys.path.insert(0, str(HERE.parent / "tests" / "helpers"))
import upload_requests as _ur  # noqa: E402  (the requests of a plan, as the tests count them)

STORES = {"s3": _up.StoreKind.S3, "gs": _up.StoreKind.GCS, "local": None}


def _partition(text: str) -> tuple[str | None, str | None]:
    names = [None if p.strip().lower() in ("none", "") else p.strip() for p in text.split(",")]
    if len(names) != 2:
        raise SystemExit(f"--sharding wants two entries like fsdp,tp, got {text!r}")
    return names[0], names[1]


def ownership(
    plan: _plan.CheckpointPlan,
    specs: list[_plan.TensorSpec],
    mesh: Mesh,
    partition: tuple[str | None, str | None],
    *,
    relayout: bool,
    primary: int = 0,
    groups: list[_relayout.ConcatGroup] | None = None,
) -> tuple[list[_up.FileOwners], np.ndarray]:
    """Every file's owners (headers by the primary) and each process's in-place write runs;
    the members of ``groups`` (positions in ``specs``) as the save's joined row blocks."""
    by_name = {s.name: s for s in specs}
    joined = grouped_owners(specs, mesh, groups or [])
    cache: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    runs = np.zeros(mesh.processes, np.int64)
    out = []
    for f in plan.files:
        starts = [np.zeros(1, np.int64)]
        owners = [np.full(1, primary, np.int64)]
        runs[primary] += 1
        for entry in sorted(f.entries.values(), key=lambda e: e.begin):
            if entry.name in joined:
                rel, own = joined[entry.name]
                starts.append(f.data_start + entry.begin + rel)
                owners.append(own)
                runs[own] += 1
                continue
            spec = by_name[entry.name]
            spec_partition = partition[: len(spec.shape)]
            key = (spec.shape, spec.dtype, spec_partition)
            if key not in cache:
                cache[key] = mesh.owners(spec, spec_partition, relayout=relayout)
            rel, own, tensor_runs = cache[key]
            starts.append(f.data_start + entry.begin + rel)
            owners.append(own)
            runs += tensor_runs
        s, o = np.concatenate(starts), np.concatenate(owners)
        keep = np.append(True, o[1:] != o[:-1])
        out.append(_up.FileOwners(f.filename, f.size, s[keep], o[keep]))
    return out, runs


def grouped_owners(
    specs: list[_plan.TensorSpec], mesh: Mesh, groups: list[_relayout.ConcatGroup]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each group member's ``(tensor-relative starts, owners)``: the joined rows spread over
    the mesh's devices in order (process ``p`` holds devices ``p * devices`` onwards)."""
    out = {}
    process_of_device = np.arange(mesh.processes * mesh.devices) // mesh.devices
    for g in groups:
        if g.writer >= 0:  # small: written whole by one process
            for member in g.members:
                out[specs[member].name] = (np.zeros(1, np.int64), np.array([g.writer]))
            continue
        runs = sorted(
            (a, b, p) for p, ranges in g.process_rows(process_of_device).items() for a, b in ranges
        )
        a_p = np.array([r[0] for r in runs], np.int64)
        b_p = np.array([r[1] for r in runs], np.int64)
        procs = np.array([r[2] for r in runs], np.int64)
        for j, member in enumerate(g.members):
            a = np.clip(a_p - j * g.rows, 0, g.rows)
            b = np.clip(b_p - j * g.rows, 0, g.rows)
            keep = b > a
            out[specs[member].name] = (a[keep] * g.row_bytes, procs[keep])
    return out


def _stat(values: np.ndarray) -> dict[str, float]:
    return {
        "max": int(values.max()),
        "mean": round(float(values.mean()), 1),
        "min": int(values.min()),
        "argmax": int(values.argmax()),
    }


def plan_save(
    specs: list[_plan.TensorSpec],
    mesh: Mesh,
    partition: tuple[str | None, str | None],
    *,
    joined: bool,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
    metadata: dict[str, str] | None = None,
) -> tuple[_plan.CheckpointPlan, list[_up.FileOwners], np.ndarray]:
    """What every process of a save of ``specs`` plans: the file plan, each file's owners,
    each process's in-place write runs. ``joined`` (object storage): the save joins
    ``core.relayout``' groups on the devices (every tensor is a ``jax.Array`` sharded by
    ``partition`` on ``mesh``, so its key is its shape, dtype and partition) and places their
    members next to each other in the files, as the real save does. ``metadata``: each
    header's ``__metadata__``."""
    groups: list[_relayout.ConcatGroup] = []
    ordered = specs
    if joined and mesh.processes > 1:
        keys = [(s.shape, s.dtype, partition[: len(s.shape)]) for s in specs]
        ordered = [specs[i] for i in _relayout.file_order(keys)]
        groups = _relayout.concat_groups(
            [s.shape for s in specs],
            [s.dtype for s in specs],
            keys,
            mesh.processes,
            mesh.processes * mesh.devices,
        )
    plan = _plan.plan_files(ordered, max_file_size=max_file_size, metadata=metadata)
    owners, runs = ownership(plan, specs, mesh, partition, relayout=joined, groups=groups)
    return plan, owners, runs


def metadata_bytes(
    plan: _plan.CheckpointPlan, specs: list[_plan.TensorSpec], mesh: Mesh, partition: Any
) -> int:
    """Bytes of ``orbax_safetensors.json`` for this plan: the real document, with each tensor's
    sharding description (device ids kept once) and a CRC32C."""
    ids = list(range(mesh.processes * mesh.devices))
    desc = {"mesh_axes": list(mesh.names), "mesh_shape": list(mesh.sizes), "device_ids": ids}
    shardings = {s.name: {**desc, "spec": list(partition[: len(s.shape)])} for s in specs}
    schema = {s.name: {"kind": "jax.Array"} for s in specs}
    doc = _metadata.build_metadata(plan, specs, schema, shardings, {})
    for info in doc["tensors"].values():
        info["crc32c"] = "0123abcd"
    return len(json.dumps(doc))


def simulate(
    processes: int,
    model: str,
    store: str,
    sharding: str,
    mesh_text: str | None = None,
    devices: int = 8,
    part_size: int = 64 << 20,
    max_file_size: int | None = _plan.DEFAULT_MAX_FILE_SIZE,
) -> dict[str, Any]:
    """The simulation's figures (what ``--json`` prints)."""
    mesh = Mesh.parse(mesh_text or "fsdp=N,tp=8", processes, devices)
    partition = _partition(sharding)
    kind = STORES[store]
    specs = model_specs(model)
    started = time.perf_counter()
    plan, owners, runs = plan_save(
        specs, mesh, partition, joined=kind is not None, max_file_size=max_file_size
    )
    out: dict[str, Any] = {
        "processes": processes,
        "devices_per_process": devices,
        "model": model,
        "store": store,
        "mesh": dict(zip(mesh.names, mesh.sizes)),
        "sharding": list(partition),
        "tensors": len(specs),
        "checkpoint_bytes": plan.total_size,
        "files": len(plan.files),
        "file_bytes": sum(f.size for f in plan.files),
    }
    if kind is None:
        seconds = time.perf_counter() - started
        owned = np.zeros(processes, np.int64)
        for f in owners:
            owned += np.bincount(
                f.owners, weights=f.stops() - f.starts, minlength=processes
            ).astype(np.int64)
        zero = np.zeros(processes, np.int64)
        out.update(
            per_process_upload_bytes=_stat(owned),
            per_process_download_bytes=_stat(zero),
            per_process_requests=_stat(runs),
            total_requests={"pwritev": int(runs.sum())},
            total_object_writes=0,
        )
    else:
        limits = _up.UploadLimits(part_size=part_size)
        uplan = _up.plan_uploads(kind, limits, owners, processes)
        seconds = time.perf_counter() - started
        t = _ur.tally(uplan)
        total = t.total_requests()
        parts_max, min_part = _ur.part_figures(uplan)
        moved = t.upload + t.download
        by_kind = {k.value: int(v.sum()) for k, v in t.requests.items() if v.sum()}
        writes = sum(int(t.requests[k].sum()) for k in _ur.WRITE_KINDS)
        share = plan.total_size / processes
        out.update(
            per_process_upload_bytes=_stat(t.upload),
            per_process_download_bytes=_stat(t.download),
            per_process_moved_bytes=_stat(moved),
            per_process_moved_over_share=round(float(moved.max()) / share, 3),
            per_process_requests=_stat(total),
            # every process but the primary, whose commit is a few requests per file
            per_process_requests_but_primary={
                **_stat(np.delete(total, 0)),
                "argmax": int(np.delete(total, 0).argmax()) + 1,
            },
            primary={
                "upload_bytes": int(t.upload[0]),
                "download_bytes": int(t.download[0]),
                "requests": int(total[0]),
            },
            total_requests=by_kind,
            total_object_writes=writes,
            mixed_window_bytes=uplan.mixed_target,
            windows=sum(f.windows for f in uplan.files),
            parts_per_upload_max=parts_max,
            min_part_bytes=min_part,
            compose_depth=_ur.compose_depth(uplan),
            compose_sources_max=_ur.largest_compose(uplan) if kind is _up.StoreKind.GCS else 0,
        )
    meta = metadata_bytes(plan, specs, mesh, partition)
    if kind is not None:
        # issue 27 point 1: 1.25 x (checkpoint bytes / N) + 2 part windows + metadata
        out["share_bound_bytes"] = int(1.25 * plan.total_size / processes + 2 * part_size + meta)
    out.update(
        restore_header_bytes_per_process=0,  # offsets come from orbax_safetensors.json
        metadata_bytes=meta,
        index_bytes=len(json.dumps(plan.index_json())) if len(plan.files) > 1 else 0,
        plan_seconds_per_process=round(seconds, 3),
    )
    return out


def _table(r: dict[str, Any]) -> str:
    gb = 1e9
    lines = [
        f"{r['model']} on {r['processes']} processes x {r['devices_per_process']} devices, "
        f"mesh {r['mesh']}, sharding {r['sharding']}, store {r['store']}",
        f"checkpoint {r['checkpoint_bytes'] / gb:.1f} GB in {r['files']} files, {r['tensors']} tensors",
    ]
    for key in ("per_process_upload_bytes", "per_process_download_bytes"):
        s = r[key]
        lines.append(f"{key:32s} max {s['max'] / 1e6:10.1f} MB  mean {s['mean'] / 1e6:10.1f} MB")
    s = r["per_process_requests"]
    lines.append(f"{'per_process_requests':32s} max {s['max']:10d}     mean {s['mean']:10.1f}")
    for key in (
        "total_requests",
        "total_object_writes",
        "parts_per_upload_max",
        "min_part_bytes",
        "compose_depth",
        "compose_sources_max",
        "restore_header_bytes_per_process",
        "metadata_bytes",
        "plan_seconds_per_process",
    ):
        if key in r:
            lines.append(f"{key:32s} {r[key]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "Sharding: --mesh NAME=SIZE,NAME=SIZE (default fsdp=N,tp=8; N = --processes) and "
            "--sharding A,B, the partition spec of each tensor's first two dimensions. "
            "A sharding whose across-host axis is not the first (tp,fsdp) is modelled on "
            "object storage with the save-side re-layout: each process's bytes of such a "
            "tensor are one contiguous block of rows, its share (local: one run per row)."
        ),
    )
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--model", choices=MODELS, default="llama3-70b")
    parser.add_argument("--store", choices=sorted(STORES), default="gs")
    parser.add_argument("--sharding", default="fsdp,tp")
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--devices", type=int, default=8, help="devices per process")
    parser.add_argument("--part-size", type=int, default=64 << 20)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = simulate(
        args.processes,
        args.model,
        args.store,
        args.sharding,
        args.mesh,
        args.devices,
        args.part_size,
    )
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
