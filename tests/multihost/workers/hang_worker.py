"""A worker that never joins JAX and sleeps forever, to exercise the launcher's timeout."""

import time

import worker_lib

worker_lib.install_handlers()
print("hang_worker: sleeping", flush=True)
time.sleep(3600)
