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

// Each format's prefill kernels (FMT_PREFILL): rabitq's rabitq_query (KQUANT).
// @formats FMT_PREFILL

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

// Flash prefill (D = 64 or 128, not KQUANT): the same attention as the GEMM path above in one
// pass, without the score matrix. A block takes FW·16 rows (row = t·G + i of one KV head);
// each warp 16 of them, its queries held as mma A fragments. Keys arrive in tiles of FBN
// through two cp.async stages: first the dense tiles of K̃/Ṽ (codes decoded, sinks exact)
// over [0, min(lo, p + 1)) of the block's last row, then the exact tiles of the window over
// [lo of its first row, last p]. Each element is masked to its row's source rule (dense:
// j < min(lo(p), p + 1); exact: lo(p) ≤ j ≤ p), so a key is counted once, from the source
// decode would read; online softmax (base 2) merges the tiles. P reaches the PV mma from
// the score fragments in registers; Ṽ's B fragments come by ldmatrix.trans.
#if D == 64 || D == 128
#ifndef FW
#define FW 4  // warps per block, 16 rows each (Tuning::prefill_warps)
#endif
#define FBN 64
#define FLD (D + 8)  // tile row stride in halves: 16-byte rows, 4 banks apart
#define FKS (D / 16)
#define FNT (D / 8)

__device__ __forceinline__ int lo_of(int pos, int coded0) { return NSINK + coded_after(pos + 1, coded0); }

// 2^x by the SFU (exp2(−inf) = 0; flushes subnormal results, which weigh nothing here).
__device__ __forceinline__ float fex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// One launch serves several sequences' chunks (grid z = item): item z's band, its first row
// in q16/out16, and its own dense copy ([NKV][kd_ld][D]) and window ([NKV][win_ld][D]).
struct FlashItem {
    BandArgs a;
    int row0;
    int pad;
    const u16* kd;
    const u16* vd;
    const u16* kwin;
    const u16* vwin;
};

extern "C" __global__ void __launch_bounds__(FW * 32) flash_prefill(const FlashItem* __restrict__ items,
        const u16* __restrict__ q16, long q_gstride, long kd_ld, long win_ld, u16* __restrict__ out16) {
    extern __shared__ __align__(16) u16 fsm[];  // [stage][K, V][FBN][FLD]
    const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, t4 = lane & 3;
    const FlashItem& item = items[blockIdx.z];
    const BandArgs a = item.a;
    const int row0 = item.row0;
    const u16* const __restrict__ kd = item.kd;
    const u16* const __restrict__ vd = item.vd;
    const u16* const __restrict__ kwin = item.kwin;
    const u16* const __restrict__ vwin = item.vwin;
    const int rows = a.n_q * G;
    // Blocks past this item's rows leave; the rest run last rows first (the causal mask makes
    // them the longest), so the long blocks start in the first wave.
    const int nblk = (rows + FW * 16 - 1) / (FW * 16);
    if ((int)blockIdx.x >= nblk) return;
    const int rb = (nblk - 1 - (int)blockIdx.x) * FW * 16;
    const int rlast = min(rb + FW * 16, rows) - 1;
    const int pos_last = a.p0 + rlast / G;
    const int dense_end = min(lo_of(pos_last, a.coded0), pos_last + 1);
    const int ex_begin = lo_of(a.p0 + rb / G, a.coded0);
    const int nd = (dense_end + FBN - 1) / FBN;
    const int ne = ex_begin <= pos_last ? (pos_last + 1 - ex_begin + FBN - 1) / FBN : 0;
    const int ntiles = nd + ne;

    // This thread's two rows (gid, gid + 8 of its warp) and their masks.
    int dlim[2], elo[2], ehi[2];
    const u16* qrow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = min(rb + warp * 16 + gid + 8 * h, rlast);
        const int pos = a.p0 + r / G, lo = lo_of(pos, a.coded0);
        dlim[h] = min(lo, pos + 1);
        elo[h] = lo;
        ehi[h] = pos;
        qrow[h] = q16 + g * q_gstride + ((size_t)row0 * G + r) * D;
    }
    u32 qa[FKS][4];
