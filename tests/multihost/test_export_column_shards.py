"""Kernels sharded along their input axis, exported by 2 real processes: each PyTorch weight's
share would be a column stripe of short runs, so it is re-laid out on the devices into row
blocks (one collective, cast first for bfloat16; with a small batch, a band of rows at a time:
``relayout.relaid_rows``): the files are byte-identical to a
one-process export, and each process writes its own half of the tensor bytes."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import orbax_safetensors as osf
from multihost.launcher import run_workers
from orbax_safetensors._src.pipeline import export


@pytest.mark.parametrize("dtype", ["keep", "bfloat16"])
def test_column_shards_are_re_laid_out_into_row_blocks(tmp_path: Path, dtype: str) -> None:
    rows, cols = 64, 2 * export.MANY_RUNS  # torch weight (cols, rows): one run per row
    out = tmp_path / "hf"
    args = {"out": str(out), "dtype": dtype, "rows": rows, "cols": cols}
    if dtype == "bfloat16":  # a small batch: each weight re-laid out in 8 bands of rows
        args["batch_bytes"] = cols * rows * 4 // 8
    results = run_workers("export_column_shards_worker.py", 2, args=args, timeout=240)
    rng = np.random.default_rng(0)
    weights = {
        f"l{i}.kernel": rng.standard_normal((rows, cols), dtype=np.float32) for i in range(3)
    }
    mapping = osf.KeyMapping([osf.Rule("layers.{i}.weight", "l{i}.kernel", osf.Transpose())])
    ref = tmp_path / "ref"
    osf.export_pytorch(weights, ref, mapping, dtype=None if dtype == "keep" else jnp.bfloat16)
    names = sorted(p.name for p in ref.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    itemsize = 4 if dtype == "keep" else 2
    total = 3 * rows * cols * itemsize
    assert [r.result["bytes_written"] for r in results] == [total // 2, total // 2]
    # one compiled re-layout serves the three layers (keyed without their names), and
    # their bands of rows alike
    assert [r.result["relayouts"] for r in results] == [1, 1]
