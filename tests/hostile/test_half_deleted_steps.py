"""Half-deleted steps (issue 46, point 5): ``verify`` passes only what restore accepts, whatever
order the files of a step disappear in.

Orbax's cleanup (``max_to_keep``) deletes an old step file by file, and Orbax lists the step
until its directory itself is gone: orbax-checkpoint 0.11.11 (and 0.12.8 with one deletion
thread) with ``shutil.rmtree``, depth first in directory listing order; 0.12.8 with several
threads deletes every directory's files at once, in no order, then the empty directories. A kill
can leave any of those states. Each test here builds real steps once (a real
``CheckpointManager`` with ``max_to_keep=2`` and three saves: step 0 deleted by Orbax, steps 1
and 2 kept), copies the root for each state a kill can leave of step 1 (the next one Orbax
deletes), restores step 1 with a real manager and holds the tools to it:

- a restore that fails: ``osf.verify`` of the root and of the step lists the step in
  ``incomplete`` with a warning (``ok`` False); ``orbax-safetensors verify`` exits 1;
  ``inspect`` (API and command line, root and step) says INCOMPLETE and exits 0; ``convert``
  of the root refuses it (exit 2, nothing written);
- in every state: Orbax and the tools list the same steps, ``verify`` and ``inspect`` judge the
  step alike, and step 2 stays intact and checked.

The states: every prefix of ``shutil.rmtree``'s order and of the reverse listing order; every
entry deleted first (with its contents); ``_CHECKPOINT_METADATA`` first, then every entry; every
file as the last one left by the parallel deleter, and its directories going bottom up.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import traced_memory

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.orbax import completeness as _completeness
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.tools import inspection

pytestmark = pytest.mark.timeout(600)

STEP = 1  # the step Orbax's cleanup deletes next


def _tree(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    # 64x64 float32 does not fit OCDBT's inline values: its bytes live in a data file of
    # ocdbt.process_0/ that the merged manifest references.
    return {
        "w": jnp.asarray(rng.random((64, 64), np.float32)),
        "b": np.arange(3, dtype=np.int32),
    }


def _zarr_registry() -> Any:
    """Orbax's PyTree handler without OCDBT, zarr v3: a directory of chunk files per array."""
    registry = ocp.DefaultCheckpointHandlerRegistry()
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
    registry.add("native", ocp.args.PyTreeSave, handler)
    registry.add("native", ocp.args.PyTreeRestore, handler)
    return registry


def _sharded_registry() -> Any:
    """This library's handler writing item ``a`` as several safetensors files."""
    registry = ocp.DefaultCheckpointHandlerRegistry()
    handler = osf.SafetensorsCheckpointHandler(max_file_size=16384)
    registry.add("a", osf.SafetensorsSave, handler)
    registry.add("a", osf.SafetensorsRestore, handler)
    return registry


