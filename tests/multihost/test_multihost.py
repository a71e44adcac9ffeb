"""Multi-host checkpoints with real ``jax.distributed`` processes on 127.0.0.1 (issue 4).

Three launches, each checking many things (process start-up dominates):

1. N=2 (2 CPU devices each): async CheckpointManager saves of steps 0-2 with ``max_to_keep=2``
   into one ``model.safetensors``; restores of step 2 onto another mesh and partition specs,
   with Orbax restore args, without a target, with shardless targets, and a partial restore;
   one save under a dtype policy (``dtype=bfloat16``), restored into the float32 target.
2. N=4 (2 devices each): the same saves split into several files (small ``max_file_size``),
   the same restores, and restores of the N=2 checkpoint (another process count).
3. N=2: restores of the N=4 checkpoint (the main environment only: see ``ON_STACK``).

Every worker reports the byte ranges it wrote (``handler.last_write_stats``) and, per restore,
``handler.last_read_stats`` against an independent byte-mask oracle. The files are then read
here, in this single process without ``jax.distributed``, by ``safetensors.safe_open`` and by
Orbax's own safetensors loader, and compared with the global arrays recomputed from scratch.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import WORKERS_DIR, run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import WORKERS_DIR, run_workers

sys.path.insert(0, str(WORKERS_DIR))
import mh_common as C

# A test's setup may run up to three launches; each ends at LAUNCH_TIMEOUT_S at the latest
# (every worker's Python stacks dumped), so the pytest timeout only backs that up.
pytestmark = [pytest.mark.multihost, pytest.mark.timeout(420)]

WORKER = "mh_checkpoint.py"
LAUNCH_TIMEOUT_S = 120.0  # a hung job fails its test (stacks dumped) instead of hanging CI
SPLIT_MAX_FILE_SIZE = 200_000  # forces the N=4 checkpoint into several files
STEPS, KEEP = [0, 1, 2], 2
ALL_MODES = ["other_mesh", "restore_args", "no_target", "no_sharding", "partial", "select"]
ITEM = "default"
# Orbax's v1 API is ``ocp.v1`` since orbax-checkpoint 0.11.12, loads safetensors since 0.11.20
# and onto a mesh (sharded targets) since 0.11.23 (Orbax's CHANGELOG).
ORBAX_SHARDED_SAFETENSORS_LOAD = (0, 11, 23)
# This library's v1 handler needs ocp.v1.save/load of orbax-checkpoint 0.12.8 (compat/orbaxcompat).
ORBAX_V1_SAVE = (0, 12, 8)


def _version(text: str) -> tuple[int, ...]:
    """``"0.11.40"`` -> ``(0, 11, 40)`` (release numbers only)."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _restore(root: Path, saved_processes: int) -> dict[str, Any]:
    return {
        "root": str(root),
        "step": STEPS[-1],
        "saved_processes": saved_processes,
        "modes": ALL_MODES,
    }


def _save_run(
    n: int,
    roots: dict[Any, Path],
    v1_paths: dict[int, Path],
    max_file_size: int | None,
    restores: list[dict[str, Any]],
    **more: Any,
) -> list[Any]:
    """N processes save STEPS into ``roots[n]`` (and once through Orbax's v1 API), then
    restore ``restores``; ``more``: further worker arguments."""
    args = {
        "v1_path": str(v1_paths[n]),
        "save_root": str(roots[n]),
        "save_steps": STEPS,
        "max_to_keep": KEEP,
        "max_file_size": max_file_size,
        "restores": restores,
        **more,
    }
    return run_workers(WORKER, n, devices_per_process=2, args=args, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Path]:
    base = tmp_path_factory.mktemp("multihost")
    return {2: base / "saved_by_2", 4: base / "saved_by_4", "bf16": base / "bf16_by_2"}


@pytest.fixture(scope="module")
def v1_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Where the N=2 and N=4 launches also save once through Orbax's v1 API (issue 17)."""
    base = tmp_path_factory.mktemp("multihost_v1")
    return {2: base / "v1_by_2", 4: base / "v1_by_4"}


@pytest.fixture(scope="module")
def n2_run(roots: dict[int, Path], v1_paths: dict[int, Path]) -> list[Any]:
    restores = [_restore(roots[2], 2)]
    return _save_run(2, roots, v1_paths, None, restores, dtype_root=str(roots["bf16"]))


