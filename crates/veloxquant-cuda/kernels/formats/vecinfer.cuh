// vecinfer (vecinfer.rs): per row the BITS-bit index (BITS ∈ {4, 8}, LSB first) of the nearest
// of the 2^BITS centroids of each GRP-dim sub-vector of z = R·(x/λ); nothing per token. Per
// head (the transform, TW = (2 + 2^BITS)·D floats): the rotation's signs, λ, the codebooks
// ((D/GRP) × 2^BITS × GRP, sub-space major). Decode dequantizes a sub-vector to its
// centroid's values (f16 for the mma) and accumulates values in the z domain; combine applies
// Rᵀ and λ once per head.
#if (FMT_ROW && KIND == 10) || (FMT_DECODE && (KK == 10 || VK == 10))
// Sub-vector s's B-bit index in a row (LSB first).
template <int B>
__device__ __forceinline__ u32 vq_index(const u8* row, int s) {
    return B == 8 ? (u32)row[s] : ((u32)row[s >> 1] >> ((s & 1) * 4)) & 15u;
}
#endif

#if FMT_ROW && KIND == 10
#define VQ_K (1 << BITS)
#define VQ_NS (D / GRP)
#define TW ((2 + VQ_K) * D)
#define ROW_PRE 1
#define ROW_POST 1
// x/λ before the rotation (vecinfer.rs forward).
__device__ __forceinline__ void row_pre_fmt(float* v, const float* __restrict__ sg, int lane) {
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] / sg[D + lane + 32 * k];
}
// × λ after the inverse rotation (kv_dense; vecinfer.rs backward).
__device__ __forceinline__ void row_post_fmt(float* v, const float* __restrict__ sg, int lane) {
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * sg[D + lane + 32 * k];
}

// kmeans.rs nearest for sub-vector s (values zs), operation for operation: the squared
// distance Σ_j ((c_j − z_j) as f64)² summed in order in f64, the first centroid of the least
// distance (none below +inf: code 0). The row's LPR lanes (q: this lane's place among them,
// the groups aligned to LPR) take centroids c ≡ q (mod LPR) in order; their minimum breaks ties
// to the lower index. Every lane of the warp calls it (shuffles).
template <int LPR>
__device__ __forceinline__ u32 vq_nearest_f64(const float* __restrict__ cb, int s, const float* zs, int q) {
    double best = __longlong_as_double(0x7ff0000000000000LL);  // +inf
    int bi = VQ_K;
    for (int c = q; c < VQ_K; c += LPR) {
        const float* const cen = cb + ((size_t)s * VQ_K + c) * GRP;
        double e = 0.0;
#pragma unroll
        for (int j = 0; j < GRP; j++) {
            const double dd = (double)(cen[j] - zs[j]);
            e = e + dd * dd;
        }
        if (e < best) {
            best = e;
            bi = c;
        }
    }
#pragma unroll
    for (int off = 1; off < LPR; off <<= 1) {
        const double ob = __shfl_xor_sync(FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (ob < best || (ob == best && oi < bi)) {
            best = ob;
            bi = oi;
        }
    }
    return bi == VQ_K ? 0u : (u32)bi;
}

// Rows [t0, t0 + n) of the page from their codes (codes[r * VQ_NS + s]), one word per thread
// at a time (threads tid, tid + nthr, …).
__device__ __forceinline__ void vq_pack_rows(const u8* codes, int n, u8* page, int t0, int tid, int nthr = 32) {
    constexpr int PER_WORD = 32 / BITS, RW = ROW_BYTES / 4;
    for (int i = tid; i < n * RW; i += nthr) {
        const int r = i / RW, w = i % RW;
        u32 word = 0;
#pragma unroll
        for (int k = 0; k < PER_WORD; k++) {
            const int s = w * PER_WORD + k;
            if (s < VQ_NS) word |= (u32)codes[r * VQ_NS + s] << (k * BITS);
        }
        ((u32*)(page + (t0 + r) * ROW_BYTES))[w] = word;
    }
}

// Every sub-vector of the rotated row by vq_nearest_f64 across the warp; the codes meet in
// shared memory, then the lanes assemble the row's words.
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    __shared__ float vq_z[32][D];       // per warp of the block (≤ 32 warps)
    __shared__ u8 vq_codes[32][VQ_NS];
    float* const z = vq_z[threadIdx.x >> 5];
    u8* const codes = vq_codes[threadIdx.x >> 5];
#pragma unroll
    for (int k = 0; k < EPL; k++) z[lane + 32 * k] = v[k];
    __syncwarp();
    const float* const cb = sg + 2 * D;
    for (int s = 0; s < VQ_NS; s++) {
        float zs[GRP];
#pragma unroll
        for (int j = 0; j < GRP; j++) zs[j] = z[s * GRP + j];
        const u32 code = vq_nearest_f64<32>(cb, s, zs, lane);
        if (lane == 0) codes[s] = (u8)code;
    }
    __syncwarp();
    vq_pack_rows(codes, 1, page, t, lane);
    __syncwarp();  // z and the codes are free for the warp's next row
}

