// Paged MLA decode attention for Hopper (sm_90a): warpgroup MMA (wgmma) with the coded cache
// converted in registers, never staged as f16 in shared memory. kv8 and tq4 only; the f32
// tier and other GPUs use attention.cu. Same inputs and outputs as attention.cu's attn_split
// (its attn_combine merges the splits; its attn_qprep makes the f16 queries, or with QF each
// CTA makes the same from the f32 queries).
//
// Compile-time parameters (-D): TIER 1 kv8 / 2 tq4; HN = heads per CTA (16, 32 or 64: the
// wgmma N); DL, DR = latent and rope widths (DL == 512: two warpgroups of 256 context dims;
// DR % 32 == 0); NSLOT = 64-token half-tiles of L rows in flight, NR = of R rows (see the
// ring below); CVT (kv8) 1 = cvt.rn.f16x2.e4m3x2, 0 = integer bit moves (slower);
// SB, SW = S^T k-steps per wgmma group and groups left in flight; PW = producer warps that
// copy (1 or 2); SKIPW=4 / SKIPC=1 (timing only, results wrong): the copy pipeline alone
// (consumers only release slots) / the consumers alone (nothing copied). The other
// timing-only knobs (NOCVT, NOSMX, NOMMA, NOS, NOO) are described at their #define.
//
// The products are transposed so that the cache is the register operand A:
//   S^T[token, head] = K[token, :] . Q^T          (A = 64 tokens of K, B = Q^T in shared memory)
//   O^T[dim, head]  += V^T[dim, token] . P^T      (A = 64 dims of V over 16 tokens, B = P^T)
// so each thread loads the raw bytes it needs (kv8: 1 byte, tq4: half a byte per value; for
// S^T by ldmatrix, whose words are those of A's fragment), converts them to f16 in registers and
// feeds them to wgmma; shared memory holds the raw
// tiles, Q^T and P^T only. Every product's k axis may be permuted freely as long as A and B
// agree: the latent dims are permuted so that a thread's four k values of a step are four
// adjacent bytes (kv8) or nibbles (tq4), and Q^T is written in that order.
//
// CTA = one work item (query, table row, tokens [t0, t1)) x one group of HN heads; 384
// threads: warps 0-3 and 4-7 are two consumer warpgroups, warps 8-11 the producer's (they
// hand most of their registers to the consumers: setmaxnreg). The producer copies each
// 64-token half-tile of raw rows into two rings: its L rows into one of NSLOT slots, its R
// rows, scales and valid-token mask into one of NR entries, XOR-swizzled by token so that
// both read patterns are bank-conflict free: with TMA=1 (warp 8 the L rows, each pool block
// as one 3-D tensor-map box in the hardware swizzle; warp 9 the rest) or with TMA=0 (PW
// warps, 16-byte cp.async chunks per lane and token). Each copy signals an mbarrier; the
// consumers release an L slot through another once every warp's O^T has read it, an R entry
// as soon as its scorer has loaded the rope rows (so that two or three entries suffice and
// the room goes to L). Per step of 128 tokens, consumer warpgroup c computes S^T for half-tile
// 2*step + c (64 tokens x HN heads), both exchange the softmax numerators through P^T in
// shared memory, and each accumulates O^T for its 256 latent dims over all 128 tokens.
//
// Softmax: base 2, per-head reference max M_h in shared memory, updated lazily: a step whose
// context weights 2^(score - M_h) * sL_t / c all stay below 2^15 (in f16) uses the old M and
// the old reference L scale c; otherwise every warp publishes its maxima and the
// accumulators are rescaled (barrier.red.or decides, uniformly). Scales never touch element
// data: score = qscale_h * (sL_t q.L_t + sR_t q.R_t), computed as
// fin_t * (rho_t * (q.R_t) + q.L_t) with rho = sR/sL (the R products run first); context
// weights are p * sL_t / c, and the partial context is multiplied back by c at the end.
//
// Assumes kv8 live rows carry no NaN codes (0x7F / 0xFF): the GPU encoder never makes them
// and DevicePool.write_coded maps them to 0x00 (both decode to 0) when rows are uploaded.
//
// Code size: the step loop has to fit the SM's instruction cache, about 36 KB of SASS
// (tests/gpu/diag_icache.py: ~2300 instructions; beyond, every pass refetches it). kv8 at
// 64 heads is at 27.8 KB, tq4 at 27.9 KB (32.0 KB with LUT2=0; scripts/sm90_compile_check.py
// prints the loop's instructions); 750 never-executed instructions added to its rare rescale
// path made kv8 64 heads 10 % slower (the same code placed after the loop: no change).

#define NCW 8                // consumer warps (two warpgroups)
#define NTHREADS (32 * NCW + 128)  // + the producer warpgroup
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240    // 128 * 24 + 256 * 240 = 168 * 384: exactly the
                             // registers the CTA starts with (more and setmaxnreg.inc waits forever)
#define HT 64                // tokens per half-tile
#define DK (DL + DR)
#define KS_L (DL / 16)
#define KS_R (DR / 16)
#define NJ (HN / 8)          // 8-head groups
#ifndef CVT
#define CVT 1
#endif
#ifndef SB
#define SB 4                 // S^T k-steps per wgmma group (registers in flight: 2 groups); 4
#endif                       // beat 2 by 1-2% at 16 x 32k on the H200 once raw words came by ldmatrix
#ifndef SW
#define SW 1                 // S^T groups left in flight at each wait
#endif
#ifndef PW                   // producer warps that copy (1 or 2): two help kv8 at 16 heads
#define PW (HN == 64 ? 1 : 2)  // (0.189 -> 0.163 ms at 16 x 32k), are even at 64 heads
#endif
#ifndef SKIPC
#define SKIPC 0              // timing only (results wrong): 1 = nothing copied (consumers alone)
#endif
#ifndef SKIPW
#define SKIPW 0              // timing only (results wrong): 4 = no consumer work
#endif
#ifndef NOS
#define NOS 0                // timing only (results wrong): 1 = no S^T products / conversions
#endif
#ifndef NOO
#define NOO 0                // timing only (results wrong): 1 = no O^T products / conversions
#endif
#ifndef NOCVT
#define NOCVT 0              // timing only (results wrong): 1 = raw words fed to wgmma unconverted
#endif
#ifndef NOSMX
#define NOSMX 0              // timing only (results wrong): 1 = no exponentials (scores -> P^T)
#endif
#ifndef NOMMA
#define NOMMA 0              // timing only (results wrong): 1 = no wgmma (operands still made)
#endif
#ifndef QF                   // 1: each CTA makes its f16 queries from the f32 ones (no
#define QF (TIER == 1)       // attn_qprep launch; kv8 16 x 32k, 16 heads 0.091 -> 0.088 ms, 64
#endif                       // heads even); 0: attn_qprep's qh (tq4: its rotation, done in the
#if QF && TIER == 2          // prologue by each CTA, cost 6 % at 64 heads; not kept)
#error "QF=1 is kv8 only (tq4 queries are rotated by attn_qprep)"
#endif
#define QSTR (DK * 2 + 16)   // QF: bytes per head row staged in P^T, QNB heads a batch
#define QNB (HN * 128 * 2 / QSTR < 8 ? HN * 128 * 2 / QSTR : 8)
#ifndef SPEC                 // 1: P^T made before the rescale vote (see the softmax), 0: after
#define SPEC (TIER == 1)     // it (kv8 16 x 32k: 0.149 -> 0.145 ms at 64 heads, 0.093 -> 0.091
#endif                       // at 16; tq4 0.186 / 0.128 either way, so tq4 keeps 0: no spills)
#ifndef CL                   // CTAs per cluster (1, 2, 4 or 8), all of one query and head group
#define CL 1                 // (attention.py picks it from the plan): each makes the f16 queries
#endif                       // of HN / CL heads and stores them into every CTA's Q^T (DSMEM)
static_assert(CL == 1 || CL == 2 || CL == 4 || CL == 8, "CL: 1, 2, 4 or 8");
#ifndef EVF                  // 1: the cache's TMA copies marked L2 evict-first (the stream passes
#define EVF 1                // once, and the queries and partial contexts keep L2): H200, 16 x
#endif                       // 32k, kv8 64h 0.1460 -> 0.1452 ms, 16h 0.0878 -> 0.0866, tq4 16h
                             // 0.1266 -> 0.1232 (the policy made at each copy: one kept in a
                             // register made ptxas spill 104 bytes at tq4 64 heads)
#ifndef QFIRST               // 1: the producer's first copies wait until the consumers have
#define QFIRST QF            // issued their query loads (named barrier 7): kv8 16 x 32k 64h
#endif                       // 0.1373 -> 0.1352 ms, 16h 0.0846 -> 0.0832; tq4 (qh, half the
                             // bytes) 0.1793 -> 0.1811, so off there

#ifndef MSK                  // 1: masked rows' scores made -Inf behind a warp vote (kv8 16 x 32k
#define MSK 1                // 64h 0.1364 / 0.1367 -> 0.1344 / 0.1343 ms, 16h 0.0846 -> 0.0838;
#endif                       // tq4 was 16h 0.1233 -> 0.1246 until LUT2, with it 64h 0.1697 /
                             // 0.1716 -> 0.1694 / 0.1697, 16h 0.1168 / 0.1171 -> 0.1144 /
                             // 0.1151); 0: a select per score
#ifndef MZ                   // 1: the numerators read M with -Inf as 0 from an array of its own,
#define MZ 1                 // written beside M (2 selects a head pair less a step: kv8 16 x 32k
#endif                       // 64h 0.1341 / 0.1353 -> 0.1332 / 0.1336 ms, 16h 0.0838 -> 0.0831)
#ifndef PDLT                 // 1: every CTA lets attn_combine (a programmatic dependent, see
#define PDLT 0               // attention.py) be placed on free SMs at its start; 0: only once
#endif                       // this grid has ended (H200, kv8 64h 1 x 32k: 0.0459 ms with 1,
                             // 0.0276 with 0, 0.0278 plain; 16 x 32k even)
