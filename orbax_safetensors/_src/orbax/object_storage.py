"""Orbax's rules for object storage: the manager options that work on ``s3://`` (a commit
marker instead of a rename), and the refusal of a save Orbax would commit by renaming on S3.

Example::

    options = manager_options_for("s3://bucket/run", max_to_keep=3)
    refuse_renaming_commit("s3://bucket/run/0.orbax-checkpoint-tmp/default")  # raises
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from orbax_safetensors._src.core.errors import SafetensorsCheckpointError
from orbax_safetensors._src.orbax import steps as _steps


def check_commit_scheme(directory: str) -> None:
    """Raises if Orbax will commit the save into ``directory`` by renaming it on ``s3://``:
    S3 has no rename, so the save would upload everything and then fail in Orbax's background
    commit. Orbax's default ``AtomicRenameTemporaryPath`` writes into a temporary name
    (``<step>.orbax-checkpoint-tmp``, or such an item directory) and renames it;
    ``CommitFileTemporaryPath`` writes ``<root>/<step>/<item>`` in place."""
    directory = os.fspath(directory).rstrip("/")
    if not directory.startswith("s3://"):
        return
    parts = directory.split("/")
    flagged = [
        i for i in range(max(3, len(parts) - 2), len(parts)) if _steps.TMP_SUFFIX in parts[i]
    ]
    if not flagged:
        return
    root = "/".join(parts[: flagged[0]])
    raise SafetensorsCheckpointError(
        f"{directory}: Orbax is saving this step into a temporary directory that it renames "
        "when done (its default AtomicRenameTemporaryPath), and S3 cannot rename: the commit "
        "would fail after every upload. Create the manager with "
        f"ocp.CheckpointManager({root!r}, options=osf.manager_options_for({root!r}, ...)) "
        "(for an ocp.Checkpointer: temporary_path_class="
        "ocp.path.atomicity.CommitFileTemporaryPath). No tensor data was uploaded."
    )


def wait_for_orbax_directories(timeout: float = 60.0) -> None:
    """Waits (at most ``timeout`` seconds) until Orbax has created this save's directories,
    for the same signals the handler's own writes wait for."""
    # Orbax creates them in a background thread before it calls the handler. A save() that
    # raises before they exist leaves that thread racing close(), which shuts down the executor
    # it writes the step metadata with; it then dies before signalling, and a thread waiting
    # for its signal keeps the process from exiting until Orbax's coordination timeout.
    from orbax.checkpoint import future as ocp_future

    async def nothing() -> None:
        return None

    with contextlib.suppress(Exception):  # best effort: the caller's error matters more
        ocp_future.CommitFutureAwaitingContractedSignals(
            nothing(), name="osf_refused_save", timeout_secs=int(timeout)
        ).result(timeout=timeout)


def refuse_renaming_commit(directory: Any) -> None:
    """Raises (see :func:`check_commit_scheme`) if Orbax would commit a save into ``directory``
    by renaming it on ``s3://``, after letting Orbax create this save's directories."""
    try:
        check_commit_scheme(directory)  # the same answer on every process
    except SafetensorsCheckpointError:
        wait_for_orbax_directories()
        raise


def manager_options_for(path: Any, **kwargs: Any) -> Any:
    """``ocp.CheckpointManagerOptions(**kwargs)`` that work for ``path``'s storage.

    On ``s3://`` Orbax's default atomic rename does not work; a step is committed instead by
    writing ``commit_success.txt`` last (``CommitFileTemporaryPath``, Orbax's default on
    ``gs://``), and a step without it is never listed. Other paths keep Orbax's defaults.

    Example::

        options = osf.manager_options_for("s3://bucket/run", max_to_keep=3)
        mngr = ocp.CheckpointManager("s3://bucket/run", options=options)
    """
    import orbax.checkpoint as ocp

    if os.fspath(path).startswith("s3://") and "temporary_path_class" not in kwargs:
        kwargs["temporary_path_class"] = ocp.path.atomicity.CommitFileTemporaryPath
    return ocp.CheckpointManagerOptions(**kwargs)
