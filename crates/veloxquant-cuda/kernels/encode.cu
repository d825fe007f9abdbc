// Fused encode, three kernels, all bit-identical to the CPU (--fmad=false):
// - encode_rows: one warp per token row (grid: ceil(rows/8) blocks of 256 threads; kivi:
//   one warp per page; qjl and turboquant_prod: RPW rows of a page per warp). Lane l holds
//   elements l, l+32, … (the canonical reduction order of reduce.rs). Used for fp16, qjl,
//   turboquant_prod, for pages of T != 32 tokens, and for the rare rows the fast kernels hand
//   back.
// - encode_pages_tpr: one warp per 32-token page, one lane per row (q8_0, q4_0, rabitq,
//   turboquant_rvq; codes when encode_pages_tpr2 is off).
// - encode_pages_tpr2: two lanes per row (turboquant_mse codes; formats/turboquant_mse.cuh).
// - encode_sketch_mma: qjl and turboquant_prod pages of f16 input, the sketch on tensor cores
//   (formats/qjl.cuh; PAGE_MMA).
// - encode_vq_pages: vecinfer, a block per page, a lane per row (formats/vecinfer.cuh; FMT_OWN).
// Defines: D, T, KIND (0 fp16, 1 q8_0, 2 q4_0, 3 codes, 4 qjl signs, 5 turboquant_prod, 6 rabitq, 7
// turboquant_rvq, 8 kivi, 9 turboquant_frac, 10 vecinfer: 4-5 and 8-10 encode_rows only;
// vecinfer's RPW rows per warp by its own encode_rows_own), BITS, BITS2, GRP, PERCH, ROT, EDEN, IN_KIND
// (0 f32, 1 f16, 2 bf16), ROW_BYTES, PAGE_BYTES; for the page kernels WARPS/MINB (tpr),
// WARPS2/MINB2 (tpr2), PF (cp.async prefetch), LOCKSTEP, QK/QS (cell table).
#if RPW > 1
#define ENCODE_ROWS_BOUNDS __launch_bounds__(256, 2)  // two blocks per SM (≤ 128 registers)
#else
#define ENCODE_ROWS_BOUNDS __launch_bounds__(256)
#endif
extern "C" __global__ void ENCODE_ROWS_BOUNDS encode_rows(
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
#if (D & (D - 1)) == 0
        auto load = [&](int i, float* v) { kivi_load_blk(x, row0 + i, lane, v); };
        kivi_page_warp<true>(load, pool + (size_t)page_idx[job] * PAGE_BYTES, lane);
#else
        // d = 96: lane l holds channels l + 32k (its EPL codes are not whole bytes).
        auto load = [&](int i, float* v) {
#pragma unroll
            for (int k = 0; k < EPL; k++) v[k] = load_in(x, (row0 + i) * D + lane + 32 * k);
        };
        kivi_page_warp<false>(load, pool + (size_t)page_idx[job] * PAGE_BYTES, lane);
#endif
        return;
    }
#endif
#if RPW > 1 && defined(ENCODE_ROWS_OWN)
    // A format's own multi-row encoder (vecinfer): RPW rows of one page per warp.
    {
        const int r0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RPW;
        if (r0 >= n_rows) return;
        const int job = r0 / T;
        encode_rows_own(x, r0, pool + (size_t)page_idx[job] * PAGE_BYTES, r0 % T, signs + (size_t)head_idx[job] * TW,
                        rot_scale, lane);
    }
#else
#if RPW > 1
    // RPW rows of one page per warp (the launch has n_rows / RPW warps; RPW divides T), by the
    // format's encode_rows_fmt, with RPW·D floats of shared memory for each of the block's 8
    // warps.
    {
        __shared__ __align__(16) float xs[8][RPW * D];
        const int r0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * RPW;
        if (r0 >= n_rows) return;
        const int job = r0 / T;
        const float* const sg = signs + (size_t)head_idx[job] * TW;
        float v[RPW][EPL];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
#pragma unroll
            for (int k = 0; k < EPL; k++) v[r][k] = LIVE(k, lane) ? load_in(x, (size_t)(r0 + r) * D + lane + 32 * k) : 0.0f;
            rotate_warp(v[r], sg, rot_scale, lane);
        }
        encode_rows_fmt(v, pool + (size_t)page_idx[job] * PAGE_BYTES, r0 % T, sg, thresholds, centroids,
                        xs[threadIdx.x >> 5], lane);
        return;
    }
