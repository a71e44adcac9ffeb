"""What a file that is not safetensors looks like, and what to run instead.

Readers call :func:`sniff_bytes` with a file's first :data:`HEAD_BYTES` bytes once its header
failed to parse (never before: a real header's length may begin with any byte), and
:func:`sniff_directory` with a directory's entry names. Only signatures are compared: nothing
is decoded, unpickled or decompressed.
"""

from __future__ import annotations

import enum
import re
import shlex
import struct
from collections.abc import Collection
from typing import NamedTuple

HEAD_BYTES = 512  # enough for every signature below (a tar header's "ustar" is at 257)


class Kind(enum.StrEnum):
    """What a path that is not a safetensors file looks like; each value is a stable tag
    (shown in messages and JSON reports as the string itself)."""

    FLAX_MSGPACK = "flax-msgpack"
    PICKLE = "pickle"
    TORCH_ZIP = "torch-zip"
    NPZ = "npz"
    ZIP = "zip"
    NPY = "npy"
    GZIP = "gzip"
    TAR = "tar"
    HDF5 = "hdf5"
    GGUF = "gguf"
    LFS_POINTER = "lfs-pointer"
    HTML = "html"
    SAFETENSORS_INDEX = "safetensors-index"
    JSON = "json"
    OSF_CHECKPOINT = "osf-checkpoint"
    ORBAX_ITEM = "orbax-item"
    ORBAX_STEP = "orbax-step"
    ORBAX_ROOT = "orbax-root"
    SAFETENSORS_DIR = "safetensors-dir"

    @property
    def is_orbax(self) -> bool:
        """An Orbax item, step or root directory."""
        return self in (Kind.ORBAX_ITEM, Kind.ORBAX_STEP, Kind.ORBAX_ROOT)


class Sniffed(NamedTuple):
    """What a path looks like: its :class:`Kind`, a ``description`` (a noun phrase) and a
    ``suggestion`` of what to run instead."""

    kind: Kind
    description: str
    suggestion: str


def message(where: str, found: Sniffed) -> str:
    """The error text for ``where``, which is not a safetensors file."""
    what = (
        "a directory, not a safetensors file"
        if found.kind in DIRECTORY_KINDS
        else "not a safetensors file"
    )
    return f"{where}: {what}; it looks like {found.description}. {found.suggestion}"


DIRECTORY_KINDS = frozenset(
    (Kind.OSF_CHECKPOINT, Kind.ORBAX_ITEM, Kind.ORBAX_STEP, Kind.ORBAX_ROOT, Kind.SAFETENSORS_DIR)
)


def convert_command(where: str) -> str:
    """The shell-quoted command converting the Flax msgpack file ``where`` to safetensors."""
    return f"orbax-safetensors convert {shlex.quote(where)} {shlex.quote(_stem(where) + '.safetensors')}"


def _stem(where: str) -> str:
    name = where.rstrip("/").rsplit("/", 1)[-1] or "checkpoint"
    return name.rsplit(".", 1)[0] if "." in name[1:] else name


_NEVER_UNPICKLE = "orbax-safetensors never unpickles (a pickle can run any code)"
_TORCH_RESAVE = (
    "If you trust its source, load it with torch.load(path, weights_only=True) (or "
    "transformers' from_pretrained) and re-save it as safetensors: "
    "safetensors.torch.save_file(state_dict, 'model.safetensors') or "
    "model.save_pretrained(out_dir, safe_serialization=True)"
)


def _msgpack_first_key(head: bytes) -> str | None:
    """The first key of a msgpack map with a string key at the start of ``head``, else None."""
    b = head[0]
    if 0x81 <= b <= 0x8F:
        pos = 1
    elif b == 0xDE and len(head) >= 3:
        pos = 3
    elif b == 0xDF and len(head) >= 5:
        pos = 5
    else:
        return None
    if pos >= len(head):
        return None
    marker = head[pos]
    if 0xA0 <= marker <= 0xBF:
        start, length = pos + 1, marker & 0x1F
    elif marker == 0xD9 and pos + 2 <= len(head):
        start, length = pos + 2, head[pos + 1]
    elif marker == 0xDA and pos + 3 <= len(head):
        start, length = pos + 3, struct.unpack(">H", head[pos + 1 : pos + 3])[0]
    else:
        return None
    raw = head[start : start + length]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text.isprintable():
        return None
    return text if len(raw) == length else text + "..."