#if RPW > 1
// encode_rows' multi-row path (ENCODE_ROWS_OWN): RPW = 1024/D rows of a page per warp, each
// row by LPR = 32/RPW lanes, each lane a 1/LPR share of the centroids; the rows' z staged in
// shared memory (stride D + 1: conflict-free). Per sub-vector the lanes rank the centroids by
// r = ‖c‖² − 2⟨c, z⟩ in f32 (dist − ‖z‖²), keeping the least two; the CPU's distance
// (kmeans.rs, f64 squares of f32 differences) and r + ‖z‖² differ by at most
// E = (γ + 2.01u)(max‖c‖ + ‖z‖)² + 1e-36 (u = 2^-24, γ = (GRP + 2)u·1.01 for the FMA chains;
// |fl(c − z) − (c − z)| ≤ u|c − z|), so a gap above 2E between the two least r picks the CPU's
// centroid. Otherwise (near ties, huge or tiny values) the rows' lanes redo that sub-vector as
// the CPU does: f64 distances, the first index of the least.
#define ENCODE_ROWS_OWN 1
#define VQ_LPR (32 / RPW)
__device__ __forceinline__ void rotate_warp(float* v, const float* __restrict__ sg, float rot_scale, int lane);
__device__ __forceinline__ void encode_rows_own(const void* __restrict__ x, int r0, u8* page, int t0,
                                                const float* __restrict__ sg, float rot_scale, int lane) {
    __shared__ float vq_zs[8][RPW][D + 1];  // per warp of encode_rows' 8
    __shared__ u8 vq_rc[8][RPW][VQ_NS];
    float (*const z)[D + 1] = vq_zs[threadIdx.x >> 5];
    u8 (*const codes)[VQ_NS] = vq_rc[threadIdx.x >> 5];
    for (int r = 0; r < RPW; r++) {
        float v[EPL];
#pragma unroll
        for (int k = 0; k < EPL; k++) v[k] = load_in(x, (size_t)(r0 + r) * D + lane + 32 * k);
        row_pre_fmt(v, sg, lane);
        rotate_warp(v, sg, rot_scale, lane);
#pragma unroll
        for (int k = 0; k < EPL; k++) z[r][lane + 32 * k] = v[k];
    }
    __syncwarp();
    const int r = lane / VQ_LPR, q = lane % VQ_LPR;
    const float* const zr = z[r];
    const float* const cb = sg + 2 * D;
    const float INF = __int_as_float(0x7f800000);
    for (int s = 0; s < VQ_NS; s++) {
        float zj[GRP], zn2 = 0.0f;
#pragma unroll
        for (int j = 0; j < GRP; j++) {
            zj[j] = zr[s * GRP + j];
            zn2 = fmaf(zj[j], zj[j], zn2);
        }
        float b1 = INF, b2 = INF, cmax2 = 0.0f;
        int i1 = VQ_K;
        for (int c = q; c < VQ_K; c += VQ_LPR) {
            const float* const cen = cb + ((size_t)s * VQ_K + c) * GRP;
            float dot = 0.0f, n2 = 0.0f;
#pragma unroll
            for (int j = 0; j < GRP; j++) {
                const float cj = cen[j];
                dot = fmaf(cj, zj[j], dot);
                n2 = fmaf(cj, cj, n2);
            }
            const float rr = fmaf(-2.0f, dot, n2);
            cmax2 = fmaxf(cmax2, n2);
            if (rr < b1) {
                b2 = b1;
                b1 = rr;
                i1 = c;
            } else {
                b2 = fminf(b2, rr);
            }
        }
#pragma unroll
        for (int off = 1; off < VQ_LPR; off <<= 1) {
            const float o1 = __shfl_xor_sync(FULL_MASK, b1, off), o2 = __shfl_xor_sync(FULL_MASK, b2, off);
            const int oi = __shfl_xor_sync(FULL_MASK, i1, off);
            cmax2 = fmaxf(cmax2, __shfl_xor_sync(FULL_MASK, cmax2, off));
            if (o1 < b1 || (o1 == b1 && oi < i1)) {
                b2 = fminf(b1, o2);
                b1 = o1;
                i1 = oi;
            } else {
                b2 = fminf(b2, o1);
            }
        }
        const float rad = sqrtf(cmax2) + sqrtf(zn2);
        const float e = ((float)(GRP + 2) * 1.01f + 2.01f) * 5.9604645e-8f * rad * rad + 1e-36f;
        const bool sure = b2 - b1 > 2.0f * e && e < 1e30f && i1 < VQ_K;
        int code = i1;
        if (__any_sync(FULL_MASK, !sure)) {
            const u32 exact = vq_nearest_f64<VQ_LPR>(cb, s, zj, q);
            if (!sure) code = (int)exact;
        }
        if (q == 0) codes[r][s] = (u8)code;
    }
    __syncwarp();
    vq_pack_rows(&codes[0][0], RPW, page, t0, lane);
    __syncwarp();  // the staged rows and codes are free for the warp's next rows
}
#endif

