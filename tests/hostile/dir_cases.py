"""Checkpoint directories whose ``orbax_safetensors.json`` (or one of its files) is forged:
``restore_directory`` and ``verify`` fail.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax_safetensors as osf
from orbax_safetensors import HeaderError, IntegrityError, SchemaError, UnsafePathError

from .bases import META_FILE, Case, base_dir, drop, make_fifo
from .schema_cases import alias_cycle, leaf_edit, update_leaf

# --------------------------------------------------------------------------- directory cases


def _copy_base(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    out = d / "ckpt"
    shutil.copytree(base_dir(), out)
    return out


def meta_doc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
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


def _tensor_file(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"]["a"]["file"] = name
        doc["files"].append(name)

    return edit


def file_edit(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        ckpt = _copy_base(d)
        edit(ckpt)
        return ckpt

    return build


def file_of(ckpt: Path, tensor: str) -> Path:
    doc = json.loads((ckpt / META_FILE).read_text())
    return ckpt / doc["tensors"][tensor]["file"]


def _damage_length(ckpt: Path) -> None:
    path = file_of(ckpt, "a")
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])


def truncate(ckpt: Path) -> None:
    path = file_of(ckpt, "a")
    path.write_bytes(path.read_bytes()[:-1])


def _flip_bit(ckpt: Path) -> None:
    path = file_of(ckpt, "b")
    raw = bytearray(path.read_bytes())
    header = osf.read_header(path)
    raw[header.data_start + header.tensors["b"].begin] ^= 0x10
    path.write_bytes(bytes(raw))


def _fifo_tensor_file(ckpt: Path) -> None:
    doc = json.loads((ckpt / META_FILE).read_text())
    make_fifo(ckpt)  # ckpt/model.safetensors
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
    return meta_doc(lambda doc: edit(doc["schema"]))


def _legacy(doc: dict[str, Any]) -> None:
    """The document as written before it placed tensors itself: no ``file_layout``, no
    ``data_offsets``; a restore then reads and cross-checks every header."""
    doc.pop("file_layout", None)
    for info in doc["tensors"].values():
        if isinstance(info, dict):
            info.pop("data_offsets", None)


def legacy_doc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    """:func:`meta_doc` on a checkpoint written the old way."""
    return meta_doc(lambda doc: (_legacy(doc), edit(doc))[1])


def legacy_files(edit: Callable[[Path], None]) -> Callable[[Path], Path]:
    """:func:`file_edit` on a checkpoint written the old way."""

    def both(ckpt: Path) -> None:
        doc = json.loads((ckpt / META_FILE).read_text())
        _legacy(doc)
        (ckpt / META_FILE).write_text(json.dumps(doc))
        edit(ckpt)

    return file_edit(both)


def dir_cases() -> list[Case]:
    S, H, U = SchemaError, HeaderError, UnsafePathError
    items: list[tuple[str, Callable[[Path], Path], type[Exception], str]] = [
        ("meta-garbage-json", meta_doc(lambda m: "{nope"), S, "not valid JSON"),
        ("meta-invalid-utf8", meta_doc(lambda m: b'{"\xff": 1}'), S, "not valid JSON"),
        ("meta-deep-json", meta_doc(lambda m: "[" * 100_000), S, "nested too deeply"),
        ("meta-not-object", meta_doc(lambda m: []), S, "metadata file"),
        ("meta-wrong-format", meta_doc(lambda m: m.update(format="x")), S, "metadata file"),
        ("meta-version-99", meta_doc(lambda m: m.update(format_version=99)), S, "format_version"),
        (
            "meta-version-bool",
            meta_doc(lambda m: m.update(format_version=True)),
            S,
            "format_version",
        ),
        (
            "meta-version-str",
            meta_doc(lambda m: m.update(format_version="1")),
            S,
            "format_version",
        ),
        ("meta-tensors-list", meta_doc(lambda m: m.update(tensors=[])), S, "tensors"),
        ("meta-files-dict", meta_doc(lambda m: m.update(files={})), S, "files"),
        ("meta-no-schema", meta_doc(lambda m: drop(m, "schema")), S, "schema"),
        ("meta-entry-not-object", meta_doc(lambda m: m["tensors"].update(a=[1])), S, "'a'"),
        ("file-dotdot-path", meta_doc(_tensor_file("../model.safetensors")), U, "leads outside"),
        ("file-absolute", meta_doc(_tensor_file("/etc/passwd")), U, "leads outside"),
        ("file-subdir", meta_doc(_tensor_file("sub/model.safetensors")), S, "invalid file"),
        ("file-dotdot", meta_doc(_tensor_file("..")), U, "leads outside"),
        ("file-empty-name", meta_doc(_tensor_file("")), S, "invalid file"),
        ("file-nul-byte", meta_doc(_tensor_file("a\x00b")), U, "leads outside"),
        (
            "file-not-listed",
            meta_doc(lambda m: m["tensors"]["a"].update(file="x")),
            S,
            "invalid file",
        ),
        ("file-missing", legacy_doc(_tensor_file("gone.safetensors")), S, "not a regular file"),
        ("file-is-directory", legacy_files(_make_dir_entry), U, "a directory, not a regular file"),
        ("file-is-metadata", legacy_doc(_tensor_file(META_FILE)), H, "not a safetensors file"),
        ("file-is-fifo", legacy_files(_fifo_tensor_file), U, "a FIFO, not a regular file"),
        ("meta-is-fifo", file_edit(_fifo_metadata), U, "a FIFO, not a regular file"),
        (
            "tensor-not-in-header",
            legacy_doc(lambda m: m["tensors"].update(zz=dict(m["tensors"]["a"]))),
            H,
            "'zz' is listed in the metadata but not in the file",
        ),
        (
            "dtype-mismatch",
            legacy_doc(lambda m: m["tensors"]["a"].update(dtype="I32")),
            H,
            "in the metadata",
        ),
        (
            "shape-mismatch",
            legacy_doc(lambda m: m["tensors"]["a"].update(shape=[2**62, 2**62])),
            H,
            "in the metadata",
        ),
        (
            "crc-malformed",
            meta_doc(lambda m: m["tensors"]["a"].update(crc32c="zz")),
            S,
            "checksum of 'a'",
        ),
        ("crc-int", meta_doc(lambda m: m["tensors"]["a"].update(crc32c=7)), S, "checksum of 'a'"),
        ("schema-alias-cycle", _schema_in_meta(alias_cycle), S, "alias"),
        (
            "schema-unknown-kind",
            _schema_in_meta(leaf_edit("b", t="pickle", name="b")),
            S,
            "unknown",
        ),
        ("schema-extra-tensor", _schema_in_meta(update_leaf("b", name="zz")), S, "no file holds"),
        ("schema-version-99", _schema_in_meta(lambda s: s.update(version=99)), S, "newer"),
        ("model-length-2**63", legacy_files(_damage_length), H, "exceeds"),
        ("model-truncated", legacy_files(truncate), H, "past the|cover"),
        ("model-bit-flip", file_edit(_flip_bit), IntegrityError, "'b'.*CRC32C"),
    ]
    return [Case(f"dir-{n}", "dir", b, e, r) for n, b, e, r in items]
