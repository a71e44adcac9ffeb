"""Config values that contradict the checkpoint are refused, never believed (issue 46, class 2).

A Hugging Face config (``hf_config=``, ``--hf-config``) whose sizes are impossible (zero,
negative, not whole numbers, heads that do not divide) or contradict the stored tensors (a
vocabulary smaller than the embedding, or far larger, heads or ``head_dim`` the kernels do not
have, layers, MLP widths) goes through every verb and API that reads one: ``export_pytorch``
from memory and from a checkpoint, ``SafetensorsSave(mapping=, hf_config=)`` through a real
CheckpointManager, the CLI's ``export --hf-config`` and ``load_pytorch`` into a MaxText train
state's parameters (and into the tree the files imply). Each is refused with one error naming
the config key, the number it claims and the number the tensors give (a ``ConfigError`` for an
impossible value, a ``TargetMismatchError`` for a contradiction), before anything is written
(no output directory, no step) and before anything the claim sizes is allocated.

Two routes into an export: the MaxText preset built from the bad config (its transforms carry
the claim: ``"mapping"``), and a good preset with the bad config as the ``config.json`` written
beside the tensors (``"config.json"``).
"""

from __future__ import annotations

import json
import re

import jax
import maxtext_checkpoints as mc
import orbax.checkpoint as ocp
import pytest
import traced_memory
from managers import state_manager

import orbax_safetensors as osf
from orbax_safetensors._src.tools import cli

DIMS = mc.Dims()  # vocabulary 96, width 32, 4 heads and 2 key/value heads of 8, MLP 64, 2 layers
GOOD = {**mc.hf_config(DIMS), "intermediate_size": DIMS.mlp, "num_hidden_layers": DIMS.layers}
PRESET = "maxtext-llama3"
HUGE = 1 << 40  # rows: a claim that would fail to allocate (128 TiB of float32 embedding)

# name: (what the bad config changes, the error, what its message must say: the key, the
# claimed number, the tensors' number; alternatives where routes word it differently)
CONFIG, MISMATCH = osf.ConfigError, osf.TargetMismatchError
BAD = {
    "vocab-negative": ({"vocab_size": -5}, CONFIG, [r"vocab_size is -5, not positive"]),
    "vocab-zero": ({"vocab_size": 0}, CONFIG, [r"vocab_size is 0, not positive"]),
    "vocab-not-whole": ({"vocab_size": 96.5}, CONFIG, [r"vocab_size is 96\.5, not a whole"]),
    "vocab-smaller": ({"vocab_size": 48}, MISMATCH, [r"vocab_size 48", r"96 rows"]),
    "vocab-huge": ({"vocab_size": HUGE}, MISMATCH, [rf"vocab_size {HUGE}", r"96 rows"]),
    "kv-heads-not-dividing": (
        {"num_key_value_heads": 3},
        CONFIG,
        [r"num_key_value_heads 3 does not divide num_attention_heads 4"],
    ),
    "heads-not-dividing": (
        {"head_dim": None, "hidden_size": 30},
        CONFIG,
        [r"hidden_size 30 does not split into num_attention_heads 4"],
    ),
    "head-dim-contradicts": (
        {"head_dim": 16},
        MISMATCH,
        [r"head_dim 16", r"heads of head_dim 8|has 32 (rows|columns)|size 32"],
    ),
    "heads-contradict": (
        {"num_attention_heads": 8},
        MISMATCH,
        [
            r"not 8 heads|into 8 heads|num_attention_heads 8",
            r"hold 4 heads|has 32 (rows|columns)|size 32",
        ],
    ),
    # sizes no MaxText transform reads: the config.json written beside the tensors claims them
    "layers-contradict": (
        {"num_hidden_layers": 3},
        MISMATCH,
        [r"num_hidden_layers 3", r"layers 0 to 1 \(2\)"],
    ),
    # a count is compared by arithmetic, never built as a set of the claimed size
    "layers-huge": (
        {"num_hidden_layers": HUGE},
        MISMATCH,
        [rf"num_hidden_layers {HUGE}", r"layers 0 to 1 \(2\)"],
    ),
    "width-contradicts": (
        {"intermediate_size": 128},
        MISMATCH,
        [r"intermediate_size 128", r"has 64 rows"],
    ),
}
# What a load reads of the config: the vocabulary, heads and head_dim (the rest shapes nothing)
LOADED = [n for n in BAD if n not in ("layers-contradict", "layers-huge", "width-contradicts")]


def bad_config(name: str) -> dict:
    return {**GOOD, **BAD[name][0]}


def refused(name: str):
    """``pytest.raises`` of case ``name``'s error; the message is checked by :func:`says`."""
    return pytest.raises(BAD[name][1])


def says(name: str, message: str) -> None:
    for pattern in BAD[name][2]:
        assert re.search(pattern, message), (pattern, message)


def params() -> dict:
    return {"params": {"params": mc.llama_params(DIMS)}}


