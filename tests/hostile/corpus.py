"""Forged and damaged checkpoints, generated in code (no binary blobs in the repository).

Every case starts from a valid file or directory written by the library and damages it by
hand: raw bytes, the JSON header, the stored schema or the directory's metadata file. Each case
says which error it must raise and a regex its message must match.

Kinds:
  ``"header"``: the safetensors header is hostile; ``read_header``, ``load_file`` and
    ``verify`` all fail.
  ``"schema"``: a valid safetensors file whose orbax-safetensors metadata (tree schema,
    checksums) is forged; ``read_header`` succeeds, ``load_file`` and ``verify`` fail.
  ``"dir"``: a checkpoint directory whose ``orbax_safetensors.json`` (or one of its files) is
    forged; ``restore_directory`` and ``verify`` fail.

Example::

    for case in all_cases():
        path = case.build(tmp_path / case.name)
        with pytest.raises(case.error, match=case.match):
            osf.load_file(path)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import orbax_safetensors as osf
from orbax_safetensors import HeaderError, IntegrityError, SchemaError

SCHEMA_KEY = "orbax_safetensors.tree"
CRC_KEY = "orbax_safetensors.crc32c"
META_FILE = "orbax_safetensors.json"
MAX_HEADER = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile input: ``build(dir)`` writes it under ``dir`` and returns the path to open."""

    name: str
    kind: str  # "header" | "schema" | "dir"
    build: Callable[[Path], Path]
    error: type[Exception]
    match: str


# --------------------------------------------------------------------------- valid bases


def base_tree() -> dict[str, Any]:
    """The tree every case starts from: tensors, an alias, inline values, a PRNG key."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    return {
        "a": a,
        "b": np.arange(4, dtype=np.int32),
        "tied": a,
        "nested": {"c": np.float32(1.5)},
        "step": 7,
        "lr": 0.5,
        "name": "run",
        "none": None,
        "key": jax.random.key(0),
    }


@functools.cache
def _base_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "base.safetensors"
        osf.save_file(base_tree(), path)
        return path.read_bytes()


@functools.cache
def _base_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="osf-hostile-base-"))
    # A tiny max_file_size splits the tensors over several files (with an index file).
    osf.save_directory(base_tree(), d / "ckpt", max_file_size=32)
    return d / "ckpt"


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header JSON document, data section) of a valid file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(doc: dict[str, Any] | bytes, data: bytes) -> bytes:
    """A file from a header document (or raw header text) and a data section (8-byte padded)."""
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _write(d: Path, raw: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.safetensors"
    path.write_bytes(raw)
    return path


def _entries(doc: dict[str, Any]) -> list[str]:
    """Tensor names in data order."""
    names = [k for k in doc if k != "__metadata__"]
    return sorted(names, key=lambda k: doc[k]["data_offsets"][0])


# --------------------------------------------------------------------------- header cases


def _drop(container: Any, key: Any) -> None:
    """``del container[key]`` as an expression (editors return None to edit in place)."""
    del container[key]


def _raw(make: Callable[[], bytes]) -> Callable[[Path], Path]:
    return lambda d: _write(d, make())


def _doc(
    edit: Callable[[dict[str, Any], bytes], tuple[Any, bytes] | None],
) -> Callable[[Path], Path]:
    """A case made by editing the parsed header (``edit`` may return a new (doc, data))."""

    def build(d: Path) -> Path:
        doc, data = split(_base_file_bytes())
        out = edit(doc, data)
        if out is not None:
            doc, data = out
        return _write(d, join(doc, data))

    return build


def _text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    """A case made by editing the header's JSON text (for what a dict cannot hold)."""

    def build(d: Path) -> Path:
        doc, data = split(_base_file_bytes())
        return _write(d, join(edit(json.dumps(doc)).encode(), data))

    return build


def _set(name: str, field: str, value: Any) -> Callable[[Path], Path]:
    def edit(doc: dict[str, Any], data: bytes) -> None:
        doc[name][field] = value

    return _doc(edit)


