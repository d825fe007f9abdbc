// Per-step helpers around decode_pages. Grid: (n_q_heads, batch); block: D threads.
// prep_query: q · log2(e)/√d, rotated once by the key rotation (the rotated-query trick).
// combine: merge the split partials (all splits' (m, l) read at once, weights through shared
// memory), one inverse value rotation on the merged accumulator,
// then the exact fp16 tail, then normalize. Defines: D, G, KROT, VROT, PDL (combine launched
// as a programmatic dependent of decode_pages: it scores the tail while decode_pages runs).
#define NEG_INF (-__int_as_float(0x7f800000))

// In-place Walsh-Hadamard transform of the block's D values (thread tid holds element tid):
// butterflies (a + o, a − o) of span < 32 by shuffles, wider ones through s.
__device__ __forceinline__ float fwht_block(float x, float* s, int tid) {
#pragma unroll
    for (int h = 1; h < 32 && h < D; h <<= 1) {
        const float o = __shfl_xor_sync(FULL_MASK, x, h);
        x = (tid & h) ? (o - x) : (x + o);
    }
    for (int h = 32; h < D; h <<= 1) {
        s[tid] = x;
        __syncthreads();
        const float o = s[tid ^ h];
        __syncthreads();
        x = (tid & h) ? (o - x) : (x + o);
    }
    return x;
}

extern "C" __global__ void prep_query(const float* __restrict__ q, float* __restrict__ qprep,
                                      const float* __restrict__ ksigns, float krot_scale) {
    __shared__ float s[D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const size_t at = ((size_t)b * n_q + hq) * D + tid;
    float x = q[at] * (LOG2E / sqrtf((float)D));
#if KROT
    x *= ksigns[(hq / G) * D + tid];
    x = fwht_block(x, s, tid) * krot_scale;
#endif
    qprep[at] = x;
}

extern "C" __global__ void combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                   int n_splits, int n_kv, const float* __restrict__ q,
                                   const u16* __restrict__ ktail, const u16* __restrict__ vtail,
                                   const int* __restrict__ n_tail, int tail_cap,
                                   const float* __restrict__ vsigns, float vrot_scale,
                                   float* __restrict__ out, int flat_nb, int flat_pages) {
    extern __shared__ float ts[];  // tail_cap tail scores, n_splits weights, n_splits sums
    __shared__ float s[D];
    __shared__ float qs[D];
    __shared__ float red[D / 32];
    float* const wsp = ts + tail_cap;
    float* const lsp = wsp + n_splits;
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const int hkv = hq / G, gi = hq % G;
    const int warp = tid >> 5, lane = tid & 31;
    // This row's partials: n_splits from row · n_splits, or (FLAT: flat_nb blocks over rows of
    // flat_pages pages laid end to end) those of the blocks k holding its first … last page,
    // at k + row.
    const int row = b * n_kv + hkv;
    size_t first = (size_t)row * n_splits;
    if (flat_nb > 0) {
        const long long n = (long long)gridDim.y * n_kv * flat_pages, x = (long long)row * flat_pages;
        const int k0 = flat_block(x, n, flat_nb);
        n_splits = flat_block(x + flat_pages - 1, n, flat_nb) - k0 + 1;
        first = (size_t)k0 + row;
    }
    const size_t base = first * G + gi;
    // The tail's scores first: they need only q and the tail, not decode_pages' partials.
    const int nt = n_tail[b];
    const u16* const kt = ktail + ((size_t)row * tail_cap) * D;
    const u16* const vt = vtail + ((size_t)row * tail_cap) * D;
    if (nt > 0) {
        qs[tid] = q[((size_t)b * n_q + hq) * D + tid] * (LOG2E / sqrtf((float)D));
        __syncthreads();
        for (int tok = warp; tok < nt; tok += D / 32) {
            float a = 0.0f;
            for (int i = lane; i < D; i += 32) a += qs[i] * h2f(kt[(size_t)tok * D + i]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL_MASK, a, off);
            if (lane == 0) ts[tok] = a;
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // One L2 round trip for all the partials: the first PRE splits' accumulators and every
    // split's (m, l) are loaded at once (m and l kept in shared memory); the weights 2^(m − M)
    // follow; the remaining accumulators' loads are independent of each other.
    const int PRE = 8;
    float pre[PRE];
#pragma unroll
    for (int sp = 0; sp < PRE; sp++) pre[sp] = sp < n_splits ? part_acc[(base + (size_t)sp * G) * D + tid] : 0.0f;
    float M = NEG_INF;
    for (int sp = tid; sp < n_splits; sp += D) {
        const size_t o = base + (size_t)sp * G;
        const float m = part_ml[o * 2];
        wsp[sp] = m;
        lsp[sp] = part_ml[o * 2 + 1];
        M = fmaxf(M, m);
    }
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
        const float mw = wsp[sp];
        const float w = mw == NEG_INF ? 0.0f : exp2f(mw - M);
        wsp[sp] = w;
        L += w == 0.0f ? 0.0f : lsp[sp] * w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(FULL_MASK, L, off);
    if (lane == 0) red[warp] = L;
    __syncthreads();
    L = 0.0f;
#pragma unroll
    for (int w = 0; w < D / 32; w++) L += red[w];
    float A = 0.0f;
#pragma unroll
    for (int sp = 0; sp < PRE; sp++) {
        if (sp < n_splits && wsp[sp] != 0.0f) A += pre[sp] * wsp[sp];
    }
#pragma unroll 8
    for (int sp = PRE; sp < n_splits; sp++) {
        const float w = wsp[sp];
        if (w != 0.0f) A += part_acc[(base + (size_t)sp * G) * D + tid] * w;
    }
#if VROT
    A = fwht_block(A, s, tid) * (vsigns[hkv * D + tid] * vrot_scale);
#endif
    if (nt > 0) {
        __syncthreads();  // the tail scores are in ts
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
