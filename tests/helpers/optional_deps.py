"""Test dependencies that the README's ``pip install -e ".[test]"`` leaves out, and the skip
that names them.

A test that needs one (google-tunix, whose own dependencies are a trainer's stack; qwix) calls
:func:`missing` where it finds the package absent, at import for a whole module or inside a
test: the test skips with a reason that starts with :data:`MISSING` and says how to install the
package, and the README's test command runs everything else.

CI (``.ci/run``) runs the README's command as written, with ``OSF_MISSING_OPTIONAL_LOG`` naming
a file where ``conftest.py`` lists each test (or module) skipped so; it then installs those
packages and runs only the listed tests again with ``OSF_REQUIRE_OPTIONAL=1``, which turns the
skip into a failure: a package CI did not install cannot pass there as a skip.

Example::

    if importlib.util.find_spec("qwix") is None:
        optional_deps.missing("qwix", "pip install qwix")
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

MISSING = "optional test dependency missing"
LOG_ENV = "OSF_MISSING_OPTIONAL_LOG"
REQUIRE_ENV = "OSF_REQUIRE_OPTIONAL"


def missing(what: str, install: str) -> NoReturn:
    """Skips the calling test, or its whole module when called at import, naming ``what`` is
    missing and the ``install`` command; fails instead under ``OSF_REQUIRE_OPTIONAL=1``."""
    reason = f"{MISSING}: {what} ({install})"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 requires it", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def log_if_missing(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Appends ``report``'s node id to the file ``OSF_MISSING_OPTIONAL_LOG`` names when the
    report is a skip from :func:`missing` (a module's collection or a test's run)."""
    path = os.environ.get(LOG_ENV)
    if not path or not report.skipped or not isinstance(report.longrepr, tuple):
        return
    if report.longrepr[2].startswith(f"Skipped: {MISSING}"):
        with open(path, "a") as log:  # (xdist workers append whole lines)
            log.write(report.nodeid + "\n")
