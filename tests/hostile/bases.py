"""The valid bases every hostile case starts from, and the small editing helpers the case
modules share (``header_cases``, ``schema_cases``, ``dir_cases``; ``corpus`` gathers them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import orbax_safetensors as osf

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
def base_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "base.safetensors"
        osf.save_file(base_tree(), path)
        return path.read_bytes()


@functools.cache
def base_dir() -> Path:
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


def write_file(d: Path, raw: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.safetensors"
    path.write_bytes(raw)
    return path


def tensor_names(doc: dict[str, Any]) -> list[str]:
    """Tensor names in data order."""
    names = [k for k in doc if k != "__metadata__"]
    return sorted(names, key=lambda k: doc[k]["data_offsets"][0])


def drop(container: Any, key: Any) -> None:
    """``del container[key]`` as an expression (editors return None to edit in place)."""
    del container[key]


def make_fifo(d: Path) -> Path:
    """A FIFO where the file should be: opening it for reading must not block."""
    d.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / "model.safetensors")
    return d / "model.safetensors"
