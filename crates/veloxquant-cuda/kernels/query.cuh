// Block helpers shared by attn.cu and prefill.cu (one thread per element of a D-vector).
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

// rabitq.rs quantize_query on this thread's element r of R·q: lo, hi over the block's D
// values, Δ = (hi − lo)/15, u = round((r − lo)/Δ) clamped to [0, 15], returns lo + Δ·u (every
// operation rounded as the CPU's: no contraction).
__device__ __forceinline__ float rabitq_query_block(float r, int tid) {
    __shared__ float mm[2][D / 32];
    float lo = r, hi = r;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
    }
    if ((tid & 31) == 0) { mm[0][tid >> 5] = lo; mm[1][tid >> 5] = hi; }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < D / 32; w++) { lo = fminf(lo, mm[0][w]); hi = fmaxf(hi, mm[1][w]); }
    const float delta = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
    const float u = delta > 0.0f ? fminf(fmaxf(roundf(__fdiv_rn(__fsub_rn(r, lo), delta)), 0.0f), 15.0f) : 0.0f;
    return __fadd_rn(lo, __fmul_rn(delta, u));
}
