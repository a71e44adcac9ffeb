"""Object storage (issue 8): ``s3://`` and ``gs://`` checkpoints against real local servers.

SeaweedFS (S3) and fake-gcs-server (GCS) run on 127.0.0.1 (``tests/objstore`` fixtures). The
files are checked with the official safetensors reader after a plain client download. Faults
are in ``test_objstore_failures.py``, several processes in ``test_objstore_multiprocess.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf

# tests/ is on sys.path (as for tests/conftest.py).
from objstore.buckets import download, list_keys, pending_uploads, upload
from objstore.trees import MiB, as_comparable, check_tree, official_tensors, sample_tree
from orbax_safetensors._src.orbax import steps as _steps
from orbax_safetensors._src.storage import config as _config
from orbax_safetensors._src.storage.interface import Piece
from orbax_safetensors._src.storage.objstore import engine as _engine

# --------------------------------------------------------------------------- single process


def test_save_file_load_file_urls(store, options) -> None:
    server, bucket = store
    options(part_size=10 * MiB)  # the 16 MiB tensor goes as parallel parts
    tree = sample_tree(big_rows=1024)
    url = f"{bucket}/models/w.safetensors"
    osf.object_store_stats(reset=True)
    osf.save_file(tree, url, metadata={"who": "test"})
    saved = osf.object_store_stats(reset=True)
    assert saved.put_requests >= 2  # multipart (S3) or staged objects + compose (GCS)
    assert list_keys(server, bucket) == ["models/w.safetensors"]  # no parts left behind
    assert pending_uploads(server, bucket) == []

    official = official_tensors(download(server, url))
    assert sorted(official) == ["params.b", "params.emb", "params.w"]
    np.testing.assert_array_equal(official["params.w"], tree["params"]["w"])
    np.testing.assert_array_equal(official["params.b"], as_comparable(tree["params"]["b"]))

    check_tree(osf.load_file(url), tree)
    assert osf.load_metadata(url)["who"] == "test"
    fetched = osf.object_store_stats(reset=True)
    file_size = len(download(server, url))
    # Header (one 64 KiB request) + the tensors: nothing is read twice.
    assert file_size <= fetched.bytes_fetched <= file_size + 2 * 64 * 1024
    assert fetched.retries == 0


def test_one_percent_of_tensors_fetches_one_percent_of_bytes(store) -> None:
    server, bucket = store
    rng = np.random.default_rng(1)
    tree = {f"t{i:03d}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(100)}
    url = f"{bucket}/many.safetensors"
    osf.save_file(tree, url)
    file_size = len(download(server, url))

    wanted = {"t042": jax.ShapeDtypeStruct((256, 256), jnp.float32)}  # 1 of 100 tensors
    osf.object_store_stats(reset=True)
    got = osf.load_file(url, target=wanted, strict=False)
    stats = osf.object_store_stats()
    np.testing.assert_array_equal(np.asarray(got["t042"]), tree["t042"])
    # 256 KiB of tensor + the 64 KiB header request, in 2 requests: about 1.25 % of the file.
    assert stats.get_requests == 2
    assert 0.01 * file_size <= stats.bytes_fetched <= 0.015 * file_size


def test_checkpoint_manager_async_max_to_keep_atomic(store) -> None:
    server, bucket = store
    root = f"{bucket}/run"
    tree = sample_tree(big_rows=64)
    options = osf.manager_options_for(root, max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in range(3):
            tree["step"] = step
            mngr.save(step, args=osf.SafetensorsSave(tree, metadata={"step": step}))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        restored = mngr.restore(2, args=osf.SafetensorsRestore())
    check_tree(restored, tree)
    keys = list_keys(server, root)
    assert "2/commit_success.txt" in keys and not any(k.startswith("0/") for k in keys)
    assert not any("/.osf-parts/" in k for k in keys)

    # A step whose files are all there but whose commit marker is not is never listed.
    for key in list_keys(server, f"{root}/2"):
        if key != "commit_success.txt":
            upload(server, f"{root}/5/{key}", download(server, f"{root}/2/{key}"))
    with ocp.CheckpointManager(root, options=options) as mngr:
        assert mngr.all_steps() == [1, 2]
        assert mngr.latest_step() == 2

    # Direct use of the same directory layout, no Orbax: restore_directory reads it.
    check_tree(osf.restore_directory(f"{root}/2/default"), tree)


def test_manager_options_for() -> None:
    s3 = osf.manager_options_for("s3://b/run", max_to_keep=3)
    assert s3.temporary_path_class is ocp.path.atomicity.CommitFileTemporaryPath
    assert s3.max_to_keep == 3
    assert osf.manager_options_for("/tmp/run").temporary_path_class is None


@pytest.mark.parametrize(
    "directory",
    [
        "s3://b/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",  # CheckpointManager
        "s3://b/run/0.orbax-checkpoint-tmp/default",  # a rename only at the step level
        "s3://b/ckpt.orbax-checkpoint-tmp",  # ocp.Checkpointer(handler).save("s3://b/ckpt")
        "s3://b/run/ckpt_3.orbax-checkpoint-tmp-1700000000/default/",  # older Orbax, a prefix
    ],
)
def test_rename_commit_on_s3_is_refused_naming_the_fix(directory: str) -> None:
    with pytest.raises(osf.SafetensorsCheckpointError, match=r"osf\.manager_options_for"):
        _steps.check_commit_scheme(directory)


@pytest.mark.parametrize(
    "directory",
    [
        "s3://b/run/0/default",  # CommitFileTemporaryPath (osf.manager_options_for)
        "s3://b.orbax-checkpoint-tmp/run/0/default",  # only the last two levels count
        "gs://b/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",  # gcsfs can rename
        "/tmp/run/0.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp",
    ],
)
def test_commit_file_and_other_stores_pass_the_check(directory: str) -> None:
    _steps.check_commit_scheme(directory)


_DEFAULT_OPTIONS_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import numpy as np
    import orbax.checkpoint as ocp
    import orbax_safetensors as osf

    report = {}
    for mode, root in zip(("async", "sync"), sys.argv[1:3]):
        tree = {"w": np.arange(4 << 20, dtype=np.float32), "step": 0}  # 16 MiB: multipart
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=mode == "async")
        with ocp.CheckpointManager(root, options=options) as mngr:
            try:
                mngr.save(0, args=osf.SafetensorsSave(tree))
            except Exception as error:
                report[mode] = {
                    "raised_in_save": True,
                    "is_osf_error": isinstance(error, osf.SafetensorsCheckpointError),
                    "message": str(error),
                    "thread": threading.current_thread().name,
                }
            else:
                report[mode] = {"raised_in_save": False}
                try:
                    mngr.wait_until_finished()
                except Exception as error:
                    report[mode]["later"] = repr(error)[:500]
    report["done_at"] = time.time()
    print(json.dumps(report), flush=True)
    """
)


