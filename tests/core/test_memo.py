"""ShardingMemo: one computation per distinct sharding, looked up by identity then value."""

from __future__ import annotations

import jax

from orbax_safetensors._src.core.sharding import ShardingMemo


def _counting(fn):
    calls = []

    def wrapped(sharding):
        calls.append(sharding)
        return fn(sharding)

    return wrapped, calls


def test_equal_sharding_objects_are_computed_once():
    device = jax.local_devices()[0]
    a = jax.sharding.SingleDeviceSharding(device)
    b = jax.sharding.SingleDeviceSharding(device)  # a distinct object, equal to a
    assert a is not b and a == b
    fn, calls = _counting(lambda s: len(s.device_set))
    memo = ShardingMemo(fn)
    assert [memo(a), memo(b), memo(a), memo(b)] == [1, 1, 1, 1]
    assert calls == [a]


def test_different_shardings_get_their_own_answers():
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(devices, ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    single = jax.sharding.SingleDeviceSharding(devices[0])
    memo = ShardingMemo(lambda s: (type(s).__name__, getattr(s, "spec", None)))
    assert memo(replicated) == ("NamedSharding", jax.sharding.PartitionSpec())
    assert memo(split) == ("NamedSharding", jax.sharding.PartitionSpec("x"))
    assert memo(single) == ("SingleDeviceSharding", None)


def test_unhashable_keys_are_remembered_by_identity():
    key = ["not", "hashable"]
    fn, calls = _counting(len)
    memo = ShardingMemo(fn)
    assert memo(key) == 2 and memo(key) == 2
    assert memo(["other", "list", "!"]) == 3
    assert len(calls) == 2  # once per object


def test_entries_keep_their_keys_alive_so_ids_are_not_reused():
    memo = ShardingMemo(lambda s: s.tag)

    class Key:
        def __init__(self, tag):
            self.tag = tag

        __hash__ = None  # type: ignore[assignment]  # identity only

    seen = [memo(Key(i)) for i in range(100)]  # each key dies at once outside the memo
    assert seen == list(range(100))
