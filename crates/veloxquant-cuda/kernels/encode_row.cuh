// Row encoding shared by encode.cu and kv.cu (both compiled with the format's defines: D, T,
// KIND, BITS, ROT, EDEN, IN_KIND, ROW_BYTES, PAGE_BYTES). Bit-identical to the CPU under
// --fmad=false: lane l holds elements l, l+32, … (the canonical reduction order of reduce.rs).
// KIND 4 (qjl, m = d): the sign bits of S·x and ‖x‖; the transform argument is Sᵀ (TW
// floats per head: S[i][e] at [e·D + i]) instead of rotation signs. KIND 5 (turboquant_prod):
// the rotation's signs, then Sᵀ; rows of (BITS)-bit codes then MSE_BYTES on the sign bits.
// KIND 6 (rabitq): the sign bits of R·x, ‖R·x‖ and x0. KIND 7 (turboquant_rvq): both
// rotations' signs (TW = 2D); stage-1 (BITS) codes, then stage-2 (BITS2) codes at MSE_BYTES;
// thresholds and centroids are stage 1's then stage 2's. KIND 8 (kivi): a page at a time
// (kivi_page_warp), GRP the group size, PERCH keys' per-channel groups.
#define EPL (D / 32)
#define NTHR ((1 << BITS) - 1)
#ifndef BITS2
#define BITS2 1
#endif
#define NTHR2 ((1 << BITS2) - 1)
#if KIND == 4
#define TW (D * D)
#elif KIND == 5
#define TW (D + D * D)
#elif KIND == 7
#define TW (2 * D)
#else
#define TW D
#endif
#ifndef MSE_BYTES
#define MSE_BYTES 0
#endif

__device__ __forceinline__ float load_in(const void* x, size_t i) {
#if IN_KIND == 0
    return ((const float*)x)[i];
#elif IN_KIND == 1
    return h2f(((const u16*)x)[i]);
#else
    return bf2f(((const u16*)x)[i]);
#endif
}

// Canonical unnormalized FWHT over the warp's strided layout (h = 1, 2, 4, …).
__device__ __forceinline__ void fwht_warp(float* v, int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            float o = __shfl_xor_sync(FULL_MASK, v[k], h);
            v[k] = (lane & h) ? (o - v[k]) : (v[k] + o);
        }
    }
#pragma unroll
    for (int hk = 1; hk < EPL; hk <<= 1) {
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if ((k & hk) == 0) {
                float a = v[k], b = v[k + hk];
                v[k] = a + b;
                v[k + hk] = a - b;
            }
        }
    }
}

__device__ __forceinline__ float warp_sum_canonical(float acc) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = acc + __shfl_xor_sync(FULL_MASK, acc, off);
    return acc;
}

#if KIND >= 4
__device__ __forceinline__ float norm_warp(const float* v) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ss = ss + v[k] * v[k];
    return sqrtf(warp_sum_canonical(ss));
}
#endif

#if KIND == 4 || KIND == 5
// Sign bits of S·x for the row held by the warp (lane l: x_l, x_{l+32}, …) into `row`. Each
// (S·x)_i is the CPU's sequential sum Σ_e S[i][e]·x_e (sketch.rs `project`) in the same
// order: lane l owns i = l + 32k, x_e is broadcast by a shuffle, and the warp reads Sᵀ's
// row e (m consecutive floats) per step.
__device__ __forceinline__ void sketch_signs_warp(const float* v, u8* row, const float* __restrict__ st, int lane) {
    float p[EPL];  // from −0, as Rust's f32 sum: −0 + a = a exactly
#pragma unroll
    for (int k = 0; k < EPL; k++) p[k] = -0.0f;
#pragma unroll
    for (int kb = 0; kb < EPL; kb++) {
#pragma unroll 8
        for (int l = 0; l < 32; l++) {
            const int e = 32 * kb + l;
            const float xe = __shfl_sync(FULL_MASK, v[kb], l);
            const float* se = st + (size_t)e * D + lane;
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                const float prod = se[32 * k] * xe;
                p[k] = p[k] + prod;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u32 w = __ballot_sync(FULL_MASK, p[k] >= 0.0f);
        if (lane == 0) ((u32*)row)[k] = w;
    }
}
#endif

#if KIND == 3 || KIND == 5 || KIND == 7 || KIND == 8
// The warp's codes (lane l: codes l, l+32, …) packed into `row`: chunk k (codes 32k..32k+31)
// is exactly words k*NB .. k*NB+NB-1. Word w is the OR of each lane's part of it (code c sits
// at bits c·NB − 32w, a 3-bit code straddling two words gives each its part): one warp
// OR-reduction (redux.sync, sm_80+) per word: NB per chunk, where gathering the codes by
// shuffles took 32/NB + 2 (and their shifts), which bound kivi's encode.
template <int NB>
__device__ __forceinline__ void pack_codes_warp(const u32* code, u8* row, int lane) {
    u32* words = (u32*)row;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        u32 mine = 0;
#pragma unroll
        for (int w = 0; w < NB; w++) {
            const int sh = lane * NB - 32 * w;
            u32 part = 0;
            if (sh >= 0 && sh < 32) part = code[k] << sh;
            else if (sh < 0 && sh > -NB) part = code[k] >> (-sh);
            const u32 word = __reduce_or_sync(FULL_MASK, part);
            if (lane == w) mine = word;
        }
        if (lane < NB) words[k * NB + lane] = mine;
    }
}

