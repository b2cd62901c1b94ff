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


def test_compile_caches_key_on_the_debug_flags(fake_cupy, monkeypatch):
    """(KVFLEET_CUDA_LINEINFO / KVFLEET_CUDA_PTXAS_V were read inside the cached compile: set
    after a first compile, e.g. tests/gpu/diag_wgmma.py --log, they were ignored)"""
    import sys
    import types

    cp = fake_cupy()
    from kernels.cuda import _build

    compiled = []

    class RawModule:  # cupy.RawModule: the options of each compile
        def __init__(self, code, options):
            compiled.append(options)

        def compile(self):
            pass

        def get_function(self, name):
            return name

    class Module:  # cupy.cuda.function.Module
        def load(self, cubin):
            pass

        def get_function(self, name):
            return name

    def compile_program(prog, opts):
        compiled.append(tuple(opts))

    nvrtc = types.SimpleNamespace(createProgram=lambda *a: None, compileProgram=compile_program,
                                  getProgramLog=lambda prog: "-v" if "--ptxas-options=-v" in
                                  compiled[-1] else "", getCUBIN=lambda prog: b"",
                                  destroyProgram=lambda prog: None, NVRTCError=RuntimeError)
    monkeypatch.setattr(cp, "RawModule", RawModule, raising=False)
    monkeypatch.setattr(cp.cuda, "function", types.SimpleNamespace(Module=Module), raising=False)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", nvrtc)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs",
                        types.SimpleNamespace(nvrtc=nvrtc))
    monkeypatch.delenv("KVFLEET_CUDA_LINEINFO", raising=False)
    monkeypatch.delenv("KVFLEET_CUDA_PTXAS_V", raising=False)
    _build.kernel("codecs.cu", "fp8_encode", exact=True)
    assert _build.arch_log("codecs.cu", "sm_90a", X=1) == ""
    monkeypatch.setenv("KVFLEET_CUDA_LINEINFO", "1")
    monkeypatch.setenv("KVFLEET_CUDA_PTXAS_V", "1")
    _build.kernel("codecs.cu", "fp8_encode", exact=True)
    assert _build.arch_log("codecs.cu", "sm_90a", X=1) == "-v"
    assert ["--generate-line-info" in opts for opts in compiled] == [False, False, True, True]
