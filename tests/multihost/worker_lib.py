"""Helpers imported at the top of a multi-process JAX worker script.

A worker is a plain Python file started by :func:`launcher.run_workers` as ``python <file>`` in N
OS processes. The launcher puts this directory on ``PYTHONPATH``, so a worker starts with::

    import worker_lib

    ctx = worker_lib.init()  # before any other JAX use
    import jax

    ...  # build arrays, run collectives, save and restore checkpoints
    worker_lib.emit_result({"process_index": jax.process_index()})
    worker_lib.finish()

This module imports JAX lazily (inside :func:`init`), so the launcher can import its constants
without starting a JAX runtime in the test process.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import traceback
from types import TracebackType
from typing import Any

# The environment protocol between launcher and workers.
ENV_COORDINATOR = "MULTIHOST_COORDINATOR"
ENV_PROCESS_ID = "MULTIHOST_PROCESS_ID"
ENV_NUM_PROCESSES = "MULTIHOST_NUM_PROCESSES"
ENV_DEVICES_PER_PROCESS = "MULTIHOST_DEVICES_PER_PROCESS"
ENV_ARGS = "MULTIHOST_ARGS"
RESULT_MARKER = "@@RESULT@@"
# On SIGUSR1 a worker dumps every thread's Python stack to stderr (the launcher sends it on timeout).
DUMP_STACKS_SIGNAL = signal.SIGUSR1

# Seconds for jax.distributed's init, heartbeat and shutdown timeouts (defaults are 100-300 s).
DISTRIBUTED_TIMEOUT_S = 60
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What :func:`init` tells a worker about its place in the job."""

    process_id: int
    num_processes: int
    devices_per_process: int
    coordinator_address: str
    args: dict[str, Any]


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """Print the traceback and exit at once, skipping JAX's shutdown barrier."""
    traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def install_handlers() -> None:
    """Make an uncaught exception fatal at once and let SIGUSR1 dump all Python stacks.

    Without this, a process with an uncaught exception waits in the distributed shutdown barrier
    while its peers block in a collective. :func:`init` calls it; call it directly only in workers
    that never join the JAX job.
    """
    sys.excepthook = _excepthook
    faulthandler.register(DUMP_STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def _required_env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"worker_lib: environment variable {name} is not set; run this worker through "
            "tests/multihost/launcher.py:run_workers, not directly."
        )
    return value


def read_context() -> WorkerContext:
    """Read the launcher's environment variables, without touching JAX."""
    return WorkerContext(
        process_id=int(_required_env(ENV_PROCESS_ID)),
        num_processes=int(_required_env(ENV_NUM_PROCESSES)),
        devices_per_process=int(_required_env(ENV_DEVICES_PER_PROCESS)),
        coordinator_address=_required_env(ENV_COORDINATOR),
        args=json.loads(os.environ.get(ENV_ARGS) or "{}"),
    )


def _bind_gloo_to_loopback() -> None:
    """Re-register JAX's CPU backend with gloo collectives bound to 127.0.0.1.

    gloo otherwise binds to whatever ``socket.gethostname()`` resolves to, and fails with
    ``gloo/transport/tcp/device.cc:99 rv == 0. -2 vs 0`` where the hostname does not resolve.
    This uses private JAX APIs (verified with jax 0.10.2); a JAX upgrade that moves them fails here
    with a message saying what to update, rather than later with an obscure gloo error.
    """
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        make_gloo = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
        register = xla_bridge.register_backend_factory
        _ = distributed.global_state.client
    except (ImportError, AttributeError) as e:
        import jax

        raise RuntimeError(
            f"worker_lib: the gloo-on-loopback fix uses private JAX APIs (jax._src.xla_bridge."
            f"register_backend_factory/make_cpu_client, jax._src.lib._jax."
            f"make_gloo_tcp_collectives, jax._src.distributed.global_state.client) that are "
            f"missing in jax {jax.__version__}: {e!r}. Update _bind_gloo_to_loopback in "
            f"{__file__} for this JAX version (see MULTIHOST.md, pitfall 1)."
        ) from e

    def cpu_backend_factory() -> Any:
        try:
            collectives = make_gloo(
                distributed_client=distributed.global_state.client, hostname=LOOPBACK
            )
        except TypeError as e:
            raise RuntimeError(
                "worker_lib: jax._src.lib._jax.make_gloo_tcp_collectives no longer accepts "
                f"(distributed_client=..., hostname=...): {e}. Update _bind_gloo_to_loopback in "
                f"{__file__}."
            ) from e
        return make_cpu_client(collectives=collectives)

    register("cpu", cpu_backend_factory, priority=0, fail_quietly=False)


def init() -> WorkerContext:
    """Join the multi-process JAX job described by the launcher's environment.

    Call it first, before any JAX computation: it installs the fail-fast exception hook, sets the
    CPU device count, binds gloo to 127.0.0.1, disables JAX's preemption service (which swallows
    SIGTERM) and calls ``jax.distributed.initialize`` with 60 s timeouts.

    Returns:
        The process id, process count, devices per process, coordinator address and the JSON
        ``args`` the launcher passed.
    """
    install_handlers()
    ctx = read_context()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", ctx.devices_per_process)
    jax.config.update("jax_enable_preemption_service", False)
    _bind_gloo_to_loopback()
    jax.distributed.initialize(
        coordinator_address=ctx.coordinator_address,
        coordinator_bind_address=ctx.coordinator_address,
        num_processes=ctx.num_processes,
        process_id=ctx.process_id,
        initialization_timeout=DISTRIBUTED_TIMEOUT_S,
        heartbeat_timeout_seconds=DISTRIBUTED_TIMEOUT_S,
        shutdown_timeout_seconds=DISTRIBUTED_TIMEOUT_S,
    )
    return ctx


def emit_result(obj: Any) -> None:
    """Print ``obj`` as the JSON result line the launcher parses into ``WorkerResult.result``.

    ``obj`` must be JSON-serialisable (convert numpy values with ``.tolist()``/``int()``). If a
    worker emits several results, the last one wins.
    """
    line = json.dumps(obj)
    sys.stdout.write(f"{RESULT_MARKER} {line}\n")
    sys.stdout.flush()


def finish() -> None:
    """Leave the job cleanly: ``jax.distributed.shutdown()`` (a barrier), then flush output."""
    import jax

    jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
