"""Property: ``diff`` and ``verify`` agree with restore on random checkpoints.

- ``diff`` of two saved trees says "identical" exactly when every tensor restores bitwise equal
  (a file against itself, against a copy with one leaf rewritten or one byte changed).
- ``verify`` passes a file or a checkpoint directory exactly when ``load_file`` /
  ``restore_directory`` succeed, after random byte damage anywhere in it.
- Files around the 1 MiB direct I/O threshold read back exactly under every ``OSF_DIRECT_IO``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from campaign import (
    NUMPY_DTYPES,
    campaign,
    direct_io,
    random_values,
    shapes,
)
from hypothesis import given
from hypothesis import strategies as st

import orbax_safetensors as osf
from orbax_safetensors._src.tools import diff as _diff

pytestmark = pytest.mark.timeout(600)


@st.composite
def _leaves(draw: st.DrawFn, big: bool = False) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(shapes(dtype, big=big))
    return random_values(dtype, shape, draw(st.integers(0, 2**32 - 1)))


_names = st.text(alphabet="abcw_", min_size=1, max_size=3)
flat_trees = st.dictionaries(
    _names, st.one_of(_leaves(), st.dictionaries(_names, _leaves(), max_size=2)), max_size=5
)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _bitwise_same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(
        (x.dtype, x.shape, x.tobytes()) == (fb[k].dtype, fb[k].shape, fb[k].tobytes())
        for k, x in fa.items()
    )


@st.composite
def _changed(draw: st.DrawFn, tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with nothing, one leaf's byte, one leaf, or one key changed."""
    flat = _flat(tree)
    op = draw(st.sampled_from(["same", "byte", "leaf", "drop"]) if flat else st.just("same"))
    out = dict(flat)
    if op == "same":
        return out
    name = draw(st.sampled_from(sorted(flat)))
    if op == "drop":
        del out[name]
    elif op == "leaf":
        out[name] = draw(_leaves())
    elif flat[name].nbytes:
        raw = flat[name].copy().reshape(-1).view(np.uint8)
        raw[draw(st.integers(0, raw.size - 1))] ^= 1 << draw(st.integers(0, 7))
        if flat[name].dtype == np.bool_:
            raw &= 1
        out[name] = raw.view(flat[name].dtype).reshape(flat[name].shape)
    return out


@campaign(1.5)
@given(tree=flat_trees, data=st.data())
def test_diff_says_identical_exactly_when_restores_are_bitwise_equal(
    tree: dict[str, Any], data: st.DataObject
) -> None:
    other = data.draw(_changed(tree))
    with tempfile.TemporaryDirectory() as d:
        a, b = Path(d) / "a.safetensors", Path(d) / "b.safetensors"
        osf.save_file(tree, a)
        osf.save_file(other, b)
        same = _bitwise_same(_flat(osf.load_file(a)), _flat(osf.load_file(b)))
        report = _diff.diff_paths(a, b)
        assert report.identical == same, report.format()
        assert _diff.diff_paths(a, a).identical


def _damage(path: Path, position: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[position % len(raw)] ^= 1 << bit
    path.write_bytes(bytes(raw))


@campaign(1.5)
@given(tree=flat_trees, where=st.integers(0, 2**31), bit=st.integers(0, 7), as_dir=st.booleans())
def test_verify_passes_exactly_when_restore_succeeds(
    tree: dict[str, Any], where: int, bit: int, as_dir: bool
) -> None:
    with tempfile.TemporaryDirectory() as d:
        if as_dir:
            path = Path(d) / "ckpt"
            osf.save_directory(tree, path, max_file_size=64)
            files = sorted(p for p in path.iterdir() if p.is_file())
            victim = files[where % len(files)]
        else:
            path = victim = Path(d) / "t.safetensors"
            osf.save_file(tree, path)
        # verify checks more than a restore reads: the index file, files holding no tensor
        # (an empty tree's), and in a directory every file's header (a restore takes the
        # tensors' places from orbax_safetensors.json and reads no header; verify holds the
        # headers, which other readers follow, against it).
        header_bytes = osf.read_header(victim).data_start if victim.suffix == ".safetensors" else 0
        verify_only = victim.name.endswith(".index.json") or (
            victim.suffix == ".safetensors"
            and (
                not osf.read_header(victim).tensors
                or (as_dir and (where // 8) % victim.stat().st_size < header_bytes)
            )
        )
        _damage(victim, where // 8, bit)
        try:
            if as_dir:
                osf.restore_directory(path)
            else:
                osf.load_file(path)
            restored = None
        except osf.SafetensorsCheckpointError as e:
            restored = e
        try:
            report = osf.verify(path)
        except osf.HeaderError:  # a file named on its own whose header cannot be read
            assert not as_dir and restored is not None
            return
        if restored is not None:
            assert not report.ok, restored
        elif not report.ok:
            assert verify_only, report.problems


@pytest.mark.parametrize("mode", ["auto", "never", "always"])
@campaign(0.3)
@given(leaf=_leaves(big=True), small=_leaves())
def test_direct_io_modes_read_back_exactly(mode: str, leaf: np.ndarray, small: np.ndarray) -> None:
    tree = {"big": leaf, "small": small, "big2": leaf[::-1].copy()}
    with tempfile.TemporaryDirectory() as d, direct_io(mode):
        path = Path(d) / "t.safetensors"
        osf.save_file(tree, path)
        assert _bitwise_same(osf.load_file(path), tree)
        osf.save_directory(tree, Path(d) / "dir", max_file_size=1 << 20)
        assert _bitwise_same(osf.restore_directory(Path(d) / "dir"), tree)
        assert osf.verify(path).ok
