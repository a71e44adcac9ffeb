"""MaxText's own conversion hooks, the reference the MaxText presets are checked against.

MaxText (``pip download --no-deps --python-version 3.12 --only-binary=:all: maxtext==0.2.5``)
is a pure-Python wheel for Python >= 3.12 that does not install here; its
``maxtext/checkpoint_conversion/utils/param_mapping.py`` imports only numpy and JAX, so it is
read straight from the wheel (or an unzipped copy) that ``OSF_MAXTEXT_WHEEL`` names, and run
as a module of its own. Without it the tests that need it skip; the other tests check the
same facts against formulas of their own (``tests/maxtext_layout.py``).

Example::

    pm = maxtext_reference.param_mapping()    # skips the test when absent
    hooks = pm.LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN(cfg, None, scan_layers=True, saving_to_hf=True)
"""

from __future__ import annotations

import functools
import os
import types
import zipfile
from pathlib import Path

import pytest

ENV = "OSF_MAXTEXT_WHEEL"
MEMBER = "maxtext/checkpoint_conversion/utils/param_mapping.py"


@functools.lru_cache(maxsize=1)
def _load() -> types.ModuleType | None:
    where = os.environ.get(ENV)
    if not where:
        return None
    path = Path(where)
    if path.is_dir():
        source = (path / MEMBER).read_text()
    else:
        with zipfile.ZipFile(path) as wheel:
            source = wheel.read(MEMBER).decode()
    module = types.ModuleType("maxtext_param_mapping")
    module.__file__ = f"{path}/{MEMBER}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # (MaxText's own file)
    return module


def param_mapping() -> types.ModuleType:
    """MaxText's ``param_mapping`` module; the calling test skips when ``OSF_MAXTEXT_WHEEL``
    names none."""
    module = _load()
    if module is None:
        pytest.skip(f"needs MaxText's wheel (maxtext==0.2.5): set {ENV} to it")
    return module
