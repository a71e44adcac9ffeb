"""Input that is not a checkpoint is bad input for every subcommand (issue 40, point 4): exit
status 2 and exactly one line, ``orbax-safetensors COMMAND: error: ...``, one wording per
situation, unknown flags included. ``DAMAGED`` and exit status 1 only for a checkpoint of this
library whose bytes are bad.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.core.errors import Mismatch, MismatchKind
from orbax_safetensors._src.pipeline.restore_options import Words, mismatch_message
from orbax_safetensors._src.tools import cli

COMMANDS = ("inspect", "verify", "diff", "convert", "export")


def run(argv: list[object]) -> tuple[int, str, str]:
    """``cli.main`` in this process: (exit status, stdout, stderr); argparse's exits too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # the argument parser's usage errors
            code = int(e.code or 0)
    return code, out.getvalue(), err.getvalue()


def assert_one_error_line(command: str, code: int, out: str, err: str, wording: str) -> None:
    """Status 2, nothing on stdout, one line on stderr: the command's prefix, then ``wording``
    (a regular expression for the rest of the line)."""
    assert code == 2, (code, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(rf"orbax-safetensors {command}: error: {wording}", lines[0]), lines[0]


def _tree() -> dict[str, object]:
    return {"params": {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)}}


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of bad input, and a good file and a damaged checkpoint, built once."""
    base = tmp_path_factory.mktemp("bad-input")
    osf.save_file(_tree(), base / "good.safetensors")
    good = (base / "good.safetensors").read_bytes()
    (base / "empty").mkdir()
    (base / "notes").mkdir()
    (base / "notes" / "readme.txt").write_text("not a checkpoint")
    with ocp.CheckpointManager(base / "root") as mngr:
        args = ocp.args.Composite(
            state=osf.SafetensorsSave(_tree()), meta=ocp.args.JsonSave({"step": 1})
        )
        mngr.save(1, args=args)
        mngr.wait_until_finished()
    json_checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    json_checkpointer.save(base / "json", {"lr": 0.1})
    standard = ocp.StandardCheckpointer()
    standard.save(base / "orbax", {"w": np.ones(3, np.float32)})
    standard.wait_until_finished()
    (base / "truncated.safetensors").write_bytes(good[:50])
    (base / "cut.safetensors").write_bytes(good[:-8])
    (base / "forged.safetensors").write_bytes((2**63).to_bytes(8, "little") + good[8:])
    (base / "pickled.safetensors").write_bytes(b"\x80\x04\x95" + bytes(64))
    osf.save_directory(_tree(), base / "damaged")
    with open(base / "damaged" / "model.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"bad")
    damaged_file = bytearray(good)
    damaged_file[-1] ^= 0xFF
    (base / "damaged.safetensors").write_bytes(bytes(damaged_file))
    return base


# Each situation: the path, relative to the fixture, and the wording after ``PATH: ``.
BAD_INPUT = {
    "missing path": ("missing", "no such file or directory"),
    "empty directory": ("empty", "not a checkpoint: an empty directory"),
    "another kind of directory": (
        "notes",
        "not a checkpoint: no safetensors file, checkpoint item, Orbax item or step in this "
        "directory",
    ),
    "Orbax JsonSave item of a step": (
        "root/1/meta",
        "an Orbax item written by JsonCheckpointHandler, not a checkpoint of tensors",
    ),
    "Orbax JSON checkpoint of one item": (
        "json",
        "an Orbax item written by JsonCheckpointHandler, not a checkpoint of tensors",
    ),
    "file truncated in its header": (
        "truncated.safetensors",
        r"header length \d+ runs past the end of the 50-byte file",
    ),
    "file truncated in its data": (
        "cut.safetensors",
        r"tensor 'params\.\w' ends at \d+, past the \d+-byte data section",
    ),
    "forged header length": (
        "forged.safetensors",
        r"header length 9223372036854775808 exceeds the \d+ byte cap",
    ),
    "another format": ("pickled.safetensors", r"not a safetensors file; it looks like .*"),
}


def _argv(command: str, path: Path, where: Path) -> list[object]:
    return {
        "inspect": ["inspect", path],
        "verify": ["verify", path],
        "diff": ["diff", path, where / "good.safetensors"],
        "convert": ["convert", path, where / "out", "-q"],
        "export": ["export", path, where / "hf", "--mapping", "llama"],
    }[command]


@pytest.mark.parametrize("situation", sorted(BAD_INPUT))
@pytest.mark.parametrize("command", COMMANDS)
def test_input_that_is_not_a_checkpoint_is_bad_input(
    where: Path, command: str, situation: str
) -> None:
    relative, wording = BAD_INPUT[situation]
    path = where / relative
    code, out, err = run(_argv(command, path, where))
    assert_one_error_line(command, code, out, err, f"{re.escape(str(path))}: {wording}")
    assert not (where / "out").exists() and not (where / "hf").exists()


def test_an_orbax_native_item_is_bad_input_for_verify(where: Path) -> None:
    """inspect, diff and convert read an Orbax-native item; verify has no checksums to check."""
    path = where / "orbax"
    code, out, err = run(["verify", path])
    wording = (
        f"{re.escape(str(path))}: an Orbax item written by StandardCheckpointHandler, which "
        "verify cannot check: an Orbax-native checkpoint records no checksums. .*"
        "orbax-safetensors convert .*"
    )
    assert_one_error_line("verify", code, out, err, wording)
    assert run(["inspect", path])[0] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{good}", "--jsn"],
        ["verify", "--jsn", "{good}"],
        ["diff", "{good}", "{good}", "--jsn"],
        ["convert", "{good}", "{out}", "--jsn"],
        ["export", "{good}", "{out}", "--mapping", "llama", "--jsn"],
        ["demo", "{out}", "--jsn"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_unknown_flag_names_the_subcommand(where: Path, argv: list[str]) -> None:
    names = {"good": where / "good.safetensors", "out": where / "out"}
    code, out, err = run([a.format(**names) for a in argv])
    wording = r"unrecognized arguments: --jsn \(see orbax-safetensors \w+ --help\)"
    assert_one_error_line(argv[0], code, out, err, wording)


@pytest.mark.parametrize("relative", ["damaged", "damaged.safetensors"])
def test_damaged_only_for_a_checkpoint_whose_bytes_are_bad(where: Path, relative: str) -> None:
    code, out, err = run(["verify", where / relative])
    assert code == 1 and err == "", (code, out, err)
    lines = out.splitlines()
    assert lines[0] == f"{where / relative}: DAMAGED (1 problem)", out
    assert "CRC32C mismatch" in lines[1] and "the bytes are damaged" in lines[1], out
    code, out, _ = run(["verify", where / "good.safetensors"])
    assert (
        code == 0
        and out == f"{where / 'good.safetensors'}: OK (1 file, 2 tensors, 80 bytes checked)\n"
    )


def test_the_real_command_line_prints_one_line(where: Path) -> None:
    """As a user runs it (the interpreter's own exit, argparse's included)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv, wording in (
        (["verify", str(where / "empty")], "not a checkpoint: an empty directory"),
        (["inspect", str(where / "good.safetensors"), "--jsn"], "unrecognized arguments: --jsn"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "orbax_safetensors.cli", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 2 and done.stdout == "", done
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"orbax-safetensors {argv[0]}: error: ") and wording in line


# --------------------------------------------------------------------------- one line


def test_a_mapping_that_leaves_keys_is_one_readable_line(where: Path) -> None:
    mapping = osf.KeyMapping([osf.Rule("fc.weight", "params.x")])
    with pytest.raises(osf.TargetMismatchError) as info:
        osf.export_pytorch(where / "good.safetensors", where / "hf", mapping)
    assert str(info.value) == (
        f"cannot export to {where / 'hf'} through this mapping:\n"
        "no rule maps these keys (2):\n  params.w\n  params.b"
    )
    code, out, err = run(["export", where / "good.safetensors", where / "hf", "--mapping", "llama"])
    wording = (
        f"cannot export to {re.escape(str(where / 'hf'))} through this mapping: no rule maps "
        r"these keys \(2\): params\.w, params\.b"
    )
    assert_one_error_line("export", code, out, err, wording)


def test_one_line_joins_lists_readably() -> None:
    text = "cannot export:\nno rule maps these keys (2):\n  a.w\n  a.b\nshapes that do not fit (1):\n  x"
    assert cli.one_line(text) == (
        "cannot export: no rule maps these keys (2): a.w, a.b; shapes that do not fit (1): x"
    )
    mismatches = [
        Mismatch("a", MismatchKind.MISSING),
        Mismatch("b", MismatchKind.MISSING),
        Mismatch("c", MismatchKind.UNEXPECTED),
    ]
    assert cli.one_line(mismatch_message(mismatches, Words())) == (
        "the checkpoint does not match the restore target: missing from the checkpoint (2): "
        "a, b; in the checkpoint but not the target (1): c"
    )
    many = "keys (25):\n" + "\n".join(f"  k{i}" for i in range(25))
    assert cli.one_line(many) == "keys (25): " + ", ".join(f"k{i}" for i in range(10)) + (
        ", and 15 more"
    )
    assert cli.one_line("one sentence") == "one sentence"