def _served_manager(tmp) -> ocp.CheckpointManager:
    """The manager of ``tmp/served``: item ``hf``, saved with a mapping (``saved``)."""
    item = {"hf": osf.SafetensorsCheckpointHandler()}
    return ocp.CheckpointManager(tmp / "served", item_names=("hf",), item_handlers=item)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of MaxText-layout parameters (a real CheckpointManager, item ``state``),
    the Hugging Face directory exported from it with the good config, and a manager root
    whose item ``hf`` holds it in that layout (``SafetensorsSave(mapping=)``)."""
    tmp = tmp_path_factory.mktemp("claims")
    with state_manager(tmp / "ckpt") as mngr:
        mngr.save(1, args=ocp.args.Composite(state=osf.SafetensorsSave(params())))
        mngr.wait_until_finished()
    good = osf.preset_mapping(PRESET, hf_config=GOOD)
    assert osf.export_pytorch(params(), tmp / "hf", good, hf_config=GOOD).ok
    with _served_manager(tmp) as mngr:  # the Hugging Face layout as a manager's item
        mngr.save(1, args=ocp.args.Composite(hf=osf.SafetensorsSave(params(), mapping=good)))
        mngr.wait_until_finished()
    jax.devices()  # (outside the measured regions)
    return tmp


def mapping_and_config(route: str, name: str, tmp) -> tuple:
    """The mapping and the ``hf_config`` of ``route`` for case ``name`` (the preset built
    here: an impossible config raises from it, inside the caller's ``pytest.raises``)."""
    config = bad_config(name)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    if route == "mapping":
        return osf.preset_mapping(PRESET, hf_config=config), path
    return osf.preset_mapping(PRESET, hf_config=GOOD), path


ROUTES = ["mapping", "config.json"]


# --------------------------------------------------------------------------- exports


@pytest.mark.parametrize("source", ["memory", "checkpoint"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BAD))
def test_export_pytorch_refuses(name, route, source, saved, tmp_path):
    # a tree in memory with the config as a dict; the checkpoint with its config.json's path
    out = tmp_path / "out"
    with refused(name) as e:
        mapping, path = mapping_and_config(route, name, tmp_path)
        if source == "memory":
            osf.export_pytorch(params(), out, mapping, hf_config=bad_config(name))
        else:
            osf.export_pytorch(saved / "ckpt", out, mapping, hf_config=path, item="state")
    says(name, str(e.value))
    assert not out.exists()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(BAD))
def test_safetensors_save_through_a_manager_refuses(name, route, saved, tmp_path):
    root = tmp_path / "run"
    item = {"hf": osf.SafetensorsCheckpointHandler()}
    with ocp.CheckpointManager(root, item_names=("hf",), item_handlers=item) as mngr:
        with refused(name) as e:
            mapping, _ = mapping_and_config(route, name, tmp_path)
            save = osf.SafetensorsSave(params(), mapping=mapping, hf_config=bad_config(name))
            mngr.save(1, args=ocp.args.Composite(hf=save))
        mngr.wait_until_finished()
        assert mngr.all_steps() == []
    says(name, str(e.value))
    assert not (root / "1").exists()


@pytest.mark.parametrize("name", list(BAD))
def test_cli_export_refuses(name, saved, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(bad_config(name)))
    out = tmp_path / "out"
    argv = ["export", str(saved / "ckpt"), str(out), "--mapping", PRESET, "--item", "state"]
    code = cli.main([*argv, "--hf-config", str(path)])
    printed, err = capsys.readouterr()
    assert code == 2 and not printed
    assert err.startswith("orbax-safetensors export: error: ") and err.count("\n") == 1, err
    says(name, err)
    assert not out.exists()


# --------------------------------------------------------------------------- loads


@pytest.mark.parametrize("target", ["train-state", "derived"])
@pytest.mark.parametrize("name", LOADED)
def test_load_refuses(name, target, saved):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params())
    with refused(name) as e:
        mapping = osf.preset_mapping(PRESET, hf_config=bad_config(name))
        osf.load_pytorch(abstract if target == "train-state" else None, saved / "hf", mapping)
    says(name, str(e.value))


@pytest.mark.parametrize("name", LOADED)
def test_manager_restore_refuses(name, saved):
    # SafetensorsRestore(target, mapping=) through a real CheckpointManager: the mapping a
    # bad config builds is refused against the stored tensors, as load_pytorch refuses it.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params())
    with _served_manager(saved) as mngr, refused(name) as e:
        mapping = osf.preset_mapping(PRESET, hf_config=bad_config(name))
        restore = osf.SafetensorsRestore(abstract, mapping=mapping)
        mngr.restore(1, args=ocp.args.Composite(hf=restore))
    says(name, str(e.value))


def test_load_refuses_a_padding_past_the_promise(saved):
    # the MaxText vocabulary a load pads to (vocab_size=) is a padding or refused, unallocated
    mapping = osf.preset_mapping(PRESET, hf_config=GOOD, vocab_size=HUGE)
    with pytest.raises(MISMATCH, match=rf"padded vocab_size={HUGE} and the tensor's 96 rows"):
        osf.load_pytorch(None, saved / "hf", mapping)
    padded = osf.preset_mapping(PRESET, hf_config=GOOD, vocab_size=128)  # within it
    tree = osf.load_pytorch(None, saved / "hf", padded)
    assert tree["params"]["params"]["token_embedder"]["embedding"].shape == (128, DIMS.embed)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("verb", ["export", "load"])
def test_a_claim_allocates_nothing(verb, saved, tmp_path):
    # A claim that would allocate 256 MiB (of a 12 KiB embedding) is refused with what the
    # plan itself takes: memory is bounded by the checkpoint, never by a config.
    claim = 1 << 21
    config = {**GOOD, "vocab_size": claim}

    def run():
        with pytest.raises(MISMATCH, match=f"vocab_size {claim}"):
            mapping = osf.preset_mapping(PRESET, hf_config=config)
            if verb == "export":
                osf.export_pytorch(params(), tmp_path / "out", mapping, hf_config=config)
            else:
                osf.load_pytorch(None, saved / "hf", mapping)

    run()  # (imports and caches outside the measure)
    assert traced_memory.traced_peak(run) < 8 << 20  # (a 32nd of what the claim would take)
