"""The methods under test, each a small class with ``save(state, dir)`` / ``restore(dir, abstract)``.

A method's timed work is ``save`` (+ ``wait`` for async completion) and ``restore``;
``prepare`` (imports), ``open`` (e.g. creating a CheckpointManager) and ``close`` are untimed
setup and teardown. The harness adds durability (fsync of every file written) to every save.

Methods 4-6 use ``orbax_safetensors``, which is written concurrently with this harness: they
report themselves unavailable (``unavailable()`` returns the reason) while the package cannot be
imported or lacks the names they need.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from benchmarks import device
from benchmarks.state import case_specs, flatten, generate, np_dtype, unflatten

ALIGN = 64


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ``align``.

    ``np.empty`` returns memory 16 bytes past a 64-byte boundary; XLA's CPU client only aliases
    (zero-copy ``device_put``) 64-byte aligned buffers, and ``read`` into them is ~3x faster.
    """
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_into(f: Any, buf: np.ndarray, offset: int) -> None:
    view = buf.reshape(-1).view(np.uint8).data
    f.seek(offset)
    while view:
        n = f.readinto(view)
        if not n:
            raise EOFError(f"short read at offset {offset}")
        view = view[n:]


class Method:
    """Base class: one way to save and restore a pytree of ``jax.Array``."""

    #: stable identifier used on the command line and in results
    name: ClassVar[str] = ""
    #: one-line description for the report
    description: ClassVar[str] = ""
    #: whether ``save`` returns before the bytes are written (then ``wait`` finishes the job)
    is_async: ClassVar[bool] = False

    def unavailable(self) -> str | None:
        """None if the method can run here, else why not."""
        return None

    def prepare(self) -> None:
        """Imports what the method needs (untimed)."""

    def open(self, directory: Path) -> None:
        """Untimed per-process setup against the checkpoint directory."""

    def save(self, state: Any, directory: Path) -> None:
        """Saves ``state`` (nested dict of ``jax.Array``) under ``directory``."""
        raise NotImplementedError

    def wait(self) -> None:
        """Blocks until an async save has finished writing."""

    def restore(self, directory: Path, abstract: Any) -> Any:
        """Restores the whole state; ``abstract`` is a tree of ``jax.ShapeDtypeStruct``."""
        raise NotImplementedError

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        """Restores only the leaves in ``abstract`` (a sub-tree of the saved tree)."""
        raise NotImplementedError(f"{self.name} has no partial restore")

    def notes(self) -> dict[str, Any]:
        """Method-specific observations about the last operation (e.g. zero-copy rate)."""
        return {}

    def configure(self, job: dict[str, Any]) -> None:
        """Untimed: sees the whole job (op, mode, case, run-wide settings) before ``open``."""

    def own_seconds(self) -> float | None:
        """The last operation's time as the method measured it itself, when the worker's wall
        clock would count something else (the device row: fio's runtime without its start)."""
        return None

    def close(self) -> None:
        """Untimed teardown."""


