// Row encoding shared by encode.cu and kv.cu (both compiled with the format's defines: D, T,
// KIND, BITS, ROT, EDEN, IN_KIND, ROW_BYTES, PAGE_BYTES). Bit-identical to the CPU under
// --fmad=false: lane l holds elements l, l+32, … (the canonical reduction order of reduce.rs).
// KIND: the format's id (format.rs KernelKind); each format's row encoder and decoder are in
// formats/, spliced in below at the marker. BITS2 and MSE_BYTES: a row's second code segment
// (turboquant_prod, turboquant_rvq); GRP and PERCH: kivi's groups.
#define EPL ((D + 31) / 32)
// Whether the lane's element lane + 32k exists: d = 80 and 112 end in a partial chunk, whose
// missing elements the lanes hold as 0 and never store (a canonical partial sum starts at +0,
// so adding them would change nothing; they are skipped where a product reads memory).
#define LIVE(k, lane) (D % 32 == 0 || (k) < D / 32 || (lane) < D % 32)
#define NTHR ((1 << BITS) - 1)
#ifndef BITS2
#define BITS2 1
#endif
#define NTHR2 ((1 << BITS2) - 1)
#ifndef MSE_BYTES
#define MSE_BYTES 0
#endif
// Rows per warp of encode_rows' multi-row path (a format's encode_rows_fmt; 1: a warp per row).
#ifndef RPW
#define RPW 1
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

#if DENSE_W
// v ← M·v for a dense rotation M (row-major D × D; the warp's strided layout): output i is the
// CPU's dot_canonical(M row i, v) (rotate.rs Rotation::apply): the lane's products in index
// order from 0, then the xor butterfly, whose result every lane holds (a + b = b + a).
__device__ __forceinline__ void dense_warp(float* v, const float* __restrict__ m, int lane) {
    float out[EPL];
#if D % 32 != 0
#pragma unroll
    for (int k = 0; k < EPL; k++) out[k] = 0.0f;  // a partial chunk's missing elements stay 0
#endif
#pragma unroll
    for (int i = 0; i < D; i++) {
        float p = 0.0f;
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if (LIVE(k, lane)) p = p + m[(size_t)i * D + lane + 32 * k] * v[k];
        }
        p = warp_sum_canonical(p);
        if ((i & 31) == lane) out[i >> 5] = p;
    }
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = out[k];
}
// v ← Mᵀ·v (the inverse rotation), for decoded rows: within the decode tolerance, not the
// CPU's order.
__device__ __forceinline__ void dense_inv_warp(float* v, const float* __restrict__ m, int lane) {
    float out[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) out[k] = 0.0f;
#pragma unroll 4
    for (int i = 0; i < D; i++) {
        float vi = 0.0f;
#pragma unroll
        for (int k = 0; k < EPL; k++) vi = (i >> 5) == k ? v[k] : vi;
        vi = __shfl_sync(FULL_MASK, vi, i & 31);
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if (LIVE(k, lane)) out[k] += m[(size_t)i * D + lane + 32 * k] * vi;
        }
    }
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = out[k];
}
#endif
// The format's forward rotation core (after its signs, before its scale: both ones for a
// dense rotation) and its inverse (before signs and scale); m: the dense matrix, when
// DENSE_W.
__device__ __forceinline__ void rot_fwd_warp(float* v, const float* __restrict__ m, int lane) {
#if DENSE_W
    dense_warp(v, m, lane);
#else
    fwht_warp(v, lane);
#endif
}
__device__ __forceinline__ void rot_inv_warp(float* v, const float* __restrict__ m, int lane) {
#if DENSE_W
    dense_inv_warp(v, m, lane);
#else
    fwht_warp(v, lane);
#endif
}

#if KIND >= 4
__device__ __forceinline__ float norm_warp(const float* v) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ss = ss + v[k] * v[k];
    return sqrtf(warp_sum_canonical(ss));
}
#endif

// Word i of a packed segment of D·NB bits (bits 32i..32i+31): stored, and read, as a word
// where D is a multiple of 32; else (d = 80 and 112, whose rows and second segments need not
// start on a word boundary) a byte at a time, none past the segment's D·NB/8 bytes.
template <int NB>
__device__ __forceinline__ void put_packed_word(u8* seg, int i, u32 w) {
#if D % 32 == 0
    ((u32*)seg)[i] = w;
#else
#pragma unroll
    for (int b = 0; b < 4; b++) {
        if (4 * i + b < D * NB / 8) seg[4 * i + b] = (u8)(w >> (8 * b));
    }
#endif
}
template <int NB>
__device__ __forceinline__ u32 packed_word(const u8* seg, int i) {
#if D % 32 == 0
    return ((const u32*)seg)[i];
#else
    u32 w = 0;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        if (4 * i + b < D * NB / 8) w |= (u32)seg[4 * i + b] << (8 * b);
    }
    return w;