#ifndef PROF
#define PROF 0               // diagnostic: 1 = clock64 stamps of every step's phases, written past
#endif                       // the end of o_part (which must be twice as long: diag_wgmma.py --prof);
                             // 3 = also inside S^T and the softmax (PROF_MODE=3)

#if TIER == 1
#define LROW DL
#define RROW DR
#if CVT
#define KV8_UNIT 1.0f
#else
#define KV8_UNIT 256.0f
#endif
#else
#define LROW (DL / 2)
#define RROW (DR / 2)
#endif
#ifndef TMA
#define TMA 1                // 1: the tensor-memory-accelerator copies whole blocks (needs 16-byte
#endif                       // aligned planes, bs % 8 == 0, RROW 32 / 64 / 128); 0: cp.async per lane
#if TMA
#ifndef BS
#error "TMA=1 needs BS, the pool's block size (the rows of a box)"
#endif
static_assert(BS % 8 == 0 && HT % BS == 0, "BS: a multiple of 8 that divides the half-tile");
#define RSTR RROW            // R rows unpadded, TMA 32/64/128-byte swizzle (= RROW)
#define ALIGN1K(x) (((x) + 1023) / 1024 * 1024)
#else
#define RSTR (RROW + 16)     // padded R row: 80 (kv8) / 48 (tq4) bytes, conflict-free
#define ALIGN1K(x) (x)
#endif
#define LCH (LROW / 16)
#define RCH (RROW / 16)

// Shared memory carve-up (bytes).
// The ring is two rings: NSLOT slots of a half-tile's L rows (read by S^T and by both
// warpgroups' O^T, released after O^T) and NR (2 or 3) entries of its R rows, scales and
// valid-token mask (read at the start of S^T by the scorer alone, released right there), so
// that the L rows get the room: kv8 at 64 heads holds four half-tiles of L instead of three
// whole half-tiles.
#ifndef NR
#define NR 2                 // R entries (WgShape: 2 at 64 heads, 3 below)
#endif
#define SM_QT 0                                  // Q^T: HN x DK f16, canonical (no swizzle)
#define SM_PT (SM_QT + HN * DK * 2)              // P^T: HN x 128 f16, canonical
#define SM_RED SM_PT                             // [NCW][HN] in P^T's place: used only while no
                                                 // P^T is live (the rescale, the epilogue)
#define SM_QS (SM_PT + HN * 128 * 2)             // qscale[HN]
#define SM_M (SM_QS + HN * 4)                    // reference max M[HN]
#define SM_AL (SM_M + HN * 4)                    // rescale factors[HN]
#define SM_MZ (SM_AL + HN * 4)                   // M with -Inf as 0: the numerators' reference
#define SM_REDC (SM_MZ + HN * 4)                 // [NCW] warp max of sL, [NCW] = c
#define SM_BAR (SM_REDC + 4 * 16)                // mbarriers: fullL, emptyL [NSLOT]; fullR, emptyR [NR]
#define SM_LMK (SM_BAR + 8 * 16)                 // the valid-token mask of each L slot (u64)
#define SM_QBAR (SM_LMK + 7 * 8)                 // CL > 1: mbarrier of the other CTAs' Q^T stores
                                                 // (in the eighth mask's place: NSLOT <= 6 anyway)
#define SM_RS (SM_LMK + 8 * 8)                   // per R entry: sL[64], sR[64], the mask (u64)
#define RS_SL 0
#define RS_SR (HT * 4)
#define RS_MK (2 * HT * 4)
#define RS_BYTES (2 * HT * 4 + 16)
#define SM_LUT (SM_RS + NR * RS_BYTES)
#ifndef LUT2                 // tq4 pair table rows of 1 = 256 bytes (32 words, one per bank, then
#define LUT2 1               // 128 unused), so that one prmt makes a lookup's offset, entry << 8 |
#endif                       // lane * 4: prmt + lds; 0 = 128-byte rows, prmt + lea + lds (16 x 32k,
                             // 64h 0.1784 / 0.1804 -> 0.1706 / 0.1731 ms, 16h 0.1219 / 0.1222 ->
                             // 0.1167 / 0.1164; the 64-head loop 2003 -> 1742 instructions)
#define LUT_ROW (LUT2 ? 256 : 128)               // bytes per pair-table entry
#if TIER == 2
#define LUT_BYTES (256 * LUT_ROW)                // pair table, one copy per bank
#else
#define LUT_BYTES 0
#endif
#define SM_RR ALIGN1K(SM_LUT + LUT_BYTES)        // R entries (TMA swizzle atoms: 1024-aligned)
#define RR_BYTES ALIGN1K(HT * RSTR)
#define SM_SLOT (SM_RR + NR * RR_BYTES)          // L slots
#define SLOT_BYTES (HT * LROW)                   // (a multiple of 1024)
#define SM_TOTAL (SM_SLOT + NSLOT * SLOT_BYTES)
static_assert(2 * (NSLOT + NR) <= 16 && NSLOT <= 7, "the mbarriers and L masks fit");
static_assert(NCW * HN * 4 <= HN * 128 * 2, "the reduction scratch fits in P^T");

static_assert(DL == 512, "each consumer warpgroup's O^T covers 256 latent dims (4 x m64)");
static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 168 * NTHREADS,
              "setmaxnreg can only hand over the registers the CTA starts with (168 each)");

typedef unsigned int u32;
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)
#include "grid_dep.cuh"

