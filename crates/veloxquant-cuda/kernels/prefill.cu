// Prefill attention over the cache, one sequence's chunk at a time (prefill.rs): scores
// S = Q·K̃ᵀ and the output P·Ṽ come from cuBLAS over the dense decoded cache (K̃, Ṽ: codes
// decoded, sinks and the window exact); these kernels make each query see exactly what decode
// would have seen. For the query at position p, keys [S, S + coded_after(p + 1)) are read
// through the codes and the newer ones — the band [lo(p), p] — exact (compressed.rs's split).
// band_softmax replaces the band's scores by exact ones (q · k_exact), masks keys after p and
// normalizes: P (f16, the band zeroed) for the value GEMM, the band's weights apart; band_v
// adds the band's exact values and writes the attention output as f16 in the model's layout.
// Grid: (n_q · G rows of one KV group, NKV), row = t · G + i (token t, group head i).
// Defines: D, G, NKV, T, NSINK, R (recent window), ROWMODE, KQUANT (rabitq keys: the codes
// are scored against the 4-bit query of rabitq_query, the sinks and the band against q).
#define NEG_INF (-__int_as_float(0x7f800000))

// Tokens held as codes once n tokens are in, starting from coded0 (compressed.rs).
__device__ __forceinline__ int coded_after(int n, int coded0) {
    const int old = max(n - NSINK, 0);
    const int ex = max(old - coded0, 0);
#if ROWMODE
    return max(coded0, old - R);
#else
    return ex >= R + T ? coded0 + (ex - R) / T * T : coded0;
#endif
}

__device__ __forceinline__ float block_reduce(float x, float* red, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float y = __shfl_xor_sync(FULL_MASK, x, o);
        x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = red[0];
    for (int w = 1; w < nw; w++) x = is_max ? fmaxf(x, red[w]) : x + red[w];
    return x;
}

struct BandArgs {
    int p0;        // position of the chunk's first query
    int n_q;       // queries in the chunk
    int n_end;     // keys (positions 0 .. n_end)
    int coded0;    // tokens in pages before the chunk
    int win_lo;    // position of the exact window's first row
    int ld_s;      // row stride of S (f32) and P (f16), elements
    int band_cap;  // row stride of the band weights
    float scale;   // 1/√D
};

// rabitq keys: each query row as the format scores it, q̄ = Rᵀ·quant₄(R·q) (rabitq.rs
// scoring_query_ref), for the GEMM against the decoded codes. Grid: (rows, NKV); block: D
// threads; q16 rows in the grouped layout (stride q_gstride per KV head), out rows packed.
extern "C" __global__ void rabitq_query(const u16* __restrict__ q16, long q_gstride, const float* __restrict__ ksigns,
                                        float krot_scale, u16* __restrict__ out, int rows) {
    __shared__ float sh[D];
    const int row = blockIdx.x, g = blockIdx.y, tid = threadIdx.x;
    const float sg = ksigns[(size_t)g * D + tid];
    float r = fwht_block(h2f(q16[g * q_gstride + (size_t)row * D + tid]) * sg, sh, tid) * krot_scale;
    r = rabitq_query_block(r, tid);
    __syncthreads();  // fwht_block's last reads of sh
    r = fwht_block(r, sh, tid) * (sg * krot_scale);
    out[((size_t)g * rows + row) * D + tid] = f2h(r);
}

extern "C" __global__ void band_softmax(BandArgs a, float* __restrict__ s, u16* __restrict__ p,
                                        float* __restrict__ wband, const u16* __restrict__ q16, long q_gstride,
                                        const u16* __restrict__ kwin, long win_ld, const u16* __restrict__ kd,
                                        long kd_ld) {
    extern __shared__ float bs[];  // band scores (band_cap)
    __shared__ float red[32];
    const int row = blockIdx.x, g = blockIdx.y, t = row / G;
    const int pos = a.p0 + t;
    const int lo = NSINK + coded_after(pos + 1, a.coded0);
    const int nb = pos + 1 - lo;
    const size_t ro = (size_t)g * a.n_q * G + row;
    float* srow = s + ro * a.ld_s;
    u16* prow = p + ro * a.ld_s;
    const u16* q = q16 + g * q_gstride + (size_t)row * D;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int b = warp; b < nb; b += nw) {
        const u16* k = kwin + ((size_t)g * win_ld + (lo + b - a.win_lo)) * D;
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32) acc += h2f(q[d]) * h2f(k[d]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
        if (lane == 0) bs[b] = acc * a.scale;
    }
#if KQUANT
    // The sinks' scores in S used the 4-bit query: again with q, as the CPU scores them.
    for (int j = warp; j < min(NSINK, min(lo, pos + 1)); j += nw) {
        const u16* k = kd + ((size_t)g * kd_ld + j) * D;
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32) acc += h2f(q[d]) * h2f(k[d]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
        if (lane == 0) srow[j] = acc * a.scale;
    }
#endif
    __syncthreads();
    // Keys [0, lim) from S (codes, and the sinks); the band [lo, pos] exact; none after pos
    // (a query among the sinks has lo > pos: no band, and only keys up to itself).
    const int lim = min(lo, pos + 1);
    float m = NEG_INF;
    for (int j = threadIdx.x; j < lim; j += blockDim.x) m = fmaxf(m, srow[j]);
    for (int b = threadIdx.x; b < nb; b += blockDim.x) m = fmaxf(m, bs[b]);
    m = block_reduce(m, red, true);
    float z = 0.0f;
    for (int j = threadIdx.x; j < lim; j += blockDim.x) z += __expf(srow[j] - m);
    for (int b = threadIdx.x; b < nb; b += blockDim.x) z += __expf(bs[b] - m);
    z = block_reduce(z, red, false);
    const float inv = 1.0f / z;
    for (int j = threadIdx.x; j < a.n_end; j += blockDim.x) prow[j] = f2h(j < lim ? __expf(srow[j] - m) * inv : 0.0f);
    float* wrow = wband + ro * a.band_cap;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) wrow[b] = __expf(bs[b] - m) * inv;
}

// out16[token][head][D] = o[g][row] + Σ_band w · v_exact. Block: D threads.
extern "C" __global__ void band_v(BandArgs a, const float* __restrict__ o, const float* __restrict__ wband,
                                  const u16* __restrict__ vwin, long win_ld, u16* __restrict__ out16, int row0) {
    const int row = blockIdx.x, g = blockIdx.y, t = row / G, i = row % G, d = threadIdx.x;
    const int pos = a.p0 + t;
    const int lo = NSINK + coded_after(pos + 1, a.coded0);
    const int nb = pos + 1 - lo;
    const size_t ro = (size_t)g * a.n_q * G + row;
    float acc = o[ro * D + d];
    const float* wrow = wband + ro * a.band_cap;
    for (int b = 0; b < nb; b++) acc += wrow[b] * h2f(vwin[((size_t)g * win_ld + (lo + b - a.win_lo)) * D + d]);
    out16[((size_t)(row0 + t) * NKV * G + g * G + i) * D + d] = f2h(acc);
}