@pytest.mark.timeout(240)
def test_default_manager_options_on_s3_fail_in_save_naming_the_fix(s3_server, s3_bucket) -> None:
    """Orbax's default options rename the step directory at commit, which S3 cannot do: the
    save is refused inside ``mngr.save()`` (async and sync), on the caller's thread, before any
    upload, with the fix in the message; the process then exits at once (no hang)."""
    roots = [f"{s3_bucket}/async", f"{s3_bucket}/sync"]
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _DEFAULT_OPTIONS_CHILD, *roots],
        capture_output=True,
        text=True,
        env=s3_server.child_env(),
        timeout=180,
        check=False,
    )
    ended = time.time()
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ended - report["done_at"] < 15, f"exit took {ended - report['done_at']:.1f} s"
    assert ended - start < 150
    for mode, root in zip(("async", "sync"), roots):
        result = report[mode]
        assert result["raised_in_save"], result
        assert result["is_osf_error"] and result["thread"] == "MainThread"
        message = result["message"]
        assert "osf.manager_options_for" in message and f"manager_options_for('{root}'" in message
        # Nothing of ours was uploaded; Orbax itself may have written its step metadata file
        # into the temporary step directory before the handler ran.
        keys = list_keys(s3_server, root)
        assert set(keys) <= {"0.orbax-checkpoint-tmp/_CHECKPOINT_METADATA"}, keys
    assert pending_uploads(s3_server, s3_bucket) == []

    # The fix the message names works on the same root, and the refused attempt is not a step.
    root = roots[0]
    tree = sample_tree(big_rows=16)
    with ocp.CheckpointManager(root, options=osf.manager_options_for(root)) as mngr:
        mngr.save(0, args=osf.SafetensorsSave(tree))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0]
        check_tree(mngr.restore(0, args=osf.SafetensorsRestore()), tree)


_BLOCKED_IMPORT_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules[sys.argv[1]] = None  # as if the package were not installed
    import numpy as np
    import orbax_safetensors as osf

    url = sys.argv[2]
    results = []
    for call in (
        lambda: osf.load_file(url),
        lambda: osf.save_file({"w": np.zeros(4, np.float32)}, url),
    ):
        try:
            call()
            results.append(None)
        except BaseException as error:
            cause = error.__cause__
            results.append(
                {
                    "type": type(error).__name__,
                    "is_import_error": isinstance(error, ImportError),
                    "message": str(error),
                    "cause": type(cause).__name__ if cause is not None else None,
                }
            )
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize(
    ("module", "url", "extra"),
    [
        ("boto3", "s3://no-bucket/w.safetensors", "s3"),
        ("google.cloud.storage", "gs://no-bucket/w.safetensors", "gcs"),
    ],
)
@pytest.mark.main_env_only("the library's own ImportError message for a module it blocks")
def test_missing_client_library_names_the_extra(module: str, url: str, extra: str) -> None:
    """A real ImportError in a child process (the module blocked in ``sys.modules``): loads and
    saves fail with an ImportError that says which extra to install, chaining the original."""
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORT_CHILD, module, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for result in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert result is not None
        assert result["is_import_error"], result
        assert f"pip install 'orbax-safetensors[{extra}]'" in result["message"], result
        assert result["cause"] in ("ImportError", "ModuleNotFoundError"), result


def test_missing_object_is_file_not_found(store) -> None:
    _, bucket = store
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        osf.load_file(f"{bucket}/nope.safetensors")


@pytest.mark.parametrize(
    "url", ["s3://bucket/ckpt/w.safetensors", "gs://bucket/ckpt/w.safetensors"]
)
def test_a_partly_held_file_outside_a_prepared_save_is_refused(url: str) -> None:
    """One process holding part of a file, with no save by several processes prepared for its
    directory: refused before any request (nothing joins ranges later), naming its bytes."""
    pieces = [Piece(0, np.zeros(10, np.uint8)), Piece(50, np.zeros(5, np.uint8))]
    osf.object_store_stats(reset=True)
    with pytest.raises(
        ValueError, match=r"w\.safetensors: this process holds bytes 0-9, 50-54 of 100"
    ):
        _engine.write_file(_engine.store_for(url, _config.resolve(None)), url, pieces, 100)
    assert osf.object_store_stats().requests == 0
