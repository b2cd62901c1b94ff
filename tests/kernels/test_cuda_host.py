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


# (compute capability, shared memory per SM, opt-in per block): the H200's, an A100's, sm_89's
H200, A100, SM89 = ("90", 233472, 232448), ("80", 167936, 166912), ("89", 102400, 101376)


def _decode_args(A, tier, H, n_blocks=4, bs=16):
    """Planes, tables, a plan and queries for one slot of 40 keys (host arrays as cupy)."""
    import cupy as cp

    from kernels.cpu.attention import LayerPlanes
    from kernels.tiers import get_tier
    t = get_tier(tier)
    dt = np.dtype(t.code_dtype())
    planes = LayerPlanes(cp.zeros((n_blocks, bs, t.code_width(512)), dt),
                         cp.zeros((n_blocks, bs), cp.float32),
                         cp.zeros((n_blocks, bs, t.code_width(64)), dt),
                         cp.zeros((n_blocks, bs), cp.float32))
    tables = cp.asarray(np.arange(n_blocks, dtype=np.int32)[None])
    plan = A.decode_plan([0], [39], n_sm=8)
    return planes, tables, plan, cp.zeros((1, H, 512), cp.float32), cp.zeros((1, H, 64), cp.float32)


@pytest.mark.parametrize("device", [H200, A100, SM89], ids=["h200", "a100", "sm89"])
@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
@pytest.mark.parametrize("H", [8, 16, 24, 64, 128])
def test_the_chosen_kernel_fits_the_devices_shared_memory(fake_cupy, monkeypatch, caplog,
                                                          device, tier, H):
    """(the choice ignored shared memory: on an A100 (163 KB per block) or an sm_89 card
    (99 KB) the 64-head tiles, and at 99 KB most tiles, did not fit, and the launch failed
    instead of a smaller tile running, counted)"""
    cc, per_sm, optin = device
    fake_cupy(cc=cc, per_sm=per_sm, optin=optin)
    from kernels.cuda import attention as A
    from kernels.tiers import get_tier

    launched = []
    monkeypatch.setattr(A, "_launch", lambda tier, shape, groups, *a: launched.append(
        (shape, groups)))
    monkeypatch.setattr(A, "_launch_wg", lambda shape, groups, *a: launched.append(
        (shape, groups)))
    path = A.kernel_path(tier, H, 512, 64)
    if path == "cpu":  # (not even 16 heads on 32-token tiles fit: the callers' CPU path)
        assert not A.has_kernel(tier, 512, 64)
        assert "shared memory" in A.no_kernel_reason(tier, 512, 64)
        with pytest.raises(ValueError, match="shared memory"):
            A.paged_mla_decode(tier, *_decode_args(A, tier, H), 1.0)
        return
    with caplog.at_level("WARNING", logger=A.__name__):
        for _ in range(3):
            A.paged_mla_decode(tier, *_decode_args(A, tier, H), 1.0)
    (shape, groups), = set(launched)
    assert path == ("wgmma" if isinstance(shape, A.WgShape) else "mma")
    minb = getattr(shape, "minb", 1)  # (attn_wg: one CTA per SM)
    assert shape.shared_bytes() <= (optin if minb == 1 else min(optin, per_sm // 2 - 1024))
    heads = shape.hn if path == "wgmma" else 16 * shape.mt
    assert groups * heads >= H and (groups - 1) * heads < H  # (no head group left empty)
    assert A.ctas_per_sm(tier, H, 512, 64) == minb
    if device == H200:  # the tuned shapes, none counted
        assert not A.fallbacks and path == ("mma" if tier == "f32" else "wgmma")
    else:
        own = A.Shape(A._TIER_ID[get_tier(tier).kind], min(4, -(-H // 16)),
                      32 if tier == "f32" else 64, 512, 64)
        smaller = own.shared_bytes() > optin
        assert A.fallbacks == ({"attn_split_smem": 3} if smaller else {})
        assert sum("attn_split_smem" in r.getMessage() for r in caplog.records) == smaller
    assert A.drain_fallbacks() == dict(A.fallbacks) and A.drain_fallbacks() == {}


def test_a100_runs_64_heads_on_32_token_tiles(fake_cupy):
    """The A100's 163 KB per block: kv8 / tq4 at 64 heads keep all heads in one CTA on
    32-token tiles (one pass over the cache); f32 takes two groups of 32 heads."""
    fake_cupy(*A100)
    from kernels.cuda import attention as A
    from kernels.tiers import get_tier

    for tier, mt, bt, groups in (("kv8", 4, 32, 1), ("tq4", 4, 32, 1), ("f32", 2, 32, 2)):
        shape, g, why = A._shape(get_tier(tier), 64, 512, 64)
        assert (shape.mt, shape.bt, g) == (mt, bt, groups), tier
        assert "166912" in why and "64 heads per CTA" in why


def test_hopper_with_less_shared_memory_leaves_attn_wg_counted(fake_cupy, monkeypatch):
    """An sm_90 device whose opt-in limit holds no attn_wg specialisation at 64 heads runs
    attention.cu instead, counted as attn_wg_smem (and here attn_split_smem: its 64-token
    tiles do not fit either)."""
    fake_cupy(cc="90", per_sm=191488, optin=190464)
    from kernels.cuda import attention as A
    from kernels.tiers import get_tier

    assert A._wg_shape(get_tier("kv8"), 64, 512, 64, 16) is None
    assert A.kernel_path("kv8", 64, 512, 64) == "mma"
    assert A.kernel_path("kv8", 16, 512, 64) == "wgmma"  # (16 heads still fit)
    monkeypatch.setattr(A, "_launch", lambda *a: None)
    A.paged_mla_decode("kv8", *_decode_args(A, "kv8", 64), 1.0)
    assert A.fallbacks == {"attn_wg_smem": 1, "attn_split_smem": 1}


def test_device_pool_attends_on_the_cpu_where_no_tile_fits(fake_cupy):
    """f32 on an sm_89 card (99 KB per block: its smallest tile needs 130 KB): DevicePool
    takes the CPU attention, counted under ("attend", "f32") with the shared-memory reason,
    and its contexts are the numpy pool's."""
    fake_cupy(*SM89)
    from kernels.cpu import codecs as cpu_codecs
    from kernels.cuda import attention as A
    from kvstore.device_pool import DevicePool
    from kvstore.pool import KVPool

    assert A.kernel_path("f32", 16, 512, 64) == "cpu"
    rng = np.random.default_rng(3)
    dev, host = (P(1, 512, 64, "f32", n_blocks=4, block_size=16, max_slots=1)
                 for P in (DevicePool, KVPool))
    L = rng.standard_normal((40, 512)).astype(np.float32)
    R = rng.standard_normal((40, 64)).astype(np.float32)
    coded = (*cpu_codecs.encode_rows(dev.tier, L), *cpu_codecs.encode_rows(dev.tier, R))
    for pool in (dev, host):
        s = pool.alloc_slot()
        pool.write_coded(0, [s] * 40, np.arange(40), *coded)
    q_lat = rng.standard_normal((2, 16, 512)).astype(np.float32)
    q_rope = rng.standard_normal((2, 16, 64)).astype(np.float32)
    got = dev.attend(0, [s, s], [39, 20], q_lat, q_rope, 0.1)
    want = host.attend(0, [s, s], [39, 20], q_lat, q_rope, 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert dict(dev.counters.fallbacks) == {("attend", "f32"): 1}


def test_the_kernel_choice_is_made_once_per_shape_not_per_layer_call(fake_cupy, monkeypatch):
    """paged_mla_decode runs per layer and step: its kernel choice (the shared-memory checks
    of every candidate, the fallback messages) is made once per parameters, device limits
    and KVFLEET_CUDA_* knobs, not per call (it doubled the host time of a call), while the
    fallbacks it implies are still counted per call. A changed knob or device limit chooses
    afresh."""
    fake_cupy(*A100)
    from kernels.cuda import attention as A

    made = []
    real_shape, real_wg = A._shape, A._wg_shapes
    monkeypatch.setattr(A, "_shape", lambda *a, **k: made.append("mma") or real_shape(*a, **k))
    monkeypatch.setattr(A, "_wg_shapes", lambda *a, **k: made.append("wg") or real_wg(*a, **k))
    launched = []
    monkeypatch.setattr(A, "_launch", lambda tier, shape, groups, *a: launched.append(shape))
    monkeypatch.setattr(A, "_launch_wg", lambda shape, groups, *a: launched.append(shape))
    args = _decode_args(A, "kv8", 64)
    for _ in range(5):
        A.paged_mla_decode("kv8", *args, 1.0)
    assert made.count("mma") == 1 and len(set(launched)) == 1 and launched[0].bt == 32
    assert A.fallbacks == {"attn_split_smem": 5}  # (counted per call all the same)
    assert A.kernel_path("kv8", 64, 512, 64) == "mma" and made.count("mma") == 1
    monkeypatch.setattr(A, "_device_info", lambda dev: (*H200, 132))  # another device's limits
    A.paged_mla_decode("kv8", *args, 1.0)
    assert isinstance(launched[-1], A.WgShape)
    monkeypatch.setenv("KVFLEET_CUDA_WGMMA", "0")  # a knob: chosen afresh
    A.paged_mla_decode("kv8", *args, 1.0)
    assert isinstance(launched[-1], A.Shape) and launched[-1].bt == 64


@pytest.mark.parametrize("cc", ["90", "89"])
def test_plan_for_two_head_groups_stays_one_wave(fake_cupy, cc):
    """(at 128 heads each work item runs as two CTAs of 64 heads (attn_wg; attention.cu
    splits heads too where its tiles do not fit), but the plan sized its items for one CTA
    each: 16 x 32k made 128 items, 256 CTAs, two waves on 132 SMs)"""
    fake_cupy(cc=cc)
    from kernels.cuda import attention as A

    rows, pos = np.arange(16), np.full(16, 32767)
    groups = A.head_groups("kv8", 128, 512, 64)
    per_sm = A.ctas_per_sm("kv8", 128, 512, 64)
    assert groups >= 2 and A.head_groups("kv8", 64, 512, 64) == 1
    plan = A.decode_plan(rows, pos, n_sm=132, ctas_per_sm=per_sm, head_groups=groups)
    assert plan.n_work * groups <= 132 * per_sm < A.decode_plan(rows, pos, n_sm=132,
                                                                ctas_per_sm=per_sm).n_work * groups
    work = plan.work.get()
    assert (work[:, 3] - work[:, 2]).sum() == 16 * 32768  # every key in exactly one item
    with pytest.raises(ValueError, match="head_groups 0"):
        A.decode_plan(rows, pos, n_sm=132, head_groups=0)
