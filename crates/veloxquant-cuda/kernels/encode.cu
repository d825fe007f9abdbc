// Fused encode, three kernels, all bit-identical to the CPU (--fmad=false):
// - encode_rows: one warp per token row (grid: ceil(rows/8) blocks of 256 threads; kivi:
//   one warp per page). Lane l holds elements l, l+32, … (the canonical reduction order of
//   reduce.rs). Used for fp16, for pages of T != 32 tokens, and for the rare rows the fast
//   kernels hand back.
// - encode_pages_tpr: one warp per 32-token page, one lane per row (q8_0, q4_0, rabitq,
//   turboquant_rvq; codes when encode_pages_tpr2 is off).
// - encode_pages_tpr2: two lanes per row (turboquant_mse codes).
// Defines: D, T, KIND (0 fp16, 1 q8_0, 2 q4_0, 3 codes, 4 qjl signs, 5 turboquant_prod, 6 rabitq, 7
// turboquant_rvq, 8 kivi: 4-8 encode_rows only), BITS, BITS2, GRP, PERCH, ROT, EDEN, IN_KIND
// (0 f32, 1 f16, 2 bf16), ROW_BYTES, PAGE_BYTES; for the page kernels WARPS/MINB (tpr),
// WARPS2/MINB2 (tpr2), PF (cp.async prefetch), LOCKSTEP, QK/QS (cell table).
extern "C" __global__ void __launch_bounds__(256) encode_rows(
    const void* __restrict__ x, int n_rows, const int* __restrict__ page_idx,
    const int* __restrict__ head_idx, u8* __restrict__ pool, const float* __restrict__ signs,
    float rot_scale, const float* __restrict__ thresholds, const float* __restrict__ centroids) {
    int lane = threadIdx.x & 31;
#if KIND == 8
    // kivi: one warp per page (the launch has n_rows / T warps; a warp per row, all but the
    // page's first idle, kept 1 in 32 of them busy: 7 % of copy bandwidth).
    {
        const int job = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
        if (job >= n_rows / T) return;
        const size_t row0 = (size_t)job * T;
        auto load = [&](int i, float* v) { kivi_load_blk(x, row0 + i, lane, v); };
        kivi_page_warp<true>(load, pool + (size_t)page_idx[job] * PAGE_BYTES, lane);
        return;
    }
#endif
    int row_id = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (row_id >= n_rows) return;
    int job = row_id / T, t = row_id % T;
    float v[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = load_in(x, (size_t)row_id * D + lane + 32 * k);
    encode_row_warp(v, pool + (size_t)page_idx[job] * PAGE_BYTES, t, signs + (size_t)head_idx[job] * TW, rot_scale,
                    thresholds, centroids, lane);
}

// ---------------------------------------------------------------------------------------
// Thread-per-row encode (T == 32; KIND 1, 2, 3, 6, 7): one warp per page, lane t encodes row t of
// the page wholly in its registers, so the canonical reductions, the Hadamard butterflies and
// the packing need no shuffles. The page's 32 input rows are staged through shared memory
// (coalesced 16 B loads, rows padded by 16 B so each lane's row read is conflict-free), and the
// encoded page is assembled in the same buffer and written out with coalesced 16 B stores.
// Arithmetic is the CPU's, operation for operation (--fmad=false); y = v/‖v‖ is computed
// with the correctly rounded reciprocal and one Markstein correction (exact for normal
// operands; rows with tiny or huge values take the plain division), and the Lloyd-Max cell
// comes from a table of bins of width 1/QS over y holding at most one threshold each
// (built and checked on the host: code = base + (thr < y)), replicated per lane group so the
// lookups are free of bank conflicts. Extra defines: WARPS (warps per block), QK (bins).
// Only for D ≤ 128, the sizes the host runs them at (a row in one lane's registers).
#if T == 32 && D <= 128 && KIND != 0 && (KIND < 4 || KIND == 6 || KIND == 7)
#define IN_B (IN_KIND == 0 ? 4 : 2)
#define ROW_IN (D * IN_B)
#define RS (ROW_IN + 16)
#define CPR (ROW_IN / 16)
#define STAGE (32 * RS)
#define ROW_W (ROW_BYTES / 4)
#if KIND == 3
#define NB (2 * QK + 3)
#define EW (EDEN ? 4 : 2)
#define COPIES (32 / EW)
#define TAB_BYTES (NB * 128)
#else
#define TAB_BYTES 0
#endif
// Dynamic shared memory: [table (KIND 3): NB bins × 32 words][WARPS stages of STAGE bytes].
#define PUTB(W, p, b) W[(p) >> 2] |= ((u32)(b) & 0xFFu) << (((p) & 3) * 8)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

#if ROT
#define SG_BYTES (TW * 4)
#else
#define SG_BYTES 0
#endif
// Helpers of the one-lane-per-row kernels: the row's D values in v, element j in v[j].

// The canonical unnormalized FWHT, stages h = 1, 2, 4, … as the CPU's fwht.
__device__ __forceinline__ void fwht_tpr(float* v) {
#pragma unroll
    for (int sh = 0; (1 << sh) < D; sh++) {
#pragma unroll
        for (int m = 0; m < D / 2; m++) {
            const int j = ((m >> sh) << (sh + 1)) | (m & ((1 << sh) - 1));
            float a = v[j], b = v[j + (1 << sh)];
            v[j] = a + b;
            v[j + (1 << sh)] = a - b;
        }
    }
}

#if KIND == 3 || KIND == 6 || KIND == 7
// ‖v‖ in the canonical order (reduce.rs): lane chains l, l + 32, … then the xor-butterfly.
__device__ __forceinline__ float norm_tpr(const float* v) {
    float ss[32];
#pragma unroll
    for (int l = 0; l < 32; l++) ss[l] = 0.0f + v[l] * v[l];
#pragma unroll
    for (int k = 1; k < D / 32; k++) {
#pragma unroll
        for (int l = 0; l < 32; l++) ss[l] = ss[l] + v[32 * k + l] * v[32 * k + l];
    }
#pragma unroll
    for (int lv = 4; lv >= 0; lv--) {
#pragma unroll
        for (int l = 0; l < 16; l++)
            if (l < (1 << lv)) ss[l] = ss[l] + ss[l + (1 << lv)];
    }
    return sqrtf(ss[0]);
}
#endif

#if KIND == 6 || KIND == 7
// Code j of B bits into the row's words (cells never overlap: + is |).
template <int B>
__device__ __forceinline__ void put_code(u32* W, int j, u32 code) {
    const int w = (j * B) >> 5, sh = (j * B) & 31;
    W[w] += code << sh;
    if (sh + B > 32) W[w + 1] += code >> (32 - sh);
}

// This lane's two f16 side values (rows' first, then second) into the page image, and the
// page's padding after them zeroed.
__device__ __forceinline__ void side_tpr(u8* st, int lane, float a, float b) {
    ((u16*)(st + 32 * ROW_BYTES))[lane] = f2h(a);
    ((u16*)(st + 32 * ROW_BYTES))[32 + lane] = f2h(b);
    for (int o = 32 * ROW_BYTES + 128 + 4 * lane; o < PAGE_BYTES; o += 128) *(u32*)(st + o) = 0;
}
#endif

// One prefetch buffer: the 32 rows (padded to RS bytes), then the page's rotation signs.
#define BUF (STAGE + SG_BYTES)

// The 32 input rows of page `job` and its head's signs `sg` into `buf` by cp.async, one group.
__device__ __forceinline__ void stage_rows_async(const void* x, int job, const float* sg, u8* buf, int lane) {
    const u8* src = (const u8*)x + (size_t)job * 32 * ROW_IN;
    const u32 sb = smem_addr(buf);
    // Chunk c = lane + 32 i: row c / CPR = lane / CPR + i·(32 / CPR) (CPR divides 32), column
    // lane % CPR: one base address per lane, immediate offsets per i.
    const u32 sl = sb + (lane / CPR) * RS + (lane % CPR) * 16;
    const u8* sp = src + 16 * lane;
#pragma unroll
    for (int i = 0; i < CPR; i++)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sl + i * (32 / CPR) * RS), "l"(sp + 512 * i)
                     : "memory");