__device__ __forceinline__ unsigned long long clk64() {
    unsigned long long c;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory");
    return c;
}
__device__ __forceinline__ unsigned long long gtimer() {  // ns, the same clock on every SM
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ bool bar_or(int id, int n, bool v) {
    u32 r;
    asm volatile("{\n.reg .pred pi, po;\nsetp.ne.u32 pi, %1, 0;\n"
                 "barrier.cta.red.or.pred po, %2, %3, pi;\nselp.u32 %0, 1, 0, po;\n}\n"
                 : "=r"(r) : "r"((u32)v), "r"(id), "r"(n) : "memory");
    return r != 0;
}
__device__ __forceinline__ void mbar_init(u32 a, u32 n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(a), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(a) : "memory");
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
// TMA: a box of a 2-D tensor map (generic address of the map in global memory) at
// coordinates (c0 = byte column, c1 = row); a 1-D bulk copy; both complete as transaction
// bytes on mbarrier `bar`.
__device__ __forceinline__ void tma_2d(u32 dst, u64 map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_3d(u32 dst, u64 map, int c0, int c1, int c2, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// the same with an L2 cache policy (createpolicy)
__device__ __forceinline__ void tma_3d_hint(u32 dst, u64 map, int c0, int c1, int c2, u32 bar, u64 pol) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(pol) : "memory");
}
__device__ __forceinline__ void tma_2d_hint(u32 dst, u64 map, int c0, int c1, u32 bar, u64 pol) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3}], [%4], %5;" :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(pol) : "memory");
}
__device__ __forceinline__ u64 evict_first_policy() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(u32 a, u32 bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
                 :: "r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Clusters (CL > 1): this CTA's rank, the address of the same shared-memory byte in CTA
// `rank`, 16- and 4-byte stores there, the cluster-wide barrier (every thread of every CTA
// arrives)
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 mapa(u32 addr, u32 rank) {  // (pure: the compiler may share it)
    u32 r;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// mbar_wait with acquire at cluster scope: for bytes that other CTAs' st.async completed
__device__ __forceinline__ void mbar_wait_cluster(u32 a, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(a), "r"(parity) : "memory");
}
// st.async: a store into another CTA's shared memory that completes as transaction bytes on
// that CTA's mbarrier `bar` (its address there)
__device__ __forceinline__ void st_async_v4(u32 addr, u32 a, u32 b, u32 c, u32 d, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d), "r"(bar) : "memory");
}
__device__ __forceinline__ void st_async_b32(u32 addr, u32 v, u32 bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(addr), "r"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {  // (no release: see the start barrier)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Shared-memory matrix descriptor, no swizzle: core matrices of 8 rows x 16 bytes; lbo =
// bytes between core matrices along k, sbo = along the 8-row (n) direction.
__device__ __forceinline__ u64 make_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32);
}
// ldmatrix: lanes 8m..8m+7 give the row addresses of 8 x 16-byte matrix m; each lane gets
// from every matrix the 4 bytes at (row lane / 4, bytes 4 (lane % 4)..): an A-fragment word.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x2(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void stsm_x4_t(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// 2^x; results below 2^-126 flush to zero (weights that small vanish in f16 and in lsum)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // (no subnormal fix-up: 3 fewer
                                                            // instructions per exponential)
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {  // (0 and subnormals -> -Inf, +Inf ->
    float y;                                           // +Inf, NaN -> NaN)
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
// Four e4m3 codes (low byte first) -> two half2: bytes 0-1 and bytes 2-3; exact (CVT=0:
// value * 2^-8, see KV8_UNIT). The halves go to the conversion as register halves: with
// cvt.u16 / shifts ptxas spends a LOP3 or SHF per conversion on extracting them.
__device__ __forceinline__ void e4m3x4(u32 w, u32& lo, u32& hi) {
#if CVT
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(w));
#else
    const u32 t0 = prmt(w, 0u, 0x1404u), t1 = prmt(w, 0u, 0x3424u);  // [0, b0, 0, b1], [0, b2, 0, b3]
    lo = (t0 & 0x80008000u) | ((t0 >> 1) & 0x3F803F80u);
    hi = (t1 & 0x80008000u) | ((t1 >> 1) & 0x3F803F80u);
#endif
}
__device__ __forceinline__ void wgmma_n16(float* d, const u32* a, u64 desc, u64 off, int accumulate) {
    asm volatile("{\n.reg .pred p;\n.reg .b64 dd;\nsetp.ne.b32 p, %14, 0;\nadd.s64 dd, %12, %13;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                 "{%8, %9, %10, %11}, dd, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "l"(off), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n32(float* d, const u32* a, u64 desc, u64 off, int accumulate) {
    asm volatile("{\n.reg .pred p;\n.reg .b64 dd;\nsetp.ne.b32 p, %22, 0;\nadd.s64 dd, %20, %21;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, dd, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "l"(off), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n64(float* d, const u32* a, u64 desc, u64 off, int accumulate) {
    asm volatile("{\n.reg .pred p;\n.reg .b64 dd;\nsetp.ne.b32 p, %38, 0;\nadd.s64 dd, %36, %37;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, dd, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "l"(off), "r"(accumulate));
}

// desc: descriptor of the operand's base; off: bytes / 16 added to its start address (inside
// the asm, so that the compiler keeps one base instead of a descriptor per k-step)
__device__ __forceinline__ void wgmma_hn(float* d, const u32* a, u64 desc, u32 off, int accumulate) {
#if NOMMA
    asm volatile("" : "+f"(d[0]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(off), "r"(accumulate));
#elif HN == 16
    wgmma_n16(d, a, desc, off, accumulate);
#elif HN == 32
    wgmma_n32(d, a, desc, off, accumulate);
#else
    wgmma_n64(d, a, desc, off, accumulate);
#endif
}

// x / y: the approximate division (2 ulp), for any y: both operands are first multiplied by
// the power of two that brings |y| into __fdividef's range (exact), by selects, not a branch
// to IEEE division (its call and branches cost ~8% of a step at kv8 64 heads); zero, Inf
// and NaN divisors give what IEEE division gives.
__device__ __forceinline__ float div_fast(float x, float y) {
    const float ay = fabsf(y);
    const float f = ay < 0x1p-100f ? 0x1p64f : (ay > 0x1p100f ? 0x1p-64f : 1.0f);
    return __fdividef(x * f, y * f);
}

// Per-row factors of the score (see the header): fin * (rho * q.R + q.L) = sL q.L + sR q.R
// A zero or negligible L scale keeps the R part exact and leaves q.L below 2^-40 of it;
// NaN / Inf L scales propagate. (Selects, not branches.)
__device__ __forceinline__ void row_factors(float sl, float sr, float& rho, float& fin) {
    const bool bad = !isfinite(sl), plain = sl > 0.0f && sl >= sr * 0x1p-40f;
    const float r = div_fast(sr, sl);  // (selected away unless plain)
    rho = bad ? 0.0f : (plain ? r : sr * 0x1p40f);
    fin = bad || plain ? sl : 0x1p-40f;
}

// Effective per-token scale of the converted values (0 for an invalid token).
__device__ __forceinline__ float eff_scale(float raw, float n) {
#if TIER == 1
    (void)n;
    return raw * KV8_UNIT;
#else
    return (raw > 0.0f && isfinite(raw)) ? raw * (1.0f / sqrtf(n)) : 0.0f;  // n: a constant
#endif
}

// Byte offset of 16-byte unit u of token t = tc + tv's L row (tc a multiple of 8, known at
// compile time in every caller; tv = 0..7) / of token t's R row within a slot's L / R region.
// cp.async (TMA=0): L rows contiguous with u's low 3 bits XORed by t & 7; R rows padded.
// TMA: L as [HT / BS pool blocks][LROW / 128 column blocks][BS tokens][128 B], the layout of
// one 3-D box per block, and R rows unpadded, both in the hardware swizzle (unit bits XORed
// by bits 7.. of the row's address, = t & 7 as BS % 8 == 0; slots 1024-aligned).
__device__ __forceinline__ int l_off2(int tc, int tv, int u) {
#if TMA
    return (tc / BS) * (BS * LROW) + (u >> 3) * (BS * 128) + (tc % BS + tv) * 128 + (((u & 7) ^ tv) << 4);
#else
    return (tc + tv) * LROW + ((u ^ tv) << 4);
#endif
}
__device__ __forceinline__ int r_off(int t, int u) {
#if TMA
    return t * RROW + ((u ^ (((t * RROW) >> 7) & (RROW / 16 - 1))) << 4);
#else
    return t * RSTR + (u << 4);
#endif
}

extern "C" __global__ void attn_wg_smem(int* out) { out[0] = SM_TOTAL; }

// grid (W, Hpad / HN), block NTHREADS, dynamic shared memory SM_TOTAL. QF=1: q_lat [N, H, DL]
// and q_rope [N, H, DR] f32 (each CTA makes its Q^T as attention.cu's attn_qprep makes qh,
// with the softmax scale times log2(e); qh / qscale unused); QF=0: qh [N, Hpad, DK] f16 bits
// and qscale [N, Hpad] from attn_qprep (the q arguments unused). Writes o_part [W, Hpad, DL]
// and ml_part [W, Hpad, 2] exactly as attention.cu's attn_split does.
#if CL > 1
#define CLUSTER_DIMS __cluster_dims__(CL, 1, 1)
#else
#define CLUSTER_DIMS
#endif
extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(NTHREADS, 1)
attn_wg(const unsigned short* qh, const float* qscale,  // (no __restrict__: see grid_dep_wait)
        const float* __restrict__ q_lat, const float* __restrict__ q_rope, int H,
        float sm_scale_log2e,
        const unsigned char* __restrict__ l_codes, const float* __restrict__ l_scale,
        const unsigned char* __restrict__ r_codes, const float* __restrict__ r_scale,
        const int* __restrict__ tables, int nb, int bs, const int* __restrict__ work,
        const u32* __restrict__ lut, const unsigned char* __restrict__ tmaps,
        float* __restrict__ o_part,
        float* __restrict__ ml_part, int Hpad) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31;
    // PROF: 4096 u64 stamps per CTA past the end of o_part: [c * 512 + step * 8 + phase] for
    // lane 0 of warp 4c, [1024 + h] the producer's issue of half-tile h, [2000..2003] start,
    // end of the prologue, end of the epilogue, the first __syncthreads passed,
    // [2004..2006] consumer 0's setmaxnreg done, its Q^T loads issued, its Q^T stores done,
    // [2007] the producer's setmaxnreg done, [2009], [2010] %globaltimer (ns, one clock for
    // all SMs) at the start and at the end of the epilogue
    unsigned long long* prof = (unsigned long long*)(o_part + (size_t)gridDim.x * Hpad * DL) +
                               ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * 4096;
    if (PROF && tid == 0) { prof[2000] = clk64(); prof[2009] = gtimer(); }
    if (PDLT) grid_dep_launch();  // attn_combine may be placed now (it waits for this grid's end)
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);  // provably warp-uniform
    const int w_id = blockIdx.x, h0 = blockIdx.y * HN;
    const int qn = work[4 * w_id], trow = work[4 * w_id + 1];
    const int t0 = work[4 * w_id + 2], t1 = work[4 * w_id + 3];
    const int nh = (t1 - t0 + HT - 1) / HT;
    const int* table = tables + (size_t)trow * nb;
    const u32 bar0 = smem_u32(smem + SM_BAR);
    auto full = [&](int s) { return bar0 + 8u * s; };               // L slot s copied
    auto empty = [&](int s) { return bar0 + 8u * (NSLOT + s); };    // L slot s read (8 warps)
    auto fullR = [&](int r) { return bar0 + 8u * (2 * NSLOT + r); };       // R entry r copied
    auto emptyR = [&](int r) { return bar0 + 8u * (2 * NSLOT + NR + r); }; // read (4 warps)
    if (tid == 0) {
        for (int s = 0; s < NSLOT; ++s) { mbar_init(full(s), TMA ? 1 : 33 * PW); mbar_init(empty(s), NCW); }
        for (int r = 0; r < NR; ++r) { mbar_init(fullR(r), TMA ? 1 : 33 * PW); mbar_init(emptyR(r), 4); }
        if (CL > 1) mbar_init(smem_u32(smem + SM_QBAR), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // Zero the ring where a slot can be read before a copy wrote it, so that a token never
    // copied reads as zeros or as an earlier real row, never as kv8 NaN codes (0 weight x NaN
    // in O^T). cp.async: rows past t1 and of missing blocks, anywhere. TMA: whole blocks are
    // copied and the kv8 scorer zeroes a half-tile's masked rows itself; what is left is the
    // slot of the missing half-tile of an odd count (its products run with zero weights),
    // never written when nh < NSLOT. tq4 codes always decode to finite values. (R rows are
    // only multiplied in S^T, where the scores of such rows are selected away.)
    {
#if TMA
        const int z0 = nh, z1 = TIER == 1 && (nh & 1) && nh < NSLOT ? nh + 1 : nh;  // slots [z0, z1)
#else
        const int z0 = 0, z1 = NSLOT;
#endif
        for (int u = tid + z0 * (SLOT_BYTES / 16); u < z1 * (SLOT_BYTES / 16); u += NTHREADS)
            ((uint4*)(smem + SM_SLOT))[u] = make_uint4(0u, 0u, 0u, 0u);
    }
    fence_async_smem();  // the zeros before any TMA write
    __syncthreads();
#if CL > 1
    // every CTA of the cluster runs, its Q^T mbarrier initialised, before any stores into
    // another's shared memory: the relaxed arrive is ordered after the init by
    // fence.mbarrier_init (a release arrive put a GPU-scope MEMBAR in every thread); what
    // this CTA's threads wrote before is ordered by __syncthreads
    cluster_arrive_relaxed();
    cluster_wait();
#endif
    if (PROF && tid == 0) prof[2003] = clk64();

    if (warp >= NCW) {
        // ---------------- producer: raw half-tiles into the ring ----------------
        // PW warps copy; the others only hand their registers over. (Whole rows per lane beat
        // coalesced 16-byte chunks per instruction, which cost a shuffle and address math per
        // chunk, and one bulk copy per row: 0.177 / 0.29 / 0.28 ms for kv8 16 x 32k alone.)
        // The next half-tile's pool rows are looked up before waiting for its slot, so the
        // table loads overlap.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
        if (PROF && tid == NCW * 32) prof[2007] = clk64();
#if TMA
        // Lane k copies block k of each half-tile (64 / BS blocks). Warp NCW copies the L rows
        // into their slots, each block as one 3-D box (128 bytes x BS rows x LROW / 128 column
        // blocks: one request per block instead of one per column block); warp NCW + 1 the R
        // rows into their entries as one 2-D box (tensor maps at tmaps, 128 bytes each) and
        // the scales as two 1-D bulk copies, so that neither ring waits for the other (in one
        // warp the L copies queued behind the R entries' releases: kv8 16h 0.098 ms). Lane 0
        // of each publishes the valid-token mask and arms its barrier with the half-tile's
        // bytes before any copy is issued.
        if (warp == NCW || warp == NCW + 1) {
            const bool lw = warp == NCW;  // the L warp (else the R warp)
            const u64 map_l = (u64)tmaps, map_r = map_l + 128;
            if (lane == 0) {
                if ((smem_u32(smem) & 1023u) || bs != BS) __trap();  // 1024-byte slots; BS = bs
                asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(map_l) : "memory");
                asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(map_r) : "memory");
            }
            __syncwarp();
            constexpr int nbk = HT / BS;
            auto block_of = [&](int h, int k) -> int {
                const int t = t0 + h * HT + k * BS;
                return h < nh && k < nbk && t < t1 ? table[t / BS] : -1;
            };
            int blk = block_of(0, lane);
            if (QFIRST) bar_sync(7, 256 + 64);  // the consumers' query loads go first
            for (int h = 0; h < nh; ++h) {
                const int slot = h % NSLOT, re = h % NR;
                const int ti = t0 + h * HT + lane;
                const bool v0 = __shfl_sync(0xffffffffu, blk, lane / BS) >= 0 && ti < t1;
                const bool v1 = __shfl_sync(0xffffffffu, blk, (lane + 32) / BS) >= 0 && ti + 32 < t1;
                const u32 m0 = __ballot_sync(0xffffffffu, v0), m1 = __ballot_sync(0xffffffffu, v1);
                const u32 nblk = __popc(__ballot_sync(0xffffffffu, blk >= 0));
                const int row = blk * BS;
                if (lw) {
                    if (h >= NSLOT) mbar_wait(empty(slot), ((h / NSLOT) - 1) & 1);
                    if (PROF && lane == 0 && h < 512) prof[1024 + h] = clk64();
                    if (lane == 0) {
                        ((uint2*)(smem + SM_LMK))[slot] = make_uint2(m0, m1);
                        mbar_arrive_tx(full(slot), SKIPC ? 0u : nblk * (u32)BS * LROW);
                    }
                    __syncwarp();
                    if (blk >= 0 && !SKIPC) {
                        const u32 dst = smem_u32(smem + SM_SLOT + slot * SLOT_BYTES + lane * BS * LROW);
                        if (EVF) tma_3d_hint(dst, map_l, 0, row, 0, full(slot), evict_first_policy());
                        else tma_3d(dst, map_l, 0, row, 0, full(slot));
                    }
                } else {
                    if (h >= NR) mbar_wait(emptyR(re), ((h / NR) - 1) & 1);
                    unsigned char* rs = smem + SM_RS + re * RS_BYTES;
                    if (lane == 0) {
                        *(uint2*)(rs + RS_MK) = make_uint2(m0, m1);
                        mbar_arrive_tx(fullR(re), SKIPC ? 0u : nblk * (u32)BS * (RROW + 8));
                    }
                    __syncwarp();
                    if (blk >= 0 && !SKIPC) {
                        const u32 dst = smem_u32(smem + SM_RR + re * RR_BYTES + lane * BS * RROW);
                        if (EVF) tma_2d_hint(dst, map_r, 0, row, fullR(re), evict_first_policy());
                        else tma_2d(dst, map_r, 0, row, fullR(re));
                        bulk_copy(smem_u32(rs + RS_SL + lane * BS * 4), l_scale + row, BS * 4, fullR(re));
                        bulk_copy(smem_u32(rs + RS_SR + lane * BS * 4), r_scale + row, BS * 4, fullR(re));
                    }
                }
                blk = block_of(h + 1, lane);
            }
        }
#else
        if (warp < NCW + PW) {
            // lane copies whole rows, 16 bytes per cp.async: tokens lane + 32 * (pw + PW * j)
            const int pw = warp - NCW;
            constexpr int TPL = 2 / PW;  // tokens per lane and half-tile
            auto lookup = [&](int h, int i) -> int {
                const int t = t0 + h * HT + i;
                if (h >= nh || t >= t1) return -1;
                const int b = table[t / bs];
                return b >= 0 ? b * bs + t % bs : -1;
            };
            auto issue_l = [&](int slot, int row, int i) {  // token i's L row
                if (row < 0 || SKIPC) return;
                const unsigned char* gl = l_codes + (size_t)row * LROW;
                const u32 dl = smem_u32(smem + SM_SLOT + slot * SLOT_BYTES + i * LROW);
#pragma unroll 4
                for (int c = 0; c < LCH; ++c) cp_async16(dl + ((c ^ (i & 7)) << 4), gl + c * 16);
            };
            auto issue_r = [&](int re, int row, int i) {  // its R row and scales
                if (row < 0 || SKIPC) return;
                const unsigned char* gr = r_codes + (size_t)row * RROW;
                const u32 dr = smem_u32(smem + SM_RR + re * RR_BYTES + i * RSTR);
#pragma unroll
                for (int c = 0; c < RCH; ++c) cp_async16(dr + c * 16, gr + c * 16);
                unsigned char* rs = smem + SM_RS + re * RS_BYTES;
                cp_async4(smem_u32(rs + RS_SL + 4 * i), l_scale + row);
                cp_async4(smem_u32(rs + RS_SR + 4 * i), r_scale + row);
            };
            int rows[TPL];
#pragma unroll
            for (int j = 0; j < TPL; ++j) rows[j] = lookup(0, lane + 32 * (pw + PW * j));
            if (QFIRST) bar_sync(7, 256 + 32 * PW);  // the consumers' query loads go first
            for (int h = 0; h < nh; ++h) {
                const int slot = h % NSLOT, re = h % NR;
                // full(slot) / fullR(re) complete after 32 cp.async arrivals and one plain
                // arrival per copying warp (fullR: its lane 0, after publishing its words of
                // the valid-token mask); a cp.async arrival counts every earlier copy of its
                // lane, so fullR also waits for the L rows
                if (h >= NSLOT) mbar_wait(empty(slot), ((h / NSLOT) - 1) & 1);
#pragma unroll
                for (int j = 0; j < TPL; ++j) issue_l(slot, rows[j], lane + 32 * (pw + PW * j));
                // (the L mask only serves the TMA path's zeroing of masked rows)
                cp_async_arrive(full(slot));
                if (lane == 0) mbar_arrive(full(slot));
                if (h >= NR) mbar_wait(emptyR(re), ((h / NR) - 1) & 1);
                unsigned char* rs = smem + SM_RS + re * RS_BYTES;
#pragma unroll
                for (int j = 0; j < TPL; ++j) {
                    const u32 m = __ballot_sync(0xffffffffu, rows[j] >= 0);
                    if (lane == 0) ((u32*)(rs + RS_MK))[pw + PW * j] = m;
                    issue_r(re, rows[j], lane + 32 * (pw + PW * j));
                }
                cp_async_arrive(fullR(re));
                if (lane == 0) mbar_arrive(fullR(re));
#pragma unroll
                for (int j = 0; j < TPL; ++j) rows[j] = lookup(h + 1, lane + 32 * (pw + PW * j));
            }
            asm volatile("cp.async.wait_all;" ::: "memory");
        }
#endif
    } else {
    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(CONSUMER_REGS));
    if (PROF && tid == 0) prof[2004] = clk64();
    const int cw = warp, wgc = cw >> 2, wi = cw & 3, g = lane >> 2, q = lane & 3;
    const int ctid = tid;  // 0..255
    float* sM = (float*)(smem + SM_M);
    float* sAL = (float*)(smem + SM_AL);
    float* sMZ = (float*)(smem + SM_MZ);
    float* sRED = (float*)(smem + SM_RED);
    float* sREDC = (float*)(smem + SM_REDC);
    const float* sQS = (const float*)(smem + SM_QS);
#if TIER == 2
    // pair table: entry b (two codes, byte k of a raw word) of this lane's bank at
    // base + b * LUT_ROW + 4 * lane
#if LUT2
    const u32 lut_base = smem_u32(smem + SM_LUT), lane4 = 4 * lane;
    auto lut_at = [&](u32 w, int k) -> u32 {  // prmt + lds
        const u32 off = prmt(w, lane4, 0x5504u | (k << 4));  // [lane * 4, byte k of w, 0, 0]
        u32 r;
        asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(lut_base + off));
        return r;
    };
#else
    const u32 lut_lane = smem_u32(smem + SM_LUT) + 4 * lane;
    auto lut_at = [&](u32 w, int k) -> u32 {  // prmt + lea + lds
        const u32 b = prmt(w, 0u, 0x4440u + k);
        u32 r;
        asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(lut_lane + (b << 7)));
        return r;
    };
#endif
#endif
    {
        // A 32-dim group grp of head h (16 words: x[c] = words 4c..4c+3) into Q^T's permuted,
        // canonical layout (u32 = two adjacent k) as four 16-byte rows of core matrices.
        // kv8: k-step s0 + j of a group holds its words 8j..8j+7, row half b the words of
        // parity b (k = 2 qd + e, see the dims' permutation); tq4: k-step s0 + a, half b the
        // words 2a + b + 4t, t = 0..3 (the pair planes of two k-steps).
        const u32 rk = CL > 1 ? cluster_rank() : 0u;  // (CL > 1: this CTA's share of the heads)
        const u32 qbar = smem_u32(smem + SM_QBAR);
        if (CL > 1 && ctid == 0) {  // the bytes the other CTAs store here (every head once)
#if QF
            int own = 0;  // (QF: the heads of batches rk, rk + CL, ... of QNB heads)
            for (int b0 = (int)rk * QNB; b0 < HN; b0 += CL * QNB) own += min(QNB, HN - b0);
            mbar_arrive_tx(qbar, (u32)(HN - own) * (DK * 2 + 4));  // Q^T rows and qscale
#else
            mbar_arrive_tx(qbar, (u32)(HN - HN / CL) * (DK * 2));
#endif
        }
        auto put_group = [&](int h, int grp, const uint4* x) {
            const int d0 = 32 * grp, dl = d0 < DL ? d0 : d0 - DL, sb = d0 < DL ? 0 : KS_L;
            unsigned char* row = smem + SM_QT + (h >> 3) * 128 + (h & 7) * 16;
            auto put = [&](int ks, int half, u32 w0, u32 w1, u32 w2, u32 w3) {
                unsigned char* at = row + (2 * ks + half) * NJ * 128;
#if CL > 1
                const u32 a = smem_u32(at);  // into every other CTA of the cluster
#pragma unroll
                for (u32 k = 1; k < CL; ++k) {
                    const u32 r = (rk + k) & (CL - 1);
                    st_async_v4(mapa(a, r), w0, w1, w2, w3, mapa(qbar, r));
                }
#endif
                *(uint4*)at = make_uint4(w0, w1, w2, w3);
            };
#if TIER == 1
            const int s0 = sb + dl / 16;
            put(s0, 0, x[0].x, x[0].z, x[1].x, x[1].z);
            put(s0, 1, x[0].y, x[0].w, x[1].y, x[1].w);
            put(s0 + 1, 0, x[2].x, x[2].z, x[3].x, x[3].z);
            put(s0 + 1, 1, x[2].y, x[2].w, x[3].y, x[3].w);
#else
            const int s0 = sb + 2 * (dl >> 5);
            put(s0, 0, x[0].x, x[1].x, x[2].x, x[3].x);
            put(s0, 1, x[0].y, x[1].y, x[2].y, x[3].y);
            put(s0 + 1, 0, x[0].z, x[1].z, x[2].z, x[3].z);
            put(s0 + 1, 1, x[0].w, x[1].w, x[2].w, x[3].w);
#endif
        };
#if QF
        // Q^T from the f32 queries, as attention.cu's attn_qprep makes qh for kv8 (the same
        // bits): per head scaled to max |q| = 1 in f16; qscale = max |q| x the softmax scale
        // x log2(e). Warp w makes head b0 + w of each batch of NB (8 at 64 heads, 7 / 3 in
        // the smaller P^T of 32 / 16): lane l holds latent dims 16l..16l+15 and rope dims
        // RPL l.., and stages the head's f16 row in P^T (rows QSTR bytes apart, 16 more than
        // a row, so that the reads below spread over the banks). Then thread (group, head)
        // puts a 32-dim group of one head into Q^T; consecutive threads take consecutive
        // heads, so that a warp's stores cover whole banks.
        constexpr int NG = DK / 32, RPL = DR / 32, NB = QNB;
        static_assert(NB >= 1 && NB * NG <= 256, "a batch of staged heads fits P^T and the threads");
        unsigned char* stg = smem + SM_PT;
        // every head of this warp loaded first, all in flight at once (one round trip)
        constexpr int NBT = (HN + NB - 1) / NB;  // batches
        constexpr int NBS = (NBT + CL - 1) / CL;  // this CTA's: batches rk, rk + CL, ...
        float xs[NBS][16], ys[NBS][RPL];
#pragma unroll
        for (int i = 0; i < NBS; ++i) {
            const int bt = (int)rk + CL * i, hg = h0 + bt * NB + cw;
            if (cw < NB && bt * NB + cw < HN && hg < H) {
                const float4* ql = (const float4*)(q_lat + ((size_t)qn * H + hg) * DL) + 4 * lane;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const float4 v = __ldg(ql + c);
                    xs[i][4 * c] = v.x; xs[i][4 * c + 1] = v.y;
                    xs[i][4 * c + 2] = v.z; xs[i][4 * c + 3] = v.w;
                }
                const float* qr = q_rope + ((size_t)qn * H + hg) * DR + RPL * lane;
#pragma unroll
                for (int e = 0; e < RPL; ++e) ys[i][e] = __ldg(qr + e);
            } else {
#pragma unroll
                for (int e = 0; e < 16; ++e) xs[i][e] = 0.0f;
#pragma unroll
                for (int e = 0; e < RPL; ++e) ys[i][e] = 0.0f;
            }
        }
        if (PROF && ctid == 0) prof[2005] = clk64();
        if (QFIRST) bar_arrive(7, 256 + 32 * (TMA ? 2 : PW));  // the producer may copy now
#pragma unroll
        for (int bi = 0; bi < NBS; ++bi) {
            const int b0 = ((int)rk + CL * bi) * NB;
            if (cw < NB && b0 + cw < HN) {
                const int hl = b0 + cw, hg = h0 + hl;
                float* x = xs[bi];
                float* y = ys[bi];
                float m = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(x[i]));
#pragma unroll
                for (int i = 0; i < RPL; ++i) m = fmaxf(m, fabsf(y[i]));
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                if (!(m > 0.0f) || isinf(m)) m = 1.0f;  // zero query; Inf / NaN propagate through q
                const float inv = 1.0f / m;
                unsigned char* srow = stg + cw * QSTR;
                uint4* sl = (uint4*)(srow + 32 * lane);
                sl[0] = make_uint4(pack_h2(x[0] * inv, x[1] * inv), pack_h2(x[2] * inv, x[3] * inv),
                                   pack_h2(x[4] * inv, x[5] * inv), pack_h2(x[6] * inv, x[7] * inv));
                sl[1] = make_uint4(pack_h2(x[8] * inv, x[9] * inv), pack_h2(x[10] * inv, x[11] * inv),
                                   pack_h2(x[12] * inv, x[13] * inv), pack_h2(x[14] * inv, x[15] * inv));
#pragma unroll
                for (int i = 0; i < RPL; ++i)
                    ((unsigned short*)(srow + 2 * DL))[RPL * lane + i] =
                        (unsigned short)(pack_h2(y[i] * inv, 0.0f) & 0xFFFFu);
                if (lane == 0) {
                    const float qs = hg < H ? m * sm_scale_log2e : 0.0f;
#if CL > 1
                    const u32 a = smem_u32(smem + SM_QS + 4 * hl);
#pragma unroll
                    for (u32 k = 1; k < CL; ++k) {
                        const u32 r = (rk + k) & (CL - 1);
                        st_async_b32(mapa(a, r), __float_as_uint(qs), mapa(qbar, r));
                    }
#endif
                    ((float*)(smem + SM_QS))[hl] = qs;
                }
            }
            bar_sync(1, 256);
            if (ctid < NB * NG && b0 + ctid % NB < HN) {
                const int grp = ctid / NB, h = b0 + ctid % NB;
                uint4 x[4];
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    x[c] = *(const uint4*)(stg + (ctid % NB) * QSTR + 64 * grp + 16 * c);
                put_group(h, grp, x);
            }
            bar_sync(1, 256);  // (the staging rows are reused by the next batch)
        }
        if (PROF && ctid == 0) prof[2006] = clk64();
        for (int h = ctid; h < HN; h += 256) { sM[h] = NEG_INF; sMZ[h] = 0.0f; }
#else
        // Q^T from attn_qprep's qh: a 32-dim group of one head (64 bytes of qh, two k-steps)
        // is four 16-byte loads, all of a thread's in flight at once, put as such (4-byte
        // cp.async per word took ~5 us per CTA at 64 heads). Consecutive threads take
        // consecutive heads of a group, so that a warp's stores cover whole banks.
        // With CL > 1 this CTA takes heads rk HS .. of them (HS = HN / CL).
        constexpr int NG = DK / 32, HS = HN / CL, NIT = (HS * NG + 255) / 256;
        const uint4* src = (const uint4*)(qh + ((size_t)qn * Hpad + h0) * DK);
        // Launched as a programmatic dependent of attn_qprep (attention.py), this grid may
        // start while qprep runs: the producer's copies (the cache, written before qprep
        // began) go ahead, the queries wait for qprep's end. qh and qscale are read after
        // this wait through plain loads (no __ldg / __restrict__: the non-coherent path is
        // outside the memory model that makes qprep's writes visible here).
        grid_dep_wait();
        uint4 v[NIT][4];
#pragma unroll
        for (int it = 0; it < NIT; ++it) {
            const int idx = ctid + 256 * it, grp = idx / HS, h = (int)rk * HS + idx % HS;
            if (idx < HS * NG)
#pragma unroll
                for (int c = 0; c < 4; ++c) v[it][c] = src[(size_t)h * (DK / 8) + 4 * grp + c];
        }
        if (PROF && ctid == 0) prof[2005] = clk64();
        if (QFIRST) bar_arrive(7, 256 + 32 * (TMA ? 2 : PW));  // the producer may copy now
#pragma unroll
        for (int it = 0; it < NIT; ++it) {
            const int idx = ctid + 256 * it, grp = idx / HS, h = (int)rk * HS + idx % HS;
            if (idx >= HS * NG) continue;
            put_group(h, grp, v[it]);
        }
        for (int h = ctid; h < HN; h += 256) {
            ((float*)(smem + SM_QS))[h] = qscale[(size_t)qn * Hpad + h0 + h];
            sM[h] = NEG_INF;
            sMZ[h] = 0.0f;
        }
        if (PROF && ctid == 0) prof[2006] = clk64();
#endif
#if TIER == 2
        {
            // the pair table, one copy per bank: thread e writes entry e's 32 copies (16-byte
            // stores, rotated by e so that a warp's stores spread over the banks)
            const u32 v = lut[ctid];
            uint4* row = (uint4*)(smem + SM_LUT) + ctid * (LUT_ROW / 16);
#pragma unroll
            for (int j = 0; j < 8; ++j) row[(j + ctid) & 7] = make_uint4(v, v, v, v);
        }
#endif
#if CL > 1
        // the other CTAs' shares of Q^T (and qscale) have landed (their bytes on qbar; no
        // cluster barrier here: its release waits for the ring's TMA copies in flight, ~5000
        // cycles at 64 heads, and a producer that took part delayed its first copy as long)
        mbar_wait_cluster(qbar, 0);
#endif
        fence_async_smem();  // Q^T (generic stores) before the wgmmas read it
        bar_sync(1, 256);
        if (PROF && ctid == 0) prof[2001] = clk64();
    }
    const u32 pt_addr = smem_u32(smem + SM_PT);
    const u64 qt_desc = make_desc(smem_u32(smem + SM_QT), NJ * 128, 128);
    const u64 pt_desc = make_desc(pt_addr, NJ * 128, 128);

    float o[4][NJ * 4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int i = 0; i < NJ * 4; ++i) o[mt][i] = 0.0f;
    float lsum[NJ * 2];