def _shift_last(delta: int, extra: int) -> Callable[[Path], Path]:
    def edit(doc: dict[str, Any], data: bytes) -> tuple[Any, bytes]:
        last = doc[_entries(doc)[-1]]
        begin, end = last["data_offsets"]
        last["data_offsets"] = [begin + delta, end + delta]
        return doc, data + b"\0" * extra

    return _doc(edit)


def _overlap(doc: dict[str, Any], data: bytes) -> None:
    second = doc[_entries(doc)[1]]
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
        ("truncated-header", lambda: _base_file_bytes()[:40], "runs past the end"),
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
        ("entry-missing-field", _doc(lambda doc, data: _drop(doc["a"], "shape")), "exactly dtype"),
        ("entry-extra-field", _set("a", "module", "os"), "exactly dtype"),
        ("truncated-data", lambda d: _write(d, _base_file_bytes()[:-1]), "past the|cover"),
        ("trailing-bytes", lambda d: _write(d, _base_file_bytes() + b"\0" * 8), "cover"),
        (
            "claimed-terabyte-tensor",
            _extra([1 << 38], 1 << 40),
            "past the",
        ),
    ]
    cases += [Case(n, "header", b, H, r) for n, b, r in docs]
    cases.append(Case("fifo-not-a-file", "header", _fifo, H, "not a regular file"))
    return cases


def _fifo(d: Path) -> Path:
    """A FIFO where the file should be: opening it for reading must not block."""
    d.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / "model.safetensors")
    return d / "model.safetensors"


def _extra(shape: list[int], nbytes: int) -> Callable[[Path], Path]:
    """Adds an F32 tensor ``z`` of ``shape`` claiming ``nbytes`` after the last tensor."""

    def edit(doc: dict[str, Any], data: bytes) -> None:
        end = max(v["data_offsets"][1] for k, v in doc.items() if k != "__metadata__")
        doc["z"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + nbytes]}

    return _doc(edit)


# --------------------------------------------------------------------------- schema cases


def _schema(edit: Callable[[dict[str, Any]], Any], key: str = SCHEMA_KEY) -> Callable[[Path], Path]:
    """A valid file whose ``key`` metadata (JSON text) is replaced by ``edit(parsed)``.

    ``edit`` mutates the parsed value in place (returning None), or returns the new value, or
    returns ``str`` to store as raw text.
    """

    def build(d: Path) -> Path:
        doc, data = split(_base_file_bytes())
        value = json.loads(doc["__metadata__"][key])
        out = edit(value)
        if out is not None:
            value = out
        doc["__metadata__"][key] = value if isinstance(value, str) else json.dumps(value)
        return _write(d, join(doc, data))

    return build


