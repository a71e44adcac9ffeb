"""Test-wide setup: CPU-only JAX with 8 devices per process (set before JAX is imported).

``OSF_TEST_PLATFORM=accelerator`` runs the tests on the machine's accelerator instead (JAX's
own choice of platform, e.g. one TPU chip): arrays live in its memory, saves take its
device-to-host path and restores its host-to-device path. Tests that need more devices than
it has skip there, naming how many (``tests/helpers/devices.py``); the CPU runs cover them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The tests' shared helpers (tests/helpers/) import as top-level modules (``import devices``),
# in this process and in the processes the tests start (their PYTHONPATH is this sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

ON_ACCELERATOR = os.environ.get("OSF_TEST_PLATFORM") == "accelerator"
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
if ON_ACCELERATOR:
    import jax  # (JAX reads JAX_PLATFORMS once, at import: the accelerator here)

    if jax.default_backend() == "cpu":  # (a CPU-only JAX first on the path: say so, not pass)
        raise RuntimeError(
            "OSF_TEST_PLATFORM=accelerator, but JAX finds no accelerator: "
            f"{jax.devices()} ({jax.__file__})"
        )

    # Processes the tests start (saves killed mid-write, fresh interpreters) run on CPU: one
    # process at a time may hold a TPU, and this one does. Their stderr stays clean of the TPU
    # runtime's advice on transparent huge pages, which tests of clean output would see.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Transparent hugepages")
    # Models compared with PyTorch on the CPU: full float32 matrix products (a TPU's default
    # precision rounds their inputs to bfloat16).
    jax.config.update("jax_default_matmul_precision", "highest")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import optional_deps  # noqa: E402
import pytest  # noqa: E402
from objstore.fixtures import (  # noqa: F401, E402
    gcs_bucket,
    gcs_server,
    options,
    s3_bucket,
    s3_server,
    store,
)

# The other CI stacks (.ci/matrix) run with OSF_PROPERTY_PROFILE=stack: they are there to check
# versions (jax, flax, orbax-checkpoint, numpy, Python), and the main environment runs every test.
ON_STACK = os.environ.get("OSF_PROPERTY_PROFILE") == "stack"


def pytest_collection_modifyitems(config, items):
    """Skips the tests marked ``main_env_only`` on the other CI stacks.

    A test earns the marker when what it proves cannot depend on the versions a stack pins: a
    static scan of the sources or docs, a pure-Python simulation, or a layer (the command line)
    over library paths that other tests run on every stack. The marker's argument says why; the
    skip names the main environment, which runs it::

        pytestmark = pytest.mark.main_env_only("a static scan of the sources")
    """
    if not ON_STACK:
        return
    for item in items:
        marker = item.get_closest_marker("main_env_only")
        if marker is None:
            continue
        why = marker.args[0] if marker.args else "version independent"
        item.add_marker(pytest.mark.skip(reason=f"main environment only ({why}): CI runs it there"))


def pytest_collectreport(report):
    optional_deps.log_if_missing(report)  # a module skipped at import


def pytest_runtest_logreport(report):
    optional_deps.log_if_missing(report)


@pytest.hookimpl(optionalhook=True)  # (a pytest-xdist hook: the README's `pytest -n auto`)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, and at most one per 4 GiB of memory (a worker holds a
    few GiB at its peak, and its multi-host tests start up to 8 processes of their own)."""
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // (4 << 30)))


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
    from orbax_safetensors._src.compat import jaxcompat

    set_mesh = jaxcompat.plain_set_mesh()
    if set_mesh is not None:
        set_mesh(None)


# orbax-checkpoint 0.11.40's own save of a replicated slice on jax 0.7 (the mid-2025 stack):
# ``with jax.sharding.set_mesh(mesh)`` in ``replica_slices.py``, where jax 0.7's set_mesh is a
# plain setter returning None. Orbax's reference save itself fails, so a differential test
# that reaches it has nothing to compare against: reported as skipped, naming the bug.
_ORBAX_SET_MESH_BUG = "does not support the context manager protocol"
_ORBAX_SET_MESH_SITE = "orbax/checkpoint/_src/serialization/replica_slices.py"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    import jax

    from orbax_safetensors._src.compat import jaxcompat

    if jaxcompat.plain_set_mesh() is None:
        return
    text = str(report.longrepr)
    if _ORBAX_SET_MESH_BUG in text and _ORBAX_SET_MESH_SITE in text:
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            f"Skipped: orbax-checkpoint's own save fails on jax {jax.__version__} "
            "(replica_slices.py uses jax.sharding.set_mesh as a context manager)",
        )
