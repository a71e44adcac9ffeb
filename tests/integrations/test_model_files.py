"""Complete Hugging Face model directories (issue 42 point 5): an export writes
``config.json`` as ``save_pretrained`` writes it (the non-default keys), a
``generation_config.json`` (``hf_config``'s directory's, one given, or the one
``save_pretrained`` derives), and, with an ``hf_config`` directory, the tokenizer's files, byte
for byte, and nothing else of it; all of it appears with the weights or not at all. Tiny
configs and tokenizers built in code, no hub downloads."""

from __future__ import annotations

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_safetensors as osf
from orbax_safetensors import cli

transformers = pytest.importorskip("transformers", minversion="5", reason="needs transformers>=5")
torch = pytest.importorskip("torch")
import hf_models  # noqa: E402

# The tensors of a directory under their own names (an export of what load_file reads)
SAME_NAMES = osf.KeyMapping([osf.Rule("{k:.*}", "{k}")])
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def saved(directory, kind="llama", tied=False):
    """A tiny random transformers model of ``kind`` saved with its tokenizer into
    ``directory``, and its weights as a pytree."""
    config = hf_models.tiny_config(kind, tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    hf_models.tiny_tokenizer().save_pretrained(directory)
    return config, osf.load_file(directory / "model.safetensors")


def doc(path):
    return json.loads(path.read_text())


def same_json(a, b, name):
    assert doc(a / name) == doc(b / name), name


@pytest.mark.parametrize(
    "kind, tied", [("llama", False), ("qwen3", True), ("gpt2", False), ("gemma3", True)]
)
def test_config_files_are_what_save_pretrained_writes(tmp_dir, kind, tied):
    config, weights = saved(tmp_dir / "original", kind, tied)
    # (a config as built: save_pretrained set the saved model's dtype and architectures)
    fresh = type(config)(**{k: v for k, v in config.to_dict().items() if k != "architectures"})
    fresh.dtype = None
    assert osf.export_pytorch(weights, tmp_dir / "out", SAME_NAMES, hf_config=fresh).ok
    for name in ("config.json", "generation_config.json"):
        same_json(tmp_dir / "out", tmp_dir / "original", name)
    assert "id2label" not in doc(tmp_dir / "out" / "config.json")  # (a default key)
    assert not (tmp_dir / "out" / "tokenizer.json").exists()  # (a config object: no tokenizer)


def test_hf_config_directory_copies_its_small_files_and_nothing_else(tmp_dir):
    original = tmp_dir / "original"
    _, weights = saved(original)
    transformers.GenerationConfig(
        max_new_tokens=5, do_sample=True, temperature=0.7
    ).save_pretrained(original)
    (original / "tokenizer.model").write_bytes(bytes(range(256)) * 3)  # a binary vocabulary
    (original / "additional_chat_templates").mkdir()
    (original / "additional_chat_templates" / "tools.jinja").write_text("{{ tools }}")
    for other in ("training_args.bin", "README.md", "optimizer.pt"):
        (original / other).write_bytes(b"not a model file")
    out = tmp_dir / "out"
    assert osf.export_pytorch(weights, out, SAME_NAMES, hf_config=original).ok

    copied = (*TOKENIZER, "generation_config.json", "tokenizer.model")
    for name in (*copied, "additional_chat_templates/tools.jinja"):
        assert (out / name).read_bytes() == (original / name).read_bytes(), name
    same_json(out, original, "config.json")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*copied, "config.json", "model.safetensors", "additional_chat_templates"]
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("w5 w7 w9").input_ids == [5, 7, 9]
    chat = [{"role": "user", "content": "w3 w4"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<s>w3 w4</s>"
    got = transformers.GenerationConfig.from_pretrained(out)
    assert (got.max_new_tokens, got.temperature) == (5, 0.7)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and loaded.generation_config.max_new_tokens == 5


def test_generation_config_given_wins(tmp_dir):
    original = tmp_dir / "original"
    config, weights = saved(original)
    given = transformers.GenerationConfig(max_new_tokens=9, do_sample=True, top_p=0.8)
    given.save_pretrained(tmp_dir / "given")
    for value in (given, tmp_dir / "given", tmp_dir / "given" / "generation_config.json"):
        out = tmp_dir / "out"
        osf.export_pytorch(weights, out, SAME_NAMES, hf_config=original, generation_config=value)
        same_json(out, tmp_dir / "given", "generation_config.json")
    as_dict = {"max_new_tokens": 3, "eos_token_id": [2, 0]}
    osf.export_pytorch(weights, out, SAME_NAMES, hf_config=config, generation_config=as_dict)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [2, 0]


def test_dict_config_is_written_as_given(tmp_dir):
    _, weights = saved(tmp_dir / "original")
    given = doc(tmp_dir / "original" / "config.json")
    del given["architectures"], given["dtype"]
    osf.export_pytorch(weights, tmp_dir / "out", SAME_NAMES, hf_config=given, dtype="bfloat16")
    written = doc(tmp_dir / "out" / "config.json")
    assert written == {**given, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}
    same_json(tmp_dir / "out", tmp_dir / "original", "generation_config.json")
    # a model type transformers does not know: no class named, no generation config
    osf.export_pytorch(weights, tmp_dir / "x", SAME_NAMES, hf_config={"model_type": "x"})
    assert doc(tmp_dir / "x" / "config.json") == {"model_type": "x", "dtype": "float32"}
    assert not (tmp_dir / "x" / "generation_config.json").exists()


def test_bad_small_files_are_refused_before_writing(tmp_dir):
    _, weights = saved(tmp_dir / "original")
    (tmp_dir / "empty").mkdir()
    (tmp_dir / "list.json").write_text("[1, 2]")
    cases = [
        ({"hf_config": tmp_dir / "empty"}, ValueError, "a directory without config.json"),
        ({"hf_config": tmp_dir / "missing"}, ValueError, "missing: no such file"),
        ({"hf_config": tmp_dir / "list.json"}, ValueError, "list.json: not a JSON object"),
        ({"hf_config": 3}, TypeError, "hf_config must be"),
        ({"generation_config": 3}, TypeError, "generation_config must be"),
        ({"generation_config": tmp_dir / "empty"}, ValueError, "generation_config .*no such"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            osf.export_pytorch(weights, tmp_dir / "out", SAME_NAMES, **kwargs)
        assert not (tmp_dir / "out").exists()


class _FailsOnData:
    """An identity transform that fails on real tensors (not on the planner's probes)."""

    def to_flax(self, x):
        return x

    def to_torch(self, x):
        if x.size > 1 and all(x.strides):
            raise RuntimeError("disk full")
        return x


def test_a_failed_export_leaves_the_old_directory_whole(tmp_dir):
    original = tmp_dir / "original"
    config, weights = saved(original)
    out = tmp_dir / "out"
    osf.export_pytorch(weights, out, SAME_NAMES, hf_config=config)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failing = osf.KeyMapping([osf.Rule("{k:.*}", "{k}", _FailsOnData())])
    with pytest.raises(RuntimeError, match="disk full"):
        osf.export_pytorch(weights, out, failing, hf_config=original)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no tokenizer yet
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["original", "out"]  # no staging left


def test_servable_item_and_cli_write_complete_directories(tmp_dir, capsys):
    original = tmp_dir / "original"
    _, weights = saved(original)
    root = tmp_dir / "run"
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(
            1,
            args=ocp.args.Composite(
                state=osf.SafetensorsSave(weights),
                served=osf.SafetensorsSave(weights, mapping=SAME_NAMES, hf_config=original),
            ),
        )
        mngr.wait_until_finished()
    # (the weights already carry Hugging Face's names: the CLI maps them with a module)
    (tmp_dir / "same_names.py").write_text(
        "import orbax_safetensors as osf\nmapping = osf.KeyMapping([osf.Rule('{k:.*}', '{k}')])\n"
    )
    argv = ["export", root, tmp_dir / "cli", "--mapping", "same_names:mapping"]
    argv += ["--hf-config", original]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_dir)
        assert cli.main([str(a) for a in [*argv, "--item", "state"]]) == 0, capsys.readouterr()
    for out in (root / "1" / "served", tmp_dir / "cli"):
        for name in (*TOKENIZER, "generation_config.json"):
            assert (out / name).read_bytes() == (original / name).read_bytes(), (out, name)
        same_json(out, original, "config.json")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert transformers.AutoTokenizer.from_pretrained(out)("w4").input_ids == [4]
        np.testing.assert_array_equal(
            model.model.norm.weight.detach().numpy(), np.asarray(weights["model.norm.weight"])
        )
