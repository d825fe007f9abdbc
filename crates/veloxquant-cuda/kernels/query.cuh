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
