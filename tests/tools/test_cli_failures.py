"""``diff`` compares bitwise unless a tolerance is given, and every command-line failure is one
``error:`` line with exit status 2, never a traceback (issue 25, points 3 and 7)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import ml_dtypes
import msgpack
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.tools import diff as _diff
from orbax_safetensors._src.tools import inspection as _inspection


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, command: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"orbax-safetensors {command}: error: "), err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- diff: bitwise

PAIRS = {
    "int64 beyond float64": (np.array([2**53], np.int64), np.array([2**53 + 1], np.int64), 1),
    "uint64 top": (
        np.array([2**64 - 1], np.uint64),
        np.array([2**64 - 2], np.uint64),
        1,
    ),
    "int64 extremes": (
        np.array([np.iinfo(np.int64).min], np.int64),
        np.array([np.iinfo(np.int64).max], np.int64),
        2**64 - 1,
    ),
    "int8 wrap": (np.array([-128], np.int8), np.array([127], np.int8), 255),
    "bool": (np.array([True, False]), np.array([True, True]), 1),
    "negative zero": (np.array([0.0], np.float32), np.array([-0.0], np.float32), 0),
    "negative zero bf16": (
        np.array([0.0], ml_dtypes.bfloat16),
        np.array([-0.0], ml_dtypes.bfloat16),
        0,
    ),
    "NaN payloads": (
        np.array([0x7FC00000], np.uint32).view(np.float32),
        np.array([0x7FC00001], np.uint32).view(np.float32),
        0,
    ),
    "complex negative zero": (
        np.array([1 + 0j], np.complex64),
        np.array([complex(1, -0.0)], np.complex64),
        0,
    ),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_diff_tells_apart_what_differs_in_bits(tmp_path, capsys, pair):
    a, b, distance = PAIRS[pair]
    osf.save_file({"x": a}, tmp_path / "a.safetensors")
    osf.save_file({"x": b}, tmp_path / "b.safetensors")
    report = _diff.diff_paths(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert not report.identical
    assert report.values == [("x", distance)]
    assert isinstance(report.values[0][1], int) == (a.dtype.kind in "iub")
    code, out, _ = run(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1 and "checkpoints differ" in out
    if distance == 0:
        assert "different bits" in out


def test_equal_bits_are_identical_nan_included(tmp_path, capsys):
    nan = np.array([np.nan, 1.0, -0.0], np.float32)
    tree = {"f": nan, "i": np.array([2**63 - 1], np.int64), "u": np.array([2**64 - 1], np.uint64)}
    osf.save_file(tree, tmp_path / "a.safetensors")
    osf.save_directory(tree, tmp_path / "b")
    code, out, _ = run(capsys, "diff", tmp_path / "a.safetensors", tmp_path / "b")
    assert code == 0 and "checkpoints are identical" in out and "3 tensors equal" in out


def test_tolerances_for_floats_integers_and_nans(tmp_path, capsys):
    a = {
        "f": np.array([1.0, 0.0, np.nan, np.inf], np.float32),
        "i": np.array([2**53, 7], np.int64),
    }
    b = {
        "f": np.array([1.001, -0.0, np.float32("nan"), np.inf], np.float32),
        "i": np.array([2**53 + 2, 7], np.int64),
    }
    b["f"][2] = np.array([0x7FC00005], np.uint32).view(np.float32)[0]  # another NaN payload
    osf.save_file(a, tmp_path / "a.safetensors")
    osf.save_file(b, tmp_path / "b.safetensors")
    paths = (tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert {n for n, _ in _diff.diff_paths(*paths).values} == {"f", "i"}
    # atol: floats within it (any NaN equal to any NaN, -0.0 equal to 0.0), integers exactly.
    report = _diff.diff_paths(*paths, atol=0.01)
    assert [n for n, _ in report.values] == ["i"] and report.differing == {"i": 1}
    assert _diff.diff_paths(*paths, atol=2).identical
    assert not _diff.diff_paths(*paths, atol=1.999).identical  # the integer bound is floor(atol)
    # rtol applies to floats only.
    report = _diff.diff_paths(*paths, rtol=1e-2)
    assert [n for n, _ in report.values] == ["i"]
    code, out, _ = run(capsys, "diff", *paths, "--rtol", "0.01", "--atol", "2")
    assert code == 0, out
    code, out, _ = run(capsys, "diff", *paths, "--atol", "0")
    assert code == 1 and "f:" in out and "i: max abs difference 2; 1 element differs" in out
    # A NaN never equals a number, whatever the tolerance; opposite infinities never agree.
    osf.save_file({"f": np.array([np.nan, np.inf])}, tmp_path / "c.safetensors")
    osf.save_file({"f": np.array([1.0, -np.inf])}, tmp_path / "d.safetensors")
    report = _diff.diff_paths(tmp_path / "c.safetensors", tmp_path / "d.safetensors", atol=1e300)
    assert report.values == [("f", np.inf)] and report.differing == {"f": 2}


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_a_bad_tolerance_is_an_error(tmp_path, capsys, bad):
    osf.save_file({"x": np.ones(2)}, tmp_path / "a.safetensors")
    code, _, err = run(
        capsys, "diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors", f"--atol={bad}"
    )
    assert code == 2
    one_error_line(err, "diff")
    with pytest.raises(SafetensorsCheckpointError, match="tolerance"):
        _diff.diff_paths(tmp_path / "a.safetensors", tmp_path / "a.safetensors", rtol=float(bad))


def test_compare_arrays_walks_large_tensors_in_chunks(monkeypatch):
    monkeypatch.setattr(_diff, "_CHUNK", 7)
    a = np.arange(100, dtype=np.int64) + 2**60
    b = a.copy()
    b[[3, 50, 99]] += np.array([1, -5, 2])
    got = _diff.compare_arrays(a, b)
    assert got == _diff.Comparison(False, 3, 5)
    assert _diff.compare_arrays(a, a).equal
    c = np.zeros(100, np.complex128)
    d = c.copy()
    d[42] = -0.0
    assert _diff.compare_arrays(c, d) == _diff.Comparison(False, 1, 0.0)


# --------------------------------------------------------------------------- one error line


def huge_zero_size_msgpack(path):
    ext = msgpack.ExtType(1, msgpack.packb([[0, 2**64 - 1], "float32", b""], use_bin_type=True))
    path.write_bytes(msgpack.packb({"params": {"w": ext}}, use_bin_type=True))
    return path


@pytest.mark.parametrize("command", ["inspect", "diff", "convert"])
def test_a_zero_size_array_with_a_huge_dimension_is_an_error(tmp_path, capsys, command):
    src = huge_zero_size_msgpack(tmp_path / "checkpoint_1")
    argv = {
        "inspect": [src],
        "diff": [src, src],
        "convert": [src, tmp_path / "out.safetensors", "-q"],
    }[command]
    code, out, err = run(capsys, command, *argv)
    assert code == 2 and out == ""
    one_error_line(err, command)
    assert "params.w" in err and "(0, 18446744073709551615)" in err
    assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(SafetensorsCheckpointError, match="beyond any array"):
        _inspection.inspect_path(src)


def test_convert_to_orbax_with_a_dtype_is_one_error_line(tmp_path, capsys):
    osf.save_directory({"w": np.ones(3, np.float32)}, tmp_path / "item")
    code, _, err = run(
        capsys, "convert", tmp_path / "item", tmp_path / "dst", "--dtype", "bfloat16"
    )
    assert code == 2
    one_error_line(err, "convert")
    assert "dtype=bfloat16: a dtype policy applies to conversions to safetensors" in err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("record", ["[1]", "{not json", '"a string"'])
@pytest.mark.parametrize("named", ["step", "root"])
def test_convert_of_a_step_whose_record_is_not_an_object_is_one_error_line(
    tmp_path, capsys, record, named
):
    import orbax.checkpoint as ocp

    root = tmp_path / "root"
    with ocp.CheckpointManager(root) as mngr:
        tree = {"w": np.ones(3, np.float32)}
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
    (root / "1" / "_CHECKPOINT_METADATA").write_text(record)
    src = root / "1" if named == "step" else root
    code, _, err = run(capsys, "convert", "-q", src, tmp_path / "dst")
    assert code == 2
    one_error_line(err, "convert")
    assert "_CHECKPOINT_METADATA: unreadable or not a JSON object" in err, err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{missing}"],
        ["verify", "{missing}"],
        ["diff", "{missing}", "{missing}"],
        ["convert", "{missing}", "{dst}"],
        ["convert", "{item}", "{item}"],  # an existing destination
        ["inspect", "{junk}"],
        ["diff", "{junk}", "{item}"],
        ["convert", "{junk}", "{dst}"],
        ["inspect", "{item}", "--include", "nothing.matches"],
        ["convert", "{item}", "{dst}", "--dtype", "notadtype"],
        ["convert", "{item}", "{dst}", "--max-file-size", "lots"],
        ["demo", "{item}", "--steps", "x"],
        ["verify"],
        ["frobnicate"],
    ],
)
def test_every_failure_is_one_error_line_and_status_2(tmp_path, capsys, argv):
    osf.save_directory({"w": np.ones(3, np.float32)}, tmp_path / "item")
    (tmp_path / "junk").write_bytes(b"\x00" * 64)
    names = {
        "missing": tmp_path / "missing",
        "dst": tmp_path / "dst",
        "item": tmp_path / "item",
        "junk": tmp_path / "junk",
    }
    argv = [a.format(**names) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def _subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return env


def test_a_closed_pipe_ends_quietly_with_status_2(tmp_path):
    """``inspect ... | head``: no traceback, no error line (the reader went away on purpose),
    exit status 2."""
    osf.save_directory({f"t{i:04d}": np.zeros(2) for i in range(4000)}, tmp_path / "item")
    command = [sys.executable, "-m", "orbax_safetensors.cli", "inspect", str(tmp_path / "item")]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_subprocess_env()
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # as `head -1` exits
        err = proc.stderr.read().decode()
        status = proc.wait(timeout=120)
    assert first.startswith(str(tmp_path / "item").encode())
    assert err == "" and status == 2


def test_a_damaged_orbax_item_is_one_error_line(tmp_path):
    """Orbax logs a warning (absl) and tensorstore may report a callback into a closed event
    loop (an unraisable exception) while a damaged item fails: the command still prints only
    its own line."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "orbax", {"a": jnp.ones(4), "b": jnp.zeros(3)})
    ckptr.wait_until_finished()
    for chunk in (tmp_path / "orbax" / "d").iterdir():
        chunk.write_bytes(os.urandom(50))
    (tmp_path / "shape").mkdir()
    for f in (tmp_path / "orbax").iterdir():
        if f.is_file():
            (tmp_path / "shape" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "shape" / "_METADATA").write_text('{"tree_metadata": 5}')
    for argv in (
        ["convert", tmp_path / "orbax", tmp_path / "out", "-q"],
        ["diff", tmp_path / "orbax", tmp_path / "orbax"],
        ["inspect", tmp_path / "shape"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "orbax_safetensors.cli", *map(str, argv)],
            capture_output=True,
            text=True,
            env=_subprocess_env(),
            timeout=300,
        )
        assert done.returncode == 2, done.stderr
        one_error_line(done.stderr, argv[0])
        if argv[0] == "inspect":
            assert "Orbax cannot read this item's metadata" in done.stderr
        else:  # the file cut short is named, not _METADATA
            assert re.search(r"OCDBT data file d/\w+ holds 50 bytes", done.stderr), done.stderr
