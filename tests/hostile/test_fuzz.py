"""Fuzzing the header parser, the schema validator and restore with hypothesis, time-bounded.

Each target runs repeated hypothesis batches until its share of the budget is spent
(``OSF_FUZZ_SECONDS``, default 24 s in total). Inputs are random bytes, mutated valid files,
valid headers with fields replaced by random JSON, random JSON schemas and mutated valid
schemas. Only our own ``ValueError`` subclasses may escape; whatever parses must be consistent.

Run longer locally::

    OSF_FUZZ_SECONDS=600 python -m pytest tests/hostile/test_fuzz.py
"""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbax_safetensors import HeaderError, SafetensorsCheckpointError, SchemaError
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.pipeline import read as _read
from orbax_safetensors._src.pipeline.restore_plan import restore_tree
from orbax_safetensors._src.storage import router as _router

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import corpus, fuzzing
except ImportError:  # tests/ became a package
    from tests.hostile import corpus, fuzzing

pytestmark = pytest.mark.timeout(int(fuzzing.BUDGET * 3) + 120)

_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def _parse(raw: bytes) -> _header.Header | None:
    """parse_header on in-memory bytes: a Header, or None after a HeaderError."""
    try:
        header = _header.parse_header(raw[:8], lambda n: raw[8 : 8 + n], len(raw), where="fuzz")
    except HeaderError:
        return None
    # Whatever parses is consistent: entries tile the data section and match dtype x shape.
    offset = 0
    for e in sorted(header.tensors.values(), key=lambda e: (e.begin, e.end)):
        assert e.begin == offset and e.nbytes == _dtypes.nbytes(e.dtype, e.shape)
        offset = e.end
    assert header.data_start + offset == len(raw)
    assert all(isinstance(v, str) for v in header.metadata.values())
    return header


_BASE = corpus.base_file_bytes()
_HEADER_END = 8 + struct.unpack("<Q", _BASE[:8])[0]
_DOC, _DATA = corpus.split(_BASE)
_SCHEMA = json.loads(_DOC["__metadata__"][corpus.SCHEMA_KEY])

_EDGE: list[Any] = [0, -1, 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63, 2**64, -(2**63), 1.5, 1e308]
_EDGE += [True, False, None, "", "F32", "BF16", "F4", "__metadata__", "tensor", "ref", [], {}]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(_EDGE),
)
_json = st.recursive(
    _scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)
    ),
    max_leaves=16,
)


# --------------------------------------------------------------------------- header parser


@_SETTINGS
@given(st.binary(max_size=300))
def _random_bytes(raw: bytes) -> None:
    _parse(raw)


@_SETTINGS
@given(st.binary(min_size=0, max_size=200), st.integers(0, 2**64 - 1))
def _random_after_prefix(body: bytes, length: int) -> None:
    _parse(struct.pack("<Q", length % (len(body) + 16) if length % 3 else length) + body)


@st.composite
def _mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(_BASE)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            data = bytearray(b"\0")
        in_header = draw(st.integers(0, 4)) > 0
        pos = draw(
            st.integers(0, max(0, min(len(data), _HEADER_END if in_header else len(data)) - 1))
        )
        op = draw(
            st.sampled_from(["flip", "set", "insert", "delete", "truncate", "length", "ascii"])
        )
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "length":
            data[0:8] = struct.pack(
                "<Q", draw(st.sampled_from([0, 1, len(data), 2**63, 2**64 - 1]))
            )
        else:  # a JSON-significant character
            data[pos] = ord(draw(st.sampled_from('{}[]":,-0123456789eE.tfn \\u')))
    return bytes(data)


@_SETTINGS
@given(_mutations())
def _mutated_file(raw: bytes) -> None:
    _parse(raw)


@st.composite
def _edited_headers(draw: st.DrawFn) -> bytes:
    doc = json.loads(json.dumps(_DOC))
    names = [k for k in doc if k != "__metadata__"]
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from([*names, "__metadata__", "<new>"]))
        if target == "<new>":
            doc[draw(st.text(max_size=6))] = draw(_json)
        elif target == "__metadata__" and isinstance(doc.get(target), dict):
            doc["__metadata__"][draw(st.text(max_size=4))] = draw(_json)
        else:
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "<entry>", "<drop>"]))
            if field == "<entry>" or not isinstance(doc.get(target), dict):
                doc[target] = draw(_json)
            elif field == "<drop>":
                doc[target].pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
            else:
                doc[target][field] = draw(_json)
    extra = draw(st.sampled_from([0, 0, 1, 8, -1]))
    data = _DATA + b"\0" * extra if extra >= 0 else _DATA[:-1]
    return corpus.join(doc, data)


