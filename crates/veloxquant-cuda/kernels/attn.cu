// Per-step helpers around decode_pages. Grid: (n_q_heads, batch); block: D threads.
// prep_query: q · log2(e)/√d, rotated once by the key rotation (the rotated-query trick).
// combine: merge the split partials (all splits' (m, l) read at once, weights through shared
// memory), one inverse value rotation on the merged accumulator,
// then the exact fp16 tail, then normalize. Defines: D, G, KROT, VROT.
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ void fwht_block(float* s, int tid) {
    for (int h = 1; h < D; h <<= 1) {
        __syncthreads();
        float a = s[tid], o = s[tid ^ h];
        __syncthreads();
        s[tid] = (tid & h) ? (o - a) : (a + o);
    }
    __syncthreads();
}

extern "C" __global__ void prep_query(const float* __restrict__ q, float* __restrict__ qprep,
                                      const float* __restrict__ ksigns, float krot_scale) {
    __shared__ float s[D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const size_t at = ((size_t)b * n_q + hq) * D + tid;
    float x = q[at] * (LOG2E / sqrtf((float)D));
#if KROT
    x *= ksigns[(hq / G) * D + tid];
    s[tid] = x;
    fwht_block(s, tid);
    x = s[tid] * krot_scale;
#endif
    qprep[at] = x;
}

extern "C" __global__ void combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                   int n_splits, int n_kv, const float* __restrict__ q,
                                   const u16* __restrict__ ktail, const u16* __restrict__ vtail,
                                   const int* __restrict__ n_tail, int tail_cap,
                                   const float* __restrict__ vsigns, float vrot_scale,
                                   float* __restrict__ out) {
    extern __shared__ float ts[];  // tail_cap tail scores, then n_splits split weights
    __shared__ float s[D];
    __shared__ float qs[D];
    __shared__ float red[D / 32];
    float* const wsp = ts + tail_cap;
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const int hkv = hq / G, gi = hq % G;
    const int warp = tid >> 5, lane = tid & 31;
    const size_t base = ((size_t)(b * n_kv + hkv) * n_splits) * G + gi;
    // The splits' (m, l) are read by all threads at once (one L2 round trip, not one per
    // split), the weights 2^(m - M) go to shared memory, and the accumulator sum's loads are
    // independent of each other.
    float M = NEG_INF;
    for (int sp = tid; sp < n_splits; sp += D) M = fmaxf(M, part_ml[(base + (size_t)sp * G) * 2]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, off));
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = red[0];
#pragma unroll
    for (int w = 1; w < D / 32; w++) M = fmaxf(M, red[w]);
    __syncthreads();
    float L = 0.0f;
    for (int sp = tid; sp < n_splits; sp += D) {
        const size_t o = base + (size_t)sp * G;
        const float mw = part_ml[o * 2];
        const float w = mw == NEG_INF ? 0.0f : exp2f(mw - M);
        wsp[sp] = w;
        L += w == 0.0f ? 0.0f : part_ml[o * 2 + 1] * w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(FULL_MASK, L, off);
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = 0.0f;
#pragma unroll
    for (int w = 0; w < D / 32; w++) L += red[w];
    float A = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < n_splits; sp++) {
        const float w = wsp[sp];
        if (w != 0.0f) A += part_acc[(base + (size_t)sp * G) * D + tid] * w;
    }
#if VROT
    s[tid] = A;
    fwht_block(s, tid);
    A = s[tid] * (vsigns[hkv * D + tid] * vrot_scale);
#endif
    const int nt = n_tail[b];
    if (nt > 0) {
        qs[tid] = q[((size_t)b * n_q + hq) * D + tid] * (LOG2E / sqrtf((float)D));
        __syncthreads();
        const u16* kt = ktail + ((size_t)(b * n_kv + hkv) * tail_cap) * D;
        const u16* vt = vtail + ((size_t)(b * n_kv + hkv) * tail_cap) * D;
        for (int tok = warp; tok < nt; tok += D / 32) {
            float a = 0.0f;
            for (int i = lane; i < D; i += 32) a += qs[i] * h2f(kt[(size_t)tok * D + i]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL_MASK, a, off);
            if (lane == 0) ts[tok] = a;
        }
        __syncthreads();
        float mt = NEG_INF;
        for (int tok = 0; tok < nt; tok++) mt = fmaxf(mt, ts[tok]);
        const float m2 = fmaxf(M, mt);
        const float sc = M == NEG_INF ? 0.0f : exp2f(M - m2);
        L *= sc;
        A *= sc;
        for (int tok = 0; tok < nt; tok++) {
            const float w = exp2f(ts[tok] - m2);
            L += w;
            A += w * h2f(vt[(size_t)tok * D + tid]);
        }
    }
    out[((size_t)b * n_q + hq) * D + tid] = L > 0.0f ? A / L : 0.0f;
}