#if ROT
    for (int c = lane; c < TW / 4; c += 32)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(sb + STAGE + 16 * c), "l"(sg + 4 * c)
                     : "memory");
#endif
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) encode_pages_tpr(
    const void* __restrict__ x, int n_jobs, const int* __restrict__ page_idx,
    const int* __restrict__ head_idx, u8* __restrict__ pool, const float* __restrict__ signs,
    float rot_scale, const u32* __restrict__ table, const float* __restrict__ thresholds,
    const float* __restrict__ centroids, u32 tab_bias, u32 tab_mul) {
    extern __shared__ __align__(16) u8 dsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if KIND == 7
    // Both stages' thresholds and stage 1's centroids, in registers.
    float thr1[NTHR], cen1[NTHR + 1], thr2[NTHR2];
#pragma unroll
    for (int j = 0; j < NTHR; j++) thr1[j] = thresholds[j];
#pragma unroll
    for (int j = 0; j <= NTHR; j++) cen1[j] = centroids[j];
#pragma unroll
    for (int j = 0; j < NTHR2; j++) thr2[j] = thresholds[NTHR + j];
#endif
#if KIND == 3
    u32* tab = (u32*)dsm;
    for (int i = threadIdx.x; i < NB * COPIES; i += WARPS * 32) {
        int b = i / COPIES;
#pragma unroll
        for (int w = 0; w < EW; w++) tab[i * EW + w] = table[b * 4 + w];
    }
    __syncthreads();
    // Bin b of this lane's copy lives at tab + 32 b + (lane % COPIES)·EW; b comes from the bits
    // of z = y·QS + 1.5·2^23 as bits(z) − (0x4B400000 − QK − 1), folded into one multiply-add.
    // tab_bias = −(0x4B400000 − QK − 1)·128 mod 2^32 comes from the host so that ptxas keeps the
    // whole base in one register (it would split a literal into an extra add per lookup).
    const u32 tbase = smem_addr(tab) + (u32)((lane % COPIES) * EW * 4) + tab_bias;
#endif
#if PF
    // Two stages per warp: the next page's rows arrive by cp.async while this one is encoded.
    // The head index of the page after next is read one iteration ahead, so no load waits.
    u8* const st0 = dsm + TAB_BYTES + warp * 2 * BUF;
    const int stride = gridDim.x * WARPS;
    int job = blockIdx.x * WARPS + warp;
    if (job < n_jobs) stage_rows_async(x, job, signs + (size_t)(ROT ? head_idx[job] : 0) * TW, st0, lane);
    int h_next = (ROT && job + stride < n_jobs) ? head_idx[job + stride] : 0;
    // Block-uniform trip count, so LOCKSTEP can keep a block's warps on the same code (the
    // loop body is tens of KiB of straight-line code: warps sharing an SM sub-partition then
    // share its instruction cache lines).
    for (int it = 0; (int)blockIdx.x * WARPS + it * stride < n_jobs; job += stride, it++) {
#if LOCKSTEP
        __syncthreads();
#endif
        if (job >= n_jobs) continue;
        u8* const st = st0 + (it & 1) * BUF;
        const int pg = page_idx[job];
        if (job + stride < n_jobs) {
            stage_rows_async(x, job + stride, signs + (size_t)h_next * TW, st0 + ((it + 1) & 1) * BUF, lane);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        h_next = (ROT && job + 2 * stride < n_jobs) ? head_idx[job + 2 * stride] : 0;
#else
    u8* st = dsm + TAB_BYTES + warp * STAGE;
    for (int job = blockIdx.x * WARPS + warp; job < n_jobs; job += gridDim.x * WARPS) {
        const int pg = page_idx[job];
        {
            const vec4u* src = (const vec4u*)x + (size_t)job * 32 * CPR;
            vec4u tmp[CPR];
#pragma unroll
            for (int i = 0; i < CPR; i++) tmp[i] = src[lane + 32 * i];
#pragma unroll
            for (int i = 0; i < CPR; i++) {
                int c = lane + 32 * i;
                *(vec4u*)(st + (c / CPR) * RS + (c % CPR) * 16) = tmp[i];
            }
        }
#endif
        __syncwarp();
        float v[D];
#pragma unroll
        for (int i = 0; i < CPR; i++) {
            vec4u q = *(const vec4u*)(st + lane * RS + 16 * i);
            u32 w4[4] = {q.x, q.y, q.z, q.w};
#if IN_KIND == 0
#pragma unroll
            for (int k = 0; k < 4; k++) v[4 * i + k] = __uint_as_float(w4[k]);
#elif IN_KIND == 1
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[8 * i + 2 * k] = h2f((u16)(w4[k] & 0xFFFFu));
                v[8 * i + 2 * k + 1] = h2f((u16)(w4[k] >> 16));
            }
#else
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[8 * i + 2 * k] = __uint_as_float(w4[k] << 16);
                v[8 * i + 2 * k + 1] = __uint_as_float(w4[k] & 0xFFFF0000u);
            }
#endif
        }
        __syncwarp();  // the stage now receives the encoded page
#if ROT
        {
#if PF
            const vec4u* sg = (const vec4u*)(st + STAGE);
#else
            const vec4u* sg = (const vec4u*)(signs + (size_t)head_idx[job] * TW);
#endif
#pragma unroll
            for (int i = 0; i < D / 4; i++) {
                vec4u s = sg[i];
                v[4 * i] = v[4 * i] * __uint_as_float(s.x);
                v[4 * i + 1] = v[4 * i + 1] * __uint_as_float(s.y);
                v[4 * i + 2] = v[4 * i + 2] * __uint_as_float(s.z);
                v[4 * i + 3] = v[4 * i + 3] * __uint_as_float(s.w);
            }
        }
        fwht_tpr(v);
#pragma unroll
        for (int j = 0; j < D; j++) v[j] = v[j] * rot_scale;
#endif
        u32 W[ROW_W];
#pragma unroll
        for (int w = 0; w < ROW_W; w++) W[w] = 0;
#if KIND == 1
#pragma unroll
        for (int k = 0; k < D / 32; k++) {
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[32 * k + i]));
            float d = amax / 127.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            u32 hb = f2h(d);
            PUTB(W, 34 * k, hb);
            PUTB(W, 34 * k + 1, hb >> 8);
#pragma unroll
            for (int i = 0; i < 32; i++) {
                float r = roundf(v[32 * k + i] * id);
                r = fminf(fmaxf(r, -128.0f), 127.0f);
                PUTB(W, 34 * k + 2 + i, (u32)(int)r);
            }
        }
