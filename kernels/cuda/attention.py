"""Paged MLA decode attention on CUDA over the pool's coded planes (f32, kv8, tq4).

    plan = decode_plan(tables_rows[N], positions[N], ctas_per_sm=ctas_per_sm(tier, H, ...),
                       head_groups=head_groups(tier, H, ...))        # once per step
    ctx  = paged_mla_decode(tier, planes, block_tables, plan, q_lat, q_rope, scale)

Query i attends keys 0..positions[i] of block-table row tables_rows[i] (-1 = padding query,
context 0). Same semantics as kernels/cpu/attention.paged_mla_attention, flat over queries.
The plan (work split over the context, flash-decoding) depends only on the lengths, so a
decode step builds it once and every layer reuses it.

Kernels (attention.cu): attn_qprep (f16 queries, tq4 rotation) -> attn_split (one CTA per
chunk of context and group of <= 64 heads: scores, online softmax, context, all on the
tensor cores with f16 operands and f32 accumulation) -> attn_combine (merge the chunks; tq4
unrotates). Precision: kv8 codes are exact in f16; tq4 levels round to f16 (2^-11
relative); the f32 tier converts K/V to f16 as well (|x| < 65504, 2^-11 relative), as do
the queries (per head scaled to max |q| = 1) and the softmax weights.

On Hopper (compute capability 9.0) kv8 and tq4 take attention_sm90.cu's attn_wg instead of
attn_split (warpgroup MMA, the codes converted in registers; `kernel_path()` says which
runs, KVFLEET_CUDA_WGMMA=0 forces attention.cu; its copies go through the TMA with tensor
maps from tma_maps(), or cp.async for block sizes not divisible by 8, rope rows other than
32 / 64 / 128 bytes and planes not 16-byte aligned; KVFLEET_CUDA_TMA=0 forces cp.async). For
kv8 each of its CTAs makes its own f16 queries (the bits attn_qprep makes; no qprep launch),
tq4 takes attn_qprep's; attn_combine merges the chunks; same precision. At 64 heads, where
every query of the plan has an even number of work items (DecodePlan.cluster), the CTAs of one
query run in clusters (_wg_cluster: the largest that fits the GPU in one wave; 2 on an H200)
and each makes 1 / CL of the heads' f16 queries, storing them into the others' shared
memory (the same bits). It
assumes kv8 live rows hold no e4m3 NaN codes (0x7F / 0xFF, which decode to 0): the GPU
encoder never writes them and kvstore.device_pool maps uploaded ones to 0x00.

On sm_90, attn_combine is launched as a programmatic dependent of the split kernel (the
driver has it ready when that kernel ends; it waits for the end with griddepcontrol.wait:
letting attn_wg place it on free SMs from its start made kv8 64h 1 x 32k 0.0278 -> 0.0459 ms,
attention_sm90.cu PDLT), and tq4's attn_wg as one of attn_qprep (its copies of the cache
start while qprep runs; its queries wait for qprep's end). KVFLEET_CUDA_PDL=0 turns both off;
a launch the driver refuses, or a driver / kernel too old for it on an sm_90 device, is
counted in `fallbacks` (the first of each logged) and plain launches follow.

Shared memory: each specialisation's need (Shape / WgShape.shared_bytes(), the kernels'
SM_TOTAL) is checked against the device's opt-in limit per block before it is chosen
(_choose). Where attn_wg does not fit, attention.cu runs (`fallbacks["attn_wg_smem"]`); where
this head count's attention.cu tiles do not fit (64 heads on an A100's 163 KB, most shapes on
sm_86 / sm_89's 99 KB), fewer tokens per tile and then fewer heads per CTA (more head groups)
do (`fallbacks["attn_split_smem"]`); where not even 16 heads on 32-token tiles fit,
has_kernel() is False and callers take the CPU path. Each such call is counted, the first of
each name logged.
"""
from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass, replace

import cupy as cp
import numpy as np

from kernels.cpu import tq4 as tq4_ref
from kernels.cpu.rotation import rotatable
from kernels.cuda._build import (arch_kernel, driver_version, function_ptr, kernel,
                                 launch_dependent, max_active_clusters, ptx_arch,
                                 set_dynamic_smem, stream_capturing)
from kernels.tiers import Tier, get_tier

_TIER_ID = {"f32": 0, "fp8": 1, "tq": 2}
LOG2E = 1.4426950408889634
MIN_CHUNK = 256  # tokens; shorter chunks cost more in partial contexts than they save
log = logging.getLogger(__name__)
# Slower paths taken inside this module (e.g. attn_wg unclustered after a driver error), by
# name (workers/fallbacks.py declares each as a kvfleet_fallbacks path, cuda.<name>); the
# first of each is logged. _since_drain: the counts drain_fallbacks() has not reported yet.
fallbacks: Counter = Counter()
_since_drain: Counter = Counter()


def _count_fallback(what: str, why: str) -> None:
    if not fallbacks[what]:
        log.warning("%s: %s (counted in kernels.cuda.attention.fallbacks)", what, why)
    fallbacks[what] += 1
    _since_drain[what] += 1


def drain_fallbacks() -> dict[str, int]:
    """This process's fallbacks since the previous drain, by name (for the worker step: the
    counts are per process, so of several models in one process the first to drain reports
    them, each once)."""
    global _since_drain
    out, _since_drain = dict(_since_drain), Counter()
    return out


PDL_ENV = "KVFLEET_CUDA_PDL"
PDL_DRIVER = 12030  # programmatic edges in CUDA graphs (stream capture) need driver 12.3