#pragma unroll
    for (int i = 0; i < NJ * 2; ++i) lsum[i] = 0.0f;
    float c_ref = 0.0f;  // reference L scale of the context weights (same in every thread)
    float lc_ref = NEG_INF;  // its log2
    const int ta = 16 * wi + g, tb = ta + 8;  // this thread's S^T rows (tokens of a half-tile)
    const int lt = 16 * wi + (lane & 7) + (lane & 8);  // the row whose address it gives ldmatrix

    auto stamp = [&](int step, int ph) {
        if (PROF && wi == 0 && lane == 0 && step < 64) prof[wgc * 512 + step * 8 + ph] = clk64();
    };
    auto stamp3 = [&](int step, int j) {  // PROF=3: sub-phases, [2048 + c * 512 + step * 8 + j]
        if (PROF == 3 && wi == 0 && lane == 0 && step < 64) prof[2048 + wgc * 512 + step * 8 + j] = clk64();
    };
    for (int step = 0; 2 * step < nh; ++step) {
        stamp(step, 0);
        if (SKIPW & 4) {  // timing only: the copy pipeline alone (consumers just release)
            for (int hs = 2 * step; hs < 2 * step + 2 && hs < nh; ++hs) {
                mbar_wait(full(hs % NSLOT), (hs / NSLOT) & 1);
                mbar_wait(fullR(hs % NR), (hs / NR) & 1);
                __syncwarp();
                if (lane == 0) mbar_arrive(empty(hs % NSLOT));
                if (lane == 0 && (hs & 1) == wgc) mbar_arrive(emptyR(hs % NR));
            }
            continue;
        }
        const int hm = 2 * step + wgc;
        const bool have = hm < nh;
        // The swizzle terms of the latent reads through an opaque move each step: otherwise
        // ptxas hoists the 8-16 swizzled offsets out of the step loop and spills them
        int lx, lk;
        asm volatile("mov.b32 %0, %1;" : "=r"(lx) : "r"((lane & 7) << 4));
        asm volatile("mov.b32 %0, %1;" : "=r"(lk) : "r"(((lane & 7) << 4) ^ (lane & 16)));
        float sacc[NJ * 4];
        bool va = false, vb = false;
        float sla = 0.0f, slb = 0.0f;
        {
            // Without a half-tile (odd count, last step) the products run on whatever the
            // slot holds (finite codes) and every score is masked: no divergent wgmma.
            const int slot = hm % NSLOT, re = hm % NR;
            const unsigned char* sp = smem + SM_SLOT + slot * SLOT_BYTES;  // L rows
            const unsigned char* rs = smem + SM_RS + re * RS_BYTES;       // scales, mask
            if (have) {
                mbar_wait(fullR(re), (hm / NR) & 1);
                stamp(step, 1);
                const u32 mw = *(const u32*)(rs + RS_MK + 4 * (ta >> 5));  // ta, tb: same word
                va = (mw >> (ta & 31)) & 1u;
                vb = (mw >> (tb & 31)) & 1u;
            }
            const float* ssl = (const float*)(rs + RS_SL);
            const float* ssr = (const float*)(rs + RS_SR);
            float sra = 0.0f, srb = 0.0f;
            if (va) { sla = eff_scale(ssl[ta], (float)DL); sra = eff_scale(ssr[ta], (float)DR); }
            if (vb) { slb = eff_scale(ssl[tb], (float)DL); srb = eff_scale(ssr[tb], (float)DR); }
            float rho_a, fin_a, rho_b, fin_b;
            row_factors(sla, sra, rho_a, fin_a);
            row_factors(slb, srb, rho_b, fin_b);
            // S^T as one chain of k-steps, SB per wgmma group: the rope part, then (once it
            // is done) the rows rescaled to the L scale, then the latent part. The raw words
            // of group gi + 1 are read before waiting for group gi - 1, so their latency
            // overlaps the products. (A second accumulator for the rope part would avoid the
            // rescale but needs 32 more registers: spills, and ptxas serialises every wgmma.)
            static_assert(KS_L % SB == 0 && SB % 2 == 0 && (TIER == 1 || SB == 2 || SB % 4 == 0),
                          "SB: divides the latent k-steps; even (kv8), 2 or a multiple of 4 (tq4)");
            // Raw words by ldmatrix (one instruction for 2 chunks of 16 bytes x 16 rows; 4
            // 32-bit loads gave the tensor cores 730 instead of 897 TFLOP/s in
            // diag_wgmma_rate): lane l gives the address of row lt (rows ta for matrices
            // 0 and 2, tb for 1 and 3) at chunk u + l / 16; w[k] = {row ta, row tb} words of
            // k-step k (kv8: chunk = k-step; tq4: chunk = two k-steps, same words).
#if TMA
            const u32 l_base = smem_u32(sp) + (lt / BS) * (BS * LROW) + (lt % BS) * 128;
#else
            const u32 l_base = smem_u32(sp) + lt * LROW;
#endif
            const u32 r_base = smem_u32(smem + SM_RR + re * RR_BYTES);
            auto l_addr = [&](int u, int x) {  // u even for x4 (x = lk), any for x2 (x = lx)
                // (the XOR in volatile asm: computed where it is used, not hoisted and spilled)
#if TMA
                const u32 c = (u >> 3) * (BS * 128), o = (u & 7) << 4;
#else
                const u32 c = 0, o = u << 4;
#endif
                u32 r;
                asm volatile("xor.b32 %0, %1, %2;" : "=r"(r) : "r"(o), "r"(x));
                return l_base + c + r;
            };
            constexpr int CPS = TIER == 1 ? 1 : 2;  // k-steps per chunk
            auto raw_g = [&](u32 (*w)[2], int gi) {  // latent group gi: k-steps gi * SB ...
                const int c0 = gi * SB / CPS;
#pragma unroll
                for (int c = 0; c < SB / CPS; c += 2) {
                    u32 r[4];
                    if (c + 1 < SB / CPS) ldsm_x4(l_addr(c0 + c, lk), r);
                    else ldsm_x2(l_addr(c0 + c, lx), r);
#pragma unroll
                    for (int e = 0; e < CPS; ++e) {
                        w[c * CPS + e][0] = r[0]; w[c * CPS + e][1] = r[1];
                        if (c + 1 < SB / CPS) { w[(c + 1) * CPS + e][0] = r[2]; w[(c + 1) * CPS + e][1] = r[3]; }
                    }
                }
            };
            auto raw_r = [&](u32 (*w)[2]) {  // rope: KS_R k-steps, RCH chunks
#pragma unroll
                for (int c = 0; c < RCH; c += 2) {
                    u32 r[4];
                    if (c + 1 < RCH) ldsm_x4(r_base + r_off(lt, c + ((lane >> 4) & 1)), r);
                    else ldsm_x2(r_base + r_off(lt, c), r);
#pragma unroll
                    for (int e = 0; e < CPS; ++e) {
                        w[c * CPS + e][0] = r[0]; w[c * CPS + e][1] = r[1];
                        if (c + 1 < RCH) { w[(c + 1) * CPS + e][0] = r[2]; w[(c + 1) * CPS + e][1] = r[3]; }
                    }
                }
            };
            auto cvt_s = [&](u32* a, const u32* w, int s) {
#if NOCVT
                (void)s;
                a[0] = w[0]; a[1] = w[1]; a[2] = w[0] >> 16; a[3] = w[1] >> 16;
#elif TIER == 1
                (void)s;
                e4m3x4(w[0], a[0], a[2]);
                e4m3x4(w[1], a[1], a[3]);
#else
                const int sh = (s & 1) * 16;  // KS_R is even: the parity of s is the plane's
                a[0] = lut_at(w[0], sh / 8);
                a[1] = lut_at(w[1], sh / 8);
                a[2] = lut_at(w[0], sh / 8 + 1);
                a[3] = lut_at(w[1], sh / 8 + 1);
#endif
            };
#if NOS
#pragma unroll
            for (int i = 0; i < NJ * 4; ++i) sacc[i] = (float)(i & 3) - 8.0f * (float)(rho_a + rho_b);
            if (have) {  // (the release, the L wait and the drain of the products as below)
                __syncwarp();
                if (lane == 0) mbar_arrive(emptyR(re));
                mbar_wait(full(slot), (hm / NSLOT) & 1);
            }
            wg_wait<0>();
            if (SPEC && step > 0) bar_arrive(5 + wgc, 256);  // (as below)
#else
            {
                // rope part: one commit group, then the rows rescaled to the L scale
                u32 wr[KS_R][2], a[KS_R][4];
                raw_r(wr);
                if (have) {  // every read of the R entry is done (rows, scales, mask)
                    __syncwarp();
                    if (lane == 0) mbar_arrive(emptyR(re));
                }
                wg_fence();
#pragma unroll
                for (int k = 0; k < KS_R; ++k) {
                    cvt_s(a[k], wr[k], k);
                    wgmma_hn(sacc, a[k], qt_desc, (KS_L + k) * 2 * NJ * 8, k > 0);
                }
                wg_commit();
            }
            if (have) mbar_wait(full(slot), (hm / NSLOT) & 1);  // the L rows
            u32 w[2][SB][2];
            raw_g(w[0], 0);
            wg_wait<0>();
            // SPEC: this warpgroup's O^T of the previous step has read P^T (the wait drained
            // it); the other warpgroup's P^T stores of this step wait for that (named barrier
            // 5 + c: arrived at here, waited for before its numerators)
            if (SPEC && step > 0) bar_arrive(5 + wgc, 256);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                sacc[4 * j] *= rho_a; sacc[4 * j + 1] *= rho_a;
                sacc[4 * j + 2] *= rho_b; sacc[4 * j + 3] *= rho_b;
            }
            stamp3(step, 0);
            // latent part: SB steps per group
#pragma unroll
            for (int gi = 0; gi < KS_L / SB; ++gi) {
                u32 a[SB][4];
#pragma unroll
                for (int u = 0; u < SB; ++u) cvt_s(a[u], w[gi & 1][u], KS_R + gi * SB + u);
                if (gi + 1 < KS_L / SB) raw_g(w[(gi + 1) & 1], gi + 1);
                wg_fence();
#pragma unroll
                for (int u = 0; u < SB; ++u)
                    wgmma_hn(sacc, a[u], qt_desc, (gi * SB + u) * 2 * NJ * 8, 1);
                wg_commit();
                wg_wait<SW>();
            }
            wg_wait<0>();
            stamp3(step, 1);
#endif
#if TMA && TIER == 1
            const uint2 mk = ((const uint2*)(smem + SM_LMK))[slot];  // (no half-tile: finite codes)
            if (have && (mk.x & mk.y) != ~0u) {
                // The TMA copies whole blocks, so tokens past t1 hold whatever the pool has
                // there (kv8 NaN codes would meet their zero weights in O^T), and tokens of
                // missing blocks stale rows: zero their L codes before P^T is published
                // (the bar_or below orders this before every warp's O^T reads). Rare: the
                // last half-tile of a work item, or a table with holes. Other warps of this
                // warpgroup may still be reading these rows for S^T: harmless, as only
                // masked rows are written and their scores are selected away (NEG_INF),
                // never multiplied.
                uint4* lz = (uint4*)sp;
                for (int u = (ctid & 127); u < HT * LROW / 16; u += 128) {
                    const int t = (u / (BS * LROW / 16)) * BS + ((u >> 3) & (BS - 1));
                    if (!(((t < 32 ? mk.x : mk.y) >> (t & 31)) & 1u)) lz[u] = make_uint4(0u, 0u, 0u, 0u);
                }
                fence_async_smem();  // before the slot's release lets the TMA write it again
            }
#endif
#if MSK
            // the masked rows' scores -Inf only where a warp has any (the last half-tile of a
            // work item, or a table with holes): 32 selects less a step elsewhere
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float2 qs = *(const float2*)(sQS + 8 * j + 2 * q);
                sacc[4 * j] *= fin_a * qs.x; sacc[4 * j + 1] *= fin_a * qs.y;
                sacc[4 * j + 2] *= fin_b * qs.x; sacc[4 * j + 3] *= fin_b * qs.y;
            }
            if (!__all_sync(0xffffffffu, va & vb))