class Floor(Method):
    """Raw bytes in one file at 64-byte aligned offsets plus a JSON index.

    Restore reads each tensor with ``readinto`` into a 64-byte aligned buffer and wraps it with
    ``jax.device_put(buf, may_alias=True)``, which on CPU shares the buffer (no copy).
    """

    name = "floor"
    description = "raw write + fsync; aligned readinto + zero-copy device_put"

    def __init__(self) -> None:
        self._aliased: tuple[int, int] = (0, 0)

    def prepare(self) -> None:
        import jax

        self._device = jax.devices()[0]

    def save(self, state: Any, directory: Path) -> None:
        flat = flatten(state)
        index: dict[str, Any] = {}
        offset = 0
        data_path = directory / "data.bin"
        fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for name, leaf in flat.items():
                host = np.asarray(leaf)
                pad = (-offset) % ALIGN
                if pad:
                    _write_all(fd, memoryview(bytes(pad)))
                    offset += pad
                index[name] = {
                    "offset": offset,
                    "nbytes": host.nbytes,
                    "shape": list(host.shape),
                    "dtype": str(host.dtype),
                }
                _write_all(fd, np.ascontiguousarray(host).reshape(-1).view(np.uint8).data)
                offset += host.nbytes
            os.fsync(fd)
        finally:
            os.close(fd)
        index_path = directory / "index.json"
        with open(index_path, "w") as f:
            json.dump(index, f)
            f.flush()
            os.fsync(f.fileno())

    def _read(self, directory: Path, names: list[str] | None) -> dict[str, Any]:
        import jax

        with open(directory / "index.json") as f:
            index = json.load(f)
        flat: dict[str, Any] = {}
        aliased = 0
        with open(directory / "data.bin", "rb", buffering=0) as f:
            for name in names if names is not None else list(index):
                entry = index[name]
                buf = aligned_empty(entry["nbytes"])
                _read_into(f, buf, entry["offset"])
                host = buf.view(np_dtype(entry["dtype"])).reshape(entry["shape"])
                leaf = jax.device_put(host, self._device, may_alias=True)
                aliased += leaf.unsafe_buffer_pointer() == host.ctypes.data
                flat[name] = leaf
        self._aliased = (aliased, len(flat))
        return unflatten(flat)

    def restore(self, directory: Path, abstract: Any) -> Any:
        return self._read(directory, None)

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        return self._read(directory, list(flatten(abstract)))

    def notes(self) -> dict[str, Any]:
        aliased, total = self._aliased
        return {"zero_copy_leaves": f"{aliased}/{total}"} if total else {}


class SafetensorsFlax(Method):
    """``safetensors.flax.save_file`` / ``load_file`` on a flat dict with dotted names."""

    name = "safetensors.flax"
    description = "safetensors.flax save_file / load_file (flat dict, dotted names)"

    def prepare(self) -> None:
        import safetensors.flax  # noqa: F401

    def save(self, state: Any, directory: Path) -> None:
        from safetensors.flax import save_file

        save_file(flatten(state), directory / "model.safetensors")

    def restore(self, directory: Path, abstract: Any) -> Any:
        from safetensors.flax import load_file

        return load_file(directory / "model.safetensors")

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        from safetensors import safe_open

        with safe_open(directory / "model.safetensors", framework="flax") as f:
            return {name: f.get_tensor(name) for name in flatten(abstract)}


class OrbaxStandard(Method):
    """``ocp.StandardCheckpointer`` (async, OCDBT + zstd by default), restored with the abstract tree.

    Partial restore uses ``PyTreeCheckpointer`` with ``PyTreeRestore(partial_restore=True)``
    (``StandardRestore`` requires the full tree structure).
    """

    name = "orbax.standard"
    description = "Orbax StandardCheckpointer (OCDBT + zstd), abstract-tree restore"
    is_async = True

    def prepare(self) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._ckptr = ocp.StandardCheckpointer()

    def save(self, state: Any, directory: Path) -> None:
        self._ckptr.save(directory / "state", state)

    def wait(self) -> None:
        self._ckptr.wait_until_finished()

    def restore(self, directory: Path, abstract: Any) -> Any:
        return self._ckptr.restore(directory / "state", abstract)

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        ocp = self._ocp
        with ocp.PyTreeCheckpointer() as ckptr:
            return ckptr.restore(
                directory / "state",
                args=ocp.args.PyTreeRestore(
                    item=abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True,
                ),
            )

    def close(self) -> None:
        self._ckptr.close()


def _accepts(fn: Any, param: str) -> bool:
    """Whether callable ``fn`` takes a parameter named ``param``."""
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _import_osf(names: tuple[str, ...]) -> tuple[Any, str | None]:
    """(module, None) or (None, reason) for ``orbax_safetensors`` having ``names``."""
    try:
        import orbax_safetensors as osf
    except Exception as e:
        return None, f"orbax_safetensors not importable ({type(e).__name__}: {e})"
    missing = [n for n in names if not hasattr(osf, n)]
    if missing:
        return None, f"orbax_safetensors lacks {', '.join(missing)}"
    return osf, None


