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
