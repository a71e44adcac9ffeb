"""Multi-process worker of ``benchmarks/maxtext_import_bench.py``.

Started through ``tests/multihost/launcher.run_workers``. Args (``ctx.args``): ``action``
(``ours``: every process calls ``osf.import_pytorch``; ``maxtext``: one process runs MaxText
0.2.5's ``to_maxtext`` conversion, its own functions from the wheel), ``hf`` (the Hugging Face
directory), ``out`` (the checkpoint's root), ``config`` (its config.json's keys). Reports
``seconds`` (until the step is written, after a last barrier), ``peak_extra`` (``VmHWM``
growth over the resident memory before) and ``rchar`` (``/proc/self/io``).
"""

import worker_lib

ctx = worker_lib.init()

import gc  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from orbax.checkpoint import v1 as ocp  # noqa: E402

from benchmarks import procfs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))

import orbax_safetensors as osf  # noqa: E402

STEP = 0
TO_MAXTEXT = "maxtext/checkpoint_conversion/to_maxtext.py"
UTILS = "maxtext/checkpoint_conversion/utils/utils.py"
HANDLING = "maxtext/checkpoint_conversion/utils/tensor_handling.py"
# What to_maxtext.main runs of its own module for an eager safetensors load (its
# eager_load_method default), then of utils.py for the save
CONVERSION = (
    "resolve_scale_key", "_convert_tensor_to_numpy", "_build_multi_axis_stacked_tensor",
    "_build_single_axis_stacked_tensor", "_get_hf_loading_function",
    "_get_maxtext_indices_and_shapes", "_get_maxtext_weight",
)  # fmt: skip
SAVING = ("load_hf_dict_from_safetensors", "shard_jax_weights")


def maxtext(hf: str, out: Path, config: dict) -> None:
    """MaxText's ``to_maxtext.main`` for ``llama3.1-8b``-like models, eager from safetensors,
    bfloat16 (its ``save_dtype``), scanned: its own functions, driven as ``main`` drives them;
    the model's abstract parameters (``get_maxtext_model_info``) are the preset's (the same
    names and shapes, as tests/integrations/test_maxtext_import.py checks), and its
    ``checkpointing.save_checkpoint`` is the Orbax v1 call it makes."""
    import maxtext_loader
    import maxtext_reference
    import torch
    import tqdm
    from safetensors import safe_open

    log = types.SimpleNamespace(log=lambda *a, **k: None)
    handling = {"jax": jax, "np": jax.numpy, "partial": partial, "Any": object}
    source = maxtext_reference.source(HANDLING)
    exec(compile(source[0], source[1], "exec"), handling)  # (all of tensor_handling.py)
    ns = {
        "np": np, "torch": torch, "ml_dtypes": ml_dtypes, "partial": partial, "jax": jax,
        "DType": types.SimpleNamespace(FLOAT32="float32", BFLOAT16="bfloat16",
                                       FLOAT8_E4M3FN="float8_e4m3fn"),
        "List": list, "Any": object, "Callable": object, "tree": jax.tree,
        "apply_hook_fns": handling["apply_hook_fns"], "nesting_depth": handling["nesting_depth"],
        "slice_shape": handling["slice_shape"], "stacked_axes": handling["stacked_axes"],
        "os": os, "pathlib": pathlib, "safe_open": safe_open, "gc": gc, "time": time,
        "logging": logging, "max_logging": log, "tqdm": tqdm.tqdm,
        "snapshot_download": None,
    }  # fmt: skip
    maxtext_loader.functions(TO_MAXTEXT, CONVERSION, ns)
    maxtext_loader.functions(UTILS, SAVING, ns)
    maxtext_config = types.SimpleNamespace(
        scan_layers=True, param_scan_axis=1, num_experts=0, head_dim=config["head_dim"],
        weight_dtype="bfloat16", model_name="llama3.1-8b",
    )  # fmt: skip
    pm = maxtext_reference.param_mapping()
    table = pm.PARAM_MAPPING["llama3.1-8b"](config, maxtext_config, True)
    hooks = pm.HOOK_FNS["llama3.1-8b"](config, maxtext_config, True, saving_to_hf=False)
    # get_maxtext_model_info: {"params-decoder-...": (index, shape)} of the Linen variables
    # ({"params": {"decoder": ...}}), in the tree's order
    mapping = osf.preset_mapping("maxtext-llama3", hf_config=hf, scan_layers=True)
    abstract = osf.abstract_pytorch(hf, mapping)["params"]
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    abstract_dict = {
        "-".join(str(k.key) for k in p): (i, tuple(leaf.shape)) for i, (p, leaf) in enumerate(paths)
    }
    hf_state = ns["load_hf_dict_from_safetensors"](hf, None, None, framework="pt")

    def getter(key: str) -> np.ndarray:  # (to_maxtext's _eager_getter)
        return ns["_convert_tensor_to_numpy"](hf_state[key], "bfloat16")

    weights = [None] * len(abstract_dict)
    for key in table:
        if key not in abstract_dict:
            continue
        index, shape = ns["_get_maxtext_indices_and_shapes"](key, abstract_dict)
        load = ns["_get_hf_loading_function"](
            table[key], getter, hooks.get(key), shape, maxtext_config, key
        )
        ns["_get_maxtext_weight"](load, index, shape, key, weights, "bfloat16", False)
    hf_state.clear()
    missing = [k for k, (i, _) in abstract_dict.items() if weights[i] is None]
    assert not missing, missing
    params = jax.tree_util.tree_unflatten(treedef, weights)
    del weights
    import psutil

    params = ns["shard_jax_weights"](params, len(jax.devices()), psutil.Process())
    state = {"step": STEP, "params": params, "opt_state": {}}
    context = ocp.Context()
    context.array.saving.use_ocdbt = True
    context.array.saving.use_zarr3 = True
    with ocp.training.Checkpointer(out, context=context) as checkpointer:
        checkpointer.save_checkpointables(
            STEP, {"items": state}, custom_metadata={"scan_layers": True}
        )


args = ctx.args
gc.collect()
multihost_utils.sync_global_devices("bench.start")
rss0, io0 = procfs.rss_bytes(), procfs.io_counters()["rchar"]
procfs.reset_peak()
t0 = time.perf_counter()
out = Path(args["out"])
if args["action"] == "ours":
    report = osf.import_pytorch(args["hf"], out, "maxtext-llama3", dtype="bfloat16", step=STEP)
    assert report.ok, report.problems()
else:
    maxtext(args["hf"], out, args["config"])
multihost_utils.sync_global_devices("bench.written")
result = {
    "process_index": jax.process_index(),
    "seconds": time.perf_counter() - t0,
    "peak_extra": max(0, procfs.hwm_bytes() - rss0),
    "rchar": procfs.io_counters()["rchar"] - io0,
}
worker_lib.emit_result(result)
worker_lib.finish()