# name -> (the save args of a step, the restore args, Orbax's handler registry for the save)
CONFIGS: dict[str, tuple[Callable[[int], Any], Callable[[], Any], Any]] = {
    "ours+standard": (
        lambda s: ocp.args.Composite(
            ours=osf.SafetensorsSave(_tree(s)), native=ocp.args.StandardSave(_tree(s))
        ),
        lambda: ocp.args.Composite(ours=osf.SafetensorsRestore(), native=ocp.args.PyTreeRestore()),
        None,
    ),
    "ours+ours": (
        lambda s: ocp.args.Composite(
            a=osf.SafetensorsSave({**_tree(s), "v": _tree(s + 1)["w"]}),
            b=osf.SafetensorsSave({"c": np.int64(s)}),
        ),
        lambda: ocp.args.Composite(a=osf.SafetensorsRestore(), b=osf.SafetensorsRestore()),
        _sharded_registry,
    ),
    "ours+zarr": (
        lambda s: ocp.args.Composite(
            ours=osf.SafetensorsSave({"c": np.int64(s)}),
            native=ocp.args.PyTreeSave(
                {**_tree(s), "name": "run"},
                save_args={
                    "w": ocp.SaveArgs(chunk_byte_size=4096),
                    "b": ocp.SaveArgs(),
                    "name": ocp.SaveArgs(),
                },
            ),
        ),
        lambda: ocp.args.Composite(ours=osf.SafetensorsRestore(), native=ocp.args.PyTreeRestore()),
        _zarr_registry,
    ),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One root per config: steps 1 and 2 kept, step 0 deleted by Orbax's cleanup."""
    out = {}
    for name, (save, _, registry) in CONFIGS.items():
        root = tmp_path_factory.mktemp(name.replace("+", "-")) / "run"
        options = ocp.CheckpointManagerOptions(max_to_keep=2)
        kwargs = {"handler_registry": registry()} if registry else {}
        with ocp.CheckpointManager(root, options=options, **kwargs) as mngr:
            for step in range(3):
                mngr.save(step, args=save(step))
            mngr.wait_until_finished()
            assert list(mngr.all_steps()) == [1, 2]
        out[name] = root
    return out


# --------------------------------------------------------------------------- the states


def _rmtree_order(path: Path, top: Path, reverse: bool = False) -> list[str]:
    """The entries of ``path`` (relative to ``top``) in the order ``shutil.rmtree`` deletes
    them: depth first, in ``os.scandir`` order (``reverse``: the other way round), each
    directory after its contents."""
    with os.scandir(path) as it:
        entries = list(it)
    if reverse:
        entries.reverse()
    out = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            out += _rmtree_order(Path(entry.path), top, reverse)
        out.append(os.path.relpath(entry.path, top))
    return out


def _states(step: Path, order: str) -> Iterator[tuple[str, list[str]]]:
    """(a name, the entries deleted in turn) for each state of ``order`` (module docstring)."""
    dfs = _rmtree_order(step, step)
    files = [e for e in dfs if not (step / e).is_dir()]
    dirs = sorted((e for e in dfs if (step / e).is_dir()), key=lambda e: -e.count("/"))
    if order in ("rmtree", "rmtree-reversed"):
        seq = dfs if order == "rmtree" else _rmtree_order(step, step, reverse=True)
        for k in range(1, len(seq) + 1):
            yield f"{order} up to {seq[k - 1]}", seq[:k]
    elif order == "each-first":
        for e in dfs:
            yield f"{e} first", [e]
    elif order == "metadata-first":
        for e in dfs:
            if e != "_CHECKPOINT_METADATA":
                yield f"_CHECKPOINT_METADATA then {e}", ["_CHECKPOINT_METADATA", e]
    elif order == "parallel":
        for f in files:
            yield f"every file but {f}", [g for g in files if g != f]
        for k in range(len(dirs) + 1):
            yield f"every file, then {k} directories", files + dirs[:k]
    else:
        raise AssertionError(order)


def _delete(step: Path, deleted: list[str]) -> None:
    for rel in deleted:
        target = step / rel
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


# --------------------------------------------------------------------------- the judges


def _restore_error(root: Path, restore_args: Callable[[], Any]) -> str | None:
    """Why a fresh manager cannot restore step 1 (None when it can); checks that Orbax and
    the tools list the same steps, step 1 among them."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        listed = list(mngr.all_steps())
        assert listed == [s for s, _ in _steps.list_steps(root)] and STEP in listed, listed
        try:
            mngr.restore(STEP, args=restore_args())
        except Exception as e:  # Orbax raises many types for what is missing
            return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _judge(
    root: Path, restore_args: Callable[[], Any], capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """What the tools get wrong about the state in ``root`` (empty: nothing)."""
    step, latest = root / str(STEP), root / str(STEP + 1)
    wrong = []
    report = osf.verify(root)
    flagged = str(step) in report.incomplete
    statuses = {s["step"]: s["status"] for s in inspection.inspect_path(root)["steps"]}
    if statuses != {STEP: "incomplete" if flagged else "ok", STEP + 1: "ok"}:
        wrong.append(f"inspect says {statuses}, verify incomplete={report.incomplete}")
    if any(str(latest) in p for p in report.problems) or report.files == 0:
        wrong.append(f"verify of the intact step 2: {report.problems}, files={report.files}")
    failed = _restore_error(root, restore_args)
    if failed is None and not flagged:
        return wrong
    if not flagged:
        wrong.append(f"restore fails ({failed}) but verify says ok={report.ok}")
        return wrong
    # The step is reported incomplete: every verb says so.
    if report.ok or not any(w.startswith(f"step {STEP} is incomplete") for w in report.warnings):
        wrong.append(f"verify: ok={report.ok}, warnings={report.warnings}")
    direct = osf.verify(step)
    if direct.ok or direct.incomplete != [str(step)]:
        wrong.append(f"verify of the step: ok={direct.ok}, incomplete={direct.incomplete}")
    code, out, _ = _cli(capsys, "verify", root)
    if code != 1 or "DAMAGED" not in out:
        wrong.append(f"orbax-safetensors verify: exit {code}: {out[-300:]}")
    code, out, err = _cli(capsys, "inspect", root)
    rows = [line for line in out.splitlines() if line.split()[:1] == [str(STEP)]]
    if code != 0 or not rows or not rows[0].endswith("INCOMPLETE"):
        wrong.append(f"orbax-safetensors inspect: exit {code}: {out[-300:]}{err[-300:]}")
    code, out, err = _cli(capsys, "inspect", step)
    if code != 0 or "INCOMPLETE" not in out:
        wrong.append(f"orbax-safetensors inspect STEP: exit {code}: {out[-300:]}{err[-300:]}")
    dst = root.parent / "converted"
    code, _, err = _cli(capsys, "convert", root, dst, "-q")
    if code != 2 or "incomplete step" not in err or dst.exists():
        wrong.append(f"orbax-safetensors convert: exit {code}: {err[-300:]}")
    return wrong


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(
    "order", ["rmtree", "rmtree-reversed", "each-first", "metadata-first", "parallel"]
)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_state_a_killed_cleanup_leaves(
    config: str,
    order: str,
    roots: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = roots[config]
    restore_args = CONFIGS[config][1]
    wrong: dict[str, list[str]] = {}
    seen: set[frozenset[str]] = set()
    states = 0
    for name, deleted in _states(src / str(STEP), order):
        case = tmp_path / "case"
        shutil.rmtree(case, ignore_errors=True)
        root = case / "run"
        shutil.copytree(src, root, copy_function=os.link)  # only ever deleted from
        _delete(root / str(STEP), deleted)
        if not (root / str(STEP)).exists():
            continue  # the step is gone: Orbax no longer lists it
        left = frozenset(str(p.relative_to(root)) for p in (root / str(STEP)).rglob("*"))
        if left in seen:
            continue
        seen.add(left)
        states += 1
        problems = _judge(root, restore_args, capsys)
        if problems:
            wrong[name] = problems
    assert states > 1
    assert not wrong, json.dumps(wrong, indent=1)


def test_a_complete_step_verifies_and_a_half_deleted_one_names_what_is_missing(
    roots: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The messages: each missing part by its path in the step, in verify and inspect."""
    for config, src in roots.items():
        assert osf.verify(src).ok, (config, osf.verify(src).problems)
        assert _completeness.missing_entries(src / str(STEP)) == []
    src = roots["ours+standard"]
    native = src / str(STEP) / "native"
    value_files = sorted(
        str(p.relative_to(src / str(STEP))) for p in (native / "ocdbt.process_0" / "d").iterdir()
    )
    cases = {
        "_CHECKPOINT_METADATA": ["_CHECKPOINT_METADATA"],
        "native/_sharding": ["native/_sharding"],
        "native/manifest.ocdbt": ["native/manifest.ocdbt"],
        "ours/model.safetensors": ["ours/model.safetensors"],
    }
    for deleted, missing in cases.items():
        root = tmp_path / deleted.replace("/", "-") / "run"
        shutil.copytree(src, root)
        _delete(root / str(STEP), [deleted])
        assert _completeness.missing_entries(root / str(STEP)) == missing, deleted
        report = osf.verify(root)
        assert report.problems == [
            f"{root / str(STEP)}: incomplete step, missing {', '.join(missing)} (Orbax lists "
            "this step but cannot restore it)"
        ]
    # The data file that holds the values of "w" (the others hold B+tree nodes of the
    # per-process database, which the merged manifest does not reference).
    needed = []
    for f in value_files:
        root = tmp_path / f.replace("/", "-") / "run"
        shutil.copytree(src, root)
        _delete(root / str(STEP), [f])
        if _restore_error(root, CONFIGS["ours+standard"][1]) is not None:
            needed.append(f)
            assert _completeness.missing_entries(root / str(STEP)) == [f]
        else:
            assert _completeness.missing_entries(root / str(STEP)) == []
    assert needed, value_files


def test_a_forged_chunk_grid_is_counted_not_enumerated(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    """The chunk files a zarr array lacks are found from its metadata's grid: one that claims
    far more chunks than the directory could hold is counted, never listed chunk by chunk."""
    root = tmp_path / "run"
    shutil.copytree(roots["ours+zarr"], root)
    step = root / str(STEP)
    meta_path = step / "native" / "w" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = [2**40, 64]
    meta_path.write_text(json.dumps(meta))
    rows, cols = meta["chunk_grid"]["configuration"]["chunk_shape"]
    expected = -(-(2**40) // rows) * -(-64 // cols)
    chunks = len([p for p in (step / "native" / "w").rglob("*") if p.is_file()]) - 1
    assert chunks > 1  # the array is stored in several chunks
    [entry] = _completeness.missing_entries(step)
    assert entry == f"{expected - chunks} of the {expected} chunk files of native/w/"


def test_verify_and_inspect_judge_a_forged_claim_without_reading_it(
    roots: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify`` and ``inspect`` of a root whose Orbax-native array claims 2**40 rows (issue
    46, class 4): they read no array of an Orbax-native item; the claim's chunk files are
    counted (not listed, not read, nothing the claim sizes allocated), the step reported
    incomplete (exit status 1; ``inspect``: INCOMPLETE, exit 0). ``verify`` of the forged item
    named on its own refuses it: an Orbax-native item records no checksums (exit status 2)."""
    root = tmp_path / "run"
    shutil.copytree(roots["ours+zarr"], root)
    item = root / str(STEP) / "native"
    meta = json.loads((item / "w" / "zarr.json").read_text())
    meta["shape"] = [2**40, 64]
    (item / "w" / "zarr.json").write_text(json.dumps(meta))
    report = osf.verify(root)  # (imports and caches outside the measure)
    peak = traced_memory.traced_peak(lambda: osf.verify(root))
    assert peak < 8 << 20, peak
    assert report.incomplete == [str(root / str(STEP))], report.problems
    assert any("chunk files of native/w/" in p for p in report.problems), report.problems
    code, out, _ = _cli(capsys, "verify", root)
    assert code == 1 and "DAMAGED" in out and "chunk files of native/w/" in out, out
    code, out, _ = _cli(capsys, "inspect", root)
    assert code == 0 and any(
        line.split()[:1] == [str(STEP)] and line.endswith("INCOMPLETE") for line in out.splitlines()
    ), out
    code, out, err = _cli(capsys, "verify", item)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Orbax" in lines[0], (code, out, err)


# --------------------------------------------------------------------------- the other readers

# Each reader of a step's tensors, given step 1 of the root (the path a user names): how it
# is called and, for the command line, its argv ((root, step, out) -> argv).
_MAPPING = osf.KeyMapping([osf.Rule("{k:.*}", "{k}")])  # every name as it is
_MAPPING_MODULE = "half_deleted_names"
_CLI_READERS: dict[str, Callable[[Path, Path, Path], list[Any]]] = {
    "diff": lambda root, step, out: ["diff", step, root / str(STEP + 1)],
    "export": lambda root, step, out: [
        *("export", root, out, "--step", STEP, "--item", "ours"),
        *("--mapping", f"{_MAPPING_MODULE}:mapping"),
    ],
    "convert": lambda root, step, out: ["convert", "-q", step, out],
}
_API_READERS: dict[str, Callable[[Path, Path], Any]] = {
    "osf.convert": lambda step, out: osf.convert(step, out, progress=False),
    "osf.export_pytorch": lambda step, out: osf.export_pytorch(step, out, _MAPPING, item="ours"),
    "osf.load_pytorch": lambda step, out: osf.load_pytorch(None, step, _MAPPING),
}


@pytest.mark.parametrize(
    "deleted",
    [
        "_CHECKPOINT_METADATA",
        "ours/model.safetensors",
        "ours/orbax_safetensors.json",
        "native/manifest.ocdbt",
        "native",
    ],
)
def test_every_reader_of_a_step_refuses_a_half_deleted_one(
    deleted: str,
    roots: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``diff``, ``export``, ``convert`` (command line and API) and ``load_pytorch`` of a step
    Orbax lists with a part gone (one state of each kind: the step's metadata, a file of this
    library's item, an Orbax item's manifest, a whole item) refuse it, as restore does and as
    ``verify`` reports it: one ``error:`` line naming the step and what it lacks, exit status
    2, nothing written. They ask the judgement the exhaustive test above holds to restore
    (``orbax/completeness.refuse_incomplete``, through ``catalog/sources.open_source``)."""
    root = tmp_path / "run"
    shutil.copytree(roots["ours+standard"], root, copy_function=os.link)
    step = root / str(STEP)
    _delete(step, [deleted])
    # The reference: restore fails (without _CHECKPOINT_METADATA, Orbax may still restore the
    # items left; the step is being deleted all the same, and verify reports it so).
    failed = _restore_error(root, CONFIGS["ours+standard"][1])
    assert failed is not None or deleted == "_CHECKPOINT_METADATA"
    assert str(step) in osf.verify(root).incomplete
    expected = f"{step}: incomplete step, missing {deleted}{'/' if deleted == 'native' else ''}"
    (tmp_path / f"{_MAPPING_MODULE}.py").write_text(
        "import orbax_safetensors as osf\nmapping = osf.KeyMapping([osf.Rule('{k:.*}', '{k}')])\n"
    )
    monkeypatch.chdir(tmp_path)  # (export --mapping imports the module from here)
    monkeypatch.syspath_prepend(str(tmp_path))
    wrong = {}
    for verb, argv in _CLI_READERS.items():
        out = tmp_path / verb / "deep" / "out"
        code, stdout, err = _cli(capsys, *argv(root, step, out))
        lines = err.strip().splitlines()
        if not (
            code == 2
            and len(lines) == 1
            and lines[0].startswith(f"orbax-safetensors {verb}: error: {expected}")
            and not (tmp_path / verb).exists()
        ):
            wrong[verb] = f"exit {code}: {stdout[-200:]} {err[-300:]}"
    for verb, call in _API_READERS.items():
        out = tmp_path / verb / "deep" / "out"
        try:
            call(step, out)
        except osf.SafetensorsCheckpointError as e:
            if not str(e).startswith(expected) or (tmp_path / verb).exists():
                wrong[verb] = str(e)[:300]
        else:
            wrong[verb] = "read it"
    assert not wrong, json.dumps(wrong, indent=1)


@pytest.mark.parametrize(
    "tree", [{"name": "run-ü", "note": None}, {"a": None, "b": {}}], ids=["strings", "no leaves"]
)
def test_an_orbax_item_without_arrays_is_complete(
    tree: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An Orbax item holding no array (strings, None, empty containers) has no OCDBT or zarr
    files; Orbax restores it, and no tool calls it incomplete (convert writes such items)."""
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(STEP, args=ocp.args.PyTreeSave(tree))
        mngr.wait_until_finished()
        want = mngr.restore(STEP, args=ocp.args.PyTreeRestore())
    step = root / str(STEP)
    assert _completeness.missing_entries(step) == []
    assert [s["status"] for s in inspection.inspect_path(root)["steps"]] == ["ok"]
    code, out, err = _cli(capsys, "inspect", step)
    assert code == 0 and "INCOMPLETE" not in out, out + err
    code, _, err = _cli(capsys, "convert", root, tmp_path / "converted", "-q")
    assert code == 0, err
    assert osf.restore_directory(tmp_path / "converted" / str(STEP) / "default") == want
    if "name" in tree:  # what it does need is still required
        (step / "default" / "_strings.json").unlink()
        assert _completeness.missing_entries(step) == ["default/_strings.json"]
