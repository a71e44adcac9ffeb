"""Test-wide setup: CPU-only JAX with 8 devices per process (set before JAX is imported)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
from objstore.fixtures import (  # noqa: F401
    gcs_bucket,
    gcs_server,
    options,
    s3_bucket,
    s3_server,
    store,
)


@pytest.fixture
def tmp_dir(tmp_path):
    """A fresh directory for one test's files."""
    return tmp_path


@pytest.fixture(autouse=True)
def _no_global_mesh_left_behind():
    """Clears a concrete mesh a test left set globally.

    On jax 0.7 ``jax.sharding.set_mesh`` is a plain setter (a context manager from 0.8 on), and
    orbax-checkpoint 0.11.40 uses it as a context manager when it saves a replicated array
    (``replica_slices.py``): its save fails after setting that mesh for the whole process, and
    every later jit on other devices would fail with "incompatible devices". The mid-2025 CI
    stack has exactly that pair; no test of this library relies on a global mesh. The library
    runs Orbax's handlers inside ``jaxcompat.global_mesh_kept`` (``tests/orbax/test_routing_mesh.py``);
    this fixture is the net for tests that call Orbax directly.
    """
    yield
    import jax

    set_mesh = getattr(jax.sharding, "set_mesh", None)
    if set_mesh is not None and not isinstance(set_mesh, type):
        set_mesh(None)
