"""The wire format's dtypes: the dtype table and sub-byte packing.

Interop is checked with the other tools' own readers (``safetensors.safe_open``, PyTorch), never
with this library's reader alone.
"""

from __future__ import annotations

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

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch (in the main environment)")


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