def _pdl_enabled(fn=None) -> bool:
    """Programmatic dependent launch for attn_combine (and tq4's attn_wg after attn_qprep):
    on an sm_90 device with a driver >= 12.3, for a function compiled for sm_90 or later (so
    that its griddepcontrol.wait was compiled in: grid_dep.cuh), unless KVFLEET_CUDA_PDL=0
    or the driver refused a launch once (counted)."""
    if _pdl_refused or os.environ.get(PDL_ENV, "1") == "0":
        return False
    if int(_device_info(cp.cuda.Device().id)[0]) < 90:
        return False  # (no PDL before Hopper: nothing to count)
    if _driver_version() < PDL_DRIVER:
        _count_fallback("pdl_driver",
                        f"programmatic dependent launch needs driver {PDL_DRIVER}, this is "
                        f"{_driver_version()}: plain launches")
        return False
    if fn is None:
        return True
    ptr = function_ptr(fn)
    if ptr not in _ptx_archs:
        _ptx_archs[ptr] = ptx_arch(fn)
    if _ptx_archs[ptr] < 90:
        _count_fallback("pdl_ptx",
                        f"a kernel compiled for compute_{_ptx_archs[ptr]} (no griddepcontrol): "
                        f"plain launches for it")
        return False
    return True


_pdl_refused = False
_ptx_archs: dict[int, int] = {}  # CUfunction -> its PTX architecture (read once each)


@functools.lru_cache(maxsize=None)
def _driver_version() -> int:
    return driver_version()


def _launch_kernel(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
                   dependent: bool = False) -> None:
    """fn on the current stream; dependent: as a programmatic dependent of the kernel before
    it where _pdl_enabled(fn) (fn then waits for that kernel with griddepcontrol.wait; see
    grid_dep.cuh), a plain launch otherwise. Where the driver refuses the dependent launch,
    the refusal is counted, this and every later launch is plain, except while the stream is
    being captured into a CUDA graph (the capture may be invalid by then: the error is raised)."""
    global _pdl_refused
    if dependent and _pdl_enabled(fn):
        try:
            launch_dependent(fn, grid, block, args, shared_mem)
            return
        except (RuntimeError, AttributeError, OSError) as e:
            _pdl_refused = True
            _count_fallback("pdl_refused", f"programmatic dependent launch refused: {e}; "
                                           f"plain launches from now on")
            if stream_capturing():
                raise
    fn(grid, block, args, shared_mem=shared_mem)


def has_kernel(tier: Tier | str, kv_lora: int, rope: int) -> bool:
    """True when attn_split covers this tier and these widths on this device (else use the
    CPU path; no_kernel_reason() says why not)."""
    return no_kernel_reason(tier, kv_lora, rope) is None


def no_kernel_reason(tier: Tier | str, kv_lora: int, rope: int) -> str | None:
    """Why no CUDA kernel attends over this tier and these widths on this device, or None:
    the tier (polar), the widths (kv_lora % 128, rope % 16, tq4's rotation), or shared
    memory (the smallest attention.cu tile, 16 heads x 32 tokens with one stage in flight,
    must fit the device's opt-in limit per block; every head count can run on it)."""
    return _no_kernel_reason(get_tier(tier), kv_lora, rope, _device_info(cp.cuda.Device().id))


@functools.lru_cache(maxsize=None)
def _no_kernel_reason(tier: Tier, kv_lora: int, rope: int, info: tuple) -> str | None:
    """no_kernel_reason on the device whose _device_info is `info` (once per key: callers
    ask per layer and step)."""
    if tier.kind not in _TIER_ID:
        return f"no CUDA attention kernel for the {tier.kind} tiers"
    if kv_lora % 128 or rope % 16 or kv_lora <= 0 or rope <= 0:
        return (f"no CUDA attention kernel for kv_lora={kv_lora}, rope={rope} (kv_lora must "
                f"be a positive multiple of 128, rope of 16)")
    if tier.kind == "tq" and not (rotatable(kv_lora) and rotatable(rope)):
        return f"no tq4 CUDA attention kernel for kv_lora={kv_lora}, rope={rope} (not rotatable)"
    need, limit = Shape(_TIER_ID[tier.kind], 1, 32, kv_lora, rope).shared_bytes(), _smem_limit()
    if need > limit:
        return (f"the smallest CUDA attention tile for kv_lora={kv_lora}, rope={rope} needs "
                f"{need} bytes of shared memory per block; this GPU allows {limit}")
    return None


