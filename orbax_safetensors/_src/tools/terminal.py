"""Terminal output shared by the tools: whether stderr is a terminal, progress bars that
appear only there (never mixed into piped or redirected output), and counts in words.

Example::

    with progress_bar(total_bytes, "convert model", progress=None) as bar:
        bar.update(n)
    counted(1, "tensor")     # '1 tensor'
"""

from __future__ import annotations

import sys
from typing import Any


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is a terminal (False when it is missing or closed)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar on stderr, shown only when stderr is a terminal (never mixed into piped or
    redirected output) and ``progress`` is not False."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=progress is False or not stderr_is_terminal(),
        mininterval=0.5,
        leave=False,
    )


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in agreement: ``counted(1, "file")`` is ``'1 file'``,
    ``counted(2, "file")`` ``'2 files'`` (``plural`` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
