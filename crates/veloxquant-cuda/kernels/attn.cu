// Per-step helpers around decode_pages. Grid: (n_q_heads, batch); block: D threads.
// prep_query: q · log2(e)/√d, rotated once by the key rotation (the rotated-query trick).
// combine: merge the split partials, one inverse value rotation on the merged accumulator,
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
    extern __shared__ float ts[];
    __shared__ float s[D];
    __shared__ float qs[D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const int hkv = hq / G, gi = hq % G;
    const size_t base = ((size_t)(b * n_kv + hkv) * n_splits) * G + gi;
    float M = NEG_INF;
    for (int sp = 0; sp < n_splits; sp++) M = fmaxf(M, part_ml[(base + (size_t)sp * G) * 2]);
    float L = 0.0f, A = 0.0f;
    if (M != NEG_INF) {
        for (int sp = 0; sp < n_splits; sp++) {
            const size_t o = base + (size_t)sp * G;
            const float mw = part_ml[o * 2];
            if (mw != NEG_INF) {
                const float sc = exp2f(mw - M);
                L += part_ml[o * 2 + 1] * sc;
                A += part_acc[o * D + tid] * sc;
            }
        }
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
        const int warp = tid >> 5, lane = tid & 31;
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
