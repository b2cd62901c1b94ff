"""kernels/cuda/attention.py's host-side logic (work plans, caches) over a numpy stand-in
for cupy (tests/conftest.py fake_cupy): no GPU, no kernel runs."""
import numpy as np
import pytest


def test_a_padding_row_gets_no_work_items(fake_cupy):
    """(table row -1 is a padding query, context 0: its keys made work items that read
    block-table row -1, before the table, and its position counted in max_keys)"""
    fake_cupy()
    from kernels.cuda import attention as A

    plan = A.decode_plan([0, -1, 1, 2], [300, 5000, 5, -1], n_sm=132)
    work = plan.work.get()
    assert (work[:, 1] >= 0).all() and set(work[:, 0]) == {0, 2}
    assert plan.splits.get().tolist() == [0, 2, 2, 3, 3]
    assert (plan.max_row, plan.max_keys) == (1, 301)  # (row 2 reads no key)
    with pytest.raises(ValueError, match="table row -2"):
        A.decode_plan([0, -2], [3, 3], n_sm=132)
