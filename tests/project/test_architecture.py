"""The architecture rules that import-linter cannot express (its contracts are in pyproject.toml
and run by ``lint-imports`` in CI): no module uses another module's underscore names, the
implementation under ``_src/`` never reaches back up through the package root, and the layers
below ``orbax/`` do not recognise Orbax's restore arguments by name (issue 26).

An ``ast`` walk over every module of the package; a failure names file:line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import orbax_safetensors as osf

PACKAGE = Path(osf.__file__).parent

pytestmark = pytest.mark.main_env_only("a static scan of the sources and docs")

# (module path relative to the package, name, attribute): private attributes read on purpose.
ALLOWED_PRIVATE_ATTRIBUTES = {
    ("_src/compat/orbaxcompat.py", "sys", "_getframe"),  # fenced, see the module's docstring
    ("_src/orbax/v0.py", "args", "_validated"),  # the args class is defined in the same module
    ("_src/tools/verify.py", "report", "_problem"),  # the report class is in the same module
    # google-cloud-storage >= 3.15 keeps bucket metadata here; see the comment at the use.
    ("_src/storage/objstore/gcs.py", "client", "_bucket_metadata_cache"),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(PACKAGE)), ast.parse(p.read_text(), str(p)))
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def _package_aliases(tree: ast.Module) -> set[str]:
    """Names bound (anywhere in the module) by importing an orbax_safetensors module."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("orbax_safetensors"):
            aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("orbax_safetensors"):
                    aliases.add(a.asname or a.name.split(".")[0])
    return aliases


def test_no_module_imports_another_modules_underscore_names() -> None:
    found = [
        f"{rel}:{node.lineno}: from {node.module} import {a.name}"
        for rel, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("orbax_safetensors")
        for a in node.names
        if _is_private(a.name) and a.name != "_version"
    ]
    assert not found, "\n".join(found)


def test_no_module_reads_another_modules_underscore_attributes() -> None:
    found = []
    for rel, tree in _modules():
        aliases = _package_aliases(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            base, attr = node.value.id, node.attr
            if not _is_private(attr) or base in ("self", "cls"):
                continue
            if base in aliases or (rel, base, attr) not in ALLOWED_PRIVATE_ATTRIBUTES:
                found.append(f"{rel}:{node.lineno}: {base}.{attr}")
    assert not found, "\n".join(found)


def test_src_never_imports_the_package_root() -> None:
    found = []
    for rel, tree in _modules():
        if not rel.startswith("_src/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "orbax_safetensors":
                found.append(f"{rel}:{node.lineno}: from orbax_safetensors import ...")
            elif isinstance(node, ast.Import) and any(
                a.name == "orbax_safetensors" for a in node.names
            ):
                found.append(f"{rel}:{node.lineno}: import orbax_safetensors")
    assert not found, "\n".join(found)


def test_the_package_root_holds_only_the_public_surface() -> None:
    names = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert names == ["__init__.py", "_src", "_version.py", "cli.py", "hf.py", "py.typed"]
    layers = sorted(
        p.name for p in (PACKAGE / "_src").iterdir() if p.is_dir() and p.name != "__pycache__"
    )
    assert layers == sorted(
        ["tools", "integrations", "catalog", "orbax", "pipeline", "storage", "core", "compat"]
    )


# Orbax's restore vocabulary: recognised and translated in _src/orbax/ only.
ORBAX_RESTORE_NAMES = (
    "RestoreArgs",  # ArrayRestoreArgs too
    "PLACEHOLDER",
    "ShardingMetadata",
    "restore_type",
    "to_jax_sharding",
    "partial_restore",
    "is_placeholder",
)
ORBAX_FREE_LAYERS = ("_src/pipeline/", "_src/storage/", "_src/core/")


def _code_words(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier, comment and string literal of a module except its
    docstrings (which may compare with Orbax by name)."""
    source = path.read_text()
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(body[0].lineno)
    words = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.COMMENT) or (
            tok.type == tokenize.STRING and tok.start[0] not in docstrings
        ):
            words.append((tok.start[0], tok.string))
    return words


def test_the_layers_below_orbax_do_not_know_orbaxs_restore_names() -> None:
    found = [
        f"{rel}:{line}: {text.strip()[:80]}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (rel := str(path.relative_to(PACKAGE))).startswith(ORBAX_FREE_LAYERS)
        for line, text in _code_words(path)
        if any(name in text for name in ORBAX_RESTORE_NAMES)
    ]
    assert not found, "\n".join(found)


def test_the_orbax_name_check_sees_code_comments_and_strings(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""Docstrings may say RestoreArgs."""\n'
        "x = ocp.PLACEHOLDER  # a ShardingMetadata\n"
        "y = 'restore_type'\n"
    )
    texts = [t for _, t in _code_words(module)]
    assert "PLACEHOLDER" in texts and "# a ShardingMetadata" in texts and "'restore_type'" in texts
    assert not any("RestoreArgs" in t for t in texts)


# A measured figure: a number with a unit of time or bandwidth, or "N.Nx faster/slower".
_FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|s|seconds|GB/s|MB/s|GiB/s|MiB/s)\b"
    r"|\b\d+(?:\.\d+)?x (?:faster|slower)\b",
)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_code_comments_hold_no_measured_figures() -> None:
    # Figures go stale in comments; they live in docs/performance.md with their command
    # (issue 26). Comments and docstrings say why, not how fast.
    found = [
        f"{path.relative_to(PACKAGE)}:{line}: {match.group(0)!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _comments_and_docstrings(path.read_text())
        for match in _FIGURE.finditer(text)
    ]
    assert not found, "measured figures in code comments (move them to docs/performance.md):\n" + (
        "\n".join(found)
    )


def test_the_figure_check_sees_comments_and_docstrings() -> None:
    source = (
        '"""Saves at 2.5 GB/s."""\nx = 1  # took 30 ms\ny = "40 ms"  # a string, not a comment\n'
    )
    texts = [m.group(0) for _, t in _comments_and_docstrings(source) for m in _FIGURE.finditer(t)]
    assert sorted(texts) == ["2.5 GB/s", "30 ms"]


def test_the_architecture_diagram_names_every_module() -> None:
    # docs/architecture.md's layer diagram is the map of the code (issue 26): a module it
    # does not name is a module a maintainer cannot place.
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    start = doc.index("```\n tools/")
    diagram = doc[start : doc.index("```", start + 3)]
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted((PACKAGE / "_src").rglob("*.py"))
        if path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", diagram)
    ]
    assert not missing, f"modules missing from docs/architecture.md's diagram: {missing}"
