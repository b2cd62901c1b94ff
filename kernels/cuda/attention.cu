// Fused paged MLA decode attention (absorbed form) over the pool's coded planes, split over
// the context (flash-decoding): attn_qprep -> attn_split -> attn_combine.
//
// Compile-time parameters (-D): TIER 0 f32 / 1 kv8 / 2 tq4; MT = m-tiles of 16 heads per CTA
// (1..4, so up to 64 heads share one pass over the cache); BT = tokens per tile; DL, DR =
// latent and rope widths (DL % 128 == 0, DR % 16 == 0); NSTAGE = raw tiles in flight (1 to
// 3, as shared memory allows); SKIP (timing only, results wrong) leaves stages out:
// 1 the f16 conversion, 2 the score products, 4 the context products, 8 the loads.
//
// Products run on the tensor cores: mma.sync m16n8k16, f16 operands, f32 accumulate. Every
// tile of BT tokens is copied raw (cp.async) into a staging buffer while the previous tile
// computes, then converted once to f16 rows Ks[token][DL+DR] in shared memory:
//   kv8: the e4m3 byte's 7 magnitude bits shifted into an f16 (exact: value * 2^-8; the
//        2^8 goes into the per-token scale; codes 0x7F/0xFF become 0);
//   tq4: each byte -> two codebook levels through a 256-entry half2 table (levels rounded
//        to f16, 2^-11 relative); scores and context stay in the rotated domain;
//   f32: float32 -> f16 (round to nearest; |x| must stay under 65504).
// Ks is read twice: as the key (B of scores = Q Ks^T, ldmatrix) and as the value (B of
// context = P Ks[:, :DL], ldmatrix.trans), so each cached byte crosses DRAM once.
//
// Per-token scales never touch the element data: score = qscale_h * (sL_t * (q.L_t) +
// sR_t * (q.R_t)); the context weight is P_t * sL_t / c with c the running max of sL over
// the tokens seen (so the f16 weights stay in [0, 1]); the accumulator is multiplied back
// by c at the end. Queries are pre-scaled per head to max |q| = 1 in f16 (attn_qprep), with
// softmax_scale * log2(e) * max|q| in qscale, so the softmax runs in base 2.

#ifndef SKIP
#define SKIP 0
#endif
#ifndef MINB
#define MINB 1  // CTAs per SM the register allocation must allow (2: <= 128 registers)
#endif
#define NTHREADS 256
#define NWARPS 8
#define DK (DL + DR)
#define KSTR (DK + 8)       // f16 row stride of Qs / Ks: +16 bytes keeps ldmatrix conflict-free
#define PSTR (BT + 8)       // f16 row stride of Ps
#define MROWS (MT * 16)
#define TG ((NWARPS / MT) < (BT / 8) ? (NWARPS / MT) : (BT / 8))  // token groups in scores
#define SW (MT * TG)        // warps that compute scores
#define NT (BT / (8 * TG))  // n-tiles (8 tokens) per score warp
#define DW (DL / NWARPS)    // latent dims per warp in the context product
#define NC (DW / 8)         // n-tiles per warp in the context product

#if TIER == 0
#define LROW (4 * DL)
#define RROW (4 * DR)
#elif TIER == 1
#define LROW (DL)
#define RROW (DR)
#else
#define LROW (DL / 2)
#define RROW (DR / 2)
#endif
#define CH ((LROW % 16 == 0 && RROW % 16 == 0) ? 16 : ((LROW % 8 == 0 && RROW % 8 == 0) ? 8 : 4))
#define LCH (LROW / CH)
#define CPT ((LROW + RROW) / CH)  // cp.async chunks per token

typedef unsigned int u32;
#define NEG_INF __int_as_float(0xff800000)

