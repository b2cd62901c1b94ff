"""CUDA paged MLA decode attention vs a float64 numpy reference on decoded rows, for every
tier with a kernel: NaN / 0x7E / huge-radius garbage in every unused pool position,
shuffled block tables, ragged lengths, several queries per slot, a padding query, inert
rows, 4 / 16 / 64 / 128 heads, one split or many."""
from dataclasses import replace

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kernels.cpu import codecs as ref  # noqa: E402
from kernels.cpu.attention import LayerPlanes  # noqa: E402
from kernels.cuda import attention as gpu  # noqa: E402
from kernels.tiers import get_tier  # noqa: E402

DL, DR, BS = 512, 64, 16
SCALE = 1.0 / np.sqrt(192.0)
LENGTHS = [1, 17, 300, 1100, 2600]


def make_pool(tier_name, rng, lengths=LENGTHS, bs=BS):
    tier = get_tier(tier_name)
    per = [-(-n // bs) for n in lengths]
    n_blocks = sum(per) + 7
    nb = max(per) + 2
    L = rng.standard_normal((n_blocks * bs, DL)).astype(np.float32)
    R = rng.standard_normal((n_blocks * bs, DR)).astype(np.float32)
    L *= np.exp(rng.uniform(-1, 0.5, (n_blocks * bs, 1))).astype(np.float32)  # per-token scales differ
    L[rng.choice(len(L), 9, replace=False)] = 0.0  # inert rows
    R[rng.choice(len(R), 9, replace=False)] = 0.0
    lc, ls = ref.encode_rows(tier, L)
    rc, rs = ref.encode_rows(tier, R)
    lc, rc = lc.reshape(n_blocks, bs, -1), rc.reshape(n_blocks, bs, -1)
    ls, rs = ls.reshape(n_blocks, bs), rs.reshape(n_blocks, bs)
    perm = rng.permutation(n_blocks)
    tables = np.full((len(lengths), nb), -1, np.int32)
    used = np.zeros((n_blocks, bs), bool)
    k = 0
    for s, (n, p) in enumerate(zip(lengths, per)):
        tables[s, :p] = perm[k:k + p]
        for t in range(n):
            used[tables[s, t // bs], t % bs] = True
        k += p
    garbage_code = np.nan if tier.kind == "f32" else 0x7E  # 0x7E: a large value in every tier
    garbage_scale = np.float32(np.nan if tier.kind != "tq" else 1e30)
    for arr in (lc, rc):
        arr[~used] = garbage_code
    ls[~used] = garbage_scale
    rs[~used] = garbage_scale
    return tier, LayerPlanes(lc, ls, rc, rs), tables


def to_device(planes):
    """The pool's planes as cupy arrays."""
    return LayerPlanes(*(cp.asarray(a) for a in (planes.l_codes, planes.l_scale,
                                                 planes.r_codes, planes.r_scale)))


def hostile_queries(rng, n, H, zero, huge, inf, nan):
    """Standard normal f32 queries q_lat [n, H, DL], q_rope [n, H, DR] with the head at
    (query, head) `zero` all zeros, the one at `huge` scaled by 1e4, an Inf latent element
    in the head at `inf` and a NaN rope element in the head at `nan`."""
    q_lat = rng.standard_normal((n, H, DL)).astype(np.float32)
    q_rope = rng.standard_normal((n, H, DR)).astype(np.float32)
    q_lat[zero], q_rope[zero] = 0.0, 0.0
    q_lat[huge] *= 1e4
    q_lat[inf + (7,)] = np.inf
    q_rope[nan + (5,)] = np.nan
    return q_lat, q_rope


def reference(tier, planes, tables, rows, positions, q_lat, q_rope):
    bs = planes.l_scale.shape[1]
    out = np.zeros(q_lat.shape, np.float64)
    for i, (r, p) in enumerate(zip(rows, positions)):
        if p < 0:
            continue
        t = np.arange(p + 1)
        blk, off = tables[r, t // bs], t % bs
        L = ref.decode_rows(tier, planes.l_codes[blk, off], planes.l_scale[blk, off], DL)
        R = ref.decode_rows(tier, planes.r_codes[blk, off], planes.r_scale[blk, off], DR)
        L, R = L.astype(np.float64), R.astype(np.float64)
        s = (q_lat[i].astype(np.float64) @ L.T + q_rope[i].astype(np.float64) @ R.T) * SCALE
        s -= s.max(axis=1, keepdims=True)
        w = np.exp(s)
        out[i] = (w / w.sum(axis=1, keepdims=True)) @ L
    return out


def contexts(tier_name, H, n_sm, seed, bs=BS):
    """(GPU contexts, float64 reference, positions, plan) for nine queries over a hostile
    pool of block size bs (also used by diag_wgmma.py)."""
    rng = np.random.default_rng(seed)
    tier, planes, tables = make_pool(tier_name, rng, bs=bs)
    rows = np.array([0, 1, 2, 3, 3, 3, 4, 2, 4])
    positions = np.array([0, 16, 299, 1099, 517, 64, 2599, -1, 1999])
    N = len(rows)
    q_lat = rng.standard_normal((N, H, DL)).astype(np.float32)
    q_rope = rng.standard_normal((N, H, DR)).astype(np.float32)
    dev = to_device(planes)
    plan = gpu.decode_plan(rows, positions, n_sm=n_sm)
    out = gpu.paged_mla_decode(tier, dev, cp.asarray(tables), plan, cp.asarray(q_lat),
                               cp.asarray(q_rope), SCALE).get()
    return out, reference(tier, planes, tables, rows, positions, q_lat, q_rope), positions, plan


def run(tier_name, H, n_sm, seed, bs=BS):
    out, want, positions, plan = contexts(tier_name, H, n_sm, seed, bs)
    assert np.isfinite(out).all(), f"{tier_name} H={H}: non-finite output"
    for i in range(len(positions)):
        if positions[i] < 0:
            assert not out[i].any(), "padding query must give zeros"
            continue
        err = np.linalg.norm(out[i] - want[i]) / np.linalg.norm(want[i])
        assert err < 2e-3, (f"{tier_name} H={H} n_sm={n_sm} bs={bs} query {i} "
                            f"(pos {positions[i]}): rel err {err:.2e}")
    return plan


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
@pytest.mark.parametrize("H", [64, 16, 4])
def test_attention_matches_float64(tier, H):
    plan = run(tier, H, n_sm=132, seed=H)
    assert plan.n_work > len(LENGTHS)  # the long rows were split


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_attention_one_split_many_tiles_and_two_head_groups(tier):
    plan = run(tier, 128, n_sm=1, seed=5)
    assert plan.n_work == 8  # one work item per real query


def test_attention_rejects_bad_input():
    rng = np.random.default_rng(0)
    tier, planes, tables = make_pool("kv8", rng, lengths=[5])
    dev = to_device(planes)
    plan = gpu.decode_plan([0], [4])
    q = cp.zeros((1, 4, DL), cp.float64)
    with pytest.raises(TypeError, match="q_lat"):
        gpu.paged_mla_decode(tier, dev, cp.asarray(tables), plan, q, cp.zeros((1, 4, DR), cp.float32), 1.0)
    with pytest.raises(ValueError, match="no CUDA attention kernel"):
        gpu.paged_mla_decode("polar3", dev, cp.asarray(tables), plan, q, q, 1.0)
    assert not gpu.has_kernel("kv8", 48, 64) and gpu.has_kernel("tq4", 512, 64)


def _hopper() -> bool:
    return cp.cuda.Device().compute_capability == "90"


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
@pytest.mark.parametrize("H", [24, 64])
def test_wgmma_and_mma_kernels_agree(tier, H, monkeypatch):
    """On Hopper kv8 / tq4 take attention_sm90.cu; attention.cu (KVFLEET_CUDA_WGMMA=0) gives
    the same contexts within the tolerance of both (H=24: the 32-head specialisation)."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    assert gpu.kernel_path(tier, H, DL, DR) == "wgmma"
    rng = np.random.default_rng(11)
    t, planes, tables = make_pool(tier, rng)
    rows, positions = np.array([4, 3, 2, 0]), np.array([2599, 1099, 299, 0])
    q_lat = cp.asarray(rng.standard_normal((4, H, DL)).astype(np.float32))
    q_rope = cp.asarray(rng.standard_normal((4, H, DR)).astype(np.float32))
    dev = to_device(planes)
    tab = cp.asarray(tables)
    plan = gpu.decode_plan(rows, positions)
    new = gpu.paged_mla_decode(t, dev, tab, plan, q_lat, q_rope, SCALE).get()
    monkeypatch.setenv(gpu.WG_ENV, "0")
    assert gpu.kernel_path(tier, H, DL, DR) == "mma"
    old = gpu.paged_mla_decode(t, dev, tab, plan, q_lat, q_rope, SCALE).get()
    err = np.linalg.norm((new - old).reshape(4, -1), axis=1) / np.linalg.norm(old.reshape(4, -1), axis=1)
    assert err.max() < 3e-3, err


@pytest.mark.parametrize("H", [64, 24])
def test_kv8_wgmma_switches_give_the_same_bits(H, monkeypatch):
    """kv8's attn_wg makes its f16 queries in each CTA (QF) and its P^T before the rescale
    vote (SPEC); with either off (attn_qprep's queries / P^T after the vote) the contexts
    are the same bits, hostile queries included: a zero head, a huge one, an Inf and a NaN
    element (H=24: padded heads in the 32-head build)."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    rng = np.random.default_rng(13)
    t, planes, tables = make_pool("kv8", rng)
    rows, positions = np.array([4, 3, 2, 0, 1]), np.array([2599, 1099, 299, 0, 16])
    q_lat, q_rope = hostile_queries(rng, 5, H, (0, 1), (1, 2), (2, 3), (3, 4))
    dev = to_device(planes)
    tab, plan = cp.asarray(tables), gpu.decode_plan(rows, positions)
    ql, qr = cp.asarray(q_lat), cp.asarray(q_rope)
    assert gpu.kernel_path(t, H, DL, DR) == "wgmma"
    base = gpu.paged_mla_decode(t, dev, tab, plan, ql, qr, SCALE).get()
    assert np.isfinite(base[0]).all() and np.isnan(base[2, 3]).all()
    for tuning in ("QF=0", "SPEC=0"):
        monkeypatch.setenv("KVFLEET_CUDA_WG_TUNING", tuning)
        other = gpu.paged_mla_decode(t, dev, tab, plan, ql, qr, SCALE).get()
        np.testing.assert_array_equal(other, base, err_msg=tuning)
    monkeypatch.delenv("KVFLEET_CUDA_WG_TUNING")
    buf = cp.empty(ql.size + 1, cp.float32)  # q_lat 4 bytes past an aligned start: attn_qprep's
    odd = buf[1:].reshape(ql.shape)
    odd[...] = ql
    np.testing.assert_array_equal(gpu.paged_mla_decode(t, dev, tab, plan, odd, qr, SCALE).get(),
                                  base, err_msg="q_lat not 16-byte aligned")


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
@pytest.mark.parametrize("H", [64, 24, 16])
def test_wgmma_clusters_give_the_same_bits(tier, H, monkeypatch):
    """Where every query has a multiple of 8 work items, attn_wg can run in clusters of 8 CTAs
    of one query that share making Q^T (each makes 1 / 8 of the heads and stores them into
    the others): the contexts are the bits of clusters of 4, 2 and none (KVFLEET_CUDA_WG_TUNING
    CL caps; by default clusters serve 64 heads only), and within 2e-3 of float64 over the
    hostile pool; hostile queries too (a zero head, a huge one, an Inf and a NaN element)."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    rng = np.random.default_rng(17 + H)
    t, planes, tables = make_pool(tier, rng)
    rows, positions = np.array([4, 3, 4, 3, 4]), np.array([1023, 1023, 2047, 511, 511])
    q_lat, q_rope = hostile_queries(rng, 5, H, (0, 1), (1, 2), (3, 3), (4, 4))
    dev = to_device(planes)
    tab, ql, qr = cp.asarray(tables), cp.asarray(q_lat), cp.asarray(q_rope)
    # three queries of 2048 keys in 256-token chunks: 8 work items each
    r8, p8 = np.array([4, 4, 4]), np.array([2047, 2047, 2047])
    plan = gpu.decode_plan(r8, p8, n_sm=24)
    assert plan.cluster == 8 and plan.n_work == 24
    shape, groups = gpu._wg_shape(t, H, DL, DR, BS)  # (by default only 64 heads use clusters)
    assert gpu._wg_cluster(shape, groups, plan, cp.cuda.Device().id).cl == (8 if H == 64 else 1)
    monkeypatch.setenv("KVFLEET_CUDA_WG_TUNING", "CL=8")
    shape, groups = gpu._wg_shape(t, H, DL, DR, BS)
    assert gpu._wg_cluster(shape, groups, plan, cp.cuda.Device().id).cl == 8
    base = gpu.paged_mla_decode(t, dev, tab, plan, ql[:3], qr[:3], SCALE).get()
    want = reference(t, planes, tables, r8, p8, q_lat[:3], q_rope[:3])
    for i in range(3):
        ok = [h for h in range(H) if abs(q_lat[i, h]).max() < 1e3]  # (the huge head: its own check)
        err = np.linalg.norm(base[i, ok] - want[i, ok]) / np.linalg.norm(want[i, ok])
        assert err < 2e-3, f"{tier} H={H} query {i}: rel err {err:.2e}"
    assert np.isfinite(base).all()
    for cap in ("CL=4", "CL=2", "CL=1"):
        monkeypatch.setenv("KVFLEET_CUDA_WG_TUNING", cap)
        shape, groups = gpu._wg_shape(t, H, DL, DR, BS)
        assert gpu._wg_cluster(shape, groups, plan, cp.cuda.Device().id).cl == int(cap[3:])
        other = gpu.paged_mla_decode(t, dev, tab, plan, ql[:3], qr[:3], SCALE).get()
        np.testing.assert_array_equal(other, base, err_msg=cap)
    # all five queries (Inf, NaN) in 256-token chunks: 4, 4, 8, 2, 2 items, clusters of 2
    plan = gpu.decode_plan(rows, positions, n_sm=40)
    assert plan.cluster == 2
    monkeypatch.setenv("KVFLEET_CUDA_WG_TUNING", "CL=8")
    shape, groups = gpu._wg_shape(t, H, DL, DR, BS)
    assert gpu._wg_cluster(shape, groups, plan, cp.cuda.Device().id).cl == 2
    base = gpu.paged_mla_decode(t, dev, tab, plan, ql, qr, SCALE).get()
    assert np.isnan(base[3, 3]).all() and np.isnan(base[4, 4]).all()
    monkeypatch.setenv("KVFLEET_CUDA_WG_TUNING", "CL=1")
    np.testing.assert_array_equal(gpu.paged_mla_decode(t, dev, tab, plan, ql, qr, SCALE).get(),
                                  base, err_msg="clusters of 2")


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
@pytest.mark.parametrize("bs", [8, 32, 64])
def test_attention_other_block_sizes(tier, bs, monkeypatch):
    """Pool blocks of 8 rows (eight TMA boxes a half-tile), 32 and 64 rows (two boxes, one):
    the float64 reference at 64 and 16 heads over the hostile pool, and the cp.async path
    bit-identical to the TMA one."""
    for H in (64, 16):
        run(tier, H, n_sm=132, seed=bs + H, bs=bs)
    if not _hopper():
        return
    assert gpu._wg_shape(get_tier(tier), 64, DL, DR, bs)[0].tma == 1
    via_tma = contexts(tier, 64, 132, 1, bs)[0]
    monkeypatch.setenv(gpu.TMA_ENV, "0")
    assert np.array_equal(contexts(tier, 64, 132, 1, bs)[0], via_tma)


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_tma_and_cp_async_copies_agree(tier, monkeypatch):
    """attn_wg's two copy paths (TMA boxes of whole blocks into swizzled slots, cp.async per
    lane) give bit-identical contexts: only where the bytes sit differs. A plane that is not
    16-byte aligned takes the cp.async path (and still agrees)."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    rng = np.random.default_rng(5)
    t, planes, tables = make_pool(tier, rng)
    rows, positions = np.array([1, 4, 4, 3, 0]), np.array([16, 2599, 1999, 1099, 0])
    q_lat = cp.asarray(rng.standard_normal((5, 32, DL)).astype(np.float32))
    q_rope = cp.asarray(rng.standard_normal((5, 32, DR)).astype(np.float32))
    dev = to_device(planes)
    tab = cp.asarray(tables)
    plan = gpu.decode_plan(rows, positions)
    assert gpu._wg_shape(t, 32, DL, DR, BS)[0].tma == 1
    via_tma = gpu.paged_mla_decode(t, dev, tab, plan, q_lat, q_rope, SCALE).get()
    assert np.isfinite(via_tma).all()
    buf = cp.empty(dev.l_scale.size + 1, cp.float32)
    shifted = buf[1:].reshape(dev.l_scale.shape)  # 4 bytes past an aligned start
    shifted[...] = dev.l_scale
    assert shifted.data.ptr % 16 == 4
    odd = gpu.paged_mla_decode(t, LayerPlanes(dev.l_codes, shifted, dev.r_codes, dev.r_scale),
                               tab, plan, q_lat, q_rope, SCALE).get()
    monkeypatch.setenv(gpu.TMA_ENV, "0")
    assert gpu._wg_shape(t, 32, DL, DR, BS)[0].tma == 0
    via_cp = gpu.paged_mla_decode(t, dev, tab, plan, q_lat, q_rope, SCALE).get()
    assert np.array_equal(via_tma, via_cp)
    assert np.array_equal(odd, via_cp)


def test_wgmma_shared_memory_matches_python():
    """WgShape.shared_bytes() (which sizes the launch) equals the kernel's SM_TOTAL."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    from kernels.cuda._build import arch_kernel
    for tier in ("kv8", "tq4"):
        for H, tma in ((16, 1), (32, 1), (64, 1), (16, 0), (64, 0)):
            shape, groups = gpu._wg_shape(get_tier(tier), H, DL, DR, BS)
            assert groups == 1 and shape.nslot >= 3
            assert shape.tma == 1
            shape = replace(shape, tma=1) if tma else gpu._without_tma(shape)
            # (tq4: also the pair table's 128-byte rows, LUT2=0)
            for s in (shape, replace(shape, tuning=(("LUT2", 0),))) if tier == "tq4" else (shape,):
                fn = arch_kernel("attention_sm90.cu", "attn_wg_smem", "sm_90a", **s.defines)
                out = cp.zeros(1, cp.int32)
                fn((1,), (1,), (out,))
                assert int(out[0]) == s.shared_bytes() <= cp.cuda.Device().attributes[
                    "MaxSharedMemoryPerBlockOptin"]


def test_wgmma_kernel_is_not_serialized():
    """ptxas serialises every wgmma of the kernel (info C7514) when it cannot prove that no
    other instruction reads an accumulator in flight; it still compiles and stays correct,
    but ran 30% slower at 64 heads before this was caught."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs an sm_90 GPU")
    from kernels.cuda._build import arch_log
    for tier in ("kv8", "tq4"):
        for H in (16, 32, 64):
            shape, _ = gpu._wg_shape(get_tier(tier), H, DL, DR, BS)
            log = arch_log("attention_sm90.cu", "sm_90a", **shape.defines)
            assert "C7514" not in log, (tier, H, log)


def test_kernel_path_choices():
    assert gpu.kernel_path("f32", 64, DL, DR) == "mma"
    assert gpu.kernel_path("polar3", 64, DL, DR) == "cpu"
    assert gpu.kernel_path("kv8", 64, DL, DR, block_size=48) == "mma"  # 48 does not divide 64
    assert gpu.kernel_path("kv8", 64, 384, DR) == "mma"  # kv_lora % 256
    # attn_wg's two warpgroups cover 2 x 256 context dims: other widths take attention.cu
    # (256 read past its latent rows, 1024 left dims 512.. unwritten)
    assert gpu.kernel_path("kv8", 16, 256, DR) == "mma"
    assert gpu.kernel_path("tq4", 16, 1024, DR) == "mma"


# (compute capability, shared memory per SM, opt-in per block, SMs) of GPUs with less shared
# memory than the H200: this one runs the tiles they would choose
SMALL_SMEM = {"a100": ("80", 167936, 166912, 108), "sm89": ("89", 102400, 101376, 128)}


@pytest.mark.parametrize("device", sorted(SMALL_SMEM))
@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
@pytest.mark.parametrize("H", [128, 64, 24, 16])
def test_tiles_for_less_shared_memory_match_float64(device, tier, H, monkeypatch):
    """Where a head count's own attention.cu tiles do not fit a GPU's shared memory, the
    smaller ones chosen instead (32-token tiles, fewer heads per CTA) are as accurate, and
    counted; where none fits there is no kernel (the CPU path)."""
    info = SMALL_SMEM[device]
    monkeypatch.setattr(gpu, "_device_info", lambda dev: info)
    monkeypatch.setattr(gpu, "fallbacks", gpu.Counter())
    if gpu.kernel_path(tier, H, DL, DR) == "cpu":
        assert (device, tier) == ("sm89", "f32") and not gpu.has_kernel(tier, DL, DR)
        return
    shape, groups, smaller = gpu._shape(get_tier(tier), H, DL, DR)
    assert shape.shared_bytes() <= info[2]
    run(tier, H, n_sm=info[3], seed=H + 1)
    assert gpu.fallbacks == ({"attn_split_smem": 1} if smaller else {})


_PROBE = r"""
// primary: lets its dependents start, then waits (at most `spin` cycles) for the dependent's
// `started` flag before it writes `done`. dependent: reads `done`, raises `started`, waits
// for the primary's end (griddepcontrol.wait), reads `done` again.
extern "C" __global__ void primary(int* done, int* started, int* saw, long long spin) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long t0 = clock64();
    while (atomicAdd(started, 0) == 0 && clock64() - t0 < spin) {}
    saw[0] = atomicAdd(started, 0);
    __threadfence();
    atomicExch(done, 1);
}
extern "C" __global__ void dependent(int* done, int* started, int* seen) {
    seen[0] = atomicAdd(done, 0);  // 0: started while primary still ran
    __threadfence();
    atomicExch(started, 1);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    seen[1] = atomicAdd(done, 0);  // 1: the wait waited for primary's end
}
"""


def _probe_kernels():
    mod = cp.RawModule(code=_PROBE, options=("--std=c++17",))
    return mod.get_function("primary"), mod.get_function("dependent")


def _pdl_testable() -> None:
    import os
    if not _hopper():
        pytest.skip("programmatic dependent launch needs an sm_90 GPU")
    if gpu._driver_version() < gpu.PDL_DRIVER:
        pytest.skip(f"driver {gpu._driver_version()} < {gpu.PDL_DRIVER}: no PDL in graphs")
    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        pytest.skip("CUDA_LAUNCH_BLOCKING serialises every launch")


def test_launch_dependent_overlaps_and_waits():
    """_build.launch_dependent really is a programmatic dependent launch, eagerly (on the
    legacy and on a non-blocking stream) and captured in a CUDA graph: the dependent of a
    one-thread kernel that triggers at its start runs while that kernel still waits for it
    (a handshake through two flags, bounded by ~10 ms of spinning) and its griddepcontrol.wait
    still waits for that kernel's end: seen [0, 1], the primary saw the dependent start. Plain
    launches of the same pair see [1, 1] after the primary's bounded spin."""
    _pdl_testable()
    from kernels.cuda._build import launch_dependent
    primary, dependent = _probe_kernels()
    spin = np.int64(20_000_000)  # cycles (~10 ms): only plain launches spin this long
    done, started, saw = cp.zeros(1, cp.int32), cp.zeros(1, cp.int32), cp.zeros(1, cp.int32)
    seen = cp.full(2, -1, cp.int32)
    primary((1,), (1,), (done, started, saw, spin))
    dependent((1,), (1,), (done, started, seen))
    assert seen.get().tolist() == [1, 1] and int(saw.get()[0]) == 0  # plain: serialised
    for mode in ("legacy stream", "non-blocking stream", "graph"):
        for a in (done, started, saw):
            a.fill(0)
        seen.fill(-1)
        cp.cuda.Device().synchronize()
        stream = cp.cuda.Stream.null if mode == "legacy stream" else cp.cuda.Stream(non_blocking=True)
        with stream:
            if mode == "graph":
                stream.begin_capture()
            primary((1,), (1,), (done, started, saw, spin))
            launch_dependent(dependent, (1,), (1,), (done, started, seen))
            if mode == "graph":
                stream.end_capture().launch(stream)
            stream.synchronize()
        assert seen.get().tolist() == [0, 1] and int(saw.get()[0]) == 1, mode


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
@pytest.mark.parametrize("H", [64, 16])
def test_programmatic_dependent_launch_gives_the_same_bits(tier, H, monkeypatch):
    """attn_combine (and tq4's attn_wg after attn_qprep) launched as programmatic dependents
    (KVFLEET_CUDA_PDL, on by default on sm_90) give the bits of plain launches: eight calls
    with different queries back to back on one stream, then the same calls captured in a
    CUDA graph and replayed, with no fallback counted. A missing griddepcontrol.wait shows
    here as a combine that read partial contexts before they were written."""
    _pdl_testable()
    rng = np.random.default_rng(5 + H)
    t, planes, tables = make_pool(tier, rng)
    rows, positions = np.array([4, 3, 4, 1, 2, 0]), np.array([2599, 1099, 1500, 16, 299, 0])
    dev, tab = to_device(planes), cp.asarray(tables)
    plan = gpu.decode_plan(rows, positions, n_sm=132)
    qs = [tuple(cp.asarray(a) for a in hostile_queries(rng, len(rows), H, (0, 1), (1, 2), (2, 3), (3, 4)))
          for _ in range(8)]

    def calls():
        return [gpu.paged_mla_decode(t, dev, tab, plan, ql, qr, SCALE) for ql, qr in qs]

    monkeypatch.setattr(gpu, "_pdl_refused", False)  # (a refusal elsewhere turns PDL off)
    launched = []
    real = gpu.launch_dependent
    monkeypatch.setattr(gpu, "launch_dependent", lambda fn, *a: (launched.append(fn), real(fn, *a)))
    monkeypatch.setenv("KVFLEET_CUDA_PDL", "0")
    assert not gpu._pdl_enabled()
    want = [o.get() for o in calls()]
    assert not launched
    monkeypatch.setenv("KVFLEET_CUDA_PDL", "1")
    assert gpu._pdl_enabled()
    before = gpu.fallbacks["pdl_refused"]
    got = calls()
    # every call's combine, and tq4's attn_wg (after attn_qprep)
    assert len(launched) == len(qs) * (2 if tier == "tq4" else 1), len(launched)
    for i, (o, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(o.get(), w, err_msg=f"{tier} H={H} call {i}")
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        calls()  # (buffers into the pool before the capture)
        stream.synchronize()
        stream.begin_capture()
        outs = calls()
        graph = stream.end_capture()
        for rep in range(3):
            for o in outs:
                o.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            for i, (o, w) in enumerate(zip(outs, want)):
                np.testing.assert_array_equal(o.get(), w, err_msg=f"{tier} H={H} graph {rep} call {i}")
    assert gpu.fallbacks["pdl_refused"] == before


def test_launch_dependent_packs_arguments_as_cupy_does():
    """_build.launch_dependent packs its arguments as a plain CuPy launch would: a cupy array
    as its device pointer, a numpy scalar as its bytes, a Python int as int64, a float as
    float64; anything else, and an empty grid, is refused by name before anything runs."""
    from kernels.cuda._build import _arg, launch_dependent
    a = cp.zeros(4, cp.float32)
    assert _arg(a).value == a.data.ptr
    assert bytes(_arg(np.int32(-3))) == np.int32(-3).tobytes()
    assert bytes(_arg(np.float32(1.5))) == np.float32(1.5).tobytes()
    assert bytes(_arg(7)) == np.int64(7).tobytes() and bytes(_arg(True)) == np.int64(1).tobytes()
    assert bytes(_arg(0.25)) == np.float64(0.25).tobytes()
    fn = _probe_kernels()[1]
    with pytest.raises(TypeError, match="type str"):
        launch_dependent(fn, (1, 1), (128,), (a, "3"))
    with pytest.raises(ValueError, match="grid"):
        launch_dependent(fn, (0, 1), (128,), (a,))


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_bench_planes_give_finite_contexts(tier):
    """The bench's random planes hold live rows only: no e4m3 NaN code (0x7F or 0xFF: the
    kernels assume live rows carry none, as DevicePool stores them as 0x00), so its timed
    calls compute finite contexts (0xFF codes made every kv8 context NaN before)."""
    import cupy as cp
    from cluster.bench.attention import _device_planes
    planes, tables = _device_planes(get_tier(tier), 2, 512, np.random.default_rng(3))
    if tier == "kv8":
        for c in (planes.l_codes, planes.r_codes):
            assert not bool(((c & 0x7F) == 0x7F).any())
    plan = gpu.decode_plan(np.arange(2), np.array([511, 300]))
    q = cp.random.standard_normal((2, 16, DL), dtype=cp.float32)
    qr = cp.random.standard_normal((2, 16, DR), dtype=cp.float32)
    out = gpu.paged_mla_decode(tier, planes, tables, plan, q, qr, SCALE)
    assert bool(cp.isfinite(out).all())
