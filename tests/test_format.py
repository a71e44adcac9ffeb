"""The wire format: headers, the dtype table, sub-byte packing, streaming saves, refused leaves.

Interop is checked with the other tools' own readers (``safetensors.safe_open``, PyTorch), never
with this library's reader alone.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

try:
    import torch
    from safetensors.torch import save_file as torch_save_file
except ImportError:  # the supported-stack venvs of .ci/matrix have no PyTorch
    torch = None

import official_reader

import orbax_safetensors as osf
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch (in the main environment)")

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


# --------------------------------------------------------------------------- dtype table

# The safetensors dtype vocabulary and the element types holding it (the public table).
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F4": np.dtype(ml_dtypes.float4_e2m1fn),
    "F6_E2M3": np.dtype(ml_dtypes.float6_e2m3fn),
    "F6_E3M2": np.dtype(ml_dtypes.float6_e3m2fn),
}
# safetensors name -> the torch dtype that reads it
TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


def _sample(dtype: np.dtype, shape=(3, 4), seed: int = 0) -> np.ndarray:
    """Every bit pattern that is a valid value of ``dtype``, in a deterministic order."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    if dtype == np.complex64:
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
    values = rng.standard_normal(n) * 4
    if dtype == ml_dtypes.float8_e8m0fnu:
        values = np.exp2(rng.integers(-20, 20, n)).astype(np.float64)
    return values.astype(dtype).reshape(shape)


def test_dtype_table_is_the_safetensors_vocabulary():
    assert set(_dtypes.SAFETENSORS_DTYPES) == set(DTYPES)
    for name, dt in DTYPES.items():
        assert _dtypes.to_numpy(name) == dt
        assert _dtypes.from_numpy(dt) == name
    with pytest.raises(osf.UnsupportedLeafError, match="unknown safetensors dtype"):
        _dtypes.to_numpy("F128")


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_round_trips_bit_exactly(tmp_path, name):
    dt = DTYPES[name]
    value = _sample(dt, (4, 6))
    tree = {"x": value}
    if _dtypes.bits(name) % 8 == 0:  # a sub-byte scalar is not a whole number of bytes
        tree["scalar"] = value.reshape(-1)[:1].reshape(())
    path = tmp_path / f"{name}.safetensors"
    osf.save_file(tree, path)
    entry = osf.read_header(path).tensors["x"]
    assert entry.dtype == name
    assert entry.shape == (4, 6)
    assert entry.nbytes == 24 * _dtypes.bits(name) // 8
    out = osf.load_file(path)
    assert type(out["x"]) is np.ndarray
    assert out["x"].dtype == dt
    assert out["x"].shape == (4, 6)
    assert out["x"].tobytes() == value.tobytes()
    if "scalar" in tree:
        assert out["scalar"].shape == ()
        assert out["scalar"].tobytes() == tree["scalar"].tobytes()


@needs_torch
@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_whole_byte_dtypes_read_by_torch_with_the_same_bytes(tmp_path, name):
    value = _sample(DTYPES[name], (3, 4), seed=1)
    path = tmp_path / "t.safetensors"
    osf.save_file({"x": value}, path)
    with safe_open(path, "pt") as f:
        t = f.get_tensor("x")
    assert t.dtype == getattr(torch, TORCH_DTYPES[name])
    assert tuple(t.shape) == (3, 4)
    assert t.contiguous().view(torch.uint8).numpy().tobytes() == value.tobytes()


def test_jax_only_narrow_dtypes_have_no_safetensors_name(tmp_path):
    for dt in (jnp.int4, jnp.uint4, jnp.int2, np.complex128, np.dtype("U3"), np.dtype(object)):
        with pytest.raises(osf.UnsupportedLeafError, match="no safetensors equivalent"):
            _dtypes.from_numpy(dt, key="k")


# --------------------------------------------------------------------------- sub-byte

SUB_BYTE = ["F4", "F6_E2M3", "F6_E3M2"]