// Lloyd-Max codes of the warp's row (the CPU's quantize: the count of thresholds strictly
// below y), NT thresholds.
template <int NT>
__device__ __forceinline__ u32 lloyd_code(float y, const float* thr) {
    u32 c = 0;
#pragma unroll
    for (int j = 0; j < NT; j++) c += (thr[j] < y) ? 1u : 0u;
    return c;
}
#endif

#if KIND == 5 || KIND == 7
// Stage 1 of turboquant_prod and turboquant_rvq (operation for operation as the CPU's): y =
// v·(1/‖v‖), its BITS-bit codes packed into `row`, v ← the residual y − ŷ (0 for a zero row);
// returns ‖v‖.
__device__ __forceinline__ float stage1_warp(float* v, u8* row, const float* __restrict__ thresholds,
                                             const float* __restrict__ centroids, int lane) {
    float thr[NTHR];
#pragma unroll
    for (int j = 0; j < NTHR; j++) thr[j] = thresholds[j];
    const float norm = norm_warp(v);
    const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    u32 code[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const float y = v[k] * inv;
        const u32 c = lloyd_code<NTHR>(y, thr);
        code[k] = c;
        v[k] = norm > 0.0f ? y - centroids[c] : 0.0f;
    }
    pack_codes_warp<BITS>(code, row, lane);
    return norm;
}
#endif

#if KIND == 5
// turboquant_prod's row (turboquant_prod.rs encode_page, operation for operation): v rotated;
// y = v·(1/‖v‖), its (BITS)-bit codes, the residual e = y − ŷ (0 for a zero row), the signs
// of S·e after the codes; returns (‖v‖, ‖e‖).
__device__ __forceinline__ float2 prod_row_warp(float* v, u8* row, const float* __restrict__ st,
                                                const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, int lane) {
    const float norm = stage1_warp(v, row, thresholds, centroids, lane);
    sketch_signs_warp(v, row + MSE_BYTES, st, lane);
    return make_float2(norm, norm_warp(v));
}
#endif

#if KIND == 7
// turboquant_rvq's row (turboquant_rvq.rs encode_row_unchecked, operation for operation): v
// rotated by R₁; y = v·(1/n₁), stage-1 codes, e = y − ŷ₁ (0 for a zero row), z = R₂·(e·(1/n₂))
// (signs sg2, the FWHT, the scale), stage-2 codes after stage 1's; returns (n₁, n₂).
__device__ __forceinline__ float2 rvq_row_warp(float* v, u8* row, const float* __restrict__ sg2, float rot_scale,
                                               const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    float thr2[NTHR2];
#pragma unroll
    for (int j = 0; j < NTHR2; j++) thr2[j] = thresholds[NTHR + j];
    const float n1 = stage1_warp(v, row, thresholds, centroids, lane);
    u32 code[EPL];
    const float n2 = norm_warp(v);
    const float inv2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * inv2 * sg2[lane + 32 * k];
    fwht_warp(v, lane);
#pragma unroll
    for (int k = 0; k < EPL; k++) code[k] = lloyd_code<NTHR2>(v[k] * rot_scale, thr2);
    pack_codes_warp<BITS2>(code, row + MSE_BYTES, lane);
    return make_float2(n1, n2);
}
#endif

