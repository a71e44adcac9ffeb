"""``orbax-safetensors export``: a checkpoint as a Hugging Face model directory, through a
preset or a ``module:attr`` mapping; every failure one ``error:`` line, exit status 2."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("orbax-safetensors export: error: "), err


@pytest.fixture
def trained(tmp_path):
    """A CheckpointManager root whose steps hold a LLaMA port's nnx.State and a JSON item."""
    config = hf_models.tiny_config()
    (tmp_path / "config.json").write_text(config.to_json_string())
    model = hf_models.CausalLM(config, rngs=nnx.Rngs(0))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        for step in (10, 20):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    model=osf.SafetensorsSave(nnx.state(model, nnx.Param)),
                    meta=ocp.args.JsonSave({"step": step}),
                ),
            )
        mngr.wait_until_finished()
    return tmp_path, model


def test_export_preset_loads_in_transformers(trained, capsys):
    tmp, model = trained
    code, out, err = run(
        capsys,
        "export",
        tmp / "ckpt",
        tmp / "hf",
        "--mapping",
        "llama",
        "--hf-config",
        tmp / "config.json",
        "--item",
        "model",
        "--dtype",
        "*norm*=keep",
        "--dtype",
        "*=bfloat16",
        "--max-file-size",
        "40KB",
    )
    assert code == 0, err
    assert out.startswith("exported 21 tensors (") and "model.safetensors.index.json" in out
    assert "config.json" in out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    ids = np.arange(12).reshape(2, 6)
    with torch.no_grad():
        got = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(got, np.asarray(model(jnp.asarray(ids))), atol=0.1)
    index = json.loads((tmp / "hf" / "model.safetensors.index.json").read_text())
    norm_file = index["weight_map"]["model.norm.weight"]
    assert (
        safetensors.numpy.load_file(str(tmp / "hf" / norm_file))["model.norm.weight"].dtype
        == np.float32
    )


def test_export_module_attr_mapping_and_step(trained, capsys, monkeypatch):
    tmp, _ = trained
    (tmp / "my_mapping.py").write_text(
        "import orbax_safetensors as osf\ndef mapping():\n    return osf.preset_mapping('llama')\n"
    )
    monkeypatch.chdir(tmp)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    code, _, err = run(
        capsys,
        "export",
        tmp / "ckpt",
        tmp / "hf10",
        "--mapping",
        "my_mapping:mapping",
        "--item",
        "model",
        "--step",
        "10",
    )
    assert code == 0, err
    assert sorted(p.name for p in (tmp / "hf10").iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--mapping", "nope"], "neither a preset"),
        (["--mapping", "no_such_module_xyz:m"], "cannot import"),
        (["--mapping", "json:dumps"], "not an osf.KeyMapping"),
        (["--mapping", "llama", "--hf-config", "missing.json"], "no such file"),
        (["--mapping", "llama", "--dtype", "float99"], "float99"),
        (["--mapping", "llama", "--item", "meta"], "no tensor item 'meta'"),
        (["--mapping", "llama", "--item", "model", "--step", "5"], "no committed step 5"),
        (["--mapping", "gpt2", "--item", "model"], "no rule maps these keys"),
    ],
)
def test_failures_are_one_error_line(trained, capsys, extra, message):
    tmp, _ = trained
    code, _, err = run(capsys, "export", tmp / "ckpt", tmp / "out", *extra)
    assert code == 2
    one_error_line(err)
    assert message in err