#pragma unroll
                for (int i = 0; i < NJ * 4; ++i) sacc[i] = ((i & 2) ? vb : va) ? sacc[i] : NEG_INF;
#else
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float2 qs = *(const float2*)(sQS + 8 * j + 2 * q);
                sacc[4 * j] = va ? sacc[4 * j] * fin_a * qs.x : NEG_INF;
                sacc[4 * j + 1] = va ? sacc[4 * j + 1] * fin_a * qs.y : NEG_INF;
                sacc[4 * j + 2] = vb ? sacc[4 * j + 2] * fin_b * qs.x : NEG_INF;
                sacc[4 * j + 3] = vb ? sacc[4 * j + 3] * fin_b * qs.y : NEG_INF;
            }
#endif
        }

        stamp(step, 2);
        // ---- softmax: lazy reference max ----
        // (no short-circuit operators: ptxas made a divergent branch of every || here, which
        // cost ~5% of a step at kv8 64 heads)
        float over = NEG_INF;  // the largest margin of a score over its head's reference max
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float2 m = *(const float2*)(sM + 8 * j + 2 * q);
            over = fmaxf(over, fmaxf(fmaxf(sacc[4 * j], sacc[4 * j + 2]) - m.x,
                                     fmaxf(sacc[4 * j + 1], sacc[4 * j + 3]) - m.y));
        }
        // The largest weight p * sL / c this step would make with the old M and c is at most
        // 2^(over + log2(max sL / c)) (the two rows' larger scale for both: conservative); it
        // must stay below 2^15 in f16 (65504 < 2^16). One bound on both factors: with p < 2^8
        // and sL < 128 c apart, 11 % of the later steps rescaled at kv8 64 heads (bench
        // data), now 0.6 % (16 x 32k 0.1440 -> 0.1391 ms). lw is -64 while c is 0 and no row
        // has a scale (a first step still moves M: over is +Inf while M is -Inf).
        // (lw > 64 flags too: sL / c itself, formed before the product, stays finite; only
        // scale ratios beyond 2^64, which the encoders never make, take it. Scales below
        // 2^-126 count as 2^-126: lg2.approx.ftz would make a subnormal one -Inf.)
        const float lm = fmaxf(va ? sla : 0.0f, vb ? slb : 0.0f);
        const float lw = fmaxf(fast_log2(lm > 0.0f ? fmaxf(lm, 0x1p-126f) : lm) - lc_ref, -64.0f);
        const bool flag = (over + lw > 15.0f) | (lw > 64.0f);
        auto move_ref = [&]() {  // M and c from this step's scores; O^T and lsum follow
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float mx = fmaxf(sacc[4 * j + e], sacc[4 * j + 2 + e]);
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                    if (g == 0) sRED[cw * HN + 8 * j + 2 * q + e] = mx;
                }
            float cm = fmaxf(va ? sla : 0.0f, vb ? slb : 0.0f);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
            if (lane == 0) sREDC[cw] = cm;
            bar_sync(3, 256);
            if (ctid < HN) {
                const float mo = sM[ctid];
                float mn = mo;
#pragma unroll
                for (int w = 0; w < NCW; ++w) mn = fmaxf(mn, sRED[w * HN + ctid]);
                sAL[ctid] = mn == NEG_INF ? 1.0f : fast_exp2(mo - mn);
                sM[ctid] = mn;
                sMZ[ctid] = mn == NEG_INF ? 0.0f : mn;
            }
            if (ctid == 255) {
                float cn = c_ref;
#pragma unroll
                for (int w = 0; w < NCW; ++w) cn = fmaxf(cn, sREDC[w]);
                sREDC[NCW] = cn;
            }
            bar_sync(3, 256);
            const float cn = sREDC[NCW];
            const float cf = c_ref > 0.0f ? div_fast(c_ref, cn) : 1.0f;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float2 al = *(const float2*)(sAL + 8 * j + 2 * q);
                lsum[2 * j] *= al.x;
                lsum[2 * j + 1] *= al.y;
                const float f0 = al.x * cf, f1 = al.y * cf;
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    o[mt][4 * j] *= f0; o[mt][4 * j + 2] *= f0;
                    o[mt][4 * j + 1] *= f1; o[mt][4 * j + 3] *= f1;
                }
            }
            c_ref = cn;
            lc_ref = fast_log2(cn);
        };
        // ---- numerators -> P^T (f16, weights p * sL / c; zeros without a half-tile) ----
        auto numerators = [&](float* ls) {  // (ls: lsum, or its copy)
            const float inv_c = c_ref > 0.0f ? div_fast(1.0f, c_ref) : 0.0f;
            const float wfa = va ? sla * inv_c : 0.0f, wfb = vb ? slb * inv_c : 0.0f;
            u32 pr[NJ][2];
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#if MZ
                const float2 m = *(const float2*)(sMZ + 8 * j + 2 * q);
#else
                float2 m = *(const float2*)(sM + 8 * j + 2 * q);
                m.x = m.x == NEG_INF ? 0.0f : m.x;
                m.y = m.y == NEG_INF ? 0.0f : m.y;
#endif
#if NOSMX
                const float p0 = sacc[4 * j] - m.x, p1 = sacc[4 * j + 1] - m.y;
                const float p2 = sacc[4 * j + 2] - m.x, p3 = sacc[4 * j + 3] - m.y;
#else
                const float p0 = fast_exp2(sacc[4 * j] - m.x), p1 = fast_exp2(sacc[4 * j + 1] - m.y);
                const float p2 = fast_exp2(sacc[4 * j + 2] - m.x), p3 = fast_exp2(sacc[4 * j + 3] - m.y);
#endif
                ls[2 * j] += p0 + p2;
                ls[2 * j + 1] += p1 + p3;
                pr[j][0] = pack_h2(p0 * wfa, p1 * wfa);
                pr[j][1] = pack_h2(p2 * wfb, p3 * wfb);
            }
            const int m4 = lane >> 3, k8 = lane & 7;
