// qjl (qjl.rs over sketch.rs, m = d): per row the sign bits of S·x (1-bit codes for decode,
// with the table {−1, +1}), then ‖x‖ in f16. The transform argument is Sᵀ (S[i][e] at
// [e·D + i]) instead of rotation signs; turboquant_prod sketches its residual with the same
// helpers.
#if FMT_ROW && KIND == 4
#define TW (D * D)
#endif
#if FMT_ROW && (KIND == 4 || KIND == 5)
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

#if FMT_ROW && (KIND == 4 || KIND == 5)
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

#if FMT_ROW && KIND == 4
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
    const float scale = norm_warp(v);
    sketch_signs_warp(v, row, sg, lane);
    put_sides(page, t, scale, 1, lane);
}
// k̂ = c·‖k‖·Sᵀ·sign (qjl.rs decode_page); rot_scale is c.
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const u16* side = (const u16*)(page + T * ROW_BYTES);
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = 0.0f;
    sketch_back_warp((const u32*)row, rot_scale * h2f(side[t]), sg, lane, v);
}
#endif

#if FMT_QUERY && (KSKETCH || KPROD)
// The query in the sketch domain, c·S·x (st: Sᵀ, d × d per KV head; thread tid = row tid of S,
// one coalesced row of Sᵀ per step).
__device__ __forceinline__ float sketch_query_block(float x, float* s, const float* __restrict__ st, float sc,
                                                    int tid) {
    s[tid] = x;
    __syncthreads();
    // Four chains, unrolled: the loads of Sᵀ (L2) overlap instead of one per FMA latency.
    st += tid;
    float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
#pragma unroll 8
    for (int e = 0; e < D; e += 4) {
        p0 += st[(size_t)e * D] * s[e];
        p1 += st[(size_t)(e + 1) * D] * s[e + 1];
        p2 += st[(size_t)(e + 2) * D] * s[e + 2];
        p3 += st[(size_t)(e + 3) * D] * s[e + 3];
    }
    return ((p0 + p1) + (p2 + p3)) * sc;
}
#endif
#if FMT_QUERY && KSKETCH
#define KTW (D * D)
#define QUERY_FMT 1
// qjl: c·S·q (kt: Sᵀ; krot_scale: c).
__device__ __forceinline__ void query_fmt(float x, float* __restrict__ qprep, size_t at, size_t second,
                                          const float* __restrict__ kt, float krot_scale, float* s, int tid) {
    qprep[at] = sketch_query_block(x, s, kt, krot_scale, tid);
}
#endif