#elif KIND == 2
#pragma unroll
        for (int k = 0; k < D / 32; k++) {
            float amax = 0.0f, mx = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; i++) {
                float a = fabsf(v[32 * k + i]);
                if (amax < a) {
                    amax = a;
                    mx = v[32 * k + i];
                }
            }
            float d = mx / -8.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            u32 hb = f2h(d);
            PUTB(W, 18 * k, hb);
            PUTB(W, 18 * k + 1, hb >> 8);
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float f0 = v[32 * k + i] * id + 8.5f;
                float f1 = v[32 * k + i + 16] * id + 8.5f;
                int q0 = (int)truncf(fminf(fmaxf(f0, -128.0f), 127.0f));
                int q1 = (int)truncf(fminf(fmaxf(f1, -128.0f), 127.0f));
                q0 = q0 < 15 ? q0 : 15;
                q1 = q1 < 15 ? q1 : 15;
                PUTB(W, 18 * k + 2 + i, (u32)(q0 & 0xF) | ((u32)(q1 & 0xF) << 4));
            }
        }
#elif KIND == 6
        // rabitq (rabitq_row_warp, one lane per row): the sign bits of R·x, ‖R·x‖ and
        // x0 = ‖R·x‖₁ / (‖R·x‖·√d), the L1 norm summed in f64 in element order.