@pytest.mark.parametrize("name", SUB_BYTE)
@pytest.mark.parametrize("count", [0, 8, 24, 1 << 16, (1 << 16) * 3 + 8, 200_000])
def test_sub_byte_pack_unpack_round_trip(name, count):
    width = _dtypes.bits(name)
    codes = np.random.default_rng(count).integers(0, 1 << width, count, dtype=np.uint8)
    values = codes.view(DTYPES[name])
    raw = _dtypes.pack(values, name)
    assert raw.dtype == np.uint8
    assert raw.size == count * width // 8 == _dtypes.nbytes(name, (count,))
    back = _dtypes.unpack(raw, name, (count,))
    assert back.dtype == DTYPES[name]
    np.testing.assert_array_equal(back.view(np.uint8), codes)


@pytest.mark.parametrize("name", SUB_BYTE)
def test_sub_byte_bit_order_is_little_endian(name):
    # Element 0 sits in the lowest bits of byte 0; element 1 follows directly above it.
    width = _dtypes.bits(name)
    codes = np.zeros(8, np.uint8)
    codes[0], codes[1] = 1, (1 << width) - 1
    raw = _dtypes.pack(codes.view(DTYPES[name]), name)
    bitstream = np.unpackbits(raw, bitorder="little")
    expected = np.zeros(8 * width, np.uint8)
    expected[0] = 1
    expected[width : 2 * width] = 1
    np.testing.assert_array_equal(bitstream, expected)


