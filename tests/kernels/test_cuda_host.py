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


def test_tma_maps_are_made_once_per_layer_of_a_78_layer_pool(fake_cupy, monkeypatch):
    """(an LRU of 64 missed on every layer of every step for GLM-5.x's 78 layers: each attend
    encoded and uploaded its tensor maps again)"""
    fake_cupy()
    from kernels.cuda import attention as A
    from kvstore.device_pool import DevicePool

    made = []
    monkeypatch.setattr(A, "_encode_tensor_map",
                        lambda ptr, dims, strides, box, swizzle: made.append(ptr) or bytes(128))
    pool = DevicePool(78, 512, 64, "kv8", n_blocks=2, block_size=16, max_slots=1)
    for _ in range(3):  # decode steps
        maps = [A.tma_maps(p) for p in pool.planes]
    assert len(made) == 2 * 78  # (an L and an R map per layer, on the first step only)
    assert all(A.tma_maps(p) is m for p, m in zip(pool.planes, maps))
