"""Timing helpers shared by the `kvfleet bench` sub-benchmarks.

`best_seconds` takes the minimum over repeats (the least disturbed run: these benchmarks
run on shared machines), on a chosen clock: CLOCKS["wall"] (perf_counter) or
CLOCKS["cpu"] (process_time: CPU seconds of this process, which other processes on an
oversubscribed machine inflate far less; with BLAS pinned to one thread it is the time one
core spent). `blas_threads(n)` pins the BLAS thread pool that numpy loaded (via
its C API, as threadpoolctl does) so that a figure means "n cores" and does not swing with
the machine's other load; it yields the count it set, or None when numpy's BLAS exposes no
such call (the figure is then taken with the BLAS default, and the result says so).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# (set, get) symbol pairs of the OpenBLAS builds numpy ships or links
_OPENBLAS_CALLS = [("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                   ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
                   ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
                   ("openblas_set_num_threads", "openblas_get_num_threads")]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def best_seconds(fn: Callable[[], object], repeat: int = 5, warmup: int = 1,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Minimum time of fn() on `clock` over `repeat` calls after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _blas_controls():
    import numpy  # noqa: F401  (loads the BLAS library into the process)
    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError as e:
        log.warning("cannot list loaded libraries (%s); BLAS threads not pinned", e)
        return None
    libs = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    for path in libs:
        lib = ctypes.CDLL(path)
        for set_name, get_name in _OPENBLAS_CALLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                return getattr(lib, set_name), getattr(lib, get_name)
    log.warning("numpy's BLAS has no OpenBLAS thread call (libraries: %s); threads not pinned",
                libs or "none found")
    return None


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[int | None]:
    """Run the block with numpy's BLAS limited to n threads; restores the old count."""
    controls = _blas_controls()
    if controls is None:
        yield None
        return
    set_threads, get_threads = controls
    old = int(get_threads())
    set_threads(int(n))
    try:
        yield int(get_threads())
    finally:
        set_threads(old)