@pytest.fixture(scope="module")
def n4_run(roots: dict[int, Path], v1_paths: dict[int, Path], n2_run: list[Any]) -> list[Any]:
    restores = [_restore(roots[4], 4), _restore(roots[2], 2)]
    return _save_run(4, roots, v1_paths, SPLIT_MAX_FILE_SIZE, restores)


# The other CI stacks (OSF_PROPERTY_PROFILE=stack) check one direction across process counts:
# the N=4 launch restores the N=2 checkpoint (the same restore calls as the other direction);
# the main environment also restores the N=4 checkpoint at N=2 (a third launch).
ON_STACK = os.environ.get("OSF_PROPERTY_PROFILE") == "stack"


@pytest.fixture(scope="module")
def n2_restore_run(roots: dict[int, Path], n4_run: list[Any]) -> list[Any]:
    if ON_STACK:
        return []
    args = {"save_root": None, "restores": [_restore(roots[4], 4)]}
    return run_workers(WORKER, 2, devices_per_process=2, args=args, timeout=LAUNCH_TIMEOUT_S)


# ----------------------------------------------------------------------------- helpers


def _headers(item_dir: Path) -> dict[str, tuple[int, int, dict[str, Any]]]:
    """file name -> (data start, file size, header), parsed by hand."""
    out = {}
    for f in sorted(item_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out[f.name] = (8 + n, f.stat().st_size, header)
    return out


def _tensor_spans(item_dir: Path) -> dict[str, tuple[str, int, int]]:
    """tensor name -> (file, absolute start, absolute end)."""
    spans = {}
    for fname, (start, _, header) in _headers(item_dir).items():
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                spans[name] = (fname, start + a, start + b)
    return spans


def _total_tensor_bytes() -> int:
    return sum(v.nbytes for v in C.global_arrays(0).values())


def _check_save(results: list[Any], root: Path, n: int, split: bool) -> None:
    assert [r.result["process_count"] for r in results] == [n] * n
    kept = [STEPS[-KEEP:]] * n
    assert [r.result["save"]["kept_steps"] for r in results] == kept
    assert sorted(p.name for p in root.iterdir() if p.name.isdigit()) == [
        str(s) for s in STEPS[-KEEP:]
    ]
    for step in STEPS[-KEEP:]:
        item_dir = root / str(step) / ITEM
        per = [r.result["save"]["steps"][str(step)] for r in results]
        files = sorted(p.name for p in item_dir.iterdir())
        for p in per:
            assert p["files"] == files
        # No checksum parts or drafts left behind; an index exactly when split.
        assert "orbax_safetensors.json" in files
        assert not [f for f in files if f.startswith("crc32c.") or f.endswith(".draft")]
        assert ("model.safetensors.index.json" in files) == split
        safetensors_files = [f for f in files if f.endswith(".safetensors")]
        assert (len(safetensors_files) > 1) == split

        # Each process wrote exactly the bytes of the shards it owns (replica_id == 0, checked
        # in the worker against a byte mask of its addressable shards)...
        assert [p["writes_only_owned"] for p in per] == [True] * n
        # ...and together they tile every file's data section exactly once, with no overlap.
        headers = _headers(item_dir)
        ranges = sorted(
            (f, off, nbytes, pid) for pid, p in enumerate(per) for f, off, nbytes in p["ranges"]
        )
        for (f0, o0, n0, _), (f1, o1, _, _) in itertools.pairwise(ranges):
            assert f0 != f1 or o0 + n0 <= o1, f"overlapping writes in {f0} at {o1}"
        for f, off, nbytes, _ in ranges:
            start, size, _ = headers[f]
            assert start <= off and off + nbytes <= size, (f, off, nbytes)
        total = _total_tensor_bytes()
        assert sum(p["bytes_written"] for p in per) == total
        assert sum(size - start for start, size, _ in headers.values()) == total
        # Headers by the primary only; host-local leaves by the primary only.
        assert per[0]["header_bytes"] == sum(start for start, _, _ in headers.values())
        assert all(p["header_bytes"] == 0 for p in per[1:])
        spans = _tensor_spans(item_dir)
        for name in [*C.HOST_NUMPY, *C.HOST_JAX]:
            f, a, b = spans[name]
            writers = {pid for rf, off, nb, pid in ranges if rf == f and off < b and off + nb > a}
            assert writers == {0}, (name, writers)
        # Every process wrote something (sharded leaves are spread over all of them).
        assert all(p["bytes_written"] > 0 for p in per)
        written = ", ".join(f"p{i} {p['bytes_written']}" for i, p in enumerate(per))
        print(f"N={n} step {step}: tensor bytes written {written} (total {total}); files {files}")


def _saved_spec(name: str) -> tuple[str, str]:
    from jax.sharding import PartitionSpec as P

    _, _, kind, spec = C.SHARDED[name]
    return str(P(*spec)), kind


def _check_reads(mode: str, res: dict[str, Any], n: int) -> None:
    """bytes read vs needed: needed matches the oracle; reads exceed it only by coalesced gaps."""
    assert res["bytes_needed"] == res["oracle_needed"], (mode, res)
    assert res["oracle_needed"] <= res["bytes_read"], (mode, res)
    assert res["bytes_read"] <= res["oracle_needed"] + res["oracle_slack"], (mode, res)
    # Every tensor is placed by orbax_safetensors.json: no process reads any header, and the
    # one metadata file it reads does not grow with the number of processes.
    assert res["header_reads"] == 0 and res["header_bytes"] == 0, (mode, res)
    assert 0 < res["metadata_bytes"] < 64 * 1024, (mode, res)
    if mode == "partial":
        # big.rows by row blocks and big.cols by column blocks: 1/n of each, read exactly (the
        # column gaps, (n-1)/n of a 16 KiB row, are too wide to coalesce): 1 + 32 requests.
        assert res["bytes_needed"] == res["bytes_read"] == 2 * 128 * 1024 * 4 // n
        assert res["requests"] == 1 + 32
    if mode == "select":
        # include / exclude: big.rows by row blocks and the small params.bias, nothing else.
        assert res["not_as_given"] == [], res
        assert 128 * 1024 * 4 // n <= res["bytes_needed"] < 128 * 1024 * 4 // n + 4096


def _check_restores(
    restores: dict[str, Any], n_now: int, n_saved: int, label: str, report: list[str]
) -> None:
    for mode in ALL_MODES:
        res = restores[mode]
        if n_now != n_saved and mode in ("no_target", "no_sharding"):
            # The saved (N_saved, 2) mesh cannot be rebuilt on this job's devices: clear error.
            assert "error" in res, (label, mode, res)
            assert res["error"].startswith("TargetMismatchError")
            assert f"a mesh of {2 * n_saved} devices" in res["error"]
            assert f"this job's {2 * n_now} devices cannot reproduce" in res["error"]
            assert "pass a restore target" in res["error"]
            continue
        assert "error" not in res, (label, mode, res.get("error"))
        assert res["problems"] == [], (label, mode, res["problems"])
        _check_reads(mode, res, n_now)
        report.append(
            f"{label:<22} {mode:<13} read {res['bytes_read']:>8} needed {res['bytes_needed']:>8}"
            f" (+{res['bytes_read'] - res['bytes_needed']} coalesced) requests {res['requests']}"
            f" headers {res['header_bytes']} metadata {res['metadata_bytes']}"
        )
        leaves = res["leaves"]
        if mode in ("no_target", "no_sharding"):
            # Saved shardings reused: same partition specs over meshes of the same shape.
            for name in C.SHARDED:
                spec, kind = _saved_spec(name)
                mesh = {"data": n_now, "model": 2} if kind == "2d" else {"x": 2 * n_now}
                assert leaves[name] == {
                    "type": "jax",
                    "spec": spec,
                    "mesh": mesh,
                    "dtype": str(np.dtype(C.SHARDED[name][1])),
                }, name
        if mode not in ("partial", "select"):
            for name in C.HOST_NUMPY:
                assert leaves[name]["type"] == "ndarray", (mode, name)
            for name in C.HOST_JAX:
                assert leaves[name]["type"] == "jax" and leaves[name]["spec"] is None
            assert leaves["step_count"]["type"] == "int" and leaves["lr"]["type"] == "float"


# ----------------------------------------------------------------------------- tests


def test_n2_async_saves_write_only_owned_bytes(n2_run: list[Any], roots: dict[int, Path]) -> None:
    _check_save(n2_run, roots[2], 2, split=False)


def test_n4_async_saves_split_into_files_write_only_owned_bytes(
    n4_run: list[Any], roots: dict[int, Path]
) -> None:
    _check_save(n4_run, roots[4], 4, split=True)


def test_restores_at_the_same_process_count(n2_run: list[Any], n4_run: list[Any]) -> None:
    report: list[str] = []
    for n, results in ((2, n2_run), (4, n4_run)):
        for r in results:
            label = f"N={n} p{r.process_id} ckpt N={n}"
            _check_restores(r.result["restores"][0], n, n, label, report)
    print("\n".join(report))


def test_restores_across_process_counts(n4_run: list[Any], n2_restore_run: list[Any]) -> None:
    report: list[str] = []
    for r in n4_run:  # saved at N=2, restored at N=4
        _check_restores(r.result["restores"][1], 4, 2, f"N=4 p{r.process_id} ckpt N=2", report)
    for r in n2_restore_run:  # saved at N=4, restored at N=2
        _check_restores(r.result["restores"][0], 2, 4, f"N=2 p{r.process_id} ckpt N=4", report)
    print("\n".join(report))


@pytest.mark.parametrize("n", [2, 4])
def test_files_read_by_safetensors_safe_open(
    n: int, roots: dict[int, Path], n2_run: list[Any], n4_run: list[Any]
) -> None:
    from safetensors import safe_open

    for step in STEPS[-KEEP:]:
        item_dir = roots[n] / str(step) / ITEM
        expected = C.global_arrays(step)
        metadata = json.loads((item_dir / "orbax_safetensors.json").read_text())
        seen: dict[str, str] = {}
        for f in sorted(item_dir.glob("*.safetensors")):
            # numpy has no bfloat16: those tensors through the flax (jax) framework.
            with (
                safe_open(str(f), framework="numpy") as st,
                safe_open(str(f), framework="flax") as st_bf16,
            ):
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    assert name not in seen, f"{name} in {seen.get(name)} and {f.name}"
                    seen[name] = f.name
                    bf16 = expected[name].dtype == C.BF16
                    got = np.asarray((st_bf16 if bf16 else st).get_tensor(name))
                    want = expected[name]
                    assert got.dtype == want.dtype and got.shape == want.shape, name
                    assert np.array_equal(got, want), (f.name, name)
                    # The whole-tensor CRC32C merged from every process's parts is right.
                    crc = crc32c.crc32c(np.ascontiguousarray(want).tobytes())
                    assert metadata["tensors"][name]["crc32c"] == f"{crc:08x}", name
        assert set(seen) == set(expected)
        for name in C.SHARDED:
            desc = metadata["tensors"][name]["sharding"]
            _, _, kind, spec = C.SHARDED[name]
            assert desc["spec"] == list(spec), name
            assert desc["mesh_shape"] == ([n, 2] if kind == "2d" else [2 * n])
        for name in [*C.HOST_NUMPY, *C.HOST_JAX]:
            assert metadata["tensors"][name]["sharding"] is None
        index = item_dir / "model.safetensors.index.json"
        if n == 4:
            doc = json.loads(index.read_text())
            assert doc["weight_map"] == seen
            assert doc["metadata"]["total_size"] == _total_tensor_bytes()
        else:
            assert not index.exists() and set(seen.values()) == {"model.safetensors"}


def test_n2_dtype_policy_save_each_process_casts_its_own_shards(
    n2_run: list[Any], roots: dict[Any, Path]
) -> None:
    """SafetensorsSave(dtype=bfloat16) in a 2-process async save: every process writes only
    the bf16 bytes of its own shards (arrays deleted once save() returns), the official reader
    sees bf16 tensors equal to jnp's cast, the schema records the original dtypes, and a
    float32 target on another mesh restores float32 (the values are exact in bf16)."""
    from safetensors import safe_open

    from orbax_safetensors._src.catalog import sources as _sources

    per = [r.result["dtype_save"] for r in n2_run]
    for p in per:
        assert p["problems"] == [], p["problems"]
        assert p["writes_only_owned"]
        assert p["leaves"]["params.emb"]["dtype"] == "float32"
    item_dir = roots["bf16"] / "0" / ITEM
    expected = C.global_arrays(0)
    stored = {n: (C.BF16 if v.dtype.kind == "f" else v.dtype) for n, v in expected.items()}
    assert sum(p["bytes_written"] for p in per) == sum(
        v.size * stored[n].itemsize for n, v in expected.items()
    )
    metadata = json.loads((item_dir / "orbax_safetensors.json").read_text())
    with safe_open(str(item_dir / "model.safetensors"), framework="flax") as st:
        assert set(st.keys()) == set(expected)
        for name, want in expected.items():
            got = np.asarray(st.get_tensor(name))
            assert got.dtype == stored[name], name
            assert np.array_equal(got, want.astype(stored[name])), name
            crc = crc32c.crc32c(np.ascontiguousarray(got).tobytes())  # of the stored bytes
            assert metadata["tensors"][name]["crc32c"] == f"{crc:08x}", name
    origins = {n: t.cast_from for n, t in _sources.open_source(item_dir).tensors.items()}
    assert origins == {
        n: {"float32": "F32", "float64": "F64"}.get(v.dtype.name) for n, v in expected.items()
    }


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
@pytest.mark.parametrize("n", [2, 4])
def test_files_read_by_orbax_v1_safetensors_loader(
    n: int, roots: dict[int, Path], n2_run: list[Any], n4_run: list[Any]
) -> None:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if _version(ocp.__version__) < ORBAX_SHARDED_SAFETENSORS_LOAD:
        pytest.skip(
            f"needs orbax-checkpoint >= 0.11.23 (Orbax's safetensors loader onto a mesh); "
            f"this is {ocp.__version__}"
        )
    # ``load`` since orbax-checkpoint 0.12.0 (0.11.x names it ``load_pytree``, which 0.12 still
    # has, deprecated).
    load = getattr(ocp.v1, "load", None) or ocp.v1.load_pytree
    # Orbax's loader reads a directory of *.safetensors files with flat tensor names: the item
    # directory ``<step>/default`` as it is (the JSON files beside them are ignored).
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    step = STEPS[-1]
    expected = C.global_arrays(step)
    abstract = {
        name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
        for name, v in expected.items()
    }
    # A sharded target too: Orbax reads only the column slices each device needs.
    abstract["big.cols"] = jax.ShapeDtypeStruct(
        (32, 4096), np.float32, sharding=NamedSharding(mesh, P(None, "a"))
    )
    # The enum, not a string: 0.11.x's Context keeps a string as it is (its enum values are
    # "SafeTensors"/"Orbax"), 0.12 converts "safetensors".
    with ocp.v1.Context(checkpoint_layout=ocp.v1.options.CheckpointLayout.SAFETENSORS):
        loaded = load(roots[n] / str(step) / ITEM, abstract)
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got.shape == want.shape, name
        # float64 host leaves come back as float32 without jax_enable_x64: compare values.
        assert np.array_equal(np.asarray(got), want.astype(got.dtype)), name
    assert loaded["big.cols"].sharding.spec == P(None, "a")


@pytest.mark.parametrize("n", [2, 4])
def test_the_same_launches_save_and_load_once_through_orbax_v1(
    n: int, v1_paths: dict[int, Path], n2_run: list[Any], n4_run: list[Any]
) -> None:
    """Issue 17: each process wrote its rows through ``osf.SafetensorsHandler`` (``ocp.v1.save``)
    and loaded its shards back onto the same sharding; the official reader sees the whole
    global array and ``osf.verify`` checks the checksums."""
    import orbax.checkpoint as ocp
    import safetensors.numpy

    import orbax_safetensors as osf

    results = {2: n2_run, 4: n4_run}[n]
    if _version(ocp.__version__) < ORBAX_V1_SAVE:
        assert all("skipped" in r.result["v1"] for r in results)
        assert f"{ORBAX_V1_SAVE[0]}.{ORBAX_V1_SAVE[1]}" in results[0].result["v1"]["skipped"]
        pytest.skip(f"orbax-checkpoint {ocp.__version__} lacks the v1 save API")
    for r in results:
        assert r.result["v1"] == {"shards_ok": True, "sharding_ok": True, "bias_ok": True}
    item = v1_paths[n] / "state"
    tensors = safetensors.numpy.load_file(str(item / "model.safetensors"))
    np.testing.assert_array_equal(
        tensors["w"], np.arange(8 * n * 6, dtype=np.float32).reshape(8 * n, 6)
    )
    np.testing.assert_array_equal(tensors["bias"], np.arange(5, dtype=np.int32))
    report = osf.verify(item)
    assert report.ok, report.problems
