// The Llama graph's element-wise kernels (ops.rs): embedding, RMSNorm, RoPE, SwiGLU, greedy
// sampling, random weights. Activations between layers are f32 (the residual stream);
// matrix-product inputs are f16 (cuBLAS, f32 accumulation). No defines.

// x[t][:] = f32(table[ids[t]][:]). Grid: rows; block 256.
extern "C" __global__ void embed(const int* __restrict__ ids, const u16* __restrict__ table, int h,
                                 float* __restrict__ x) {
    const int t = blockIdx.x;
    const u16* e = table + (size_t)ids[t] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)t * h + i] = h2f(e[i]);
}

__device__ __forceinline__ float block_sum(float x, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    __syncthreads();
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = 0.0f;
    for (int w = 0; w < nw; w++) x += red[w];
    return x;
}

// out16[r] = f16(x[r] · w / rms(x[r])) for rows r of x (row stride ld_x). Grid: rows; block
// 256. The row is read once into registers (h ≤ 256 · RMS_MAX): these launches are latency-
// bound at decode batch sizes (a few rows), so one pass and one reduction.
#define RMS_MAX 32
extern "C" __global__ void __launch_bounds__(256) rmsnorm(const float* __restrict__ x, long ld_x,
                                                         const float* __restrict__ w, int h, float eps,
                                                         u16* __restrict__ out16) {
    __shared__ float red[32];
    const float* r = x + (size_t)blockIdx.x * ld_x;
    float v[RMS_MAX];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_MAX; k++) {
        const int i = threadIdx.x + k * 256;
        v[k] = i < h ? r[i] : 0.0f;
        ss += v[k] * v[k];
    }
    ss = block_sum(ss, red);
    const float s = rsqrtf(ss / (float)h + eps);
#pragma unroll
    for (int k = 0; k < RMS_MAX; k++) {
        const int i = threadIdx.x + k * 256;
        if (i < h) out16[(size_t)blockIdx.x * h + i] = f2h(v[k] * s * w[i]);
    }
}

