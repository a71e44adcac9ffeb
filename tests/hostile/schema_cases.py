"""Valid safetensors files whose orbax-safetensors metadata (tree schema, checksums) is forged:
``read_header`` succeeds, ``load_file`` and ``verify`` fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orbax_safetensors import IntegrityError, SchemaError

from .bases import CRC_KEY, SCHEMA_KEY, Case, base_file_bytes, drop, join, split, write_file

# --------------------------------------------------------------------------- schema cases


def _schema(edit: Callable[[dict[str, Any]], Any], key: str = SCHEMA_KEY) -> Callable[[Path], Path]:
    """A valid file whose ``key`` metadata (JSON text) is replaced by ``edit(parsed)``.

    ``edit`` mutates the parsed value in place (returning None), or returns the new value, or
    returns ``str`` to store as raw text.
    """

    def build(d: Path) -> Path:
        doc, data = split(base_file_bytes())
        value = json.loads(doc["__metadata__"][key])
        out = edit(value)
        if out is not None:
            value = out
        doc["__metadata__"][key] = value if isinstance(value, str) else json.dumps(value)
        return write_file(d, join(doc, data))

    return build


def _node(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The schema node of the leaf named ``name``."""
    stack = [schema["tree"]]
    while stack:
        node = stack.pop()
        if node.get("name") == name:
            return node
        v = node.get("v")
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.append(v)
    raise KeyError(name)


def leaf_edit(leaf: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """Replaces the node of leaf ``leaf`` by ``fields``."""

    def edit(s: dict[str, Any]) -> None:
        node = _node(s, leaf)
        node.clear()
        node.update(fields)

    return edit


def update_leaf(leaf: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda s: _node(s, leaf).update(fields)


def _root_keys(keys: list[Any]) -> Callable[[dict[str, Any]], None]:
    return lambda s: s["tree"].update({"k": keys + s["tree"]["k"][len(keys) :]})


def _nest(depth: int, inner: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        node = inner
        for _ in range(depth):
            node = {"t": "list", "v": [node]}
        s["tree"]["v"][0] = node

    return edit


def _deep_list(depth: int) -> Any:
    x: Any = []
    for _ in range(depth):
        x = [x]
    return x


def alias_cycle(s: dict[str, Any]) -> None:
    _node(s, "tied").update({"t": "ref", "of": "none2"})
    s["tree"]["v"][s["tree"]["k"].index("none")] = {"t": "ref", "name": "none2", "of": "tied"}


def _crc(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    return _schema(edit, CRC_KEY)


def _wrong_crc(c: dict[str, str]) -> None:
    c["b"] = f"{int(c['b'], 16) ^ 1:08x}"


def schema_cases() -> list[Case]:
    S = SchemaError
    items: list[tuple[str, Callable[[Path], Path], str]] = [
        ("schema-garbage-json", _schema(lambda s: "{not json"), "not valid JSON"),
        ("schema-deep-json", _schema(lambda s: "[" * 100_000), "nested too deeply"),
        ("schema-not-object", _schema(lambda s: []), "not a JSON object"),
        ("schema-wrong-format", _schema(lambda s: s.update(format="pickle")), "format"),
        ("schema-version-99", _schema(lambda s: s.update(version=99)), "newer"),
        ("schema-version-string", _schema(lambda s: s.update(version="1")), "version"),
        ("schema-version-bool", _schema(lambda s: s.update(version=True)), "version"),
        ("schema-version-0", _schema(lambda s: s.update(version=0)), "version"),
        ("schema-no-tree", _schema(lambda s: drop(s, "tree")), "no kind"),
        ("alias-nowhere", _schema(update_leaf("tied", of="zzz")), "alias 'tied'"),
        ("alias-self", _schema(update_leaf("tied", of="tied")), "alias 'tied'"),
        ("alias-cycle", _schema(alias_cycle), "alias"),
        ("alias-to-inline", _schema(update_leaf("tied", of="step")), "alias 'tied'"),
        ("alias-of-int", _schema(update_leaf("tied", of=3)), "alias 'tied'"),
        ("kind-unknown", _schema(leaf_edit("b", t="pickle", name="b")), "unknown"),
        ("kind-import", _schema(leaf_edit("b", t="import", name="b", module="os")), "unknown"),
        ("kind-not-string", _schema(leaf_edit("b", t=5, name="b")), "no kind"),
        ("colliding-names", _schema(update_leaf("b", name="a")), "twice"),
        ("colliding-dict-keys", _schema(_root_keys(["a", "a"])), "duplicate"),
        ("dict-key-count", _schema(lambda s: drop(s["tree"]["k"], -1)), "keys do not match"),
        ("dict-key-float", _schema(_root_keys([1.5])), "neither str nor int"),
        ("dict-key-null", _schema(_root_keys([None])), "neither str nor int"),
        ("children-not-list", _schema(lambda s: s["tree"].update(v={})), "child list"),
        (
            "node-key-malformed",
            _schema(leaf_edit("b", t="node", type="X", k=[["exec", "x"]], v=[{"t": "none"}])),
            "malformed",
        ),
        ("tree-300-deep", _schema(_nest(300, {"t": "none"})), "deeper"),
        ("tree-deep-junk", _schema(_nest(150, _deep_list(300))), "no kind"),
        ("tensor-not-stored", _schema(update_leaf("b", name="zz")), "no file holds"),
        ("tensor-array-kind", _schema(update_leaf("b", array="pickle")), "array kind"),
        ("int-not-int", _schema(update_leaf("step", v="7")), "int value"),
        ("bool-not-bool", _schema(leaf_edit("step", t="bool", name="step", v=1)), "bool value"),
        ("float-overflow", _schema(update_leaf("lr", v="0x1p99999")), "hex float"),
        ("float-garbage", _schema(update_leaf("lr", v="abc xyz")), "hex float"),
        ("var-empty", _schema(leaf_edit("b", t="var")), "no kind"),
        ("key-no-impl", _schema(lambda s: drop(_node(s, "key"), "impl")), "impl"),
        ("key-impl-unknown", _schema(update_leaf("key", impl="nope")), "PRNG key"),
        ("key-impl-mismatch", _schema(update_leaf("key", impl="rbg")), "PRNG key"),
        (
            "key-data-float",
            _schema(leaf_edit("a", t="key", name="a", impl="threefry2x32")),
            "PRNG key",
        ),
        ("crc-garbage-json", _crc(lambda c: "{oops"), "not valid JSON"),
        ("crc-not-object", _crc(lambda c: ["a"]), "not an object"),
        ("crc-malformed", _crc(lambda c: c.update(a="zz")), "checksum of 'a'"),
        ("crc-int", _crc(lambda c: c.update(a=5)), "checksum of 'a'"),
        ("tensor-array-kind-list", _schema(update_leaf("b", array=["jax"])), "array kind"),
        ("tensor-name-list", _schema(update_leaf("b", name=["b"])), "no name"),
    ]
    cases = [Case(n, "schema", b, S, r) for n, b, r in items]
    cases.append(Case("crc-wrong", "schema", _crc(_wrong_crc), IntegrityError, "'b'.*CRC32C"))
    return cases
