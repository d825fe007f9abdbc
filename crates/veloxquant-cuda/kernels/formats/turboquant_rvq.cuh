// turboquant_rvq (turboquant_rvq.rs, two-stage residual VQ): per row stage 1's (BITS)-bit
// codes of y = R₁·x/n₁, then at MSE_BYTES stage 2's (BITS2)-bit codes of
// R₂·(y − ŷ₁)/n₂; per token n₁ and n₂. The transform argument is both rotations' signs
// (TW = 2D); thresholds and centroids are stage 1's then stage 2's. Keys decode as
// turboquant_prod's two segments (formats/turboquant_prod.cuh); values (VK = 5) by the
// readers below into decode.cu's two accumulators (V2SEG), finished by value_post_fmt.
#if FMT_ROW && KIND == 7
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below)
#define PAGE_STATE 1  // its own PageCodec and page_codec
#define TW (2 * D + DENSE_W)
// turboquant_rvq's row (turboquant_rvq.rs encode_row_unchecked, operation for operation): v
// rotated by R₁; y = v·(1/n₁), stage-1 codes, e = y − ŷ₁ (0 for a zero row), z = R₂·(e·(1/n₂))
// (signs sg2, the FWHT, the scale; or R₂'s matrix m2), stage-2 codes after stage 1's; returns
// (n₁, n₂).
__device__ __forceinline__ float2 rvq_row_warp(float* v, u8* row, const float* __restrict__ sg2,
                                               const float* __restrict__ m2, float rot_scale,
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
    rot_fwd_warp(v, m2, lane);
#pragma unroll
    for (int k = 0; k < EPL; k++) code[k] = lloyd_code<NTHR2>(v[k] * rot_scale, thr2);
    pack_codes_warp<BITS2>(code, row + MSE_BYTES, lane);
    return make_float2(n1, n2);
}
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
    put_two_sides(page, t, rvq_row_warp(v, row, sg + D, DENSE_M(sg) + D * D, rot_scale, thresholds, centroids, lane),
                  lane);
}
// n₁·(ŷ₁ + n₂·R₂ᵀ·ẑ) (turboquant_rvq.rs decode_page), still in R₁'s domain.
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const u16* side = (const u16*)(page + T * ROW_BYTES);
    codes_row_decode(page, t, cen, lane, v);
    {
        const float* sg2 = sg + D;
        float z[EPL];
#if D % 32 == 0
        const u32* w = (const u32*)(row + MSE_BYTES);
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            const int bit = (lane + 32 * k) * BITS2, wi = bit >> 5, o = bit & 31;
            u32 cz = w[wi] >> o;
            if (o + BITS2 > 32) cz |= w[wi + 1] << (32 - o);
            z[k] = cen[(1 << BITS) + (cz & ((1u << BITS2) - 1u))];
        }
#else
#pragma unroll
        for (int k = 0; k < EPL; k++)
            z[k] = LIVE(k, lane) ? cen[(1 << BITS) + code_at_bytes<BITS2>(row + MSE_BYTES, lane + 32 * k)] : 0.0f;
#endif
        rot_inv_warp(z, DENSE_M(sg) + D * D, lane);
        const float n12 = h2f(side[t]) * h2f(side[T + t]);
#pragma unroll
        for (int k = 0; k < EPL; k++) v[k] += n12 * (z[k] * rot_scale * sg2[lane + 32 * k]);
    }
}
#endif

