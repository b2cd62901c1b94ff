"""Diagnostic (not a test): one attn_split launch per tier/head count for Nsight Compute.

    KVFLEET_CUDA_LINEINFO=1 ncu --kernel-name attn_split --launch-skip 1 --launch-count 1 \
        python3 tests/gpu/diag_profile.py kv8 64
"""
import sys

import cupy as cp
import numpy as np

from cluster.bench.attention import DL, DR, SCALE, _device_planes
from kernels.cuda import attention as cuda_attention
from kernels.tiers import get_tier

tier, H = get_tier(sys.argv[1]), int(sys.argv[2])
B, T = 16, 32768
planes, tables = _device_planes(tier, B, T, np.random.default_rng(0))
plan = cuda_attention.decode_plan(np.arange(B), np.full(B, T - 1))
q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
for _ in range(2):
    cuda_attention.paged_mla_decode(tier, planes, tables, plan, q_lat, q_rope, SCALE)
cp.cuda.Device().synchronize()
print("done")