#pragma unroll
        for (int j = 0; j < D; j++) W[j >> 5] |= (v[j] >= 0.0f ? 1u : 0u) << (j & 31);
        const float norm = norm_tpr(v);
        double l1 = 0.0;
#pragma unroll
        for (int j = 0; j < D; j++) l1 = __dadd_rn(l1, (double)fabsf(v[j]));
        const float x0 = norm > 0.0f ? (float)__ddiv_rn(l1, __dmul_rn((double)norm, sqrt((double)D))) : 0.0f;
        side_tpr(st, lane, norm, x0);
#elif KIND == 7
        // turboquant_rvq (rvq_row_warp, one lane per row): y = v·(1/n₁), stage-1 codes, the
        // residual e = y − ŷ₁ (0 for a zero row), z = R₂·(e·(1/n₂)), stage-2 codes after
        // stage 1's words.
        const float n1 = norm_tpr(v);
        {
            const float inv = n1 > 0.0f ? 1.0f / n1 : 0.0f;
#pragma unroll
            for (int j = 0; j < D; j++) {
                const float y = v[j] * inv;
                const u32 c = lloyd_code<NTHR>(y, thr1);
                put_code<BITS>(W, j, c);
                float cy = cen1[0];  // cen1[c] by selects: the array stays in registers
#pragma unroll
                for (int i = 1; i <= NTHR; i++) cy = c == (u32)i ? cen1[i] : cy;
                v[j] = n1 > 0.0f ? y - cy : 0.0f;
            }
        }
        const float n2 = norm_tpr(v);
        {
            const float inv = n2 > 0.0f ? 1.0f / n2 : 0.0f;
#if PF
            const vec4u* sg = (const vec4u*)(st + STAGE) + D / 4;
#else
            const vec4u* sg = (const vec4u*)(signs + (size_t)head_idx[job] * TW + D);
#endif
#pragma unroll
            for (int i = 0; i < D / 4; i++) {
                vec4u s = sg[i];
                v[4 * i] = v[4 * i] * inv * __uint_as_float(s.x);
                v[4 * i + 1] = v[4 * i + 1] * inv * __uint_as_float(s.y);
                v[4 * i + 2] = v[4 * i + 2] * inv * __uint_as_float(s.z);
                v[4 * i + 3] = v[4 * i + 3] * inv * __uint_as_float(s.w);
            }
            fwht_tpr(v);
#pragma unroll
            for (int j = 0; j < D; j++) put_code<BITS2>(W + MSE_BYTES / 4, j, lloyd_code<NTHR2>(v[j] * rot_scale, thr2));
        }
        side_tpr(st, lane, n1, n2);
#else
        const float norm = norm_tpr(v);
#if IN_KIND == 1
        const float mn = norm;  // f16 input: see encode_pages_tpr2
#else
        float mnp[16];  // min |v| in 16 independent chains, then a tree
#pragma unroll
        for (int j = 0; j < 16; j++) mnp[j] = fabsf(v[j]);
#pragma unroll
        for (int j = 16; j < D; j++) mnp[j & 15] = fminf(mnp[j & 15], fabsf(v[j]));