@dataclass(frozen=True)
class Shape:
    """Compile-time shape of one specialisation."""
    tier_id: int
    mt: int  # m-tiles of 16 heads per CTA
    bt: int  # tokens per tile
    dl: int
    dr: int
    nstage: int = 1  # raw tiles in flight
    skip: int = 0    # attention.cu SKIP: timing variants only
    minb: int = 1    # CTAs per SM (2: registers capped at 128, shared memory halved)

    @property
    def defines(self) -> dict:
        return dict(TIER=self.tier_id, MT=self.mt, BT=self.bt, DL=self.dl, DR=self.dr,
                    NSTAGE=self.nstage, SKIP=self.skip, MINB=self.minb)

    def shared_bytes(self) -> int:
        """attention.cu SM_TOTAL."""
        mrows, kstr, pstr = 16 * self.mt, self.dl + self.dr + 8, self.bt + 8
        tg = min(8 // self.mt, self.bt // 8)
        per = {0: 4.0, 1: 1.0, 2: 0.5}[self.tier_id]
        stage = int(self.bt * (self.dl + self.dr) * per)
        return (2 * mrows * kstr + 2 * self.bt * kstr + 2 * mrows * pstr
                + self.nstage * (-(-stage // 16) * 16 + 4 * 2 * self.bt) + 3 * 4 * self.bt
                + 4 * (self.nstage + 1) * self.bt + 2 * 4 * tg * mrows + 4 * mrows + 4 * 256 + 16)


@functools.lru_cache(maxsize=None)
def _device_info(device: int) -> tuple[str, int, int, int]:
    """(compute capability, shared memory per SM, per block opt-in, SMs) of a device, read
    once per process: Device.attributes queries every attribute, and this runs per layer."""
    dev = cp.cuda.Device(device)
    attrs = dev.attributes
    return (dev.compute_capability, attrs["MaxSharedMemoryPerMultiprocessor"],
            attrs["MaxSharedMemoryPerBlockOptin"], attrs["MultiProcessorCount"])


def _smem_limit(ctas_per_sm: int = 1) -> int:
    _, per_sm, optin, _ = _device_info(cp.cuda.Device().id)
    return min(optin, per_sm // ctas_per_sm - 1024)  # 1 KiB/CTA reserved


def _shape(tier: Tier, n_heads: int, dl: int, dr: int, skip: int = 0,
           two_ctas: bool = True) -> tuple[Shape, int, str]:
    """(specialisation, head groups, why it is smaller than this head count's own: "" where
    it is not) for n_heads: up to 64 heads share one pass; as many raw tiles in flight (3, 2
    or 1) as shared memory allows. With <= 16 heads a coded tier runs two CTAs per SM on
    32-token tiles, so one CTA's conversion overlaps the other's products (one CTA of 8 warps
    leaves the schedulers idle most cycles). Where the head count's own tiles do not fit the
    device's shared memory, 32-token tiles, then fewer heads per CTA (more head groups, each
    reading the cache again) do; has_kernel() checks that the smallest fits."""
    n16 = -(-n_heads // 16)  # m-tiles of 16 heads
    mt0, tid = min(4, n16), _TIER_ID[tier.kind]
    bt0 = 32 if tid == 0 else 64
    if two_ctas and mt0 == 1 and tid != 0:
        limit = _smem_limit(2)
        for nstage in (3, 2, 1):
            shape = Shape(tid, 1, 32, dl, dr, nstage, skip, 2)
            if shape.shared_bytes() <= limit:
                return shape, n16, ""
    limit = _smem_limit()
    for mt in range(mt0, 0, -1):
        groups = -(-n16 // mt)
        if mt < mt0 and mt > 1 and -(-n16 // (mt - 1)) == groups:
            continue  # (mt - 1 makes as many groups, with less padding and shared memory)
        for bt in dict.fromkeys((bt0, 32)):
            for nstage in (3, 2, 1):
                shape = Shape(tid, mt, bt, dl, dr, nstage, skip)
                if shape.shared_bytes() <= limit:
                    if (mt, bt) == (mt0, bt0):
                        return shape, groups, ""
                    need = Shape(tid, mt0, bt0, dl, dr, 1, skip).shared_bytes()
                    return shape, groups, (
                        f"{16 * mt0} heads per CTA on {bt0}-token tiles need {need} bytes of "
                        f"shared memory per block, this GPU allows {limit}: {16 * mt} heads "
                        f"per CTA ({groups} head groups) on {bt}-token tiles")
    raise ValueError(f"{tier.name}: no attention.cu tile for kv_lora={dl}, rope={dr} fits "
                     f"{limit} bytes of shared memory (has_kernel() is False)")


WG_ENV = "KVFLEET_CUDA_WGMMA"  # "0": never the sm_90a kernel (comparisons, other GPUs)
_WG_TIER = {"fp8": 1, "tq": 2}
WG_THREADS = 384  # attention_sm90.cu NTHREADS: two consumer warpgroups + the producer's
TMA_ENV = "KVFLEET_CUDA_TMA"  # "0": the sm_90a kernel copies with cp.async instead of the TMA


@dataclass(frozen=True)
class WgShape:
    """Compile-time shape of attention_sm90.cu (warpgroup MMA, Hopper)."""
    tier_id: int
    hn: int     # heads per CTA: the wgmma N (16, 32 or 64)
    dl: int
    dr: int
    nslot: int  # 64-token half-tiles of raw L rows in flight (R rows: nr, see the kernel)
    cvt: int = 1  # kv8: 1 hardware e4m3x2 -> f16x2 conversion, 0 integer bit moves
    tma: int = 1  # 1: blocks copied by the TMA (tensor maps from tma_maps()), 0: cp.async
    bs: int = 16  # the pool's block size: rows of a TMA box (compiled in with the TMA only)
    tuning: tuple = ()  # extra (name, value) defines from KVFLEET_CUDA_WG_TUNING="SB=2,SW=1":
                        # SB, SW, PW and the timing-only knobs (attention_sm90.cu)
    cl: int = 1  # CTAs per cluster (CL): consecutive work items of one query share the work
                 # of making Q^T (see _wg_cluster)

    @property
    def defines(self) -> dict:
        bs = dict(BS=self.bs) if self.tma else {}
        cl = dict(CL=self.cl) if self.cl > 1 else {}
        # QF: kv8 CTAs make their f16 queries from the f32 ones; tq4 reads attn_qprep's (its
        # rotation cost more in the prologue than the launch saves). A tuning QF=0 overrides.
        d = dict(TIER=self.tier_id, HN=self.hn, DL=self.dl, DR=self.dr, NSLOT=self.nslot,
                 NR=self.nr, CVT=self.cvt, TMA=self.tma, QF=int(self.tier_id == 1), **bs, **cl)
        # (a tuning NSLOT below the shape's leaves shared memory unused; a tuning CL only caps
        # the cluster _wg_cluster picks, which is self.cl)
        d.update(t for t in self.tuning if t[0] != "CL")
        if d["NSLOT"] > self.nslot:
            raise ValueError(f"KVFLEET_CUDA_WG_TUNING NSLOT={d['NSLOT']}: at most {self.nslot} "
                             f"fit in shared memory for {self.hn} heads of this tier")
        if d["NR"] != self.nr:  # (shared_bytes() sizes the launch with self.nr)
            raise ValueError(f"KVFLEET_CUDA_WG_TUNING NR={d['NR']}: the shape has {self.nr} "
                             f"R entries at {self.hn} heads and cannot be tuned")
        return d

    @property
    def nr(self) -> int:
        """R entries: two at 64 heads (all that fit beside four L slots), three below."""
        return 2 if self.hn == 64 else 3

    def shared_bytes(self) -> int:
        """attention_sm90.cu SM_TOTAL (checked against the kernel in tests/gpu)."""
        hn, dk, nr = self.hn, self.dl + self.dr, self.nr
        lrow, rrow = (self.dl, self.dr) if self.tier_id == 1 else (self.dl // 2, self.dr // 2)
        # Q^T, P^T (the reduction scratch lives in it), qscale / M / factors / M with -Inf
        # as 0, c, mbarriers, the L slots' valid-token masks, the R entries' scales and masks
        head = hn * dk * 2 + hn * 128 * 2 + 4 * hn * 4 + 64 + 128 + 64 + nr * (2 * 64 * 4 + 16)
        lut = 256 * (64 if dict(self.tuning).get("LUT2", 1) else 32) * 4 if self.tier_id == 2 else 0
        if self.tma:  # unpadded R rows; the R entries start 1024-byte aligned
            rr = -(-(64 * rrow) // 1024) * 1024
            return -(-(head + lut) // 1024) * 1024 + nr * rr + self.nslot * 64 * lrow
        return head + lut + nr * 64 * (rrow + 16) + self.nslot * 64 * lrow


def _tuning(text: str) -> tuple[tuple[str, int], ...]:
    """KVFLEET_CUDA_WG_TUNING ("SB=2,SW=1") as (define, value) pairs."""
    out = []
    for kv in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = kv.partition("=")
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            raise ValueError(f"KVFLEET_CUDA_WG_TUNING entry {kv!r} must look like SB=2")
        out.append((name, int(value)))
    return tuple(out)


def _wg_shape(tier: Tier, n_heads: int, dl: int, dr: int, bs: int) -> tuple[WgShape, int] | None:
    """(specialisation, head groups) of the sm_90a kernel, or None where it does not apply:
    not a Hopper GPU, KVFLEET_CUDA_WGMMA=0, f32 / polar tiers, widths (kv_lora other than
    512, the two consumer warpgroups' 2 x 256 context dims; rope % 32), a block size that
    does not divide 64, or not enough shared memory (_wg_shapes: the ones tried)."""
    shapes = _wg_shapes(tier, n_heads, dl, dr, bs)
    limit = _device_info(cp.cuda.Device().id)[2]
    for shape in shapes or ():
        if shape.shared_bytes() <= limit:
            return shape, -(-n_heads // shape.hn)
    return None


def _wg_shapes(tier: Tier, n_heads: int, dl: int, dr: int, bs: int) -> list[WgShape] | None:
    """The sm_90a kernel's specialisations for these parameters, best first (the first one
    that fits the device's shared memory runs), or None where the kernel does not apply."""
    if os.environ.get(WG_ENV, "1") == "0" or tier.kind not in _WG_TIER:
        return None
    if dl != 512 or dr % 32 or bs <= 0 or 64 % bs or not has_kernel(tier, dl, dr):
        return None
    if _device_info(cp.cuda.Device().id)[0] != "90":
        return None
    hn = 16 if n_heads <= 16 else 32 if n_heads <= 32 else 64
    cvt = int(os.environ.get("KVFLEET_CUDA_KV8_CVT", "1"))
    tuning = _tuning(os.environ.get("KVFLEET_CUDA_WG_TUNING", ""))
    rrow = dr if tier.kind == "fp8" else dr // 2
    # The TMA copies (whole blocks) beat cp.async everywhere (H200, 16 x 32k, ms: kv8 64h
    # 0.212 vs 0.234, 16h 0.134 vs 0.163; tq4 64h 0.247 vs 0.259, 16h 0.169 vs 0.184).
    tma = int(os.environ.get(TMA_ENV, "1") != "0" and bs % 8 == 0 and rrow in (32, 64, 128))
    # At 64 heads four L slots (kv8: all that fit): tq4 with six ran 0.193 ms at 16 x 32k
    # against 0.186 with four (ptxas spilled in the step loop).
    return [WgShape(_WG_TIER[tier.kind], hn, dl, dr, nslot, cvt, tma, bs, tuning)
            for nslot in ((4, 3) if hn == 64 else (5, 4, 3))]  # (mbarriers: 2 (NSLOT + NR) <= 16)


@dataclass(frozen=True)
class _Choice:
    """The kernel that attends for one tier, head count, widths and block size here."""
    shape: Shape | WgShape | None  # None: no kernel fits (the CPU path)
    groups: int = 0
    fallbacks: tuple = ()  # (name, why) of each preferred kernel that did not fit
    why: str = ""          # (shape None) why not


# what a choice depends on besides its arguments: the KVFLEET_CUDA_* knobs _wg_shapes reads
_CHOICE_ENV = (WG_ENV, "KVFLEET_CUDA_KV8_CVT", TMA_ENV, "KVFLEET_CUDA_WG_TUNING")
_choices: dict[tuple, _Choice] = {}


def _choose(tier: Tier, n_heads: int, dl: int, dr: int, bs: int, skip: int = 0,
            two_ctas: bool = True) -> _Choice:
    """attn_wg where it applies and fits, else attention.cu's best tile that fits, else none
    (the CPU path); the fallbacks a launch of it counts (kernel_path, ctas_per_sm and
    paged_mla_decode all choose here, so the plan matches the launch). Made once per
    arguments, device limits and knobs: paged_mla_decode asks per layer and step, and
    trying every candidate's shared memory cost as much host time as the rest of a call."""
    key = (tier, n_heads, dl, dr, bs, skip, two_ctas, _device_info(cp.cuda.Device().id),
           *map(os.environ.get, _CHOICE_ENV))
    choice = _choices.get(key)
    if choice is None:
        choice = _choices[key] = _choose_now(tier, n_heads, dl, dr, bs, skip, two_ctas)
    return choice


def _choose_now(tier: Tier, n_heads: int, dl: int, dr: int, bs: int, skip: int,
                two_ctas: bool) -> _Choice:
    why = no_kernel_reason(tier, dl, dr)
    if why is not None:
        return _Choice(None, why=why)
    missed = ()
    if not skip:
        wg = _wg_shape(tier, n_heads, dl, dr, bs)
        if wg is not None:
            return _Choice(wg[0], wg[1])
        shapes = _wg_shapes(tier, n_heads, dl, dr, bs)
        if shapes:  # (it applies: shared memory is what it lacks)
            need = min(s.shared_bytes() for s in shapes)
            missed = (("attn_wg_smem", f"attn_wg ({shapes[0].hn} heads) needs {need} bytes of "
                       f"shared memory per block, this GPU allows "
                       f"{_device_info(cp.cuda.Device().id)[2]}: attention.cu runs"),)
    shape, groups, smaller = _shape(tier, n_heads, dl, dr, skip, two_ctas)
    if smaller:
        missed += (("attn_split_smem", smaller),)
    return _Choice(shape, groups, missed)


def kernel_path(tier: Tier | str, n_heads: int, kv_lora: int, rope: int,
                block_size: int = 16) -> str:
    """Which kernel attends for these parameters: 'wgmma' (attention_sm90.cu), 'mma'
    (attention.cu) or 'cpu' (no CUDA kernel: callers fall back)."""
    shape = _choose(get_tier(tier), n_heads, kv_lora, rope, block_size).shape
    return "cpu" if shape is None else "wgmma" if isinstance(shape, WgShape) else "mma"


def ctas_per_sm(tier: Tier | str, n_heads: int, kv_lora: int, rope: int,
                block_size: int = 16) -> int:
    """CTAs per SM of the kernel for this tier and head count (for decode_plan)."""
    shape = _choose(get_tier(tier), n_heads, kv_lora, rope, block_size).shape
    return shape.minb if isinstance(shape, Shape) else 1


def head_groups(tier: Tier | str, n_heads: int, kv_lora: int, rope: int,
                block_size: int = 16) -> int:
    """CTAs per work item of the kernel for this tier and head count: its groups of heads
    (2 for 128 heads on attn_wg's 64; for decode_plan). 1 where no kernel fits."""
    return max(1, _choose(get_tier(tier), n_heads, kv_lora, rope, block_size).groups)


class _Kernels:
    """The three compiled functions of one Shape, shared memory limit set once."""

    def __init__(self, shape: Shape):
        d = shape.defines
        self.qprep = kernel("attention.cu", "attn_qprep", **d)
        self.split = kernel("attention.cu", "attn_split", **d)
        self.combine = kernel("attention.cu", "attn_combine", **d)
        self.smem = shape.shared_bytes()
        self.split.max_dynamic_shared_size_bytes = self.smem


@functools.lru_cache(maxsize=None)
def _kernels(shape: Shape, device: int) -> _Kernels:
    return _Kernels(shape)


@dataclass(frozen=True)
class DecodePlan:
    """Work items (query, table row, t0, t1) on the device and each query's range of them."""
    work: cp.ndarray    # [W, 4] int32
    splits: cp.ndarray  # [N + 1] int32
    n_queries: int
    n_work: int
    chunk: int
    max_row: int   # largest block-table row used (checked against the table)
    max_keys: int  # longest key range (checked against the table's capacity)
    cluster: int = 1  # largest power of two <= 8 that divides every query's work-item count
                      # (so aligned runs of that many items belong to one query)


def decode_plan(rows, positions, n_sm: int | None = None, ctas_per_sm: int = 1,
                head_groups: int = 1) -> DecodePlan:
    """Split every query's keys 0..positions[i] into chunks so that about one wave of CTAs
    (n_sm * ctas_per_sm; see ctas_per_sm()) covers the step, each work item taking
    head_groups CTAs (see head_groups()). rows, positions: host int arrays [N]."""
    if head_groups < 1:
        raise ValueError(f"head_groups {head_groups}: at least 1")
    rows = np.asarray(rows, np.int64)
    pos = np.asarray(positions, np.int64)
    if rows.shape != pos.shape or rows.ndim != 1:
        raise ValueError(f"rows {rows.shape} and positions {pos.shape} must be equal 1-d shapes")
    if rows.size and rows.min() < -1:
        raise ValueError(f"table row {int(rows.min())}: rows are >= 0, or -1 for a padding query")
    n_keys = np.where(rows < 0, 0, np.maximum(pos + 1, 0))  # (a padding row reads no table row)
    total = int(n_keys.sum())
    if n_sm is None:
        n_sm = _device_info(cp.cuda.Device().id)[3]
    n_sm = max(1, n_sm * ctas_per_sm // head_groups)  # work items in one wave
    # One CTA per SM: the smallest multiple of 64 (every tile size divides it) whose work
    # items fit in one wave, so no second wave runs a handful of stragglers.
    chunk = -(-max(MIN_CHUNK, -(-max(total, 1) // n_sm)) // 64) * 64
    while chunk < int(n_keys.max(initial=0)) and int((-(-n_keys // chunk)).sum()) > n_sm:
        chunk += 64
    counts = -(-n_keys // chunk)
    splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    W = int(splits[-1])
    q = np.repeat(np.arange(len(pos)), counts)
    j = np.arange(W) - splits[:-1][q] if W else np.zeros(0, np.int64)
    t0 = j * chunk
    work = np.stack([q, rows[q], t0, np.minimum(t0 + chunk, n_keys[q])], axis=1).astype(np.int32)
    cluster = 8
    while cluster > 1 and np.any(counts % cluster):
        cluster //= 2
    return DecodePlan(cp.asarray(work.reshape(-1, 4)), cp.asarray(splits), len(pos), W, chunk,
                      int(rows[n_keys > 0].max(initial=-1)), int(n_keys.max(initial=0)),
                      cluster)


@functools.lru_cache(maxsize=None)
def _tq_lut(device: int) -> cp.ndarray:
    """[256] uint32: the byte's two codebook levels as f16, low nibble in the low half."""
    h = tq4_ref.PAIR_LEVELS.astype(np.float16).view(np.uint16).astype(np.uint32)
    return cp.asarray(h[:, 0] | (h[:, 1] << 16))


def _check(name: str, a, dtype, shape: tuple) -> None:
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"{name} must be a cupy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _flash_decode(ks, hpad: int, planes, tables, plan, q_lat, q_rope, scale: float,
                  out: cp.ndarray, split, prep: bool = True) -> None:
    """attn_qprep -> split -> attn_combine (attention.cu's qprep and combine, whichever
    kernel splits the context): split(qh, qscale, o_part, ml_part, lut, nb, bs) launches
    the split kernel over plan.work when there is any (prep False: a split kernel that makes
    its own f16 queries, given qh = qscale = None)."""
    N, H, dl = q_lat.shape
    dr = q_rope.shape[2]
    lut = _tq_lut(cp.cuda.Device().id)  # (uploaded on first use: before qprep, so that the
    qh = qscale = None                   # split kernel follows qprep directly)
    if prep:
        qh = cp.empty((N, hpad, dl + dr), cp.uint16)
        qscale = cp.empty((N, hpad), cp.float32)
        ks.qprep((N, hpad), (128,), (q_lat, q_rope, qh, qscale, np.int32(H), np.int32(hpad),
                                     np.float32(scale * LOG2E)))
    W = plan.n_work
    o_part = cp.empty((max(W, 1), hpad, dl), cp.float32)
    ml_part = cp.empty((max(W, 1), hpad, 2), cp.float32)
    if W:
        split(qh, qscale, o_part, ml_part, lut, np.int32(tables.shape[1]),
              np.int32(planes.l_scale.shape[1]))
    _launch_kernel(ks.combine, (N, H), (128,), (o_part, ml_part, plan.splits, out, np.int32(H),
                                                 np.int32(hpad)), dependent=True)


def _launch(tier: Tier, shape: Shape, groups: int, planes, tables, plan, q_lat, q_rope,
            scale: float, out: cp.ndarray) -> None:
    ks = _kernels(shape, cp.cuda.Device().id)

    def split(qh, qscale, o_part, ml_part, lut, nb, bs):
        ks.split((plan.n_work, groups), (256,), (
            qh, qscale, planes.l_codes, planes.l_scale, planes.r_codes, planes.r_scale, tables,
            nb, bs, plan.work, lut, o_part, ml_part, np.int32(o_part.shape[1])),
            shared_mem=ks.smem)

    _flash_decode(ks, groups * 16 * shape.mt, planes, tables, plan, q_lat, q_rope, scale, out,
                  split)


class _WgKernel:
    """attn_wg of one WgShape, compiled for sm_90a, shared memory limit set once."""

    def __init__(self, shape: WgShape):
        self.fn = arch_kernel("attention_sm90.cu", "attn_wg", "sm_90a", **shape.defines)
        self.smem = shape.shared_bytes()
        self.reads_qh = not shape.defines["QF"]  # (attn_qprep's qh and qscale)
        set_dynamic_smem(self.fn, self.smem)


@functools.lru_cache(maxsize=None)
def _wg_kernel(shape: WgShape, device: int) -> _WgKernel:
    return _WgKernel(shape)


def _encode_tensor_map(ptr: int, dims: tuple, strides: tuple, box: tuple,
                       swizzle: int) -> bytes:
    """A CUtensorMap (128 bytes) over uint8 data at device address ptr (the driver's
    cuTensorMapEncodeTiled): dims innermost first (dims[0] bytes, stride 1), strides in bytes
    of dims[1:], box the extent copied along each dim, swizzle 1 / 2 / 3 = 32 / 64 / 128 bytes."""
    import ctypes
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    raw = ctypes.create_string_buffer(128 + 64)
    at = -(-ctypes.addressof(raw) // 64) * 64  # the map is 64-byte aligned
    u64, u32, n = ctypes.c_uint64, ctypes.c_uint32, len(dims)
    err = fn(ctypes.c_void_p(at), 0, n, ctypes.c_void_p(ptr),  # UINT8
             (u64 * n)(*dims), (u64 * (n - 1))(*strides), (u32 * n)(*box),
             (u32 * n)(*([1] * n)), 0, swizzle, 2, 0)  # no interleave, L2 promotion 128 B, no OOB fill
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for dims {dims}, strides "
                           f"{strides}, box {box}, swizzle {swizzle}")
    return ctypes.string_at(at, 128)


TMA_SWIZZLE = {32: 1, 64: 2, 128: 3}  # row bytes -> CU_TENSOR_MAP_SWIZZLE_32B / 64B / 128B


# (more entries than layers x pools: layers are visited in a cycle, and an LRU smaller than
# the cycle misses every time; an entry is a 256-byte device array)
@functools.lru_cache(maxsize=4096)
def _tma_maps_at(l_ptr: int, r_ptr: int, rows: int, lrow: int, rrow: int, bs: int,
                 device: int) -> cp.ndarray:
    # L: (byte in a 128-byte column block, row, column block): one box is a whole pool block,
    # laid out in shared memory as [column block][row][128 B] under the 128-byte swizzle
    maps = _encode_tensor_map(l_ptr, (128, rows, lrow // 128), (lrow, 128),
                              (128, bs, lrow // 128), 3) + \
        _encode_tensor_map(r_ptr, (rrow, rows), (rrow,), (rrow, bs), TMA_SWIZZLE[rrow])
    return cp.asarray(np.frombuffer(maps, np.uint8))


def tma_maps(planes) -> cp.ndarray:
    """Device copy of the tensor maps attn_wg's TMA path reads (L codes of a pool block as
    one 3-D box, R codes as bs-row boxes), cached per plane address and shape."""
    nblk, bs, lrow = planes.l_codes.shape
    return _tma_maps_at(planes.l_codes.data.ptr, planes.r_codes.data.ptr, nblk * bs, lrow,
                        planes.r_codes.shape[2], bs, cp.cuda.Device().id)


def _without_tma(shape: WgShape) -> WgShape:
    """The cp.async variant of a TMA shape, with as many slots as still fit."""
    limit = _device_info(cp.cuda.Device().id)[2]
    for nslot in range(shape.nslot, 2, -1):
        out = replace(shape, tma=0, nslot=nslot)
        if out.shared_bytes() <= limit:
            return out
    raise RuntimeError(f"no cp.async variant of {shape} fits {limit} bytes of shared memory")


def wg_query_args(wg, q_lat, q_rope, scale: float, qh=None, qscale=None) -> tuple:
    """attn_wg's first arguments: attn_qprep's qh / qscale (null where wg makes its own f16
    queries), the f32 queries, their head count and the softmax scale in base 2."""
    null = np.uint64(0)
    return (null if qh is None else qh, null if qscale is None else qscale, q_lat, q_rope,
            np.int32(q_lat.shape[1]), np.float32(scale * LOG2E))


def _wg_cluster(shape: WgShape, groups: int, plan, device: int) -> WgShape:
    """shape with the largest cluster (CL) the plan allows (plan.cluster: aligned runs of
    work items of one query) whose clusters all fit on the GPU at once (the driver's
    cuOccupancyMaxActiveClusters; a cluster's CTAs need SMs of one GPC), so the grid stays
    one wave. KVFLEET_CUDA_WG_TUNING=CL=1 turns clusters off, CL=n caps them at n."""
    return _cluster_shape(shape, groups, plan.cluster, plan.n_work, device)


@functools.lru_cache(maxsize=256)
def _cluster_shape(shape: WgShape, groups: int, cluster: int, n_work: int,
                   device: int) -> WgShape:
    # (once per shape and plan size, not per layer; at 16 heads, where Q^T is 18 KB, clusters
    # of 2 ran 0.4-1.6 % slower: by default 64 heads only; a tuning CL=n sets the cap at any
    # head count, rounded down to 1, 2, 4, 8)
    cap = max(1, min(8, dict(shape.tuning).get("CL", 8 if shape.hn == 64 else 1)))
    cl = 1 << (min(cluster, cap).bit_length() - 1) if n_work else 1
    while cl > 1:
        wg = _wg_kernel(replace(shape, cl=cl), device)
        try:
            most = max_active_clusters(wg.fn, cl, WG_THREADS, wg.smem)
        except RuntimeError as e:  # (counted and logged; the kernel runs unclustered)
            _count_fallback("attn_wg_clusters", f"cuOccupancyMaxActiveClusters failed: {e}")
            return replace(shape, cl=1)
        if n_work * groups <= cl * most:
            break
        cl //= 2
    return replace(shape, cl=cl)


def launch_wg(wg: _WgKernel, groups: int, planes, tables, plan, query_args: tuple, lut, maps,
              o_part: cp.ndarray, ml_part: cp.ndarray, after_qprep: bool = False) -> None:
    """attn_wg over plan.work: query_args from wg_query_args(), maps from tma_maps() (any
    array without the TMA), o_part [>= W, Hpad, DL] and ml_part [W, Hpad, 2]. after_qprep:
    the last work on this stream is the attn_qprep that makes qh, launched plainly (so all
    work before it has ended; _flash_decode uploads the LUT and _launch_wg the tensor maps
    before it): attn_wg is then launched as its programmatic dependent and starts copying
    the cache while qprep runs (where _pdl_enabled)."""
    _launch_kernel(wg.fn, (plan.n_work, groups), (WG_THREADS,), (
        *query_args, planes.l_codes, planes.l_scale, planes.r_codes, planes.r_scale, tables,
        np.int32(tables.shape[1]), np.int32(planes.l_scale.shape[1]), plan.work, lut, maps,
        o_part, ml_part, np.int32(o_part.shape[1])), wg.smem, dependent=after_qprep and wg.reads_qh)


def _launch_wg(shape: WgShape, groups: int, planes, tables, plan, q_lat, q_rope,
               scale: float, out: cp.ndarray) -> None:
    dev = cp.cuda.Device().id
    # attn_combine (and attn_qprep) of attention.cu depend only on TIER, DL and DR
    ks = _kernels(Shape(shape.tier_id, 1, 64, q_lat.shape[2], q_rope.shape[2]), dev)
    s = shape
    if s.tma and any(a.data.ptr % 16 for a in (planes.l_codes, planes.r_codes,
                                               planes.l_scale, planes.r_scale)):
        s = _without_tma(s)  # the TMA needs 16-byte aligned planes
    if groups > 1 and "EVF" not in dict(s.tuning):  # (two CTAs read each row: keep it in L2)
        s = replace(s, tuning=s.tuning + (("EVF", 0),))
    s = _wg_cluster(s, groups, plan, dev)
    wg = _wg_kernel(s, dev)
    if not wg.reads_qh and q_lat.data.ptr % 16:  # its 16-byte query loads: attn_qprep's instead
        s = replace(s, tuning=s.tuning + (("QF", 0),))
        wg = _wg_kernel(s, dev)

    maps = tma_maps(planes) if s.tma else None  # (uploaded on first use: before qprep)

    def split(qh, qscale, o_part, ml_part, lut, nb, bs):
        launch_wg(wg, groups, planes, tables, plan, wg_query_args(wg, q_lat, q_rope, scale, qh,
                                                                  qscale), lut,
                  lut if maps is None else maps, o_part, ml_part,  # (unused without the TMA)
                  after_qprep=qh is not None)

    _flash_decode(ks, groups * shape.hn, planes, tables, plan, q_lat, q_rope, scale, out, split,
                  prep=wg.reads_qh)


def paged_mla_decode(tier: Tier | str, planes, block_tables: cp.ndarray, plan: DecodePlan,
                     q_lat: cp.ndarray, q_rope: cp.ndarray, scale: float,
                     _skip: int = 0, _two_ctas: bool = True) -> cp.ndarray:
    """ctx [N, H, kv_lora] float32 for queries q_lat [N, H, kv_lora], q_rope [N, H, rope]
    over the device planes (kernels/cpu/attention.LayerPlanes of cupy arrays) through
    block_tables [S, nb] int32, as laid out by `plan` (decode_plan)."""
    tier = get_tier(tier)
    if q_lat.ndim != 3 or q_rope.ndim != 3:
        raise ValueError(f"q_lat {q_lat.shape} and q_rope {q_rope.shape} must be [N, H, D]")
    N, H, dl = q_lat.shape
    dr = q_rope.shape[2]
    why = no_kernel_reason(tier, dl, dr)
    if why is not None:
        raise ValueError(f"{tier.name}: {why} (has_kernel() is False; use the CPU path)")
    _check("q_lat", q_lat, cp.float32, (N, H, dl))
    _check("q_rope", q_rope, cp.float32, (N, H, dr))
    if plan.n_queries != N:
        raise ValueError(f"plan is for {plan.n_queries} queries, got {N}")
    n_blocks, bs = planes.l_scale.shape
    cdt = np.dtype(tier.code_dtype())
    _check("l_codes", planes.l_codes, cdt, (n_blocks, bs, tier.code_width(dl)))
    _check("r_codes", planes.r_codes, cdt, (n_blocks, bs, tier.code_width(dr)))
    _check("l_scale", planes.l_scale, cp.float32, (n_blocks, bs))
    _check("r_scale", planes.r_scale, cp.float32, (n_blocks, bs))
    _check("block_tables", block_tables, cp.int32, block_tables.shape)
    if plan.max_row >= block_tables.shape[0] or plan.max_keys > block_tables.shape[1] * bs:
        raise ValueError(f"plan reaches table row {plan.max_row} / {plan.max_keys} keys; "
                         f"block_tables {block_tables.shape} x block_size {bs} is smaller")
    out = cp.empty((N, H, dl), cp.float32)
    if not N:
        return out
    choice = _choose(tier, H, dl, dr, bs, _skip, _two_ctas)
    for name, why in choice.fallbacks:
        _count_fallback(name, why)
    if isinstance(choice.shape, WgShape):
        _launch_wg(choice.shape, choice.groups, planes, block_tables, plan, q_lat, q_rope, scale,
                   out)
    else:
        _launch(tier, choice.shape, choice.groups, planes, block_tables, plan, q_lat, q_rope,
                scale, out)
    return out