def _zip_first_name(head: bytes) -> str:
    if len(head) < 30:
        return ""
    (n,) = struct.unpack("<H", head[26:28])
    return head[30 : 30 + n].decode("utf-8", "replace")


def sniff_bytes(head: bytes, where: str = "file") -> Sniffed | None:
    """What a file starting with ``head`` (its first :data:`HEAD_BYTES`) looks like when it is
    a known non-safetensors format, else None; ``where``: its path, for the suggestions."""
    if len(head) >= 9 and head[8:9] == b"{":
        return None  # a safetensors header (8-byte length, then JSON): damaged, not foreign
    if not head:
        return None
    if head[0] == 0x80 and len(head) > 1 and 2 <= head[1] <= 5:
        torchish = re.search(r"\.(pt|pth|bin|ckpt)$", where) is not None
        return Sniffed(
            Kind.PICKLE,
            f"a Python pickle (protocol {head[1]})"
            + (", e.g. a PyTorch checkpoint in the legacy torch.save format" if torchish else ""),
            f"{_NEVER_UNPICKLE}. "
            + (
                _TORCH_RESAVE
                if torchish
                else "If you trust its source, unpickle it yourself and save the tree with "
                "osf.save_file(tree, 'out.safetensors')"
            )
            + ".",
        )
    key = _msgpack_first_key(head)
    if key is not None:
        return Sniffed(
            Kind.FLAX_MSGPACK,
            "a Flax msgpack checkpoint (flax.serialization.to_bytes, e.g. flax_model.msgpack, or "
            f"a flax.training.checkpoints checkpoint_<step> file; first key {key!r})",
            f"Convert it: {convert_command(where)} (or "
            "restore it "
            "with flax.serialization.msgpack_restore and save it with osf.save_file).",
        )
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        first = _zip_first_name(head)
        if first.endswith(("data.pkl", ".format_version", "/version")):
            return Sniffed(
                Kind.TORCH_ZIP,
                f"a PyTorch checkpoint written by torch.save (a zip holding {first!r}, a pickle)",
                f"{_NEVER_UNPICKLE}. {_TORCH_RESAVE}.",
            )
        if first.endswith(".npy"):
            return Sniffed(
                Kind.NPZ,
                "a NumPy .npz archive",
                "Load it with dict(np.load(path, allow_pickle=False)) and save it with "
                "osf.save_file(arrays, 'out.safetensors').",
            )
        return Sniffed(
            Kind.ZIP,
            f"a zip archive (first entry {first!r})" if first else "a zip archive",
            "Unzip it and pass the .safetensors file (or the checkpoint directory) inside.",
        )
    if head.startswith(b"\x93NUMPY"):
        return Sniffed(
            Kind.NPY,
            "a NumPy .npy array",
            "Load it with np.load(path, allow_pickle=False) and save it with "
            "osf.save_file({'name': array}, 'out.safetensors').",
        )
    if head.startswith(b"\x1f\x8b"):
        return Sniffed(
            Kind.GZIP,
            "a gzip-compressed file (e.g. a .tar.gz)",
            "Decompress it (tar -xzf / gunzip) and pass the checkpoint inside.",
        )
    if len(head) >= 262 and head[257:262] == b"ustar":
        return Sniffed(Kind.TAR, "a tar archive", "Extract it and pass the checkpoint inside.")
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return Sniffed(
            Kind.HDF5,
            "an HDF5 file (e.g. Keras .h5 or Hugging Face tf_model.h5 weights)",
            "Read its datasets with h5py and save them with osf.save_file, or take the "
            "model's .safetensors weights instead.",
        )
    if head.startswith(b"GGUF"):
        return Sniffed(
            Kind.GGUF,
            "a GGUF file (llama.cpp)",
            "Take the original model's .safetensors weights instead (GGUF tensors are often "
            "quantized to block formats safetensors has no dtype for).",
        )
    if head.startswith(b"version https://git-lfs"):
        return Sniffed(
            Kind.LFS_POINTER,
            "a Git LFS pointer file, not the weights themselves",
            "Fetch the real file: git lfs pull (or huggingface_hub.hf_hub_download).",
        )
    text = head.lstrip()[:16].lower()
    if text.startswith((b"<!doctype html", b"<html")):
        return Sniffed(
            Kind.HTML,
            "an HTML page (a failed or redirected download?)",
            "Download the file again (on the Hugging Face Hub: the /resolve/ URL, not /blob/).",
        )
    if head.lstrip()[:1] == b"{":
        if b"weight_map" in head:
            return Sniffed(
                Kind.SAFETENSORS_INDEX,
                "a safetensors index (model.safetensors.index.json)",
                "Pass the directory that holds it and its .safetensors files instead.",
            )
        if b"orbax-safetensors" in head or b"orbax_safetensors" in head:
            return Sniffed(
                Kind.JSON,
                "the metadata file of an orbax-safetensors checkpoint directory",
                "Pass the directory that holds it instead.",
            )
        return Sniffed(
            Kind.JSON, "a JSON file", "Pass a .safetensors file or a checkpoint directory."
        )
    return None


