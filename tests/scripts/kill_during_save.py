"""Saves step 1 (committed), starts an async save of step 2, then SIGKILLs itself.

Usage: ``python kill_during_save.py ROOT MODE``. MODE ``after-save`` kills right after ``save()``
returns; ``mid-write`` waits until the step's safetensors file exists (its bytes are being
written), then kills. Either way the process never reaches ``wait_until_finished()``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import orbax.checkpoint as ocp

import orbax_safetensors as osf


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(1, args=osf.SafetensorsSave({"w": jnp.arange(6.0), "b": jnp.ones((2, 3))}))
    mngr.wait_until_finished()
    # 64 MiB: writing and fsyncing it takes far longer than the kill below.
    big = {f"w{i}": jnp.full((1024, 1024), i, jnp.float32) for i in range(16)}
    mngr.save(2, args=osf.SafetensorsSave(big))
    if mode == "mid-write":
        target = os.path.join(
            root, "2.orbax-checkpoint-tmp", "default.orbax-checkpoint-tmp", "model.safetensors"
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(target) and time.monotonic() < deadline:
            time.sleep(0.0005)
    print("killing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
