"""Memory figures a worker reports (the soak, `generate --stats`, the dashboards)."""
from __future__ import annotations

import os
import resource
import sys


def rss_bytes() -> int:
    """Resident set of this process (Linux: /proc/self/statm; elsewhere the peak RSS)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def device_mem_bytes(kind: str) -> int | None:
    """Bytes in use on the worker's device: MLX's active memory on metal, the CUDA device's
    used memory where CuPy sees one, the RSS on cpu (host memory is its device)."""
    if kind == "metal":
        import mlx.core as mx
        return int(mx.get_active_memory())
    if kind == "cuda":
        import importlib.util
        if importlib.util.find_spec("cupy") is None:
            return None
        import cupy
        try:
            free, total = cupy.cuda.runtime.memGetInfo()
        except cupy.cuda.runtime.CUDARuntimeError:  # a cuda-labelled node without a GPU
            return None
        return int(total - free)
    return rss_bytes()