@_SETTINGS
@given(_edited_headers())
def _edited_header(raw: bytes) -> None:
    _parse(raw)


def test_fuzz_header_parser() -> None:
    assert _parse(_BASE) is not None
    runs = fuzzing.run_for(0.1, _random_bytes)
    runs += fuzzing.run_for(0.1, _random_after_prefix)
    runs += fuzzing.run_for(0.2, _mutated_file)
    runs += fuzzing.run_for(0.2, _edited_header)
    assert runs >= 4


# --------------------------------------------------------------------------- schema validator


def _validate(schema: Any) -> dict[str, _tree.SchemaLeaf] | None:
    try:
        leaves = _tree.validate_schema(schema)
    except SchemaError:
        return None
    # Whatever validates can be rebuilt without surprises.
    _tree.unflatten(schema, lambda leaf: leaf.tensor_name)
    return leaves


@_SETTINGS
@given(_json)
def _random_schema(value: Any) -> None:
    _validate(value)
    _validate({"format": _tree.SCHEMA_FORMAT, "version": 1, "tree": value})


def _slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) position in a JSON value."""
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((node, k))
            _slots(v, out)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            _slots(v, out)
    return out


_LEAF_NAMES = sorted({"a", "b", "tied", "nested.c", "key", "step", "lr", "name", "zz"})
_KINDS = ["dict", "list", "tuple", "node", "var", "none", "tensor", "key", "ref", "bool", "int"]
_KINDS += ["float", "str", "pickle", "", "import"]


@st.composite
def _schema_nodes(draw: st.DrawFn) -> dict[str, Any]:
    node: dict[str, Any] = {"t": draw(st.sampled_from(_KINDS))}
    for field in draw(st.lists(st.sampled_from(["name", "of", "v", "k", "array", "impl"]))):
        if field in ("name", "of"):
            node[field] = draw(st.one_of(st.sampled_from(_LEAF_NAMES), _scalars))
        elif field == "array":
            node[field] = draw(st.sampled_from(["jax", "numpy", "scalar", "pickle", 1]))
        elif field == "impl":
            node[field] = draw(st.sampled_from(["threefry2x32", "rbg", "nope", 3]))
        else:
            node[field] = draw(_json)
    return node


@st.composite
def _mutated_schemas(draw: st.DrawFn) -> Any:
    schema = json.loads(json.dumps(_SCHEMA))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(schema, [])
        container, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["replace", "node", "drop", "dup"]))
        if op == "replace":
            container[key] = draw(_json)
        elif op == "node":
            container[key] = draw(_schema_nodes())
        elif op == "drop":
            del container[key]
        elif isinstance(container, list):
            container.append(json.loads(json.dumps(container[key])))
    return schema


@_SETTINGS
@given(_mutated_schemas())
def _mutated_schema(schema: Any) -> None:
    _validate(schema)


_STORED = None


def _stored() -> Any:
    global _STORED
    if _STORED is None:
        path = corpus.base_dir().parent / "fuzz-base.safetensors"
        path.write_bytes(_BASE)
        header = _router.read_header(path)
        crcs = json.loads(header.metadata[corpus.CRC_KEY])
        _STORED = _read.locate_in_file(path, header, crcs)
    return _STORED


@settings(_SETTINGS, max_examples=40)
@given(_mutated_schemas())
def _mutated_schema_restore(schema: Any) -> None:
    with contextlib.suppress(SafetensorsCheckpointError):
        restore_tree(schema, _stored(), None)


def test_fuzz_schema_validator() -> None:
    jax.devices()
    assert _validate(_SCHEMA) is not None
    tree = restore_tree(_SCHEMA, _stored(), None)
    assert np.array_equal(tree["a"], corpus.base_tree()["a"])
    runs = fuzzing.run_for(0.1, _random_schema)
    runs += fuzzing.run_for(0.15, _mutated_schema)
    runs += fuzzing.run_for(0.15, _mutated_schema_restore)
    assert runs >= 3