#if FMT_PAGE && KIND == 7
// Both stages' thresholds and stage 1's centroids, in registers.
struct PageCodec {
    float thr1[NTHR], cen1[NTHR + 1], thr2[NTHR2];
};
__device__ __forceinline__ PageCodec page_codec(u8* dsm, const u32* __restrict__ table,
                                               const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, u32 tab_bias, int lane) {
    PageCodec pc;
#pragma unroll
    for (int j = 0; j < NTHR; j++) pc.thr1[j] = thresholds[j];
#pragma unroll
    for (int j = 0; j <= NTHR; j++) pc.cen1[j] = centroids[j];
#pragma unroll
    for (int j = 0; j < NTHR2; j++) pc.thr2[j] = thresholds[NTHR + j];
    return pc;
}
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
    const float(&thr1)[NTHR] = pc.thr1;
    const float(&cen1)[NTHR + 1] = pc.cen1;
    const float(&thr2)[NTHR2] = pc.thr2;
    // turboquant_rvq (rvq_row_warp, one lane per row): y = v·(1/n₁), stage-1 codes, the
    // residual e = y − ŷ₁ (0 for a zero row), z = R₂·(e·(1/n₂)), stage-2 codes after
    // stage 1's words.
    const float n1 = norm_tpr(v);
    {
        const float inv = n1 > 0.0f ? 1.0f / n1 : 0.0f;
#pragma unroll
        for (int j = 0; j < D; j++) {
            const float y = v[j] * inv;
            // cen1[c] by selects, the arrays kept in registers (up to 2 bits from lloyd_code's
            // own compares: 384 fewer instructions a page at d = 128).
#if BITS <= 2
            float cy;
            const u32 c = lloyd_code_centroid<NTHR>(y, thr1, cen1, &cy);
#else
            const u32 c = lloyd_code<NTHR>(y, thr1);
            float cy = cen1[0];
#pragma unroll
            for (int i = 1; i <= NTHR; i++) cy = c == (u32)i ? cen1[i] : cy;
#endif
            put_code<BITS>(W, j, c);
            v[j] = n1 > 0.0f ? y - cy : 0.0f;
        }
    }
    const float n2 = norm_tpr(v);
    {
        const float inv = n2 > 0.0f ? 1.0f / n2 : 0.0f;
        const vec4u* sg = (const vec4u*)(sgh + D);
#pragma unroll
        for (int i = 0; i < D / 4; i++) {
            vec4u s = sg[i];
            v[4 * i] = v[4 * i] * inv * __uint_as_float(s.x);
            v[4 * i + 1] = v[4 * i + 1] * inv * __uint_as_float(s.y);
            v[4 * i + 2] = v[4 * i + 2] * inv * __uint_as_float(s.z);
            v[4 * i + 3] = v[4 * i + 3] * inv * __uint_as_float(s.w);
        }
        fwht_tpr(v);
#pragma unroll
        for (int j = 0; j < D; j++) put_code<BITS2>(W + MSE_BYTES / 4, j, lloyd_code<NTHR2>(v[j] * rot_scale, thr2));
    }
    side_tpr(st, lane, n1, n2);
    return false;
}
#endif

#if FMT_QUERY && KRVQ
#define KTW (2 * D + KDENSE_W)
#define QUERY_FMT 1
// R₁·q for stage 1, then R₂·R₁·q for stage 2 (kt: R₁'s signs, then R₂'s; dense: then R₁, R₂).
__device__ __forceinline__ void query_fmt(float x, float* __restrict__ qprep, size_t at, size_t second,
                                          const float* __restrict__ kt, float krot_scale, float* s, int tid) {
    qprep[at] = x;
    __syncthreads();  // the rotation's last reads of s
    qprep[at + second] = rot_block<KDENSE_W, false>(x * kt[D + tid], s, tid, kt + 2 * D + D * D) * krot_scale;
}
#endif

#if FMT_DECODE && VK == 5
// A value row's dims [g*VC, (g+1)*VC) of stage 1 (v_row, through vtab) and of stage 2
// (v_second, at V_MSE_BYTES through v2tab) as VC/2 f16x2 pairs (2m, 2m+1).
__device__ __forceinline__ void v_row(const u8* vr, int g, const u16* tab, u32* out) {
    seg_codes_to_h2<VB, VC, V_MSE_BYTES / 4>(vr, g * VC, tab, out);
}
__device__ __forceinline__ void v_second(const u8* vr, int g, const u16* v2t, u32* out) {
    seg_codes_to_h2<V2B, VC, (V_ROW_BYTES - V_MSE_BYTES) / 4>(vr + V_MSE_BYTES, g * VC, v2t, out);
}
#endif

#if FMT_QUERY && VRVQ
#define VALUE_POST_FMT 1
#define VACC2 1
// combine's merged accumulators a (stage 1's domain) and a2 (stage 2's) to R₁ᵀ·(a + R₂ᵀ·a2)
// (turboquant_rvq.rs finish); vt: R₁'s signs, R₂'s, then (dense) R₁'s and R₂'s matrices.
__device__ __forceinline__ float value_post_fmt(float a, float a2, const float* __restrict__ vsigns, float vrot_scale,
                                                float* s, int hkv, int tid) {
    const float* const vt = vsigns + (size_t)hkv * (2 * D + VDENSE_W);
    a2 = rot_block<VDENSE_W, true>(a2, s, tid, vt + 2 * D + D * D) * (vt[D + tid] * vrot_scale);
    return rot_block<VDENSE_W, true>(a + a2, s, tid, vt + 2 * D) * (vt[tid] * vrot_scale);
}
#endif
