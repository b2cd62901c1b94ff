"""Diagnostic (not a test): the sm_90a kernel (attention_sm90.cu) against the float64
reference and against attention.cu, per variant, printing errors instead of asserting.

    python3 tests/gpu/diag_wgmma.py            # shared memory check + error matrix
    python3 tests/gpu/diag_wgmma.py --log      # also the compiler log (ptxas -v)
    python3 tests/gpu/diag_wgmma.py --parts    # fixed cost of a call; qprep / attn_wg /
                                               # combine alone at 16 x 32768
    python3 tests/gpu/diag_wgmma.py --prof     # where a step's time goes: clock64 stamps of
                                               # each phase (PROF=1), 16 x 32768, and each
                                               # half-tile's L lead (issue to its scorer's
                                               # first wait); PROF_MODE=3 also the parts of
                                               # S^T and of the softmax;
                                               # PROF_CASES=kv8/64,tq4/16 picks the cases,
                                               # PROF_B=16,4 the slots (fewer: SMs left idle,
                                               # the same 4096-token chunk), PROF_BASE=1 the
                                               # kernel in attention_sm90_base.cu,
                                               # PROF_TUNING=SKIPC=1 defines added
    python3 tests/gpu/diag_wgmma.py --tune "" "PW=2" "SKIPC=1" "SKIPW=4" ...
                                   # time each KVFLEET_CUDA_WG_TUNING at 16 x 32768
                                   # (SKIPC=1: consumers alone, SKIPW=4: copies alone;
                                   # TUNE_H=64 / TUNE_CVT=1 restrict the heads / kv8 cvt,
                                   # TUNE_TIERS=kv8 the tiers, TUNE_BT=1x32768,16x32768
                                   # the shapes;
                                   # BASE: the kernel in attention_sm90_base.cu;
                                   # BASE2D: the same with the 2-D L maps of before 12-01)

Variants come from the environment the kernel reads: KVFLEET_CUDA_KV8_CVT (1 hardware
conversion, 0 bit moves) and KVFLEET_CUDA_WG_TUNING (extra defines, e.g. "SKIPW=3").
"""
import functools
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_gpu import DL, DR, SCALE, contexts  # noqa: E402

from kernels.cuda import attention as gpu  # noqa: E402
from kernels.cuda._build import arch_kernel, arch_log  # noqa: E402
from kernels.tiers import get_tier  # noqa: E402


def smem_check() -> None:
    for tier in ("kv8", "tq4"):
        for hn in (16, 32, 64):
            shape, _ = gpu._wg_shape(get_tier(tier), hn, DL, DR, 16)
            fn = arch_kernel("attention_sm90.cu", "attn_wg_smem", "sm_90a", **shape.defines)
            out = cp.zeros(1, cp.int32)
            fn((1,), (1,), (out,))
            print(f"smem {tier} HN={hn} nslot={shape.nslot}: kernel {int(out[0])} "
                  f"python {shape.shared_bytes()}", flush=True)


def errors(tier_name: str, H: int, seed: int, n_sm: int = 132) -> list[float]:
    """Per query: relative L2 error against float64 (padding query: its largest |value|)."""
    out, want, positions, _ = contexts(tier_name, H, n_sm, seed)
    return [float(np.abs(out[i]).max()) if p < 0 else
            float(np.linalg.norm(out[i] - want[i]) / np.linalg.norm(want[i]))
            for i, p in enumerate(positions)]


def _base_kernel(shape, device):
    """attn_wg compiled from kernels/cuda/attention_sm90_base.cu (a copy of an earlier
    kernel, e.g. `git show HEAD:kernels/cuda/attention_sm90.cu`): variant "BASE" (BASE2D:
    one whose TMA path reads the 2-D L maps of _maps_2d, as before 2026-12-01)."""
    from kernels.cuda._build import set_dynamic_smem
    k = object.__new__(gpu._WgKernel)
    defines = dict(shape.defines)
    if "SM_RR" not in _base_source():  # whole-half-tile slots (before 2026-12-01, session 7)
        defines["NSLOT"], k.smem = _slots_of(shape)
    else:
        k.smem = shape.shared_bytes()
    fn = arch_kernel("attention_sm90_base.cu", "attn_wg", "sm_90a", **defines)
    set_dynamic_smem(fn, k.smem)
    k.fn, k.reads_qh = fn, not defines["QF"]
    if "__restrict__ q_lat" not in _base_source():  # (before 2026-12-01 session 8: qh and
        k.fn, k.reads_qh = _QhOnly(fn), True        # qscale are its only query arguments)
    return k