// Row t's centroids (the z domain; lane l: dims l, l + 32, …).
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* const row = page + t * ROW_BYTES;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int dim = lane + 32 * k, s = dim / GRP;
        v[k] = sg[2 * D + ((size_t)s * VQ_K + vq_index<BITS>(row, s)) * GRP + dim % GRP];
    }
}
#endif

#if FMT_DECODE && (KK == 10 || VK == 10)
#ifndef VQSM
#define VQSM 0
#endif
#define VQ_TW(b) ((2 + (1 << (b))) * D)
// Sub-vectors [s0, s0 + NS)'s indices of a row: one load where they are 2, 4, 8 or 16 whole
// bytes (a thread's share of a row starts at a multiple of its size: rows of 4 (keys) or 8
// (values) shares in pages of whole 16-byte units), else byte by byte — a load per index was
// the generic path's busiest instruction.
template <int B, int NS, bool WHOLE>
__device__ __forceinline__ void vq_indices(const u8* row, int s0, u32* c) {
    constexpr int NB = NS * B / 8;
    if (WHOLE && (NB == 2 || NB == 4 || NB == 8 || NB == 16) && (NS * B) % 8 == 0) {
        u32 w[NB >= 4 ? NB / 4 : 1];
        ldraw<NB>(row + s0 * B / 8, w);
#pragma unroll
        for (int i = 0; i < NS; i++) c[i] = (w[i * B / 32] >> (i * B % 32)) & ((1u << B) - 1u);
    } else {
#pragma unroll
        for (int i = 0; i < NS; i++) c[i] = vq_index<B>(row, s0 + i);
    }
}
#define VQ_WHOLE(bytes) ((bytes) % 16 == 0)