#pragma unroll
        for (int lv = 3; lv >= 0; lv--) {
#pragma unroll
            for (int l = 0; l < 8; l++)
                if (l < (1 << lv)) mnp[l] = fminf(mnp[l], mnp[l + (1 << lv)]);
        }
        const float mn = mnp[0];
#endif
        // Rows outside the Markstein range (zeros, tiny or huge values) are redone below.
        const bool slow = !(norm >= 0x1p-40f && norm <= 0x1p40f && mn >= norm * 0x1p-60f);
        {
            // Slow rows get y = 0 here (r = 0, n = 1: finite, so the table index stays in range).
            const float n = slow ? 1.0f : norm;
            const float r = slow ? 0.0f : 1.0f / norm;  // correctly rounded
#pragma unroll
            for (int j = 0; j < D; j++) {
                float y0 = v[j] * r;
                float e = fmaf(-y0, n, v[j]);  // exact remainder
                v[j] = fmaf(e, r, y0);         // = RN(v / norm) (Markstein)
            }
        }
#if EDEN
        float ipl[32];
#endif
#pragma unroll
        for (int j = 0; j < D; j++) {
            const float y = v[j];
            // y·QS is exact, so the one rounding of the fma is round(y·QS) + 1.5·2^23.
            const float z = fmaf(y, (float)QS, 12582912.0f);
            const u32 a = (u32)__float_as_int(z) * tab_mul + tbase;  // IMAD: keeps the ALU pipe free
#if EDEN
            vec4u ent;
            asm("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(ent.x), "=r"(ent.y), "=r"(ent.z), "=r"(ent.w) : "r"(a));
#else
            vec2u ent;
            asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(ent.x), "=r"(ent.y) : "r"(a));
#endif
            // thr < y ⟺ RN(thr − y) < 0 (no ftz: distinct floats never differ by zero), so the
            // cell is base + the sign bit: an FADD and one LEA.HI instead of compare + select.
            const u32 code = ent.y + (__float_as_uint(__uint_as_float(ent.x) - y) >> 31);
#if EDEN
            const bool up = code != ent.y;
#endif
#if EDEN
            const float p = y * __uint_as_float(up ? ent.w : ent.z);
            if (j < 32) ipl[j] = 0.0f + p;
            else ipl[j & 31] = ipl[j & 31] + p;
#endif
            const int w = (j * BITS) >> 5, sh = (j * BITS) & 31;
            W[w] += code << sh;  // cells never overlap: + is |
            if (sh + BITS > 32) W[w + 1] += code >> (32 - sh);
        }
        float scale = norm;
#if EDEN
#pragma unroll
        for (int lv = 4; lv >= 0; lv--) {
#pragma unroll
            for (int l = 0; l < 16; l++)
                if (l < (1 << lv)) ipl[l] = ipl[l] + ipl[l + (1 << lv)];
        }
        if (ipl[0] > 0.0f) scale = norm / ipl[0];
#endif
        ((u16*)(st + 32 * ROW_BYTES))[lane] = f2h(scale);
        for (int o = 32 * ROW_BYTES + 64 + 4 * lane; o < PAGE_BYTES; o += 128) *(u32*)(st + o) = 0;
#endif
        // This row into the page image, then the page out with coalesced stores.
        {
            u8* row = st + lane * ROW_BYTES;
#if ROW_BYTES % 16 == 0
#pragma unroll
            for (int w = 0; w < ROW_W; w += 4) *(vec4u*)(row + 4 * w) = vec4u{W[w], W[w + 1], W[w + 2], W[w + 3]};
#elif ROW_BYTES % 8 == 0
#pragma unroll
            for (int w = 0; w < ROW_W; w += 2) *(vec2u*)(row + 4 * w) = vec2u{W[w], W[w + 1]};
#else
#pragma unroll
            for (int w = 0; w < ROW_W; w++) *(u32*)(row + 4 * w) = W[w];
#endif
        }
        __syncwarp();
#if KIND == 3
        // The rare rows the fast division does not cover: the whole warp re-encodes each one
        // with the warp-per-row code (plain IEEE division) into the page image.
        for (u32 todo = __ballot_sync(FULL_MASK, slow); todo; todo &= todo - 1) {
            const int s = __ffs(todo) - 1;
            float vw[EPL];
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = load_in(x, ((size_t)job * 32 + s) * D + lane + 32 * k);
#if ROT
            const float* sg = signs + (size_t)head_idx[job] * D;
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = vw[k] * sg[lane + 32 * k];
            fwht_warp(vw, lane);
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = vw[k] * rot_scale;
#endif
            float sc = codes_row_warp(vw, st + s * ROW_BYTES, thresholds, centroids, lane);
            if (lane == 0) ((u16*)(st + 32 * ROW_BYTES))[s] = f2h(sc);
            __syncwarp();
        }
#endif
        u8* page = pool + (size_t)pg * PAGE_BYTES;
