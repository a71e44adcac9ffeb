"""Selective restore by name: include / exclude globs in load_file, SafetensorsRestore and the
CLI; only the selected tensors' bytes are read."""

from __future__ import annotations

import json
import sys

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import kernel_io  # (tests/ is on sys.path)
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_safetensors as osf
from orbax_safetensors._src.core import tree as _tree
from orbax_safetensors._src.core.select import Selection
from orbax_safetensors._src.tools import cli

# --------------------------------------------------------------------------- the pattern rule


@pytest.mark.parametrize(
    ("include", "exclude", "name", "selected"),
    [
        ("layers.*.attn", None, "layers.0.attn.kernel", True),
        ("layers.*.attn", None, "layers.0.mlp.kernel", False),
        ("layers.*.attn.*", None, "layers.12.attn.q.kernel", True),  # '*' crosses dots
        ("layers.1", None, "layers.1.w", True),  # a name selects its subtree
        ("layers.1", None, "layers.10.w", False),  # ... on dot boundaries only
        ("layers.1*", None, "layers.10.w", True),
        ("*kernel", None, "a.b.kernel", True),
        ("params", "*.bias", "params.dense.bias", False),
        (None, "opt_state", "opt_state.0.mu.w", False),
        (None, "opt_state", "params.w", True),
        ("Params", None, "params.w", False),  # case-sensitive
        ("layers.[02]", None, "layers.2.w", True),
    ],
)
def test_pattern_rule(include, exclude, name, selected):
    sel = Selection.of(include, exclude)
    assert sel is not None and sel.selects(name) is selected


def test_bad_patterns_fail_before_reading():
    assert Selection.of(None, None) is None
    for bad in (3, [""], ["a", None], b"bytes"):
        with pytest.raises(TypeError, match="include"):
            Selection.of(bad)
    with pytest.raises(TypeError, match="selects nothing"):
        Selection.of([])
    with pytest.raises(TypeError, match="exclude"):
        osf.SafetensorsRestore(exclude=5)


# --------------------------------------------------------------------------- load_file


def _tree_to_save() -> dict:
    return {
        "params": {
            "layers": [
                {
                    "attn": {
                        "w": np.full((4, 4), i, np.float32),
                        "bias": np.full(4, i, np.float32),
                    },
                    "mlp": {"w": np.full((4, 8), i, np.float32)},
                }
                for i in range(3)
            ],
            "head": jnp.arange(6.0).reshape(2, 3),
            "none": None,
        },
        "opt_state": (np.zeros(3, np.float32), {"count": np.int32(7)}),
        "step": 12,
    }


def test_without_target_selected_subtrees_in_saved_containers(tmp_path):
    path = tmp_path / "t.safetensors"
    tree = _tree_to_save()
    osf.save_file(tree, path)
    out = osf.load_file(path, include="params.layers.*.attn", exclude="*.bias")
    assert out == {
        "params": {
            "layers": [{"attn": {"w": out["params"]["layers"][i]["attn"]["w"]}} for i in range(3)]
        }
    }
    for i in range(3):
        np.testing.assert_array_equal(out["params"]["layers"][i]["attn"]["w"], np.full((4, 4), i))
    # A list keeps its length (None where nothing is selected): indices name the same layers.
    out = osf.load_file(path, include=["params.layers.1", "step", "params.none"])
    assert out["params"]["layers"][0] is None and out["params"]["layers"][2] is None
    np.testing.assert_array_equal(out["params"]["layers"][1]["mlp"]["w"], np.full((4, 8), 1))
    assert out["step"] == 12 and out["params"]["none"] is None and "head" not in out["params"]
    # Tuples keep theirs too; the saved array kinds come back (jax stays jax).
    out = osf.load_file(path, include=("opt_state.1", "params.head"))
    assert out["opt_state"][0] is None and int(out["opt_state"][1]["count"]) == 7
    assert isinstance(out["params"]["head"], jax.Array)


def test_plain_safetensors_file_selects_flat_names(tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "plain.safetensors")
    save_file({"a.w": np.ones(2, np.float32), "a.b": np.ones(1), "c": np.zeros(3)}, path)
    assert set(osf.load_file(path, include="a", exclude="a.b")) == {"a.w"}


