"""PyTorch / Hugging Face checkpoints into a Flax NNX port and back, proved with PyTorch itself:
files written by ``safetensors.torch`` (and by ``huggingface_hub``'s sharded writer) are loaded
into the NNX model, whose outputs must match the torch model's; exports are loaded by
``safetensors.torch.load_file`` into the torch model with ``load_state_dict(strict=True)``."""

from __future__ import annotations

import json
import math

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import orbax_safetensors as osf

torch = pytest.importorskip("torch", reason="needs PyTorch (in the main environment)")
import safetensors.torch  # noqa: E402  (imports torch)

NnxList = getattr(nnx, "List", list)  # nnx.List: flax >= 0.12 (0.11 takes a plain list)

VOCAB, DIM, HEADS, CLASSES, LAYERS = 40, 16, 4, 5, 2


# --------------------------------------------------------------------------- the torch model


class TorchAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(dim, dim)
        self.v_proj = torch.nn.Linear(dim, dim)
        self.o_proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        d = e // self.heads

        def split(y):
            return y.view(b, t, self.heads, d).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, e))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.attn = TorchAttention(DIM, HEADS)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, 2 * DIM)
        self.fc2 = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class TorchModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([TorchBlock() for _ in range(LAYERS)])
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------- its NNX port


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x)), approximate=False))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = NnxList([Block(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.classifier = nnx.Linear(DIM, CLASSES, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.classifier(self.final_norm(x))


MAPPING = osf.KeyMapping(
    [
        *osf.Rule.embedding("embed", "embed"),
        *osf.Rule.layer_norm("layers.{i}.norm1", "blocks.{i}.ln1"),
        *osf.Rule.layer_norm("layers.{i}.norm2", "blocks.{i}.ln2"),
        *osf.Rule.linear("layers.{i}.attn.q_proj", "blocks.{i}.attn.query", heads=HEADS),
        *osf.Rule.linear("layers.{i}.attn.k_proj", "blocks.{i}.attn.key", heads=HEADS),
        *osf.Rule.linear("layers.{i}.attn.v_proj", "blocks.{i}.attn.value", heads=HEADS),
        *osf.Rule.linear(
            "layers.{i}.attn.o_proj", "blocks.{i}.attn.out", heads=HEADS, heads_on="input"
        ),
        *osf.Rule.linear("layers.{i}.fc1", "blocks.{i}.up"),
        *osf.Rule.linear("layers.{i}.fc2", "blocks.{i}.down"),
        *osf.Rule.layer_norm("norm", "final_norm"),
        *osf.Rule.linear("head", "classifier"),
    ]
)


def torch_model(seed=0):
    torch.manual_seed(seed)
    model = TorchModel().eval()
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot pass
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


IDS = np.random.default_rng(0).integers(0, VOCAB, size=(3, 7))


def torch_out(model):
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).numpy()


def assert_same_outputs(flax_model, tmodel):
    np.testing.assert_allclose(
        np.asarray(flax_model(jnp.asarray(IDS))), torch_out(tmodel), rtol=1e-4, atol=1e-5
    )


# --------------------------------------------------------------------------- loading


def test_load_state_dict_file_gives_same_outputs(tmp_dir):
    tmodel = torch_model()
    safetensors.torch.save_file(
        tmodel.state_dict(), tmp_dir / "model.safetensors", metadata={"format": "pt"}
    )
    model = Model(nnx.Rngs(1))
    report = osf.load_pytorch(model, tmp_dir / "model.safetensors", MAPPING)
    assert report.ok and len(report.moved) == len(tmodel.state_dict())
    assert ("layers.1.attn.q_proj.weight", "blocks.1.attn.query.kernel") in report.moved
    assert_same_outputs(model, tmodel)


def test_load_hf_sharded_directory(tmp_dir):
    """Shards and index written by the Hugging Face Hub library itself."""
    hub = pytest.importorskip("huggingface_hub")
    tmodel = torch_model(seed=3)
    hub.save_torch_state_dict(tmodel.state_dict(), tmp_dir, max_shard_size=4000)
    assert (tmp_dir / "model.safetensors.index.json").exists()
    assert len(list(tmp_dir.glob("model-*.safetensors"))) > 2
    model = Model(nnx.Rngs(1))
    osf.load_pytorch(model, tmp_dir, MAPPING)
    assert_same_outputs(model, tmodel)


def test_load_hand_sharded_directory_with_bf16_weights(tmp_dir):
    """HF layout written with plain safetensors.torch: weights cast to the model's dtype."""
    tmodel = torch_model(seed=4)
    state = {k: v.to(torch.bfloat16) for k, v in tmodel.state_dict().items()}
    keys = sorted(state)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors.torch.save_file(
            {k: state[k] for k in shard}, tmp_dir / name, metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(shard, name))
    weight_map[shards[1][0]] = "./" + weight_map[shards[1][0]]  # (one shard, named two ways)
    (tmp_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    model = Model(nnx.Rngs(1))
    osf.load_pytorch(model, tmp_dir, MAPPING)
    assert model.classifier.kernel[...].dtype == jnp.float32
    tmodel_bf16 = torch_model(seed=4)
    tmodel_bf16.load_state_dict({k: v.float() for k, v in state.items()})
    assert_same_outputs(model, tmodel_bf16)


def test_problems_are_reported_all_at_once(tmp_dir):
    tmodel = torch_model()
    state = dict(tmodel.state_dict())
    state["extra.weight"] = torch.ones(2)  # no rule
    del state["head.bias"]  # the model's classifier.bias gets nothing
    state["layers.0.fc1.weight"] = torch.ones(3, DIM)  # wrong shape
    safetensors.torch.save_file(state, tmp_dir / "bad.safetensors")
    model = Model(nnx.Rngs(1))
    before = np.asarray(model.embed.embedding[...])
    with pytest.raises(osf.TargetMismatchError) as e:
        osf.load_pytorch(model, tmp_dir / "bad.safetensors", MAPPING)
    msg = str(e.value)
    assert "no rule maps these keys (1):\n  extra.weight" in msg
    assert "model variables nothing maps to (1):\n  classifier.bias" in msg
    assert (
        "layers.0.fc1.weight F32[3, 16] becomes [16, 3] but blocks.0.up.kernel is [16, 32]" in msg
    )
    np.testing.assert_array_equal(model.embed.embedding[...], before)  # nothing loaded
    report = osf.load_pytorch(model, tmp_dir / "bad.safetensors", MAPPING, strict=False)
    assert (
        not report.ok
        and report.unmapped == ["extra.weight"]
        and report.missing == ["classifier.bias"]
    )
    np.testing.assert_array_equal(model.embed.embedding[...], tmodel.embed.weight.detach().numpy())


def test_unexpected_and_ignored_keys(tmp_dir):
    safetensors.torch.save_file(
        {
            "lin.weight": torch.ones(3, 2),
            "lin.bias": torch.zeros(3),
            "bn.num_batches_tracked": torch.tensor(5),
        },
        tmp_dir / "m.safetensors",
    )
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    mapping = osf.KeyMapping(
        [
            osf.Rule("lin.weight", "kernel", osf.Transpose()),
            osf.Rule("lin.bias", "bias"),
            osf.Rule("x", "nope"),
        ],
        ignore_torch=[r".*\.num_batches_tracked"],
    )
    report = osf.load_pytorch(model, tmp_dir / "m.safetensors", mapping)
    assert report.ok and report.ignored == ["bn.num_batches_tracked"]
    safetensors.torch.save_file({"x": torch.ones(1)}, tmp_dir / "x.safetensors")
    report = osf.load_pytorch(model, tmp_dir / "x.safetensors", mapping, strict=False)
    assert report.unexpected == ["x -> nope"] and set(report.missing) == {"kernel", "bias"}


def test_load_into_sharded_model_keeps_sharding(tmp_dir):
    tmodel = torch.nn.Linear(8, 16)
    safetensors.torch.save_file(tmodel.state_dict(), tmp_dir / "lin.safetensors")
    mesh = devices.mesh((2, 4), ("a", "b"))
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    model.kernel[...] = jax.device_put(model.kernel[...], sharding)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    model.bias[...] = jax.device_put(model.bias[...], replicated)
    mapping = osf.KeyMapping(
        [osf.Rule("weight", "kernel", osf.Transpose()), osf.Rule("bias", "bias")]
    )
    osf.load_pytorch(model, tmp_dir / "lin.safetensors", mapping)
    assert model.kernel[...].sharding == sharding and model.bias[...].sharding == replicated
    x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    np.testing.assert_allclose(
        model(x), tmodel(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6
    )


# --------------------------------------------------------------------------- export


def test_export_model_loads_into_torch_strict(tmp_dir):
    model = Model(nnx.Rngs(7))
    report = osf.export_pytorch(model, tmp_dir / "hf", MAPPING)
    assert report.ok
    assert sorted(p.name for p in (tmp_dir / "hf").iterdir()) == ["model.safetensors"]
    with safetensors.safe_open(str(tmp_dir / "hf" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tmodel = TorchModel().eval()
    tmodel.load_state_dict(
        safetensors.torch.load_file(tmp_dir / "hf" / "model.safetensors"), strict=True
    )
    assert_same_outputs(model, tmodel)


def test_export_sharded_with_index_loads_with_hf_hub(tmp_dir):
    model = Model(nnx.Rngs(8))
    osf.export_pytorch(model, tmp_dir / "hf", MAPPING, max_file_size=5000, batch_bytes=3000)
    index = json.loads((tmp_dir / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    state = {}
    for f in files:  # the reference reader, shard by shard
        state.update(safetensors.torch.load_file(tmp_dir / "hf" / f))
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in state.values()
    )
    tmodel = TorchModel().eval()
    tmodel.load_state_dict(state, strict=True)
    assert_same_outputs(model, tmodel)
    hub = pytest.importorskip("huggingface_hub")
    tmodel2 = TorchModel().eval()
    hub.load_torch_model(tmodel2, tmp_dir / "hf", strict=True)
    assert_same_outputs(model, tmodel2)


def test_export_from_checkpoint_directory_round_trips(tmp_dir):
    """Load torch weights, train-free save as our checkpoint, export that back to torch."""
    tmodel = torch_model(seed=9)
    safetensors.torch.save_file(tmodel.state_dict(), tmp_dir / "in.safetensors")
    model = Model(nnx.Rngs(1))
    osf.load_pytorch(model, tmp_dir / "in.safetensors", MAPPING)
    osf.save_directory({"model": nnx.state(model), "step": 3}, tmp_dir / "ckpt")
    report = osf.export_pytorch(
        tmp_dir / "ckpt", tmp_dir / "hf", MAPPING, prefix="model.", dtype=jnp.bfloat16
    )
    assert report.ok
    out = safetensors.torch.load_file(tmp_dir / "hf" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    for key, value in tmodel.state_dict().items():
        torch.testing.assert_close(
            out[key].float(), value.to(torch.bfloat16).float(), rtol=0, atol=0
        )


def test_export_reports_unmapped_names(tmp_dir):
    model = Model(nnx.Rngs(0))
    partial = osf.KeyMapping(MAPPING.rules[:-2])  # no rule for the classifier
    with pytest.raises(
        osf.TargetMismatchError,
        match=r"no rule maps these keys \(2\):\n  classifier.bias\n  classifier.kernel",
    ):
        osf.export_pytorch(model, tmp_dir / "hf", partial)
    assert not (tmp_dir / "hf").exists()
    report = osf.export_pytorch(model, tmp_dir / "hf", partial, strict=False)
    assert report.unmapped == ["classifier.bias", "classifier.kernel"]
    assert "head.weight" not in safetensors.torch.load_file(tmp_dir / "hf" / "model.safetensors")


# --------------------------------------------------------------------------- rules and transforms


def test_rule_patterns_work_both_ways():
    rule = osf.Rule("h.{i:\\d+}.attn.{p}.weight", "blocks.{i}.{p}.kernel", osf.Transpose())
    assert rule.match_torch("h.12.attn.c_proj.weight") == "blocks.12.c_proj.kernel"
    assert rule.match_flax("blocks.12.c_proj.kernel") == "h.12.attn.c_proj.weight"
    assert rule.match_torch("h.x.attn.c_proj.weight") is None
    assert rule.match_torch("h.1.attn.c_proj.weight.extra") is None
    with pytest.raises(ValueError, match="same placeholders"):
        osf.Rule("a.{i}.w", "b.w")
    # The placeholder methods of the public Rule (kept since 0.1's first API).
    values = rule.torch_groups("h.12.attn.c_proj.weight")
    assert values == {"i": "12", "p": "c_proj"} == rule.flax_groups("blocks.12.c_proj.kernel")
    assert rule.flax_name(values) == "blocks.12.c_proj.kernel"
    assert rule.torch_key(values) == "h.12.attn.c_proj.weight"
    assert rule.torch_groups("blocks.12.c_proj.kernel") is None
    assert rule.flax_groups("h.12.attn.c_proj.weight") is None


@pytest.mark.parametrize(
    "transform, shape",
    [
        (osf.Transpose(), (3, 5)),
        (osf.Transpose((2, 3, 1, 0)), (8, 4, 3, 3)),
        (osf.SplitHeads(4, -1), (6, 12)),
        (osf.SplitHeads(4, 0), (12, 6)),
        (osf.Chain(osf.Transpose(), osf.SplitHeads(2, 0)), (6, 8)),
        (osf.SplitHeads(4, -1, head_dim=3), (6, 12)),
        (osf.Reshape((2, 3, 4), (6, 4)), (6, 4)),
    ],
)
def test_transforms_invert(transform, shape):
    x = np.arange(np.prod(shape)).reshape(shape)
    np.testing.assert_array_equal(transform.to_torch(transform.to_flax(x)), x)


@pytest.mark.parametrize(
    "transform, direction, shape, match",
    [
        (osf.SplitHeads(5, -1), "to_flax", (6, 12), "does not split into 5 heads"),
        (osf.SplitHeads(head_dim=16), "to_flax", (6, 12), "into heads of head_dim 16"),
        (osf.SplitHeads(4, -1, head_dim=4), "to_flax", (6, 12), "into 4 heads of head_dim 4"),
        # a merge checks what it is told: a wrong head_dim never merges silently
        (
            osf.SplitHeads(head_dim=6),
            "to_torch",
            (6, 4, 3),
            "hold 4 heads of head_dim 3, not heads of head_dim 6",
        ),
        (osf.SplitHeads(2, 0), "to_torch", (4, 3, 6), "hold 4 heads of head_dim 3, not 2 heads"),
    ],
)
def test_split_heads_refuses_what_does_not_fit(transform, direction, shape, match):
    with pytest.raises(ValueError, match=match):
        getattr(transform, direction)(np.zeros(shape))


@pytest.mark.parametrize("kwargs", [{}, {"heads": 0}, {"head_dim": -8}, {"heads": 2.5}])
def test_split_heads_needs_positive_sizes(kwargs):
    with pytest.raises(ValueError, match="SplitHeads"):
        osf.SplitHeads(**kwargs)


def test_conv_kernel_transpose_matches_torch(tmp_dir):
    tconv = torch.nn.Conv2d(3, 4, kernel_size=3, padding=1)
    safetensors.torch.save_file(tconv.state_dict(), tmp_dir / "conv.safetensors")
    conv = nnx.Conv(3, 4, kernel_size=(3, 3), padding=1, rngs=nnx.Rngs(0))
    mapping = osf.KeyMapping(
        [osf.Rule("weight", "kernel", osf.Transpose((2, 3, 1, 0))), osf.Rule("bias", "bias")]
    )
    osf.load_pytorch(conv, tmp_dir / "conv.safetensors", mapping)
    x = np.random.default_rng(0).normal(size=(1, 3, 5, 5)).astype(np.float32)
    want = tconv(torch.from_numpy(x)).detach().numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(conv(x.transpose(0, 2, 3, 1)), want, rtol=1e-5, atol=1e-5)
