"""docs/security.md's promise is one numbered list, and every item names the tests that prove it.

Also the promise's items no other test covers: the package never unpickles, evaluates or
imports by name, and a class name forged into a schema is never imported.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

import orbax_safetensors as osf

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def promise_items() -> list[str]:
    """The numbered items of the ``## The promise`` section (continuation lines joined)."""
    text = DOC.read_text()
    match = re.search(r"^## The promise\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "docs/security.md has no '## The promise' section"
    items: list[str] = []
    for line in match.group(1).splitlines():
        if re.match(r"\d+\. ", line):
            items.append(line)
        elif items and line.startswith("   ") and line.strip():
            items[-1] += " " + line.strip()
    return items


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


@pytest.mark.main_env_only("a static scan of the docs and sources")
def test_every_promise_names_existing_tests() -> None:
    items = promise_items()
    assert len(items) >= 10, items
    for item in items:
        refs = _REF.findall(item)
        assert refs, f"promise without a test: {item[:120]}"
        for file, name in refs:
            path = ROOT / file
            assert path.is_file(), f"{file} (named in: {item[:80]})"
            assert name.startswith("test_") and name in _functions(path), f"{file}::{name}"


def read_path_rows() -> list[str]:
    """The rows of the ``| Read path | What it checks | Tested by |`` table."""
    text = DOC.read_text()
    match = re.search(
        r"^\| Read path \| What it checks \| Tested by \|\n\|[-|]+\|\n(.*?)\n\n", text, re.M | re.S
    )
    assert match, "docs/security.md has no read path table"
    return match.group(1).splitlines()


@pytest.mark.main_env_only("a static scan of the docs and sources")
def test_every_read_path_names_its_bit_flip_tests() -> None:
    """Each row of *What is verified, and when* names the tests that flip a bit through it."""
    rows = read_path_rows()
    assert len(rows) >= 10, rows
    for row in rows:
        cells = row.strip("|").split(" | ")
        assert len(cells) == 3, row
        refs = _REF.findall(cells[2])
        assert refs and not _REF.findall(cells[0] + cells[1]), f"row without a test: {row[:120]}"
        for file, name in refs:
            path = ROOT / file
            assert path.is_file(), f"{file} (named in: {row[:80]})"
            assert name.startswith("test_") and name in _functions(path), f"{file}::{name}"
    paths = " ".join(row.split(" | ")[0] for row in rows)
    for read in (
        "load_file",
        "load_model",
        "restore_directory",
        "CheckpointManager.restore",
        "ocp.load",
        "load_pytorch",
        "diff",
        "convert",
        "export",
        "inspect",
        "verify",
        "multi-host",
        "s3://",
    ):
        assert read in paths, f"no row for {read}"


# The columns of the matrix of *Hostile input by verb*.
_VERBS = [
    "`inspect`", "`verify`", "`diff`", "`convert`", "`export` (CLI)", "`load_file`",
    "`load_pytorch`", "`export_pytorch`", "manager restore",
]  # fmt: skip
_CODE = re.compile(r"\b([A-Z]\d+)\b")


def _table(header: str) -> list[list[str]]:
    """The cells of the table of docs/security.md whose header row starts with ``header``."""
    text = DOC.read_text()
    match = re.search(rf"^({re.escape(header)}[^\n]*)\n\|[-|]+\|\n(.*?)\n\n", text, re.M | re.S)
    assert match, f"docs/security.md has no table {header!r}"
    rows = [match.group(1), *match.group(2).splitlines()]
    return [[c.strip() for c in row.strip().strip("|").split(" | ")] for row in rows]


@pytest.mark.main_env_only("a static scan of the docs and sources")
def test_the_attack_matrix_names_a_test_or_a_reason_in_every_cell() -> None:
    """Rows the five attack classes of issue 46, columns every verb and API that reads; each
    cell names tests from the legend (which must exist) or says ``n/a: why``."""
    header, *rows = _table("| Attack class |")
    assert header[1:] == _VERBS, header
    assert [r[0][:2] for r in rows] == ["1.", "2.", "3.", "4.", "5."], [r[0] for r in rows]
    _, *legend_rows = _table("| Code | Test |")
    legend = dict((code, ref) for code, ref in legend_rows)
    used = set()
    for row in rows:
        assert len(row) == len(_VERBS) + 1, row
        for verb, cell in zip(_VERBS, row[1:]):
            codes = _CODE.findall(cell)
            where = f"{row[0][:2]} {verb}: {cell!r}"
            if cell.startswith("n/a"):
                assert re.match(r"n/a: \w", cell) and not codes, where
                continue
            assert codes, where
            unknown = set(codes) - set(legend)
            assert not unknown, f"{where}: not in the legend: {unknown}"
            used.update(codes)
    assert used == set(legend), f"legend codes no cell uses: {set(legend) - used}"
    for code, ref in legend.items():
        found = _REF.fullmatch(ref)
        assert found, f"{code}: {ref}"
        file, name = found.groups()
        path = ROOT / file
        assert path.is_file(), f"{code}: {file}"
        assert name.startswith("test_") and name in _functions(path), f"{code}: {file}::{name}"


_FORBIDDEN_CALLS = {"eval", "exec", "__import__", "compile"}
_FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "importlib", "marshal", "shelve"}
# The imports by name: `orbax-safetensors export --mapping module:attr` imports the module its
# user names on the command line (as `python -m` does; tools/mapping_flags.py reads --mapping), and
# the package's root imports each public name's module, from its own constant table (_LAZY),
# when the name is first used; nothing read from a file is.
_IMPORTS_BY_NAME = {
    "orbax_safetensors/_src/tools/mapping_flags.py",
    "orbax_safetensors/__init__.py",
}


