"""core/relayout.py: which tensors object-storage saves and restores move to row blocks, and
which rows (bytes) each process holds then; pure, so a planner simulating N processes gets
the answer the real processes act on (checked with real processes in
tests/objstore/test_objstore_relayout.py)."""

from __future__ import annotations

import pytest

from orbax_safetensors._src.core import relayout as _relayout

layout_of = _relayout.row_block_layout


def test_column_stripes_across_processes_become_one_row_block_each() -> None:
    layout = layout_of((512, 4096), "F32", (None, "data"), ("data",), [0, 1], process_count=2)
    assert layout is not None
    assert layout.rows_per_device == 256 and layout.row_bytes == 4096 * 4
    assert layout.process_rows(0) == ((0, 256),) and layout.process_rows(1) == ((256, 512),)
    assert layout.byte_ranges(1) == ((256 * 4096 * 4, 256 * 4096 * 4),)
    assert layout.process_rows(7) == () and layout.byte_ranges(7) == ()


def test_a_process_s_adjacent_devices_form_one_block_and_scattered_ones_several() -> None:
    # (2, 2) mesh ("data", "model"), "data" across processes; the first dimension cut by the
    # in-process axis, the second by the across-process one.
    procs = [[0, 0], [1, 1]]
    layout = layout_of((256, 1024), "BF16", ("model", "data"), ("data", "model"), procs, 2)
    assert layout is not None and layout.rows_per_device == 64
    assert layout.blocks == {0: ((0, 128),), 1: ((128, 256),)}
    # Devices of the two processes interleaved in the mesh's order: two blocks each.
    scattered = layout_of((64, 8), "F32", (None, "x"), ("x",), [0, 1, 0, 1], 2)
    assert scattered is not None
    assert scattered.blocks == {0: ((0, 16), (32, 48)), 1: ((16, 32), (48, 64))}
    assert scattered.byte_ranges(1) == ((16 * 32, 16 * 32), (48 * 32, 16 * 32))


@pytest.mark.parametrize(
    ("shape", "dtype", "spec", "axes", "procs"),
    [
        ((512, 4096), "F32", ("data", None), ("data",), [0, 1]),  # rows across processes
        ((512, 4096), "F32", (None, "model"), ("data", "model"), [[0, 0], [1, 1]]),  # in-process
        ((16, 4096), "F32", (None, "data"), ("data",), [0, 1]),  # too few rows
        ((4, 8, 512), "F32", (None, "data"), ("data",), [0, 1]),  # 4 runs per box
        ((513, 64), "F32", (None, "data"), ("data",), [0, 1]),  # rows not divisible
        ((34, 1), "F4", (None, "data"), ("data",), [0, 1]),  # blocks of half bytes
        ((512,), "F32", ("data",), ("data",), [0, 1]),  # one dimension
        ((512, 4096), "F32", (None, None), ("data",), [0, 1]),  # replicated
        ((512, 4096), "F32", (None, "data"), ("data",), [0, 0]),  # one process
    ],
)
def test_tensors_written_and_read_directly(shape, dtype, spec, axes, procs) -> None:
    assert layout_of(shape, dtype, spec, axes, procs) is None


def test_the_first_dimension_s_runs_count_with_the_dims_before_the_cut() -> None:
    # 4 x 8 = 32 runs per box before the cut dimension: re-laid out (4 rows, 2 per device).
    layout = layout_of((4, 8, 512), "F32", (None, None, "data"), ("data",), [0, 1])
    assert layout is not None and layout.blocks == {0: ((0, 2),), 1: ((2, 4),)}
    assert layout.byte_ranges(1) == ((2 * 8 * 512 * 4, 2 * 8 * 512 * 4),)
    # Axes given as a tuple of names, one of them across processes.
    both = layout_of(
        (64, 64), "F32", (None, ("model", "data")), ("data", "model"), [[0, 0], [1, 1]]
    )
    assert both is not None and both.blocks == {0: ((0, 32),), 1: ((32, 64),)}


def test_a_mesh_that_leaves_out_a_process_is_not_re_laid_out() -> None:
    assert layout_of((512, 64), "F32", (None, "data"), ("data",), [0, 1], process_count=3) is None
    assert layout_of((512, 64), "F32", (None, "data"), ("data",), [0, 1], process_count=2)


def test_mesh_processes_must_match_the_mesh_axes() -> None:
    with pytest.raises(ValueError, match="mesh_processes has 1 dimensions"):
        layout_of((512, 64), "F32", (None, "data"), ("data", "model"), [0, 1])
