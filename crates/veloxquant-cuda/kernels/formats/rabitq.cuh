// rabitq (rabitq.rs): per row the sign bits of R·x, then per token ‖R·x‖ and x0 = ⟨ō, R·x⟩
// (= ‖R·x‖₁/(‖R·x‖·√d)). Decode reads the signs as 1-bit codes {−1, +1} scaled by
// ‖x‖/(x0·√d) against the 4-bit query (prep_query).
#if FMT_ROW && KIND == 6
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below)
// rabitq's row (rabitq.rs encode_row_unchecked): v = R·x (rotated by the caller); the sign
// bits (v ≥ 0), ‖v‖ and x0 = ‖v‖₁/(‖v‖·√d) with ‖v‖₁ summed in f64 in element order as the
// CPU does (lane 0 walks the elements, each broadcast by a shuffle); returns (‖v‖, x0).
__device__ __forceinline__ float2 rabitq_row_warp(const float* v, u8* row, int lane) {
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u32 w = __ballot_sync(FULL_MASK, v[k] >= 0.0f);
        if (lane == 0) put_packed_word<1>(row, k, w);
    }
    const float norm = norm_warp(v);  // d = 80, 112: the partial chunk's missing elements are 0
    double l1 = 0.0;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        for (int l = 0; l < 32; l++) l1 = __dadd_rn(l1, (double)fabsf(__shfl_sync(FULL_MASK, v[k], l)));
    }
    const float x0 = norm > 0.0f ? (float)__ddiv_rn(l1, __dmul_rn((double)norm, sqrt((double)D))) : 0.0f;
    return make_float2(norm, x0);
}
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
    put_two_sides(page, t, rabitq_row_warp(v, row, lane), lane);
}
// ±‖x‖/(x0·√d) by the sign bits (rabitq.rs decode_page), still rotated.
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const u16* side = (const u16*)(page + T * ROW_BYTES);
    const float x0 = h2f(side[T + t]);
    const float w = x0 > 0.0f ? h2f(side[t]) / x0 * (1.0f / sqrtf((float)D)) : 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? (((packed_word<1>(row, k) >> lane) & 1u) ? w : -w) : 0.0f;
}
#endif

#if FMT_DECODE && KRATIO
// Token i's key scale ‖x‖/(x0·√d) (rabitq.rs decode_page; 0 when x0 = 0) from the page's sides,
// by the fast reciprocal (≤ 2 ulp): x0 = ‖v‖₁/(‖v‖·√d) ∈ [1/√d, 1] is a normal f16, and an
// IEEE division per token was an eighth of the FAST loop's instructions.
__device__ __forceinline__ float kscale(const u16* kn, int i) {
    const float x0 = h2f(kn[T + i]);
    return x0 > 0.0f ? __fdividef(h2f(kn[i]), x0) * (1.0f / sqrtf((float)D)) : 0.0f;
}
#endif

#if FMT_PAGE && KIND == 6
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
    // rabitq (rabitq_row_warp, one lane per row): the sign bits of R·x, ‖R·x‖ and
    // x0 = ‖R·x‖₁ / (‖R·x‖·√d), the L1 norm summed in f64 in element order.
#pragma unroll
    for (int j = 0; j < D; j++) W[j >> 5] |= (v[j] >= 0.0f ? 1u : 0u) << (j & 31);
    const float norm = norm_tpr(v);
    double l1 = 0.0;
#pragma unroll
    for (int j = 0; j < D; j++) l1 = __dadd_rn(l1, (double)fabsf(v[j]));
    const float x0 = norm > 0.0f ? (float)__ddiv_rn(l1, __dmul_rn((double)norm, sqrt((double)D))) : 0.0f;
    side_tpr(st, lane, norm, x0);
    return false;
}
#endif

#if (FMT_QUERY && KRABITQ) || (FMT_PREFILL && KQUANT)
// rabitq.rs quantize_query on this thread's element r of R·q: lo, hi over the block's D
// values, Δ = (hi − lo)/15, u = round((r − lo)/Δ) clamped to [0, 15], returns lo + Δ·u (every
// operation rounded as the CPU's: no contraction).
// d = 80 and 112: the block's last warp has 16 threads, which reduce among themselves.
__device__ __forceinline__ float rabitq_query_block(float r, int tid) {
    constexpr int NW = (D + 31) / 32;
    __shared__ float mm[2][NW];
    float lo = r, hi = r;
#if D % 32 == 0
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
    }
#else
    static_assert(D % 32 == 16, "a partial warp of 16 threads");
    const bool part = (tid >> 5) == D / 32;
    const u32 mask = part ? 0xffffu : FULL_MASK;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        if (part && off == 16) continue;  // warp-uniform
        lo = fminf(lo, __shfl_xor_sync(mask, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(mask, hi, off));
    }
#endif
    if ((tid & 31) == 0) { mm[0][tid >> 5] = lo; mm[1][tid >> 5] = hi; }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; w++) { lo = fminf(lo, mm[0][w]); hi = fmaxf(hi, mm[1][w]); }
    const float delta = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
    const float u = delta > 0.0f ? fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(r, lo), delta)), 0.0f), 15.0f) : 0.0f;
    return __fadd_rn(lo, __fmul_rn(delta, u));
}
#endif
#if FMT_QUERY && KRABITQ
#define PREP_QUERY_FMT 1
// The 4-bit query of R·q (unscaled; rabitq_query_block), then the scale log2(e)/√d.
__device__ __forceinline__ void prep_query_fmt(float q, float* __restrict__ out, const float* __restrict__ kt,
                                               float krot_scale, float* s, int tid) {
    float r = q * kt[tid];
    r = rabitq_query_block(rot_block<KDENSE_W, false>(r, s, tid, kt + D) * krot_scale, tid);
    *out = __fmul_rn(r, LOG2E / sqrtf((float)D));
}
#endif

#if FMT_PREFILL && KQUANT
// rabitq keys: each query row as the format scores it, q̄ = Rᵀ·quant₄(R·q) (rabitq.rs
// scoring_query_ref), for the GEMM against the decoded codes. Grid: (rows, NKV); block: D
// threads; q16 rows in the grouped layout (stride q_gstride per KV head), out rows packed.
extern "C" __global__ void rabitq_query(const u16* __restrict__ q16, long q_gstride, const float* __restrict__ ksigns,
                                        float krot_scale, u16* __restrict__ out, int rows) {
    __shared__ float sh[D];
    const int row = blockIdx.x, g = blockIdx.y, tid = threadIdx.x;
    const float* kt = ksigns + (size_t)g * (D + KDENSE_W);  // signs, then a dense rotation's R
    const float sg = kt[tid];
    float r = rot_block<KDENSE_W, false>(h2f(q16[g * q_gstride + (size_t)row * D + tid]) * sg, sh, tid, kt + D) *
              krot_scale;
    r = rabitq_query_block(r, tid);
    __syncthreads();  // the rotation's last reads of sh
    r = rot_block<KDENSE_W, true>(r, sh, tid, kt + D) * (sg * krot_scale);
    out[((size_t)g * rows + row) * D + tid] = f2h(r);
}
#endif