#endif
}

#if KIND == 3 || KIND == 5 || KIND == 7 || KIND == 8 || KIND == 9
// The warp's codes (lane l: codes l, l+32, …) packed into `row`: chunk k (codes 32k..32k+31)
// is exactly words k*NB .. k*NB+NB-1. Word w is the OR of each lane's part of it (code c sits
// at bits c·NB − 32w, a 3-bit code straddling two words gives each its part): one warp
// OR-reduction (redux.sync, sm_80+) per word: NB per chunk, where gathering the codes by
// shuffles took 32/NB + 2 (and their shifts), which bound kivi's encode.
// d = 80 and 112: the last chunk's missing codes count as 0 (put_packed_word stores by bytes).
template <int NB>
__device__ __forceinline__ void pack_codes_warp(const u32* codes, u8* row, int lane) {
#if D % 32 == 0
    const u32* code = codes;
#else
    u32 code[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) code[k] = LIVE(k, lane) ? codes[k] : 0u;
#endif
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
        if (lane < NB) put_packed_word<NB>(row, k * NB + lane, mine);
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
// lloyd_code and the cell's centroid cen[c] (*yh) from the same compares: the thresholds
// are sorted, so the last one below y names it. The thread-per-row stage 1 of
// turboquant_prod and turboquant_rvq up to 2 bits (at 3 and 4 the predicates held for both
// spill at d = 128).
template <int NT>
__device__ __forceinline__ u32 lloyd_code_centroid(float y, const float* thr, const float* cen, float* yh) {
    u32 c = 0;
    float h = cen[0];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const bool up = thr[j] < y;
        c += up ? 1u : 0u;
        h = up ? cen[j + 1] : h;
    }
    *yh = h;
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
        v[k] = norm > 0.0f && LIVE(k, lane) ? y - centroids[c] : 0.0f;
    }
    pack_codes_warp<BITS>(code, row, lane);
    return norm;
}
#endif

// Token t's first f16 side value (its scale) by lane 0; row 0 also zeroes the page's padding
// after the rows and their `sides` f16 values per token.
__device__ __forceinline__ void put_sides(u8* page, int t, float scale, int sides, int lane) {
    if (lane == 0) {
        ((u16*)(page + T * ROW_BYTES))[t] = f2h(scale);
        const int used = T * ROW_BYTES + 2 * T * sides;
        if (t == 0 && PAGE_BYTES > used) {
            for (int i = used; i < PAGE_BYTES; i++) page[i] = 0;
        }
    }
}

// Token t's two f16 side values (sides.x first), as put_sides.
__device__ __forceinline__ void put_two_sides(u8* page, int t, float2 sides, int lane) {
    if (lane == 0) ((u16*)(page + T * ROW_BYTES))[T + t] = f2h(sides.y);
    put_sides(page, t, sides.x, 2, lane);
}

// A dense rotation's matrix R₁ in a head's transform sg, after the format's own TW − DENSE_W
// words (turboquant_rvq's R₂ follows it).
#define DENSE_M(sg) ((sg) + (TW - DENSE_W))
// Each format's row codec (FMT_ROW): encode_row_fmt (row t of a page from v, rotated when the
// format rotates; its sides too) and decode_row_fmt (row t back, sides applied, still in the
// rotated domain), and TW, the floats per head of its transform argument (default D);
// optionally row_pre_fmt (ROW_PRE: before the rotation) and row_post_fmt (ROW_POST: after the
// inverse rotation of a decoded row).
// @formats FMT_ROW
#ifndef TW
#define TW (D + DENSE_W)
#endif

// The format's rotation of a row held by a warp (signs sg, then the FWHT, then the scale).
__device__ __forceinline__ void rotate_warp(float* v, const float* __restrict__ sg, float rot_scale, int lane) {
#if ROT && DENSE_W
    dense_warp(v, DENSE_M(sg), lane);  // unit signs and scale: not applied
#elif ROT
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * sg[lane + 32 * k];
    fwht_warp(v, lane);
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * rot_scale;
#endif
}

// One row held by a warp (lane l: elements l, l+32, …, unrotated input) encoded as row t of
// `page` (rotation signs sg, when the format rotates): the body shared by encode_rows and the
// cache's row appends (kv.cu).
__device__ __forceinline__ void encode_row_warp(float* v, u8* page, int t, const float* __restrict__ sg,
                                                float rot_scale, const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, int lane) {
#ifdef ROW_PRE
    row_pre_fmt(v, sg, lane);  // a format's step before the rotation (turboquant_frac: − μ)
#endif
    rotate_warp(v, sg, rot_scale, lane);
    encode_row_fmt(v, page, t, sg, rot_scale, thresholds, centroids, lane);
}
