"""Fresh-process restore: ``mngr.restore(step)`` with no args, after only ``import orbax_safetensors``.

Usage: ``python restore_no_args.py ROOT STEP [ROOT STEP ...]``. Prints, per checkpoint, one JSON
line describing every leaf of the restored tree (path, Python type, dtype, shape, values), so the
parent test can compare it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import orbax.checkpoint as ocp

import orbax_safetensors  # noqa: F401  (registers the handler; nothing else is registered)


def describe(tree: object) -> list[dict[str, object]]:
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        row: dict[str, object] = {"path": jax.tree_util.keystr(path), "type": type(leaf).__name__}
        if isinstance(leaf, (jax.Array, np.ndarray)):
            host = np.asarray(leaf)
            row.update(
                kind="jax" if isinstance(leaf, jax.Array) else "numpy",
                dtype=str(host.dtype),
                shape=list(host.shape),
                values=host.astype(np.float64).ravel().tolist(),
            )
        else:
            row.update(kind="python", value=leaf)
        out.append(row)
    return out


def main() -> None:
    args = sys.argv[1:]
    for root, step in zip(args[::2], args[1::2]):
        mngr = ocp.CheckpointManager(root)
        restored = mngr.restore(int(step))
        mngr.close()
        if isinstance(restored, ocp.args.Composite):
            restored = dict(restored.items())
            print(json.dumps({"composite": True, "leaves": describe(restored)}))
        else:
            doc = {"composite": False, "top": type(restored).__name__}
            print(json.dumps({**doc, "leaves": describe(restored)}))


if __name__ == "__main__":
    main()
