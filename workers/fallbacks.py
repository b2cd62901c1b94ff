"""Every path of the kvfleet_fallbacks counter (cluster/metrics.py): the names a worker step
reports in StepOutput.fallbacks, declared here so that the metrics endpoint starts each at 0
(a counter's series appears at its first increment, and Prometheus's increase() misses
that step).

    cpu.polar_rebuild_rows   polar rows the numpy attention rebuilt to float32 (workers/actor.py)
    cuda.host_model_steps    steps of a cuda worker that runs the numpy model (workers/ep_worker.py)
    cuda.<op>_<tier>         DevicePool calls served by the CPU codec (encode) or the CPU
                             attention (attend) (kvstore/device_pool.py)
    cuda.<name>              kernels/cuda/attention.py's slower launches (CUDA_KERNEL)
    metal.paged_attention    MLX-op attention instead of the Metal kernel (kernels/metal)
    metal.<op>_<tier>        numpy paths of a metal pool: paged_attention, encode, decode

The set is finite: the names are literals at the counting calls, and <tier> ranges over
kernels.tiers.TIERS (tests/workers/test_fallbacks.py scans the counting calls against this
list, so a new one must be declared here).
"""
from __future__ import annotations

from kernels.tiers import TIERS

WORKER = ("cpu.polar_rebuild_rows", "cuda.host_model_steps")
CUDA_POOL_OPS = ("encode", "attend")  # DeviceCounters.fallback(op, tier)
CUDA_KERNEL = ("pdl_driver", "pdl_ptx", "pdl_refused", "attn_wg_clusters", "attn_wg_smem",
               "attn_split_smem")  # kernels.cuda.attention.fallbacks
METAL = ("paged_attention",)  # KernelStats.count_fallback(name)
METAL_TIER_OPS = ("paged_attention", "encode", "decode")  # KernelStats: <op>_<tier>

FALLBACK_PATHS: tuple[str, ...] = (
    *WORKER,
    *(f"cuda.{op}_{tier}" for op in CUDA_POOL_OPS for tier in TIERS),
    *(f"cuda.{name}" for name in CUDA_KERNEL),
    *(f"metal.{name}" for name in METAL),
    *(f"metal.{op}_{tier}" for op in METAL_TIER_OPS for tier in TIERS),
)
