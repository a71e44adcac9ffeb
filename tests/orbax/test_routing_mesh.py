"""Orbax's own handlers, called for Orbax's args in a mixed root, leave no global mesh behind.

orbax-checkpoint 0.11.40 on jax 0.7 (the mid-2025 stack) uses ``jax.sharding.set_mesh`` as a
context manager when it saves a replicated array; on jax 0.7 that is a plain setter, so Orbax's
save fails after setting a mesh for the whole thread and every later jit on other devices fails.
The router runs Orbax's handlers inside ``jaxcompat.global_mesh_kept``: whatever Orbax's save
does, the caller's thread keeps its mesh (checked before the suite-wide fixture clears it).
"""

from __future__ import annotations

import asyncio

import devices  # (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_safetensors._src.compat import jaxcompat
from orbax_safetensors._src.orbax import args as _args


def _replicated() -> dict[str, jax.Array]:
    mesh = devices.mesh((2,), ("d",))
    return {"x": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P()))}


def _jit_elsewhere_works() -> None:
    # A jit on devices other than the saved array's: what a leaked global mesh breaks.
    y = jax.device_put(jnp.ones(4), devices.take(4)[3])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1)(y)), np.full(4, 2.0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_orbax_save_through_the_router_keeps_the_global_mesh(tmp_path, mode):
    router = _args.OrbaxRouter()
    directory = epath.Path(tmp_path) / "item"
    directory.mkdir()
    args = ocp.args.StandardSave(_replicated())
    try:
        if mode == "sync":
            router.save(directory, args)
        else:

            async def run() -> None:
                futures = await router.async_save(directory, args)
                for future in futures or ():
                    future.result()

            asyncio.run(run())
    except TypeError as err:  # Orbax 0.11.40 on jax 0.7: its own save fails; the mesh is kept
        assert "context manager" in str(err)
    finally:
        router.close()
    if jaxcompat.plain_set_mesh() is not None:
        before = jax.sharding.set_mesh(None)
        assert before is None, f"a global mesh was left set: {before}"
    _jit_elsewhere_works()


def test_global_mesh_kept_restores_a_mesh_set_inside():
    if jaxcompat.plain_set_mesh() is None:
        pytest.skip(f"jax {jax.__version__}: set_mesh is not a plain setter (nothing to guard)")
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with jaxcompat.global_mesh_kept():
        jax.sharding.set_mesh(mesh)
    assert jax.sharding.set_mesh(None) is None
