"""Where a block of Python spends its wall time, thread by thread: a sampling profiler that
needs nothing installed (the TPU machine has no py-spy, and no profiler may attach there).

Every ``interval`` seconds a daemon thread reads every other thread's current frame
(``sys._current_frames``) and counts, per thread name, the innermost frames of this
library, of the benchmark, or of the packages named in ``focus``. A thread blocked in C (a
``pwrite``, a device transfer, a lock) shows the Python line that called into it, which is
what is wanted: which step of the pipeline each thread waits in. Minor page faults and
context switches of the whole process (``getrusage``) are taken at entry and exit.

Example::

    with StackSampler() as sampler:
        mngr.save(step, args=osf.SafetensorsSave(state))
        mngr.wait_until_finished()
    print(sampler.report(top=8))
"""

from __future__ import annotations

import collections
import resource
import sys
import threading
import time
from typing import Any

# Frames of these files are shown (the innermost such frame of each sample); a frame of
# another file is shown only as the innermost frame, if none of these is on the stack.
FOCUS = ("orbax_safetensors", "benchmarks", "orbax/checkpoint", "jax/_src")


def _where(frame: Any, focus: tuple[str, ...]) -> str:
    """The innermost frames of ``frame``'s stack in ``focus`` (up to three), outermost last."""
    parts: list[str] = []
    innermost = None
    while frame is not None and len(parts) < 3:
        code = frame.f_code
        path = code.co_filename
        if innermost is None:
            innermost = f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}"
        hit = next((f for f in focus if f in path), None)
        if hit is not None:
            short = path.split(hit, 1)[1].lstrip("/") or path
            parts.append(f"{hit.split('/')[-1]}/{short}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts) if parts else innermost or "?"


class StackSampler:
    """Samples every thread's stack every ``interval`` seconds while the block runs."""

    def __init__(self, interval: float = 0.002, focus: tuple[str, ...] = FOCUS) -> None:
        self.interval = interval
        self.focus = focus
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.samples = 0
        self.seconds = 0.0
        self.faults = 0
        self.switches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._usage0 = (usage.ru_minflt, usage.ru_nvcsw + usage.ru_nivcsw)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.faults = usage.ru_minflt - self._usage0[0]
        self.switches = usage.ru_nvcsw + usage.ru_nivcsw - self._usage0[1]

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, f"thread-{ident}")
                # thread pools name their threads by pool and number: one row per pool
                pool = name.rstrip("0123456789").rstrip("_-") or name
                self.counts[pool][_where(frame, self.focus)] += 1
            self.samples += 1

    def summary(self, top: int = 6) -> dict[str, Any]:
        """Per thread (pool): the share of samples it was seen in each place, largest first."""
        out: dict[str, Any] = {
            "seconds": round(self.seconds, 3),
            "samples": self.samples,
            "minor_faults": self.faults,
            "context_switches": self.switches,
            "threads": {},
        }
        for pool, counter in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(counter.values())
            out["threads"][pool] = {
                "seen": round(total / max(1, self.samples), 2),  # threads of the pool, on average
                "top": [
                    [where, round(n / max(1, self.samples), 3)]
                    for where, n in counter.most_common(top)
                ],
            }
        return out

    def report(self, top: int = 6) -> str:
        """:meth:`summary` as text: per pool, the seconds of wall time spent in each place
        (summed over the pool's threads)."""
        s = self.summary(top)
        lines = [
            f"{s['seconds']:.3f} s, {s['samples']} samples, {s['minor_faults']} minor faults, "
            f"{s['context_switches']} context switches"
        ]
        for pool, row in s["threads"].items():
            lines.append(f"  {pool} (x{row['seen']}):")
            for where, share in row["top"]:
                lines.append(f"    {share * s['seconds']:7.3f} s  {where}")
        return "\n".join(lines)