#endif
    int row_id = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (row_id >= n_rows) return;
    int job = row_id / T, t = row_id % T;
    float v[EPL];
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? load_in(x, (size_t)row_id * D + lane + 32 * k) : 0.0f;
    encode_row_warp(v, pool + (size_t)page_idx[job] * PAGE_BYTES, t, signs + (size_t)head_idx[job] * TW, rot_scale,
                    thresholds, centroids, lane);
#endif
}

// ---------------------------------------------------------------------------------------
// Thread-per-row encode (T == 32; formats with a page codec, PAGE_CODEC): one warp per page, lane t encodes row t of
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
// Only for D = 64 and 128, the sizes the host runs them at (a row in one lane's registers,
// rotated by the FWHT).
#if T == 32 && (D == 64 || D == 128) && (PAGE_CODEC || PAGE_MMA)
#define IN_B (IN_KIND == 0 ? 4 : 2)
#define ROW_IN (D * IN_B)
#define RS (ROW_IN + 16)
#define CPR (ROW_IN / 16)
#define STAGE (32 * RS)
#define ROW_W (ROW_BYTES / 4)
// Dynamic shared memory: [the format's table (TAB_BYTES)][WARPS stages of STAGE bytes].
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

// The format's rotation of a row held by one lane (rotate_warp's operations): the signs sg
// (the transform's first D floats; shared or global), the FWHT, the scale.
__device__ __forceinline__ void rotate_tpr(float* v, const float* sg, float rot_scale) {
#if ROT
#pragma unroll
    for (int i = 0; i < D / 4; i++) {
        const vec4u s = ((const vec4u*)sg)[i];
        v[4 * i] = v[4 * i] * __uint_as_float(s.x);
        v[4 * i + 1] = v[4 * i + 1] * __uint_as_float(s.y);
        v[4 * i + 2] = v[4 * i + 2] * __uint_as_float(s.z);
        v[4 * i + 3] = v[4 * i + 3] * __uint_as_float(s.w);
    }
    fwht_tpr(v);
#pragma unroll
    for (int j = 0; j < D; j++) v[j] = v[j] * rot_scale;
#endif
}

// The 32 lane chains s[l] summed by the canonical xor-butterfly's tree (reduce.rs).
__device__ __forceinline__ float tree32(float* s) {
#pragma unroll
    for (int lv = 4; lv >= 0; lv--) {
#pragma unroll
        for (int l = 0; l < 16; l++)
            if (l < (1 << lv)) s[l] = s[l] + s[l + (1 << lv)];
    }
    return s[0];
}

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
    return sqrtf(tree32(ss));
}