class OursFile(Method):
    """``osf.save_file(tree, path)`` / ``osf.load_file(path, target=None)``.

    Partial restore passes a sub-tree of ``jax.ShapeDtypeStruct`` as ``target`` (with
    ``strict=False`` when ``load_file`` takes it).
    """

    name = "ours.file"
    description = "orbax_safetensors save_file / load_file(target=None)"
    _needs: ClassVar[tuple[str, ...]] = ("save_file", "load_file")

    def unavailable(self) -> str | None:
        return _import_osf(self._needs)[1]

    def prepare(self) -> None:
        osf, reason = _import_osf(self._needs)
        if osf is None:
            raise RuntimeError(reason)
        self._osf = osf

    def save(self, state: Any, directory: Path) -> None:
        self._osf.save_file(state, directory / "model.safetensors")

    def restore(self, directory: Path, abstract: Any) -> Any:
        return self._osf.load_file(directory / "model.safetensors", target=None)

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        path = directory / "model.safetensors"
        if _accepts(self._osf.load_file, "strict"):
            return self._osf.load_file(path, target=abstract, strict=False)
        return self._osf.load_file(path, target=abstract)


class OursFileBufferedWrites(OursFile):
    """As :class:`OursFile` with ``OSF_DIRECT_IO=never``: saves written through the page cache
    (with writeback started per 8 MiB) instead of ``O_DIRECT``; reads buffered too."""

    name = "ours.file.buffered"
    description = "as ours.file with OSF_DIRECT_IO=never (buffered writes and reads)"

    def configure(self, job: dict[str, Any]) -> None:
        os.environ["OSF_DIRECT_IO"] = "never"  # this worker process only


class OursManager(Method):
    """``ocp.CheckpointManager`` with ``osf.SafetensorsSave`` / ``osf.SafetensorsRestore``.

    The manager is created in ``open`` (untimed), as a training loop creates it once.
    """

    name = "ours.mngr.sync"
    description = (
        "orbax_safetensors via CheckpointManager, synchronous, written straight from the "
        "arrays (SafetensorsSave(snapshot=False))"
    )
    enable_async: ClassVar[bool] = False
    snapshot: ClassVar[bool] = False  # SafetensorsSave(snapshot=...), where it takes one
    _needs: ClassVar[tuple[str, ...]] = ("SafetensorsSave", "SafetensorsRestore")

    def unavailable(self) -> str | None:
        return _import_osf(self._needs)[1]

    def prepare(self) -> None:
        import orbax.checkpoint as ocp

        osf, reason = _import_osf(self._needs)
        if osf is None:
            raise RuntimeError(reason)
        self._osf = osf
        self._ocp = ocp
        self._mngr: Any = None

    def open(self, directory: Path) -> None:
        ocp = self._ocp
        self._mngr = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=self.enable_async),
            **self._manager_kwargs(),
        )

    def _manager_kwargs(self) -> dict[str, Any]:
        return {}

    def save(self, state: Any, directory: Path) -> None:
        save_args = self._osf.SafetensorsSave
        # (Versions before the option wrote a synchronous save straight from the arrays.)
        kwargs = {"snapshot": self.snapshot} if _accepts(save_args, "snapshot") else {}
        self._mngr.save(0, args=save_args(state, **kwargs))

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def restore(self, directory: Path, abstract: Any) -> Any:
        return self._mngr.restore(0, args=self._osf.SafetensorsRestore(abstract))

    def restore_partial(self, directory: Path, abstract: Any) -> Any:
        restore_args = self._osf.SafetensorsRestore
        if _accepts(restore_args, "partial_restore"):  # Orbax's name, since issue 16
            return self._mngr.restore(0, args=restore_args(abstract, partial_restore=True))
        if _accepts(restore_args, "strict"):  # earlier versions: strict governed keys
            return self._mngr.restore(0, args=restore_args(abstract, strict=False))
        return self._mngr.restore(0, args=restore_args(abstract))

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()


