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
import inspect
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


# Where jaxlib's ``make_gloo_tcp_collectives`` lives, newest first: ``jax._src.lib._jax`` from
# jax 0.7 (checked with 0.7.0 and 0.10.2), ``jax._src.lib.xla_extension`` in jax 0.6 (0.6.0).
_GLOO_MODULES = ("_jax", "xla_extension")


def _find_make_gloo() -> Any:
    """jaxlib's ``make_gloo_tcp_collectives`` (private), or RuntimeError naming what to update."""
    import jax

    try:
        import jax._src.lib as jax_lib
    except ImportError:
        jax_lib = None
    for name in _GLOO_MODULES:
        make_gloo = getattr(getattr(jax_lib, name, None), "make_gloo_tcp_collectives", None)
        if make_gloo is not None:
            return make_gloo
    raise RuntimeError(
        f"worker_lib: the gloo-on-loopback fix needs the private make_gloo_tcp_collectives, "
        f"found in none of {', '.join('jax._src.lib.' + n for n in _GLOO_MODULES)} in jax "
        f"{jax.__version__}. Update _GLOO_MODULES in {__file__} for this JAX version "
        f"(see MULTIHOST.md, pitfall 1)."
    )


def _bind_gloo_to_loopback() -> None:
    """Re-register JAX's CPU backend with gloo collectives bound to 127.0.0.1.

    gloo otherwise binds to whatever ``socket.gethostname()`` resolves to, and fails with
    ``gloo/transport/tcp/device.cc:99 rv == 0. -2 vs 0`` where the hostname does not resolve.
    This uses private JAX APIs (verified with jax 0.6.0, 0.7.0 and 0.10.2); a JAX version that
    moves them fails here with a message saying what to update, rather than later with an obscure
    gloo error.
    """
    try:
        from jax._src import distributed, xla_bridge

        make_cpu_client = xla_bridge.make_cpu_client
        register = xla_bridge.register_backend_factory
        _ = distributed.global_state.client
    except (ImportError, AttributeError) as e:
        import jax

        raise RuntimeError(
            f"worker_lib: the gloo-on-loopback fix uses private JAX APIs (jax._src.xla_bridge."
            f"register_backend_factory/make_cpu_client, jax._src.distributed.global_state."
            f"client) that are missing in jax {jax.__version__}: {e!r}. Update "
            f"_bind_gloo_to_loopback in {__file__} for this JAX version (see MULTIHOST.md, "
            f"pitfall 1)."
        ) from e
    make_gloo = _find_make_gloo()

    def cpu_backend_factory() -> Any:
        try:
            collectives = make_gloo(
                distributed_client=distributed.global_state.client, hostname=LOOPBACK
            )
        except TypeError as e:
            raise RuntimeError(
                "worker_lib: jaxlib's make_gloo_tcp_collectives no longer accepts "
                f"(distributed_client=..., hostname=...): {e}. Update _bind_gloo_to_loopback in "
                f"{__file__}."
            ) from e
        return make_cpu_client(collectives=collectives)

    register("cpu", cpu_backend_factory, priority=0, fail_quietly=False)


def _disable_preemption_service() -> None:
    """Turn JAX's preemption service off where JAX has the option.

    The service swallows SIGTERM (MULTIHOST.md, pitfall 2). jax 0.10.2 has the option
    ``jax_enable_preemption_service``; jax 0.6.0 and 0.7.0 do not (``Unrecognized config
    option``) and always run the service. Nothing here relies on SIGTERM (the launcher stops
    workers with SIGKILL), so where the option is absent the worker goes on with the service on.
    """
    import jax

    if "jax_enable_preemption_service" in jax.config.values:
        jax.config.update("jax_enable_preemption_service", False)


def init() -> WorkerContext:
    """Join the multi-process JAX job described by the launcher's environment.

    Call it first, before any JAX computation: it installs the fail-fast exception hook, sets the
    CPU device count, binds gloo to 127.0.0.1, disables JAX's preemption service (which swallows
    SIGTERM) where JAX has that option, and calls ``jax.distributed.initialize`` with 60 s timeouts
    (those this JAX accepts).

    Returns:
        The process id, process count, devices per process, coordinator address and the JSON
        ``args`` the launcher passed.
    """
    install_handlers()
    ctx = read_context()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", ctx.devices_per_process)
    _disable_preemption_service()
    _bind_gloo_to_loopback()
    jax.distributed.initialize(
        coordinator_address=ctx.coordinator_address,
        coordinator_bind_address=ctx.coordinator_address,
        num_processes=ctx.num_processes,
        process_id=ctx.process_id,
        initialization_timeout=DISTRIBUTED_TIMEOUT_S,
        **_supported_timeouts(jax.distributed.initialize),
    )
    return ctx


# Timeouts jax.distributed.initialize takes only in newer JAX: heartbeat_timeout_seconds since
# jax 0.7 (0.6.0 has none: 10 heartbeats of 10 s), shutdown_timeout_seconds after 0.7.0 (0.10.2
# has it). Older JAX keeps its defaults; the excepthook and the launcher's SIGKILL of the peers
# still end a failing run at once (MULTIHOST.md, pitfall 3).
_OPTIONAL_TIMEOUTS = ("heartbeat_timeout_seconds", "shutdown_timeout_seconds")


def _supported_timeouts(initialize: Any) -> dict[str, int]:
    """The optional timeouts (``DISTRIBUTED_TIMEOUT_S``) that this ``initialize`` accepts."""
    params = inspect.signature(initialize).parameters
    return {name: DISTRIBUTED_TIMEOUT_S for name in _OPTIONAL_TIMEOUTS if name in params}


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
