"""Hostile checkpoint directories whose metadata records the tensors' places (each tensor's
``data_offsets``, each file's ``file_layout``), which a restore trusts without reading any
header: each place must fit its dtype and shape and stay inside its file.

Built with the helpers of :mod:`.dir_cases`; :func:`.corpus.all_cases` includes them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbax_safetensors._src.core.errors import SchemaError

from . import dir_cases
from .bases import Case, drop


def _offsets(tensor: str, offsets: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["tensors"][tensor].update(data_offsets=offsets)


def _shift(tensor: str, by: int) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        begin, end = doc["tensors"][tensor]["data_offsets"]
        doc["tensors"][tensor]["data_offsets"] = [begin + by, end + by]

    return edit


def _layout(tensor: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["file_layout"][doc["tensors"][tensor]["file"]].update(fields)


def _grow_file(ckpt: Path) -> None:
    path = dir_cases.file_of(ckpt, "a")
    path.write_bytes(path.read_bytes() + b"\0")


def _remove_file(ckpt: Path) -> None:
    dir_cases.file_of(ckpt, "a").unlink()


def cases() -> list[Case]:
    """The layout cases, as directory cases."""
    S = SchemaError
    items: list[tuple[str, Callable[[Path], Path], type[Exception], str]] = [
        ("layout-file-missing", dir_cases.file_edit(_remove_file), S, "not a regular file"),
        (
            "layout-file-truncated",
            dir_cases.file_edit(dir_cases.truncate),
            S,
            "changed or truncated",
        ),
        ("layout-file-grown", dir_cases.file_edit(_grow_file), S, "changed or truncated"),
        ("offsets-too-short", dir_cases.meta_doc(_offsets("a", [0, 1])), S, "'a' has data_offsets"),
        ("offsets-negative", dir_cases.meta_doc(_shift("a", -8)), S, "'a' has data_offsets"),
        (
            "offsets-not-ints",
            dir_cases.meta_doc(_offsets("a", ["0", "4"])),
            S,
            "'a' has data_offsets",
        ),
        (
            "offsets-missing",
            dir_cases.meta_doc(lambda m: drop(m["tensors"]["a"], "data_offsets")),
            S,
            "'a' has data_offsets None",
        ),
        ("offsets-past-end", dir_cases.meta_doc(_shift("a", 1 << 40)), S, "'a'.*hole"),
        ("offsets-overlap", dir_cases.meta_doc(_shift("a", 1)), S, "hole|overlaps"),
        (
            "offsets-without-layout",
            dir_cases.meta_doc(lambda m: drop(m, "file_layout")),
            S,
            "no file_layout",
        ),
        ("layout-size-forged", dir_cases.meta_doc(_layout("a", size=1 << 40)), S, "cover"),
        ("layout-start-zero", dir_cases.meta_doc(_layout("a", data_start=0)), S, "file_layout of"),
        (
            "layout-start-huge",
            dir_cases.meta_doc(_layout("a", data_start=1 << 40, size=1 << 41)),
            S,
            "file_layout of",
        ),
        (
            "layout-not-object",
            dir_cases.meta_doc(lambda m: m.update(file_layout=[])),
            S,
            "file_layout",
        ),
        (
            "layout-extra-file",
            dir_cases.meta_doc(lambda m: m["file_layout"].update(x={})),
            S,
            "file_layout must describe",
        ),
    ]
    return [Case(f"dir-{n}", "dir", b, e, r) for n, b, e, r in items]
