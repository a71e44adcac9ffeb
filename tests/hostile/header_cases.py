"""Hostile safetensors headers: the file's header is forged, so ``read_header``, ``load_file``
and ``verify`` all fail.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbax_safetensors import HeaderError, UnsafePathError

from .bases import (
    MAX_HEADER,
    Case,
    base_file_bytes,
    drop,
    join,
    make_fifo,
    split,
    tensor_names,
    write_file,
)

# --------------------------------------------------------------------------- header cases


def _raw(make: Callable[[], bytes]) -> Callable[[Path], Path]:
    return lambda d: write_file(d, make())


def _doc(
    edit: Callable[[dict[str, Any], bytes], tuple[Any, bytes] | None],
) -> Callable[[Path], Path]:
    """A case made by editing the parsed header (``edit`` may return a new (doc, data))."""

    def build(d: Path) -> Path:
        doc, data = split(base_file_bytes())
        out = edit(doc, data)
        if out is not None:
            doc, data = out
        return write_file(d, join(doc, data))

    return build


def _text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """A case made by editing the header's JSON text (for what a dict cannot hold)."""

    def build(d: Path) -> Path:
        doc, data = split(base_file_bytes())
        return write_file(d, join(edit(json.dumps(doc)).encode(), data))

    return build


def _set(name: str, field: str, value: Any) -> Callable[[Path], Path]:
    def edit(doc: dict[str, Any], data: bytes) -> None:
        doc[name][field] = value

    return _doc(edit)


