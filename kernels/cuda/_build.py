"""Lazy NVRTC compilation of the .cu sources beside this file, cached by their parameters.

    fn = kernel("attention.cu", "attn_split", TIER=1, MT=4)   # compiled once per parameter set

Parameters become -D defines, so one source yields one specialised module per tier / tile
shape (mini-sglang's `_jit_*_module` idea). The cache is keyed on (source, defines, device)
and lives for the process; compilation happens on first use, never at import.
"""
from __future__ import annotations

import functools
import os

import cupy as cp

from kernels.cuda._source import _source


# Bit-exact float32: no fused multiply-add, IEEE division and square root, denormals kept.
EXACT_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                 "--ftz=false")
FAST_OPTIONS = ("--std=c++17",)


@functools.lru_cache(maxsize=None)
def _module(name: str, defines: tuple[tuple[str, int], ...], exact: bool,
            device: int) -> cp.RawModule:
    opts = (EXACT_OPTIONS if exact else FAST_OPTIONS) + tuple(
        f"-D{k}={v}" for k, v in defines)
    if os.environ.get("KVFLEET_CUDA_LINEINFO") == "1":  # source lines for ncu / profilers
        opts += ("--generate-line-info",)
    mod = cp.RawModule(code=_source(name), options=opts)
    mod.compile()
    return mod


@functools.lru_cache(maxsize=None)
def _module_arch(name: str, defines: tuple[tuple[str, int], ...], arch: str, device: int):
    """NVRTC straight to a cubin for `arch` (e.g. sm_90a, which wgmma needs: CuPy's own
    compile names the plain sm_90 target). Returns (module, compile log)."""
    from cupy_backends.cuda.libs import nvrtc

    opts = [*FAST_OPTIONS, f"--gpu-architecture={arch}", *(f"-D{k}={v}" for k, v in defines)]
    if os.environ.get("KVFLEET_CUDA_LINEINFO") == "1":
        opts.append("--generate-line-info")
    if os.environ.get("KVFLEET_CUDA_PTXAS_V") == "1":  # registers / spills in the log
        opts.append("--ptxas-options=-v")
    prog = nvrtc.createProgram(_source(name), name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on {name} for {arch} with {dict(defines)}: {e}\n"
                               f"{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    mod = cp.cuda.function.Module()
    mod.load(cubin)
    return mod, log


def arch_kernel(name: str, func: str, arch: str, **defines: int):
    """`func` of kernels/cuda/`name` compiled for one architecture (a cupy Function:
    fn(grid, block, args, shared_mem=...))."""
    key = tuple(sorted((k, int(v)) for k, v in defines.items()))
    return _module_arch(name, key, arch, cp.cuda.Device().id)[0].get_function(func)


def arch_log(name: str, arch: str, **defines: int) -> str:
    """The compiler's log of that module (ptxas warnings; -v output under
    KVFLEET_CUDA_PTXAS_V=1)."""
    key = tuple(sorted((k, int(v)) for k, v in defines.items()))
    return _module_arch(name, key, arch, cp.cuda.Device().id)[1]


def set_dynamic_smem(fn, nbytes: int) -> None:
    """Let a cupy Function use more than 48 KB of dynamic shared memory."""
    cp.cuda.driver.funcSetAttribute(fn.ptr, 8, int(nbytes))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.lru_cache(maxsize=None)
def _max_active_clusters(ptr: int, cluster: int, threads: int, smem: int) -> int:
    import ctypes

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                    ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                    ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]

    fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    fn.restype = ctypes.c_int
    cfg = LaunchConfig((cluster, 1, 1), (threads, 1, 1), smem, None, None, 0)
    n = ctypes.c_int(0)
    err = fn(ctypes.byref(n), ctypes.c_void_p(ptr), ctypes.byref(cfg))
    if err:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed ({err}) for a cluster of "
                           f"{cluster} CTAs x {threads} threads, {smem} bytes of shared memory")
    return n.value


def max_active_clusters(fn, cluster: int, threads: int, smem: int) -> int:
    """How many clusters of `cluster` CTAs of cupy Function fn (compiled with that
    __cluster_dims__) the GPU runs at once, with `threads` threads and `smem` bytes of
    dynamic shared memory each (the driver's cuOccupancyMaxActiveClusters)."""
    return _max_active_clusters(int(fn.ptr), int(cluster), int(threads), int(smem))


def kernel(name: str, func: str, exact: bool = False, **defines: int) -> cp.RawKernel:
    """The compiled function `func` of kernels/cuda/`name` with `defines` as -D macros."""
    key = tuple(sorted((k, int(v)) for k, v in defines.items()))
    return _module(name, key, exact, cp.cuda.Device().id).get_function(func)


def cuda_available() -> bool:
    """True when cupy can see at least one CUDA device."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False