#pragma unroll
            for (int jp = 0; jp < NJ / 2; ++jp) {
                const int jj = 2 * jp + (m4 >> 1), r = m4 & 1;
                const u32 addr = pt_addr + (((8 * wgc + 2 * wi + r) * NJ + jj) * 8 + k8) * 16;
                stsm_x4_t(addr, pr[2 * jp][0], pr[2 * jp][1], pr[2 * jp + 1][0], pr[2 * jp + 1][1]);
            }
        };
#if SPEC
        // P^T made with the current M and c before the vote, whose barrier then also
        // publishes it: one full barrier a step instead of two. A step that moves M or c (rare)
        // makes it again (lsum's share of it is kept apart until the vote).
        float lsp[NJ * 2];
#pragma unroll
        for (int i = 0; i < NJ * 2; ++i) lsp[i] = lsum[i];
        // (both warpgroups' O^T of the previous step read the whole of P^T: the other one
        // must be done with it before these stores; the vote used to order them)
        if (step > 0) bar_sync(5 + (wgc ^ 1), 256);
        numerators(lsp);
        fence_async_smem();
        stamp3(step, 2);
        const bool rescale = bar_or(2, 256, flag);
        stamp(step, 3);
        if (PROF == 3 && wi == 0 && lane == 0 && step < 64) prof[2048 + wgc * 512 + step * 8 + 4] = rescale;
        if (rescale) {  // (sRED, in P^T, is written only after every warp's P^T stores)
            move_ref();
            numerators(lsum);
            fence_async_smem();
            bar_sync(4, 256);
        } else {
#pragma unroll
            for (int i = 0; i < NJ * 2; ++i) lsum[i] = lsp[i];
        }
        stamp3(step, 3);
