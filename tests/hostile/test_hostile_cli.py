"""Hostile inputs through every entry point: the command line and the Flax msgpack reader.

Every case of the safetensors corpus (``tests/hostile/corpus.py``) and of the msgpack corpus
(``tests/hostile/msgpack_corpus.py``) goes through ``inspect``, ``verify``, ``diff`` and
``convert`` (``cli.main`` in this process, bounded in memory by the input's real size); a
sample goes through the real ``python -m orbax_safetensors.cli`` as subprocesses with a
timeout. A documented outcome only: exit status 2 with one ``error:`` line on stderr (``verify``
of a checkpoint whose bytes are damaged: status 1 and the problem listed; of a file whose header
cannot be read: status 2, it is no checkpoint), never an escaping exception (a traceback), a
hang, or an allocation beyond the file's size. The msgpack reader raises ``FlaxMsgpackError`` only.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import traced_memory

import orbax_safetensors as osf
from orbax_safetensors._src.catalog import flax_msgpack
from orbax_safetensors._src.tools import cli

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import corpus, msgpack_corpus
except ImportError:  # tests/ became a package
    from tests.hostile import corpus, msgpack_corpus

pytestmark = pytest.mark.timeout(300)

_SLACK = 16 << 20  # fixed allowance: imports, messages, fixed-size read buffers
CASES = corpus.all_cases()
MSGPACK = msgpack_corpus.cases()
# The command line's own layer (exit status, one error line, nothing written) over readers that
# tests/hostile/test_hostile.py (every entry point) and test_msgpack_reader_refuses_forged_files
# run every case through on every stack.
_CLI_LAYER = pytest.mark.main_env_only("the command line's layer over the readers")


def _msgpack_param(case: msgpack_corpus.Case) -> object:
    return pytest.param(case, id=case.name)


@pytest.fixture(scope="module", autouse=True)
def _warm_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    # JAX, the corpus bases and every command's imports, outside the measured regions.
    jax.devices()
    tmp = tmp_path_factory.mktemp("warm")
    base = tmp / "base.safetensors"
    base.write_bytes(corpus.base_file_bytes())
    good = tmp / "good_7"
    good.write_bytes(msgpack_corpus.valid())
    for path in (base, corpus.base_dir(), good):
        for argv in [*_commands(path, tmp, base), ["verify", str(path)]]:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                cli.main(argv)


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_cli(argv: list[str], budget_of: Path) -> tuple[int, str, str]:
    """``cli.main(argv)`` in this process: (status, stdout, stderr); its peak traced memory
    stays within the input's real size (plus a fixed allowance)."""
    out, err = io.StringIO(), io.StringIO()
    status: list[int] = []

    def call() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status.append(cli.main(argv))
            except SystemExit as e:  # argparse
                status.append(int(e.code or 0))

    peak = traced_memory.traced_peak(call)
    assert peak <= _SLACK + 16 * _size(budget_of), f"{argv}: peak {peak} bytes"
    return status[0], out.getvalue(), err.getvalue()


def assert_error(argv: list[str], status: int, err: str) -> None:
    """Exit status 2 and exactly one line on stderr, ``orbax-safetensors CMD: error: ...``."""
    assert status == 2, (argv, status, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"orbax-safetensors {argv[0]}: error: ", lines[0]), err


def _commands(path: Path, tmp_path: Path, base: Path) -> list[list[str]]:
    return [
        ["inspect", str(path)],
        ["inspect", "--json", str(path)],
        ["diff", str(base), str(path)],
        ["convert", "-q", str(path), str(tmp_path / "converted")],
    ]


@_CLI_LAYER
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_safetensors_corpus_through_the_cli(case: corpus.Case, tmp_path: Path) -> None:
    path = case.build(tmp_path / re.sub(r"\W", "_", case.name))
    base = tmp_path / "base.safetensors"
    base.write_bytes(corpus.base_file_bytes())
    for argv in _commands(path, tmp_path, base):
        status, _, err = run_cli(argv, path)
        if status == 2 or case.kind == "header":
            assert_error(argv, status, err)
            assert not (tmp_path / "converted").exists()
        else:  # forged schema or metadata a command does not read: listed, compared or copied
            assert status in (0, 1) and not err.strip(), (argv, status, err)
    status, out, err = run_cli(["verify", str(path)], path)
    if case.kind == "header":  # a file on its own whose header cannot be read: not a checkpoint
        assert_error(["verify"], status, err)
    else:
        assert status == 1 and "DAMAGED" in out and not err.strip(), (status, out, err)


