"""Tunix's own NNX model classes (``google-tunix``), for the ``tunix-*`` preset tests.

CI installs Tunix without its dependencies (``pip install --no-deps google-tunix``, see
``.ci/run``): its package ``__init__`` imports the trainers (metrax, grain, datasets, ...),
which the model modules do not need. So when ``import tunix`` fails on a missing dependency,
the model modules are imported under a bare ``tunix`` package object (its ``__init__`` not run):
Tunix's ``models``, ``utils``, ``generate`` and ``oss`` folders are namespace packages, and the
model modules need only jax, flax, jaxtyping, safetensors, huggingface_hub and fsspec. Where
Tunix is not installed (the README's ``pip install -e ".[test]"`` leaves it out) the tests skip
as ``optional_deps`` skips, naming the install command; if the model modules themselves do not
import, they skip naming the reason.

Importing a Tunix model module sets Flax's ``flax_always_shard_variable`` to False (Tunix's
``env_utils.setup_sharding_environment``); :func:`tunix_flags` restores it after a test, so
the rest of the suite runs with the flag it had.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import optional_deps  # (tests/ is on sys.path)
import pytest

TUNIX_INSTALL = "pip install --no-deps google-tunix==0.1.7 jaxtyping"


def _bare_package() -> None:
    spec = importlib.util.find_spec("tunix")
    if spec is None or spec.loader is None:
        optional_deps.missing("google-tunix", TUNIX_INSTALL)
    try:
        import tunix  # noqa: F401 (a full install imports as usual)
    except ImportError:
        # the trainers' dependencies are missing: a package object without its __init__
        for name in [n for n in sys.modules if n == "tunix" or n.startswith("tunix.")]:
            del sys.modules[name]
        sys.modules["tunix"] = importlib.util.module_from_spec(spec)


def model_modules() -> tuple[ModuleType, ModuleType]:
    """``(tunix.models.llama3.model, tunix.models.qwen3.model)``, or a skip naming why.

    Test modules call it at import (``LLAMA3, QWEN3 = tunix_models.model_modules()``): the
    skip is then the whole module's, reported with its reason (``allow_module_level``).
    """
    import flax
    import jax

    before = _shard_flag(flax)
    try:
        _bare_package()
        llama3 = importlib.import_module("tunix.models.llama3.model")
        qwen3 = importlib.import_module("tunix.models.qwen3.model")
    except ImportError as e:
        pytest.skip(
            f"Tunix's model modules do not import with jax {jax.__version__}, flax "
            f"{flax.__version__}: {e}",
            allow_module_level=True,
        )
    finally:
        _set_shard_flag(flax, before)
    return llama3, qwen3


def _shard_flag(flax: ModuleType) -> bool | None:
    return getattr(flax.config, "flax_always_shard_variable", None)


def _set_shard_flag(flax: ModuleType, value: bool | None) -> None:
    if value is not None:
        flax.config.update("flax_always_shard_variable", value)


@contextlib.contextmanager
def tunix_flags() -> Iterator[None]:
    """Flax configured as Tunix's model modules configure it, restored on exit."""
    import flax

    before = _shard_flag(flax)
    _set_shard_flag(flax, False if before is not None else None)
    try:
        yield
    finally:
        _set_shard_flag(flax, before)
