"""A worker in which process ``args["fail_process"]`` raises while its peers wait in a barrier."""

import worker_lib

ctx = worker_lib.init()

from jax.experimental import multihost_utils  # noqa: E402

if ctx.process_id == ctx.args.get("fail_process", 1):
    raise ValueError(f"intentional failure in process {ctx.process_id}")
multihost_utils.sync_global_devices("never reached by the failing process")
worker_lib.finish()