class _QhOnly:
    """A kernel from before session 8, called with today's arguments (drops the f32 queries,
    their head count and the scale that attention.wg_query_args puts after qh, qscale)."""

    def __init__(self, fn):
        self.fn, self.ptr = fn, fn.ptr

    def __call__(self, grid, block, args, shared_mem=0):
        self.fn(grid, block, (*args[:2], *args[6:]), shared_mem=shared_mem)


def _base_source() -> str:
    return open(os.path.join(os.path.dirname(gpu.__file__), "attention_sm90_base.cu")).read()


def _slots_of(shape):
    """(NSLOT, shared bytes) of the kernels whose slots held whole half-tiles (L and R rows,
    scales, mask), as before 2026-12-01 (session 7)."""
    hn, dk = shape.hn, shape.dl + shape.dr
    lrow, rrow = (shape.dl, shape.dr) if shape.tier_id == 1 else (shape.dl // 2, shape.dr // 2)
    head = hn * dk * 2 + hn * 128 * 2 + 3 * hn * 4 + 8 * hn * 4 + 64 + 128
    head += 256 * 32 * 4 if shape.tier_id == 2 else 0
    limit = gpu._device_info(cp.cuda.Device().id)[2]
    for nslot in (6, 5, 4, 3):
        if shape.tma:
            slot = -(-(64 * lrow + 64 * rrow + 2 * 64 * 4 + 16) // 1024) * 1024
            total = -(-head // 1024) * 1024 + nslot * slot
        else:
            total = head + nslot * (64 * lrow + 64 * (rrow + 16) + 2 * 64 * 4 + 16)
        if total <= limit:
            return nslot, total
    raise RuntimeError("no slot count fits")


def _maps_2d(planes):
    """The tensor maps of kernels before 2026-12-01: L codes as 2-D boxes of bs rows x 128
    bytes (one per column block), R codes as before (cached: graphs capture the launch)."""
    nblk, bs, lrow = planes.l_codes.shape
    return _maps_2d_at(planes.l_codes.data.ptr, planes.r_codes.data.ptr, nblk * bs, lrow,
                       planes.r_codes.shape[2], bs)


@functools.lru_cache(maxsize=8)
def _maps_2d_at(l_ptr, r_ptr, rows, lrow, rrow, bs):
    maps = gpu._encode_tensor_map(l_ptr, (lrow, rows), (lrow,), (128, bs), 3) + \
        gpu._encode_tensor_map(r_ptr, (rrow, rows), (rrow,), (rrow, bs), gpu.TMA_SWIZZLE[rrow])
    return cp.asarray(np.frombuffer(maps, np.uint8))


def tune(variants: list[str]) -> None:
    from cluster.bench.attention import _device_planes, _graph_time
    wg_kernel, tma_maps = gpu._wg_kernel, gpu.tma_maps
    rng = np.random.default_rng(0)
    for tier_name, (B, T) in ((t, tuple(int(v) for v in bt.split("x"))) for t in os.environ.get("TUNE_TIERS", "kv8,tq4").split(",")
                              for bt in os.environ.get("TUNE_BT", "16x32768").split(",")):
        tier = get_tier(tier_name)
        planes, tables = _device_planes(tier, B, T, rng)
        for H in (int(h) for h in os.environ.get("TUNE_H", "64,16").split(",")):
            q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
            q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
            plan = gpu.decode_plan(np.arange(B), np.full(B, T - 1), ctas_per_sm=1)
            for v in variants:
                for cvt in (os.environ.get("TUNE_CVT", "1,0").split(",") if tier_name == "kv8"
                            else ("1",)):
                    names = v.split(",")
                    gpu._wg_kernel = _base_kernel if {"BASE", "BASE2D"} & set(names) else wg_kernel
                    gpu.tma_maps = _maps_2d if "BASE2D" in names else tma_maps
                    defs = [x for x in names
                            if x and not x.startswith("TMA=") and x not in ("BASE", "BASE2D")]
                    tma = [x[4:] for x in v.split(",") if x.startswith("TMA=")]
                    os.environ[gpu.TMA_ENV] = tma[-1] if tma else "1"
                    os.environ["KVFLEET_CUDA_WG_TUNING"] = ",".join(defs)
                    os.environ["KVFLEET_CUDA_KV8_CVT"] = cvt
                    try:
                        err = max(errors(tier_name, H, seed=3))
                    except ValueError as e:  # (a tuning that does not fit this shape)
                        print(f"tune {tier_name} H={H} [{v}]: skipped ({e})", flush=True)
                        continue
                    fn = lambda: gpu.paged_mla_decode(  # noqa: E731
                        tier, planes, tables, plan, q_lat, q_rope, SCALE)
                    t = _graph_time(fn, 10)[0]
                    print(f"tune {tier_name} {B}x{T} H={H} [{v}] cvt={cvt}: {1e3 * t:.4f} ms  "
                          f"(max err {err:.1e})", flush=True)
        planes = tables = None
        cp.get_default_memory_pool().free_all_blocks()
    gpu._wg_kernel = wg_kernel
    gpu.tma_maps = tma_maps
    os.environ.pop("KVFLEET_CUDA_WG_TUNING", None)
    os.environ.pop("KVFLEET_CUDA_KV8_CVT", None)
    os.environ.pop(gpu.TMA_ENV, None)


def parts() -> None:
    """Time per call at B = 16 for T = 4k .. 32k (the intercept of time against T is the
    fixed cost of a call) and, at 16 x 32k, attn_qprep, attn_wg and attn_combine alone."""
    from dataclasses import replace
    from cluster.bench.attention import _device_planes, _graph_time
    B, H = 16, 64
    rng = np.random.default_rng(0)
    dev = cp.cuda.Device().id
    for tier_name in ("kv8", "tq4"):
        tier = get_tier(tier_name)
        planes, tables = _device_planes(tier, B, 32768, rng)
        q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
        q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
        for T in (4096, 8192, 16384, 32768):
            plan = gpu.decode_plan(np.arange(B), np.full(B, T - 1), ctas_per_sm=1)
            t = _graph_time(lambda: gpu.paged_mla_decode(tier, planes, tables, plan, q_lat,
                                                         q_rope, SCALE), 10)[0]
            print(f"parts {tier_name} H={H} {B}x{T}: {1e3 * t:.4f} ms (W={plan.n_work}, "
                  f"chunk {plan.chunk})", flush=True)
        shape, groups = gpu._wg_shape(tier, H, DL, DR, planes.l_scale.shape[1])
        shape = gpu._wg_cluster(shape, groups, plan, dev)
        most = {c: gpu.max_active_clusters(gpu._wg_kernel(replace(shape, cl=c), dev).fn, c,
                                           gpu.WG_THREADS, shape.shared_bytes()) for c in (2, 4, 8)}
        print(f"parts {tier_name} H={H}: clusters of {shape.cl}; at most {most} clusters of "
              f"2 / 4 / 8 at once", flush=True)
        ks = gpu._kernels(gpu.Shape(shape.tier_id, 1, 64, DL, DR), dev)
        hpad, W = groups * shape.hn, plan.n_work
        qh = cp.empty((B, hpad, DL + DR), cp.uint16)
        qs = cp.empty((B, hpad), cp.float32)
        o_part = cp.zeros((W, hpad, DL), cp.float32)
        ml_part = cp.zeros((W, hpad, 2), cp.float32)
        out = cp.empty((B, H, DL), cp.float32)
        cargs = (o_part, ml_part, plan.splits, out, np.int32(H), np.int32(hpad))
        wg = gpu._wg_kernel(shape, dev)
        lut = gpu._tq_lut(dev)
        maps = gpu.tma_maps(planes)
        calls = {
            "qprep": lambda: ks.qprep((B, hpad), (128,), (  # (tq4's; kv8 makes its own)
                q_lat, q_rope, qh, qs, np.int32(H), np.int32(hpad), np.float32(SCALE * gpu.LOG2E))),
            "attn_wg": lambda: gpu.launch_wg(wg, groups, planes, tables, plan, gpu.wg_query_args(
                wg, q_lat, q_rope, SCALE, qh, qs), lut, maps, o_part, ml_part),
            "combine": lambda: ks.combine((B, H), (128,), cargs),
        }
        base = os.path.join(os.path.dirname(gpu.__file__), "attention_base.cu")
        if os.path.exists(base):  # (an earlier attention.cu, e.g. `git show HEAD:...`)
            from kernels.cuda._build import kernel
            old = kernel("attention_base.cu", "attn_combine",
                         **gpu.Shape(shape.tier_id, 1, 64, DL, DR).defines)
            calls["combine of attention_base.cu"] = lambda: old((B, H), (128,), cargs)
        for name, fn in calls.items():
            print(f"parts {tier_name} H={H} {B}x32768 {name} alone: "
                  f"{1e3 * _graph_time(fn, 10)[0]:.4f} ms", flush=True)
        planes = tables = None
        cp.get_default_memory_pool().free_all_blocks()


def prof() -> None:
    """attn_wg with PROF=1 (PROF_MODE=3: PROF=3) at 16 x 32768: per phase of a step (copy
    wait, S^T, flag barrier, P^T, O^T), the median over CTAs of the mean over the steady
    steps, in SM clock cycles (the clock rate from the kernel's own graph-timed duration)."""
    from dataclasses import replace
    from cluster.bench.attention import _device_planes, _graph_time
    T = 32768
    rng = np.random.default_rng(0)
    dev = cp.cuda.Device().id
    cases = [(t, h, b) for b in (int(x) for x in os.environ.get("PROF_B", "16").split(","))
             for t, h in (("kv8", 64), ("tq4", 64), ("kv8", 16), ("tq4", 16))
             if f"{t}/{h}" in os.environ.get("PROF_CASES", "kv8/64,tq4/64,kv8/16,tq4/16")]
    for tier_name, H, B in cases:
        tier = get_tier(tier_name)
        planes, tables = _device_planes(tier, B, T, rng)
        q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
        q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
        # B < 16: fewer CTAs of the same chunk (as many SMs idle): the copies' contention
        plan = gpu.decode_plan(np.arange(B), np.full(B, T - 1), n_sm=gpu._device_info(dev)[3] * B // 16,
                               ctas_per_sm=1)
        shape, groups = gpu._wg_shape(tier, H, DL, DR, planes.l_scale.shape[1])
        if os.environ.get("PROF_BASE") != "1":
            shape = gpu._wg_cluster(shape, groups, plan, dev)
        print(f"prof {tier_name} H={H}: clusters of {shape.cl}", flush=True)
        ks = gpu._kernels(gpu.Shape(shape.tier_id, 1, 64, DL, DR), dev)
        hpad, W = groups * shape.hn, plan.n_work
        qh = cp.empty((B, hpad, DL + DR), cp.uint16)
        qs = cp.empty((B, hpad), cp.float32)
        ks.qprep((B, hpad), (128,), (q_lat, q_rope, qh, qs, np.int32(H), np.int32(hpad),
                                     np.float32(SCALE * gpu.LOG2E)))
        ml_part = cp.zeros((W, hpad, 2), cp.float32)
        lut, maps = gpu._tq_lut(dev), gpu.tma_maps(planes)
        times = {}
        for p in (0, 1):
            make = _base_kernel if os.environ.get("PROF_BASE") == "1" else gpu._wg_kernel
            pv = p * int(os.environ.get("PROF_MODE", "1"))  # 3: also S^T / softmax parts
            extra = gpu._tuning(os.environ.get("PROF_TUNING", ""))  # e.g. SKIPC=1
            wg = make(replace(shape, tuning=shape.tuning + extra + (("PROF", pv),)), dev)
            o_part = cp.zeros((2 * W, hpad, DL), cp.float32)  # stamps past the first W rows
            q = gpu.wg_query_args(wg, q_lat, q_rope, SCALE, qh, qs)
            fn = lambda: gpu.launch_wg(wg, groups, planes, tables, plan, q, lut,  # noqa: E731
                                       maps, o_part, ml_part)
            times[p] = _graph_time(fn, 10)[0]
        fn()
        cp.cuda.Device().synchronize()
        st = o_part.reshape(-1)[W * hpad * DL:].view(cp.uint64)[:W * groups * 4096].get()
        st = st.reshape(W * groups, 4096).astype(np.int64)
        n = int(plan.chunk) // 128
        t = st[:, :1024].reshape(-1, 2, 64, 8)[:, :, :n, :6]  # [cta, wg, step, phase]
        total = np.median(st[:, 2002] - st[:, 2000])
        ghz = total / (times[1] * 1e9)
        print(f"prof {tier_name} H={H} {B}x32768 ({W} CTAs): attn_wg {1e3 * times[0]:.4f} ms "
              f"(PROF=1 {1e3 * times[1]:.4f}), {total:.0f} cycles per CTA = {ghz:.2f} GHz; "
              f"{n} steps", flush=True)
        lo, hi = 2, n - 2
        names = ["wait full", "S^T", "flag+bar", "P^T+bar", "O^T"]
        for c in (0, 1):
            d = np.diff(t[:, c, lo:hi, :], axis=2)  # phases 0..5 -> 5 durations
            step = np.diff(t[:, c, lo:hi + 1, 0], axis=1)
            durs = [np.median(d[:, :, k].mean(axis=1)) for k in range(5)]
            print(f"  wg{c} step {np.median(step.mean(axis=1)):.0f} cycles: " + ", ".join(
                f"{nm} {v:.0f}" for nm, v in zip(names, durs)) +
                f"; next-step gap {np.median((t[:, c, lo + 1:hi + 1, 0] - t[:, c, lo:hi, 5]).mean(axis=1)):.0f}",
                flush=True)
        # the L rows' lead: the producer's issue of half-tile h's L rows (PROF stamp 1024 + h)
        # to the end of its scorer's first wait (for the R entry; the whole half-tile in the
        # kernels before session 7, where this was the copy latency when that wait was long),
        # and the issue relative to the start of the step that uses it
        iss = st[:, 1024:1024 + 2 * n].reshape(-1, n, 2)  # [cta, step, owner wg]
        for c in (0, 1):
            lat = t[:, c, lo:hi, 1] - iss[:, lo:hi, c]
            rel = iss[:, lo:hi, c] - t[:, c, lo:hi, 0]
            print(f"  half-tiles of wg{c}: L issue to wait end {np.median(lat.mean(axis=1)):.0f} "
                  f"cycles, issued {np.median(rel.mean(axis=1)):.0f} cycles after the step "
                  f"that uses it starts", flush=True)
        if os.environ.get("PROF_MODE") == "3":
            # [cta, wg, step, j]: j 0 rope done, 1 latent done, 2 flag made, 3 P^T stored
            sub = st[:, 2048:3072].reshape(-1, 2, 64, 8)[:, :, lo:hi, :4]
            ph = t[:, :, lo:hi, :]
            # (SPEC=1, kv8's default: "flag made" includes the P^T stores made before the
            # vote, and "P^T made" is only the rare remake after a rescale)
            parts = [("to rope done", sub[..., 0] - ph[..., 1]),
                     ("latent loop", sub[..., 1] - sub[..., 0]),
                     ("final scale", ph[..., 2] - sub[..., 1]),
                     ("flag made", sub[..., 2] - ph[..., 2]),
                     ("bar_or wait", ph[..., 3] - sub[..., 2]),
                     ("P^T made", sub[..., 3] - ph[..., 3]),
                     ("P^T barrier", ph[..., 4] - sub[..., 3])]
            resc = st[:, 2048:3072].reshape(-1, 2, 64, 8)[:, 0, :n, 4]  # (SPEC: the vote)
            print(f"  steps that rescaled: {resc.mean():.3f} (step 0 {resc[:, 0].mean():.2f}, "
                  f"steps 1-3 {resc[:, 1:4].mean():.3f}, later {resc[:, 4:].mean():.4f})", flush=True)
            for c in (0, 1):
                print(f"  wg{c} parts: " + ", ".join(
                    f"{nm} {np.median(v[:, c].mean(axis=1)):.0f}" for nm, v in parts), flush=True)
        pro = np.median(st[:, 2001] - st[:, 2000])
        first = np.median(t[:, 0, 0, 0] - st[:, 2001])
        epi = np.median(st[:, 2002] - t[:, :, n - 1, 5].max(axis=1))
        print(f"  prologue {pro:.0f}, to the first step {first:.0f}, last step to the end {epi:.0f} "
              f"cycles; step 0 {np.median(t[:, 0, 1, 0] - t[:, 0, 0, 0]):.0f}", flush=True)
        # the prologue from the CTA's start: its first __syncthreads, the producer's first L
        # issue, the consumers' Q^T made, warpgroup 0's first R entry and L slot landed
        at = lambda x: np.median(x - st[:, 2000])  # noqa: E731
        print(f"  from the CTA start: __syncthreads {at(st[:, 2003]):.0f}, first L issue "
              f"{at(st[:, 1024]):.0f}, Q^T made {at(st[:, 2001]):.0f}, first R landed "
              f"{at(t[:, 0, 0, 1]):.0f}, first S^T done {at(t[:, 0, 0, 2]):.0f} cycles",
              flush=True)
        print(f"  consumer 0: setmaxnreg {at(st[:, 2004]):.0f}, Q^T loads issued "
              f"{at(st[:, 2005]):.0f}, stored {at(st[:, 2006]):.0f} cycles", flush=True)
        print(f"  producer: setmaxnreg {at(st[:, 2007]):.0f} cycles", flush=True)
        # the spread over CTAs: durations (SM cycles) and, on the one global clock (ns),
        # when each started and ended relative to the first start
        dur = st[:, 2002] - st[:, 2000]
        g0, g1 = st[:, 2009] - st[:, 2009].min(), st[:, 2010] - st[:, 2009].min()
        print(f"  CTA durations: min {dur.min()}, median {np.median(dur):.0f}, p90 "
              f"{np.percentile(dur, 90):.0f}, max {dur.max()} cycles; starts 0..{g0.max()} ns "
              f"(median {np.median(g0):.0f}); ends median {np.median(g1):.0f}, p90 "
              f"{np.percentile(g1, 90):.0f}, max {g1.max()} ns", flush=True)
        planes = tables = None
        cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    if "--prof" in sys.argv:
        prof()
        return
    if "--parts" in sys.argv:
        parts()
        return
    if "--tune" in sys.argv:
        tune(sys.argv[sys.argv.index("--tune") + 1:])
        return
    if "--log" in sys.argv:
        for tier, hn in (("kv8", 64), ("tq4", 64), ("kv8", 16)):
            shape, _ = gpu._wg_shape(get_tier(tier), hn, DL, DR, 16)
            os.environ["KVFLEET_CUDA_PTXAS_V"] = "1"
            print(f"--- log {tier} HN={hn}\n" + arch_log("attention_sm90.cu", "sm_90a",
                                                        **shape.defines)[-1500:], flush=True)
    smem_check()
    for cvt in ("1", "0"):
        os.environ["KVFLEET_CUDA_KV8_CVT"] = cvt
        for tier in ("kv8", "tq4"):
            if tier == "tq4" and cvt == "0":
                continue
            for H in (16, 64, 4, 24, 128):
                for n_sm in (132, 1):
                    e = errors(tier, H, seed=H, n_sm=n_sm)
                    print(f"cvt={cvt} {tier} H={H} n_sm={n_sm}: max err {max(e):.2e}  "
                          + " ".join(f"{x:.1e}" for x in e), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