// As rmsnorm, one warp per row (8 rows per 256-thread block, h ≤ 32 · RMSW_MAX): for prefill's
// thousands of rows, where a block per row runs ~7 latency-bound rounds of blocks per SM.
#define RMSW_MAX 64
extern "C" __global__ void __launch_bounds__(256) rmsnorm_rows(const float* __restrict__ x, long ld_x,
                                                              const float* __restrict__ w, int h, float eps,
                                                              int n_rows, u16* __restrict__ out16) {
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n_rows) return;  // whole warps leave together
    const float* r = x + (size_t)row * ld_x;
    float v[RMSW_MAX];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMSW_MAX; k++) {
        const int i = lane + 32 * k;
        v[k] = i < h ? r[i] : 0.0f;
        ss += v[k] * v[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    const float s = rsqrtf(ss / (float)h + eps);
#pragma unroll
    for (int k = 0; k < RMSW_MAX; k++) {
        const int i = lane + 32 * k;
        if (i < h) out16[(size_t)row * h + i] = f2h(v[k] * s * w[i]);
    }
}

// RoPE on the fused QKV rows (llama.cpp's adjacent pairs 2i, 2i+1): q to q32 [t][HQ][D] (f32,
// decode) or, when q16 is set, to q16 in the prefill GEMM's grouped layout [g][t][G][D]; k to
// k32 [t][HKV][D]. pos[t] is the row's position; cos/sin [n_ctx][D/2]. Grid: rows; block 256.
extern "C" __global__ void rope(const float* __restrict__ qkv, int ld, const int* __restrict__ pos,
                                const float* __restrict__ cs, const float* __restrict__ sn, int hq, int hkv, int d,
                                int n_rows, float* __restrict__ q32, u16* __restrict__ q16,
                                float* __restrict__ k32) {
    const int t = blockIdx.x, half = d / 2, grp = hq / hkv;
    const float* row = qkv + (size_t)t * ld;
    const float* c = cs + (size_t)pos[t] * half;
    const float* s = sn + (size_t)pos[t] * half;
    for (int e = threadIdx.x; e < (hq + hkv) * half; e += blockDim.x) {
        const int head = e / half, i = e % half;
        const float a = row[head * d + 2 * i], b = row[head * d + 2 * i + 1];
        const float x0 = a * c[i] - b * s[i], x1 = a * s[i] + b * c[i];
        if (head < hq) {
            if (q16) {
                const int g = head / grp, gi = head % grp;
                u16* o = q16 + (((size_t)g * n_rows + t) * grp + gi) * d + 2 * i;
                o[0] = f2h(x0);
                o[1] = f2h(x1);
            } else {
                float* o = q32 + ((size_t)t * hq + head) * d + 2 * i;
                o[0] = x0;
                o[1] = x1;
            }
        } else {
            float* o = k32 + ((size_t)t * hkv + head - hq) * d + 2 * i;
            o[0] = x0;
            o[1] = x1;
        }
    }
}

// act16[t][j] = f16(silu(gate) · up), gate_up rows = [gate (f) | up (f)]. Grid-stride.
extern "C" __global__ void swiglu(const float* __restrict__ gu, int f, long n, u16* __restrict__ act16) {
    for (long e = (long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long)gridDim.x * blockDim.x) {
        const long t = e / f, j = e % f;
        const float g = gu[t * 2 * f + j], u = gu[t * 2 * f + f + j];
        act16[e] = f2h(g / (1.0f + __expf(-g)) * u);
    }
}

// ids[r] = argmax of logits row r (first index on ties, NaN never wins). Grid: rows; block
// 1024 (a few rows of a large vocabulary at decode).
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* __restrict__ logits, int n_vocab,
                                                              int* __restrict__ ids) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    const float* r = logits + (size_t)blockIdx.x * n_vocab;
    float best = -__int_as_float(0x7f800000);
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = r[i];
        if (v > best) { best = v; idx = i; }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            const float v = bv[threadIdx.x + o];
            const int j = bi[threadIdx.x + o];
            if (v > bv[threadIdx.x] || (v == bv[threadIdx.x] && j < bi[threadIdx.x])) {
                bv[threadIdx.x] = v;
                bi[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = bi[0] == 0x7fffffff ? 0 : bi[0];
}

// Counter-based N(0, 1) (splitmix64 + Box–Muller): element i of a stream depends only on
// (seed, i), so weights are reproducible for any grid.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float normal_at(u64 seed, u64 i) {
    const u64 r = mix64(seed + 0x9e3779b97f4a7c15ull * (i + 1));
    const float u1 = ((float)(r >> 40) + 1.0f) * (1.0f / 16777216.0f);
    const float u2 = (float)((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * __logf(u1)) * __cosf(6.2831853f * u2);
}

// Sampling (veloxquant-llm's sample.rs is the reference, the same arithmetic): per row, the
// top-k and top-p thresholds on the logit found by bisection over the ordered bit patterns
// of f32 (count / mass of the logits at or above a key), then the Gumbel-max among the
// kept tokens with noise hashed from (seed, draw, id). params per row: [f32 temperature |
// f32 top_p << 32, top_k, seed, draw]; temperature ≤ 0 or top_k = 1: argmax. Grid: rows;
// block 1024.
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ bool finite_f(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ double gumbel_at(u64 seed, u64 draw, u64 id) {
    const u64 h = mix64(mix64(seed + 0x9e3779b97f4a7c15ull * (draw + 1)) + 0x9e3779b97f4a7c15ull * (id + 1));
    const double u = ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    return -log(-log(u));
}
template <typename T, typename Op> __device__ __forceinline__ T block_reduce(T x, T* red, Op op) {
    red[threadIdx.x] = x;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] = op(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    const T r = red[0];
    __syncthreads();
    return r;
}
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* __restrict__ logits, int n_vocab,
                                                              const u64* __restrict__ params,
                                                              int* __restrict__ ids) {
    __shared__ double red_d[1024];
    __shared__ int red_i[1024];
    const float* r = logits + (size_t)blockIdx.x * n_vocab;
    const u64* P = params + 4 * (size_t)blockIdx.x;
    const float temp = __uint_as_float((unsigned)(P[0] & 0xffffffffu));
    const float top_p = __uint_as_float((unsigned)(P[0] >> 32));
    const u64 top_k = P[1], seed = P[2], draw = P[3];
    const bool greedy = !(temp > 0.0f) || top_k == 1;
    // The largest finite logit (greedy: its first index), the smallest, and their count.
    float mx = -__int_as_float(0x7f800000), mn = __int_as_float(0x7f800000);
    int cnt = 0, arg = 0x7fffffff;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = r[i];
        if (finite_f(v)) {
            if (v > mx) { mx = v; arg = i; }
            mn = fminf(mn, v);
            cnt++;
        }
    }
    float* red_f = (float*)red_d;
    const float m = block_reduce(mx, red_f, [](float a, float b) { return fmaxf(a, b); });
    const float lo_v = block_reduce(mn, red_f, [](float a, float b) { return fminf(a, b); });
    const int n_fin = block_reduce(cnt, red_i, [](int a, int b) { return a + b; });
    if (n_fin == 0) {
        if (threadIdx.x == 0) ids[blockIdx.x] = 0;
        return;
    }
    if (greedy) {
        const int a = block_reduce(mx == m ? arg : 0x7fffffff, red_i, [](int a, int b) { return min(a, b); });
        if (threadIdx.x == 0) ids[blockIdx.x] = a;
        return;
    }
    unsigned floor_key = order_key(lo_v);
    const unsigned top_key = order_key(m) + 1;
    if (top_k > 0 && top_k < (u64)n_fin) {
        // The largest key with at least top_k finite logits at or above it.
        unsigned lo = floor_key, hi = top_key;
        while (hi - lo > 1) {
            const unsigned mid = lo + (hi - lo) / 2;
            int c = 0;
            for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
                const float v = r[i];
                c += finite_f(v) && order_key(v) >= mid;
            }
            if ((u64)block_reduce(c, red_i, [](int a, int b) { return a + b; }) >= top_k) lo = mid; else hi = mid;
        }
        floor_key = lo;
    }
    if (top_p < 1.0f) {
        // The largest key whose logits at or above it hold top_p of the kept mass.
        auto mass = [&](unsigned key) {
            double w = 0.0;
            for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
                const float v = r[i];
                if (finite_f(v) && order_key(v) >= key) w += exp((double)(v - m) / (double)temp);
            }
            return block_reduce(w, red_d, [](double a, double b) { return a + b; });
        };
        const double need = (double)top_p * mass(floor_key);
        unsigned lo = floor_key, hi = top_key;
        while (hi - lo > 1) {
            const unsigned mid = lo + (hi - lo) / 2;
            if (mass(mid) >= need) lo = mid; else hi = mid;
        }
        floor_key = lo;
    }
    // Gumbel-max over the kept tokens, the smaller id on ties.
    double best = -__longlong_as_double(0x7ff0000000000000ll);
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float v = r[i];
        if (finite_f(v) && order_key(v) >= floor_key) {
            const double sc = (double)(v - m) / (double)temp + gumbel_at(seed, draw, (u64)i);
            if (sc > best) { best = sc; bi = i; }
        }
    }
    const double b = block_reduce(best, red_d, [](double a, double c) { return fmax(a, c); });
    const int a = block_reduce(best == b ? bi : 0x7fffffff, red_i, [](int x, int y) { return min(x, y); });
    if (threadIdx.x == 0) ids[blockIdx.x] = a == 0x7fffffff ? 0 : a;
}

// out[i] = f16(scale · N(0,1)) (scale = 0: all `offset`).
extern "C" __global__ void fill_f16(u16* __restrict__ out, u64 n, u64 seed, float scale, float offset) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f2h(offset + scale * normal_at(seed, i));
}
extern "C" __global__ void fill_f32(float* __restrict__ out, u64 n, u64 seed, float scale, float offset) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = offset + scale * normal_at(seed, i);
}

// meta[d[1 + 2i]] = d[2 + 2i] for i < d[0]: the host's page-table and counter writes, applied
// in stream order (inside a captured step too). One block.
extern "C" __global__ void apply_deltas(const int* __restrict__ d, int* __restrict__ meta) {
    const int n = d[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x) meta[d[1 + 2 * i]] = d[2 + 2 * i];
}
