"""Restoring a checkpoint directory written by ``pipeline.checkpoint_save``: its metadata file,
where each stored tensor lies, the abstract tree, and the restore itself (onto the saved
shardings when the target gives none).

Example::

    state = restore_checkpoint("/tmp/ckpt", RestoreOptions(target=abstract_state))
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

import jax
from etils import epath

from orbax_safetensors._src.core import checksum as _checksum
from orbax_safetensors._src.core import dtypes as _dtypes
from orbax_safetensors._src.core import header as _header
from orbax_safetensors._src.core import metadata as _metadata
from orbax_safetensors._src.core import sharding as _sharding
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.errors import (
    HeaderError,
    SchemaError,
    TargetMismatchError,
    UnsafePathError,
)
from orbax_safetensors._src.pipeline import gcpause as _gcpause
from orbax_safetensors._src.pipeline.reader import ReadStats, StoredTensor
from orbax_safetensors._src.pipeline.restore_options import RestoreOptions
from orbax_safetensors._src.pipeline.tree_restore import restore_tree
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage import confine as _confine
from orbax_safetensors._src.storage import router as _router

# --------------------------------------------------------------------------- reading


def read_metadata(directory: epath.PathLike, *, stats: ReadStats | None = None) -> dict[str, Any]:
    """Reads and checks the metadata file of a checkpoint directory (its size is added to
    ``stats.metadata_bytes``)."""
    path = _confine.inside(directory, _metadata.METADATA_FILE)
    if not path.exists():
        raise FileNotFoundError(
            f"{directory} is not an orbax-safetensors checkpoint: no {_metadata.METADATA_FILE}"
        )
    raw = _confine.read_file(path, limit=_metadata.MAX_METADATA_BYTES)
    if stats is not None:
        stats.metadata_bytes += len(raw)
    return _metadata.parse_metadata(raw, path)


def locate_in_directory(
    directory: epath.PathLike,
    metadata: Mapping[str, Any],
    *,
    check_headers: bool = False,
    stats: ReadStats | None = None,
    io: _config.IOOptions | None = None,
) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint directory: where its bytes lie, dtype, shape, checksum.

    When the metadata places every tensor itself (``file_layout`` and each tensor's
    ``data_offsets``; checkpoints of this version on), no header is read: a restore by N processes
    reads the metadata file and the tensor bytes it needs, nothing that grows with N. Local
    files must then have the recorded sizes. Older checkpoints, or ``check_headers=True``
    (``verify``), read each file's header once and cross-check it against the metadata;
    ``stats`` counts the header bytes read; ``io``: the I/O options of the header reads.

    Example::

        stored = locate_in_directory(path, read_metadata(path))
        stored["params.w"].offset  # where its bytes start in stored["params.w"].path
    """
    directory = epath.Path(directory)
    layout = metadata.get("file_layout") if _metadata.has_layout(metadata) else None
    headers: dict[str, _header.Header] = {}  # by file name, once the name has been checked
    paths: dict[str, epath.Path] = {}  # one Path object per file, shared by its tensors
    out: dict[str, StoredTensor] = {}
    for name, info in metadata["tensors"].items():
        filename = info.get("file") if isinstance(info, dict) else None
        if not isinstance(filename, str) or (
            filename not in paths
            and (not _metadata.is_plain_filename(filename) or filename not in metadata["files"])
        ):
            raise SchemaError(f"{directory}: tensor {name!r} names an invalid file {filename!r}")
        if filename not in paths:
            path = _confine.inside(directory, filename, where=directory / _metadata.METADATA_FILE)
            _check_file(directory, name, filename, path, layout)
            if layout is None or check_headers:
                headers[filename] = _router.read_header(path, io)
                if stats is not None:
                    stats.header_reads += 1
                    stats.header_bytes += headers[filename].data_start
            paths[filename] = path
        if filename in headers:
            entry = _checked_entry(directory, name, info, headers[filename], layout)
            start, dtype, shape = (
                headers[filename].data_start + entry.begin,
                entry.dtype,
                entry.shape,
            )
        else:  # checked by the metadata validator: inside the file, as its dtype and shape say
            assert layout is not None
            start = layout[filename]["data_start"] + info["data_offsets"][0]
            dtype, shape = info["dtype"], tuple(info["shape"])
        crc = _recorded_crc(directory, name, info)
        out[name] = StoredTensor(name, paths[filename], start, dtype, shape, crc)
    return out


def _recorded_crc(directory: epath.Path, name: str, info: Mapping[str, Any]) -> int | None:
    # A tensor's CRC32C as the metadata records it (None: saved without checksums).
    crc_text = info.get("crc32c")
    if crc_text is None:
        return None
    crc = _checksum.from_hex(crc_text)
    if crc is None:
        raise SchemaError(f"{directory}: checksum of {name!r} is malformed: {crc_text!r}")
    return crc


