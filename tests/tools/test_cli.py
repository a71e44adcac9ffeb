"""The command line: inspect, convert, diff (and --help everywhere), on real files and real
Orbax checkpoints. Interop is checked with the other tool (safetensors, Orbax), not our reader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import orbax_safetensors as osf
from orbax_safetensors import cli
from orbax_safetensors._src.catalog import sources as _sources
from orbax_safetensors._src.tools import convert as _convert
from orbax_safetensors._src.tools import diff as _diff

SUBCOMMANDS = ["inspect", "verify", "convert", "diff", "demo"]
NnxList = getattr(nnx, "List", list)  # nnx.List: flax >= 0.12 (0.11 takes a plain list)


def run(capsys, *argv):
    """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def saved_root(root, steps, args_of):
    """A CheckpointManager root holding ``steps``, each saved with ``args_of(step)``."""
    with ocp.CheckpointManager(root) as mngr:
        for step in steps:
            mngr.save(step, args=args_of(step))
        mngr.wait_until_finished()
    return root


def tree_example():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharded = jax.device_put(
        jnp.arange(64, dtype=jnp.float32).reshape(8, 8),
        NamedSharding(mesh, PartitionSpec("data", "model")),
    )
    return {
        "params": {
            "w": sharded,
            "b": jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16),
            "emb": jax.random.normal(jax.random.key(0), (16, 4)),
        },
        "layers": [
            {"k": jnp.arange(6, dtype=jnp.int32).reshape(2, 3)},
            {"k": np.arange(5, dtype=np.int8)},
        ],
        "step": 7,
        "lr": 0.5,
        "nothing": None,
    }


def leaves_by_name(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v for p, v in flat}


@pytest.fixture(scope="module")
def orbax_item(tmp_path_factory):
    """An Orbax StandardSave item (OCDBT), one array sharded over a 4x2 mesh."""
    path = tmp_path_factory.mktemp("orbax") / "item"
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree_example())
    ckptr.wait_until_finished()
    ckptr.close()
    return path


@pytest.fixture(scope="module")
def orbax_root(tmp_path_factory):
    """A CheckpointManager root of Orbax-native steps: a StandardSave item plus a JSON item."""
    root = tmp_path_factory.mktemp("orbax_root") / "ckpts"

    def args_of(step):
        tree = {"w": jnp.full((4, 3), float(step)), "count": jnp.array(step)}
        return ocp.args.Composite(
            state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave({"step": step})
        )

    saved_root(root, (1, 2), args_of)
    return root


# --------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"orbax-safetensors {command}" in out and "-h, --help" in out