#if PAGE_BYTES % 16 == 0
        for (int c = lane; c < PAGE_BYTES / 16; c += 32) ((vec4u*)page)[c] = ((const vec4u*)st)[c];
#else
        for (int c = lane; c < PAGE_BYTES / 4; c += 32) ((u32*)page)[c] = ((const u32*)st)[c];
#endif
        __syncwarp();
    }
}
#endif

#if T == 32 && D <= 128 && KIND == 3 && PF
// ---------------------------------------------------------------------------------------
// Two threads per row (turboquant_mse codes): a warp encodes 16 rows (half a page; unit u is
// rows 16(u&1)… of page u>>1). Lane (r, s) = (lane & 15, lane >> 4) holds the elements e of
// row r with bit 4 of e equal to s: e = 32·e_hi + 16·s + e_lo, local index 16·e_hi + e_lo.
// So each lane holds whole canonical lane chains (l = e mod 32 = 16 s + e_lo): the norm's and
// the EDEN dot's per-lane sums are local and only the butterfly level 16 crosses threads;
// of the Hadamard stages only h = 16 crosses (one shuffle per element). Half the registers
// and half the straight-line code of the thread-per-row kernel, so twice the warps.
#define DH (D / 2)
#define NG (D / 32)            // groups of 16 consecutive elements per lane
#define GW ((16 * BITS + 31) / 32)
#define STAGE2 (16 * RS)
#define BUF2 (STAGE2 + SG_BYTES)

__device__ __forceinline__ void stage_half_async(const void* x, int unit, const float* sg, u8* buf, int lane) {
    const u8* src = (const u8*)x + (size_t)unit * 16 * ROW_IN;
    const u32 sb = smem_addr(buf);
    // Chunk c = lane + 32 i: row c / CPR = lane / CPR + i·(32 / CPR) (CPR divides 32), column
    // lane % CPR: one base address per lane, immediate offsets per i.
    const u32 sl = sb + (lane / CPR) * RS + (lane % CPR) * 16;
    const u8* sp = src + 16 * lane;
#pragma unroll
    for (int i = 0; i < CPR / 2; i++)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sl + i * (32 / CPR) * RS), "l"(sp + 512 * i)
                     : "memory");
#if ROT
    for (int c = lane; c < D / 4; c += 32)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(sb + STAGE2 + 16 * c), "l"(sg + 4 * c)
                     : "memory");
#endif
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(WARPS2 * 32, MINB2) encode_pages_tpr2(
    const void* __restrict__ x, int n_jobs, const int* __restrict__ page_idx,
    const int* __restrict__ head_idx, u8* __restrict__ pool, const float* __restrict__ signs,
    float rot_scale, const u32* __restrict__ table, const float* __restrict__ thresholds,
    const float* __restrict__ centroids, u32 tab_bias, u32 tab_mul) {
    extern __shared__ __align__(16) u8 dsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = lane & 15, s = lane >> 4;
    u32* tab = (u32*)dsm;
    for (int i = threadIdx.x; i < NB * COPIES; i += WARPS2 * 32) {
        int b = i / COPIES;
#pragma unroll
        for (int w = 0; w < EW; w++) tab[i * EW + w] = table[b * 4 + w];
    }
    __syncthreads();
    const u32 tbase = smem_addr(tab) + (u32)((lane % COPIES) * EW * 4) + tab_bias;
    u8* const st0 = dsm + TAB_BYTES + warp * 2 * BUF2;
    const int n_units = 2 * n_jobs;
    const int stride = gridDim.x * WARPS2;
    int u = blockIdx.x * WARPS2 + warp;
    if (u < n_units) stage_half_async(x, u, signs + (size_t)(ROT ? head_idx[u >> 1] : 0) * D, st0, lane);
    int h_next = (ROT && u + stride < n_units) ? head_idx[(u + stride) >> 1] : 0;
    for (int it = 0; u < n_units; u += stride, it++) {
        u8* const st = st0 + (it & 1) * BUF2;
        const int job = u >> 1, half = u & 1;
        const int pg = page_idx[job];
        if (u + stride < n_units) {
            stage_half_async(x, u + stride, signs + (size_t)h_next * D, st0 + ((it + 1) & 1) * BUF2, lane);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        h_next = (ROT && u + 2 * stride < n_units) ? head_idx[(u + 2 * stride) >> 1] : 0;
        __syncwarp();
        float v[DH];
#pragma unroll
        for (int g = 0; g < NG; g++) {
            // elements 32 g + 16 s … + 15 of row r: 16 × IN_B bytes
#pragma unroll
            for (int i = 0; i < IN_B; i++) {
                vec4u q = *(const vec4u*)(st + r * RS + (32 * g + 16 * s) * IN_B + 16 * i);
                u32 w4[4] = {q.x, q.y, q.z, q.w};
#if IN_KIND == 0
#pragma unroll
                for (int k = 0; k < 4; k++) v[16 * g + 4 * i + k] = __uint_as_float(w4[k]);
#elif IN_KIND == 1
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    v[16 * g + 8 * i + 2 * k] = h2f((u16)(w4[k] & 0xFFFFu));
                    v[16 * g + 8 * i + 2 * k + 1] = h2f((u16)(w4[k] >> 16));
                }
#else
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    v[16 * g + 8 * i + 2 * k] = __uint_as_float(w4[k] << 16);
                    v[16 * g + 8 * i + 2 * k + 1] = __uint_as_float(w4[k] & 0xFFFF0000u);
                }
#endif
            }
        }
#if ROT
#pragma unroll
        for (int g = 0; g < NG; g++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                vec4u sg = *(const vec4u*)(st + STAGE2 + (32 * g + 16 * s) * 4 + 16 * i);
                v[16 * g + 4 * i] = v[16 * g + 4 * i] * __uint_as_float(sg.x);
                v[16 * g + 4 * i + 1] = v[16 * g + 4 * i + 1] * __uint_as_float(sg.y);
                v[16 * g + 4 * i + 2] = v[16 * g + 4 * i + 2] * __uint_as_float(sg.z);
                v[16 * g + 4 * i + 3] = v[16 * g + 4 * i + 3] * __uint_as_float(sg.w);
            }
        }