@pytest.mark.parametrize("case", [_msgpack_param(c) for c in MSGPACK])
def test_msgpack_reader_refuses_forged_files(case: msgpack_corpus.Case, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_5"
    path.write_bytes(case.data)

    def read() -> None:
        with pytest.raises(flax_msgpack.FlaxMsgpackError, match=case.match) as info:
            flax_msgpack.read_file(path)
        assert isinstance(info.value, osf.SafetensorsCheckpointError)
        assert str(path) in str(info.value)

    assert traced_memory.traced_peak(read) <= _SLACK + 16 * len(case.data)


@_CLI_LAYER
@pytest.mark.parametrize("case", [_msgpack_param(c) for c in MSGPACK])
def test_msgpack_corpus_through_the_cli(case: msgpack_corpus.Case, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_5"
    path.write_bytes(case.data)
    good = tmp_path / "good_7"
    good.write_bytes(msgpack_corpus.valid())
    for argv in _commands(path, tmp_path, good):
        status, _, err = run_cli(argv, path)
        assert_error(argv, status, err)
    status, _, err = run_cli(["verify", str(path)], path)
    assert_error(["verify"], status, err)  # not a safetensors file: nothing to verify
    assert not (tmp_path / "converted").exists()


# --------------------------------------------------------------------------- real processes


def _spawn(argv: list[str], **kw: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    options: dict[str, object] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    options.update(kw)
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-m", "orbax_safetensors.cli", *argv], text=True, env=env, **options
    )


@_CLI_LAYER
def test_the_real_command_line_on_hostile_files(tmp_path: Path) -> None:
    """A sample, as subprocesses at once: one error line, status 2 (verify: 1), no traceback."""
    by_name = {c.name: c for c in CASES}
    header = by_name["length-2**63"].build(tmp_path / "h")
    directory = by_name["dir-file-dotdot-path"].build(tmp_path / "d")
    flipped = by_name["dir-model-bit-flip"].build(tmp_path / "f")
    forged = tmp_path / "checkpoint_5"
    forged.write_bytes(next(c for c in MSGPACK if c.name == "huge-dims").data)
    runs = [
        (["inspect", str(header)], 2),
        (["diff", str(header), str(forged)], 2),
        (["convert", "-q", str(forged), str(tmp_path / "out")], 2),
        (["inspect", str(directory)], 2),
        (["verify", str(flipped)], 1),
    ]
    procs = [(argv, want, _spawn(argv)) for argv, want in runs]
    for argv, want, proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == want, (argv, proc.returncode, err)
        assert "Traceback" not in err, err
        if want == 2:
            assert_error(argv, proc.returncode, err)
        else:
            assert "DAMAGED" in out and not err.strip(), (out, err)


def test_zero_size_msgpack_array_with_a_huge_dimension(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_5"
    path.write_bytes(next(c for c in MSGPACK if c.name == "zero-size-huge-dim").data)
    proc = _spawn(["inspect", str(path)])
    _, err = proc.communicate(timeout=240)
    assert_error(["inspect"], proc.returncode, err)


def test_convert_dtype_of_a_safetensors_source_is_an_error_line(tmp_path: Path) -> None:
    src = tmp_path / "item"
    osf.save_directory({"w": jax.numpy.ones(3)}, src)
    argv = ["convert", "-q", str(src), str(tmp_path / "dst"), "--dtype", "bfloat16"]
    status, _, err = run_cli(argv, src)
    assert_error(argv, status, err)


def test_inspect_into_a_closed_pipe(tmp_path: Path) -> None:
    path = tmp_path / "many.safetensors"
    osf.save_file({f"t{i}": jax.numpy.ones(1) for i in range(3000)}, path)
    reader, writer = os.pipe()
    os.close(reader)  # like `| head` that has exited
    proc = _spawn(["inspect", str(path)], stdout=writer)
    os.close(writer)
    _, err = proc.communicate(timeout=240)
    assert "Traceback" not in err, err
    # A reader that left is no failure of the checkpoint: silence (the shell's 141) or one line.
    assert proc.returncode in (0, 2, 141, -13), (proc.returncode, err)
    assert len(err.strip().splitlines()) <= 1, err