_ORBAX_ITEM_ENTRIES = frozenset(("manifest.ocdbt", "_METADATA", "_sharding", "d", "descriptor"))


def sniff_directory(entries: Collection[str], where: str = "directory") -> Sniffed | None:
    """What a directory holding the entry names ``entries`` looks like, or None."""
    names = set(entries)
    if "orbax_safetensors.json" in names:
        return Sniffed(
            Kind.OSF_CHECKPOINT,
            "an orbax-safetensors checkpoint directory",
            "Restore it with osf.restore_directory(path) or a CheckpointManager with "
            "osf.SafetensorsRestore; load_file reads one .safetensors file.",
        )
    convert = f"orbax-safetensors convert {shlex.quote(where)} {shlex.quote(_stem(where) + '-safetensors')}"
    if names & _ORBAX_ITEM_ENTRIES or any(n.startswith("ocdbt.process_") for n in names):
        return Sniffed(
            Kind.ORBAX_ITEM,
            "an Orbax-native checkpoint (OCDBT / TensorStore, e.g. written by "
            "ocp.StandardCheckpointer)",
            "Restore it with ocp.StandardCheckpointer().restore(path), or convert it to "
            f"safetensors: {convert}.",
        )
    if "_CHECKPOINT_METADATA" in names:
        return Sniffed(
            Kind.ORBAX_STEP,
            "an Orbax checkpoint step directory",
            f"Restore it through ocp.CheckpointManager, or convert it to safetensors: {convert}.",
        )
    steps = sorted((n for n in names if n.isdigit()), key=int)
    if steps:
        shown = ", ".join(steps[:5]) + (", ..." if len(steps) > 5 else "")
        return Sniffed(
            Kind.ORBAX_ROOT,
            f"a CheckpointManager root (steps {shown})",
            f"orbax-safetensors inspect {shlex.quote(where)} lists its steps; restore one through "
            f"ocp.CheckpointManager, or convert them all: {convert}.",
        )
    if "model.safetensors.index.json" in names or any(n.endswith(".safetensors") for n in names):
        return Sniffed(
            Kind.SAFETENSORS_DIR,
            "a directory of safetensors files",
            "Load one of its .safetensors files, or see it whole with "
            f"orbax-safetensors inspect {shlex.quote(where)}.",
        )
    return None