#endif
        __syncwarp();  // the stage now receives the encoded rows
#if ROT
        // Hadamard stages h = 1, 2, 4, 8 (local), 16 (across the pair), 32, 64 (local 16, 32).
#pragma unroll
        for (int sh = 0; sh < 4; sh++) {
#pragma unroll
            for (int m = 0; m < DH / 2; m++) {
                const int j = ((m >> sh) << (sh + 1)) | (m & ((1 << sh) - 1));
                float a = v[j], b = v[j + (1 << sh)];
                v[j] = a + b;
                v[j + (1 << sh)] = a - b;
            }
        }
#pragma unroll
        {
            const float sgn = s ? -1.0f : 1.0f;  // ±v exact: the fma rounds a + b or a − b once
#pragma unroll
            for (int j = 0; j < DH; j++) {
                const float o = __shfl_xor_sync(FULL_MASK, v[j], 16);
                v[j] = fmaf(sgn, v[j], o);
            }
        }
#pragma unroll
        for (int sh = 4; (1 << sh) < DH; sh++) {
#pragma unroll
            for (int m = 0; m < DH / 2; m++) {
                const int j = ((m >> sh) << (sh + 1)) | (m & ((1 << sh) - 1));
                float a = v[j], b = v[j + (1 << sh)];
                v[j] = a + b;
                v[j + (1 << sh)] = a - b;
            }
        }
#pragma unroll
        for (int j = 0; j < DH; j++) v[j] = v[j] * rot_scale;
#endif
        // ‖v‖: chains l = 16 s + e_lo over e_hi, then the butterfly (16 across, 8…1 local).
        float ss[16];
#pragma unroll
        for (int e = 0; e < 16; e++) ss[e] = 0.0f + v[e] * v[e];
#pragma unroll
        for (int g = 1; g < NG; g++) {
#pragma unroll
            for (int e = 0; e < 16; e++) ss[e] = ss[e] + v[16 * g + e] * v[16 * g + e];
        }
#pragma unroll
        for (int e = 0; e < 16; e++) ss[e] = ss[e] + __shfl_xor_sync(FULL_MASK, ss[e], 16);
#pragma unroll
        for (int lv = 3; lv >= 0; lv--) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < (1 << lv)) ss[e] = ss[e] + ss[e + (1 << lv)];
        }
        const float norm = sqrtf(ss[0]);
#if IN_KIND == 1
        // f16 input: every FWHT value is a multiple of 2^-24 (sums of f16 values round to
        // multiples of it), so a nonzero |v| is at least 2^-24·rot_scale ≥ 2^-28 and, with
        // ‖v‖ ∈ [2^-40, 2^40], the Markstein step is exact for every element (zeros give +0
        // where the CPU may give −0, which no comparison or product can tell apart). Only the
        // norm needs checking.
        const float mn = norm;
#else
        float mnp[8];
#pragma unroll
        for (int j = 0; j < 8; j++) mnp[j] = fabsf(v[j]);
#pragma unroll
        for (int j = 8; j < DH; j++) mnp[j & 7] = fminf(mnp[j & 7], fabsf(v[j]));
#pragma unroll
        for (int lv = 2; lv >= 0; lv--) {
#pragma unroll
            for (int l = 0; l < 4; l++)
                if (l < (1 << lv)) mnp[l] = fminf(mnp[l], mnp[l + (1 << lv)]);
        }
        const float mn = fminf(mnp[0], __shfl_xor_sync(FULL_MASK, mnp[0], 16));
