// q8_0 (q8_0.rs, llama.cpp's block): per 32 values an f16 scale d = amax/127, then 32 int8
// round(x/d).
#if FMT_ROW && KIND == 1
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below)
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
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
}
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u8* blk = row + 34 * k;
        v[k] = h2f(*(const u16*)blk) * (float)(signed char)blk[2 + lane];
    }
}
#endif

#if FMT_DECODE && KK == 1
// One key row's quarter for thread t: KS*2 f16x2 = (slots j0,j1), (j2,j3) per k-step.
__device__ __forceinline__ void k_row(const u8* kr, int t, const u16* tab, u32* out) {
    // The thread's QD dims span QD/32 blocks (d = 256: two) or part of one.
#pragma unroll
    for (int i = 0; i < QD / 2; i++) {
        const int dim = t * QD + 2 * i;
        const u8* base = kr + 34 * (dim / 32);
        const u32 s2 = (u32)*(const u16*)base * 0x10001u;
        out[i] = i8x2_h2(*(const u16*)(base + 2 + dim % 32), s2);
    }
}
#endif
#if FMT_DECODE && VK == 1
// One value row's dims [g*VC, (g+1)*VC) as VC/2 f16x2 pairs (2m, 2m+1).
__device__ __forceinline__ void v_row(const u8* vr, int g, const u16* tab, u32* out) {
#if 32 % VC == 0
    int blk = (g * VC) / 32, off = (g * VC) % 32;  // VC divides 32: within one block
    const u8* base = vr + 34 * blk;
    u32 s2 = *(const u16*)base;
    s2 |= s2 << 16;
    const u16* qv = (const u16*)(base + 2 + off);
#pragma unroll
    for (int m = 0; m < VC / 2; m++) out[m] = i8x2_h2(qv[m], s2);
#else
    // d = 96 (VC = 12): the dims may cross a block; each pair (even first dim) lies in one.
#pragma unroll
    for (int m = 0; m < VC / 2; m++) {
        const int dim = g * VC + 2 * m;
        const u8* base = vr + 34 * (dim / 32);
        out[m] = i8x2_h2(*(const u16*)(base + 2 + dim % 32), (u32)*(const u16*)base * 0x10001u);
    }
#endif
}
#endif

#if FMT_PAGE && KIND == 1
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
#pragma unroll
    for (int k = 0; k < D / 32; k++) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[32 * k + i]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        u32 hb = f2h(d);
        PUTB(W, 34 * k, hb);
        PUTB(W, 34 * k + 1, hb >> 8);
#pragma unroll
        for (int i = 0; i < 32; i++) {
            float r = roundf(v[32 * k + i] * id);
            r = fminf(fmaxf(r, -128.0f), 127.0f);
            PUTB(W, 34 * k + 2 + i, (u32)(int)r);
        }
    }
    return false;
}
#endif