#else
        stamp3(step, 2);
        const bool rescale = bar_or(2, 256, flag);
        stamp(step, 3);
        if (rescale) move_ref();
        numerators(lsum);
        fence_async_smem();
        stamp3(step, 3);
        bar_sync(4, 256);
#endif
        stamp(step, 4);

        // ---- O^T += V^T P^T over the step's tokens: this warpgroup's 256 latent dims ----
        // 8 groups of 16 tokens; group kk + 1's raw words are read before waiting for group
        // kk - 1. A missing half-tile (odd count) has zero weights in P^T: no divergent wgmma;
        // its slot holds finite codes (rows a scorer zeroed, real rows, or the initial zeros).
#if TIER == 1
        typedef uint2 OW;
        const int oc = 16 * wgc + 4 * wi + (g >> 1), ooff = (g & 1) * 8;
#else
        typedef u32 OW;
        const int oc = 8 * wgc + 2 * wi + (g >> 2), ooff = (g & 3) * 4;
#endif
        // this thread's two row offsets (tokens 2q, 2q + 1 of every 8; the rest is constant),
        // through an opaque move so that ptxas keeps two registers instead of one per load
        int ov[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
            asm volatile("mov.b32 %0, %1;" : "=r"(ov[e]) : "r"(l_off2(0, 2 * q + e, oc) + ooff));
        auto raw_o = [&](OW* X, int kk) {
            const int hs = 2 * step + (kk >> 2);
            if ((kk & 3) == 0 && hs != hm && hs < nh) mbar_wait(full(hs % NSLOT), (hs / NSLOT) & 1);
            const unsigned char* sp = smem + SM_SLOT + (hs % NSLOT) * SLOT_BYTES;
#pragma unroll
            for (int i = 0; i < 4; ++i)  // l_off2(tc, tv, u) = l_off2(tc, 0, 0) + l_off2(0, tv, u)
                X[i] = *(const OW*)(sp + l_off2(16 * (kk & 3) + 8 * (i >> 1), 0, 0) + ov[i & 1]);
        };
        auto cvt_o = [&](u32 (*a)[4], const OW* X) {
#if NOCVT && TIER == 1
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                a[mt][0] = mt < 2 ? X[0].x : X[0].y; a[mt][1] = mt < 2 ? X[1].x : X[1].y;
                a[mt][2] = mt < 2 ? X[2].x : X[2].y; a[mt][3] = mt < 2 ? X[3].x : X[3].y;
            }
#elif NOCVT
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                a[mt][0] = X[0] >> mt; a[mt][1] = X[1] >> mt; a[mt][2] = X[2] >> mt; a[mt][3] = X[3] >> mt;
            }