// Shared memory carve-up (bytes); every piece is a multiple of 16.
#define SM_Q 0
#define SM_K (SM_Q + MROWS * KSTR * 2)
#define SM_P (SM_K + BT * KSTR * 2)
#define SM_STAGE (SM_P + MROWS * PSTR * 2)
#define STAGE_BYTES (((BT * (LROW + RROW) + 15) / 16) * 16)
#define SM_RAWS (SM_STAGE + NSTAGE * STAGE_BYTES)
#define SM_SSL (SM_RAWS + NSTAGE * 2 * BT * 4)
#define SM_SSR (SM_SSL + BT * 4)
#define SM_BIAS (SM_SSR + BT * 4)
#define SM_GL (SM_BIAS + BT * 4)
#define SGLR (NSTAGE + 1)  // ring of per-tile pool rows: the tile converting + the one issued
#define SM_MAX (SM_GL + SGLR * BT * 4)
#define SM_LSUM (SM_MAX + TG * MROWS * 4)
#define SM_MFIN (SM_LSUM + TG * MROWS * 4)
#define SM_LUT (SM_MFIN + MROWS * 4)
#define SM_MISC (SM_LUT + 256 * 4)
#define SM_TOTAL (SM_MISC + 16)

#include "grid_dep.cuh"

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void ldsm_x4(u32& d0, u32& d1, u32& d2, u32& d3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(u32& d0, u32& d1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(d0), "=r"(d1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32& d0, u32& d1, u32& d2, u32& d3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(u32& d0, u32& d1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(d0), "=r"(d1) : "r"(addr));
}

// c[4] += a[4] (16x16 row-major f16) * b[2] (16x8 col-major f16), f32 accumulate.
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async(u32 dst, const void* src) {
#if CH == 16
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
#elif CH == 8
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(dst), "l"(src));
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(dst), "l"(src));
#endif
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Wait until at most NSTAGE - 1 committed groups are still in flight.
__device__ __forceinline__ void cp_wait_stage() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(NSTAGE - 1) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^(m_old - m_new) for the online softmax; 0 while no key has been seen (both -inf).
__device__ __forceinline__ float rescale(float m_old, float m_new) {
    return m_new == NEG_INF ? 0.0f : fast_exp2(m_old - m_new);
}

__device__ __forceinline__ u32 f2h(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return (u32)h;
}
__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return f2h(lo) | (f2h(hi) << 16); }

