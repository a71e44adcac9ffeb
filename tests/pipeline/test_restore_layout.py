"""Restores find every tensor from ``orbax_safetensors.json`` and read no safetensors header
(issue 27, must-hold 3); checkpoints written before the metadata recorded the tensors' places
still restore, reading each header once; the object-store read planner's byte bound and
request count (issue 27, must-hold 2) on byte runs.

The object-store halves (S3 and GCS test servers) are in ``tests/objstore/test_objstore_reads.py``.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.core import runs as _runs
from orbax_safetensors._src.core.errors import IntegrityError, SchemaError
from orbax_safetensors._src.pipeline import standalone as _standalone
from orbax_safetensors._src.pipeline.read import ReadStats

GOLDEN = Path(__file__).parents[1] / "golden" / "format1_without_offsets"
META = "orbax_safetensors.json"


def tree() -> dict[str, Any]:
    return {
        "params": {
            "w": np.arange(24, dtype=np.float32).reshape(4, 6),
            "b": np.arange(6, dtype=ml_dtypes.bfloat16),
        },
        "step": np.int64(7),
        "name": "old",
        "mask": np.array([True, False, True]),
    }


def check(got: dict[str, Any]) -> None:
    want = tree()
    np.testing.assert_array_equal(got["params"]["w"], want["params"]["w"])
    np.testing.assert_array_equal(got["params"]["b"], want["params"]["b"])
    assert got["step"] == 7 and got["name"] == "old"
    np.testing.assert_array_equal(got["mask"], want["mask"])


def strip_layout(directory: Path) -> None:
    """Rewrites the metadata as written before it recorded the tensors' places."""
    doc = json.loads((directory / META).read_text())
    doc.pop("file_layout")
    for info in doc["tensors"].values():
        info.pop("data_offsets")
    (directory / META).write_text(json.dumps(doc))


def restore(directory: Path) -> tuple[Any, ReadStats]:
    stats = ReadStats()
    return _standalone.restore_checkpoint(directory, stats=stats), stats


def test_metadata_records_each_tensor_where_its_header_does(tmp_path: Path) -> None:
    osf.save_directory(tree(), tmp_path / "c", max_file_size=64)
    doc = json.loads((tmp_path / "c" / META).read_text())
    assert doc["format_version"] == 1  # additive: readers without the fields read headers
    assert sorted(doc["file_layout"]) == sorted(doc["files"]) and len(doc["files"]) == 2
    for filename, layout in doc["file_layout"].items():
        header = osf.read_header(tmp_path / "c" / filename)
        assert layout == {
            "data_start": header.data_start,
            "size": (tmp_path / "c" / filename).stat().st_size,
        }
        for name, entry in header.tensors.items():
            assert doc["tensors"][name]["file"] == filename
            assert doc["tensors"][name]["data_offsets"] == [entry.begin, entry.end]


def test_a_new_checkpoint_restores_without_reading_any_header(tmp_path: Path) -> None:
    osf.save_directory(tree(), tmp_path / "c", max_file_size=64)
    got, stats = restore(tmp_path / "c")
    check(got)
    assert stats.header_reads == 0 and stats.header_bytes == 0, stats
    assert stats.metadata_bytes == (tmp_path / "c" / META).stat().st_size
    # Only the tensors' own bytes were read: 96 + 12 + 8 + 3.
    assert stats.bytes_read == stats.bytes_needed == 119, stats
    assert osf.verify(tmp_path / "c").ok