#if VQSM
// VQSM: the block's codebooks staged once in dynamic shared memory as f16 (keys' then values',
// 2^B·D halves each; the host sizes it, ≤ 128 KiB): a sub-vector's centroid is one 4-, 8- or
// 16-byte load, already the mma's f16 pairs.
#define KVQ_HALVES (KK == 10 ? (1 << KB) * D : 0)
#define VVQ_HALVES (VK == 10 ? (1 << VB) * D : 0)
#define DECODE_SETUP_FMT 1
__device__ __forceinline__ void stage_codebook(u16* dst, const float* __restrict__ src, int n, int tid, int nthr) {
    for (int i = 4 * tid; i < n; i += 4 * nthr) {
        const float4 x = __ldg((const float4*)(src + i));  // 16-byte aligned: TW and 2D are multiples of 4
        *(vec2u*)(dst + i) = vec2u{pack_h2(x.x, x.y), pack_h2(x.z, x.w)};
    }
}
__device__ __forceinline__ void decode_setup_fmt(u8* smem, const float* __restrict__ ksigns,
                                                 const float* __restrict__ vsigns, int h, int tid, int nthr) {
#if KK == 10
    stage_codebook((u16*)smem, ksigns + (size_t)h * VQ_TW(KB) + 2 * D, KVQ_HALVES, tid, nthr);
#endif
#if VK == 10
    stage_codebook((u16*)smem + KVQ_HALVES, vsigns + (size_t)h * VQ_TW(VB) + 2 * D, VVQ_HALVES, tid, nthr);
#endif
}
// Dims [first, first + N) of a row of B-bit indices of GS-dim sub-vectors (first and N whole
// sub-vectors) as N/2 f16x2: their centroids' values from the staged codebook cb.
template <int B, int GS, int N, bool WHOLE>
__device__ __forceinline__ void vq_to_h2(const u8* row, int first, const u16* cb, u32* out) {
    u32 idx[N / GS];
    vq_indices<B, N / GS, WHOLE>(row, first / GS, idx);
#pragma unroll
    for (int i = 0; i < N / GS; i++) {
        const int s = first / GS + i;
        const u32 c = idx[i];
        const u16* const cen = cb + ((size_t)s * (1 << B) + c) * GS;
        if (GS == 2) {
            out[i] = *(const u32*)cen;
        } else if (GS == 4) {
            const vec2u v = *(const vec2u*)cen;
            out[2 * i] = v.x;
            out[2 * i + 1] = v.y;
        } else {
            const vec4u v = *(const vec4u*)cen;
            out[4 * i] = v.x; out[4 * i + 1] = v.y; out[4 * i + 2] = v.z; out[4 * i + 3] = v.w;
        }
    }
}
#define VQ_KCB ((const u16*)dsm)
#define VQ_VCB ((const u16*)dsm + KVQ_HALVES)
#else
// Codebooks too large to stage (d = 256, 8-bit keys and values): read as f32 from the
// transforms (through L1), converted per use.
template <int B, int GS, int N, bool WHOLE>
__device__ __forceinline__ void vq_to_h2(const u8* row, int first, const float* __restrict__ cb, u32* out) {
    u32 idx[N / GS];
    vq_indices<B, N / GS, WHOLE>(row, first / GS, idx);
#pragma unroll
    for (int i = 0; i < N / GS; i++) {
        const int s = first / GS + i;
        const u32 c = idx[i];
        // 8-byte aligned: transform rows of (2 + 2^B)·D floats, sub-vectors of an even GS.
        const float2* const cen = (const float2*)(cb + ((size_t)s * (1 << B) + c) * GS);
#pragma unroll
        for (int j = 0; j < GS / 2; j++) {
            const float2 p = __ldg(cen + j);
            out[(i * GS) / 2 + j] = pack_h2(p.x, p.y);
        }
    }
}
// The codebooks of the block's KV head h (decode_pages' transforms; the generic path only).
#define VQ_KCB (ksigns + (size_t)h * VQ_TW(KB) + 2 * D)
#define VQ_VCB (vsigns + (size_t)h * VQ_TW(VB) + 2 * D)
#endif
#endif
#if FMT_DECODE && KK == 10
#define K_ROW(kp, row, t, tab, out) \
    vq_to_h2<KB, KG, QD, VQ_WHOLE(K_PAGE_BYTES)>((kp) + (row) * K_ROW_BYTES, (t) * QD, VQ_KCB, out)