// Four e4m3 bytes with the NaN codes 0x7F / 0xFF replaced by 0x00 (they decode to 0).
__device__ __forceinline__ u32 fp8x4_clean(u32 w) {
    u32 nan = (((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) >> 7;  // 1 per NaN byte
    return w & ~(nan * 0xFFu);
}
// Two e4m3 bytes (bits 0-7 and 16-23 of t) -> half2 of value * 2^-8: the 7 magnitude bits
// land in the f16 exponent/mantissa fields (bias 15 vs 7), subnormals included, exactly.
__device__ __forceinline__ u32 fp8x2_h2(u32 t) {
    return ((t & 0x007F007Fu) << 7) | ((t << 8) & 0x80008000u);
}

// One conversion unit: 8 elements of a staged row -> 8 f16 (a uint4) of a Ks row.
#define CV_UNITS (BT * (DK / 8))
#if TIER == 0
struct RawUnit { float4 a, b; };
#define UB 1
#elif TIER == 1
typedef uint2 RawUnit;
#define UB 3
#else
typedef u32 RawUnit;
#define UB 3
#endif

// Unit j (of DK / 8) of token i in a staging buffer: L units first, then R units.
__device__ __forceinline__ RawUnit load_unit(const unsigned char* st, int i, int j) {
    const unsigned char* s = j < DL / 8 ? st + i * LROW + j * (LROW / (DL / 8))
                                        : st + BT * LROW + i * RROW + (j - DL / 8) * (RROW / (DR / 8));
#if TIER == 0
    RawUnit r;
    r.a = ((const float4*)s)[0];
    r.b = ((const float4*)s)[1];
    return r;
#else
    return *(const RawUnit*)s;
#endif
}

__device__ __forceinline__ uint4 convert_unit(RawUnit w, const u32* lut) {
#if TIER == 0
    return make_uint4(pack_h2(w.a.x, w.a.y), pack_h2(w.a.z, w.a.w), pack_h2(w.b.x, w.b.y), pack_h2(w.b.z, w.b.w));
#elif TIER == 1
    u32 x = fp8x4_clean(w.x), y = fp8x4_clean(w.y);
    return make_uint4(fp8x2_h2(__byte_perm(x, 0, 0x4140)), fp8x2_h2(__byte_perm(x, 0, 0x4342)),
                      fp8x2_h2(__byte_perm(y, 0, 0x4140)), fp8x2_h2(__byte_perm(y, 0, 0x4342)));
#else
    return make_uint4(lut[w & 0xFF], lut[(w >> 8) & 0xFF], lut[(w >> 16) & 0xFF], lut[w >> 24]);
#endif
}

// ---------------------------------------------------------------------------------------

#include "sign_hash.cuh"

// Unnormalized Walsh-Hadamard transform of buf[N] in shared memory (N a power of two, at
// least 2), called by all 128 threads of the block. Index bits 0-4 are exchanged by warp
// shuffles, the bits above 6 stay within a thread, bits 5-6 go through one pass over shared
// memory: three barriers instead of one per stage (a stage-per-barrier loop made the tq4
// qprep and combine take 10 us at 16 x 64 heads). N < 128: the first min(N, 32) lanes.
template <int N>
__device__ __forceinline__ void fwht(float* buf) {
    static_assert(N >= 2 && (N & (N - 1)) == 0, "fwht: N must be a power of two");
    const int tid = threadIdx.x, lane = tid & 31;
    constexpr int R = N >= 128 ? N / 128 : N >= 32 ? N / 32 : 1;  // values per thread: index
    constexpr int ML = N < 32 ? N : 32;                             // tid + 128 r (N < 128:
    __syncthreads();                                                // lane + 32 r)
    if (N >= 128 || tid < (N < 32 ? N : 32)) {
        const int i0 = N >= 128 ? tid : lane, st = N >= 128 ? 128 : 32;
        float x[R];
#pragma unroll
        for (int r = 0; r < R; ++r) x[r] = buf[i0 + st * r];
#pragma unroll
        for (int s = 1; s < R; s <<= 1)
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (!(r & s)) {
                    const float a = x[r], b = x[r + s];
                    x[r] = a + b;
                    x[r + s] = a - b;
                }
#pragma unroll
        for (int m = 1; m < ML; m <<= 1)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float p = __shfl_xor_sync(N < 32 ? (1u << (N & 31)) - 1u : 0xffffffffu, x[r], m);
                x[r] = (lane & m) ? p - x[r] : x[r] + p;
            }
#pragma unroll
        for (int r = 0; r < R; ++r) buf[i0 + st * r] = x[r];
    }
    if (N >= 128) {
        __syncthreads();
        for (int g = tid; g < N / 4; g += 128) {  // bits 5-6: the four values 32 apart
            const int b = (g & 31) + 128 * (g >> 5);
            const float y0 = buf[b], y1 = buf[b + 32], y2 = buf[b + 64], y3 = buf[b + 96];
            const float a0 = y0 + y1, a1 = y0 - y1, a2 = y2 + y3, a3 = y2 - y3;
            buf[b] = a0 + a2;
            buf[b + 32] = a1 + a3;
            buf[b + 64] = a0 - a2;
            buf[b + 96] = a1 - a3;
        }
    }
    __syncthreads();
}

// q_lat[N, H, DL], q_rope[N, H, DR] (f32) -> qh[N, Hpad, DK] f16 bits scaled to max|q| = 1
// (tq4: rotated first, L and R separately), qscale[N, Hpad] = max|q| * sm_scale_log2e.
// grid (N, Hpad), block 128. Heads >= H get zeros.
extern "C" __global__ void __launch_bounds__(128)
attn_qprep(const float* __restrict__ q_lat, const float* __restrict__ q_rope,
           unsigned short* __restrict__ qh, float* __restrict__ qscale, int H, int Hpad,
           float sm_scale_log2e) {
    __shared__ float buf[DK];
    __shared__ float red[4];
    grid_dep_launch();  // attn_wg (tq4) may start its copies now; it waits before reading qh
    const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    unsigned short* out = qh + ((size_t)n * Hpad + h) * DK;
    if (h >= H) {
        for (int d = tid; d < DK; d += 128) out[d] = 0;
        if (tid == 0) qscale[(size_t)n * Hpad + h] = 0.0f;
        return;
    }
    const float* ql = q_lat + ((size_t)n * H + h) * DL;
    const float* qr = q_rope + ((size_t)n * H + h) * DR;
    for (int d = tid; d < DK; d += 128) {
        float v = d < DL ? ql[d] : qr[d - DL];
#if TIER == 2
        v = neg_sign(d < DL ? d : d - DL) ? -v : v;
#endif
        buf[d] = v;
    }
#if TIER == 2
    fwht<DL>(buf);
    fwht<DR>(buf + DL);
    const float il = 1.0f / sqrtf((float)DL), ir = 1.0f / sqrtf((float)DR);
    for (int d = tid; d < DK; d += 128) buf[d] *= d < DL ? il : ir;
#endif
    __syncthreads();
    float m = 0.0f;
    for (int d = tid; d < DK; d += 128) m = fmaxf(m, fabsf(buf[d]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    if (!(m > 0.0f) || isinf(m)) m = 1.0f;  // zero query; Inf/NaN propagate through q
    const float inv = 1.0f / m;
    for (int d = tid; d < DK; d += 128) out[d] = (unsigned short)f2h(buf[d] * inv);
    if (tid == 0) qscale[(size_t)n * Hpad + h] = m * sm_scale_log2e;
}

// One CTA = one work item (query, block-table row, tokens [t0, t1)) x one group of MROWS
// heads. Writes the unnormalized partial context o_part[w, Hpad, DL] and (max, sum) in
// ml_part[w, Hpad, 2] (base-2 log domain). grid (W, Hpad / MROWS), block 256,
// dynamic shared memory SM_TOTAL.
extern "C" __global__ void __launch_bounds__(NTHREADS, MINB)
attn_split(const unsigned short* __restrict__ qh, const float* __restrict__ qscale,
           const unsigned char* __restrict__ l_codes, const float* __restrict__ l_scale,
           const unsigned char* __restrict__ r_codes, const float* __restrict__ r_scale,
           const int* __restrict__ tables, int nb, int bs, const int* __restrict__ work,
           const u32* __restrict__ lut, float* __restrict__ o_part,
           float* __restrict__ ml_part, int Hpad) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* Qs = (unsigned short*)(smem + SM_Q);
    unsigned short* Ks = (unsigned short*)(smem + SM_K);
    unsigned short* Ps = (unsigned short*)(smem + SM_P);
    unsigned char* stage = smem + SM_STAGE;
    float* raws = (float*)(smem + SM_RAWS);  // [2][BT] raw L and R scales
    float* ssL = (float*)(smem + SM_SSL);
    float* ssR = (float*)(smem + SM_SSR);
    float* sbias = (float*)(smem + SM_BIAS);
    int* sgl = (int*)(smem + SM_GL);        // [SGLR][BT] flat pool row of each token, -1 = none
    float* smax = (float*)(smem + SM_MAX);  // [TG][MROWS]
    float* slsum = (float*)(smem + SM_LSUM);
    float* smfin = (float*)(smem + SM_MFIN);
    u32* slut = (u32*)(smem + SM_LUT);
    float* sctile = (float*)(smem + SM_MISC);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, q4 = lane & 3;
    const int w_id = blockIdx.x, h0 = blockIdx.y * MROWS;
    const int qn = work[4 * w_id], trow = work[4 * w_id + 1];
    const int t0 = work[4 * w_id + 2], t1 = work[4 * w_id + 3];
    const int ntiles = (t1 - t0 + BT - 1) / BT;
    const int* table = tables + (size_t)trow * nb;
    // flat pool row of token i of tile k (-1: past the range or no block)
    auto lookup = [&](int k, int i) -> int {
        int t = t0 + k * BT + i;
        if (k >= ntiles || t >= t1) return -1;
        int b = table[t / bs];
        return b >= 0 ? b * bs + t % bs : -1;
    };

    // ---- prologue: queries, codebook, rows of the first tiles ----
    int pre = -1;  // threads < BT: the row of their token NSTAGE tiles ahead, loaded early
    {
        const uint4* src = (const uint4*)(qh + ((size_t)qn * Hpad + h0) * DK);
        for (int u = tid; u < MROWS * (DK / 8); u += NTHREADS) {
            int r = u / (DK / 8), c = u % (DK / 8);
            *(uint4*)(Qs + r * KSTR + c * 8) = src[(size_t)r * (DK / 8) + c];
        }
#if TIER == 2
        for (int i = tid; i < 256; i += NTHREADS) slut[i] = lut[i];
#endif
        if (tid < BT) {
            for (int k = 0; k < NSTAGE; ++k) sgl[k * BT + tid] = lookup(k, tid);
            pre = lookup(NSTAGE, tid);
        }
    }
    __syncthreads();

    // cp.async of the rows of `tile` into staging buffer tile % NSTAGE; always commits a
    // group (empty past the end) so that cp_wait_stage counts stay uniform.
    auto issue = [&](int tile) {
        if (tile < ntiles && !(SKIP & 8)) {
            const int* gls = sgl + (tile % SGLR) * BT;
            unsigned char* st = stage + (tile % NSTAGE) * STAGE_BYTES;
            float* rw = raws + (tile % NSTAGE) * 2 * BT;
            for (int c = tid; c < BT * CPT; c += NTHREADS) {
                int i = c / CPT, j = c % CPT, gl = gls[i];
                if (gl < 0) continue;
                if (j < LCH)
                    cp_async(smem_u32(st + i * LROW + j * CH), l_codes + (size_t)gl * LROW + j * CH);
                else
                    cp_async(smem_u32(st + BT * LROW + i * RROW + (j - LCH) * CH),
                             r_codes + (size_t)gl * RROW + (j - LCH) * CH);
            }
            if (tid < BT && gls[tid] >= 0) {
                cp_async4(smem_u32(rw + tid), l_scale + gls[tid]);
                cp_async4(smem_u32(rw + BT + tid), r_scale + gls[tid]);
            }
        }
        cp_commit();
    };
    for (int k = 0; k < NSTAGE; ++k) issue(k);

    // score-warp rows (r0, r0 + 8) and their running max / partial sum
    const int mw = warp % MT, tg = warp / MT;
    const int r0 = mw * 16 + g;
    const float qs0 = qscale[(size_t)qn * Hpad + h0 + r0];
    const float qs1 = qscale[(size_t)qn * Hpad + h0 + r0 + 8];
    float m_s0 = NEG_INF, m_s1 = NEG_INF, l_s0 = 0.0f, l_s1 = 0.0f;
    // context rows (mt * 16 + g, + 8) of every thread
    float m_c[MT][2];
    float o[MT][NC][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m_c[mt][0] = m_c[mt][1] = NEG_INF;
#pragma unroll
        for (int nc = 0; nc < NC; ++nc) o[mt][nc][0] = o[mt][nc][1] = o[mt][nc][2] = o[mt][nc][3] = 0.0f;
    }
    float c_run = 1.17549435e-38f;  // running max of the L scales (FLT_MIN: never 0)

    for (int it = 0; it < ntiles; ++it) {
        const int* gls = sgl + (it % SGLR) * BT;
        const unsigned char* stage_c = stage + (it % NSTAGE) * STAGE_BYTES;
        const float* raws_c = raws + (it % NSTAGE) * 2 * BT;
        cp_wait_stage();  // this tile's rows have landed (later tiles may still be in flight)
        __syncthreads();  // ... for every thread; and the last tile's Ks / Ps are free
        // ---- convert the staged tile to f16 rows (invalid tokens -> zero rows) ----
        // UB units (8 elements each) per batch: loads first, then conversions and stores, so
        // that a thread has several shared loads in flight (8 warps alone hide little).
        if (!(SKIP & 1)) {
#pragma unroll 1
            for (int u0 = tid; u0 < CV_UNITS; u0 += UB * NTHREADS) {
                RawUnit w[UB];
                bool ok[UB];
#pragma unroll
                for (int b = 0; b < UB; ++b) {
                    int u = u0 + b * NTHREADS, i = u / (DK / 8), j = u % (DK / 8);
                    ok[b] = u < CV_UNITS && gls[i] >= 0;
                    if (ok[b]) w[b] = load_unit(stage_c, i, j);
                }
#pragma unroll
                for (int b = 0; b < UB; ++b) {
                    int u = u0 + b * NTHREADS, i = u / (DK / 8), j = u % (DK / 8);
                    if (u < CV_UNITS) *(uint4*)(Ks + i * KSTR + j * 8) = ok[b] ? convert_unit(w[b], slut) : make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        if (warp == 0) {  // per-token scales, mask bias and the tile's max L scale
            float cm = 0.0f;
            for (int i = lane; i < BT; i += 32) {
                float sl = 0.0f, sr = 0.0f, bias = NEG_INF;
                if (gls[i] >= 0) {
                    bias = 0.0f;
#if TIER == 0
                    sl = 1.0f; sr = 1.0f;
#elif TIER == 1
                    sl = raws_c[i] * 256.0f; sr = raws_c[BT + i] * 256.0f;
#else
                    float a = raws_c[i], b = raws_c[BT + i];
                    sl = (a > 0.0f && isfinite(a)) ? a / sqrtf((float)DL) : 0.0f;
                    sr = (b > 0.0f && isfinite(b)) ? b / sqrtf((float)DR) : 0.0f;
#endif
                }
                ssL[i] = sl; ssR[i] = sr; sbias[i] = bias;
                cm = fmaxf(cm, sl);
            }
            for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
            if (lane == 0) sctile[0] = cm;
        }
        if (tid < BT) sgl[((it + NSTAGE) % SGLR) * BT + tid] = pre;
        __syncthreads();
        issue(it + NSTAGE);  // overlaps with this tile's products (and the next tiles')
        if (tid < BT) pre = lookup(it + NSTAGE + 1, tid);  // consumed one tile later

        // ---- scores: warp (mw, tg) -> rows mw*16.., tokens tg*NT*8.. ----
        float s[NT][4];
        if (warp < SW) {
            float accL[NT][4], accR[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) accL[nt][e] = accR[nt][e] = 0.0f;
            const int tb = tg * NT * 8;
            const u32 qa = smem_u32(Qs + (mw * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KSTR + (lane >> 4) * 8);
            const u32 kb = NT >= 2 ? smem_u32(Ks + (tb + (lane & 7) + (lane >> 4) * 8) * KSTR + ((lane >> 3) & 1) * 8)
                                   : smem_u32(Ks + (tb + (lane & 7)) * KSTR + ((lane >> 3) & 1) * 8);
#pragma unroll 4
            for (int ks = 0; ks < DK / 16; ++ks) {
                if (SKIP & 2) break;
                u32 a[4];
                ldsm_x4(a[0], a[1], a[2], a[3], qa + ks * 32);
#pragma unroll
                for (int p = 0; p < (NT + 1) / 2; ++p) {
                    u32 b0, b1, b2, b3;
                    if constexpr (NT >= 2) {
                        ldsm_x4(b0, b1, b2, b3, kb + p * 16 * KSTR * 2 + ks * 32);
                    } else {
                        ldsm_x2(b0, b1, kb + ks * 32);
                    }
                    if (ks < DL / 16) {
                        mma16816(accL[2 * p], a, b0, b1);
                        if constexpr (NT >= 2) mma16816(accL[2 * p + 1], a, b2, b3);
                    } else {
                        mma16816(accR[2 * p], a, b0, b1);
                        if constexpr (NT >= 2) mma16816(accR[2 * p + 1], a, b2, b3);
                    }
                }
            }
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int tok = tb + nt * 8 + 2 * q4 + (e & 1);
                    float v = (e < 2 ? qs0 : qs1) * (ssL[tok] * accL[nt][e] + ssR[tok] * accR[nt][e]) + sbias[tok];
                    s[nt][e] = v;
                    if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
                }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            if (q4 == 0) { smax[tg * MROWS + r0] = mx0; smax[tg * MROWS + r0 + 8] = mx1; }
        }
        __syncthreads();

        const float c_new = fmaxf(c_run, sctile[0]);
        const float inv_c = 1.0f / c_new;
        // ---- softmax numerators -> Ps (f16), running sums ----
        if (warp < SW) {
            float mn0 = m_s0, mn1 = m_s1;
#pragma unroll
            for (int j = 0; j < TG; ++j) { mn0 = fmaxf(mn0, smax[j * MROWS + r0]); mn1 = fmaxf(mn1, smax[j * MROWS + r0 + 8]); }
            const float e0 = mn0 == NEG_INF ? 0.0f : mn0, e1 = mn1 == NEG_INF ? 0.0f : mn1;
            const int tb = tg * NT * 8;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                int tok = tb + nt * 8 + 2 * q4;
                float p0 = fast_exp2(s[nt][0] - e0), p1 = fast_exp2(s[nt][1] - e0);
                float p2 = fast_exp2(s[nt][2] - e1), p3 = fast_exp2(s[nt][3] - e1);
                sum0 += p0 + p1; sum1 += p2 + p3;
                float w0 = ssL[tok] * inv_c, w1 = ssL[tok + 1] * inv_c;
                *(u32*)(Ps + r0 * PSTR + tok) = pack_h2(p0 * w0, p1 * w1);
                *(u32*)(Ps + (r0 + 8) * PSTR + tok) = pack_h2(p2 * w0, p3 * w1);
            }
            l_s0 = l_s0 * rescale(m_s0, mn0) + sum0;
            l_s1 = l_s1 * rescale(m_s1, mn1) + sum1;
            m_s0 = mn0; m_s1 = mn1;
        }
        __syncthreads();

        // ---- context: warp -> dims warp*DW.., all MROWS rows: O = O*alpha + P Ks ----
        {
            const float cr = c_run * inv_c;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    int r = mt * 16 + g + hh * 8;
                    float mn = m_c[mt][hh];
#pragma unroll
                    for (int j = 0; j < TG; ++j) mn = fmaxf(mn, smax[j * MROWS + r]);
                    float alpha = rescale(m_c[mt][hh], mn) * cr;
                    m_c[mt][hh] = mn;
#pragma unroll
                    for (int nc = 0; nc < NC; ++nc) { o[mt][nc][2 * hh] *= alpha; o[mt][nc][2 * hh + 1] *= alpha; }
                }
            const u32 pa = smem_u32(Ps + ((lane & 7) + ((lane >> 3) & 1) * 8) * PSTR + (lane >> 4) * 8);
            const u32 vb = smem_u32(Ks + ((lane & 7) + ((lane >> 3) & 1) * 8) * KSTR + warp * DW + (lane >> 4) * 8);
#pragma unroll
            for (int ks = 0; ks < BT / 16; ++ks) {
                if (SKIP & 4) break;
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    ldsm_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], pa + (mt * 16 * PSTR + ks * 16) * 2);
#pragma unroll
                for (int pc = 0; pc < (NC + 1) / 2; ++pc) {
                    u32 b0, b1, b2, b3;
                    if constexpr (NC >= 2) {
                        ldsm_x4_t(b0, b1, b2, b3, vb + (ks * 16 * KSTR + pc * 16) * 2);
                    } else {
                        ldsm_x2_t(b0, b1, vb + (ks * 16 * KSTR) * 2);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816(o[mt][2 * pc], a[mt], b0, b1);
                        if constexpr (NC >= 2) mma16816(o[mt][2 * pc + 1], a[mt], b2, b3);
                    }
                }
            }
        }
        c_run = c_new;
    }
    cp_wait_all();

    // ---- epilogue: row sums, (max, sum), partial context * c ----
    if (warp < SW) {
        l_s0 += __shfl_xor_sync(0xffffffffu, l_s0, 1);
        l_s0 += __shfl_xor_sync(0xffffffffu, l_s0, 2);
        l_s1 += __shfl_xor_sync(0xffffffffu, l_s1, 1);
        l_s1 += __shfl_xor_sync(0xffffffffu, l_s1, 2);
        if (q4 == 0) {
            slsum[tg * MROWS + r0] = l_s0; slsum[tg * MROWS + r0 + 8] = l_s1;
            if (tg == 0) { smfin[r0] = m_s0; smfin[r0 + 8] = m_s1; }
        }
    }
    __syncthreads();
    if (tid < MROWS) {
        float l = 0.0f;
        for (int j = 0; j < TG; ++j) l += slsum[j * MROWS + tid];
        float* ml = ml_part + ((size_t)w_id * Hpad + h0 + tid) * 2;
        ml[0] = smfin[tid];
        ml[1] = l;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float* dst = o_part + ((size_t)w_id * Hpad + h0 + mt * 16 + g + hh * 8) * DL + warp * DW + 2 * q4;
#pragma unroll
            for (int nc = 0; nc < NC; ++nc)
                *(float2*)(dst + nc * 8) = make_float2(o[mt][nc][2 * hh] * c_run, o[mt][nc][2 * hh + 1] * c_run);
        }
}

// out[n, h, :] = sum_s o_part[s] 2^(m_s - M) / sum_s l_s 2^(m_s - M) over the work items
// [splits[n], splits[n+1]) of query n (zero when it has none); tq4 unrotates the result.
// grid (N, H), block 128; thread t sums dims t + 128 k. No block barrier before the sums:
// every warp finds M and L itself (lanes stride over the splits, then shuffles), and the
// partial contexts of the first CF splits are loaded before that, so that with up to CF
// splits a query (the common plan: 8 at 16 x 32k) the (max, sum) pairs and the contexts
// come in one round trip. (The block-reduced form, with three dependent trips through L2
// and four barriers, took 5.0 us at 16 x 32k, 64 heads.)
#define CF 8
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(128)
attn_combine(const float* o_part, const float* ml_part,
             const int* __restrict__ splits, float* __restrict__ out, int H, int Hpad) {
#if TIER == 2
    __shared__ float buf[DL];
#endif
    constexpr int NV = DL / 128;
    // Launched as a programmatic dependent of the split kernel: o_part and ml_part are read
    // only after this wait, through plain loads (no __ldg / __restrict__: the non-coherent
    // path is outside the memory model that makes the split kernel's writes visible here)
    grid_dep_wait();
    const int n = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
    const int ws = splits[n], we = splits[n + 1];
    auto part = [&](int s) { return o_part + ((size_t)s * Hpad + h) * DL + tid; };
    float v[CF][NV];
#pragma unroll
    for (int j = 0; j < CF; ++j)
#pragma unroll
        for (int k = 0; k < NV; ++k) v[j][k] = ws + j < we ? part(ws + j)[128 * k] : 0.0f;
    float M = NEG_INF;
    for (int s = ws + lane; s < we; s += 32) M = fmaxf(M, ml_part[((size_t)s * Hpad + h) * 2]);
    M = warp_max(M);
    float L = 0.0f;
    if (M != NEG_INF)
        for (int s = ws + lane; s < we; s += 32) {
            const float2 ml = *(const float2*)(ml_part + ((size_t)s * Hpad + h) * 2);
            L += ml.y * exp2f(ml.x - M);
        }
    L = warp_sum(L);
    const float invL = L > 0.0f ? 1.0f / L : 0.0f;
    float acc[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) acc[k] = 0.0f;
    for (int s0 = ws; s0 < we; s0 += CF) {
        // lane j < CF: the weight of split s0 + j (its pair is in L1 from the sums above)
        float wl = 0.0f;
        if (lane < CF && s0 + lane < we && M != NEG_INF)
            wl = exp2f(ml_part[((size_t)(s0 + lane) * Hpad + h) * 2] - M) * invL;
#pragma unroll
        for (int j = 0; j < CF; ++j) {
            const float w = __shfl_sync(0xffffffffu, wl, j);
#pragma unroll
            for (int k = 0; k < NV; ++k) acc[k] += v[j][k] * w;
        }
        const int s1 = s0 + CF;
        if (s1 < we)
#pragma unroll
            for (int j = 0; j < CF; ++j)
#pragma unroll
                for (int k = 0; k < NV; ++k) v[j][k] = s1 + j < we ? part(s1 + j)[128 * k] : 0.0f;
    }
    float* dst = out + ((size_t)n * H + h) * DL;
#if TIER == 2
#pragma unroll
    for (int k = 0; k < NV; ++k) buf[tid + 128 * k] = acc[k];
    fwht<DL>(buf);
    const float il = 1.0f / sqrtf((float)DL);
    for (int d = tid; d < DL; d += 128) buf[d] = neg_sign(d) ? -(buf[d] * il) : buf[d] * il;
    __syncthreads();
    for (int d = tid; d < DL; d += 128) dst[d] = buf[d];
#else
#pragma unroll
    for (int k = 0; k < NV; ++k) dst[tid + 128 * k] = acc[k];
#endif
}
