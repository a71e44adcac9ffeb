"""Orbax-native items whose metadata claims more than their files hold (issue 46, class 4).

Real Orbax items (``PyTreeSave``; OCDBT or a directory per array, zarr3 or zarr2), then forged:
an array's zarr metadata claims 2**40 elements with its chunks deleted, read as the fill
value, or stored as one chunk of that size; an OCDBT data file, B-tree node or manifest
deleted or cut short. Every verb and API that reads an Orbax-native array (``inspect``,
``diff``, ``convert``, ``export`` on the command line; ``osf.convert``, ``osf.export_pytorch``,
``osf.load_pytorch``; ``OrbaxSource.read``, ``read_box``, ``read_sharded`` and ``restore``,
the fallback through Orbax's own restore; a ``CheckpointManager``'s restore of a mixed step
whose Orbax-native item this library's handler passes to Orbax's) refuses before allocating the
claim, with one
``SafetensorsCheckpointError`` naming the tensor or the missing file; the command line with
one ``error:`` line and exit status 2, and no output left behind. ``inspect`` lists a claim
without reading it.

Before this, ``convert`` of such an item allocated the claim and the process aborted
(``std::bad_alloc``), so every cell runs in one child process (:func:`drive`): a crash there
fails the cells it had not answered, never pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)
_CHILDREN = 3  # child processes at most: a crash ends one (and fails its cell)

HUGE = [1 << 20, 1 << 20]  # 2**40 float32 elements: 4 TiB claimed
MAXTEXT_EMBEDDING = "params.params.token_embedder.embedding"  # (96, 32) in chunks of (96, 4)
MAPPING_MODULE = "orbax_claims_mapping"
# ``mapping``: the item's tensors exported as ``model.*.weight``; ``loading``: the item read
# as a PyTorch checkpoint (its names on the PyTorch side).
MAPPING_SOURCE = (
    "import orbax_safetensors as osf\n"
    "def mapping():\n"
    "    return osf.KeyMapping([osf.Rule('model.{n}.weight', 'params.{n}')], "
    "ignore_flax=['step'])\n"
    "def loading():\n"
    "    return osf.KeyMapping([osf.Rule('params.{n}', 'loaded.{n}')])\n"
)
# The layouts Orbax saves in: (use_ocdbt, use_zarr3).
LAYOUTS = {
    "ocdbt-zarr3": (True, True),
    "ocdbt-zarr2": (True, False),
    "plain-zarr3": (False, True),
    "plain-zarr2": (False, False),
}


# ------------------------------------------------------------------------------ the items


def save_item(path: Path, use_ocdbt: bool, use_zarr3: bool) -> None:
    """A real Orbax PyTree item: ``params.w`` (64, 64) float32 (random: stored out of line in
    an OCDBT data file), ``params.b`` (4,) and a scalar ``step``."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    tree = {
        "params": {
            "w": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),
            "b": jnp.ones((4,), jnp.float32),
        },
        "step": 3,
    }
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(path, args=ocp.args.PyTreeSave(tree))


def mixed_registry() -> Any:
    """A registry giving both items of a mixed step to this library's handler: ``ours``
    (safetensors) and ``native`` (Orbax's ``StandardSave``, passed on to Orbax's handler)."""
    import orbax_safetensors as osf

    handler = osf.SafetensorsCheckpointHandler()
    registry = osf.handler_registry(handler, item="native")
    registry.add("ours", osf.SafetensorsSave, handler)
    registry.add("ours", osf.SafetensorsRestore, handler)
    return registry