#if KIND == 6
// rabitq's row (rabitq.rs encode_row_unchecked): v = R·x (rotated by the caller); the sign
// bits (v ≥ 0), ‖v‖ and x0 = ‖v‖₁/(‖v‖·√d) with ‖v‖₁ summed in f64 in element order as the
// CPU does (lane 0 walks the elements, each broadcast by a shuffle); returns (‖v‖, x0).
__device__ __forceinline__ float2 rabitq_row_warp(const float* v, u8* row, int lane) {
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u32 w = __ballot_sync(FULL_MASK, v[k] >= 0.0f);
        if (lane == 0) ((u32*)row)[k] = w;
    }
    const float norm = norm_warp(v);
    double l1 = 0.0;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        for (int l = 0; l < 32; l++) l1 = __dadd_rn(l1, (double)fabsf(__shfl_sync(FULL_MASK, v[k], l)));
    }
    const float x0 = norm > 0.0f ? (float)__ddiv_rn(l1, __dmul_rn((double)norm, sqrt((double)D))) : 0.0f;
    return make_float2(norm, x0);
}
#endif

#if KIND == 3
// Codes of one row held by a warp (lane l: elements l, l+32, …, already rotated) into `row`
// (global or shared); returns the row's scale (every lane).
__device__ __forceinline__ float codes_row_warp(const float* v, u8* row, const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, int lane) {
    float thr[NTHR];
#pragma unroll
    for (int j = 0; j < NTHR; j++) thr[j] = thresholds[j];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ss = ss + v[k] * v[k];
    float norm = sqrtf(warp_sum_canonical(ss));
    float y[EPL];
    u32 code[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        y[k] = norm > 0.0f ? v[k] / norm : 0.0f;
        code[k] = lloyd_code<NTHR>(y[k], thr);
    }
    pack_codes_warp<BITS>(code, row, lane);
    float scale = norm;
#if EDEN
    float ip = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ip = ip + y[k] * centroids[code[k]];
    ip = warp_sum_canonical(ip);
    if (ip > 0.0f) scale = norm / ip;
#endif
    return scale;
}
#endif

#if KIND == 8
// kivi (kivi.rs encode_page): the f16 scale s = (max − min)/(2^b − 1) and zero z = min of
// group p, stored when `store`, and the codes u = clamp(round((x − z)/s), 0, 2^b − 1) (0 when
// s = 0) computed against their f32 values. Both divisions are the correctly rounded quotient
// (as the CPU's `/`) by Markstein's step: y0 = a·r, e = a − y0·b (exact by FMA), a·(1/b) ≈
// y0 + e·r with r = RN(1/b); RN of that is RN(a/b) when nothing under- or overflows, which
// the guards below ensure (else the IEEE division), at three FMA-pipe operations instead of
// a division per element.
#define KIVI_LEVELS ((float)((1 << BITS) - 1))
#define KIVI_NP (T * D / GRP)
// One group's (s, z) and 1/s. fast: s a finite f16 > 0 and z finite, so every x of the group
// (min ≤ x ≤ max, with max − min < 65520·levels) gives |x − z| < 2^21 and |(x − z)/s| < 2^46:
// no overflow, and the remainder can only underflow where |(x − z)/s| < 2^-70, which rounds
// to code 0 whichever way the last bit goes.
struct KiviGroup {
    float s, z, rs;
    bool fast;
};
__device__ __forceinline__ KiviGroup kivi_group(u8* page, int p, float lo, float hi, bool store) {
    const float span = hi - lo;
    // span/levels: r = RN(1/levels) is a constant; span ≥ 2^-100 keeps the remainder normal
    // (smaller spans give s < 2^-25, stored as f16 0 both ways).
    const float rl = 1.0f / KIVI_LEVELS;
    const float y0 = span * rl;
    const float sq = span >= 0x1p-100f && span <= 0x1p100f ? fmaf(fmaf(-y0, KIVI_LEVELS, span), rl, y0)
                                                          : __fdiv_rn(span, KIVI_LEVELS);
    // −0 as +0 (kivi.rs set_scale_zero): the sign of a zero min is the reduction's choice.
    const u16 s16 = f2h(sq), z16 = f2h(lo == 0.0f ? 0.0f : lo);
    if (store) {
        u16* sz = (u16*)(page + T * ROW_BYTES);
        sz[p] = s16;
        sz[KIVI_NP + p] = z16;
    }
    KiviGroup g;
    g.s = h2f(s16);
    g.z = h2f(z16);
    g.fast = g.s > 0.0f && g.s <= 65504.0f && fabsf(g.z) <= 65504.0f;
    g.rs = g.fast ? __frcp_rn(g.s) : 0.0f;
    return g;
}
// The code of x in a group with g.fast (Markstein's quotient q). clamp(round(q), 0, levels)
// as min(⌊RZ(q + 0.5)⌋, levels) with the floor's conversion saturating negatives to 0: for
// q ≥ 0, rounding the sum toward zero never carries it past the next integer, so the floor
// is round-half-away's; q < 0 gives 0 either way (NaN too).
__device__ __forceinline__ u32 kivi_code_fast(float x, const KiviGroup& g) {
    const float a = x - g.z;
    const float y0 = a * g.rs;
    const float q = fmaf(fmaf(-y0, g.s, a), g.rs, y0);
    return min(__float2uint_rd(__fadd_rz(q, 0.5f)), (u32)((1 << BITS) - 1));
}
__device__ __forceinline__ u32 kivi_code(float x, const KiviGroup& g) {
    if (g.fast) return kivi_code_fast(x, g);
    const float u = g.s > 0.0f ? roundf(__fdiv_rn(x - g.z, g.s)) : 0.0f;
    return (u32)fminf(fmaxf(u, 0.0f), KIVI_LEVELS);
}

