"""Gather-free Hugging Face export by real ``jax.distributed`` processes (issue 28, points 2
and 7): N = 2 and N = 4 processes (2 CPU devices each) export a sharded scanned LLaMA
(``workers/hf_export_values.py``: stacked layers, fused QKV and gate/up parts cut by shard
boundaries, a head-split output projection re-laid-out on the devices, a replicated and a
host-local tensor) from memory and from a checkpoint this job saved.

Two launches, each checking many things:

- every file of every export is byte-identical to the one-process export of the same weights
  (so ``safetensors`` and transformers read it as they read that one);
- each process wrote only its own bytes: the processes' byte counts add up to the model's
  tensor bytes exactly, each non-primary process wrote at most its 1/N share of the sharded
  tensors (the replicated and host-local ones are the primary's), and what each passed to
  ``write`` system calls (``/proc/self/io``'s ``wchar``, sockets included) is its count plus
  at most a small overhead (headers, index, ``config.json``, the collectives' traffic);
- ``transformers.AutoModelForCausalLM.from_pretrained`` loads the exports with no missing or
  unexpected keys, and its logits match the JAX model's (``hf_models.CausalLM``) within 1e-5
  in float32.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pytest

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from multihost.launcher import WORKERS_DIR, run_workers
except ImportError:  # tests/ became a package
    from tests.multihost.launcher import WORKERS_DIR, run_workers

sys.path.insert(0, str(WORKERS_DIR))
import hf_export_values as V

import orbax_safetensors as osf

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402
from official_reader import tensor_bytes  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(420)]

IDS = np.random.default_rng(0).integers(0, V.V, size=(2, 9))
# What a process passes to write() besides tensor bytes: headers, index and config.json (the
# primary), and the collectives' socket traffic (barriers, the device re-layout).
WRITE_OVERHEAD = 64 << 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import jax
    from flax import nnx

    base = tmp_path_factory.mktemp("hf_export_mh")
    config = hf_models.tiny_config()
    model = hf_models.CausalLM(config, "llama", rngs=nnx.Rngs(0))
    # norms away from 1 so that a misplaced norm shows in the logits
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.scale[...] = jax.random.uniform(jax.random.key(len(str(norm))), (V.E,)) + 0.5
    weights = V.scanned_weights(model)
    assert {k: v.shape for k, v in weights.items()} == V.SHAPES
    np.savez(base / "weights.npz", **weights)
    config_doc = json.loads(config.to_json_string(use_diff=False))
    single = {}
    for name, kwargs in V.EXPORTS.items():  # the one-process exports, the reference bytes
        single[name] = base / f"single_{name}"
        report = osf.export_pytorch(
            weights, single[name], V.MAPPING, hf_config=config_doc, **kwargs
        )
        assert report.ok, report.problems()
    jax_logits = np.asarray(model(jax.numpy.asarray(IDS)))
    return {
        "base": base,
        "config": config_doc,
        "single": single,
        "jax_logits": jax_logits,
    }


@pytest.mark.parametrize("n", [2, 4])
def test_processes_export_only_their_bytes_byte_identical_and_loadable(setup, n):
    out = setup["base"] / f"by_{n}"
    results = run_workers(
        "hf_export_worker.py",
        n,
        devices_per_process=2,
        args={
            "weights": str(setup["base"] / "weights.npz"),
            "out": str(out),
            "config": setup["config"],
        },
        timeout=240.0,
    )
    by_pid = {r.process_id: r.result for r in results}
    # The checkpoint's reference: this one process exporting the checkpoint the job saved.
    single = dict(setup["single"], from_ckpt=out / "single_from_ckpt")
    kwargs = V.EXPORTS["f32_shards"]
    osf.export_pytorch(
        out / "ckpt",
        single["from_ckpt"],
        V.MAPPING,
        hf_config=setup["config"],
        item="state",
        **kwargs,
    )
    for name in [*V.EXPORTS, "from_ckpt"]:
        mine, ref = out / name, single[name]
        files = sorted(p.name for p in ref.iterdir())
        assert sorted(p.name for p in mine.iterdir()) == files, name
        for f in files:
            assert (mine / f).read_bytes() == (ref / f).read_bytes(), f"{name}/{f} differs"
        total = tensor_bytes(ref)
        written = [by_pid[i][name]["bytes_written"] for i in range(n)]
        assert sum(written) == total, (name, written, total)
        for i in range(n):
            got = by_pid[i][name]
            assert got["bytes_written"] > 0
            assert got["bytes_written"] <= got["wchar"] <= got["bytes_written"] + WRITE_OVERHEAD
            if i:  # not the primary: at most its share, nothing but tensor bytes
                assert got["bytes_written"] <= total / n, (name, written)
    for name in ["f32_shards", "from_ckpt"]:
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            out / name, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            logits = hf.eval()(torch.tensor(IDS)).logits.numpy()
        np.testing.assert_allclose(logits, setup["jax_logits"], atol=1e-5, rtol=0)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(out / "bf16", dtype=torch.bfloat16)
    assert bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    print(
        f"N={n}: per process "
        + ", ".join(f"{by_pid[i]['f32_shards']['bytes_written']}" for i in range(n))
        + " bytes of the f32 export; seconds "
        + ", ".join(str(by_pid[i]["f32_shards"]["seconds"]) for i in range(n))
    )
