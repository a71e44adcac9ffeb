#!/usr/bin/env python
"""Object-storage benchmark: orbax-safetensors save/restore on S3 and GCS beside a plain client.

Starts SeaweedFS (S3) and fake-gcs-server (GCS) on 127.0.0.1 (the test fixtures' servers,
``tests/objstore``), then for each store and size, in one run and alternating order:

* ``boto3`` / ``google-cloud-storage``: upload and download of the very bytes of the
  checkpoint file (``upload_fileobj`` / ``download_fileobj`` with boto3's default transfer
  manager; ``upload_from_file`` / ``download_as_bytes`` for GCS), the vendor clients' plain path;
* ``osf.save_file`` / ``osf.load_file`` of the same pytree to ``s3://`` / ``gs://``;
* ``CheckpointManager`` save (async, ``wait_until_finished``) and restore with
  ``SafetensorsCheckpointHandler`` (includes Orbax's own metadata and commit-marker requests).

Reports the median MiB/s over ``--repeats`` and the requests our engine sent. Server and
client share this machine's cores, so the numbers compare methods, not storage services.

Example::

    python benchmarks/objstore_bench.py --sizes 64M,256M --repeats 3 --out benchmarks/results
    python benchmarks/objstore_bench.py --quick          # 32 MiB, 1 repeat, < 1 min

Writes ``objstore.md`` and ``objstore.json`` into ``--out`` when given.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "helpers")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from objstore import servers  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def make_tree(nbytes: int) -> dict[str, Any]:
    """Eight float32 tensors (and a few small ones) totalling about ``nbytes``."""
    import numpy as np

    rng = np.random.default_rng(0)
    cols = 1024
    rows = max(1, nbytes // 8 // (cols * 4))
    tree: dict[str, Any] = {
        f"layer{i}": {"w": rng.standard_normal((rows, cols), dtype=np.float32)} for i in range(8)
    }
    tree["bias"] = rng.standard_normal((4096,), dtype=np.float32)
    tree["step"] = 1
    return tree


class Vendor:
    """The vendor client's plain upload / download of one object."""

    def __init__(self, server: servers.ObjectStoreServer, bucket: str) -> None:
        self.kind = server.kind
        self.bucket = bucket.split("://", 1)[1]
        if self.kind == "s3":
            self.client = servers.s3_client(server)
        else:
            from google.cloud import storage

            self.client = storage.Client().bucket(self.bucket)

    def upload(self, key: str, data: bytes) -> None:
        if self.kind == "s3":
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, key)
        else:
            self.client.blob(key).upload_from_file(io.BytesIO(data), size=len(data))

    def download(self, key: str) -> bytes:
        if self.kind == "s3":
            out = io.BytesIO()
            self.client.download_fileobj(self.bucket, key, out)
            return out.getvalue()
        return self.client.blob(key).download_as_bytes()


def bench_store(server: servers.ObjectStoreServer, size: int, repeats: int) -> list[dict[str, Any]]:
    import numpy as np
    import orbax.checkpoint as ocp

    import orbax_safetensors as osf

    tree = make_tree(size)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "w.safetensors"
        osf.save_file(tree, local)
        data = local.read_bytes()
    nbytes = len(data)
    client_name = "boto3" if server.kind == "s3" else "google-cloud-storage"
    times: dict[str, list[float]] = {}
    requests: dict[str, list[int]] = {}

    def measure(name: str, fn: Callable[[], Any], ours: bool = True) -> Any:
        osf.object_store_stats(reset=True)
        start = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        if ours:
            requests.setdefault(name, []).append(osf.object_store_stats().requests)
        return result

    for r in range(repeats):
        order = ["vendor", "osf", "manager"] if r % 2 == 0 else ["manager", "osf", "vendor"]
        for method in order:
            # A fresh bucket per measurement, emptied right after: the servers keep every
            # object (fake-gcs-server in memory), so a run never holds more than one copy.
            bucket = servers.create_bucket(server)
            try:
                if method == "vendor":
                    vendor = Vendor(server, bucket)
                    key = "vendor.safetensors"
                    up = functools.partial(vendor.upload, key, data)
                    measure(f"{client_name} upload", up, ours=False)
                    down = functools.partial(vendor.download, key)
                    assert measure(f"{client_name} download", down, ours=False) == data
                elif method == "osf":
                    url = f"{bucket}/osf.safetensors"
                    measure("osf.save_file", functools.partial(osf.save_file, tree, url))
                    back = measure("osf.load_file", functools.partial(osf.load_file, url))
                    np.testing.assert_array_equal(
                        np.asarray(back["layer3"]["w"]), tree["layer3"]["w"]
                    )
                    del back
                else:
                    root = f"{bucket}/run"
                    options = osf.manager_options_for(root, max_to_keep=1)
                    with ocp.CheckpointManager(root, options=options) as mngr:

                        def save() -> None:
                            mngr.save(0, args=osf.SafetensorsSave(tree))
                            mngr.wait_until_finished()

                        measure("CheckpointManager save", save)
                        restore = functools.partial(mngr.restore, 0, args=osf.SafetensorsRestore())
                        measure("CheckpointManager restore", restore)
            finally:
                servers.delete_bucket(server, bucket)
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            {
                "store": "S3 (SeaweedFS)" if server.kind == "s3" else "GCS (fake-gcs-server)",
                "method": name,
                "bytes": nbytes,
                "seconds_median": round(median, 3),
                "mib_per_s": round(nbytes / MiB / median, 1),
                "requests": int(statistics.median(requests[name])) if name in requests else None,
                "repeats": len(values),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| store | method | size | median s | MiB/s | our requests |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        reqs = "" if r["requests"] is None else str(r["requests"])
        lines.append(
            f"| {r['store']} | {r['method']} | {r['bytes'] / MiB:.0f} MiB | "
            f"{r['seconds_median']} | {r['mib_per_s']} | {reqs} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256M", help="comma-separated, e.g. 64M,1G")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stores", default="s3,gcs")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 1 repeat")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [32 * MiB] if args.quick else [parse_size(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    kinds = [k.strip() for k in args.stores.split(",")]
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        server = servers.start_server(kind)  # type: ignore[arg-type]
        try:
            with servers.use_server(server), contextlib.redirect_stderr(io.StringIO()):
                for size in sizes:
                    new_rows = bench_store(server, size, repeats)
                    print(markdown(new_rows).split("\n", 2)[2], file=sys.__stdout__, flush=True)
                    rows += new_rows
        finally:
            servers.stop_server(server)
    text = markdown(rows)
    print("\n" + text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "objstore.md").write_text(text + "\n")
        (args.out / "objstore.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
