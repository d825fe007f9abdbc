// fp16 (fp16.rs): each row is D f16 values.
#if FMT_ROW && KIND == 0
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        if (LIVE(k, lane)) ((u16*)row)[lane + 32 * k] = f2h(v[k]);
    }
}
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? h2f(((const u16*)row)[lane + 32 * k]) : 0.0f;
}
#endif

#if FMT_DECODE && KK == 0
// One key row's quarter for thread t: KS*2 f16x2 = (slots j0,j1), (j2,j3) per k-step.
__device__ __forceinline__ void k_row(const u8* kr, int t, const u16* tab, u32* out) {
#if QD % 8 == 0
    const vec4u* p = (const vec4u*)(kr + t * QD * 2);
#pragma unroll
    for (int i = 0; i < QD / 8; i++) {
        vec4u v = p[i];
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
#else
    const u32* p = (const u32*)(kr + t * QD * 2);  // 4-byte aligned: QD even
#pragma unroll
    for (int i = 0; i < QD / 2; i++) out[i] = p[i];
#endif
}
#endif
#if FMT_DECODE && VK == 0
// One value row's dims [g*VC, (g+1)*VC) as VC/2 f16x2 pairs (2m, 2m+1).
__device__ __forceinline__ void v_row(const u8* vr, int g, const u16* tab, u32* out) {
#if VC % 8 == 0
    const vec4u* p = (const vec4u*)(vr + g * VC * 2);
#pragma unroll
    for (int i = 0; i < VC / 8; i++) {
        vec4u v = p[i];
        out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
    }
#else
    // d = 96: VC = 12 halves at byte 24·g, 4-byte aligned.
    const u32* p = (const u32*)(vr + g * VC * 2);
#pragma unroll
    for (int i = 0; i < VC / 2; i++) out[i] = p[i];
#endif
}
#endif
