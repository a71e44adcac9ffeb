"""How many devices a test needs.

CPU runs have 8 devices per process (``conftest.py``); a run on an accelerator
(``OSF_TEST_PLATFORM=accelerator``, e.g. one TPU chip) has what the machine has, and a test
that needs more skips there, naming how many it needs (CPU runs, CI's, cover it).

Example::

    mesh = devices.mesh((2, 4), ("x", "y"))     # 8 devices, or a skip
    first, second = devices.take(2)
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest


def take(n: int) -> list[jax.Device]:
    """The first ``n`` devices; a skip where this run has fewer."""
    have = jax.devices()
    if len(have) < n:
        pytest.skip(
            f"needs {n} devices; this run has {len(have)} {have[0].platform} device(s) "
            "(the CPU runs have 8)"
        )
    return have[:n]


def mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh of the first ``prod(shape)`` devices; a skip where this run has fewer."""
    return jax.sharding.Mesh(np.array(take(math.prod(shape))).reshape(shape), axes)
