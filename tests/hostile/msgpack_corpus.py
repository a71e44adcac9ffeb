"""Forged and damaged legacy Flax msgpack files, generated in code.

Each case is the bytes of a file that looks like a Flax state dict to the sniffer (a msgpack map
whose first key is a string) but lies: huge or negative dimensions, deep nesting, ext types
Flax never writes, wrong payloads, truncations, forged chunked arrays. Every one must raise
``FlaxMsgpackError`` (a ``SafetensorsCheckpointError``) naming the problem.

Example::

    for case in cases():
        path = tmp_path / case.name
        path.write_bytes(case.data)
        with pytest.raises(FlaxMsgpackError, match=case.match):
            flax_msgpack.read_file(path)
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile msgpack file: its bytes and a regex its error message matches."""

    name: str
    data: bytes
    match: str


def ext(code: int, payload: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload)


def ndarray(shape: object, dtype: object, data: bytes) -> msgpack.ExtType:
    """Flax's ndarray ext (code 1): msgpack ``(shape, dtype name, bytes)``."""
    return ext(1, msgpack.packb((shape, dtype, data), use_bin_type=True))


def state(value: object) -> bytes:
    """A Flax-like state dict holding ``value`` at ``params.w``."""
    return msgpack.packb({"params": {"w": value}, "step": 3}, use_bin_type=True)


def valid() -> bytes:
    """A valid file (what the damaged cases start from)."""
    w = np.arange(12, dtype=np.float32)
    return state(ndarray([3, 4], "float32", w.tobytes()))


def _nested_maps(depth: int) -> bytes:
    return b"\x81\xa1a" * depth + b"\xc0"


def _chunked(shape: dict[str, int], chunks: dict[str, object]) -> bytes:
    return state({"__msgpack_chunked_array__": True, "shape": shape, "chunks": chunks})


def cases() -> list[Case]:
    """Every forged msgpack case."""
    good = valid()
    f32 = np.zeros(2, np.float32).tobytes()
    items = [
        Case(
            "zero-size-huge-dim", state(ndarray([0, 2**64 - 1], "float32", b"")), "beyond any array"
        ),
        Case("huge-dims", state(ndarray([2**40, 2**40], "float32", f32)), "beyond any array"),
        Case("huge-dim-u64", state(ndarray([2**64 - 1], "uint8", b"\0")), "beyond any array"),
        Case("rank-65", state(ndarray([1] * 65, "float32", f32[:4])), "not a list of sizes"),
        Case("negative-dim", state(ndarray([-1], "float32", f32)), "not a list of sizes"),
        Case("bool-dim", state(ndarray([True], "float32", f32)), "not a list of sizes"),
        Case("shape-not-list", state(ndarray("2", "float32", f32)), "not a list of sizes"),
        Case("dtype-object", state(ndarray([1], "object", b"\0" * 8)), "not a numeric dtype"),
        Case("dtype-void", state(ndarray([1], "V8", b"\0" * 8)), "not a numeric dtype"),
        Case("dtype-bytes-huge", state(ndarray([1], "x" * 5000, b"\0")), "not a numeric dtype"),
        Case("bytes-short", state(ndarray([4], "float32", f32)), "needs 16 bytes"),
        Case("bytes-missing", state(ext(1, msgpack.packb(([2], "float32")))), "damaged array"),
        Case("ext-unknown", state(ext(7, b"\0")), "ext type 7"),
        Case(
            "ext-timestamp", b"\x82\xa6params\x81\xa1w\xd6\xff\0\0\0\x01\xa4step\x03", "Timestamp"
        ),
        Case("ext-not-triple", state(ext(1, msgpack.packb([1, 2]))), "damaged array"),
        Case("ext-garbage", state(ext(1, b"\xc1\xc1")), "damaged array"),
        Case(
            "ext-bin-length-lies",
            state(ext(1, b"\x93\x91\x02\xa7float32\xc6\xff\xff\xff\xff")),
            "needs|damaged",
        ),
        Case("scalar-with-shape", state(ext(3, msgpack.packb(([2], "float32", f32)))), "scalar"),
        Case("complex-damaged", state(ext(2, msgpack.packb(("a", 1)))), "complex"),
        Case("truncated-third", good[: len(good) // 3], "truncated|valid msgpack"),
        Case("truncated-last-byte", good[:-1], "truncated|valid msgpack|damaged"),
        Case("trailing-bytes", good + b"\0", "bytes follow"),
        Case("map-length-lies", b"\xdf\xff\xff\xff\xff\xa1a\xc0", "valid msgpack"),
        Case("str-length-lies", b"\x81\xdb\xff\xff\xff\xffabc", "valid msgpack"),
        Case("bin-length-lies", b"\x81\xa1w\xc6\xff\xff\xff\xff\x01", "valid msgpack"),
        Case("ext32-length-lies", b"\x81\xa1w\xc9\xff\xff\xff\xff\x01", "valid msgpack"),
        Case("deep-maps-200", _nested_maps(200), "nested deeper"),
        Case("deep-maps-100k", _nested_maps(100_000), "nested|valid msgpack"),
        Case("deep-lists-200", b"\x81\xa1a" + b"\x91" * 200 + b"\xc0", "nested deeper"),
        Case(
            "chunked-mixed-dtypes",
            _chunked(
                {"0": 4}, {"0": ndarray([2], "float32", f32), "1": ndarray([2], "int32", f32)}
            ),
            "several dtypes",
        ),
        Case(
            "chunked-count-mismatch",
            _chunked({"0": 5}, {"0": ndarray([2], "float32", f32)}),
            "needs 5",
        ),
        Case(
            "chunked-huge-shape",
            _chunked({"0": 2**62, "1": 2**62}, {"0": ndarray([2], "float32", f32)}),
            "needs|beyond any array",
        ),
        Case("chunked-missing-entry", _chunked({"1": 2}, {"0": 1}), "missing"),
        Case("chunked-not-arrays", _chunked({"0": 2}, {"0": "xx"}), "1-D arrays"),
    ]
    return items