def _node(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The schema node of the leaf named ``name``."""
    stack = [schema["tree"]]
    while stack:
        node = stack.pop()
        if node.get("name") == name:
            return node
        v = node.get("v")
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.append(v)
    raise KeyError(name)


def _leaf(leaf: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """Replaces the node of leaf ``leaf`` by ``fields``."""

    def edit(s: dict[str, Any]) -> None:
        node = _node(s, leaf)
        node.clear()
        node.update(fields)

    return edit


def _update(leaf: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: _node(s, leaf).update(fields)


def _root_keys(keys: list[Any]) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["tree"].update({"k": keys + s["tree"]["k"][len(keys) :]})


def _nest(depth: int, inner: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        node = inner
        for _ in range(depth):
            node = {"t": "list", "v": [node]}
        s["tree"]["v"][0] = node

    return edit


def _deep_list(depth: int) -> Any:
    x: Any = []
    for _ in range(depth):
        x = [x]
    return x


def _alias_cycle(s: dict[str, Any]) -> None:
    _node(s, "tied").update({"t": "ref", "of": "none2"})
    s["tree"]["v"][s["tree"]["k"].index("none")] = {"t": "ref", "name": "none2", "of": "tied"}


def _crc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    return _schema(edit, CRC_KEY)


def _wrong_crc(c: dict[str, str]) -> None:
    c["b"] = f"{int(c['b'], 16) ^ 1:08x}"


def schema_cases() -> list[Case]:
    S = SchemaError
    items: list[tuple[str, Callable[[Path], Path], str]] = [
        ("schema-garbage-json", _schema(lambda s: "{not json"), "not valid JSON"),
        ("schema-deep-json", _schema(lambda s: "[" * 100_000), "nested too deeply"),
        ("schema-not-object", _schema(lambda s: []), "not a JSON object"),
        ("schema-wrong-format", _schema(lambda s: s.update(format="pickle")), "format"),
        ("schema-version-99", _schema(lambda s: s.update(version=99)), "newer"),
        ("schema-version-string", _schema(lambda s: s.update(version="1")), "version"),
        ("schema-version-bool", _schema(lambda s: s.update(version=True)), "version"),
        ("schema-version-0", _schema(lambda s: s.update(version=0)), "version"),
        ("schema-no-tree", _schema(lambda s: _drop(s, "tree")), "no kind"),
        ("alias-nowhere", _schema(_update("tied", of="zzz")), "alias 'tied'"),
        ("alias-self", _schema(_update("tied", of="tied")), "alias 'tied'"),
        ("alias-cycle", _schema(_alias_cycle), "alias"),
        ("alias-to-inline", _schema(_update("tied", of="step")), "alias 'tied'"),
        ("alias-of-int", _schema(_update("tied", of=3)), "alias 'tied'"),
        ("kind-unknown", _schema(_leaf("b", t="pickle", name="b")), "unknown"),
        ("kind-import", _schema(_leaf("b", t="import", name="b", module="os")), "unknown"),
        ("kind-not-string", _schema(_leaf("b", t=5, name="b")), "no kind"),
        ("colliding-names", _schema(_update("b", name="a")), "twice"),
        ("colliding-dict-keys", _schema(_root_keys(["a", "a"])), "duplicate"),
        ("dict-key-count", _schema(lambda s: _drop(s["tree"]["k"], -1)), "keys do not match"),
        ("dict-key-float", _schema(_root_keys([1.5])), "neither str nor int"),
        ("dict-key-null", _schema(_root_keys([None])), "neither str nor int"),
        ("children-not-list", _schema(lambda s: s["tree"].update(v={})), "child list"),
        (
            "node-key-malformed",
            _schema(_leaf("b", t="node", type="X", k=[["exec", "x"]], v=[{"t": "none"}])),
            "malformed",
        ),
        ("tree-300-deep", _schema(_nest(300, {"t": "none"})), "deeper"),
        ("tree-deep-junk", _schema(_nest(150, _deep_list(300))), "no kind"),
        ("tensor-not-stored", _schema(_update("b", name="zz")), "no file holds"),
        ("tensor-array-kind", _schema(_update("b", array="pickle")), "array kind"),
        ("int-not-int", _schema(_update("step", v="7")), "int value"),
        ("bool-not-bool", _schema(_leaf("step", t="bool", name="step", v=1)), "bool value"),
        ("float-overflow", _schema(_update("lr", v="0x1p99999")), "hex float"),
        ("float-garbage", _schema(_update("lr", v="abc xyz")), "hex float"),
        ("var-empty", _schema(_leaf("b", t="var")), "no kind"),
        ("key-no-impl", _schema(lambda s: _drop(_node(s, "key"), "impl")), "impl"),
        ("key-impl-unknown", _schema(_update("key", impl="nope")), "PRNG key"),
        ("key-impl-mismatch", _schema(_update("key", impl="rbg")), "PRNG key"),
        ("key-data-float", _schema(_leaf("a", t="key", name="a", impl="threefry2x32")), "PRNG key"),
        ("crc-garbage-json", _crc(lambda c: "{oops"), "not valid JSON"),
        ("crc-not-object", _crc(lambda c: ["a"]), "not an object"),
        ("crc-malformed", _crc(lambda c: c.update(a="zz")), "checksum of 'a'"),
        ("crc-int", _crc(lambda c: c.update(a=5)), "checksum of 'a'"),
        ("tensor-array-kind-list", _schema(_update("b", array=["jax"])), "array kind"),
        ("tensor-name-list", _schema(_update("b", name=["b"])), "no name"),
    ]
    cases = [Case(n, "schema", b, S, r) for n, b, r in items]
    cases.append(Case("crc-wrong", "schema", _crc(_wrong_crc), IntegrityError, "'b'.*CRC32C"))
    return cases


# --------------------------------------------------------------------------- directory cases


def _copy_base(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    out = d / "ckpt"
    shutil.copytree(_base_dir(), out)
    return out


def _meta_doc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    """A checkpoint directory whose metadata document is edited (or replaced by a str/bytes)."""

    def build(d: Path) -> Path:
        ckpt = _copy_base(d)
        doc = json.loads((ckpt / META_FILE).read_text())
        out = edit(doc)
        if out is not None:
            doc = out
        raw = doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc))
        (ckpt / META_FILE).write_bytes(raw.encode() if isinstance(raw, str) else raw)
        return ckpt

    return build


def _legacy(doc: dict[str, Any]) -> None:
    """The document as written before it placed tensors itself: no ``file_layout``, no
    ``data_offsets``; a restore then reads and cross-checks every header."""
    doc.pop("file_layout", None)
    for info in doc["tensors"].values():
        if isinstance(info, dict):
            info.pop("data_offsets", None)


def _legacy_doc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    """:func:`_meta_doc` on a checkpoint written the old way."""
    return _meta_doc(lambda doc: (_legacy(doc), edit(doc))[1])


def _legacy_files(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    """:func:`_file_edit` on a checkpoint written the old way."""

    def both(ckpt: Path) -> None:
        doc = json.loads((ckpt / META_FILE).read_text())
        _legacy(doc)
        (ckpt / META_FILE).write_text(json.dumps(doc))
        edit(ckpt)

    return _file_edit(both)


def _tensor_file(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["a"]["file"] = name
        doc["files"].append(name)

    return edit


def _file_edit(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        ckpt = _copy_base(d)
        edit(ckpt)
        return ckpt

    return build


def _file_of(ckpt: Path, tensor: str) -> Path:
    doc = json.loads((ckpt / META_FILE).read_text())
    return ckpt / doc["tensors"][tensor]["file"]


def _damage_length(ckpt: Path) -> None:
    path = _file_of(ckpt, "a")
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])


def _truncate(ckpt: Path) -> None:
    path = _file_of(ckpt, "a")
    path.write_bytes(path.read_bytes()[:-1])


def _flip_bit(ckpt: Path) -> None:
    path = _file_of(ckpt, "b")
    raw = bytearray(path.read_bytes())
    header = osf.read_header(path)
    raw[header.data_start + header.tensors["b"].begin] ^= 0x10
    path.write_bytes(bytes(raw))


def _fifo_tensor_file(ckpt: Path) -> None:
    doc = json.loads((ckpt / META_FILE).read_text())
    _fifo(ckpt)  # ckpt/model.safetensors
    _tensor_file("model.safetensors")(doc)
    (ckpt / META_FILE).write_text(json.dumps(doc))


def _fifo_metadata(ckpt: Path) -> None:
    (ckpt / META_FILE).unlink()
    os.mkfifo(ckpt / META_FILE)


def _make_dir_entry(ckpt: Path) -> None:
    (ckpt / "sub").mkdir()
    doc = json.loads((ckpt / META_FILE).read_text())
    _tensor_file("sub")(doc)
    (ckpt / META_FILE).write_text(json.dumps(doc))


def _schema_in_meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    return _meta_doc(lambda doc: edit(doc["schema"]))


def dir_cases() -> list[Case]:
    S, H = SchemaError, HeaderError
    items: list[tuple[str, Callable[[Path], Path], type[Exception], str]] = [
        ("meta-garbage-json", _meta_doc(lambda m: "{nope"), S, "not valid JSON"),
        ("meta-invalid-utf8", _meta_doc(lambda m: b'{"\xff": 1}'), S, "not valid JSON"),
        ("meta-deep-json", _meta_doc(lambda m: "[" * 100_000), S, "nested too deeply"),
        ("meta-not-object", _meta_doc(lambda m: []), S, "metadata file"),
        ("meta-wrong-format", _meta_doc(lambda m: m.update(format="x")), S, "metadata file"),
        ("meta-version-99", _meta_doc(lambda m: m.update(format_version=99)), S, "format_version"),
        (
            "meta-version-bool",
            _meta_doc(lambda m: m.update(format_version=True)),
            S,
            "format_version",
        ),
        (
            "meta-version-str",
            _meta_doc(lambda m: m.update(format_version="1")),
            S,
            "format_version",
        ),
        ("meta-tensors-list", _meta_doc(lambda m: m.update(tensors=[])), S, "tensors"),
        ("meta-files-dict", _meta_doc(lambda m: m.update(files={})), S, "files"),
        ("meta-no-schema", _meta_doc(lambda m: _drop(m, "schema")), S, "schema"),
        ("meta-entry-not-object", _meta_doc(lambda m: m["tensors"].update(a=[1])), S, "'a'"),
        ("file-dotdot-path", _meta_doc(_tensor_file("../model.safetensors")), S, "invalid file"),
        ("file-absolute", _meta_doc(_tensor_file("/etc/passwd")), S, "invalid file"),
        ("file-subdir", _meta_doc(_tensor_file("sub/model.safetensors")), S, "invalid file"),
        ("file-dotdot", _meta_doc(_tensor_file("..")), S, "invalid file"),
        ("file-empty-name", _meta_doc(_tensor_file("")), S, "invalid file"),
        ("file-nul-byte", _meta_doc(_tensor_file("a\x00b")), S, "invalid file"),
        (
            "file-not-listed",
            _meta_doc(lambda m: m["tensors"]["a"].update(file="x")),
            S,
            "invalid file",
        ),
        ("file-missing", _legacy_doc(_tensor_file("gone.safetensors")), S, "not a regular file"),
        ("file-is-directory", _legacy_files(_make_dir_entry), S, "not a regular file"),
        ("file-is-metadata", _legacy_doc(_tensor_file(META_FILE)), H, "not a safetensors file"),
        ("file-is-fifo", _legacy_files(_fifo_tensor_file), S, "not a regular file"),
        ("meta-is-fifo", _file_edit(_fifo_metadata), S, "not a regular file"),
        (
            "tensor-not-in-header",
            _legacy_doc(lambda m: m["tensors"].update(zz=dict(m["tensors"]["a"]))),
            H,
            "'zz' is listed in the metadata but not in the file",
        ),
        (
            "dtype-mismatch",
            _legacy_doc(lambda m: m["tensors"]["a"].update(dtype="I32")),
            H,
            "in the metadata",
        ),
        (
            "shape-mismatch",
            _legacy_doc(lambda m: m["tensors"]["a"].update(shape=[2**62, 2**62])),
            H,
            "in the metadata",
        ),
        (
            "crc-malformed",
            _meta_doc(lambda m: m["tensors"]["a"].update(crc32c="zz")),
            S,
            "checksum of 'a'",
        ),
        ("crc-int", _meta_doc(lambda m: m["tensors"]["a"].update(crc32c=7)), S, "checksum of 'a'"),
        ("schema-alias-cycle", _schema_in_meta(_alias_cycle), S, "alias"),
        ("schema-unknown-kind", _schema_in_meta(_leaf("b", t="pickle", name="b")), S, "unknown"),
        ("schema-extra-tensor", _schema_in_meta(_update("b", name="zz")), S, "no file holds"),
        ("schema-version-99", _schema_in_meta(lambda s: s.update(version=99)), S, "newer"),
        ("model-length-2**63", _legacy_files(_damage_length), H, "exceeds"),
        ("model-truncated", _legacy_files(_truncate), H, "past the|cover"),
        ("model-bit-flip", _file_edit(_flip_bit), IntegrityError, "'b'.*CRC32C"),
    ]
    return [Case(f"dir-{n}", "dir", b, e, r) for n, b, e, r in items]


def all_cases() -> list[Case]:
    """Every case of every kind."""
    from . import layout  # the layout cases use this module's helpers

    return header_cases() + schema_cases() + dir_cases() + layout.cases()
