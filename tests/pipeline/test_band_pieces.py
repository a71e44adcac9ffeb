"""pipeline/pieces: an export's large tensors cast band by band (``band_rows``,
``band_piece``) into buffers lent by ``storage/buffers.LentBuffers`` and placed for direct
I/O: the bands, put together at their file offsets, are byte for byte the whole tensor cast by
``core/astype`` (what ``jnp.astype`` gives on CPU), whatever the source's layout."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from orbax_safetensors._src.core import casting as _casting
from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.pipeline import pieces as _pieces
from orbax_safetensors._src.storage import buffers as _buffers

MiB = 1 << 20


def test_band_rows_cut_axis_0_into_bands_of_at_most_the_band_bytes():
    assert _pieces.band_rows((1000, 1024), 2, MiB) == [(0, 512), (512, 1000)]
    assert _pieces.band_rows((3, 4 * MiB), 1, MiB) == [(0, 1), (1, 2), (2, 3)]  # a row each
    assert _pieces.band_rows((7,), 4, 8) == [(0, 7)]  # 1-D: one band
    assert _pieces.band_rows((), 4, 8) == [(0, 1)]  # 0-D: one band
    assert _pieces.band_rows((0, 5), 4, 8) == [(0, 0)]  # empty: one empty band
    for shape, band in [((1025, 3, 7), 4096), ((64, 64), 64 * 64 * 4), ((5, 1), 1)]:
        rows = _pieces.band_rows(shape, 4, band)
        assert rows[0][0] == 0 and rows[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # contiguous, no overlap
        row_bytes = 4 * int(np.prod(shape[1:]))
        assert all((b - a) * row_bytes <= max(band, row_bytes) for a, b in rows)


def _sources() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((1536, 1031), np.float32) * 1e3
    f32[0, :8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, 1e-45, 65520.0]  # edges
    stacked = rng.standard_normal((6, 300, 257), np.float32)
    return [
        ("contiguous", f32),
        ("transposed", f32.T),  # a Transpose rule's view: not C-contiguous
        ("stacked", stacked),
        ("stacked_swapped", stacked.transpose(0, 2, 1)),
        ("strided", f32[::2, ::3]),
        ("flat", f32.reshape(-1)),  # 1-D: one band above the capacity
        ("wide_rows", rng.standard_normal((3, 2 * MiB // 4 + 5), np.float32)),
        ("ints", rng.integers(-(2**31), 2**31 - 1, (2048, 513), dtype=np.int64)),
    ]


@pytest.mark.parametrize("target", [ml_dtypes.bfloat16, np.float16, np.int8, np.float32])
@pytest.mark.parametrize("band_bytes", [MiB, 3 * MiB + 4100])
def test_bands_at_their_file_offsets_are_the_whole_cast(target, band_bytes, monkeypatch):
    """Every source layout, cast by bands into lent buffers, gives in the file the bytes of
    ``astype`` of the whole tensor; each buffer sits at its file offset's phase modulo 4 KiB
    (the direct writer sends it as it is), and bands reuse the buffers given back."""
    monkeypatch.setattr(_pieces, "BAND_BYTES", band_bytes)
    sources = _sources()
    target = np.dtype(target)
    specs = _plan.specs_of([(name, target, v.shape) for name, v in sources])
    specs.insert(0, _plan.specs_of([("odd", np.dtype(np.uint8), (13,))])[0])  # offsets not 4K
    plan = _plan.plan_files(specs, max_file_size=40 * MiB)
    lent = _buffers.LentBuffers(band_bytes, max_idle=4)
    for name, value in sources:
        fplan, entry = plan.locate(name)
        file_bytes = np.zeros(entry.nbytes, np.uint8)
        start = fplan.data_start + entry.begin
        for rows in _pieces.band_rows(value.shape, target.itemsize, band_bytes):
            file_index, (piece,) = _pieces.band_piece(plan, name, value, rows, lent)
            assert file_index == plan.file_of[name]
            data = np.frombuffer(piece.data, np.uint8)
            assert (data.ctypes.data - piece.offset) % 4096 == 0, name
            file_bytes[piece.offset - start : piece.offset - start + data.nbytes] = data
            lent.give_back(piece.data)
        want = _casting.astype(value, target)
        np.testing.assert_array_equal(file_bytes, want.reshape(-1).view(np.uint8), err_msg=name)
    assert lent.fresh == 1  # one buffer, given back after each band, served every band
    # (the 1-D tensor above the capacity got fresh memory of its own, placed all the same)


def test_cast_in_bands_only_for_large_whole_byte_casts_or_relayouts():
    big = np.zeros((1024, 512), np.float32)  # 2 MiB
    small = np.zeros((16, 16), np.float32)
    specs = _plan.specs_of(
        [
            ("cast", np.dtype(ml_dtypes.bfloat16), big.shape),
            ("same", np.dtype(np.float32), big.shape),
            ("relaid", np.dtype(np.float32), big.T.shape),
            ("small", np.dtype(ml_dtypes.bfloat16), small.shape),
            ("nibbles", np.dtype(ml_dtypes.float4_e2m1fn), (4096, 1024)),  # 2 MiB
        ]
    )
    plan = _plan.plan_files(specs, max_file_size=None)
    assert _pieces.cast_in_bands(plan, "cast", big)
    assert not _pieces.cast_in_bands(plan, "same", big)  # written from the source as it is
    assert _pieces.cast_in_bands(plan, "relaid", big.T)
    assert not _pieces.cast_in_bands(plan, "small", small)  # below BAND_MIN_BYTES
    nibbles = np.zeros((4096, 1024), np.float32)
    assert not _pieces.cast_in_bands(plan, "nibbles", nibbles)  # 4 bits: not whole bytes
