"""Checksum throughput on this machine, and what checksums cost a save and a restore.

Justifies the integrity checksum choice (CRC32C) with measurements, side by side in one run:
CRC32C (``crc32c`` package, hardware instructions), xxh3-64 (``xxhash``, if installed),
SHA-256 (``hashlib``) and zlib's CRC-32, over an in-cache buffer and a large buffer from RAM;
then ``orbax_safetensors`` ``save_file`` / ``load_file`` of the same tree with checksums
verified on restore and with ``verify=False``.

Run::

    python benchmarks/checksum_bench.py [--mib 256] [--repeats 5]

Why CRC32C besides speed: it is *combinable* (``crc(A + B)`` from ``crc(A)``, ``crc(B)`` and
``len(B)``, and linear in the data), so each process of a multi-host save checksums only the
byte runs it writes and the primary merges per-process shares without reading any data.
xxh3 and SHA-256 cannot be merged that way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np


def _rate(fn: Callable[[], object], nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def checksum_table(mib: int, repeats: int) -> list[tuple[str, float, float]]:
    """(name, GB/s on 1 MiB in cache, GB/s on ``mib`` MiB) for each checksum."""
    import crc32c

    small = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    large = np.random.default_rng(1).integers(0, 255, mib << 20, dtype=np.uint8)
    funcs: dict[str, Callable[[np.ndarray], object]] = {
        "crc32c (hardware)": lambda b: crc32c.crc32c(b),
        "zlib crc32": lambda b: zlib.crc32(b),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    try:
        import xxhash

        funcs["xxh3_64"] = lambda b: xxhash.xxh3_64_intdigest(b)
    except ImportError:
        print("xxhash not installed: pip install xxhash to include xxh3")
    rows = []
    for name, fn in funcs.items():
        small_rate = _rate(lambda fn=fn: [fn(small) for _ in range(64)], 64 * small.nbytes, repeats)
        large_rate = _rate(lambda fn=fn: fn(large), large.nbytes, repeats)
        rows.append((name, small_rate, large_rate))
    return rows


def restore_cost(mib: int, repeats: int) -> tuple[float, float, float]:
    """Median seconds of save_file, load_file(verify=True), load_file(verify=False)."""
    import jax

    import orbax_safetensors as osf

    rng = np.random.default_rng(2)
    n = 16
    tree = {f"w{i}": rng.standard_normal((mib << 20) // 4 // n, dtype=np.float32) for i in range(n)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.safetensors")
        saves, verified, unverified = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            osf.save_file(tree, path)
            saves.append(time.perf_counter() - t0)
        # Alternate the two modes, after one untimed load each, so page-cache and first-touch
        # memory effects hit both alike.
        for verify in (True, False):
            jax.block_until_ready(osf.load_file(path, verify=verify))
        for _ in range(repeats):
            for verify, out in ((True, verified), (False, unverified)):
                t0 = time.perf_counter()
                result = osf.load_file(path, verify=verify)
                jax.block_until_ready(result)
                out.append(time.perf_counter() - t0)
                del result
    return statistics.median(saves), statistics.median(verified), statistics.median(unverified)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the large buffer / tree")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"checksum throughput (GB/s, median of {args.repeats})")
    print(f"| checksum | 1 MiB in cache | {args.mib} MiB from RAM |")
    print("|---|---|---|")
    for name, small, large in checksum_table(args.mib, args.repeats):
        print(f"| {name} | {small:.2f} | {large:.2f} |")
    save, verified, unverified = restore_cost(args.mib, args.repeats)
    print(f"\norbax_safetensors, {args.mib} MiB float32 in 16 tensors (warm page cache, seconds):")
    print(f"save_file (checksums computed): {save:.3f}")
    print(
        f"load_file verify=True: {verified:.3f}   verify=False: {unverified:.3f}   "
        f"verification cost: {verified - unverified:+.3f} s ({verified / unverified:.2f}x)"
    )


if __name__ == "__main__":
    main()