#endif
        const bool slow = !(norm >= 0x1p-40f && norm <= 0x1p40f && mn >= norm * 0x1p-60f);
        {
            const float n = slow ? 1.0f : norm;
            const float rc = slow ? 0.0f : 1.0f / norm;
#pragma unroll
            for (int j = 0; j < DH; j++) {
                float y0 = v[j] * rc;
                float e = fmaf(-y0, n, v[j]);
                v[j] = fmaf(e, rc, y0);
            }
        }
        u32 G[NG][GW];
#pragma unroll
        for (int g = 0; g < NG; g++) {
#pragma unroll
            for (int w = 0; w < GW; w++) G[g][w] = 0;
        }
#if EDEN
        float ipl[16];
#endif
#pragma unroll
        for (int j = 0; j < DH; j++) {
            const float y = v[j];
            const float z = fmaf(y, (float)QS, 12582912.0f);
            const u32 a = (u32)__float_as_int(z) * tab_mul + tbase;  // IMAD: keeps the ALU pipe free
#if EDEN
            vec4u ent;
            asm("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(ent.x), "=r"(ent.y), "=r"(ent.z), "=r"(ent.w) : "r"(a));
#else
            vec2u ent;
            asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(ent.x), "=r"(ent.y) : "r"(a));
#endif
            // thr < y ⟺ RN(thr − y) < 0 (no ftz: distinct floats never differ by zero), so the
            // cell is base + the sign bit: an FADD and one LEA.HI instead of compare + select.
            const u32 code = ent.y + (__float_as_uint(__uint_as_float(ent.x) - y) >> 31);
#if EDEN
            const bool up = code != ent.y;
#endif
#if EDEN
            const float p = y * __uint_as_float(up ? ent.w : ent.z);
            if (j < 16) ipl[j] = 0.0f + p;
            else ipl[j & 15] = ipl[j & 15] + p;
#endif
            const int g = j >> 4, bp = (j & 15) * BITS, w = bp >> 5, sh = bp & 31;
            G[g][w] += code << sh;
            if (sh + BITS > 32) G[g][w + 1] += code >> (32 - sh);
        }
        float scale = norm;
#if EDEN
#pragma unroll
        for (int e = 0; e < 16; e++) ipl[e] = ipl[e] + __shfl_xor_sync(FULL_MASK, ipl[e], 16);
#pragma unroll
        for (int lv = 3; lv >= 0; lv--) {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < (1 << lv)) ipl[e] = ipl[e] + ipl[e + (1 << lv)];
        }
        if (ipl[0] > 0.0f) scale = norm / ipl[0];
#endif
        // Group g of this lane is codes 16 (2 g + s) … of the row: 2·BITS bytes at 2·BITS·(2 g + s).
        u8* const row = st + r * ROW_BYTES;
#pragma unroll
        for (int g = 0; g < NG; g++) {
            u8* const dst = row + 2 * BITS * (2 * g + s);
#if (2 * BITS) % 8 == 0
            *(vec2u*)dst = vec2u{G[g][0], G[g][1]};
#elif (2 * BITS) % 4 == 0
            *(u32*)dst = G[g][0];
#else
#pragma unroll
            for (int p = 0; p < BITS; p++) ((u16*)dst)[p] = (u16)(G[g][p >> 1] >> (16 * (p & 1)));
#endif
        }
        if (s == 0) ((u16*)(st + 16 * ROW_BYTES))[r] = f2h(scale);
        __syncwarp();
        for (u32 todo = __ballot_sync(FULL_MASK, slow && s == 0); todo; todo &= todo - 1) {
            const int rr = __ffs(todo) - 1;
            float vw[EPL];
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = load_in(x, ((size_t)u * 16 + rr) * D + lane + 32 * k);
#if ROT
            const float* sgw = signs + (size_t)head_idx[job] * D;
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = vw[k] * sgw[lane + 32 * k];
            fwht_warp(vw, lane);
#pragma unroll
            for (int k = 0; k < EPL; k++) vw[k] = vw[k] * rot_scale;
#endif
            float sc = codes_row_warp(vw, st + rr * ROW_BYTES, thresholds, centroids, lane);
            if (lane == 0) ((u16*)(st + 16 * ROW_BYTES))[rr] = f2h(sc);
            __syncwarp();
        }
        u8* const page = pool + (size_t)pg * PAGE_BYTES;
        for (int c = lane; c < ROW_BYTES; c += 32)  // 16 rows = ROW_BYTES chunks of 16 B
            ((vec4u*)(page + 16 * half * ROW_BYTES))[c] = ((const vec4u*)st)[c];
        if (lane < 2) ((vec4u*)(page + 32 * ROW_BYTES + 32 * half))[lane] = ((const vec4u*)(st + 16 * ROW_BYTES))[lane];
        __syncwarp();
    }
}
#endif

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
