"""A CheckpointManager over one safetensors item, for the tests that save and restore whole
steps (crashes, full disks), and the environment of their subprocesses, which run a test file
as a script and import this module too."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

import orbax_safetensors as osf


def state_manager(root: Path, **options: Any) -> ocp.CheckpointManager:
    """A manager at ``root`` whose one item, ``state``, the safetensors handler saves;
    ``options``: ``CheckpointManagerOptions`` fields.

    Example::

        with state_manager(tmp_path, max_to_keep=2) as mngr:
            mngr.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(tree)))
    """
    return ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(**options),
        item_names=("state",),
        item_handlers={"state": osf.SafetensorsCheckpointHandler()},
    )


def script_env(**variables: str) -> dict[str, str]:
    """This process's environment plus ``variables``, with ``tests/helpers/`` on
    ``PYTHONPATH`` (a test file run as a script imports this module).

    Example::

        subprocess.run([sys.executable, __file__], env=script_env(JAX_PLATFORMS="cpu"))
    """
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, **variables, PYTHONPATH=path)