def test_console_script_runs():
    done = subprocess.run(
        [sys.executable, "-m", "orbax_safetensors.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for command in SUBCOMMANDS:
        assert command in done.stdout


def test_parse_size():
    assert cli.parse_size("5GB") == 5 * 1000**3
    assert cli.parse_size("512MiB") == 512 * 2**20
    assert cli.parse_size("1000") == 1000
    assert cli.parse_size("1.5k") == 1500


# --------------------------------------------------------------------------- inspect


def test_inspect_file_table_and_json(tmp_dir, capsys):
    path = tmp_dir / "w.safetensors"
    osf.save_file({"a": np.ones((2, 3), np.float32), "b": {"c": np.zeros(4, np.int8)}}, path)
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0
    assert "a" in out and "F32" in out and "(2, 3)" in out and "24" in out
    assert "b.c" in out and "I8" in out and "(4,)" in out
    assert "total: 2 tensors, 28 bytes" in out
    code, out, _ = run(capsys, "inspect", path, "--json")
    doc = json.loads(out)
    assert doc["kind"] == "file" and doc["num_tensors"] == 2 and doc["total_bytes"] == 28
    assert {t["name"]: (t["dtype"], t["shape"], t["bytes"], t["file"]) for t in doc["tensors"]} == {
        "a": ("F32", [2, 3], 24, "w.safetensors"),
        "b.c": ("I8", [4], 4, "w.safetensors"),
    }


def test_inspect_torch_written_file(tmp_dir, capsys):
    torch = pytest.importorskip("torch", reason="needs PyTorch (in the main environment)")
    from safetensors.torch import save_file

    save_file(
        {"lin.weight": torch.ones(3, 2), "lin.bias": torch.zeros(3, dtype=torch.bfloat16)},
        tmp_dir / "t.safetensors",
        metadata={"format": "pt"},
    )
    _, out, _ = run(capsys, "inspect", tmp_dir / "t.safetensors", "--json")
    doc = json.loads(out)
    assert doc["metadata"] == {"format": "pt"}
    assert {t["name"]: t["dtype"] for t in doc["tensors"]} == {
        "lin.weight": "F32",
        "lin.bias": "BF16",
    }


def test_inspect_sharded_item_names_files(tmp_dir, capsys):
    tree = {f"t{i}": np.full((10,), i, np.float32) for i in range(4)}
    osf.save_directory(tree, tmp_dir / "item", max_file_size=80)
    _, out, _ = run(capsys, "inspect", tmp_dir / "item", "--json")
    doc = json.loads(out)
    assert doc["kind"] == "item"
    files = {t["file"] for t in doc["tensors"]}
    assert len(files) == 2 and all(f.startswith("model-0000") for f in files)
    assert doc["total_bytes"] == 160


def test_inspect_step_and_root_of_a_checkpoint_manager(tmp_dir, capsys):
    root = tmp_dir / "ckpts"
    saved_root(
        root,
        (10, 20),
        lambda step: ocp.args.Composite(
            state=osf.SafetensorsSave({"w": np.ones((step, 4), np.float32)}),
            meta=ocp.args.JsonSave({"step": step}),
        ),
    )
    code, out, _ = run(capsys, "inspect", root, "--json")
    doc = json.loads(out)
    assert doc["kind"] == "root" and doc["latest_step"] == 20
    assert [(s["step"], s["num_tensors"], s["tensor_bytes"]) for s in doc["steps"]] == [
        (10, 1, 160),
        (20, 1, 320),
    ]
    assert all(s["disk_bytes"] > s["tensor_bytes"] for s in doc["steps"])
    assert doc["steps"][0]["items"] == ["state", "meta"]
    code, out, _ = run(capsys, "inspect", root)
    assert "latest step: 20" in out and "tensor bytes" in out
    code, out, _ = run(capsys, "inspect", root / "20")
    assert code == 0 and "[state] item" in out and "state/model.safetensors" in out
    assert "other items: meta" in out


def test_inspect_orbax_native_item(orbax_item, capsys):
    _, out, _ = run(capsys, "inspect", orbax_item, "--json")
    doc = json.loads(out)
    assert doc["kind"] == "orbax"
    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in doc["tensors"]}
    assert shapes == {
        "params.w": ("F32", [8, 8]),
        "params.b": ("BF16", [8]),
        "params.emb": ("F32", [16, 4]),
        "layers.0.k": ("I32", [2, 3]),
        "layers.1.k": ("I8", [5]),
    }


def test_inspect_missing_path_is_an_error(tmp_dir, capsys):
    code, _, err = run(capsys, "inspect", tmp_dir / "nope")
    assert code == 2 and "no such file" in err


# --------------------------------------------------------------------------- convert


def test_convert_orbax_item_to_safetensors(orbax_item, tmp_dir, capsys):
    dst = tmp_dir / "st"
    # Tiny batches and files: many partial restores, several output files.
    code, out, err = run(
        capsys, "convert", orbax_item, dst, "--batch-size", "100", "--max-file-size", "200"
    )
    assert code == 0, err
    assert "converted 5 tensors" in out
    expected = ocp.StandardCheckpointer().restore(orbax_item)  # Orbax's own reading
    # Read the files with the reference safetensors reader, not ours.
    meta = json.loads((dst / "orbax_safetensors.json").read_text())
    assert len(meta["files"]) > 1
    found = {}
    for f in meta["files"]:
        found.update(safetensors.numpy.load_file(str(dst / f)))
    want = {
        k: np.asarray(v)
        for k, v in leaves_by_name(expected).items()
        if isinstance(v, (jax.Array, np.ndarray))
    }
    assert set(found) == set(want)
    for name, value in want.items():
        assert found[name].dtype == value.dtype and np.array_equal(found[name], value), name
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want)
    # Our restore gives the same tree: scalars inline, None kept, jax vs numpy leaves kept.
    restored = osf.restore_directory(dst)
    assert restored["step"] == 7 and restored["lr"] == 0.5 and restored["nothing"] is None
    assert isinstance(restored["params"]["w"], jax.Array)
    assert isinstance(restored["layers"][1]["k"], np.ndarray)
    assert restored["params"]["b"].dtype == ml_dtypes.bfloat16
    # The saved 4x2 mesh layout is recorded.
    assert meta["tensors"]["params.w"]["sharding"] == {
        "mesh_axes": ["data", "model"],
        "mesh_shape": [4, 2],
        "spec": ["data", "model"],
    }
    assert all(t.get("crc32c") for t in meta["tensors"].values())
    code, out, _ = run(capsys, "diff", orbax_item, dst)
    assert code == 0 and "identical" in out