#pragma unroll
    for (int ks = 0; ks < FKS; ks++) {
        qa[ks][0] = *(const u32*)(qrow[0] + ks * 16 + 2 * t4);
        qa[ks][1] = *(const u32*)(qrow[1] + ks * 16 + 2 * t4);
        qa[ks][2] = *(const u32*)(qrow[0] + ks * 16 + 8 + 2 * t4);
        qa[ks][3] = *(const u32*)(qrow[1] + ks * 16 + 8 + 2 * t4);
    }

    // Tile `it` into stage `st`: rows clamped to the source's last valid row (finite values
    // that the masks weigh by 0).
    const u32 sbase = (u32)__cvta_generic_to_shared(fsm);
    auto load = [&](int it, int st) {
        const bool ex = it >= nd;
        const int j0 = ex ? ex_begin + (it - nd) * FBN : it * FBN;
        const u16* ks = ex ? kwin + ((size_t)g * win_ld + (j0 - a.win_lo)) * D : kd + ((size_t)g * kd_ld + j0) * D;
        const u16* vs = ex ? vwin + ((size_t)g * win_ld + (j0 - a.win_lo)) * D : vd + ((size_t)g * kd_ld + j0) * D;
        const int nvalid = a.n_end - j0;  // rows j0 .. n_end − 1 exist in either source
        const u32 kb = sbase + (u32)(st * 2 * FBN * FLD) * 2, vb = kb + FBN * FLD * 2;
        for (int c = threadIdx.x; c < FBN * D / 8; c += FW * 32) {
            const int r = c / (D / 8), c8 = (c % (D / 8)) * 8;
            const int rr = min(r, nvalid - 1);
            cp16(kb + (r * FLD + c8) * 2, ks + (size_t)rr * D + c8);
            cp16(vb + (r * FLD + c8) * 2, vs + (size_t)rr * D + c8);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

    const float sl2 = a.scale * LOG2E;
    float o[FNT][4];
#pragma unroll
    for (int n = 0; n < FNT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    if (ntiles > 0) load(0, 0);
    for (int it = 0; it < ntiles; it++) {
        if (it + 1 < ntiles) {
            load(it + 1, (it + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();
        const bool ex = it >= nd;
        const int j0 = ex ? ex_begin + (it - nd) * FBN : it * FBN;
        const u32 ksm = sbase + (u32)((it & 1) * 2 * FBN * FLD) * 2;
        const u32 vsm = sbase + (u32)((it & 1) * 2 * FBN * FLD + FBN * FLD) * 2;
        float s[FBN / 8][4];
        // K's B fragments by ldmatrix.x4: lane l addresses key row nt·8 + l%8 at dims 8·(l/8)
        // of a 32-dim span, giving b0, b1 of two k-steps.
        const u32 krow = ksm + (u32)(((lane & 7) * FLD + (lane >> 3) * 8) * 2);
#pragma unroll
        for (int nt = 0; nt < FBN / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < FKS; ks += 2) {
                u32 b0, b1, b2, b3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                             : "r"(krow + (u32)((nt * 8 * FLD + ks * 16) * 2)));
                mma16816(s[nt], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
                mma16816(s[nt], qa[ks + 1][0], qa[ks + 1][1], qa[ks + 1][2], qa[ks + 1][3], b2, b3);
            }
        }
        float mt[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < FBN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, j = j0 + nt * 8 + 2 * t4 + (e & 1);
                const bool ok = ex ? (j >= elo[h] && j <= ehi[h]) : (j < dlim[h]);
                s[nt][e] = ok ? s[nt][e] * sl2 : NEG_INF;
                mt[h] = fmaxf(mt[h], s[nt][e]);
            }
        }
        float alpha[2], mu[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mt[h] = fmaxf(mt[h], __shfl_xor_sync(FULL_MASK, mt[h], 1));
            mt[h] = fmaxf(mt[h], __shfl_xor_sync(FULL_MASK, mt[h], 2));
            const float mn = fmaxf(m[h], mt[h]);
            mu[h] = mn == NEG_INF ? 0.0f : mn;  // no key yet: every weight is exp2(−inf) = 0
            alpha[h] = fex2(m[h] - mu[h]);
            m[h] = mn;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < FNT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
#pragma unroll
        for (int nt = 0; nt < FBN / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] = fex2(s[nt][e] - mu[e >> 1]);
                l[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int kk = 0; kk < FBN / 16; kk++) {
            const u32 a0 = pack_h2(s[2 * kk][0], s[2 * kk][1]), a1 = pack_h2(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]), a3 = pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            // Lanes 0–15 address key rows kk·16 + lane at dims n0, lanes 16–31 the same rows at n0 + 8.
            const u32 vrow = vsm + (u32)(((kk * 16 + (lane & 15)) * FLD + (lane >> 4) * 8) * 2);
#pragma unroll
            for (int n = 0; n < FNT; n += 2) {
                u32 b0, b1, b2, b3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                             : "r"(vrow + n * 8 * 2));
                mma16816(o[n], a0, a1, a2, a3, b0, b1);
                mma16816(o[n + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        __syncthreads();  // this stage is refilled by the next iteration's load
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rb + warp * 16 + gid + 8 * h;
        if (r > rlast) continue;
        const float inv = 1.0f / l[h];
        const int t = r / G, i = r % G;
        u16* dst = out16 + ((size_t)(row0 + t) * NKV * G + g * G + i) * D + 2 * t4;
#pragma unroll
        for (int n = 0; n < FNT; n++) *(u32*)(dst + n * 8) = pack_h2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
}
#endif