#endif
#if FMT_DECODE && VK == 10
#define V_ROW(vp, row, g, tab, out) \
    vq_to_h2<VB, VG, VC, VQ_WHOLE(V_PAGE_BYTES)>((vp) + (row) * V_ROW_BYTES, (g) * VC, VQ_VCB, out)
#endif

#if FMT_QUERY && KVQ
#define KTW ((2 + (1 << KVQB)) * D)
#define QUERY_PRE_FMT 1
// q ⊙ λ before the rotation (vecinfer.rs prepare_query: q' = R·(q ⊙ λ)).
__device__ __forceinline__ float query_pre_fmt(float x, const float* __restrict__ kt, int tid) {
    return x * kt[D + tid];
}
#endif
#if FMT_QUERY && VVQ
#define VALUE_POST_FMT 1
// The merged accumulator is in the z domain: Rᵀ, then λ (vecinfer.rs finish).
__device__ __forceinline__ float value_post_fmt(float a, const float* __restrict__ vsigns, float vrot_scale, float* s,
                                                int hkv, int tid) {
    const float* const vt = vsigns + (size_t)hkv * ((2 + (1 << VVQB)) * D);
    return fwht_block(a, s, tid) * (vt[tid] * vrot_scale) * vt[D + tid];
}
#endif

