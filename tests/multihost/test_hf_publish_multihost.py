"""Publishing every step from a multi-process training job (issue 28, points 2 and 3): N = 2
and N = 4 real ``jax.distributed`` processes (2 CPU devices each) save, per step, a sharded
training state and a servable Hugging Face item (``SafetensorsSave(item, mapping=,
hf_config=)``) in one ``ocp.args.Composite`` through an async ``CheckpointManager`` with
``max_to_keep`` (``workers/hf_publish_worker.py``). The item is the scanned LLaMA of
``workers/hf_export_values.py`` (stacked layers, fused QKV and gate/up cut by shard boundaries,
a head-split output projection re-laid-out on the devices, a replicated and a host-local
tensor) with a rank-2 LoRA adapter on the LM head, sharded over processes, merged as written.

One launch per N, checking many things:

- retention: only the last ``max_to_keep`` steps are left;
- every file of each kept servable item (tensors, index, ``config.json``,
  ``orbax_safetensors.json``) is byte-identical to a one-process save of the same weights:
  in particular the LoRA merge of sharded inputs is bit-identical to the one-process merge;
- each process wrote only its own bytes of the servable item: the processes' counts add up to
  its tensor bytes exactly, a non-primary process wrote at most its 1/N share, and what each
  passed to ``write`` system calls during the step is its two items' bytes plus at most a
  small overhead (headers, index, config and metadata files, checksum shares, the
  collectives' and Orbax's barrier traffic);
- ``transformers.AutoModelForCausalLM.from_pretrained`` loads each kept item with no missing
  or unexpected keys and its logits match the JAX model's within 1e-5 (float32);
- ``SafetensorsRestore(target, mapping=)`` into a sharded target restores the exact values in
  every process, each reading well under the whole item.
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

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(480)]

STEPS, MAX_TO_KEEP = 3, 2
IDS = np.random.default_rng(0).integers(0, V.V, size=(2, 9))
# What a process passes to write() during a step besides its tensor bytes: headers, index,
# config.json and the metadata file (the primary), checksum shares, Orbax's step metadata,
# and the socket traffic of the collectives and barriers.
WRITE_OVERHEAD = 256 << 10
ORBAX_COMMIT_FILE = "commit_success.txt"  # Orbax's, naming the item's temporary path


def _item(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {n: weights[n] for n in V.SPECS if n != "head"}
    lora = {"lora_a": weights["lora_a"], "lora_b": weights["lora_b"]}
    tree["head"] = {"kernel": weights["head"], "lora": lora}
    return tree


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    base = tmp_path_factory.mktemp("hf_publish_mh")
    config = hf_models.tiny_config()
    config_doc = json.loads(config.to_json_string(use_diff=False))
    paths, logits = [], {}
    for step in range(STEPS):
        model = hf_models.CausalLM(config, "llama", rngs=nnx.Rngs(step))
        for layer in model.model.layers:  # norms away from 1: a misplaced norm shows
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                key = jax.random.key(step * 100 + len(str(norm)))
                norm.scale[...] = jax.random.uniform(key, (V.E,)) + 0.5
        weights = V.scanned_weights(model)
        rng = np.random.default_rng(step)
        weights["lora_a"] = (0.1 * rng.standard_normal((V.E, V.RANK))).astype(np.float32)
        weights["lora_b"] = (0.1 * rng.standard_normal((V.RANK, V.V))).astype(np.float32)
        paths.append(str(base / f"weights_{step}.npz"))
        np.savez(paths[-1], **weights)
        merged = weights["head"] + V.LORA_SCALE * (weights["lora_a"] @ weights["lora_b"])
        model.lm_head.kernel[...] = jax.numpy.asarray(merged)
        logits[step] = np.asarray(model(jax.numpy.asarray(IDS)))
    # The one-process reference: the same manager setup, this process alone.
    ref = base / "single"
    handlers = {"policy": osf.SafetensorsCheckpointHandler(max_file_size=40_000)}
    with ocp.CheckpointManager(ref, item_handlers=handlers) as mngr:
        for step, path in enumerate(paths):
            item = _item(dict(np.load(path)))
            args = osf.SafetensorsSave(item, mapping=V.PUBLISH_MAPPING, hf_config=config_doc)
            mngr.save(step, args=ocp.args.Composite(policy=args))
        mngr.wait_until_finished()
    last = dict(np.load(paths[-1]))
    report = osf.export_pytorch(
        _item(last),
        base / "export_lora",
        V.PUBLISH_MAPPING,
        hf_config=config_doc,
        max_file_size=40_000,
    )
    assert report.ok, report.problems()
    with ocp.CheckpointManager(base / "reshaped") as mngr:
        mngr.save(0, args=osf.SafetensorsSave(V.reshape_item(last), mapping=V.RESHAPE_MAPPING))
        mngr.wait_until_finished()
    merged_heads = {}
    for step in range(STEPS):
        served = ref / str(step) / "policy"
        merged_heads[str(step)] = osf.load_pytorch(
            {"head": {"kernel": np.zeros((V.E, V.V), np.float32)}},
            served,
            V.PUBLISH_MAPPING,
            strict=False,
        )["head"]["kernel"]
    np.savez(base / "merged_head.npz", **merged_heads)
    return {"base": base, "config": config_doc, "paths": paths, "ref": ref, "logits": logits}


@pytest.mark.parametrize("n", [2, 4])
def test_processes_publish_only_their_bytes_every_step(setup, n):
    root = setup["base"] / f"run_{n}"
    results = run_workers(
        "hf_publish_worker.py",
        n,
        devices_per_process=2,
        args={
            "root": str(root),
            "weights": setup["paths"],
            "merged_head": str(setup["base"] / "merged_head.npz"),
            "config": setup["config"],
            "max_to_keep": MAX_TO_KEEP,
        },
        timeout=360.0,
    )
    by_pid = {r.process_id: r.result for r in results}
    kept = list(range(STEPS - MAX_TO_KEEP, STEPS))
    assert sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) == kept  # retention
    for i in range(n):
        assert by_pid[i]["all_steps"] == kept
    for step in kept:
        mine, ref = root / str(step) / "policy", setup["ref"] / str(step) / "policy"
        files = sorted(p.name for p in ref.iterdir() if p.name != ORBAX_COMMIT_FILE)
        assert "config.json" in files and "model.safetensors.index.json" in files
        assert sorted(p.name for p in mine.iterdir() if p.name != ORBAX_COMMIT_FILE) == files
        for f in files:
            assert (mine / f).read_bytes() == (ref / f).read_bytes(), f"step {step}: {f} differs"
    # The LoRA merge of sharded inputs, bit-identical to one process's: osf.export_pytorch,
    # and a rule re-laid-out on the devices (merged shard by shard first).
    for mine, ref in [
        (root / "export_lora", setup["base"] / "export_lora"),
        (root / "reshaped" / "0" / "default", setup["base"] / "reshaped" / "0" / "default"),
    ]:
        files = sorted(p.name for p in ref.iterdir() if p.name != ORBAX_COMMIT_FILE)
        assert sorted(p.name for p in mine.iterdir() if p.name != ORBAX_COMMIT_FILE) == files
        for f in files:
            assert (mine / f).read_bytes() == (ref / f).read_bytes(), f"{mine}/{f} differs"
    for step in range(STEPS):
        total = tensor_bytes(setup["ref"] / str(step) / "policy")
        got = [by_pid[i]["steps"][str(step)] for i in range(n)]
        assert sum(g["policy_bytes"] for g in got) == total, (step, got, total)
        for i, g in enumerate(got):
            assert g["policy_bytes"] > 0
            mine = g["policy_bytes"] + g["train_bytes"]
            assert mine <= g["wchar"] <= mine + WRITE_OVERHEAD, (step, i, g)
            if i:  # not the primary: at most its share
                assert g["policy_bytes"] <= total / n, (step, got, total)
    whole = tensor_bytes(setup["ref"] / str(kept[-1]) / "policy")
    for i in range(n):
        for step in kept:
            r = by_pid[i]["restored"][str(step)]
            assert r["exact"], (i, step, r)
            assert r["bytes_needed"] < whole * (0.75 if n == 2 else 0.5), (i, step, r, whole)
    for step in kept:
        served = root / str(step) / "policy"
        hf, info = transformers.AutoModelForCausalLM.from_pretrained(
            served, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            logits = hf.eval()(torch.tensor(IDS)).logits.numpy()
        np.testing.assert_allclose(logits, setup["logits"][step], atol=1e-5, rtol=0)
    print(
        f"N={n}: servable item bytes per process "
        + ", ".join(str(by_pid[i]["steps"][str(kept[-1])]["policy_bytes"]) for i in range(n))
        + f" of {whole}; save() blocked "
        + ", ".join(str(by_pid[i]["steps"][str(kept[-1])]["save_s"]) for i in range(n))
        + " s; restore read "
        + ", ".join(str(by_pid[i]["restored"][str(kept[-1])]["bytes_read"]) for i in range(n))
    )