class OursManagerAsync(OursManager):
    """As :class:`OursManager` with ``enable_async_checkpointing=True``."""

    name = "ours.mngr.async"
    description = "orbax_safetensors via CheckpointManager, async"
    enable_async = True
    snapshot = True
    is_async = True


class OursManagerSyncSnapshot(OursManager):
    """As :class:`OursManager` with ``SafetensorsSave``'s default ``snapshot=True``: a
    synchronous save that copies the state to host first, as an async one does."""

    name = "ours.mngr.sync.snapshot"
    description = "as ours.mngr.sync with the default snapshot=True (host copies first)"
    snapshot = True


class OursManagerNoChecksums(OursManager):
    """As :class:`OursManager` with ``checksums=False, verify=False``: the CRC32C's cost."""

    name = "ours.mngr.sync.nocrc"
    description = "as ours.mngr.sync without CRC32C (checksums=False, verify=False)"

    def _manager_kwargs(self) -> dict[str, Any]:
        handler = self._osf.SafetensorsCheckpointHandler(checksums=False, verify=False)
        return {"item_handlers": handler}


class DeviceLimit(Method):
    """The device's limit for the same byte count: fio's sequential write until durable (save),
    fio's O_DIRECT sequential read (cold restore; no arrays are built), and memory bandwidth
    for warm restores: a numpy copy of the state into fresh 64-byte aligned buffers wrapped
    zero-copy as ``jax.Array`` (first-touch page faults included, as in every restore).

    The fio job settings are the fastest of a small grid, calibrated once per run
    (``benchmarks/device.py``); the run passes them in the job (``"fio"``).
    """

    name = "device"
    description = (
        "the limit: fio sequential write + end fsync / fio O_DIRECT sequential read; "
        "warm: numpy copy of the state (memory bandwidth)"
    )

    def __init__(self) -> None:
        self._job: dict[str, Any] = {}
        self._source: dict[str, np.ndarray] = {}
        self._seconds: float | None = None

    def own_seconds(self) -> float | None:
        return self._seconds

    def unavailable(self) -> str | None:
        import shutil

        return None if shutil.which("fio") else "fio is not installed (apt-get install fio)"

    def configure(self, job: dict[str, Any]) -> None:
        self._job = job
        if job.get("op") == "restore" and job.get("mode") == "warm":
            # The copy's source: the state itself, in memory (untimed).
            seed = job["case"]["seed"]
            self._source = {s.name: generate(s, seed) for s in case_specs(job["case"])}

    def _settings(self, kind: str) -> dict[str, str]:
        fio = self._job.get("fio") or {}
        return (
            fio.get(kind)
            or (device.WRITE_CANDIDATES if kind == "write" else device.READ_CANDIDATES)[0]
        )

    def _nbytes(self) -> int:
        return sum(s.nbytes for s in case_specs(self._job["case"]))

    def save(self, state: Any, directory: Path) -> None:
        device.run_fio(
            directory / device.FIO_FILE, self._nbytes(), self._settings("write"), write=True
        )

    def restore(self, directory: Path, abstract: Any) -> Any:
        if self._job.get("mode") != "warm":
            self._seconds = device.run_fio(
                directory / device.FIO_FILE, self._nbytes(), self._settings("read"), write=False
            )
            return None  # bytes only: the worker reports verified = "n/a"
        import jax

        dev = jax.devices()[0]
        flat: dict[str, Any] = {}
        for name, src in self._source.items():
            buf = aligned_empty(src.nbytes).view(src.dtype).reshape(src.shape)
            np.copyto(buf, src)
            flat[name] = jax.device_put(buf, dev, may_alias=True)
        return unflatten(flat)

    def notes(self) -> dict[str, Any]:
        return {"fio": {k: device.describe(self._settings(k)) for k in ("write", "read")}}


METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        DeviceLimit,
        Floor,
        SafetensorsFlax,
        OrbaxStandard,
        OursFile,
        OursFileBufferedWrites,
        OursManager,
        OursManagerAsync,
        OursManagerSyncSnapshot,
        OursManagerNoChecksums,
    )
}