@pytest.mark.parametrize("name", SUB_BYTE)
def test_sub_byte_round_trip_through_a_file(tmp_path, name):
    width = _dtypes.bits(name)
    codes = np.random.default_rng(2).integers(0, 1 << width, (4, 8), dtype=np.uint8)
    value = codes.view(DTYPES[name])
    path = tmp_path / "s.safetensors"
    tree = {"q": value}
    if name == "F4":  # XLA has no F6 types: jax cannot hold F6 arrays on CPU
        tree["j"] = jnp.asarray(value)
    osf.save_file(tree, path)
    entry = osf.read_header(path).tensors["q"]
    assert (entry.dtype, entry.shape, entry.nbytes) == (name, (4, 8), 32 * width // 8)
    out = osf.load_file(path)
    np.testing.assert_array_equal(out["q"].view(np.uint8), codes)
    if name == "F4":
        assert isinstance(out["j"], jax.Array)
        assert out["j"].dtype == DTYPES[name]
        np.testing.assert_array_equal(np.asarray(out["j"]).view(np.uint8), codes)


# E2M1 code -> value, from the OCP Microscaling spec: sign bit 3, exponent bits 2-1, mantissa bit 0.
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@needs_torch
def test_f4_file_is_torch_float4_e2m1fn_x2(tmp_path):
    # PyTorch reads an F4 tensor as float4_e2m1fn_x2: one byte holds two values, element 2i in the
    # low nibble and 2i+1 in the high nibble (the OCP MX / ONNX FLOAT4E2M1 packing), so the last
    # dimension is halved. Decode torch's bytes with the spec's table, independently of ml_dtypes.
    value = _E2M1.reshape(2, 8).astype(ml_dtypes.float4_e2m1fn)
    path = tmp_path / "f4.safetensors"
    osf.save_file({"q": value}, path)
    with safe_open(path, "pt") as f:
        t = f.get_tensor("q")
    assert t.dtype == torch.float4_e2m1fn_x2
    assert tuple(t.shape) == (2, 4)
    raw = t.view(torch.uint8).numpy()
    decoded = np.stack([_E2M1[raw & 0xF], _E2M1[raw >> 4]], axis=-1).reshape(2, 8)
    np.testing.assert_array_equal(decoded, _E2M1.reshape(2, 8))
    assert raw[0, 0] == 0x10  # 0.0 (code 0) low, 0.5 (code 1) high


@needs_torch
def test_f4_file_written_by_torch_loads_as_float4(tmp_path):
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    path = tmp_path / "torch_f4.safetensors"
    torch_save_file({"w": torch.from_numpy(packed).view(torch.float4_e2m1fn_x2)}, str(path))
    out = osf.load_file(path)  # a plain safetensors file: a flat dict back
    assert out["w"].dtype == ml_dtypes.float4_e2m1fn
    assert out["w"].shape == (3, 10)
    expected = np.stack([_E2M1[packed & 0xF], _E2M1[packed >> 4]], axis=-1).reshape(3, 10)
    np.testing.assert_array_equal(np.asarray(out["w"]).astype(np.float32), expected)


def test_f6_is_not_readable_by_the_safetensors_python_bindings(tmp_path):
    # safetensors 0.8 lists F6_E2M3/F6_E3M2 in its Rust dtype enum but its Python bindings refuse
    # them, so F6 interop cannot be checked here; our own round trip is tested above.
    path = tmp_path / "f6.safetensors"
    osf.save_file({"q": np.zeros(4, ml_dtypes.float6_e2m3fn)}, path)
    # Older bindings (safetensors < 0.6) refuse the whole header instead.
    match = "F6_E2M3" if official_reader.reads("F6_E2M3") else None
    with pytest.raises(Exception, match=match), safe_open(path, "numpy") as f:
        f.get_tensor("q")


def test_sub_byte_tensor_not_filling_whole_bytes_is_refused(tmp_path):
    path = tmp_path / "odd.safetensors"
    with pytest.raises(
        osf.UnsupportedLeafError, match=r"leaf .layer\.q.: .*not a whole number of bytes"
    ):
        osf.save_file({"layer": {"q": np.zeros(3, ml_dtypes.float4_e2m1fn)}}, path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- streaming save

_MEASURE = textwrap.dedent(
    """
    import json, os, sys, tracemalloc
    os.environ["JAX_PLATFORMS"] = "cpu"
    import ml_dtypes
    import numpy as np
    import orbax_safetensors as osf

    kind, path = sys.argv[1], sys.argv[2]
    mb = 1 << 20
    if kind == "mixed":
        tree = {
            "big": np.ones(8 * mb, np.float32),                       # 32 MiB: the largest
            "layers": [{"w": np.full(2 * mb, i, np.float64)} for i in range(6)],  # 6 x 16 MiB
            "bf16": np.ones(4 * mb, ml_dtypes.bfloat16),              # 8 MiB
            "step": 7,
        }
    else:  # sub-byte: packing makes the on-disk copy, half the in-memory size
        tree = {"q": np.ones(32 * mb, ml_dtypes.float4_e2m1fn), "s": np.ones(mb, np.float32)}
    largest = max(a.nbytes for a in tree.values() if hasattr(a, "nbytes"))
    total = sum(x.nbytes for x in __import__("jax").tree.leaves(tree) if hasattr(x, "nbytes"))
    osf.save_file({"warm": np.ones(4)}, path)  # import-time and first-call allocations
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    osf.save_file(tree, path)
    peak = tracemalloc.get_traced_memory()[1] - base
    print(json.dumps({"peak": peak, "largest": largest, "total": total}))
    """
)


@pytest.mark.parametrize("kind", ["mixed", "sub_byte"])
def test_save_streams_host_arrays_without_a_whole_file_buffer(tmp_path, kind):
    # numpy registers its buffers with tracemalloc, so the peak counts every temporary array.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, kind, str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["total"] > 3 * r["largest"] or kind == "sub_byte"
    assert r["peak"] < r["largest"], r
    if kind == "mixed":
        assert r["peak"] < (1 << 20), r  # no tensor is copied at all, only the header is built


# --------------------------------------------------------------------------- refused leaves

BAD_TREES = [
    ({"ok": np.ones(2), "opt": {"fn": object()}}, "opt.fn", "builtins.object"),
    ({"ok": np.ones(2), "names": np.array(["a", "b"])}, "names", "<U1"),
    ({"ok": np.ones(2), "z": [np.ones(3, np.complex128)]}, "z.0", "complex128"),
    ({"ok": jnp.ones(2), "q": jnp.ones(4, jnp.int4)}, "q", "int4"),
    ({"ok": np.ones(2), "f": lambda x: x}, "f", "function"),
    ({"ok": np.ones(2), (1, 2): np.ones(1)}, "(1, 2)", "only str and int keys"),
]


@pytest.mark.parametrize(("tree", "key", "detail"), BAD_TREES)
def test_unsupported_leaf_raises_naming_the_key_and_writes_nothing(tmp_path, tree, key, detail):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(osf.UnsupportedLeafError) as info:
        osf.save_file(tree, path)
    assert key in str(info.value)
    assert detail in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no file and no temporary file


@pytest.mark.parametrize(("tree", "key", "detail"), BAD_TREES[:3])
def test_unsupported_leaf_is_refused_before_any_io(tmp_path, tree, key, detail):
    # The directory does not exist: touching the filesystem would raise FileNotFoundError.
    with pytest.raises(osf.UnsupportedLeafError, match=key.replace(".", r"\.")):
        osf.save_file(tree, tmp_path / "missing" / "bad.safetensors")


def test_failed_save_keeps_an_existing_file(tmp_path):
    path = tmp_path / "keep.safetensors"
    osf.save_file({"w": np.arange(3.0)}, path)
    before = path.read_bytes()
    with pytest.raises(osf.UnsupportedLeafError):
        osf.save_file({"w": np.arange(3.0), "bad": object()}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_bad_user_metadata_is_refused_before_writing(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(osf.UnsupportedLeafError, match="str to str"):
        osf.save_file({"w": np.ones(2)}, path, metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(osf.UnsupportedLeafError, match="reserved"):
        osf.save_file({"w": np.ones(2)}, path, metadata={"orbax_safetensors.tree": "{}"})
    assert list(tmp_path.iterdir()) == []


def test_failure_after_writing_removes_the_temporary_file(tmp_path):
    # The destination is a directory: the temporary file is written in full, then the rename
    # fails; the temporary file must not stay behind.
    path = tmp_path / "w.safetensors"
    path.mkdir()
    with pytest.raises(OSError):
        osf.save_file({"w": np.ones(1000)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    assert list(path.iterdir()) == []


def test_jax_arrays_are_accepted_with_their_dtype(tmp_path):
    path = tmp_path / "j.safetensors"
    tree = {"w": jnp.ones((2, 3), jnp.bfloat16), "k": jax.random.key(0)}
    osf.save_file(tree, path)
    tensors = osf.read_header(path).tensors
    assert (tensors["w"].dtype, tensors["w"].shape) == ("BF16", (2, 3))
    assert (tensors["k"].dtype, tensors["k"].shape) == ("U32", (2,))


# --------------------------------------------------------------------------- docs/format.md


def _doc_json_blocks() -> list[object]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    blocks = re.findall(r"^```json\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    out = []
    for b in blocks:
        try:
            out.append(json.loads(b))
        except ValueError:
            out.append(None)  # templates such as {"format": ..., "tree": NODE}
    return out


def test_worked_example_in_format_md_is_what_save_file_writes(tmp_path):
    w = jnp.ones((2, 2), jnp.float32)
    tree = {
        "layers": [{"w": w, "b": np.zeros(2, np.float16)}],
        "head": w,
        "step": 10,
        "lr": 0.001,
        "rng": jax.random.key(0),
        1: None,
        "cfg": ("relu", True),
    }
    path = tmp_path / "ex.safetensors"
    osf.save_file(tree, path, metadata={"run": "demo"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    blocks = [b for b in _doc_json_blocks() if isinstance(b, dict)]
    assert header in blocks  # the tensor entries
    assert json.loads(meta["orbax_safetensors.tree"]) in blocks  # the schema
    doc_meta = next(b for b in blocks if "orbax_safetensors.crc32c" in b)
    assert json.loads(doc_meta["orbax_safetensors.crc32c"]) == json.loads(
        meta["orbax_safetensors.crc32c"]
    )
    assert {k: v for k, v in doc_meta.items() if not k.startswith("orbax")} == {
        "format": "flax",
        "run": "demo",
    }
    # the numbers quoted in the prose
    assert (len(raw), n, raw[:8].hex(" ")) == (4124, 4088, "f8 0f 00 00 00 00 00 00")
    assert len(raw[8 : 8 + n].rstrip(b" ")) == 1076
