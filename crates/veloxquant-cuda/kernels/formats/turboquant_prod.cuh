// turboquant_prod (turboquant_prod.rs over sketch.rs' token layout): per row the (BITS)-bit
// codes of y = R·x/‖R·x‖ (turboquant_mse's at one bit less), then at MSE_BYTES the sign bits
// of S·(y − ŷ) (qjl's sketch of the residual); per token ‖x‖ and the residual norm γ. The
// transform argument is the rotation's signs, then Sᵀ.
#if FMT_ROW && KIND == 5
#define TW (D + D * D + DENSE_W)
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
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
    put_two_sides(page, t, prod_row_warp(v, row, sg + D, thresholds, centroids, lane), lane);
}
// ‖x‖·(ŷ + c·γ·Sᵀ·sign) (turboquant_prod.rs decode_page), still rotated.
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const u16* side = (const u16*)(page + T * ROW_BYTES);
    codes_row_decode(page, t, cen, lane, v);
    sketch_back_warp(row + MSE_BYTES, SKETCH_C(D) * h2f(side[T + t]) * h2f(side[t]), sg + D, lane, v);
}
#endif

#if FMT_ROW && KIND == 5 && RPW > 1
// RPW rows t0.. of a page (encode_rows' multi-row path), as encode_row_fmt: stage 1 and γ per
// row, then the residuals' signs together (sketch_signs_rows).
__device__ __forceinline__ void encode_rows_fmt(float (*v)[EPL], u8* page, int t0, const float* __restrict__ sg,
                                                const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, float* xs, int lane) {
    float norm[RPW], gam[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        norm[r] = stage1_warp(v[r], page + (t0 + r) * ROW_BYTES, thresholds, centroids, lane);
        gam[r] = norm_warp(v[r]);
    }
    sketch_signs_rows(v, gam, page, t0, MSE_BYTES, xs, sg + D, lane);
#pragma unroll
    for (int r = 0; r < RPW; r++) put_two_sides(page, t0 + r, make_float2(norm[r], gam[r]), lane);
}
#endif

#if FMT_DECODE && KK == 5
// Two-segment key rows (turboquant_prod; turboquant_rvq and qjl:2x read as them): the first
// segment's codes, then the second's through its own table (k_second).
// One key row's quarter for thread t: KS*2 f16x2 = (slots j0,j1), (j2,j3) per k-step.
__device__ __forceinline__ void k_row(const u8* kr, int t, const u16* tab, u32* out) {
    seg_codes_to_h2<KB, QD, K_MSE_BYTES / 4>(kr, t * QD, tab, out);
}
// A key row's second segment (turboquant_prod's signs with the table {−1, +1}, turboquant_rvq's
// stage-2 codes) through its table k2t, in k_row's order.
__device__ __forceinline__ void k_second(const u8* kr, int t, const u16* k2t, u32* out) {
    seg_codes_to_h2<K2B, QD, (K_ROW_BYTES - K_MSE_BYTES) / 4>(kr + K_MSE_BYTES, t * QD, k2t, out);
}
#endif

#if FMT_QUERY && KPROD
#define KTW (D + D * D + KDENSE_W)
#define QUERY_FMT 1
// R·q for the codes, then c·S·R·q for the signs (kt: the rotation's signs, then Sᵀ).
__device__ __forceinline__ void query_fmt(float x, float* __restrict__ qprep, size_t at, size_t second,
                                          const float* __restrict__ kt, float krot_scale, float* s, int tid) {
    qprep[at] = x;
    __syncthreads();  // fwht_block's last reads of s
    qprep[at + second] = sketch_query_block(x, s, kt + D, SKETCH_C(D), tid);
}
#endif
