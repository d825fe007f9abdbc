// q4_0 (q4_0.rs, llama.cpp's block): per 32 values an f16 scale d = max/−8 (max: the value of
// largest magnitude), then 16 bytes of nibbles min(⌊x/d + 8.5⌋, 15): value i in byte i's low
// nibble, value i + 16 in its high nibble.
#if FMT_ROW && KIND == 2
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below)
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
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
}
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const u8* blk = row + 18 * k;
        const u8 b = blk[2 + (lane & 15)];
        const int q = lane < 16 ? (b & 0xF) : (b >> 4);
        v[k] = h2f(*(const u16*)blk) * (float)(q - 8);
    }
}
#endif

#if FMT_DECODE && KK == 2
// q4_0's keys: k-step ks takes byte bb of the thread's run of 16-byte nibble blocks, low nibbles
// (dims byte, byte + 1 of the block) in slots 0-1, high (+ 16) in slots 2-3 (the query's map).
#define KDIM_FMT 1
__device__ __forceinline__ int kdim_fmt(int t, int ks, int j) {
    const int bb = t * QD / 2 + 2 * ks;
    return (bb / 16) * 32 + bb % 16 + (j & 1) + (j >= 2 ? 16 : 0);
}
// One key row's quarter for thread t: KS*2 f16x2 = (slots j0,j1), (j2,j3) per k-step.
__device__ __forceinline__ void k_row(const u8* kr, int t, const u16* tab, u32* out) {
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const int bb = t * QD / 2 + 2 * ks;  // as kdim
        const u8* base = kr + 18 * (bb / 16);
        const u32 s2 = (u32)*(const u16*)base * 0x10001u;
        u32 t2 = prmt(*(const u16*)(base + 2 + bb % 16), 0u, 0x4140u);  // byte0 -> half 0, byte1 -> half 1
        out[2 * ks] = u4x2_h2(t2, s2);
        out[2 * ks + 1] = u4x2_h2(t2 >> 4, s2);
    }
}
#endif
#if FMT_DECODE && VK == 2
// One value row's dims [g*VC, (g+1)*VC) as VC/2 f16x2 pairs (2m, 2m+1).
__device__ __forceinline__ void v_row(const u8* vr, int g, const u16* tab, u32* out) {
#if 32 % VC == 0
    const u8* base = vr + 18 * ((g * VC) / 32);  // VC divides 32: within one block
    u32 s2 = *(const u16*)base;
    s2 |= s2 << 16;
#pragma unroll
    for (int m = 0; m < VC / 2; m++) {
        // Dims o, o + 1 of the block: byte o % 16, low nibbles below 16, high from 16.
        const int o = (g * VC) % 32 + 2 * m;
        out[m] = u4x2_h2(prmt(*(const u16*)(base + 2 + o % 16), 0u, 0x4140u) >> ((o / 16) * 4), s2);
    }
#else
    // d = 96 (VC = 12): the dims may cross a block; each pair (even first dim) lies in one.
#pragma unroll
    for (int m = 0; m < VC / 2; m++) {
        const int dim = g * VC + 2 * m, o = dim % 32;
        const u8* base = vr + 18 * (dim / 32);
        out[m] = u4x2_h2(prmt(*(const u16*)(base + 2 + o % 16), 0u, 0x4140u) >> ((o / 16) * 4),
                         (u32)*(const u16*)base * 0x10001u);
    }
#endif
}
#endif

#if FMT_PAGE && KIND == 2
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
#pragma unroll
    for (int k = 0; k < D / 32; k++) {
        float amax = 0.0f, mx = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[32 * k + i]);
            if (amax < a) {
                amax = a;
                mx = v[32 * k + i];
            }
        }
        float d = mx / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        u32 hb = f2h(d);
        PUTB(W, 18 * k, hb);
        PUTB(W, 18 * k + 1, hb >> 8);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float f0 = v[32 * k + i] * id + 8.5f;
            float f1 = v[32 * k + i + 16] * id + 8.5f;
            int q0 = (int)truncf(fminf(fmaxf(f0, -128.0f), 127.0f));
            int q1 = (int)truncf(fminf(fmaxf(f1, -128.0f), 127.0f));
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            PUTB(W, 18 * k + 2 + i, (u32)(q0 & 0xF) | ((u32)(q1 & 0xF) << 4));
        }
    }
    return false;
}
#endif