@pytest.mark.main_env_only("a static scan of the docs and sources")
def test_the_package_never_unpickles_evaluates_or_imports_by_name() -> None:
    problems = []
    for path in sorted((ROOT / "orbax_safetensors").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            # importlib.metadata (installed versions) is allowed; importlib itself is not.
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names if a.name != "importlib.metadata"}
            elif isinstance(node, ast.ImportFrom) and node.module != "importlib.metadata":
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            user_named = str(path.relative_to(ROOT)) in _IMPORTS_BY_NAME
            if user_named:
                names -= {"importlib"}
            if names & _FORBIDDEN_MODULES:
                problems.append(f"{where}: imports {names & _FORBIDDEN_MODULES}")
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
                if (name == "import_module" and not user_named) or (
                    isinstance(fn, ast.Name) and name in _FORBIDDEN_CALLS
                ):
                    problems.append(f"{where}: calls {name}")
                owner = fn.value if isinstance(fn, ast.Attribute) else None
                if name == "load" and isinstance(owner, ast.Name) and owner.id in ("np", "numpy"):
                    problems.append(f"{where}: numpy.load")
    assert not problems, problems


Point = namedtuple("Point", ["x", "y"])


@pytest.mark.parametrize("forged", ["this", "this.Zen", "os:system", "builtins.eval"])
def test_a_class_name_forged_into_the_schema_is_never_imported(tmp_path: Path, forged: str) -> None:
    path = tmp_path / "p.safetensors"
    osf.save_file({"p": Point(np.ones(2, np.float32), np.zeros(1, np.int8))}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 : 8 + n])
    schema = json.loads(doc["__metadata__"]["orbax_safetensors.tree"])
    nodes = [schema["tree"]]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            if node.get("t") == "node":
                node["type"] = forged
            nodes.extend(node.get("v", []))
    doc["__metadata__"]["orbax_safetensors.tree"] = json.dumps(schema)
    text = json.dumps(doc).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    assert "this" not in sys.modules
    try:
        tree = osf.load_file(path)
    except osf.SchemaError:
        pass  # refusing the name is fine too
    else:  # rebuilt as plain containers, not as the named class
        assert type(tree["p"]) in (dict, list, tuple), type(tree["p"])
        assert np.array_equal(np.asarray(jax_leaves(tree["p"])[0]), np.ones(2, np.float32))
    assert "this" not in sys.modules


def jax_leaves(node: object) -> list[object]:
    """Leaves of plain containers, in order."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in jax_leaves(v)]
    if isinstance(node, (list, tuple)):
        return [x for v in node for x in jax_leaves(v)]
    return [node]
