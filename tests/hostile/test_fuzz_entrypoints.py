"""Fuzzing the Flax msgpack reader and the command line with hypothesis, time-bounded.

Mutated valid Flax msgpack files, random msgpack values and random bytes go to the msgpack
decoder (only ``FlaxMsgpackError`` may escape, whatever decodes is a dict of arrays, scalars,
strings and dicts); mutated safetensors and msgpack files go to ``inspect``, ``verify``,
``diff`` and ``convert`` through ``cli.main`` (status 0, 1 or 2, one ``error:`` line with 2,
never an escaping exception). The budget is a share of ``OSF_FUZZ_SECONDS`` (default 24 s).
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbax_safetensors._src.catalog import flax_msgpack
from orbax_safetensors._src.tools import cli

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import corpus, fuzzing, msgpack_corpus
except ImportError:  # tests/ became a package
    from tests.hostile import corpus, fuzzing, msgpack_corpus

pytestmark = pytest.mark.timeout(int(fuzzing.BUDGET * 3) + 180)
_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True
)


@st.composite
def _mutated(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            data = bytearray(b"\x80")
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.sampled_from([0, 0x7F, 0x80, 0xC1, 0xD6, 0xDF, 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        else:
            del data[pos:]
    return bytes(data)


_MSGPACK = msgpack_corpus.valid()
_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=12),
        st.builds(msgpack.ExtType, st.integers(0, 5), st.binary(max_size=24)),
        st.builds(
            msgpack_corpus.ndarray,
            st.lists(st.integers(0, 2**64 - 1), max_size=3),
            st.sampled_from(["float32", "int8", "bool", "object", "V4", ""]),
            st.binary(max_size=16),
        ),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c, max_size=3)
    ),
    max_leaves=10,
)


def _decode(raw: bytes) -> None:
    try:
        tree = flax_msgpack.decode(raw, where="fuzz")
    except flax_msgpack.FlaxMsgpackError:
        return
    allowed: tuple[type, ...] = (np.ndarray, np.generic, int, float, complex, str, bytes, list)
    for name, leaf in flax_msgpack.flatten(tree).items():
        assert isinstance(name, str)
        assert leaf is None or isinstance(leaf, allowed), (name, type(leaf))
        if isinstance(leaf, np.ndarray):
            assert leaf.nbytes <= len(raw), (name, leaf.shape)


@_SETTINGS
@given(_mutated(_MSGPACK))
def _mutated_msgpack(raw: bytes) -> None:
    _decode(raw)


@_SETTINGS
@given(st.dictionaries(st.text(max_size=4), _values, min_size=1, max_size=4))
def _random_msgpack(value: dict[str, Any]) -> None:
    _decode(msgpack.packb(value, use_bin_type=True))


@_SETTINGS
@given(st.binary(max_size=200))
def _random_bytes(raw: bytes) -> None:
    _decode(b"\x81\xa1a" + raw)


def test_fuzz_flax_msgpack_reader() -> None:
    _decode(_MSGPACK)
    runs = fuzzing.run_for(0.15, _mutated_msgpack)
    runs += fuzzing.run_for(0.15, _random_msgpack)
    runs += fuzzing.run_for(0.1, _random_bytes)
    assert runs >= 3


def _cli(argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    assert status in (0, 1, 2), (argv, status)
    if status == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and f"orbax-safetensors {argv[0]}: error: " in lines[0], lines


_SAFETENSORS = corpus.base_file_bytes()


@settings(_SETTINGS, max_examples=15)
@given(
    st.one_of(_mutated(_SAFETENSORS), _mutated(_MSGPACK)),
    st.sampled_from(["inspect", "verify", "diff", "convert"]),
)
def _mutated_through_the_cli(raw: bytes, command: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("model.safetensors" if raw[8:9] == b"{" else "checkpoint_3")
        path.write_bytes(raw)
        base = Path(d) / "base.safetensors"
        base.write_bytes(_SAFETENSORS)
        argv = {
            "inspect": ["inspect", str(path)],
            "verify": ["verify", str(path)],
            "diff": ["diff", str(base), str(path)],
            "convert": ["convert", "-q", str(path), str(Path(d) / "out")],
        }[command]
        _cli(argv)


def test_fuzz_the_command_line() -> None:
    runs = fuzzing.run_for(0.2, _mutated_through_the_cli)
    assert runs >= 1
