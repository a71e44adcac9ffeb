"""``core.relayout``'s groups: which tensors a save to object storage joins on the devices, where their
members sit in the files and which rows of a group each process writes (pure functions of
global facts, shared by the save and ``benchmarks/scale_sim.py``)."""

from __future__ import annotations

import numpy as np

from orbax_safetensors._src.core import plan as _plan
from orbax_safetensors._src.core import relayout as _groups

MiB = 1 << 20


def test_file_order_puts_each_keys_tensors_together() -> None:
    keys = ["a", None, "b", "a", None, "b", "a"]
    assert _groups.file_order(keys) == [0, 3, 6, 1, 2, 5, 4]


def test_plan_keeps_members_adjacent() -> None:
    # (the stable alignment sort of plan_files keeps a key's tensors next to each other)
    specs = [
        _plan.TensorSpec(f"{kind}{i}", "F32", shape)
        for i in range(3)
        for kind, shape in (("q", (64, 32)), ("n", (7,)))
    ]
    keys = [(s.shape, s.dtype) for s in specs]
    plan = _plan.plan_files([specs[i] for i in _groups.file_order(keys)], max_file_size=None)
    entries = sorted(plan.files[0].entries.values(), key=lambda e: e.begin)
    names = [e.name for e in entries]
    assert names[:3] == ["q0", "q1", "q2"]
    for k in range(2):
        assert entries[k].begin + entries[k].nbytes == entries[k + 1].begin


def test_groups_reach_the_run_and_spread_over_every_process() -> None:
    # 80 bf16 matrices of 128 MiB on 1,024 processes x 8 devices: 128 KiB per process each
    shapes, dtypes = [(8192, 8192)] * 80, ["BF16"] * 80
    groups = _groups.concat_groups(shapes, dtypes, ["q"] * 80, 1024, 8192)
    assert [len(g.members) for g in groups] == [80]
    g = groups[0]
    rows = g.process_rows(np.arange(8192) // 8)
    assert len(rows) == 1024 and all(len(r) == 1 for r in rows.values())
    assert sum(b - a for r in rows.values() for a, b in r) == g.total_rows
    assert (rows[3][0][1] - rows[3][0][0]) * g.row_bytes == 10 * MiB


def test_small_keys_are_written_whole_and_lone_tensors_stay() -> None:
    shapes = [(512,)] * 4 + [(8192, 4096)]
    groups = _groups.concat_groups(shapes, ["F32"] * 5, ["n"] * 4 + ["lone"], 4, 8)
    assert len(groups) == 1 and groups[0].members == (0, 1, 2, 3)
    assert groups[0].writer == 3  # the last process first: the primary has the commit to do
    assert groups[0].process_rows(np.arange(8) // 2) == {3: [(0, 2048)]}


def test_groups_of_few_rows_start_where_the_previous_ended() -> None:
    # 256 expert rows, 2 members per group, 8 processes x 128 devices: each group fills
    # 512 of the 1,024 devices, the next group the other half
    shapes, dtypes = [(256, 256, 256)] * 8, ["F32"] * 8
    groups = _groups.concat_groups(shapes, dtypes, ["e"] * 8, 8, 1024, run_bytes=1)
    procs = np.arange(1024) // 128
    owners = [sorted(g.process_rows(procs)) for g in groups]
    assert owners[0] == [0, 1, 2, 3] and owners[1] == [4, 5, 6, 7]


def test_member_rows_map_a_range_back_onto_members() -> None:
    g = _groups.ConcatGroup((5, 9, 11), rows=10, row_bytes=4, devices=4)
    assert g.member_rows(8, 23) == [(0, 8, 10), (1, 0, 10), (2, 0, 3)]
    assert g.member_rows(10, 20) == [(1, 0, 10)]