def test_pattern_matching_nothing_names_it_and_some_names(tmp_path):
    path = tmp_path / "t.safetensors"
    osf.save_file(_tree_to_save(), path)
    with pytest.raises(osf.TargetMismatchError) as e:
        osf.load_file(path, include=["params.head", "parms.layers"])
    text = str(e.value)
    assert "'parms.layers'" in text and "matches no name" in text and "params.layers.0" in text
    with pytest.raises(osf.TargetMismatchError, match="exclude pattern 'nope'"):
        osf.load_file(path, exclude="nope")
    with pytest.raises(osf.TargetMismatchError, match="selects nothing"):
        osf.load_file(path, include="step", exclude="step")


def test_with_target_patterns_select_within_it(tmp_path):
    path = tmp_path / "t.safetensors"
    tree = _tree_to_save()
    osf.save_file(tree, path)
    abstract = jax.eval_shape(lambda: tree)
    out = osf.load_file(path, target=abstract, include="params.layers.2")
    np.testing.assert_array_equal(out["params"]["layers"][2]["attn"]["w"], np.full((4, 4), 2))
    # Unselected target leaves come back as given (nothing read), as Orbax's PLACEHOLDER does.
    assert out["params"]["head"] is abstract["params"]["head"]
    assert out["opt_state"] is not None and out["step"] is abstract["step"]
    # A live state as the target: the selected leaves are replaced, the others kept.
    live = jax.tree.map(lambda x: x, tree)
    live["params"]["head"] = jnp.zeros((2, 3))
    live["params"]["layers"][0]["mlp"]["w"] = np.full((4, 8), -1, np.float32)
    out = osf.load_file(path, target=live, include="params.head")
    np.testing.assert_array_equal(out["params"]["head"], tree["params"]["head"])
    assert out["params"]["layers"][0]["mlp"]["w"] is live["params"]["layers"][0]["mlp"]["w"]
    # A pattern matching nothing in the target names the target's names.
    with pytest.raises(osf.TargetMismatchError, match="matches no name in the restore target"):
        osf.load_file(path, target=abstract, include="encoder")


def test_with_target_strict_checks_only_the_selection(tmp_path):
    path = tmp_path / "t.safetensors"
    osf.save_file({"enc": {"w": np.ones(2)}, "dec": {"w": np.ones(3)}}, path)
    target = {"enc": {"w": np.zeros(2), "extra": np.zeros(1)}}
    with pytest.raises(
        osf.TargetMismatchError, match=r"missing from the checkpoint \(1\): enc.extra"
    ):
        osf.load_file(path, target=target, include="enc")
    out = osf.load_file(path, target={"enc": {"w": np.zeros(2)}}, include="enc")  # dec not asked
    np.testing.assert_array_equal(out["enc"]["w"], np.ones(2))
    with pytest.raises(osf.TargetMismatchError, match="in the checkpoint but not the target"):
        osf.load_file(path, target={"enc": {"w": np.zeros(2)}}, include="*")


def _rchar() -> int:
    with open("/proc/self/io", "rb", buffering=0) as f:
        text = f.read(4096)
    return int(text.split(b"rchar:")[1].split()[0])


def _rchar_self() -> int:
    """The bytes one _rchar() call reads itself (counted by the next call)."""
    a = _rchar()
    return _rchar() - a


@pytest.mark.skipif(not kernel_io.counts_reads(), reason=kernel_io.NO_COUNTER)
def test_only_selected_bytes_and_headers_are_read(tmp_path):
    # Measured at the system calls (/proc/self/io rchar: bytes this process read): loading
    # a selection reads its tensors' bytes plus the header, nothing of the other tensors.
    rng = np.random.default_rng(0)
    tree = {f"layer{i}": {"w": rng.standard_normal((256, 256), np.float32)} for i in range(6)}
    tree["head"] = rng.standard_normal((64, 512)).astype(np.float32)
    path = tmp_path / "big.safetensors"
    osf.save_file(tree, path)
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    osf.load_file(path, include="layer0")  # warm-up (imports, caches)
    rchar_self = _rchar_self()
    for include, exclude in (("layer[13]", None), (["head", "layer5.w"], None), (None, "layer*")):
        expected = sum(
            v.nbytes
            for k, v in _tree.flatten(tree).arrays.items()
            if Selection.of(include, exclude).selects(k)
        )
        before = _rchar()
        out = osf.load_file(path, include=include, exclude=exclude)
        read = _rchar() - before - rchar_self
        assert read == expected + header, (include, exclude, read, expected, header)
        assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(out)) == expected
    before = _rchar()
    osf.load_file(path)
    assert _rchar() - before - rchar_self == sum(v.nbytes for v in jax.tree.leaves(tree)) + header


