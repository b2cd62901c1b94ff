"""Lazy NVRTC compilation of the .cu sources beside this file, cached by their parameters.

    fn = kernel("attention.cu", "attn_split", TIER=1, MT=4)   # compiled once per parameter set

Parameters become -D defines, so one source yields one specialised module per tier / tile
shape (mini-sglang's `_jit_*_module` idea). The cache is keyed on (source, defines, device,
KVFLEET_CUDA_LINEINFO / KVFLEET_CUDA_PTXAS_V) and lives for the process; compilation happens
on first use, never at import.
"""
from __future__ import annotations

import ctypes
import functools
import os

import cupy as cp
import numpy as np

from kernels.cuda._source import _source


# Bit-exact float32: no fused multiply-add, IEEE division and square root, denormals kept.
EXACT_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                 "--ftz=false")
FAST_OPTIONS = ("--std=c++17",)


def _env_flags() -> tuple[bool, bool]:
    """(KVFLEET_CUDA_LINEINFO=1, KVFLEET_CUDA_PTXAS_V=1): read per call and part of the
    cache keys, so a flag set after a first compile still compiles with it."""
    return (os.environ.get("KVFLEET_CUDA_LINEINFO") == "1",
            os.environ.get("KVFLEET_CUDA_PTXAS_V") == "1")


@functools.lru_cache(maxsize=None)
def _module(name: str, defines: tuple[tuple[str, int], ...], exact: bool,
            device: int, lineinfo: bool = False) -> cp.RawModule:
    opts = (EXACT_OPTIONS if exact else FAST_OPTIONS) + tuple(
        f"-D{k}={v}" for k, v in defines)
    if lineinfo:  # source lines for ncu / profilers
        opts += ("--generate-line-info",)
    mod = cp.RawModule(code=_source(name), options=opts)
    mod.compile()
    return mod


@functools.lru_cache(maxsize=None)
def _module_arch(name: str, defines: tuple[tuple[str, int], ...], arch: str, device: int,
                 lineinfo: bool = False, ptxas_v: bool = False):
    """NVRTC straight to a cubin for `arch` (e.g. sm_90a, which wgmma needs: CuPy's own
    compile names the plain sm_90 target). Returns (module, compile log)."""
    from cupy_backends.cuda.libs import nvrtc

    opts = [*FAST_OPTIONS, f"--gpu-architecture={arch}", *(f"-D{k}={v}" for k, v in defines)]
    if lineinfo:
        opts.append("--generate-line-info")
    if ptxas_v:  # registers / spills in the log
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
    return _module_arch(name, key, arch, cp.cuda.Device().id, *_env_flags())[0].get_function(func)


def arch_log(name: str, arch: str, **defines: int) -> str:
    """The compiler's log of that module (ptxas warnings; -v output under
    KVFLEET_CUDA_PTXAS_V=1)."""
    key = tuple(sorted((k, int(v)) for k, v in defines.items()))
    return _module_arch(name, key, arch, cp.cuda.Device().id, *_env_flags())[1]


def set_dynamic_smem(fn, nbytes: int) -> None:
    """Let a cupy Function use more than 48 KB of dynamic shared memory."""
    cp.cuda.driver.funcSetAttribute(fn.ptr, 8, int(nbytes))  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_ubyte * 64)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTR = _LaunchAttr(_PROGRAMMATIC_STREAM_SERIALIZATION, 0)  # (one for every launch)
_PDL_ATTR.value[0] = 1  # programmaticStreamSerializationAllowed


@functools.lru_cache(maxsize=None)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def _bytes_type(n: int):
    return ctypes.c_ubyte * n


def _arg(a):
    """One kernel argument as the ctypes object whose address cuLaunchKernelEx takes, packed
    as CuPy packs it for a plain launch: a cupy array as its device pointer, a numpy scalar
    as its bytes, a Python int (bool included) as int64 and a float as float64."""
    if isinstance(a, cp.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    if isinstance(a, np.generic):
        return _bytes_type(a.nbytes).from_buffer_copy(a)
    raise TypeError(f"kernel argument of type {type(a).__name__}: pass a cupy array, a numpy "
                    f"scalar (np.int32, np.float32, np.uint64), an int or a float")


def function_ptr(fn) -> int:
    """The CUfunction of a cupy Function (.ptr) or RawKernel (.kernel.ptr)."""
    return fn.ptr if hasattr(fn, "ptr") else fn.kernel.ptr


def ptx_arch(fn) -> int:
    """The virtual architecture fn's code was generated for (cuFuncGetAttribute,
    CU_FUNC_ATTRIBUTE_PTX_VERSION, e.g. 90): what `__CUDA_ARCH__` was when it was compiled."""
    v = ctypes.c_int(0)
    err = _driver().cuFuncGetAttribute(ctypes.byref(v), 5, ctypes.c_void_p(function_ptr(fn)))
    if err:
        raise RuntimeError(f"cuFuncGetAttribute(PTX_VERSION) failed ({_error_name(err)})")
    return v.value


def driver_version() -> int:
    """The CUDA driver's version (cuDriverGetVersion: 12030 for 12.3)."""
    v = ctypes.c_int(0)
    err = _driver().cuDriverGetVersion(ctypes.byref(v))
    if err:
        raise RuntimeError(f"cuDriverGetVersion failed ({_error_name(err)})")
    return v.value


def stream_capturing() -> bool:
    """True while the current stream is being captured into a CUDA graph (cuStreamIsCapturing)."""
    status = ctypes.c_int(0)
    err = _driver().cuStreamIsCapturing(ctypes.c_void_p(cp.cuda.get_current_stream().ptr),
                                        ctypes.byref(status))
    return bool(err == 0 and status.value != 0)


def _error_name(err: int) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(int(err), ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {err}"


def launch_dependent(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
    """fn(grid, block, args, shared_mem=...) on the current stream as a programmatic dependent
    launch (cuLaunchKernelEx, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): it may
    start once every CTA of the kernel before it has run griddepcontrol.launch_dependents, so
    fn must run griddepcontrol.wait before it reads what that kernel writes (or writes what
    it reads), through coherent loads (not __ldg). Raises ValueError for an empty grid or
    block, RuntimeError with the driver's error name where the launch is refused."""
    grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    block = tuple(int(x) for x in block) + (1,) * (3 - len(block))
    if min(grid) < 1 or min(block) < 1:
        raise ValueError(f"launch_dependent: grid {grid} and block {block} must be >= 1 in every dim")
    cfg = _LaunchConfig(grid, block, int(shared_mem), cp.cuda.get_current_stream().ptr,
                        ctypes.addressof(_PDL_ATTR), 1)
    held = [_arg(a) for a in args]
    params = (ctypes.c_void_p * max(len(held), 1))(*[ctypes.addressof(h) for h in held])
    err = _driver().cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(function_ptr(fn)), params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx with programmatic stream serialization failed "
                           f"({_error_name(err)}) for grid {grid}, block {block}")


@functools.lru_cache(maxsize=None)
def _max_active_clusters(ptr: int, cluster: int, threads: int, smem: int) -> int:
    fn = _driver().cuOccupancyMaxActiveClusters
    fn.restype = ctypes.c_int
    cfg = _LaunchConfig((cluster, 1, 1), (threads, 1, 1), smem, None, None, 0)
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
    return _module(name, key, exact, cp.cuda.Device().id, _env_flags()[0]).get_function(func)


def cuda_available() -> bool:
    """True when cupy can see at least one CUDA device."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False
