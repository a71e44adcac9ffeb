"""The kernel's per-process I/O counters, where the kernel keeps them.

``/proc/self/io``'s ``rchar`` counts the bytes this process's read calls returned; Linux keeps
it, gVisor (the TPU machines' sandbox) has no such line. Tests that count bytes read skip
where it is missing.

Example::

    @pytest.mark.skipif(not counts_reads(), reason=NO_COUNTER)
    def test_reads_little(): ...
"""

from __future__ import annotations

NO_COUNTER = "needs /proc/self/io's rchar (Linux; gVisor has none)"


def counts_reads() -> bool:
    """Whether this kernel counts the bytes read calls return (``rchar``)."""
    try:
        with open("/proc/self/io", "rb") as f:
            return b"rchar:" in f.read(4096)
    except OSError:
        return False