def test_convert_pytree_save_without_ocdbt(tmp_dir):
    src = tmp_dir / "pytree"
    tree = {"a": jnp.arange(12.0).reshape(3, 4), "b": [np.ones(2, np.float16)], "name": "run-1"}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    ckptr.save(src, args=ocp.args.PyTreeSave(tree))
    assert not (src / "manifest.ocdbt").exists()
    summary = _convert.convert(src, tmp_dir / "st")
    assert summary.direction == "safetensors" and summary.tensors == 2
    restored = osf.restore_directory(tmp_dir / "st")
    assert restored["name"] == "run-1"
    np.testing.assert_array_equal(restored["a"], tree["a"])
    np.testing.assert_array_equal(restored["b"][0], tree["b"][0])


def test_convert_keeps_prng_keys_and_unwraps_nnx_values(tmp_dir):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = NnxList([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.layers[1](jax.nn.relu(self.layers[0](x)))

    model = MLP(nnx.Rngs(0))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_dir / "native", nnx.state(model))
    ckptr.wait_until_finished()
    plain = _convert.convert(tmp_dir / "native", tmp_dir / "plain", unwrap_values=False)
    assert (
        "layers.0.kernel.value" in _sources.open_source(tmp_dir / "plain").tensors
    )  # Orbax's names
    _convert.convert(tmp_dir / "native", tmp_dir / "st", unwrap_values=True)
    assert plain.tensors == 6
    fresh = MLP(nnx.Rngs(1))
    restored = osf.restore_directory(tmp_dir / "st", target=nnx.state(fresh))
    nnx.update(fresh, restored)
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(fresh(x), model(x))
    key = fresh.drop.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(model.drop.rngs.key[...])
    )


def test_convert_safetensors_item_back_to_orbax(tmp_dir, capsys):
    tree = {
        "w": jnp.arange(6.0).reshape(2, 3),
        "opt": [np.ones(3, np.int32)],
        "step": 3,
        "tag": "x",
    }
    osf.save_directory(tree, tmp_dir / "st")
    code, out, err = run(capsys, "convert", tmp_dir / "st", tmp_dir / "orbax", "-q")
    assert code == 0, err
    restored = ocp.PyTreeCheckpointer().restore(tmp_dir / "orbax")  # Orbax's own reader
    np.testing.assert_array_equal(restored["w"], tree["w"])
    np.testing.assert_array_equal(restored["opt"][0], tree["opt"][0])
    assert restored["step"] == 3 and restored["tag"] == "x"
    code, out, _ = run(capsys, "diff", tmp_dir / "st", tmp_dir / "orbax")
    assert code == 0, out


