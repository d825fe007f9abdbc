// Fused encode: one warp per token row (grid: ceil(rows/8) blocks of 256 threads).
// Lane l holds elements l, l+32, … (the canonical reduction order of reduce.rs), so norms,
// the Hadamard butterflies and the EDEN dot round exactly as on the CPU (--fmad=false).
// Defines: D, T, KIND (0 fp16, 1 q8_0, 2 q4_0, 3 codes), BITS, ROT, EDEN, IN_KIND
// (0 f32, 1 f16, 2 bf16), ROW_BYTES, PAGE_BYTES.
#define EPL (D / 32)
#define NTHR ((1 << BITS) - 1)

__device__ __forceinline__ float load_in(const void* x, size_t i) {
#if IN_KIND == 0
    return ((const float*)x)[i];
#elif IN_KIND == 1
    return h2f(((const u16*)x)[i]);
#else
    return bf2f(((const u16*)x)[i]);
#endif
}

// Canonical unnormalized FWHT over the warp's strided layout (h = 1, 2, 4, …).
__device__ __forceinline__ void fwht_warp(float* v, int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            float o = __shfl_xor_sync(FULL_MASK, v[k], h);
            v[k] = (lane & h) ? (o - v[k]) : (v[k] + o);
        }
    }
#pragma unroll
    for (int hk = 1; hk < EPL; hk <<= 1) {
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if ((k & hk) == 0) {
                float a = v[k], b = v[k + hk];
                v[k] = a + b;
                v[k + hk] = a - b;
            }
        }
    }
}

__device__ __forceinline__ float warp_sum_canonical(float acc) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = acc + __shfl_xor_sync(FULL_MASK, acc, off);
    return acc;
}

extern "C" __global__ void __launch_bounds__(256) encode_rows(
    const void* __restrict__ x, int n_rows, const int* __restrict__ page_idx,
    const int* __restrict__ head_idx, u8* __restrict__ pool, const float* __restrict__ signs,
    float rot_scale, const float* __restrict__ thresholds, const float* __restrict__ centroids) {
    int row_id = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (row_id >= n_rows) return;
    int job = row_id / T, t = row_id % T;
    float v[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = load_in(x, (size_t)row_id * D + lane + 32 * k);
    u8* page = pool + (size_t)page_idx[job] * PAGE_BYTES;
    u8* row = page + t * ROW_BYTES;
#if ROT
    const float* sg = signs + (size_t)head_idx[job] * D;
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * sg[lane + 32 * k];
    fwht_warp(v, lane);
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * rot_scale;
#endif

#if KIND == 0
#pragma unroll
    for (int k = 0; k < EPL; k++) ((u16*)row)[lane + 32 * k] = f2h(v[k]);
#elif KIND == 1
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
#elif KIND == 2
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
#else
    float thr[NTHR];
#pragma unroll
    for (int j = 0; j < NTHR; j++) thr[j] = thresholds[j];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ss = ss + v[k] * v[k];
    float norm = sqrtf(warp_sum_canonical(ss));
    float y[EPL];
    u32 code[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        y[k] = norm > 0.0f ? v[k] / norm : 0.0f;
        u32 c = 0;
#pragma unroll
        for (int j = 0; j < NTHR; j++) c += (thr[j] < y[k]) ? 1u : 0u;
        code[k] = c;
    }
    // Chunk k (codes 32k..32k+31) is exactly words k*BITS .. k*BITS+BITS-1 of the row.
    u32* words = (u32*)row;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        u32 word = 0;
        int w = lane < BITS ? lane : 0;
        int c0 = (32 * w) / BITS;
#pragma unroll
        for (int q = 0; q < 32 / BITS + 2; q++) {
            int c = c0 + q;
            u32 cv = __shfl_sync(FULL_MASK, code[k], c & 31);
            int sh = c * BITS - 32 * w;
            if (c < 32) {
                if (sh >= 0 && sh < 32) word |= cv << sh;
                else if (sh < 0 && sh > -BITS) word |= cv >> (-sh);
            }
        }
        if (lane < BITS) words[k * BITS + lane] = word;
    }
    float scale = norm;
#if EDEN
    float ip = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ip = ip + y[k] * centroids[code[k]];
    ip = warp_sum_canonical(ip);
    if (ip > 0.0f) scale = norm / ip;
#endif
    if (lane == 0) {
        ((u16*)(page + T * ROW_BYTES))[t] = f2h(scale);
        if (t == 0 && PAGE_BYTES > T * ROW_BYTES + 2 * T) {
            for (int i = T * ROW_BYTES + 2 * T; i < PAGE_BYTES; i++) page[i] = 0;
        }
    }
#endif
}

// Read bandwidth probe and a hashed N(0,1) generator (f16) for benchmarks.
extern "C" __global__ void read_probe(const vec4u* __restrict__ p, unsigned long long n, u32* out) {
    u32 acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        vec4u v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) out[0] = acc;
}

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void fill_normal_f16(u16* out, unsigned long long n, unsigned long long seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        u64 r = mix64(seed + i * 0x9E3779B97F4A7C15ull);
        float u1 = ((float)(r >> 40) + 1.0f) * (1.0f / 16777216.0f);
        float u2 = (float)((r >> 8) & 0xFFFFFF) * (1.0f / 16777216.0f);
        out[i] = f2h(sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
    }
}