def _shift_last(delta: int, extra: int) -> Callable[[Path], Path]:
    def edit(doc: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
        last = doc[tensor_names(doc)[-1]]
        begin, end = last["data_offsets"]
        last["data_offsets"] = [begin + delta, end + delta]
        return doc, data + b"\0" * extra

    return _doc(edit)


def _overlap(doc: dict[str, Any], data: bytes) -> None:
    second = doc[tensor_names(doc)[1]]
    begin, end = second["data_offsets"]
    second["data_offsets"] = [begin - 4, end - 4]


def _dup_tensor(text: str) -> str:
    doc = json.loads(text)
    entry = json.dumps(doc["a"])
    return text[:-1] + f', "a": {entry}}}'


def _meta(value: Any) -> Callable[[Path], Path]:
    def edit(doc: dict[str, Any], data: bytes) -> None:
        doc["__metadata__"]["evil"] = value

    return _doc(edit)


def header_cases() -> list[Case]:
    pack = functools.partial(struct.pack, "<Q")
    H = HeaderError
    raws: list[tuple[str, Callable[[], bytes], str]] = [
        ("empty-file", lambda: b"", "too short"),
        ("tiny-file", lambda: b"\x01\x02\x03", "too short"),
        ("seven-bytes", lambda: b"\0" * 7, "too short"),
        ("length-0", lambda: pack(0) + b"{}      ", "header length is 0"),
        ("length-past-end", lambda: pack(1000) + b"{}      ", "runs past the end"),
        ("length-90MiB-claimed", lambda: pack(90 << 20) + b"{}      ", "runs past the end"),
        ("length-2**63", lambda: pack(2**63) + b"{}      ", "exceeds"),
        ("length-2**64-1", lambda: pack(2**64 - 1) + b"{}      ", "exceeds"),
        ("length-above-cap", lambda: pack(MAX_HEADER + 8) + b"{}      ", "exceeds"),
        ("truncated-header", lambda: base_file_bytes()[:40], "runs past the end"),
        ("invalid-utf8", lambda: join(b'{"\xff\xfe": 1}', b""), "UTF-8"),
        ("invalid-json", lambda: join(b'{"a": [1, 2', b""), "not valid JSON"),
        ("json-extra-data", lambda: join(b"{} {}", b""), "not valid JSON"),
        ("json-array", lambda: join(b"[1, 2, 3]", b""), "JSON object"),
        ("json-string", lambda: join(b'"abc"', b""), "JSON object"),
        ("json-leading-space", lambda: join(b" {}", b""), "JSON object"),
        ("json-bom", lambda: join(b"\xef\xbb\xbf{}", b""), "JSON object"),
        (
            "deep-arrays-100k",
            lambda: join(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b""),
            "nested too deeply",
        ),
        (
            "deep-objects-50k",
            lambda: join(b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b""),
            "nested too deeply",
        ),
        (
            "deep-unterminated",
            lambda: join(b'{"a":' + b"[" * 100_000, b""),
            "nested too deeply|not valid JSON",
        ),
        ("huge-integer-text", lambda: join(b'{"a":' + b"9" * 50_000 + b"}", b""), "JSON"),
    ]
    cases = [Case(n, "header", _raw(m), H, r) for n, m, r in raws]
    docs: list[tuple[str, Callable[[Path], Path], str]] = [
        ("duplicate-tensor", _text(_dup_tensor), "duplicate key 'a'"),
        (
            "duplicate-field",
            _text(lambda t: t.replace('"dtype": "F32"', '"dtype": "F32", "dtype": "F32"', 1)),
            "duplicate key 'dtype'",
        ),
        (
            "duplicate-metadata-key",
            _text(lambda t: t.replace('"format": "flax"', '"format": "flax", "format": "pt"')),
            "duplicate key 'format'",
        ),
        ("offsets-overlap", _doc(_overlap), "overlaps"),
        ("offsets-hole", _shift_last(8, 8), "hole"),
        ("offsets-out-of-bounds", _shift_last(8, 0), "past the"),
        ("offsets-negative", _set("a", "data_offsets", [-4, 20]), "data_offsets"),
        ("offsets-float", _set("a", "data_offsets", [0.0, 24.0]), "data_offsets"),
        ("offsets-string", _set("a", "data_offsets", ["0", "24"]), "data_offsets"),
        ("offsets-bool", _set("a", "data_offsets", [False, True]), "data_offsets"),
        ("offsets-null", _set("a", "data_offsets", None), "data_offsets"),
        ("offsets-reversed", _set("a", "data_offsets", [24, 0]), "data_offsets"),
        ("offsets-one", _set("a", "data_offsets", [24]), "data_offsets"),
        ("offsets-three", _set("a", "data_offsets", [0, 12, 24]), "data_offsets"),
        ("offsets-2**64", _set("a", "data_offsets", [0, 2**64]), "past the"),
        (
            "offsets-nan",
            # (a's begin, wherever the layout puts it)
            _text(lambda t: re.sub(r'("a": \{[^}]*"data_offsets": \[)\d+', r"\1NaN", t)),
            "data_offsets",
        ),
        ("dtype-unknown", _set("a", "dtype", "F31"), "unknown dtype"),
        ("dtype-lowercase", _set("a", "dtype", "f32"), "unknown dtype"),
        ("dtype-int", _set("a", "dtype", 5), "unknown dtype"),
        ("dtype-object-pickle", _set("a", "dtype", "object"), "unknown dtype"),
        ("shape-negative", _set("a", "shape", [-2, -3]), "shape"),
        ("shape-float", _set("a", "shape", [2.0, 3.0]), "shape"),
        ("shape-string", _set("a", "shape", "2x3"), "shape"),
        ("shape-bool", _set("a", "shape", [True, 6]), "shape"),
        ("shape-nested", _set("a", "shape", [[2], 3]), "shape"),
        ("shape-2**62-squared", _set("a", "shape", [2**62, 2**62]), "overflow|span"),
        ("shape-zero-by-2**63", _extra([0, 2**63], 0), "overflow"),
        ("shape-zero-by-2**64", _extra([2**64, 0], 0), "overflow"),
        ("shape-65-dims", _set("a", "shape", [1] * 65), "dimensions"),
        ("bytes-mismatch", _set("a", "shape", [3, 3]), "span"),
        ("sub-byte-partial", _set("a", "dtype", "F4"), "span|whole number"),
        ("metadata-int-value", _meta(1), "__metadata__"),
        ("metadata-null-value", _meta(None), "__metadata__"),
        ("metadata-object-value", _meta({"x": "y"}), "__metadata__"),
        (
            "metadata-list",
            _doc(lambda doc, data: doc.update({"__metadata__": ["a"]})),
            "__metadata__",
        ),
        ("entry-not-object", _doc(lambda doc, data: doc.update({"a": [1, 2]})), "exactly dtype"),
        ("entry-missing-field", _doc(lambda doc, data: drop(doc["a"], "shape")), "exactly dtype"),
        ("entry-extra-field", _set("a", "module", "os"), "exactly dtype"),
        ("truncated-data", lambda d: write_file(d, base_file_bytes()[:-1]), "past the|cover"),
        ("trailing-bytes", lambda d: write_file(d, base_file_bytes() + b"\0" * 8), "cover"),
        (
            "claimed-terabyte-tensor",
            _extra([1 << 38], 1 << 40),
            "past the",
        ),
    ]
    cases += [Case(n, "header", b, H, r) for n, b, r in docs]
    cases.append(
        Case("fifo-not-a-file", "header", make_fifo, UnsafePathError, "a FIFO, not a regular file")
    )
    return cases


def _extra(shape: list[int], nbytes: int) -> Callable[[Path], Path]:
    """Adds an F32 tensor ``z`` of ``shape`` claiming ``nbytes`` after the last tensor."""

    def edit(doc: dict[str, Any], data: bytes) -> None:
        end = max(v["data_offsets"][1] for k, v in doc.items() if k != "__metadata__")
        doc["z"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + nbytes]}

    return _doc(edit)
