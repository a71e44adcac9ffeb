"""Forged and damaged files: every case raises a clear ValueError subclass, with bounded memory.

The corpus (``tests/hostile/corpus.py``) is generated in code from valid files. Each case goes
through every entry point that reads it: ``read_header``, ``load_file``, ``restore_directory``
and ``verify``. Peak Python-visible memory (tracemalloc, which numpy reports to) must stay
bounded by the case's real size: nothing may be allocated from a claimed length.
"""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import orbax_safetensors as osf
from orbax_safetensors._src.pipeline import standalone as _standalone

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from hostile import corpus
except ImportError:  # tests/ became a package
    from tests.hostile import corpus

pytestmark = pytest.mark.timeout(120)

CASES = corpus.all_cases()
HEADER = [c for c in CASES if c.kind == "header"]
SCHEMA = [c for c in CASES if c.kind == "schema"]
DIRS = [c for c in CASES if c.kind == "dir"]
_SLACK = 8 << 20  # fixed allowance: Python objects, error messages, small buffers


@pytest.fixture(scope="module", autouse=True)
def _warm_up() -> None:
    # JAX's backend and the corpus bases are set up once, outside the measured regions.
    jax.devices()
    corpus.base_file_bytes()
    corpus.base_dir()


def _real_size(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _bounded(fn: Callable[[], Any], path: Path) -> Any:
    """Runs ``fn`` and checks its peak traced memory against the input's real size."""
    tracemalloc.start()
    try:
        return fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        limit = _SLACK + 16 * _real_size(path)
        assert peak <= limit, f"peak {peak} bytes for a {_real_size(path)}-byte input"


def _raises(case: corpus.Case, fn: Callable[[], Any], path: Path) -> None:
    with pytest.raises(case.error, match=case.match) as info:
        _bounded(fn, path)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, osf.SafetensorsCheckpointError)


def _build(case: corpus.Case, tmp_path: Path) -> Path:
    return case.build(tmp_path / re.sub(r"\W", "_", case.name))


def test_corpus_covers_the_issue() -> None:
    names = {c.name for c in CASES}
    assert len(names) == len(CASES), "case names must be unique"
    assert len(HEADER) >= 20 and len(SCHEMA) >= 20 and len(DIRS) >= 20
    for must in [
        "empty-file", "tiny-file", "length-0", "length-past-end", "length-2**63",
        "length-above-cap", "invalid-utf8", "invalid-json", "json-array", "deep-arrays-100k",
        "duplicate-tensor", "offsets-overlap", "offsets-hole", "offsets-out-of-bounds",
        "offsets-negative", "offsets-float", "dtype-unknown", "shape-negative", "shape-float",
        "shape-2**62-squared", "bytes-mismatch", "metadata-int-value", "truncated-data",
        "schema-garbage-json", "schema-version-99", "alias-nowhere", "alias-cycle",
        "kind-unknown", "colliding-names", "dir-file-dotdot-path", "dir-file-subdir",
        "dir-shape-mismatch",
    ]:  # fmt: skip
        assert must in names


@pytest.mark.parametrize("case", HEADER, ids=lambda c: c.name)
def test_hostile_header(case: corpus.Case, tmp_path: Path) -> None:
    path = _build(case, tmp_path)
    _raises(case, lambda: osf.read_header(path), path)
    _raises(case, lambda: osf.load_file(path), path)
    _raises(case, lambda: osf.load_metadata(path), path)


@pytest.mark.parametrize("case", SCHEMA, ids=lambda c: c.name)
def test_hostile_schema(case: corpus.Case, tmp_path: Path) -> None:
    path = _build(case, tmp_path)
    osf.read_header(path)  # the safetensors layer is intact: other readers can use the file
    _raises(case, lambda: osf.load_file(path), path)


@pytest.mark.parametrize("case", DIRS, ids=lambda c: c.name)
def test_hostile_directory(case: corpus.Case, tmp_path: Path) -> None:
    path = _build(case, tmp_path)
    _raises(case, lambda: _standalone.restore_checkpoint(path), path)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_verify_reports_each_case(case: corpus.Case, tmp_path: Path) -> None:
    path = _build(case, tmp_path)
    if case.kind == "header":  # a file on its own whose header cannot be read: not a checkpoint
        _raises(case, lambda: osf.verify(path), path)
        return
    report = _bounded(lambda: osf.verify(path), path)
    assert not report.ok
    assert any(re.search(case.match, p) for p in report.problems), report.problems
    assert all(str(path) in p for p in report.problems), report.problems


def test_bases_are_valid(tmp_path: Path) -> None:
    path = tmp_path / "base.safetensors"
    path.write_bytes(corpus.base_file_bytes())
    tree = osf.load_file(path)
    assert tree["tied"] is tree["a"] and tree["step"] == 7
    assert osf.verify(path).ok
    restored = _standalone.restore_checkpoint(corpus.base_dir())
    assert restored["name"] == "run"
    report = osf.verify(corpus.base_dir())
    assert report.ok and report.files > 1, report


def test_a_schema_naming_a_tensor_no_file_holds_fails_even_when_not_asked_for(
    tmp_path: Path,
) -> None:
    (case,) = [c for c in SCHEMA if c.name == "tensor-not-stored"]
    path = _build(case, tmp_path)
    with pytest.raises(osf.SchemaError, match="no file holds"):
        osf.load_file(path, target={"a": np.zeros((2, 3), np.float32)}, strict=False)


def test_hostile_file_with_a_target(tmp_path: Path) -> None:
    """A target does not bypass validation: headers and schema are checked first."""
    target = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int32)}
    for case in HEADER[::4] + SCHEMA[::4]:
        path = _build(case, tmp_path)
        with pytest.raises(osf.SafetensorsCheckpointError):
            osf.load_file(path, target=target, strict=False)
