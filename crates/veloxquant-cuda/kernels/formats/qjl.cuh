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

#if FMT_ROW && (KIND == 4 || KIND == 5) && RPW > 1
// The sign bits of S·x for RPW rows of a warp at once, written at byte `off` of rows t0.. of
// `page` (encode_rows' multi-row path; x_r in v[r] and staged in xs, RPW·D floats of the
// warp's shared memory): each load of Sᵀ serves
// every row, and the products are summed by FMA. That sum and the CPU's (each product
// rounded, then added) both lie within γ·Σ_e|S_ie·x_e| of the exact one (γ = D·2⁻²⁴/(1 − D·2⁻²⁴),
// any order), so they differ by at most 2γ·‖S_i‖·‖x‖ (Cauchy–Schwarz; ‖S_i‖ summed here,
// ‖x‖ = nrm[r], 1 % margin for both, plus an absolute 1e-37 for underflow): where every
// output of a row lies beyond that bound, its sign is the CPU's. A row with an output within
// it, or with a norm too large (or not finite) to bound its sums, is redone by
// sketch_signs_warp, operation for operation (random rows: ~2 % of them at d = 128).
__device__ __forceinline__ void sketch_signs_rows(const float (*v)[EPL], const float* nrm, u8* page, int t0,
                                                  int off, float* xs, const float* __restrict__ st, int lane) {
#pragma unroll
    for (int r = 0; r < RPW; r++) {
#pragma unroll
        for (int k = 0; k < EPL; k++) xs[r * D + lane + 32 * k] = v[r][k];
    }
    __syncwarp();
    float p[RPW][EPL], ns[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        ns[k] = 0.0f;
#pragma unroll
        for (int r = 0; r < RPW; r++) p[r][k] = 0.0f;
    }
    const float* const stl = st + lane;
#pragma unroll 1
    for (int e = 0; e < D; e += 4) {
        float se[4][EPL];
#pragma unroll
        for (int j = 0; j < 4; j++) {
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                se[j][k] = stl[(size_t)(e + j) * D + 32 * k];
                ns[k] = fmaf(se[j][k], se[j][k], ns[k]);
            }
        }
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const float4 xv = *(const float4*)(xs + r * D + e);  // x_e … x_{e+3}, one broadcast
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                p[r][k] = fmaf(se[0][k], xv.x, p[r][k]);
                p[r][k] = fmaf(se[1][k], xv.y, p[r][k]);
                p[r][k] = fmaf(se[2][k], xv.z, p[r][k]);
                p[r][k] = fmaf(se[3][k], xv.w, p[r][k]);
            }
        }
    }
    __syncwarp();  // xs read by every lane before the next rows overwrite it
    const float rel = 2.0f * (float)D * 5.9604645e-8f * 1.01f;
    float bs[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) bs[k] = rel * sqrtf(ns[k]);
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        u8* const row = page + (t0 + r) * ROW_BYTES + off;
        bool sure = nrm[r] < 1e30f;
#pragma unroll
        for (int k = 0; k < EPL; k++) sure = sure && fabsf(p[r][k]) > bs[k] * nrm[r] + 1e-37f;
        if (__all_sync(FULL_MASK, sure)) {
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                const u32 w = __ballot_sync(FULL_MASK, p[r][k] > 0.0f);
                if (lane == 0) ((u32*)row)[k] = w;
            }
        } else {
            sketch_signs_warp(v[r], row, st, lane);
        }
    }
}
#endif
#if FMT_ROW && KIND == 4 && RPW > 1
// RPW rows t0.. of a page (encode_rows' multi-row path): ‖x‖ and the signs, as encode_row_fmt.
__device__ __forceinline__ void encode_rows_fmt(float (*v)[EPL], u8* page, int t0, const float* __restrict__ sg,
                                                const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, float* xs, int lane) {
    float nrm[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) nrm[r] = norm_warp(v[r]);
    sketch_signs_rows(v, nrm, page, t0, 0, xs, sg, lane);
#pragma unroll
    for (int r = 0; r < RPW; r++) put_sides(page, t0 + r, nrm[r], 1, lane);
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
    // Four chains. At d ≤ 128 every load of Sᵀ (L2) is issued before the first use: one
    // round trip before the decode step can start, where a pipelined loop took several.
    st += tid;
    float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
#if D <= 128
    float sv[D];
#pragma unroll
    for (int e = 0; e < D; e++) sv[e] = st[(size_t)e * D];
#pragma unroll
    for (int e = 0; e < D; e += 4) {
        p0 += sv[e] * s[e];
        p1 += sv[e + 1] * s[e + 1];
        p2 += sv[e + 2] * s[e + 2];
        p3 += sv[e + 3] * s[e + 3];
    }
#else
#pragma unroll 8
    for (int e = 0; e < D; e += 4) {
        p0 += st[(size_t)e * D] * s[e];
        p1 += st[(size_t)(e + 1) * D] * s[e + 1];
        p2 += st[(size_t)(e + 2) * D] * s[e + 2];
        p3 += st[(size_t)(e + 3) * D] * s[e + 3];
    }
#endif
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