# --------------------------------------------------------------------------- CheckpointManager


@pytest.mark.parametrize("max_file_size", [None, 300_000])  # one file, or one per tensor
def test_manager_restore_selects_and_reads_only_that(tmp_path, max_file_size):
    mesh = devices.mesh((4, 2), ("x", "y"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    state = {
        "params": {
            f"l{i}": {"w": jax.device_put(jnp.full((256, 256), float(i)), sharding)}
            for i in range(4)
        },
        "opt": {"mu": np.ones((256, 256), np.float32)},
        "step": 5,
    }
    handler = osf.SafetensorsCheckpointHandler(max_file_size=max_file_size)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("default", osf.SafetensorsSave, handler)
    registry.add("default", osf.SafetensorsRestore, handler)
    with ocp.CheckpointManager(epath.Path(tmp_path), handler_registry=registry) as mngr:
        mngr.save(1, args=osf.SafetensorsSave(state))
        mngr.wait_until_finished()
        files = list((epath.Path(tmp_path) / "1" / "default").glob("*.safetensors"))
        assert len(files) == (1 if max_file_size is None else 5)
        out = mngr.restore(1, args=osf.SafetensorsRestore(include="params.l[12]", exclude=None))
        assert set(out) == {"params"} and set(out["params"]) == {"l1", "l2"}
        np.testing.assert_array_equal(out["params"]["l2"]["w"], np.full((256, 256), 2.0))
        assert out["params"]["l1"]["w"].sharding.is_equivalent_to(sharding, 2)  # as saved
        assert handler.last_read_stats.bytes_read == 2 * 256 * 256 * 4
        assert handler.last_read_stats.bytes_needed == 2 * 256 * 256 * 4
        # With a target: the selection within it; the rest comes back as given.
        abstract = jax.eval_shape(lambda: state)
        out = mngr.restore(1, args=osf.SafetensorsRestore(abstract, exclude=["params", "step"]))
        np.testing.assert_array_equal(out["opt"]["mu"], np.ones((256, 256)))
        assert (
            out["params"] is not None and out["params"]["l0"]["w"] is abstract["params"]["l0"]["w"]
        )
        assert handler.last_read_stats.bytes_read == 256 * 256 * 4
        with pytest.raises(osf.TargetMismatchError, match="'opt_state'"):
            mngr.restore(1, args=osf.SafetensorsRestore(include="opt_state"))
    assert "include='params.l[12]'" in repr(osf.SafetensorsRestore(include="params.l[12]"))


# --------------------------------------------------------------------------- the CLI


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_inspect_diff_convert_select(tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    tree = _tree_to_save()
    osf.save_file(tree, a)
    tree["params"]["head"] = tree["params"]["head"] + 1
    osf.save_file(tree, b)
    code, out = _run(
        capsys, "inspect", str(a), "--json", "--include", "params.layers.0", "--exclude", "*.bias"
    )
    assert code == 0
    names = [t["name"] for t in json.loads(out)["tensors"]]
    assert names == ["params.layers.0.attn.w", "params.layers.0.mlp.w"]
    code, out = _run(capsys, "inspect", str(a), "--include", "nothing.here")
    assert code == 2 and "'nothing.here'" in out
    code, out = _run(capsys, "diff", str(a), str(b), "--exclude", "params.head")
    assert code == 0, out
    code, out = _run(capsys, "diff", str(a), str(b), "--include", "params.head", "--json")
    assert code == 1 and [v["name"] for v in json.loads(out)["values"]] == ["params.head"]
    dst = tmp_path / "orbax"
    code, out = _run(capsys, "convert", str(a), str(dst), "-q", "--include", "params.layers.2")
    assert code == 0, out
    restored = ocp.StandardCheckpointer().restore(dst)
    assert set(restored) == {"params"}
    assert restored["params"]["layers"][0] is None
    np.testing.assert_array_equal(restored["params"]["layers"][2]["mlp"]["w"], np.full((4, 8), 2))
    back = tmp_path / "back"
    code, out = _run(
        capsys, "convert", str(dst), str(back), "-q", "--include", "params.layers.2.attn"
    )
    assert code == 0, out
    out = osf.restore_directory(back)
    assert list(out["params"]["layers"][2]) == ["attn"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
