"""The wire format as saves write it: streaming saves, refused leaves, the worked example of
docs/format.md.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_safetensors as osf

# --------------------------------------------------------------------------- streaming save

_MEASURE = textwrap.dedent(
    """
    import json, os, sys, tracemalloc
    os.environ["JAX_PLATFORMS"] = "cpu"
    import ml_dtypes
    import numpy as np
    import orbax_safetensors as osf

    kind, path = sys.argv[1], sys.argv[2]
    mb = 1 << 20
    if kind == "mixed":
        tree = {
            "big": np.ones(8 * mb, np.float32),                       # 32 MiB: the largest
            "layers": [{"w": np.full(2 * mb, i, np.float64)} for i in range(6)],  # 6 x 16 MiB
            "bf16": np.ones(4 * mb, ml_dtypes.bfloat16),              # 8 MiB
            "step": 7,
        }
    else:  # sub-byte: packing makes the on-disk copy, half the in-memory size
        tree = {"q": np.ones(32 * mb, ml_dtypes.float4_e2m1fn), "s": np.ones(mb, np.float32)}
    largest = max(a.nbytes for a in tree.values() if hasattr(a, "nbytes"))
    total = sum(x.nbytes for x in __import__("jax").tree.leaves(tree) if hasattr(x, "nbytes"))
    osf.save_file({"warm": np.ones(4)}, path)  # import-time and first-call allocations
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    osf.save_file(tree, path)
    peak = tracemalloc.get_traced_memory()[1] - base
    print(json.dumps({"peak": peak, "largest": largest, "total": total}))
    """
)


@pytest.mark.parametrize("kind", ["mixed", "sub_byte"])
def test_save_streams_host_arrays_without_a_whole_file_buffer(tmp_path, kind):
    # numpy registers its buffers with tracemalloc, so the peak counts every temporary array.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, kind, str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["total"] > 3 * r["largest"] or kind == "sub_byte"
    assert r["peak"] < r["largest"], r
    if kind == "mixed":
        assert r["peak"] < (1 << 20), r  # no tensor is copied at all, only the header is built


# --------------------------------------------------------------------------- refused leaves

BAD_TREES = [
    ({"ok": np.ones(2), "opt": {"fn": object()}}, "opt.fn", "builtins.object"),
    ({"ok": np.ones(2), "names": np.array(["a", "b"])}, "names", "<U1"),
    ({"ok": np.ones(2), "z": [np.ones(3, np.complex128)]}, "z.0", "complex128"),
    ({"ok": jnp.ones(2), "q": jnp.ones(4, jnp.int4)}, "q", "int4"),
    ({"ok": np.ones(2), "f": lambda x: x}, "f", "function"),
    ({"ok": np.ones(2), (1, 2): np.ones(1)}, "(1, 2)", "only str and int keys"),
    ({"ok": np.ones(2), "l": {"w\ud800": np.ones(2)}}, "l.w\\ud800", "not valid UTF-8"),
]


@pytest.mark.parametrize(("tree", "key", "detail"), BAD_TREES)
def test_unsupported_leaf_raises_naming_the_key_and_writes_nothing(tmp_path, tree, key, detail):
    path = tmp_path / "bad.safetensors"
    with pytest.raises(osf.UnsupportedLeafError) as info:
        osf.save_file(tree, path)
    assert key in str(info.value)
    assert detail in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no file and no temporary file


@pytest.mark.parametrize(("tree", "key", "detail"), BAD_TREES[:3])
def test_unsupported_leaf_is_refused_before_any_io(tmp_path, tree, key, detail):
    # The directory does not exist: touching the filesystem would raise FileNotFoundError.
    with pytest.raises(osf.UnsupportedLeafError, match=key.replace(".", r"\.")):
        osf.save_file(tree, tmp_path / "missing" / "bad.safetensors")


def test_failed_save_keeps_an_existing_file(tmp_path):
    path = tmp_path / "keep.safetensors"
    osf.save_file({"w": np.arange(3.0)}, path)
    before = path.read_bytes()
    with pytest.raises(osf.UnsupportedLeafError):
        osf.save_file({"w": np.arange(3.0), "bad": object()}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_bad_user_metadata_is_refused_before_writing(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(osf.UnsupportedLeafError, match="str to str"):
        osf.save_file({"w": np.ones(2)}, path, metadata={"step": 3})  # type: ignore[dict-item]
    with pytest.raises(osf.UnsupportedLeafError, match="reserved"):
        osf.save_file({"w": np.ones(2)}, path, metadata={"orbax_safetensors.tree": "{}"})
    assert list(tmp_path.iterdir()) == []


def test_failure_after_writing_removes_the_temporary_file(tmp_path):
    # The destination is a directory: the temporary file is written in full, then the rename
    # fails; the temporary file must not stay behind.
    path = tmp_path / "w.safetensors"
    path.mkdir()
    with pytest.raises(OSError):
        osf.save_file({"w": np.ones(1000)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    assert list(path.iterdir()) == []


def test_jax_arrays_are_accepted_with_their_dtype(tmp_path):
    path = tmp_path / "j.safetensors"
    tree = {"w": jnp.ones((2, 3), jnp.bfloat16), "k": jax.random.key(0)}
    osf.save_file(tree, path)
    tensors = osf.read_header(path).tensors
    assert (tensors["w"].dtype, tensors["w"].shape) == ("BF16", (2, 3))
    assert (tensors["k"].dtype, tensors["k"].shape) == ("U32", (2,))


def test_big_endian_numpy_arrays_keep_their_values_on_every_write_path(tmp_path):
    # safetensors is little-endian: a ``>f4`` array (from FITS, some HDF5 files) is stored as
    # its values in that order, as safetensors.numpy does; a tied one stays tied.
    import orbax.checkpoint as ocp
    import safetensors.numpy

    big = np.arange(6, dtype=">f4").reshape(2, 3)
    tree = {"w": big, "tied": big, "i": np.array([1, -2], ">i8"), "s": np.dtype(">f8").type(2.5)}
    want = {k: np.asarray(v).astype(np.asarray(v).dtype.newbyteorder("=")) for k, v in tree.items()}

    osf.save_file(tree, tmp_path / "f.safetensors")
    official = safetensors.numpy.load_file(tmp_path / "f.safetensors")
    restored = osf.load_file(tmp_path / "f.safetensors")
    assert osf.read_header(tmp_path / "f.safetensors").tensors.keys() == {"w", "i", "s"}
    assert restored["tied"] is restored["w"]

    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, args=osf.SafetensorsSave(tree))
        manager.wait_until_finished()
        from_manager = manager.restore(1, args=osf.SafetensorsRestore())

    mapping = osf.KeyMapping([osf.Rule("{n:\\w+}", "{n}")])
    osf.export_pytorch({"w": big}, tmp_path / "hf", mapping)
    exported = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")

    for got in (official, restored, from_manager, exported):
        for key, value in got.items():
            assert np.asarray(value).dtype == want[key].dtype, key
            np.testing.assert_array_equal(value, want[key])


def test_a_tensor_name_that_is_not_utf8_is_refused_on_every_write_path(tmp_path):
    # A lone surrogate in a dict key (legal in a Python str) cannot name a tensor: refused
    # naming the leaf before any I/O (SafetensorsSave: before Orbax creates the step), as
    # save_file does (BAD_TREES). The same character in a string value or an inline leaf's key
    # is JSON text: it round-trips.
    import orbax.checkpoint as ocp

    bad = {"layers": {"w\ud800": np.ones(2, np.float32)}}
    match = r"'layers\.w\\ud800'.*not valid UTF-8"
    with pytest.raises(osf.UnsupportedLeafError, match=match):
        osf.SafetensorsSave(bad)
    mapping = osf.KeyMapping([osf.Rule("{n:.*}", "{n}")])
    with pytest.raises(osf.UnsupportedLeafError, match=match):
        osf.export_pytorch(bad, tmp_path / "hf", mapping)
    assert list(tmp_path.iterdir()) == []

    tree = {"note": "x\ud800", "n\ud800": 3, "w": np.ones(2, np.float32)}
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, args=osf.SafetensorsSave(tree))
        manager.wait_until_finished()
        got = manager.restore(1, args=osf.SafetensorsRestore())
    assert got["note"] == "x\ud800" and got["n\ud800"] == 3


# --------------------------------------------------------------------------- docs/format.md


def _doc_json_blocks() -> list[object]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    blocks = re.findall(r"^```json\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    out = []
    for b in blocks:
        try:
            out.append(json.loads(b))
        except ValueError:
            out.append(None)  # templates such as {"format": ..., "tree": NODE}
    return out


def test_worked_example_in_format_md_is_what_save_file_writes(tmp_path):
    w = jnp.ones((2, 2), jnp.float32)
    tree = {
        "layers": [{"w": w, "b": np.zeros(2, np.float16)}],
        "head": w,
        "step": 10,
        "lr": 0.001,
        "rng": jax.random.key(0),
        1: None,
        "cfg": ("relu", True),
    }
    path = tmp_path / "ex.safetensors"
    osf.save_file(tree, path, metadata={"run": "demo"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    blocks = [b for b in _doc_json_blocks() if isinstance(b, dict)]
    assert header in blocks  # the tensor entries
    assert json.loads(meta["orbax_safetensors.tree"]) in blocks  # the schema
    doc_meta = next(b for b in blocks if "orbax_safetensors.crc32c" in b)
    assert json.loads(doc_meta["orbax_safetensors.crc32c"]) == json.loads(
        meta["orbax_safetensors.crc32c"]
    )
    assert {k: v for k, v in doc_meta.items() if not k.startswith("orbax")} == {
        "format": "flax",
        "run": "demo",
    }
    # the numbers quoted in the prose
    assert (len(raw), n, raw[:8].hex(" ")) == (4124, 4088, "f8 0f 00 00 00 00 00 00")
    assert len(raw[8 : 8 + n].rstrip(b" ")) == 1076
