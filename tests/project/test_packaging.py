"""Packaging: every import of the package's code is a declared dependency; one version source."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import orbax_safetensors as osf

PACKAGE = Path(osf.__file__).parent
ROOT = PACKAGE.parent


def _imported_modules() -> dict[str, list[str]]:
    """Top-level third-party modules the package imports -> where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "orbax_safetensors":
                    found.setdefault(top, []).append(f"{path.name}:{node.lineno}")
    return found


def _declared() -> set[str]:
    """Distributions named in the package's requirements, extras included (normalised)."""
    requires = importlib.metadata.requires("orbax-safetensors") or []
    names = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in requires}
    return {_normalise(n) for n in names}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Import name -> distribution, for the optional clients, which may not be installed here (the
# supported-stack venvs have none; there "google" may be only protobuf's namespace).
_NOT_INSTALLED = {"boto3": ["boto3"], "botocore": ["botocore"], "google": ["google-cloud-storage"]}


def test_every_import_is_a_declared_dependency() -> None:
    declared = _declared()
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _imported_modules().items():
        found = [*providers.get(module, [module]), *_NOT_INSTALLED.get(module, [])]
        dists = {_normalise(d) for d in found}
        if not dists & declared:
            missing[module] = (sorted(dists), where)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_version_has_one_source() -> None:
    assert importlib.metadata.version("orbax-safetensors") == osf.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^version\s*=\s*\"", pyproject, re.M) is None, "version written in pyproject"
    assert 'dynamic = ["version"]' in pyproject