// kivi's layout for encode_rows (BLK): lane l holds channels [EPL·l, EPL·l + EPL) of each token,
// so a token's slice is one vector load and the lane's codes are whole bytes of the row (2-bit
// at d = 64: a byte per pair of lanes), stored without a cross-lane pack.
#define KIN_B (IN_KIND == 0 ? 4 : 2)
__device__ __forceinline__ void kivi_load_blk(const void* x, size_t row, int lane, float* v) {
    // The lane's EPL·KIN_B bytes (4 to 32) as words, by the widest aligned loads.
    constexpr int NW = EPL * KIN_B / 4;
    const u32* p = (const u32*)((const u8*)x + (row * D + (size_t)EPL * lane) * KIN_B);
    u32 w[NW];
#pragma unroll
    for (int i = 0; i < NW; i += NW >= 4 ? 4 : NW) {
        if (NW >= 4) {
            const vec4u a = *(const vec4u*)(p + i);
            w[i] = a.x; w[i + 1] = a.y; w[i + 2] = a.z; w[i + 3] = a.w;
        } else if (NW == 2) {
            const vec2u a = *(const vec2u*)p;
            w[0] = a.x; w[1] = a.y;
        } else {
            w[0] = p[0];
        }
    }
#pragma unroll
    for (int i = 0; i < NW; i++) {
#if IN_KIND == 0
        v[i] = __uint_as_float(w[i]);
#elif IN_KIND == 1
        v[2 * i] = h2f((u16)(w[i] & 0xFFFFu));
        v[2 * i + 1] = h2f((u16)(w[i] >> 16));
#else
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
#endif
    }
}
// The lane's EPL codes (BLK layout: code k at bit BITS·k of its slice) into row `row`.
__device__ __forceinline__ void kivi_store_blk(const u32* code, u8* row, int lane) {
    u32 pk = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) pk |= code[k] << (BITS * k);
    if (EPL * BITS == 4) {
        pk |= __shfl_down_sync(FULL_MASK, pk, 1) << 4;
        if ((lane & 1) == 0) row[lane >> 1] = (u8)pk;
    } else if (EPL * BITS == 8) {
        row[lane] = (u8)pk;
    } else if (EPL * BITS == 16) {
        ((u16*)row)[lane] = (u16)pk;
    } else {
        ((u32*)row)[lane] = pk;
    }
}