def locate_in_directory_file(
    path: epath.PathLike, header: _header.Header
) -> dict[str, StoredTensor] | None:
    """The tensors of ``path``, one file of a checkpoint directory, with the checksums that
    directory's metadata file records for them; None when no metadata file beside ``path``
    lists it (a file on its own, or one a checkpoint does not own).

    Where each tensor lies comes from ``header`` (the file's own, already read and checked).
    The metadata must describe the file exactly as the header does: the same tensors, each
    with the same dtype, shape and place. A metadata file that cannot be read, or that
    disagrees with the header, is an error, never a reason to read the file unchecked.

    Raises:
      SchemaError: the metadata file beside ``path`` is malformed.
      HeaderError: it disagrees with ``header`` (naming the tensor).
      UnsafePathError: it is a FIFO or another special file, or a symbolic link out of the
        directory.

    Example::

        stored = locate_in_directory_file(path, _router.read_header(path))
        stored["params.w"].crc32c  # the CRC32C orbax_safetensors.json records
    """
    path = epath.Path(path)
    directory = path.parent
    if not (directory / _metadata.METADATA_FILE).exists():
        return None
    try:
        metadata = read_metadata(directory)
        if path.name not in metadata["files"]:
            return None
        return _located_by_metadata(path, header, metadata)
    except (HeaderError, SchemaError, UnsafePathError) as e:
        if type(e) not in (HeaderError, SchemaError, UnsafePathError):
            raise
        raise type(e)(
            f"{e}\n{path.name} lies in a checkpoint directory whose {_metadata.METADATA_FILE} "
            "would record its checksums, and that metadata cannot vouch for it: the file or "
            f"the metadata is damaged (orbax_safetensors.verify('{directory}') says which); "
            "load_file(..., verify=False) reads the file without checking it"
        ) from None


def _located_by_metadata(
    path: epath.Path, header: _header.Header, metadata: Mapping[str, Any]
) -> dict[str, StoredTensor]:
    # The tensors of one listed file, placed by its header, with the metadata's checksums;
    # the metadata must describe the file exactly as the header does.
    directory = path.parent
    layout = metadata.get("file_layout") if _metadata.has_layout(metadata) else None
    out: dict[str, StoredTensor] = {}
    for name, info in metadata["tensors"].items():
        if not isinstance(info, dict) or info.get("file") != path.name:
            continue
        entry = _checked_entry(directory, name, info, header, layout)
        start = header.data_start + entry.begin
        crc = _recorded_crc(directory, name, info)
        out[name] = StoredTensor(name, path, start, entry.dtype, entry.shape, crc)
    unplaced = [name for name in header.tensors if name not in out]
    if unplaced:
        raise HeaderError(
            f"{path}: holds tensor {unplaced[0]!r}, which {_metadata.METADATA_FILE} does not "
            "place in this file"
        )
    return out


def _check_file(
    directory: epath.Path,
    name: str,
    filename: str,
    path: epath.Path,
    layout: Mapping[str, Any] | None,
) -> None:
    # A listed file must exist as a regular file. Local files are also checked against the
    # recorded size (one stat). On object storage, where each check is a request per file and
    # process, the ranged reads themselves fail on a missing or shorter object.
    if layout is not None and _router.is_object_url(path):
        return
    if _router.is_local(path):
        size = _local_size(path)
        expected = layout[filename]["size"] if layout is not None else size
        if size is not None and size != expected:
            raise SchemaError(
                f"{directory}: {filename!r} is {size} bytes but {_metadata.METADATA_FILE} "
                f"records {expected}; the file was changed or truncated"
            )
        if size is not None:
            return
    if not _router.is_regular_file(path):
        raise SchemaError(
            f"{directory}: tensor {name!r} is stored in {filename!r}, which does not "
            "exist or is not a regular file"
        )


def _local_size(path: epath.Path) -> int | None:
    # The size of a local regular file, None when it is missing. Something else (a FIFO, a
    # directory) is refused as every read of a file refuses it.
    try:
        st = os.stat(os.fspath(path))
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _confine.not_regular_error(path, st.st_mode)
    return st.st_size


def _checked_entry(
    directory: epath.Path,
    name: str,
    info: Mapping[str, Any],
    header: _header.Header,
    layout: Mapping[str, Any] | None,
) -> _header.TensorEntry:
    # The header's entry of a tensor, which must agree with the metadata's.
    filename = info["file"]
    entry = header.tensors.get(name)
    if entry is None:
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} is listed in the metadata but not in the file"
        )
    if entry.dtype != info.get("dtype") or list(entry.shape) != info.get("shape"):
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} is {entry.dtype}{list(entry.shape)} in the "
            f"file but {info.get('dtype')}{info.get('shape')} in the metadata"
        )
    if layout is not None and (
        [entry.begin, entry.end] != info["data_offsets"]
        or header.data_start != layout[filename]["data_start"]
    ):
        raise HeaderError(
            f"{directory / filename}: tensor {name!r} lies at data_offsets "
            f"{[entry.begin, entry.end]} after a {header.data_start}-byte header in the file, "
            f"but at {info['data_offsets']} after {layout[filename]['data_start']} in the metadata"
        )
    return entry


