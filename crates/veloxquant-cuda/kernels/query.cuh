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
// x ← M·x (INV: Mᵀ·x) for the block's D values, M a dense rotation (row-major D × D, head
// sizes that are not a power of two): decode's query and output, within its tolerance.
template <bool INV>
__device__ __forceinline__ float dense_block(float x, float* s, int tid, const float* __restrict__ m) {
    s[tid] = x;
    __syncthreads();
    float a = 0.0f;
#pragma unroll 8
    for (int j = 0; j < D; j++) a += (INV ? m[(size_t)j * D + tid] : m[(size_t)tid * D + j]) * s[j];
    __syncthreads();
    return a;
}
// A rotation's core for the block (after its signs, before its scale; both ones when
// dense): the FWHT, or with DW dense words the matrix m.
template <int DW, bool INV>
__device__ __forceinline__ float rot_block(float x, float* s, int tid, const float* __restrict__ m) {
    if (DW) return dense_block<INV>(x, s, tid, m);
    return fwht_block(x, s, tid);
}