// A whole page by one warp: load(i, v) puts token i's elements in v, lane l holding channels
// [EPL·l, EPL·l + EPL) (BLK) or l, l + 32, … (the cache's appends, as they load rows). Keys:
// per channel (a lane's own), min/max over each group of GRP tokens, then the codes (the
// tokens loaded twice, not held: 32·EPL registers). Values: per token, min/max over groups of
// GRP channels, in the lane and then by shuffles. min/max are exact in any order and the
// quotients correctly rounded, so both layouts give the CPU's pages.
template <bool BLK, class Load>
__device__ __forceinline__ void kivi_page_warp(Load load, u8* page, int lane) {
    float v[EPL];
    u32 code[EPL];
    auto store = [&](int i) {
        if (BLK) kivi_store_blk(code, page + i * ROW_BYTES, lane);
        else pack_codes_warp<BITS>(code, page + i * ROW_BYTES, lane);
    };
#if PERCH
    for (int g0 = 0; g0 < T; g0 += GRP) {
        float lo[EPL], hi[EPL];
#pragma unroll
        for (int k = 0; k < EPL; k++) { lo[k] = __int_as_float(0x7f800000); hi[k] = -lo[k]; }
        // Unrolled so that several tokens' loads are in flight at once.
#pragma unroll 8
        for (int i = g0; i < g0 + GRP; i++) {
            load(i, v);
#pragma unroll
            for (int k = 0; k < EPL; k++) { lo[k] = fminf(lo[k], v[k]); hi[k] = fmaxf(hi[k], v[k]); }
        }
        KiviGroup sz[EPL];
        bool all_fast = true;
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            sz[k] = kivi_group(page, (g0 / GRP) * D + (BLK ? EPL * lane + k : lane + 32 * k), lo[k], hi[k], true);
            all_fast = all_fast && sz[k].fast;
        }
#pragma unroll 4
        for (int i = g0; i < g0 + GRP; i++) {
            load(i, v);
            if (BLK && all_fast) {  // the fast quotient without a branch per element
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code_fast(v[k], sz[k]);
            } else {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code(v[k], sz[k]);
            }
            store(i);
        }
    }
#else
#pragma unroll 4
    for (int i = 0; i < T; i++) {
        load(i, v);
        if (BLK) {
            // A value group of GRP channels is GRP / EPL consecutive lanes (EPL ≤ 8 ≤ GRP / 2).
            float lo = v[0], hi = v[0];
#pragma unroll
            for (int k = 1; k < EPL; k++) { lo = fminf(lo, v[k]); hi = fmaxf(hi, v[k]); }
#pragma unroll
            for (int off = GRP / EPL / 2; off > 0; off >>= 1) {
                lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
                hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
            }
            const int ch = EPL * lane;
            const KiviGroup g = kivi_group(page, i * (D / GRP) + ch / GRP, lo, hi, ch % GRP == 0);
            if (g.fast) {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code_fast(v[k], g);
            } else {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code(v[k], g);
            }
        } else {
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                float lo = v[k], hi = v[k];
#pragma unroll
                for (int off = GRP / 2; off > 0; off >>= 1) {
                    lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
                    hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
                }
                const int ch = lane + 32 * k;
                code[k] = kivi_code(v[k], kivi_group(page, i * (D / GRP) + ch / GRP, lo, hi, ch % GRP == 0));
            }
        }
        store(i);
    }
#endif
}
#endif

// One row held by a warp (lane l: elements l, l+32, …, unrotated input) encoded as row t of
// `page` (rotation signs sg, when the format rotates): the body shared by encode_rows and the
// cache's row appends (kv.cu).
__device__ __forceinline__ void encode_row_warp(float* v, u8* page, int t, const float* __restrict__ sg,
                                                float rot_scale, const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
#if ROT
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * sg[lane + 32 * k];
    fwht_warp(v, lane);
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * rot_scale;
#endif

#if KIND == 0
#pragma unroll
    for (int k = 0; k < EPL; k++) ((u16*)row)[lane + 32 * k] = f2h(v[k]);
#elif KIND == 1
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        float amax = fabsf(v[k]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        float r = roundf(v[k] * id);
        r = fminf(fmaxf(r, -128.0f), 127.0f);
        u8* blk = row + 34 * k;
        blk[2 + lane] = (u8)(signed char)(int)r;
        if (lane == 0) *(u16*)blk = f2h(d);  // blocks start at even offsets
    }
#elif KIND == 2
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        float a = fabsf(v[k]);
        float amax = a;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off));
        u32 hit = __ballot_sync(FULL_MASK, a == amax);
        int src = __ffs(hit) - 1;
        float mx = __shfl_sync(FULL_MASK, v[k], src);
        if (amax == 0.0f) mx = 0.0f;  // the CPU never updates its +0 start
        float d = mx / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        float f = v[k] * id + 8.5f;
        int q = (int)truncf(fminf(fmaxf(f, -128.0f), 127.0f));
        q = q < 15 ? q : 15;
        int hi = __shfl_down_sync(FULL_MASK, q, 16);
        u8* blk = row + 18 * k;
        if (lane < 16) blk[2 + lane] = (u8)((q & 0xF) | ((hi & 0xF) << 4));
        if (lane == 0) *(u16*)blk = f2h(d);  // blocks start at even offsets
    }
