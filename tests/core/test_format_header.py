"""The wire format's header and layout: building and parsing headers, refused headers, where
tensors sit in a file.

Interop is checked with the other tools' own readers (``safetensors.safe_open``), never with this
library's reader alone.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header

# --------------------------------------------------------------------------- headers


def _parse(blob: bytes, where: str = "f") -> _header.Header:
    return _header.parse_header(blob[:8], lambda n: blob[8 : 8 + n], len(blob), where=where)


def test_build_header_layout_and_parse_round_trip():
    header, entries = _header.build_header(
        [("w", "F32", (2, 3)), ("b", "BF16", (3,)), ("s", "I64", ())], {"format": "flax"}
    )
    (n,) = struct.unpack("<Q", header[:8])
    assert len(header) == 8 + n
    assert len(header) % 8 == 0  # padded with spaces so the data section starts 8-aligned
    assert header.rstrip(b" ").endswith(b"}")
    doc = json.loads(header[8:])
    assert doc["__metadata__"] == {"format": "flax"}
    assert doc["w"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert doc["b"] == {"dtype": "BF16", "shape": [3], "data_offsets": [24, 30]}
    assert doc["s"] == {"dtype": "I64", "shape": [], "data_offsets": [30, 38]}
    assert [(e.name, e.begin, e.end) for e in entries] == [
        ("w", 0, 24),
        ("b", 24, 30),
        ("s", 30, 38),
    ]

    parsed = _parse(header + bytes(38))
    assert parsed.metadata == {"format": "flax"}
    assert parsed.data_start == len(header)
    assert parsed.data_size == 38
    assert parsed.tensors["w"] == entries[0]
    assert parsed.tensors["s"].shape == ()


def test_build_header_refuses_duplicates_reserved_names_and_non_string_metadata():
    with pytest.raises(osf.HeaderError, match="'w' appears twice"):
        _header.build_header([("w", "F32", (1,)), ("w", "F32", (1,))])
    with pytest.raises(osf.HeaderError, match="__metadata__"):
        _header.build_header([("__metadata__", "F32", (1,))])
    with pytest.raises(osf.HeaderError, match="str to str"):
        _header.build_header([("w", "F32", (1,))], {"step": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize("seed", range(4))
def test_header_bound_is_never_below_the_header_built(seed):
    """An async save plans on its writer thread unless ``header_bound`` says the header might
    exceed the cap; the bound must hold for any names, dtypes and shapes."""
    from orbax_safetensors._src.core import plan as _plan

    rng = np.random.default_rng(seed)
    alphabet = ['"', "\\", "\n", "\x01", "é", "中", "a", ".", "~", "\u2028"]
    specs = []
    for i in range(200):
        name = "".join(rng.choice(alphabet, size=int(rng.integers(0, 12)))) + str(i)
        ndim = int(rng.integers(0, 6))
        shape = tuple(int(d) for d in rng.integers(0, 10**6, size=ndim))
        dtype = str(rng.choice(["F32", "BF16", "F8_E4M3", "BOOL", "I64"]))
        specs.append(_plan.TensorSpec(name, dtype, shape))
    meta = {"format": "flax", 'k"\\': "v\x02中"}
    for cut in (1, 7, 200):
        part = specs[:cut]
        header, _ = _header.build_header([(s.name, s.dtype, s.shape) for s in part], meta)
        chars = sum(len(s.name) for s in part)
        assert len(header) <= _plan.header_bound(chars, cut, max(len(s.shape) for s in part), meta)
    assert _plan.header_bound(0, 0, 0) >= len(_header.build_header([], {"format": "flax"})[0])


def _blob(doc: dict, data: bytes) -> bytes:
    text = json.dumps(doc).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x00" * 4, "too short"),
        (struct.pack("<Q", 0), "header length is 0"),
        (struct.pack("<Q", 1 << 40) + b"{}", "exceeds"),
        (struct.pack("<Q", 100) + b"{}", "runs past the end"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "UTF-8"),
        (struct.pack("<Q", 2) + b"[]", "JSON object"),
        (struct.pack("<Q", 5) + b'{"a":', "not valid JSON"),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b""), "data section"),
        (_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "8 bytes"),
        (
            _blob({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
            "unknown dtype",
        ),
        (
            _blob({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)),
            "non-negative",
        ),
        (_blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "hole"),
        (
            _blob(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                bytes(8),
            ),
            "overlaps",
        ),
        (
            _blob({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(5)),
            "trailing",
        ),
        (_blob({"__metadata__": {"step": 3}}, b""), "not a string"),
        (
            _blob(
                {"a": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 4]}},
                bytes(4),
            ),
            "overflows|data_offsets span",
        ),
        (struct.pack("<Q", 13) + b'{"a":1,"a":2}', "duplicate key"),
    ],
)
def test_parse_header_refuses_malformed_headers(blob, message):
    with pytest.raises(osf.HeaderError, match=message):
        _parse(blob, where="bad.safetensors")


def test_parse_header_error_is_a_value_error_naming_the_file():
    with pytest.raises(ValueError, match=r"bad\.safetensors"):
        _parse(struct.pack("<Q", 0), where="bad.safetensors")


def test_saved_file_layout_order_and_alignment(tmp_path):
    path = tmp_path / "x.safetensors"
    tree = {
        "a": np.ones(3, np.int8),
        "b": np.ones(2, np.float64),
        "c": np.ones(5, np.float16),
        "d": np.ones(1, np.float32),
    }
    osf.save_file(tree, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8 : 8 + n])
    names = [k for k in doc if k != "__metadata__"]
    # Widest elements first (stable): every tensor starts at a multiple of its element size.
    assert names == ["b", "d", "c", "a"]
    assert (8 + n) % 8 == 0
    for k in names:
        begin, end = doc[k]["data_offsets"]
        width = np.dtype(tree[k].dtype).itemsize
        assert begin % width == 0
        assert raw[8 + n + begin : 8 + n + end] == tree[k].tobytes()
    assert len(raw) == 8 + n + sum(a.nbytes for a in tree.values())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_file_size", [None, 3000])
def test_file_plans_are_laid_out_for_direct_io(seed, max_file_size):
    """Every file's data section starts on a 4 KiB boundary; tensors stay contiguous (no gaps,
    which readers refuse); each starts at a multiple of its element size, and every tensor
    whose size is a multiple of 64 bytes starts 64-byte aligned. The plan is deterministic."""
    from orbax_safetensors._src.core import plan as _plan

    rng = np.random.default_rng(seed)
    dtypes = ["F64", "F32", "BF16", "F16", "I8", "U8", "BOOL", "C64", "F4", "I64"]
    specs = []
    for i in range(60):
        dtype = str(rng.choice(dtypes))
        shape = tuple(int(d) for d in rng.integers(1, 40, size=int(rng.integers(0, 3))))
        if dtype == "F4":
            shape = (*shape, 2)  # sub-byte tensors fill whole bytes
        specs.append(_plan.TensorSpec(f"t{i}", dtype, shape))
    plan = _plan.plan_files(specs, max_file_size=max_file_size, metadata={"format": "flax"})
    again = _plan.plan_files(specs, max_file_size=max_file_size, metadata={"format": "flax"})
    assert [f.header for f in plan.files] == [f.header for f in again.files]
    assert (len(plan.files) > 1) == (max_file_size is not None)
    for f in plan.files:
        assert f.data_start % 4096 == 0
        parsed = _parse(f.header + bytes(f.size - f.data_start))  # contiguous, covers the data
        assert parsed.data_start == f.data_start
        for e in f.entries.values():
            width = _dtypes.bits(e.dtype)
            if width >= 8:
                assert e.begin % (width // 8) == 0, e
            if e.nbytes % 64 == 0:
                assert e.begin % 64 == 0, e
        # Only tensors whose sizes are not multiples of 64 may start misaligned.
        odd = [e for e in f.entries.values() if e.nbytes % 64]
        assert sum(e.begin % 64 != 0 for e in f.entries.values()) <= max(len(odd) - 1, 0)


def test_files_padded_to_8_bytes_still_load(tmp_path):
    """A file laid out as before 4 KiB alignment (the header padded to 8 bytes, tensors at
    arbitrary 8-aligned offsets), as the official writer still writes them, loads, with its
    schema and checksums."""
    from safetensors.numpy import save_file as np_save_file

    tree = {"w": np.arange(300_000, dtype=np.float32).reshape(600, 500), "b": np.ones(3, np.int8)}
    new = tmp_path / "new.safetensors"
    osf.save_file(tree, new)
    raw = new.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8 : 8 + n].rstrip(b" ")
    text += b" " * (-(8 + len(text)) % 8)
    old = tmp_path / "old.safetensors"
    old.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    assert (8 + len(text)) % 4096 != 0
    got = osf.load_file(old)
    np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"])
    np.testing.assert_array_equal(got["b"], tree["b"])

    official = tmp_path / "official.safetensors"
    np_save_file({"a": np.ones(5, np.float16), "w": tree["w"]}, str(official))
    got = osf.load_file(official)
    np.testing.assert_array_equal(got["w"], tree["w"])
    np.testing.assert_array_equal(got["a"], np.ones(5, np.float16))