def save_mixed_step(root: Path) -> Path:
    """A CheckpointManager root whose step 0 holds ``ours`` and an Orbax-native ``native``
    (the tree of :func:`save_item`, OCDBT and zarr3 as Orbax saves by default): that item."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import orbax_safetensors as osf

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    tree = {"params": {"w": w, "b": jnp.ones((4,), jnp.float32)}, "step": 3}
    args = ocp.args.Composite(
        ours=osf.SafetensorsSave({"c": np.arange(4)}), native=ocp.args.StandardSave(tree)
    )
    with ocp.CheckpointManager(root, handler_registry=mixed_registry()) as mngr:
        mngr.save(0, args=args)
        mngr.wait_until_finished()
    return root / "0" / "native"


def save_maxtext(root: Path) -> Path:
    """A MaxText llama train state saved as MaxText's v0 releases save it, sharded over the
    devices (chunks of one device's rows): its item directory."""
    import jax
    import maxtext_checkpoints as M
    import orbax.checkpoint as ocp

    state = {"step": np.int32(7), "params": {"params": M.llama_params(M.Dims())}}
    state = M.shard_state(state, layers=True)
    if getattr(ocp, "__version__", "0.12").startswith("0.11."):
        # Orbax 0.11's replica-parallel save of a replicated jax.Array fails on JAX 0.7 (it
        # enters jax.sharding.set_mesh, no context manager there): those leaves go as numpy.
        state = jax.tree.map(
            lambda a: (
                np.asarray(a)
                if isinstance(a, jax.Array) and a.is_fully_replicated and len(a.devices()) > 1
                else a
            ),
            state,
        )
    return M.save_v0(root, 7, state) / M.ITEM


def _ocdbt(path: Path) -> Any:
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()


def forge_claim(path: Path, shape: list[int], chunks: list[int], *, drop_chunks: bool) -> None:
    """Rewrites ``params.w``'s zarr metadata to claim ``shape`` in chunks of ``chunks``
    (through the OCDBT database where the item has one), deleting its chunks if asked."""
    import tensorstore as ts

    zarr3 = json.loads((path / "_METADATA").read_text())["use_zarr3"]
    meta_key = "params.w/zarr.json" if zarr3 else "params.w/.zarray"

    def forged(doc: dict[str, Any]) -> bytes:
        doc["shape"] = shape
        if zarr3:
            doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
            doc["codecs"][0]["configuration"]["chunk_shape"] = chunks
        else:
            doc["chunks"] = chunks
        return json.dumps(doc).encode()

    if (path / "manifest.ocdbt").exists():
        kv = _ocdbt(path)
        kv.write(meta_key, forged(json.loads(kv.read(meta_key).result().value))).result()
        if drop_chunks:
            for key in kv.list().result():
                if key.startswith(b"params.w/") and key != meta_key.encode():
                    kv.delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()
        return
    meta = path / meta_key
    meta.write_bytes(forged(json.loads(meta.read_text())))
    if drop_chunks:
        for chunk in meta.parent.iterdir():
            if chunk != meta:
                shutil.rmtree(chunk) if chunk.is_dir() else chunk.unlink()


def value_file(path: Path) -> Path:
    """The OCDBT data file holding ``params.w``'s chunk (out of line: the largest)."""
    return max((path / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


@dataclasses.dataclass(frozen=True)
class Case:
    """A forged item: ``layout`` saved, then ``forge(path)``; ``match``: what every refusal
    says; ``lists``: whether ``inspect`` still lists it (the metadata reads)."""

    name: str
    layout: str
    forge: Callable[[Path], None]
    match: str
    lists: bool


def _claim(path: Path) -> None:
    forge_claim(path, HUGE, [64, 64], drop_chunks=True)


def _fill_value(path: Path) -> None:
    doc = json.loads((path / "_METADATA").read_text())
    doc["store_array_data_equal_to_fill_value"] = False  # never-written chunks read as zeros
    (path / "_METADATA").write_text(json.dumps(doc))
    forge_claim(path, HUGE, [64, 64], drop_chunks=True)


def _one_chunk(path: Path) -> None:  # a chunk that would decompress to the claim
    forge_claim(path, HUGE, HUGE, drop_chunks=False)


def _truncate(path: Path) -> None:
    file = value_file(path)
    file.write_bytes(file.read_bytes()[:100])


def _drop_maxtext_chunk(path: Path) -> None:  # one device's columns of the embedding
    import tensorstore as ts

    key = f"{MAXTEXT_EMBEDDING}/c/0/3".encode()
    _ocdbt(path).delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()


def _remove_root_node(path: Path) -> None:
    for node in (path / "d").iterdir():
        node.unlink()


_MISSING = r"missing from .*: refused before allocating"
_PHYSICAL = r"needs more than this machine's \d+ bytes of physical memory: refused before"
CASES = [
    *(Case(f"claim-{layout}", layout, _claim, _MISSING, True) for layout in LAYOUTS),
    Case("claim-read-as-fill-value", "ocdbt-zarr3", _fill_value, _PHYSICAL, True),
    Case("claim-in-one-chunk", "plain-zarr2", _one_chunk, _PHYSICAL, True),
    Case(
        "ocdbt-value-file-missing",
        "ocdbt-zarr3",
        lambda p: value_file(p).unlink(),
        r"OCDBT data file ocdbt\.process_0/d/\w+ is missing: it holds the value of key "
        r"'params\.w/(?:c/0/0|0\.0)' of tensor 'params\.w'",  # (zarr3's key, or zarr2's)
        True,
    ),
    Case(
        "ocdbt-value-file-short",
        "ocdbt-zarr2",
        _truncate,
        r"OCDBT data file ocdbt\.process_0/d/\w+ holds 100 bytes, but its manifest places the "
        r"value of key 'params\.w/0\.0'",
        True,
    ),
    Case(
        "ocdbt-node-file-missing",
        "ocdbt-zarr3",
        _remove_root_node,
        r"OCDBT data file d/\w+ is missing: it holds a B-tree node",
        False,
    ),
    Case(
        "ocdbt-manifest-missing",
        "ocdbt-zarr2",
        lambda p: (p / "manifest.ocdbt").unlink(),
        r"OCDBT manifest file manifest\.ocdbt is missing",
        False,
    ),
    Case(
        "maxtext-chunk-missing",
        "maxtext",
        _drop_maxtext_chunk,
        r"tensor 'params\.params\.token_embedder\.embedding' claims F32\[96, 32\] \(12288 bytes\), "
        r"but chunks of \[0:96, 0:32\] \(chunks of \[96, 4\]\) are missing from the item's OCDBT",
        True,
    ),
    Case(
        "zarr-metadata-file-missing",
        "plain-zarr2",
        lambda p: (p / "params.w" / ".zarray").unlink(),
        r"the zarr metadata of array 'params\.w' \(params\.w/\.zarray\) is missing",
        False,
    ),
]
BY_NAME = {c.name: c for c in CASES}

# ------------------------------------------------------------------------------ the verbs


def _mapping(name: str = "mapping") -> Any:
    import importlib

    return getattr(importlib.import_module(MAPPING_MODULE), name)()


def _source(item: Path) -> Any:
    from orbax_safetensors._src.catalog import orbax_source

    return orbax_source.OrbaxSource(item)


def _read_sharded(item: Path, out: Path) -> Any:
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _source(item).read_sharded(["params.w"], {"params.w": sharding})


def _convert(item: Path, out: Path) -> Any:
    import orbax_safetensors as osf

    return osf.convert(item, out)


def _export_pytorch(item: Path, out: Path) -> Any:
    import orbax_safetensors as osf

    return osf.export_pytorch(item, out, _mapping())


def _export_maxtext(item: Path, out: Path) -> Any:
    import maxtext_checkpoints as M

    import orbax_safetensors as osf

    mapping = osf.preset_mapping("maxtext-llama3", hf_config=M.hf_config(M.Dims()))
    return osf.export_pytorch(item, out, mapping)


def _manager_restore(item: Path, out: Path, args: Any = None) -> Any:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(item.parent.parent, handler_registry=mixed_registry()) as mngr:
        return mngr.restore(0, args=args)


def _manager_pytree_restore(item: Path, out: Path) -> Any:
    import orbax.checkpoint as ocp

    import orbax_safetensors as osf

    args = ocp.args.Composite(ours=osf.SafetensorsRestore(), native=ocp.args.PyTreeRestore())
    return _manager_restore(item, out, args)


def _load_pytorch(item: Path, out: Path) -> Any:
    import orbax_safetensors as osf

    return osf.load_pytorch(None, item, _mapping("loading"))


# API verbs: each reads ``params.w`` of the item (``out``: a path to write under).
API: dict[str, Callable[[Path, Path], Any]] = {
    "OrbaxSource.read": lambda item, out: _source(item).read(["params.w"]),
    "OrbaxSource.read_box": lambda item, out: _source(item).read_box(
        "params.w", (slice(0, 64), slice(0, 64))
    ),
    "OrbaxSource.read_sharded": _read_sharded,
    "OrbaxSource.restore": lambda item, out: _source(item).restore(["params.w"]),
    "osf.convert": _convert,
    "osf.export_pytorch": _export_pytorch,
    "osf.load_pytorch": _load_pytorch,
    # the MaxText preset on a MaxText train state, read as one process reads it
    # (integrations/export_reads.py: whole tensors, or bands of stacked layers)
    "osf.export_pytorch(maxtext-llama3)": _export_maxtext,
    # a mixed step's Orbax-native item, restored by Orbax's handler through this library's
    # (cases "<case>@step": the item forged inside a manager root)
    "manager restore": _manager_restore,
    "manager restore(PyTreeRestore)": _manager_pytree_restore,
}
CLI = {
    "inspect": lambda item, out: ["inspect", str(item)],
    "diff": lambda item, out: ["diff", str(item), str(item)],
    "convert": lambda item, out: ["convert", "-q", str(item), str(out)],
    "export": lambda item, out: ["export", str(item), str(out), "--mapping", "{m}:mapping"],
}
MANAGER = ("manager restore", "manager restore(PyTreeRestore)")
VERBS = [verb for verb in [*CLI, *API] if "maxtext" not in verb and verb not in MANAGER]
STEP = "@step"  # a case's forgery in a mixed step's Orbax-native item (Orbax's default layout)
STEP_CASES = ("claim-ocdbt-zarr3", "claim-read-as-fill-value", "claim-in-one-chunk")


# Every verb meets these; the others go through the verbs their failure could differ on.
EVERY_VERB = ("claim-ocdbt-zarr3", "ocdbt-value-file-missing")
WHOLE_READS = ("convert", "export", "OrbaxSource.read_sharded", "OrbaxSource.restore")


def cells() -> list[tuple[str, str]]:
    """The (verb, case) pairs that must refuse: every verb on the headline forgery and on a
    missing OCDBT value file; the other layouts through ``convert`` (the reported
    reproduction); the refusals by size through the verbs that read whole tensors (and a box
    of a chunk decoded whole); the other lost files where the item is opened and read."""
    out = [(verb, case) for case in EVERY_VERB for verb in VERBS]
    out += [("convert", f"claim-{layout}") for layout in LAYOUTS if layout != "ocdbt-zarr3"]
    out += [(verb, "claim-read-as-fill-value") for verb in WHOLE_READS]
    out += [(verb, "claim-in-one-chunk") for verb in (*WHOLE_READS, "OrbaxSource.read_box")]
    out += [(verb, "ocdbt-value-file-short") for verb in ("diff", "convert", "OrbaxSource.read")]
    for case in ("ocdbt-node-file-missing", "ocdbt-manifest-missing", "zarr-metadata-file-missing"):
        out += [(verb, case) for verb in ("inspect", "convert", "OrbaxSource.read")]
    out += [("osf.export_pytorch(maxtext-llama3)", "maxtext-chunk-missing")]
    out += [(verb, case + STEP) for verb in MANAGER for case in (*STEP_CASES, *EVERY_VERB[1:])]
    return out


# Reads that must succeed: the intact item through the verbs that write or map, and a box of
# an array whose never-written chunks read as the fill value (what Orbax's restore gives).
CONTROLS = [
    *((verb, "intact") for verb in ("convert", "export", "osf.export_pytorch", "osf.load_pytorch")),
    ("OrbaxSource.read_box", "claim-read-as-fill-value"),
    ("osf.export_pytorch(maxtext-llama3)", "maxtext-intact"),
    *((verb, "intact" + STEP) for verb in MANAGER),
]


# ------------------------------------------------------------------------------ the child


def _captured(call: Callable[[], Any], err_file: Path) -> tuple[Any, str, str]:
    """``call()``'s result, stdout and stderr, file descriptor 2 included (what TensorStore or
    an abort message writes), kept in ``err_file`` should the process die in ``call``."""
    out = io.StringIO()
    with open(err_file, "w+b") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                result = call()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return result, out.getvalue(), err.read().decode(errors="replace")


def run_cell(verb: str, item: Path, out_parent: Path, err_file: Path) -> dict[str, Any]:
    """One cell, as :func:`drive` records it: the CLI's status and output, or the API's
    error, and what is left where the output was to go."""
    from orbax_safetensors import SafetensorsCheckpointError
    from orbax_safetensors._src.tools import cli

    out_parent.mkdir(parents=True)
    out = out_parent / "out"
    record: dict[str, Any] = {}
    if verb in CLI:
        argv = [a.replace("{m}", MAPPING_MODULE) for a in CLI[verb](item, out)]
        record["status"], record["stdout"], record["stderr"] = _captured(
            lambda: cli.main(argv), err_file
        )
    else:
        try:
            _captured(lambda: API[verb](item, out), err_file)
            record["error"] = None
        except Exception as e:  # (recorded: the test says which types may escape)
            record["error"] = [type(e).__name__, str(e)]
            record["ours"] = isinstance(e, SafetensorsCheckpointError)
    record["left"] = sorted(p.name for p in out_parent.iterdir())
    return record


def _cell_dir(verb: str, case: str) -> str:
    return re.sub(r"\W", "_", f"{verb}-{case}")


def drive(spec_path: str) -> None:
    """The child: runs each cell of the spec, noting its start and then its record in the
    results file at once, so a crash names the cell it happened in."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["mapping_dir"])
    # Orbax's failed reads leave asyncio tasks that log their failure whenever TensorStore's
    # threads let them go, in whichever cell runs then; the command line silences that logger
    # while it runs (a command is alone in its process), so the child does for every cell.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    with open(spec["results"], "a") as results:

        def note(line: dict[str, Any]) -> None:
            results.write(json.dumps(line) + "\n")
            results.flush()
            os.fsync(results.fileno())

        for verb, case, item in spec["cells"]:
            note({"start": [verb, case]})
            where = _cell_dir(verb, case)
            err_file = Path(spec["stderr"]) / f"{where}.txt"
            record = run_cell(verb, Path(item), Path(spec["out"]) / where, err_file)
            note({"cell": [verb, case], **record})


# ------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Builds the items, forges the cases and runs every cell in one child process."""
    tmp = tmp_path_factory.mktemp("orbax_claims")
    base = {}
    for layout, (ocdbt, zarr3) in LAYOUTS.items():
        base[layout] = tmp / "base" / layout
        save_item(base[layout], ocdbt, zarr3)
    base["maxtext"] = save_maxtext(tmp / "base" / "maxtext")
    items = {"intact": base["ocdbt-zarr3"], "maxtext-intact": base["maxtext"]}
    items["intact" + STEP] = save_mixed_step(tmp / "base" / "step")
    for case in CASES:
        items[case.name] = tmp / "items" / case.name
        shutil.copytree(base[case.layout], items[case.name])
        case.forge(items[case.name])
    for name in (*STEP_CASES, *EVERY_VERB[1:]):
        root = tmp / "roots" / name
        shutil.copytree(tmp / "base" / "step", root)
        items[name + STEP] = root / "0" / "native"
        BY_NAME[name].forge(items[name + STEP])
    (tmp / f"{MAPPING_MODULE}.py").write_text(MAPPING_SOURCE)
    (tmp / "stderr").mkdir()
    pending = [*CONTROLS, *cells()]
    got: dict[tuple[str, str], Any] = {}
    for attempt in range(_CHILDREN):  # a crash ends a child: the next runs the cells after it
        if not pending:
            break
        spec = {
            "cells": [[v, c, str(items[c])] for v, c in pending],
            "out": str(tmp / "out"),
            "stderr": str(tmp / "stderr"),
            "results": str(tmp / f"results{attempt}.jsonl"),
            "mapping_dir": str(tmp),
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        proc = subprocess.run(
            [sys.executable, __file__, str(tmp / "spec.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )
        started = None
        results = Path(spec["results"])
        for line in results.read_text().splitlines() if results.exists() else []:
            record = json.loads(line)
            if "start" in record:
                started = tuple(record["start"])
            else:
                got[tuple(record.pop("cell"))] = record
        if started is not None and started not in got:
            err = (tmp / "stderr" / f"{_cell_dir(*started)}.txt").read_text(errors="replace")
            got[started] = f"the process ended with status {proc.returncode} here: {err[-2000:]}"
        elif proc.returncode:  # (died outside a cell: every cell it did not answer fails)
            for cell in pending:
                got.setdefault(cell, f"the child failed: {proc.stderr[-2000:]}")
        pending = [cell for cell in pending if cell not in got]
    return {cell: got.get(cell, "not run: the children crashed") for cell in [*CONTROLS, *cells()]}


def _one_error_line(verb: str, record: dict[str, Any]) -> str:
    assert record["status"] == 2, record
    lines = record["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"orbax-safetensors {verb}: error: "), record
    return lines[0]


@pytest.mark.parametrize("verb, case", cells(), ids=[f"{v}-{c}" for v, c in cells()])
def test_a_claim_the_files_do_not_back_is_refused_before_allocating(
    outcomes: dict[tuple[str, str], Any], verb: str, case: str
) -> None:
    record = outcomes[(verb, case)]
    assert isinstance(record, dict), record  # (a string: the process died in this cell)
    forged = BY_NAME[case.removesuffix(STEP)]
    assert record["left"] == [], record  # no output, no temporary sibling
    if verb == "inspect" and forged.lists:  # lists the claim, reads nothing
        assert record["status"] == 0 and not record["stderr"].strip(), record
        if case.startswith("claim"):
            assert "(1048576, 1048576)" in record["stdout"], record
        return
    if verb in CLI:
        message = _one_error_line(verb, record)
    else:
        assert record["error"] is not None and record["ours"], record
        message = record["error"][1]
    assert re.search(forged.match, message), message
    if case.startswith("claim"):  # the tensor and its claim, named
        assert "tensor 'params.w' claims F32[1048576, 1048576] (4398046511104 bytes)" in message


@pytest.mark.parametrize("verb, case", CONTROLS, ids=[f"{v}-{c}" for v, c in CONTROLS])
def test_what_the_files_back_reads_through_the_same_cells(
    outcomes: dict[tuple[str, str], Any], verb: str, case: str
) -> None:
    record = outcomes[(verb, case)]
    assert isinstance(record, dict), record
    if verb in CLI:
        assert record["status"] == 0 and not record["stderr"].strip(), record
    else:
        assert record["error"] is None, record
    writes = verb in ("convert", "export") or verb.startswith("osf.export_pytorch")
    assert record["left"] == (["out"] if writes else []), record


def test_orbax_metadata_and_zarr_metadata_disagreeing_are_named(tmp_path: Path) -> None:
    """An item changed after it was opened: Orbax's metadata (read at open) and the zarr
    metadata TensorStore opens claim different shapes; the read names both."""
    from orbax_safetensors import SafetensorsCheckpointError

    item = tmp_path / "item"
    save_item(item, False, True)
    source = _source(item)
    forge_claim(item, [64, 128], [64, 64], drop_chunks=False)
    with pytest.raises(SafetensorsCheckpointError) as info:
        source.read(["params.w"])
    assert (
        "tensor 'params.w': Orbax's metadata claims shape [64, 64] but its zarr metadata "
        "(params.w/zarr.json) gives shape [64, 128]"
    ) in str(info.value)


def test_a_box_of_the_chunks_present_still_reads(tmp_path: Path) -> None:
    """A tensor with a chunk missing: a box of the chunks present reads, one that needs the
    missing chunk is refused before anything is allocated, naming the box."""
    import orbax.checkpoint as ocp

    from orbax_safetensors import SafetensorsCheckpointError

    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False)
    with ocp.Checkpointer(handler) as checkpointer:
        save_args = {"w": ocp.SaveArgs(chunk_byte_size=w.nbytes // 4)}
        checkpointer.save(tmp_path / "item", args=ocp.args.PyTreeSave({"w": w}, save_args))
    source = _source(tmp_path / "item")
    rows = source.chunks["w"][0]
    assert rows < 64, source.chunks
    (tmp_path / "item" / "w" / f"{64 // rows - 1}.0").unlink()  # the last rows' chunk
    box = (slice(0, rows), slice(0, 64))
    np.testing.assert_array_equal(source.read_box("w", box), w[:rows])
    with pytest.raises(SafetensorsCheckpointError, match=rf"chunks of \[{64 - rows}:64, 0:64\]"):
        source.read_box("w", (slice(64 - rows, 64), slice(0, 64)))


if __name__ == "__main__":
    drive(sys.argv[1])