#if FMT_OWN && KIND == 10
// Centroid c's GRP values from a 16-byte-aligned codebook slot (vector loads: broadcast).
__device__ __forceinline__ void vq_centroid(const float* slot, int c, float* o) {
    if constexpr (GRP % 4 == 0) {
#pragma unroll
        for (int q = 0; q < GRP / 4; q++) {
            const float4 t = ((const float4*)(slot + c * GRP))[q];
            o[4 * q] = t.x, o[4 * q + 1] = t.y, o[4 * q + 2] = t.z, o[4 * q + 3] = t.w;
        }
    } else if constexpr (GRP % 2 == 0) {
#pragma unroll
        for (int q = 0; q < GRP / 2; q++) {
            const float2 t = ((const float2*)(slot + c * GRP))[q];
            o[2 * q] = t.x, o[2 * q + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < GRP; j++) o[j] = slot[c * GRP + j];
    }
}

// encode_vq_pages (P = 1) and encode_vq_pages2 (P = 2; Tuning::encode_vq_pairs): a block per
// page at a time, its rows 32 at a time. The rotated rows are staged once per block (stride
// D + 1: a lane reading its row is free of bank conflicts); each warp takes P sub-vectors at a
// time (s ≡ P·warp + lane / (32/P)), stages each one's codebook and the centroids' ‖c‖² in a
// slot of its own, then every lane scans all 2^BITS centroids in the same order (broadcast
// reads) for its P rows (rows q, q + 32/P, … with q = lane mod 32/P) — the warp-per-row
// kernel split each row's centroids over lanes and reduced by shuffles. P = 2 reads each
// centroid once for two rows: a 16-byte load takes a wavefront per quarter-warp even when
// every lane reads one address, so P = 1 may be bound by the shared-memory pipe. The ranking
// is encode_rows_own's: r = ‖c‖² + Σ c_j·(−2 z_j) in f32 (‖c‖² an FMA chain of GRP terms,
// then GRP more: at most 2·GRP roundings, each ≤ u of a value ≤ (‖c‖ + ‖z‖)²), the least two
// kept; a gap above 2E, E = ((2·GRP + 2)·1.01 + 2.01)·u·(max‖c‖ + ‖z‖)² + 1e-36, picks the
// CPU's centroid (kmeans.rs: f64 squares of f32 differences, ≤ 2.01u·‖c − z‖² off; checked by
// cpu_side's vecinfer_f32_ranking_bound_holds), else the lane redoes the sub-vector as the
// CPU does (vq_nearest_f64, f64, first index of the least). Dynamic shared memory (encode.rs
// vq_pages_smem): VQ_BASE bytes, then VQ_PER_WARP per slot, P slots per warp.
#define VQ_ZS (D + 1)
#define VQ_BASE ((32 * VQ_ZS * 4 + 32 * VQ_NS + 15) / 16 * 16)
#define VQ_PER_WARP (VQ_K * (GRP + 1) * 4)
extern "C" __device__ const u32 encode_vq_pages_smem[2] = {VQ_BASE, VQ_PER_WARP};
template <int P>
__device__ __forceinline__ void vq_pages(const void* __restrict__ x, int n_jobs, const int* __restrict__ page_idx,
                                         const int* __restrict__ head_idx, u8* __restrict__ pool,
                                         const float* __restrict__ signs, float rot_scale) {
    constexpr int LPS = 32 / P;  // lanes per sub-vector
    extern __shared__ __align__(16) u8 dsm[];
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q = lane % LPS, half = lane / LPS;
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    // A host layout short of this one would be a bug: fail the launch, never leave pages unwritten.
    if (dyn < (u32)(VQ_BASE + nw * P * VQ_PER_WARP)) __trap();
    float (*const z)[VQ_ZS] = (float (*)[VQ_ZS])dsm;
    u8 (*const codes)[VQ_NS] = (u8 (*)[VQ_NS])(dsm + 32 * VQ_ZS * 4);
    float* const cen = (float*)(dsm + VQ_BASE + (warp * P + half) * VQ_PER_WARP);  // VQ_K × GRP, 16-byte aligned
    float* const n2s = cen + VQ_K * GRP;
    const float INF = __int_as_float(0x7f800000);
    for (int job = blockIdx.x; job < n_jobs; job += gridDim.x) {
        const float* const sg = signs + (size_t)head_idx[job] * TW;
        u8* const page = pool + (size_t)page_idx[job] * PAGE_BYTES;
        for (int t0 = 0; t0 < T; t0 += 32) {
            const int n = T - t0 < 32 ? T - t0 : 32;
            const size_t row0 = (size_t)job * T + t0;
            for (int r = warp; r < n; r += nw) {
                float v[EPL];
#pragma unroll
                for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? load_in(x, (row0 + r) * D + lane + 32 * k) : 0.0f;
                row_pre_fmt(v, sg, lane);
                rotate_warp(v, sg, rot_scale, lane);
#pragma unroll
                for (int k = 0; k < EPL; k++)
                    if (LIVE(k, lane)) z[r][lane + 32 * k] = v[k];
            }
            __syncthreads();  // the rows staged
            for (int s0 = P * warp; s0 < VQ_NS; s0 += P * nw) {
                // This lane's sub-vector (past the last: the first one's codebook, no codes).
                const int s = s0 + half < VQ_NS ? s0 + half : s0;
                const bool live = s0 + half < VQ_NS;
                const float* const cs = sg + 2 * D + (size_t)s * VQ_K * GRP;  // 16-byte aligned: TW, 2D ≡ 0 (mod 4)
                for (int i = q; i < VQ_K * GRP / 4; i += LPS) ((float4*)cen)[i] = __ldg((const float4*)cs + i);
                __syncwarp();
                float cmax2 = 0.0f;
                for (int c = q; c < VQ_K; c += LPS) {
                    float e2 = 0.0f;
#pragma unroll
                    for (int j = 0; j < GRP; j++) e2 = fmaf(cen[c * GRP + j], cen[c * GRP + j], e2);
                    n2s[c] = e2;
                    cmax2 = fmaxf(cmax2, e2);
                }
#pragma unroll
                for (int off = LPS / 2; off > 0; off >>= 1) cmax2 = fmaxf(cmax2, __shfl_xor_sync(FULL_MASK, cmax2, off));
                __syncwarp();
                // P = 1: lanes past the group's rows skip the scan (P = 2: a row past n scans
                // row 0's values and writes no code).
                if (P > 1 || lane < n) {
                    float zj[P][GRP], m2z[P][GRP], zn2[P], b1[P], b2[P];
                    int i1[P];
#pragma unroll
                    for (int p = 0; p < P; p++) {
                        const int r = q + LPS * p < n ? q + LPS * p : 0;
                        zn2[p] = 0.0f;
#pragma unroll
                        for (int j = 0; j < GRP; j++) {
                            zj[p][j] = z[r][s * GRP + j];
                            zn2[p] = fmaf(zj[p][j], zj[p][j], zn2[p]);
                            m2z[p][j] = -2.0f * zj[p][j];
                        }
                        b1[p] = INF, b2[p] = INF, i1[p] = VQ_K;
                    }
#pragma unroll 8
                    for (int c = 0; c < VQ_K; c++) {
                        const float c2 = n2s[c];
                        float cv[GRP];
                        vq_centroid(cen, c, cv);
#pragma unroll
                        for (int p = 0; p < P; p++) {
                            float rr = c2;
#pragma unroll
                            for (int j = 0; j < GRP; j++) rr = fmaf(cv[j], m2z[p][j], rr);
                            b2[p] = fminf(b2[p], fmaxf(b1[p], rr));  // NaN rr: b2 = b1, never sure
                            i1[p] = rr < b1[p] ? c : i1[p];          // ties keep the first: b2 = b1, never sure
                            b1[p] = fminf(b1[p], rr);
                        }
                    }
#pragma unroll
                    for (int p = 0; p < P; p++) {
                        const int r = q + LPS * p;
                        if (live && r < n) {
                            const float rad = sqrtf(cmax2) + sqrtf(zn2[p]);
                            const float e = ((float)(2 * GRP + 2) * 1.01f + 2.01f) * 5.9604645e-8f * rad * rad + 1e-36f;
                            const bool sure = b2[p] - b1[p] > 2.0f * e && e < 1e30f && i1[p] < VQ_K;
                            codes[r][s] = (u8)(sure ? (u32)i1[p] : vq_nearest_f64<1>(sg + 2 * D, s, zj[p], 0));
                        }
                    }
                }
                __syncwarp();  // cen and n2s free for the warp's next sub-vectors
            }
            __syncthreads();  // every code of the group written
            vq_pack_rows(&codes[0][0], n, page, t0, threadIdx.x, blockDim.x);
            __syncthreads();  // z and the codes free for the next group
        }
    }
}
#define VQ_PAGES_ARGS                                                                                            \
    const void *__restrict__ x, int n_jobs, const int *__restrict__ page_idx, const int *__restrict__ head_idx, \
        u8 *__restrict__ pool, const float *__restrict__ signs, float rot_scale,                                  \
        const float *__restrict__ thresholds, const float *__restrict__ centroids
extern "C" __global__ void __launch_bounds__(256) encode_vq_pages(VQ_PAGES_ARGS) {
    vq_pages<1>(x, n_jobs, page_idx, head_idx, pool, signs, rot_scale);
}
extern "C" __global__ void __launch_bounds__(256) encode_vq_pages2(VQ_PAGES_ARGS) {
    vq_pages<2>(x, n_jobs, page_idx, head_idx, pool, signs, rot_scale);
}
#endif
