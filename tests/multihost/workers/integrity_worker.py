"""Restores of a directory holding one flipped bit, in each process: a target sharded across
processes reads each process's own rows only (the whole-tensor CRC32C cannot be checked), a
replicated one reads the whole tensor in every process (checked, the damage named)."""

import worker_lib

ctx = worker_lib.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_safetensors as osf  # noqa: E402

mesh = Mesh(np.array(jax.devices()).reshape(ctx.num_processes, -1), ("p", "d"))
saved = np.zeros((8, 4), np.float32)


def target(spec: P) -> dict:
    return {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, spec))}


def outcome(read) -> dict:
    """Whether this process's shards hold the saved values, or the error's message."""
    try:
        got = read()
    except osf.IntegrityError as e:
        return {"error": str(e)}
    shards = got["w"].addressable_shards
    return {"intact": all(np.array_equal(np.asarray(s.data), saved[s.index]) for s in shards)}


directory = ctx.args["dir"]
file = f"{directory}/model.safetensors"
worker_lib.emit_result(
    {
        "own_rows": outcome(lambda: osf.restore_directory(directory, target(P("p")))),
        "own_rows_of_the_file": outcome(lambda: osf.load_file(file, target(P("p")))),
        "replicated": outcome(lambda: osf.restore_directory(directory, target(P()))),
        "replicated_file": outcome(lambda: osf.load_file(file, target(P()))),
    }
)
worker_lib.finish()