@pytest.mark.parametrize("how", ["golden", "stripped"])
def test_a_checkpoint_without_offsets_restores_reading_each_header_once(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "c"
    if how == "golden":  # written by the code before the fields existed
        shutil.copytree(GOLDEN, path)
    else:
        osf.save_directory(tree(), path, max_file_size=64)
        strip_layout(path)
    assert "file_layout" not in json.loads((path / META).read_text())
    got, stats = restore(path)
    check(got)
    assert stats.header_reads == 2, stats  # two files, one header each
    assert stats.header_bytes == 2 * 4096, stats  # each header padded to 4 KiB
    assert osf.verify(path).ok


def test_verify_cross_checks_the_recorded_places_against_the_headers(tmp_path: Path) -> None:
    """A metadata file whose offsets are consistent but not the file's: a restore trusts it
    (the checksum catches the swap), ``verify`` compares it with every header."""
    osf.save_directory({"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)}, tmp_path)
    doc = json.loads((tmp_path / META).read_text())
    a, b = doc["tensors"]["a"], doc["tensors"]["b"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    (tmp_path / META).write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="CRC32C"):
        osf.restore_directory(tmp_path)
    report = osf.verify(tmp_path)
    assert not report.ok
    assert any("lies at data_offsets" in p for p in report.problems), report.problems


def test_a_forged_offset_is_refused_before_any_read(tmp_path: Path) -> None:
    osf.save_directory(tree(), tmp_path, max_file_size=64)
    doc = json.loads((tmp_path / META).read_text())
    filename = doc["tensors"]["params.w"]["file"]
    doc["tensors"]["params.w"]["data_offsets"] = [1 << 40, (1 << 40) + 96]
    doc["file_layout"][filename]["size"] += 1 << 40
    (tmp_path / META).write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=r"'params.w' at data_offsets .* leaves a hole"):
        osf.restore_directory(tmp_path)


# --------------------------------------------------------------------------- ranged reads


def _read_bytes(reads: list[tuple[int, list[memoryview]]]) -> int:
    return sum(len(v) for _, views in reads for v in views)


def _brute_force_fewest(offsets: list[int], sizes: list[int], ratio: float, max_gap: int) -> int:
    # The fewest contiguous ranges covering every run within the byte bound, by trying every
    # subset of gaps to merge.
    gaps = [offsets[k + 1] - offsets[k] - sizes[k] for k in range(len(offsets) - 1)]
    budget = int((ratio - 1) * sum(sizes))
    best = len(offsets)
    for merged in itertools.product([False, True], repeat=len(gaps)):
        cost = sum(g for g, m in zip(gaps, merged) if m)
        if cost <= budget and all(g <= max_gap for g, m in zip(gaps, merged) if m):
            best = min(best, len(offsets) - sum(merged))
    return best


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), min_size=1, max_size=9),
    st.integers(0, 80),
)
def test_ranged_reads_read_at_most_1_5x_in_the_fewest_ranges(
    layout: list[tuple[int, int]], max_gap: int
) -> None:
    offsets, sizes, pos = [], [], 0
    for gap, size in layout:
        pos += gap
        offsets.append(pos)
        sizes.append(size)
        pos += size
    bufs = [np.zeros(n, np.uint8) for n in sizes]
    runs = list(zip(offsets, bufs))[::-1]  # any order
    reads = _runs.ranged_reads(runs, max_gap)
    assert _read_bytes(reads) <= 1.5 * sum(sizes)
    assert len(reads) == _brute_force_fewest(offsets, sizes, 1.5, max_gap)
    # Every run lands at its own place: the views of each read tile the range it covers.
    data = np.arange(pos, dtype=np.int64).astype(np.uint8)
    for start, views in reads:
        at = start
        for v in views:
            np.frombuffer(v, np.uint8)[:] = data[at : at + len(v)]
            at += len(v)
    for off, buf in zip(offsets, bufs):
        np.testing.assert_array_equal(buf, data[off : off + len(buf)])


def test_column_stripes_read_within_1_5x_with_the_fewest_requests() -> None:
    """A quarter of the columns of a row-major matrix: reading it whole costs 4x, one request
    per row 1.0x; the planner reads <= 1.5x in the fewest ranges that allows (5/6 of the rows:
    every merged 3-run gap adds 3 run widths, the budget is half of all runs)."""
    shape, index = (1024, 1024), (slice(0, 1024), slice(0, 256))
    offsets, length = _runs.byte_runs("F32", shape, index, "t")
    runs = [(int(o), np.empty(length, np.uint8)) for o in offsets]
    reads = _runs.ranged_reads(runs, 1 << 20)
    needed = len(runs) * length
    assert _read_bytes(reads) <= 1.5 * needed
    merged = int(0.5 * needed) // (3 * length)  # gaps of 3 runs each fit in half the bytes
    assert len(reads) == len(runs) - merged == 854


def test_sub_byte_shards_off_whole_bytes_are_refused_naming_the_leaf(tmp_path: Path) -> None:
    # One float4 element per device: a shard of half a byte; each device's owner writes its
    # own bytes, so the save refuses it, naming the leaf (the restore reads whole bytes).
    import devices  # (tests/ is on sys.path)
    import jax

    mesh = devices.mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.arange(8).astype(ml_dtypes.float4_e2m1fn)
    with pytest.raises(osf.UnsupportedLeafError, match=r"leaf 'layer.w4': .*whole bytes"):
        osf.save_file({"layer": {"w4": jax.device_put(values, sharding)}}, tmp_path / "a.st")
    osf.save_file({"layer": {"w4": values}}, tmp_path / "b.safetensors")
    # One process reads the whole tensor and places its slices: restoring onto them works.
    target = {"layer": {"w4": jax.ShapeDtypeStruct((8,), values.dtype, sharding=sharding)}}
    out = osf.load_file(tmp_path / "b.safetensors", target)["layer"]["w4"]
    assert out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), values.view(np.uint8))
