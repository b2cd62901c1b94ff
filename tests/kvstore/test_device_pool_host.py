"""kvstore/device_pool.py's host-side logic over a numpy stand-in for cupy (tests/conftest.py
fake_cupy): no GPU, no kernel runs (tests/gpu/test_device_pool_gpu.py runs the kernels)."""
import numpy as np


def test_plan_cache_tells_head_counts_apart(fake_cupy):
    """(the key held n_heads % 256: 16 heads, 2 CTAs per SM on attention.cu, and 272 heads,
    1 CTA per SM, shared a plan)"""
    fake_cupy(cc="89")  # attention.cu: its CTAs per SM depend on the head count
    from kernels.cuda import attention as A
    from kvstore.device_pool import DevicePool

    pool = DevicePool(1, 512, 64, "kv8", n_blocks=8, block_size=16, max_slots=4)
    slots, pos = np.arange(4), np.full(4, 20000)
    for heads in (16, 272, 16):
        plan = pool.plan(slots, pos, heads)
        want = A.decode_plan(slots, pos, ctas_per_sm=A.ctas_per_sm("kv8", heads, 512, 64),
                             head_groups=A.head_groups("kv8", heads, 512, 64))
        assert (plan.chunk, plan.n_work) == (want.chunk, want.n_work), heads
    assert pool.plan(slots, pos, 16) is plan  # (still cached within a step)


def test_plan_counts_head_groups(fake_cupy):
    """(128 heads run as two 64-head CTAs per work item: the pool's plan made one wave of
    work items, two waves of CTAs)"""
    fake_cupy(cc="90")
    from kernels.cuda import attention as A
    from kvstore.device_pool import DevicePool

    pool = DevicePool(1, 512, 64, "kv8", n_blocks=8, block_size=16, max_slots=16)
    slots, pos = np.arange(16), np.full(16, 32767)
    groups = A.head_groups("kv8", 128, 512, 64, 16)
    assert groups == 2
    plan = pool.plan(slots, pos, 128)
    assert plan.n_work * groups <= 132 < 2 * pool.plan(slots, pos, 64).n_work
