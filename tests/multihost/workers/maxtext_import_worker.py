"""Multi-process ``import``: every process of the job writes the Hugging Face directory
``ctx.args["hf"]`` as a MaxText checkpoint under ``ctx.args["root"]``, once per entry of
``ctx.args["imports"]`` (``{name: {"step", "scan_layers", "batch_bytes", "cli"}}``, in order:
the first pays what a process pays once, compilations and thread pools), through
``osf.import_pytorch`` or, with ``cli``, the command line (``orbax-safetensors import
--distributed``, in this process: the job is joined already).

Reported per import: ``bytes_read`` (the load's own count, ``ReadStats.bytes_read``; None
with the command line), ``rchar`` (bytes this process's read system calls returned
meanwhile: ``/proc/self/io``), ``peak`` (``VmHWM`` growth over the resident memory before), ``seconds``; with the command
line, ``line``: what it printed.
"""

import time

import worker_lib

ctx = worker_lib.init()

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from orbax.checkpoint import v1  # noqa: E402, F401  (imported before the counters start)

import orbax_safetensors as osf  # noqa: E402
from orbax_safetensors._src.tools import cli  # noqa: E402


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


hf, root = ctx.args["hf"], Path(ctx.args["root"])
result = {"process_index": jax.process_index()}
for name, spec in ctx.args["imports"].items():
    gc.collect()  # what earlier imports freed goes back to the system: RSS is what is held
    ctypes.CDLL(None).malloc_trim(0)
    before, rss = rchar(), vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.monotonic()
    out = root / name
    if spec.get("cli"):
        printed = io.StringIO()
        argv = ["import", hf, str(out), "--mapping", "maxtext-llama3", "--distributed"]
        argv += ["--step", str(spec["step"]), "--batch-size", str(spec["batch_bytes"])]
        argv += [] if spec["scan_layers"] else ["--no-scan-layers"]
        with contextlib.redirect_stdout(printed):
            assert cli.main(argv) == 0
        bytes_read, line = None, printed.getvalue()
    else:
        report = osf.import_pytorch(
            hf,
            out,
            "maxtext-llama3",
            step=spec["step"],
            scan_layers=spec["scan_layers"],
            batch_bytes=spec["batch_bytes"],
        )
        assert report.ok, report.problems()
        bytes_read, line = report.bytes_read, ""
    result[name] = {
        "bytes_read": bytes_read,
        "line": line,
        "rchar": rchar() - before,
        "peak": vm("VmHWM") - rss,
        "seconds": round(time.monotonic() - t0, 3),
    }

worker_lib.emit_result(result)
worker_lib.finish()