def test_convert_standard_save_round_trip_restores_with_standard_restore(tmp_dir):
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": 3}
    osf.save_directory(tree, tmp_dir / "st")
    _convert.convert(tmp_dir / "st", tmp_dir / "orbax")
    restored = ocp.StandardCheckpointer().restore(tmp_dir / "orbax", jax.eval_shape(lambda: tree))
    np.testing.assert_array_equal(restored["w"], tree["w"])


def test_convert_manager_root_both_ways(orbax_root, tmp_dir, capsys):
    code, out, err = run(capsys, "convert", orbax_root, tmp_dir / "st")
    assert code == 0, err
    assert "copied unchanged: 1/meta, 2/meta" in out
    with ocp.CheckpointManager(tmp_dir / "st") as mngr:
        assert mngr.all_steps() == [1, 2]
        abstract = {
            "w": jax.ShapeDtypeStruct((4, 3), jnp.float32),
            "count": jax.ShapeDtypeStruct((), jnp.int32),
        }
        got = mngr.restore(
            2,
            args=ocp.args.Composite(
                state=osf.SafetensorsRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
    np.testing.assert_array_equal(got["state"]["w"], np.full((4, 3), 2.0))
    assert int(got["state"]["count"]) == 2 and got["meta"] == {"step": 2}
    step_meta = json.loads((tmp_dir / "st" / "2" / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"]["state"] == osf.SafetensorsCheckpointHandler.typestr()
    # ... and back to Orbax-native, readable by a plain CheckpointManager.
    code, out, err = run(capsys, "convert", tmp_dir / "st", tmp_dir / "back")
    assert code == 0, err
    with ocp.CheckpointManager(tmp_dir / "back") as mngr:
        got = mngr.restore(
            1,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
    np.testing.assert_array_equal(got["state"]["w"], np.full((4, 3), 1.0))
    code, out, _ = run(capsys, "diff", orbax_root / "1", tmp_dir / "back" / "1")
    assert code == 0, out


# tqdm's marks: a redraw, a bar, a rate, a percentage followed by a bar.
_PROGRESS_MARKS = re.compile(r"\r|[\u2588-\u258f]|[?\d][kMGTP]?(it|B|step)/s|\d%\|")


def _cli_process(*argv, stderr_terminal=False):
    """Runs the console script in a child process, stdout a pipe and stderr a pipe or (with
    ``stderr_terminal``) a pseudo-terminal; returns (exit status, stdout, stderr)."""
    command = [sys.executable, "-m", "orbax_safetensors.cli", *map(str, argv)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if not stderr_terminal:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        return done.returncode, done.stdout, done.stderr
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, env=env) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        out = proc.stdout.read().decode()
        code = proc.wait(timeout=120)
    return code, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(300)
def test_convert_progress_bar_only_on_a_terminal(orbax_root, tmp_dir, capsys):
    # Piped (a CI log, `| tee`): the result line only, no bar in either stream.
    code, out, err = _cli_process("convert", orbax_root / "1", tmp_dir / "piped")
    assert code == 0, err
    assert "converted 2 tensors" in out
    assert not _PROGRESS_MARKS.search(out) and not _PROGRESS_MARKS.search(err), (out, err)
    assert "convert state" not in err
    # stderr a terminal: the bar is drawn there, stdout stays clean.
    code, out, err = _cli_process(
        "convert", orbax_root / "1", tmp_dir / "terminal", stderr_terminal=True
    )
    assert code == 0, err
    assert "convert state" in err  # the tqdm bar (the terminal turns every "\n" into "\r\n")
    assert _PROGRESS_MARKS.search(err.replace("\r\n", "\n")), err
    assert "converted 2 tensors" in out and not _PROGRESS_MARKS.search(out)
    # In-process under pytest (stderr captured, not a terminal): no bar either.
    code, out, err = run(capsys, "convert", orbax_root / "1", tmp_dir / "st")
    assert code == 0, err
    assert "convert state" not in err and "\r" not in err
    code, _, err = run(capsys, "convert", orbax_root / "1", tmp_dir / "st")
    assert code == 2 and "already exists" in err
    assert not [p for p in tmp_dir.iterdir() if ".converting-" in p.name]


def test_failed_conversion_leaves_nothing(tmp_dir):
    (tmp_dir / "junk").mkdir()
    (tmp_dir / "junk" / "_METADATA").write_text("not json")
    with pytest.raises(osf.SafetensorsCheckpointError, match="cannot read"):
        _convert.convert(tmp_dir / "junk", tmp_dir / "out")
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["junk"]


# --------------------------------------------------------------------------- diff


def test_diff_reports_every_kind_of_difference(tmp_dir, capsys):
    a = {
        "same": np.arange(4.0),
        "val": np.zeros(3, np.float32),
        "shape": np.zeros(3),
        "dtype": np.ones(2, np.float32),
        "only_a": np.ones(1),
    }
    b = {
        "same": np.arange(4.0),
        "val": np.array([0, 0.25, -0.5], np.float32),
        "shape": np.zeros(4),
        "dtype": np.ones(2, np.float16),
        "only_b": np.ones(1),
    }
    osf.save_file(a, tmp_dir / "a.safetensors")
    osf.save_directory(b, tmp_dir / "b")
    code, out, _ = run(capsys, "diff", tmp_dir / "a.safetensors", tmp_dir / "b")
    assert code == 1
    assert "only in A (1):\n  only_a" in out and "only in B (1):\n  only_b" in out
    assert "shape: F64[3] vs F64[4]" in out
    assert "dtype: F32[2] vs F16[2] (max abs difference 0)" in out
    assert "val: max abs difference 0.5" in out
    assert "val: max abs difference 0.5; 2 elements differ" in out
    assert "1 tensor equal; checkpoints differ" in out
    code, out, _ = run(capsys, "diff", tmp_dir / "a.safetensors", tmp_dir / "b", "--json")
    doc = json.loads(out)
    assert doc["identical"] is False
    assert doc["values"] == [{"name": "val", "max_abs_diff": 0.5, "differing": 2}]
    code, out, _ = run(capsys, "diff", tmp_dir / "a.safetensors", tmp_dir / "b", "--atol", "0.6")
    assert "values differ" not in out and code == 1  # still differs in keys and shapes
    code, out, _ = run(capsys, "diff", tmp_dir / "a.safetensors", tmp_dir / "a.safetensors")
    assert code == 0 and "identical" in out


def test_max_abs_difference_edge_cases():
    nan = np.float32("nan")
    assert _diff.max_abs_difference(np.array([nan, 1]), np.array([nan, 1])) == 0.0
    assert (
        _diff.max_abs_difference(np.array([0.0], np.float32), np.array([-0.0], np.float32)) == 0.0
    )
    assert _diff.max_abs_difference(np.array([nan]), np.array([1.0])) == np.inf
    assert _diff.max_abs_difference(np.array([np.inf]), np.array([-np.inf])) == np.inf
    assert _diff.max_abs_difference(np.array([True]), np.array([False])) == 1.0
    x = np.arange(10, dtype=ml_dtypes.bfloat16)
    assert _diff.max_abs_difference(x, x + 1) == 1.0


def test_relative_paths_work_for_orbax_sources(orbax_item, tmp_dir, monkeypatch, capsys):
    """Orbax refuses relative paths; the tools make them absolute."""
    import shutil

    shutil.copytree(orbax_item, tmp_dir / "native")
    monkeypatch.chdir(tmp_dir)
    code, _, err = run(capsys, "convert", "native", "st", "-q")
    assert code == 0, err
    code, _, err = run(capsys, "convert", "st", "back", "-q")
    assert code == 0, err
    code, out, _ = run(capsys, "diff", "native", "back")
    assert code == 0, out


# --------------------------------------------------------------------------- verify


def test_verify_good_and_damaged(tmp_dir, capsys):
    root = tmp_dir / "ckpts"
    saved_root(
        root,
        (1, 2),
        lambda step: osf.SafetensorsSave({"w": np.full((32,), step, np.float32), "b": np.ones(4)}),
    )
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and "OK (2 files, 4 tensors" in out
    code, out, _ = run(capsys, "verify", root / "2" / "default" / "model.safetensors")
    assert code == 0 and "OK (1 file, 2 tensors, 160 bytes checked)" in out
    data = root / "2" / "default" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # flip a byte of the last tensor
    data.write_bytes(bytes(raw))
    code, out, _ = run(capsys, "verify", root)
    assert code == 1 and "DAMAGED" in out
    assert "model.safetensors" in out and "CRC32C mismatch" in out
    code, out, _ = run(capsys, "verify", root, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and len(doc["problems"]) == 1
    (root / "1" / "default" / "model.safetensors").write_bytes(b"\x08\x00")  # truncated
    code, out, _ = run(capsys, "verify", root / "1")
    assert code == 1 and "model.safetensors" in out
    code, _, err = run(capsys, "verify", tmp_dir / "missing")
    assert code == 2 and f"{tmp_dir / 'missing'}: no such file or directory" in err


def test_verify_plain_torch_file_has_no_checksums(tmp_dir, capsys):
    torch = pytest.importorskip("torch", reason="needs PyTorch (in the main environment)")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, tmp_dir / "t.safetensors")
    code, out, _ = run(capsys, "verify", tmp_dir / "t.safetensors")
    assert code == 0 and "no recorded checksum" in out


def _proc_status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) // 1024
    raise KeyError(key)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_convert_streams_in_bounded_memory(tmp_dir):
    """Orbax -> safetensors holds about one batch of tensors, not the whole checkpoint.

    The growth is a fixed cost (Orbax/TensorStore's copies of one batch, allocator slack):
    measured 31-71 MiB here whether the checkpoint holds 96 or 288 MiB, so the checkpoint is
    made large enough (256 MiB) that holding it whole could not pass for that noise.
    """
    tree = {f"t{i}": np.full((1024, 2048), i, np.float32) for i in range(32)}  # 32 x 8 MiB
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(tmp_dir / "native", tree)
    del tree
    _convert.convert(tmp_dir / "native", tmp_dir / "warm", batch_bytes=8 << 20, progress=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _proc_status_mib("VmRSS")
    _convert.convert(tmp_dir / "native", tmp_dir / "st", batch_bytes=8 << 20, progress=False)
    growth = _proc_status_mib("VmHWM") - base
    assert growth < 96, f"peak memory grew by {growth} MiB converting 256 MiB in 8 MiB batches"
    got = safetensors.numpy.load_file(str(tmp_dir / "st" / "model.safetensors"))
    assert float(got["t7"][0, 0]) == 7.0 and len(got) == 32


def test_convert_plain_safetensors_file_and_hf_dir_to_orbax(tmp_dir):
    torch = pytest.importorskip("torch", reason="needs PyTorch (in the main environment)")
    from safetensors.torch import save_file

    state = {"lin.weight": torch.arange(6.0).reshape(2, 3), "lin.bias": torch.ones(2)}
    save_file(state, tmp_dir / "t.safetensors")
    (tmp_dir / "hf").mkdir()
    save_file(state, tmp_dir / "hf" / "model.safetensors")
    for src, dst in ((tmp_dir / "t.safetensors", tmp_dir / "o1"), (tmp_dir / "hf", tmp_dir / "o2")):
        summary = _convert.convert(src, dst)
        assert summary.direction == "orbax" and summary.tensors == 2
        restored = ocp.PyTreeCheckpointer().restore(dst)
        np.testing.assert_array_equal(restored["lin.weight"], state["lin.weight"].numpy())
        assert _diff.diff_paths(src, dst).identical