#elif KIND == 8
    // kivi: whole pages only (kivi_page_warp); never called.
#else
#if KIND >= 5
#if KIND == 5
    const float2 sides = prod_row_warp(v, row, sg + D, thresholds, centroids, lane);
#elif KIND == 6
    const float2 sides = rabitq_row_warp(v, row, lane);
#else
    const float2 sides = rvq_row_warp(v, row, sg + D, rot_scale, thresholds, centroids, lane);
#endif
    const float scale = sides.x;
    if (lane == 0) ((u16*)(page + T * ROW_BYTES))[T + t] = f2h(sides.y);
#elif KIND == 4
    const float scale = norm_warp(v);
    sketch_signs_warp(v, row, sg, lane);
#else
    float scale = codes_row_warp(v, row, thresholds, centroids, lane);
#endif
    if (lane == 0) {
        ((u16*)(page + T * ROW_BYTES))[t] = f2h(scale);
        const int used = T * ROW_BYTES + 2 * T * (KIND >= 5 ? 2 : 1);
        if (t == 0 && PAGE_BYTES > used) {
            for (int i = used; i < PAGE_BYTES; i++) page[i] = 0;
        }
    }
#endif
}

#if KIND == 4 || KIND == 5
// v (lane l: elements l, l+32, …) += s·Sᵀ·sign for the m = d sign bits at w: the reference
// back-projection (sketch.rs add_back_projection; summed in another order, so equal within
// rounding). Per e the warp sums its lanes' ±S[i][e] (one coalesced row of Sᵀ) and lane
// e mod 32 keeps it.
__device__ __forceinline__ void sketch_back_warp(const u32* w, float s, const float* __restrict__ st, int lane,
                                                 float* v) {
    float sgn[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) sgn[k] = (w[k] >> lane) & 1u ? s : -s;
#pragma unroll
    for (int kb = 0; kb < EPL; kb++) {
        for (int l = 0; l < 32; l++) {
            const float* se = st + (size_t)(32 * kb + l) * D + lane;
            float a = 0.0f;
#pragma unroll
            for (int k = 0; k < EPL; k++) a += sgn[k] * se[32 * k];
            a = warp_sum_canonical(a);
            if (lane == l) v[kb] += a;
        }
    }
}
#endif

// Row t of `page` decoded by a warp (lane l: elements l, l+32, …), per-token scale applied,
// still in the rotated domain: the reference decode of rows.rs (f32 centroids `cen`).
__device__ __forceinline__ void decode_row_warp(const u8* page, int t, const float* __restrict__ cen, int lane,
                                                float* v) {
    const u8* row = page + t * ROW_BYTES;
#if KIND == 0
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = h2f(((const u16*)row)[lane + 32 * k]);
#elif KIND == 1
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u8* blk = row + 34 * k;
        v[k] = h2f(*(const u16*)blk) * (float)(signed char)blk[2 + lane];
    }
#elif KIND == 2
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u8* blk = row + 18 * k;
        const u8 b = blk[2 + (lane & 15)];
        const int q = lane < 16 ? (b & 0xF) : (b >> 4);
        v[k] = h2f(*(const u16*)blk) * (float)(q - 8);
    }
#elif KIND == 8
    // kivi (kivi.rs decode_page): s·u + z of the element's group.
    const u32* w = (const u32*)row;
    const u16* sz = (const u16*)(page + T * ROW_BYTES);
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int ch = lane + 32 * k, bit = ch * BITS;
        const u32 c = (w[bit >> 5] >> (bit & 31)) & ((1u << BITS) - 1u);
        const int p = PERCH ? (t / GRP) * D + ch : t * (D / GRP) + ch / GRP;
        v[k] = h2f(sz[p]) * (float)c + h2f(sz[KIVI_NP + p]);
    }
#else
    const u32* w = (const u32*)row;
    const float s = h2f(((const u16*)(page + T * ROW_BYTES))[t]);
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int bit = (lane + 32 * k) * BITS, wi = bit >> 5, o = bit & 31;
        u32 c = w[wi] >> o;
        if (o + BITS > 32) c |= w[wi + 1] << (32 - o);
        v[k] = cen[c & ((1u << BITS) - 1u)] * s;
    }
#endif
}