#elif TIER == 1
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                const int b = 2 * (mt & 1);
                const u32 sel = b | ((4 + b) << 4) | ((b + 1) << 8) | ((5 + b) << 12);
                const u32 p01 = mt < 2 ? prmt(X[0].x, X[1].x, sel) : prmt(X[0].y, X[1].y, sel);
                const u32 p23 = mt < 2 ? prmt(X[2].x, X[3].x, sel) : prmt(X[2].y, X[3].y, sel);
                e4m3x4(p01, a[mt][0], a[mt][1]);
                e4m3x4(p23, a[mt][2], a[mt][3]);
            }
#else
            const u32 ev01 = (X[0] & 0x0F0F0F0Fu) | ((X[1] << 4) & 0xF0F0F0F0u);
            const u32 od01 = ((X[0] >> 4) & 0x0F0F0F0Fu) | (X[1] & 0xF0F0F0F0u);
            const u32 ev23 = (X[2] & 0x0F0F0F0Fu) | ((X[3] << 4) & 0xF0F0F0F0u);
            const u32 od23 = ((X[2] >> 4) & 0x0F0F0F0Fu) | (X[3] & 0xF0F0F0F0u);
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                a[mt][0] = lut_at(ev01, mt);
                a[mt][1] = lut_at(od01, mt);
                a[mt][2] = lut_at(ev23, mt);
                a[mt][3] = lut_at(od23, mt);
            }
#endif
        };
        OW X[2][4];
#if NOO
        for (int hs = 2 * step; hs < 2 * step + 2 && hs < nh; ++hs) {
            if (hs != hm) mbar_wait(full(hs % NSLOT), (hs / NSLOT) & 1);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty(hs % NSLOT));
        }
        continue;
#endif
        raw_o(X[0], 0);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            u32 a[4][4];
            cvt_o(a, X[kk & 1]);
            const int hs = 2 * step + (kk >> 2);
            if ((kk & 3) == 3 && hs < nh) {  // every read of this half-tile is done
                __syncwarp();
                if (lane == 0) mbar_arrive(empty(hs % NSLOT));
            }
            if (kk + 1 < 8) raw_o(X[(kk + 1) & 1], kk + 1);
            wg_fence();
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) wgmma_hn(o[mt], a[mt], pt_desc, kk * 2 * NJ * 8, 1);
            wg_commit();
            wg_wait<1>();
        }
        stamp(step, 5);
    }
    wg_wait<0>();

    // ---- epilogue: (max, sum) per head, partial context * c ----
#pragma unroll
    for (int i = 0; i < NJ * 2; ++i) {
        float v = lsum[i];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        lsum[i] = v;
    }
    bar_sync(3, 256);
    if (g == 0)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            sRED[cw * HN + 8 * j + 2 * q] = lsum[2 * j];
            sRED[cw * HN + 8 * j + 2 * q + 1] = lsum[2 * j + 1];
        }
    bar_sync(3, 256);
    if (ctid < HN) {
        float l = 0.0f;
#pragma unroll
        for (int w = 0; w < NCW; ++w) l += sRED[w * HN + ctid];
        float* ml = ml_part + ((size_t)w_id * Hpad + h0 + ctid) * 2;
        ml[0] = sM[ctid];
        ml[1] = l;
    }
    // The partial context through shared memory (the Q^T region: every warp is past the last
    // S^T products): per (j, e) a warp holds 4 heads x 64 dims, lane (g, q) dims 8g..8g+7 of
    // head 8j + 2q + e; rewritten as 4 rows of 64 + 4 floats (the pad spreads the banks) and
    // stored by 8 lanes a head, so that each store instruction writes whole 32-byte sectors
    // (the direct float4 stores wrote half sectors, 16 bytes apart).
    constexpr int SROW = 64 + 4;  // floats per staged head row
    float* stg = (float*)(smem + SM_QT) + cw * (4 * SROW);
    const int hq = lane >> 3, c8 = lane & 7;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i0 = 4 * j + e, i1 = 4 * j + 2 + e;
            *(float4*)(stg + q * SROW + 8 * g) = make_float4(o[0][i0] * c_ref, o[0][i1] * c_ref, o[1][i0] * c_ref, o[1][i1] * c_ref);
            *(float4*)(stg + q * SROW + 8 * g + 4) = make_float4(o[2][i0] * c_ref, o[2][i1] * c_ref, o[3][i0] * c_ref, o[3][i1] * c_ref);
            __syncwarp();
            float* dst = o_part + ((size_t)w_id * Hpad + h0 + 8 * j + 2 * hq + e) * DL + 256 * wgc + 64 * wi;
            *(float4*)(dst + 4 * c8) = *(const float4*)(stg + hq * SROW + 4 * c8);
            *(float4*)(dst + 32 + 4 * c8) = *(const float4*)(stg + hq * SROW + 32 + 4 * c8);
            __syncwarp();
        }
    if (PROF) {
        bar_sync(3, 256);
        if (ctid == 0) { prof[2002] = clk64(); prof[2010] = gtimer(); }
    }
    }
}
