"""The tree schema's typed codec (core/schema.py): files carry exactly the JSON the dict-based
code wrote (golden copies), from_json/to_json round trips, and hostile schemas refused with a
SchemaError that names the problem, without deep recursion or crashes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

import orbax_safetensors as osf
from orbax_safetensors import SchemaError
from orbax_safetensors._src.core import rebuild as _rebuild
from orbax_safetensors._src.core import schema as _schema
from orbax_safetensors._src.core import tree as _tree

try:  # pytest puts tests/ on sys.path while tests/ has no __init__.py
    from golden.rich_tree import rich_tree
except ImportError:  # pragma: no cover - run from the repository root as a package
    from tests.golden.rich_tree import rich_tree

GOLDEN = Path(__file__).parents[1] / "golden"
# (the tied paths "head" and "again.*" named too: all in one dtype, they stay one tensor)
POLICY = {"*.w": "bfloat16", "head": "bfloat16", "again.*": "bfloat16", "nnx.*": "float16"}


def _saved_schema_text(tmp_path: Path, **kwargs: Any) -> str:
    path = tmp_path / "rich.safetensors"
    osf.save_file(rich_tree(), path, **kwargs)
    with safe_open(str(path), "np") as f:
        return str(f.metadata()["orbax_safetensors.tree"])


@pytest.mark.parametrize(("suffix", "kwargs"), [("", {}), ("_bf16", {"dtype": POLICY})])
def test_saved_schema_is_byte_for_byte_the_golden_copy(
    tmp_path: Path, suffix: str, kwargs: dict[str, Any]
) -> None:
    golden = (GOLDEN / f"schema_rich{suffix}.json").read_text().strip()
    assert _saved_schema_text(tmp_path, **kwargs) == golden
    # The codec alone gives the same document, and reads it back to the same text.
    doc = json.loads(golden)
    again = json.dumps(_schema.to_json(_schema.from_json(doc)), separators=(",", ":"))
    assert again == golden


def test_checkpoint_directory_schema_is_the_golden_copy(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(0, args=osf.SafetensorsSave(rich_tree()))
    meta = next((tmp_path / "ckpt").rglob("orbax_safetensors.json"))
    golden = json.loads((GOLDEN / "schema_rich.json").read_text())
    assert json.loads(meta.read_text())["schema"] == golden


def test_golden_files_restore_to_the_saved_tree(tmp_path: Path) -> None:
    text = _saved_schema_text(tmp_path)
    restored = osf.load_file(tmp_path / "rich.safetensors")
    names = _tree.unflatten(json.loads(text), lambda leaf: leaf.tensor_name)
    assert names["head"] == "layers.0.w" and names["again"] == ["layers.0.w"] * 2
    assert restored["a.b"] == np.int8(3) and restored["a"]["b"].dtype == np.int32
    assert restored[1] is None and restored["big"] == 2**80


def _rich_schema() -> _schema.Schema:
    return _schema.from_json(json.loads((GOLDEN / "schema_rich_bf16.json").read_text()))


def test_typed_nodes_of_the_rich_tree() -> None:
    schema = _rich_schema()
    leaves = schema.leaves
    assert leaves["layers.0.w"].node == _schema.Tensor("layers.0.w", _schema.ArrayKind.JAX, "F32")
    assert leaves["layers.0.b"].node == _schema.Tensor("layers.0.b", _schema.ArrayKind.NUMPY)
    assert leaves["1"].node.array is _schema.ArrayKind.SCALAR
    assert leaves["head"].node == _schema.Alias("head", "layers.0.w")
    assert leaves["head"].tensor_name == "layers.0.w"
    assert leaves["rbg"].node == _schema.PrngKey("rbg", "rbg")
    assert leaves["floats.3"].node == _schema.Inline(
        _schema.LeafKind.FLOAT, "floats.3", "-0x0.0p+0"
    )
    assert leaves["big"].node.value == 2**80
    assert leaves["a.b~1"].kind is _schema.LeafKind.TENSOR
    assert isinstance(schema.tree, _schema.DictNode) and schema.tree.keys[11] == 1
    box = schema.tree.children[schema.tree.keys.index("box")]
    assert isinstance(box, _schema.CustomNode) and box.indexed and box.type_name == "Box"
    assert box.entries == (
        _schema.Entry(_schema.EntryKind.IDX, 0),
        _schema.Entry(_schema.EntryKind.IDX, 1),
    )
    var = schema.tree.children[schema.tree.keys.index("var")]
    assert var == _schema.VarNode(_schema.Tensor("var", _schema.ArrayKind.JAX))
    assert leaves["rng"].node == _schema.PrngKey("rng", "threefry2x32")
    w, b = leaves["layers.0.w"].node, leaves["layers.0.b"].node
    assert isinstance(w, _schema.Tensor) and w.cast_from == "F32"
    assert isinstance(b, _schema.Tensor) and b.cast_from is None


def test_round_trip_and_equality_by_kind() -> None:
    schema = _rich_schema()
    assert _schema.from_json(_schema.to_json(schema)) == schema
    assert _schema.ListNode((_schema.NONE,)) != _schema.TupleNode((_schema.NONE,))
    assert _schema.Alias("a", "b") != _schema.PrngKey("a", "b")
    assert _schema.Entry(_schema.EntryKind.KEY, 1) != _schema.Entry(_schema.EntryKind.KEY, "1")
    assert hash(_schema.Tensor("a", _schema.ArrayKind.JAX)) == hash(
        _schema.Tensor("a", _schema.ArrayKind.JAX)
    )
    tree = _schema.DictNode(
        (1, "1"),
        (
            _schema.CustomNode(None, (), ()),
            _schema.TupleNode((_schema.Inline(_schema.LeafKind.STR, "1.0", "x"), _schema.NONE)),
        ),
    )
    doc = _schema.to_json(_schema.Schema(tree))
    assert doc["tree"]["v"][0] == {"t": "node", "k": [], "v": []}  # no type recorded
    assert _schema.from_json(doc).tree == tree


def test_capture_finish_cast_from_and_kinds() -> None:
    captured = _tree.capture({"w": np.ones(2, np.float32), "k": np.zeros(1, np.int8), "s": 1})
    assert captured.stored_kinds() == [_schema.LeafKind.TENSOR, _schema.LeafKind.TENSOR]
    flat = captured.finish(cast_from=["F32", None])
    assert flat.schema["tree"]["v"][0] == {
        "t": "tensor",
        "array": "numpy",
        "name": "w",
        "cast_from": "F32",
    }
    assert "cast_from" not in flat.schema["tree"]["v"][1]
    again = _tree.flatten({"w": np.ones(2, np.float32), "k": np.zeros(1, np.int8), "s": 1})
    assert captured.finish().schema == again.schema


def test_prune_typed_and_json_agree() -> None:
    schema = _rich_schema()
    doc = _schema.to_json(schema)

    def keep(name: str) -> bool:
        return name.startswith(("layers.1", "again", "box"))

    pruned = _rebuild.prune_schema(schema, keep)
    assert pruned is not None
    assert _rebuild.prune_schema(doc, keep) == _schema.to_json(pruned)
    assert set(pruned.leaves) == {"layers.1.w", "again.0", "again.1", "box.0", "box.1"}
    assert _rebuild.selectable_names(schema) == _rebuild.selectable_names(doc)
    got = _rebuild.unflatten(pruned, lambda leaf: leaf.tensor_name, schema.leaves)
    assert got == {
        "layers": [None, {"w": "layers.1.w"}],
        "again": ["layers.0.w", "layers.0.w"],
        "box": ["box.0", 7],
    }
    assert _rebuild.prune_schema(schema, lambda name: False) is None


def _doc(tree: Any, **top: Any) -> dict[str, Any]:
    return {"format": _schema.SCHEMA_FORMAT, "version": 1, "tree": tree, **top}


def _t(name: str) -> dict[str, Any]:
    return {"t": "tensor", "array": "jax", "name": name}


HOSTILE: list[tuple[str, Any, str]] = [
    ("not-object", [], "not a JSON object"),
    ("format", {"format": "x" * 10_000, "version": 1}, "schema format"),
    ("version-str", _doc(_schema.NONE, version="1"), "version"),
    ("version-new", _doc(None, version=2), "newer"),
    ("no-tree", {"format": _schema.SCHEMA_FORMAT, "version": 1}, "no kind"),
    ("kind-unknown", _doc({"t": "pickle"}), "unknown"),
    ("kind-list", _doc({"t": ["dict"]}), "no kind"),
    ("children", _doc({"t": "list", "v": {}}), "child list"),
    ("keys", _doc({"t": "dict", "k": ["a"], "v": []}), "keys do not match"),
    ("key-float", _doc({"t": "dict", "k": [1.5], "v": [{"t": "none"}]}), "neither str nor int"),
    ("key-bool", _doc({"t": "dict", "k": [True], "v": [{"t": "none"}]}), "neither str nor int"),
    ("dup-key", _doc({"t": "dict", "k": ["a", "a"], "v": [{"t": "none"}] * 2}), "duplicate"),
    ("entry", _doc({"t": "node", "k": [["exec", "x"]], "v": [{"t": "none"}]}), "malformed"),
    (
        "entry-kind-list",
        _doc({"t": "node", "k": [[["idx"], 0]], "v": [{"t": "none"}]}),
        "malformed",
    ),
    (
        "dup-entry",
        _doc({"t": "node", "k": [["idx", 0], ["idx", 0]], "v": [{"t": "none"}] * 2}),
        "duplicate",
    ),
    ("node-type", _doc({"t": "node", "type": 5, "k": [], "v": []}), "not a string"),
    ("no-name", _doc({"t": "tensor", "array": "jax"}), "no name"),
    ("twice", _doc({"t": "list", "v": [_t("a"), _t("a")]}), "twice"),
    ("array", _doc({"t": "tensor", "array": {"a": 1}, "name": "a"}), "array kind"),
    ("cast-from", _doc({**_t("a"), "cast_from": 32}), "cast_from"),
    ("impl", _doc({"t": "key", "name": "k"}), "impl"),
    ("of-int", _doc({"t": "list", "v": [_t("a"), {"t": "ref", "of": 0, "name": "b"}]}), "alias"),
    ("of-nowhere", _doc({"t": "ref", "of": "zz", "name": "b"}), "not a stored tensor"),
    (
        "of-alias",
        _doc(
            {
                "t": "list",
                "v": [{"t": "ref", "of": "b", "name": "a"}, {"t": "ref", "of": "a", "name": "b"}],
            }
        ),
        "not a stored tensor",
    ),
    ("bool", _doc({"t": "bool", "v": 1, "name": "a"}), "bool value"),
    ("int", _doc({"t": "int", "v": True, "name": "a"}), "int value"),
    ("str", _doc({"t": "str", "v": None, "name": "a"}), "str value"),
    ("float", _doc({"t": "float", "v": "0x1p99999", "name": "a"}), "hex float"),
    ("float-num", _doc({"t": "float", "v": 1.5, "name": "a"}), "hex float"),
    ("var-empty", _doc({"t": "var"}), "no kind"),
]


@pytest.mark.parametrize(("name", "doc", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_schemas_raise_schema_error(name: str, doc: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message) as info:
        _schema.from_json(doc)
    assert len(str(info.value)) < 400  # bounded, however large the offending value


def _nest(depth: int, inner: dict[str, Any]) -> dict[str, Any]:
    for _ in range(depth):
        inner = {"t": "var", "v": inner}
    return inner


def test_depth_and_leaf_bounds() -> None:
    assert _schema.from_json(_doc(_nest(_schema.MAX_DEPTH, {"t": "none"}))).tree is not None
    with pytest.raises(SchemaError, match="deeper than 256"):
        _schema.from_json(_doc(_nest(_schema.MAX_DEPTH + 1, {"t": "none"})))
    deep_junk: Any = []
    for _ in range(5000):  # deep, but not a node: refused at the first level, no recursion
        deep_junk = [deep_junk]
    with pytest.raises(SchemaError, match="no kind"):
        _schema.from_json(_doc({"t": "list", "v": [deep_junk]}))
    many = _doc({"t": "list", "v": [_t(str(i)) for i in range(11)]})
    assert len(_schema.from_json(many, max_leaves=11).leaves) == 11
    with pytest.raises(SchemaError, match="more than 10 leaves"):
        _schema.from_json(many, max_leaves=10)
    with pytest.raises(SchemaError, match="more than 10 leaves"):
        _tree.validate_schema(many, max_leaves=10)


def test_pruned_aliases_are_accepted_only_when_asked() -> None:
    doc = _doc({"t": "list", "v": [{"t": "none"}, {"t": "ref", "of": "a", "name": "b"}]})
    with pytest.raises(SchemaError, match="alias 'b'"):
        _schema.from_json(doc)
    assert _schema.from_json(doc, check_aliases=False).leaves["b"].tensor_name == "a"


def test_leaf_kind_names_each_leaf_node_kind() -> None:
    assert _schema.leaf_kind(_schema.Tensor("w", _schema.ArrayKind.JAX)) is _schema.LeafKind.TENSOR
    assert _schema.leaf_kind(_schema.PrngKey("k", "rbg")) is _schema.LeafKind.KEY
    assert _schema.leaf_kind(_schema.Alias("a", "w")) is _schema.LeafKind.REF
    inline = _schema.Inline(_schema.LeafKind.FLOAT, "f", (0.5).hex())
    assert _schema.leaf_kind(inline) is _schema.LeafKind.FLOAT and inline.value == 0.5