def abstract_tree(directory: epath.PathLike, metadata: Mapping[str, Any] | None = None) -> Any:
    """The saved tree with ``jax.ShapeDtypeStruct`` leaves (inline values as saved); reads no
    tensor bytes."""
    metadata = metadata or read_metadata(directory)
    tensors = metadata["tensors"]
    leaves = _tree.validate_schema(metadata["schema"])

    def get(leaf: _tree.SchemaLeaf) -> Any:
        info = tensors.get(leaf.tensor_name)
        if not isinstance(info, dict):
            raise SchemaError(
                f"schema leaf {leaf.name!r} refers to unknown tensor {leaf.tensor_name!r}"
            )
        original = leaves.get(leaf.tensor_name, leaf).node
        if isinstance(original, _tree.PrngKey):
            impl = original.impl
            return jax.eval_shape(
                lambda: jax.random.wrap_key_data(
                    jax.numpy.zeros(info["shape"], jax.numpy.uint32), impl=impl
                )
            )
        return jax.ShapeDtypeStruct(tuple(info["shape"]), _dtypes.to_numpy(info["dtype"]))

    return _tree.unflatten(metadata["schema"], get, leaves)


@_gcpause.paused
def restore_checkpoint(
    directory: epath.PathLike,
    options: RestoreOptions | None = None,
    *,
    stats: ReadStats | None = None,
) -> Any:
    """Restores a checkpoint directory as ``options`` asks (see :class:`.RestoreOptions`).

    As Orbax's handlers do, arrays saved as ``jax.Array`` without a sharding in the target (no
    target at all, a ``jax.ShapeDtypeStruct`` without one, a request for the saved kind) are
    placed with their saved sharding, rebuilt over the saved devices when this job has them
    all; otherwise on ``options.fallback_sharding`` (as Orbax's
    ``StandardRestore(fallback_sharding=...)``) if given, else a ``TargetMismatchError`` asks
    for a target sharding (Orbax: "Topology mismatch"). Arrays saved host-local come back on
    this process's first device.

    Example::

        tree = restore_checkpoint(path, RestoreOptions(target=abstract, keys=Keys.PARTIAL))
    """
    options = options or RestoreOptions()
    directory = epath.Path(directory)
    metadata = read_metadata(directory, stats=stats)
    stored = locate_in_directory(directory, metadata, stats=stats, io=options.io)
    return restore_tree(
        metadata["schema"],
        stored,
        options,
        stats=stats,
        saved_sharding=saved_shardings(directory, metadata, options.fallback_sharding),
    )


def saved_shardings(
    directory: epath.PathLike,
    metadata: Mapping[str, Any],
    fallback_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[str], Any] | None:
    """Each tensor's saved sharding over this job's devices, by tensor name (None for a tensor
    saved without one); None when no tensor has one. For a sharding this job's devices cannot
    reproduce the function gives ``fallback_sharding``, or raises ``TargetMismatchError``
    without one."""
    tensors = metadata["tensors"]
    if not any(
        isinstance(info, dict) and (info.get("sharding") or "device" in info)
        for info in tensors.values()
    ):
        return None
    # A saved single device counts in a single-process job only: in a multi-process one, each
    # process places host-local arrays on its own first device (the same answer everywhere).
    single_process = jax.process_count() == 1
    device_meshes = metadata.get("device_meshes")
    built: dict[str, Any] = {}  # one sharding object per distinct description

    def rebuilt(name: str, key: str, build: Callable[[], Any], saved_on: Callable[[], str]) -> Any:
        # One object per distinct description; fallback_sharding, or an error, where this job
        # cannot reproduce it.
        if key not in built:
            built[key] = build()
        if built[key] is not None:
            return built[key]
        if fallback_sharding is not None:
            return fallback_sharding
        raise TargetMismatchError(
            f"{directory}: tensor {name!r} was saved {saved_on()}; pass a restore target whose "
            "leaves are jax.ShapeDtypeStruct with the sharding you want"
        )

    def sharding_of(name: str) -> Any:
        info = tensors.get(name)
        desc = info.get("sharding") if isinstance(info, dict) else None
        if not desc:
            if single_process and isinstance(info, dict) and "device" in info:
                saved = info["device"]
                return rebuilt(
                    name,
                    f"device {saved!r}",
                    lambda: _sharding.device_from_json(saved),
                    lambda: f"on device {saved}, which this process does not have",
                )
            return None
        if not isinstance(desc, dict):
            raise SchemaError(f"{directory}: tensor {name!r} has a malformed sharding {desc!r}")
        if "device_ids" in desc:  # (long lists: kept in device_meshes by this library)
            key = json.dumps(desc, sort_keys=True)
        else:
            key = repr(
                (
                    desc.get("mesh_axes"),
                    desc.get("mesh_shape"),
                    desc.get("spec"),
                    desc.get("mesh_devices"),
                )
            )
        return rebuilt(
            name,
            key,
            lambda: _sharding.sharding_from_json(desc, device_meshes),
            lambda: (
                f"with sharding {desc!r} (a mesh of {_sharding.mesh_size(desc)} devices), "
                f"which this job's {len(jax.devices())} devices cannot reproduce"
            ),
        )

    return sharding_of
