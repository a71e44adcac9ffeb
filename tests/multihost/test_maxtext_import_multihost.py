"""``import`` on the cluster (issue 48 point 3): N = 2 and N = 4 real ``jax.distributed``
processes (2 CPU devices each) write a Hugging Face LLaMA directory as a MaxText checkpoint
through ``maxtext-llama3`` (its query and key interleaved for RoPE and the query scaled: the
transforms run on the devices, the tensors split over all of them), at N = 2 through the
command line (``orbax-safetensors import --distributed``, scanned), at N = 4 through
``osf.import_pytorch`` (unscanned). Each launch imports twice (the first pays what a process
pays once: compilations, thread pools, Orbax's setup) and checks the second:

- the checkpoint holds what ``load_pytorch`` gives in one process, bit for bit (restored in
  the test process by MaxText's own reader, ``tests/helpers/maxtext_loader.py``, where
  MaxText's wheel is at hand; else by Orbax's ``load``);
- each process read only its share of the files: ``/proc/self/io``'s ``rchar`` (and, through
  the Python API, the load's own count) at most 1.25 times the tensors' bytes / N;
- host memory follows the batch, not the model: each process's peak resident memory growth
  (``VmHWM``, reset through ``/proc/self/clear_refs``) is at most its share of the model
  (the arrays on its CPU devices, which a TPU holds in its own memory) plus the batch plus
  ``MEMORY_CONSTANT``, with the model 16 times the batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import maxtext_checkpoints
import numpy as np
import pytest
from kernel_io import counts_reads

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import run_workers

import orbax_safetensors as osf

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not maxtext_checkpoints.can_import(), reason=maxtext_checkpoints.NO_IMPORT),
]

# A LLaMA of 64 MiB of float32 tensors, in two files
CONFIG = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "vocab_size": 4096, "tie_word_embeddings": False,
}  # fmt: skip
BATCH = 4 << 20
BOUND = 1.25  # bytes read by a process / its share
# What a process holds besides its share of the model and a batch: the batch's PyTorch-side
# arrays beside the ones they become, Orbax's and TensorStore's buffers while it writes, the
# transforms' compiled code and what the allocator keeps of freed memory.
MEMORY_CONSTANT = 24 << 20


def _tensors() -> dict[str, np.ndarray]:
    c, rng = CONFIG, np.random.default_rng(0)
    e, m, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], e), "model.norm.weight": (e,),
              "lm_head.weight": (c["vocab_size"], e)}  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, e),
                   p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, e),
                   p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, e),
                   p + "self_attn.o_proj.weight": (e, c["num_attention_heads"] * d),
                   p + "mlp.gate_proj.weight": (m, e), p + "mlp.up_proj.weight": (m, e),
                   p + "mlp.down_proj.weight": (e, m),
                   p + "input_layernorm.weight": (e,),
                   p + "post_attention_layernorm.weight": (e,)}  # fmt: skip
    return {k: rng.standard_normal(s, np.float32) * 0.05 for k, s in shapes.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import safetensors.numpy

    base = tmp_path_factory.mktemp("maxtext_import")
    hf = base / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(CONFIG))
    tensors = _tensors()
    keys = sorted(tensors)
    files = {f"model-0000{i + 1}-of-00002.safetensors": keys[i::2] for i in range(2)}
    for f, part in files.items():
        safetensors.numpy.save_file({k: tensors[k] for k in part}, str(hf / f), {"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    total = sum(v.nbytes for v in tensors.values())
    assert total >= 16 * BATCH
    return {"base": base, "hf": hf, "total": total}


def _restored(step_dir: Path, want: dict) -> dict:
    """The parameters of a MaxText step: through MaxText's own reader where its wheel is at
    hand, else Orbax's ``load`` of the same request."""
    import jax

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), want)
    if maxtext_checkpoints_wheel():
        import maxtext_loader

        return maxtext_loader.load_params_from_path(step_dir / "items", abstract)
    from orbax.checkpoint import v1 as ocp

    context = ocp.Context()
    context.pytree.loading.partial_load = True
    with context:
        return ocp.load(step_dir, {"params": abstract}, checkpointable_name="items")["params"]


def maxtext_checkpoints_wheel() -> bool:
    import os

    return bool(os.environ.get("OSF_MAXTEXT_WHEEL"))


def _check(setup: dict, n: int, root: Path, name: str, step: int, scan_layers: bool, by_pid):
    import jax

    mapping = osf.preset_mapping("maxtext-llama3", hf_config=setup["hf"], scan_layers=scan_layers)
    want = osf.load_pytorch(None, setup["hf"], mapping)["params"]  # one process
    got = _restored(root / name / str(step), want)
    flat_want, flat_got = (maxtext_checkpoints.flatten(t) for t in (want, got))
    assert sorted(flat_got) == sorted(flat_want)
    for key, value in flat_want.items():
        a, b = np.asarray(flat_got[key]), np.asarray(value)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), key
    meta = json.loads((root / name / str(step) / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"] == {"scan_layers": scan_layers}
    share = setup["total"] / n
    got_ = [by_pid[i][name] for i in range(n)]
    print(
        f"N={n} {name}: read (rchar) {[g['rchar'] for g in got_]}, by the load "
        f"{[g['bytes_read'] for g in got_]} of a share of {share:.0f}; peak host memory (MiB) "
        f"{[round(g['peak'] / (1 << 20), 1) for g in got_]} (first import "
        f"{[round(by_pid[i]['first']['peak'] / (1 << 20), 1) for i in range(n)]}; share "
        f"{share / (1 << 20):.1f}, "
        f"batch {BATCH >> 20}); seconds {[g['seconds'] for g in got_]}"
    )
    for i, g in enumerate(got_):
        if g["bytes_read"] is not None:
            assert g["bytes_read"] <= BOUND * share, (i, g)
        if counts_reads():
            assert g["rchar"] <= BOUND * share, (i, g)
        assert g["peak"] <= share + BATCH + MEMORY_CONSTANT, (i, g)
    del jax


@pytest.mark.parametrize("n", [2, 4])
def test_each_process_reads_and_holds_its_share(setup, n):
    root = setup["base"] / f"n{n}"
    scan_layers, cli = n == 2, n == 2
    spec = {"scan_layers": scan_layers, "batch_bytes": BATCH, "cli": cli}
    imports = {"first": {**spec, "step": 0}, "second": {**spec, "step": 5}}
    results = run_workers(
        "maxtext_import_worker.py",
        n,
        devices_per_process=2,
        args={"hf": str(setup["hf"]), "root": str(root), "imports": imports},
        timeout=300.0,
    )
    by_pid = {r.process_id: r.result for r in results}
    if cli:
        assert "load_parameters_path=" in by_pid[0]["second"]["line"]
    _check(setup, n, root, "second", 5, scan_layers, by_pid)