// A staged row (the input kind, 16-byte chunks) into v as f32, element j in v[j].
__device__ __forceinline__ void row_tpr(const u8* row, float* v) {
#pragma unroll
    for (int i = 0; i < CPR; i++) {
        const vec4u q = *(const vec4u*)(row + 16 * i);
        const u32 w4[4] = {q.x, q.y, q.z, q.w};
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
}

// Page codecs that find y's cell in a bin table (format.rs bin_table: bins of 4 words, the
// first EW of them used): nb bins copied into shared memory as 32/EW copies each (bin b of
// copy c at word 32 b + c·EW), each lane group reading its own copy, free of bank conflicts.
template <int EW>
__device__ __forceinline__ void copy_bins(u32* tab, const u32* __restrict__ table, int nb, int nthreads) {
    for (int i = threadIdx.x; i < nb * (32 / EW); i += nthreads) {
        const int b = i / (32 / EW);
#pragma unroll
        for (int w = 0; w < EW; w++) tab[i * EW + w] = table[b * 4 + w];
    }
}
// The bin entry at shared address a: (thr, base), and for EW = 4 (c(base), c(base + 1)).
template <int EW>
__device__ __forceinline__ vec4u bin_entry(u32 a) {
    vec4u e;
    if (EW == 4) {
        asm("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(e.x), "=r"(e.y), "=r"(e.z), "=r"(e.w) : "r"(a));
    } else {
        asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(e.x), "=r"(e.y) : "r"(a));
        e.z = e.w = 0u;
    }
    return e;
}
// y's cell from its bin entry: base + (thr < y), as thr < y ⟺ RN(thr − y) < 0 (no ftz:
// distinct floats never differ by zero): an FADD and one LEA.HI instead of compare + select.
__device__ __forceinline__ u32 bin_code(const vec4u& e, float y) {
    return e.y + (__float_as_uint(__uint_as_float(e.x) - y) >> 31);
}

// The rows of job's page that page_row handed back (slow), each redone by the whole warp:
// redo(v, s) with v row s's input (lane l: elements l, l + 32, …), then a warp barrier.
template <class Redo>
__device__ __forceinline__ void redo_slow_rows(const void* __restrict__ x, int job, bool slow, int lane, Redo redo) {
    for (u32 todo = __ballot_sync(FULL_MASK, slow); todo; todo &= todo - 1) {
        const int s = __ffs(todo) - 1;
        float vw[EPL];
#pragma unroll
        for (int k = 0; k < EPL; k++) vw[k] = load_in(x, ((size_t)job * 32 + s) * D + lane + 32 * k);
        redo(vw, s);
        __syncwarp();
    }
}

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

// One prefetch buffer: the 32 rows (padded to RS bytes), then the page's rotation signs.
#define BUF (STAGE + SG_BYTES)

// The 32 input rows of page `job` into `buf` (rows RS bytes apart) by cp.async, uncommitted.
__device__ __forceinline__ void copy_rows_async(const void* x, int job, u8* buf, int lane) {
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
}

// The 32 input rows of page `job` and its head's signs `sg` into `buf` by cp.async, one group.
__device__ __forceinline__ void stage_rows_async(const void* x, int job, const float* sg, u8* buf, int lane) {
    copy_rows_async(x, job, buf, lane);
#if ROT
    const u32 sb = smem_addr(buf);
    for (int c = lane; c < TW / 4; c += 32)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(sb + STAGE + 16 * c), "l"(sg + 4 * c)
                     : "memory");
#endif
    asm volatile("cp.async.commit_group;" ::: "memory");
}

#ifndef PAGE_STATE
// A page codec without per-block state (formats that do not set PAGE_STATE).
struct PageCodec {};
__device__ __forceinline__ PageCodec page_codec(u8* dsm, const u32* __restrict__ table,
                                               const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, u32 tab_bias, int lane) {
    return PageCodec{};
}
#endif

// Each format's page codec (FMT_PAGE; PAGE_CODEC set by its row codec): page_row, which
// encodes row `lane` from v (rotated when the format rotates; sgh: the head's transform) into
// W and the page image's sides and returns whether page_fixup (PAGE_FIXUP) must redo the row
// with the warp-per-row code; with PAGE_STATE, its PageCodec and the per-block set-up
// page_codec (tables, registers).
// @formats FMT_PAGE
#if PAGE_CODEC
#ifndef TAB_BYTES
#define TAB_BYTES 0
#endif
#ifndef PAGE_FIXUP
#define PAGE_FIXUP 0
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) encode_pages_tpr(
    const void* __restrict__ x, int n_jobs, const int* __restrict__ page_idx,
    const int* __restrict__ head_idx, u8* __restrict__ pool, const float* __restrict__ signs,
    float rot_scale, const u32* __restrict__ table, const float* __restrict__ thresholds,
    const float* __restrict__ centroids, u32 tab_bias, u32 tab_mul) {
    extern __shared__ __align__(16) u8 dsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const PageCodec pc = page_codec(dsm, table, thresholds, centroids, tab_bias, lane);
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
        row_tpr(st + lane * RS, v);
        __syncwarp();  // the stage now receives the encoded page
#if PF
        const float* sgh = (const float*)(st + STAGE);
#else
        const float* sgh = signs + (size_t)head_idx[job] * TW;
#endif
#ifdef PAGE_PRE
        page_pre_fmt(v, sgh);  // a format's step before the rotation (turboquant_frac: − μ)
#endif
        rotate_tpr(v, sgh, rot_scale);
        u32 W[ROW_W];
#pragma unroll
        for (int w = 0; w < ROW_W; w++) W[w] = 0;
        const bool slow = page_row(pc, v, W, st, sgh, rot_scale, tab_mul, lane);
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
#if PAGE_FIXUP
        page_fixup(x, job, head_idx, signs, rot_scale, thresholds, centroids, st, slow, lane);
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
#endif  // PAGE_CODEC
#endif

// Formats' own page kernels for any page size and d (FMT_OWN: vecinfer's encode_vq_pages).
// @formats FMT_OWN

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
