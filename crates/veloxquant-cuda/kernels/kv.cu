// The device cache's appends and reads, one stream (K or V) at a time, compiled with that
// stream's format defines (as encode.cu; IN_KIND = 1: the fp16 window is the encoder's input).
// Extra defines: NKV (KV heads), NSINK (S), RING (ring slots C = R + 1 in row mode, R + T in
// page mode).
//
// Layouts (cache.rs): the page table [slot][NKV][max_pages] holds physical page ids; the exact
// buffer [slot][NKV][NSINK + RING][D] f16 holds the sinks (token j < S at slot j) and the
// fp16 window as a ring (token j >= S at slot S + (j − S) mod RING). A sequence of n tokens
// with c of them in pages holds tokens [S, S + c) as codes and [S + c, n) in the ring.
//
// An append of n tokens to a sequence (AppendRow) first encodes the tokens that leave the
// window, [S + coded0, S + coded1), each from the fp16 value the ring or the new data holds
// (the CPU encodes the same f16 values), then writes the new tokens that stay exact.
#define XS (NSINK + RING)

struct AppendRow {
    int slot;     // cache slot; < 0: nothing
    int pos0;     // tokens before the append
    int n;        // tokens appended
    int coded0;   // tokens in pages before (after the sinks)
    int coded1;   // tokens in pages after
    int src_row;  // row of the new data's first token in the source
};

__device__ __forceinline__ int xslot(int j) { return j < NSINK ? j : NSINK + (j - NSINK) % RING; }

// The f16 value of token j's element lane + 32k (head h of row r) as the encoder sees it.
__device__ __forceinline__ void load_exact_or_new(const AppendRow& r, int j, int h, const float* __restrict__ src,
                                                  long src_stride, const u16* __restrict__ exact, int lane,
                                                  float* v) {
    if (j >= r.pos0) {
        const float* s = src + (size_t)(r.src_row + j - r.pos0) * src_stride + h * D;
#pragma unroll
        for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? h2f(f2h(s[lane + 32 * k])) : 0.0f;
    } else {
        const u16* x = exact + ((size_t)(r.slot * NKV + h) * XS + xslot(j)) * D;
#pragma unroll
        for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? h2f(x[lane + 32 * k]) : 0.0f;
    }
}

__device__ __forceinline__ void encode_token(const AppendRow& r, int j, int h, const float* __restrict__ src,
                                             long src_stride, const u16* __restrict__ exact, u8* __restrict__ pool,
                                             const int* __restrict__ page_table, int max_pages,
                                             const float* __restrict__ signs, float rot_scale,
                                             const float* __restrict__ thr, const float* __restrict__ cen,
                                             int lane) {
    const int c = j - NSINK;
    const int phys = page_table[(size_t)(r.slot * NKV + h) * max_pages + c / T];
#if KIND == 8
    // kivi (page mode: whole pages leave the window): the page's first token encodes it.
    if (c % T == 0) {
        auto load = [&](int i, float* v) { load_exact_or_new(r, j + i, h, src, src_stride, exact, lane, v); };
        kivi_page_warp<false>(load, pool + (size_t)phys * PAGE_BYTES, lane);
    }
#else
    float v[EPL];
    load_exact_or_new(r, j, h, src, src_stride, exact, lane, v);
    encode_row_warp(v, pool + (size_t)phys * PAGE_BYTES, c % T, signs + (size_t)h * TW, rot_scale, thr, cen, lane);
#endif
}

// Token j (new, i = j − pos0) written to its exact slot, if it stays exact.
__device__ __forceinline__ void write_exact(const AppendRow& r, int j, int h, const float* __restrict__ src,
                                            long src_stride, u16* __restrict__ exact, int lane) {
    if (j >= NSINK && j < NSINK + r.coded1) return;
    const float* s = src + (size_t)(r.src_row + j - r.pos0) * src_stride + h * D;
    u16* x = exact + ((size_t)(r.slot * NKV + h) * XS + xslot(j)) * D;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        if (LIVE(k, lane)) x[lane + 32 * k] = f2h(s[lane + 32 * k]);
    }
}

// phase 0: encode the leaving tokens; phase 1: write the new exact tokens. Grid: (⌈items /
// warps⌉, rows), a warp per (token, head) item of row blockIdx.y. Phase 2 (appends of a few
// tokens, e.g. one decode step): grid (1, rows), a warp per head doing both in order — the
// slots it reads are never the ones it writes (RING > R).
extern "C" __global__ void kv_append(const AppendRow* __restrict__ rows, int phase, const float* __restrict__ src,
                                     long src_stride, u16* __restrict__ exact, u8* __restrict__ pool,
                                     const int* __restrict__ page_table, int max_pages,
                                     const float* __restrict__ signs, float rot_scale,
                                     const float* __restrict__ thr, const float* __restrict__ cen) {
    const AppendRow r = rows[blockIdx.y];
    if (r.slot < 0) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (phase == 2) {
        for (int h = warp; h < NKV; h += nw) {
            for (int j = NSINK + r.coded0; j < NSINK + r.coded1; j++)
                encode_token(r, j, h, src, src_stride, exact, pool, page_table, max_pages, signs, rot_scale, thr, cen,
                             lane);
            for (int j = r.pos0; j < r.pos0 + r.n; j++) write_exact(r, j, h, src, src_stride, exact, lane);
        }
        return;
    }
    const int item = blockIdx.x * nw + warp;
    const int h = item % NKV, i = item / NKV;
    if (phase == 0) {
        const int j = NSINK + r.coded0 + i;
        if (j < NSINK + r.coded1)
            encode_token(r, j, h, src, src_stride, exact, pool, page_table, max_pages, signs, rot_scale, thr, cen,
                         lane);
    } else if (i < r.n) {
        write_exact(r, r.pos0 + i, h, src, src_stride, exact, lane);
    }
}

// Decoded keys or values of one sequence, positions [0, n_end), into dense f16 rows
// out[NKV][ld][D] in the original domain (rotation undone): sinks and the window from the
// exact buffer, tokens [S, S + coded) through the codes. A warp per (position, head).
extern "C" __global__ void kv_dense(int slot, int n_end, int coded, const u16* __restrict__ exact,
                                    const u8* __restrict__ pool, const int* __restrict__ page_table,
                                    int max_pages, const float* __restrict__ signs, float rot_scale,
                                    const float* __restrict__ cen, u16* __restrict__ out, long ld) {
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int h = item % NKV, j = item / NKV;
    if (j >= n_end) return;
    u16* o = out + ((size_t)h * ld + j) * D;
    const int c = j - NSINK;
    if (c < 0 || c >= coded) {
        const u16* x = exact + ((size_t)(slot * NKV + h) * XS + xslot(j)) * D;
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if (LIVE(k, lane)) o[lane + 32 * k] = x[lane + 32 * k];
        }
        return;
    }
    const int phys = page_table[(size_t)(slot * NKV + h) * max_pages + c / T];
    const u8* page = pool + (size_t)phys * PAGE_BYTES;
    float v[EPL];
    decode_row_fmt(page, c % T, signs + (size_t)h * TW, rot_scale, cen, lane, v);
#if ROT && DENSE_W
    dense_inv_warp(v, DENSE_M(signs + (size_t)h * TW), lane);
#elif ROT
    // x = Hᵀ(D s ⊙ …): the rotation is R = scale · H · diag(signs), H symmetric, so
    // R⁻¹ y = diag(signs) · H · y · scale.
    fwht_warp(v, lane);
    const float* sg = signs + (size_t)h * TW;
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] * rot_scale * sg[lane + 32 * k];
#endif
#ifdef ROW_POST
    row_post_fmt(v, signs + (size_t)h * TW, lane);
#endif
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        if (LIVE(k, lane)) o[lane + 32 * k] = f2h(v[k]);
    }
}

// The exact fp16 values of positions [S + coded0, pos0 + n) of one append — the window before
// it and the new tokens — into out[NKV][ld][D] (prefill's exact keys and values). Launched
// before kv_append's phase 1, which may overwrite ring slots of the window. A warp per
// (position, head).
extern "C" __global__ void kv_window(const AppendRow* __restrict__ rows, const float* __restrict__ src,
                                     long src_stride, const u16* __restrict__ exact, u16* __restrict__ out, long ld) {
    const AppendRow r = rows[blockIdx.y];
    if (r.slot < 0) return;
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int h = item % NKV, i = item / NKV;
    const int lo = NSINK + r.coded0, j = lo + i;
    if (j >= r.pos0 + r.n) return;
    float v[EPL];
    load_exact_or_new(r, j, h, src, src_stride, exact, lane, v);
    u16* o = out + ((size_t)h * ld + i) * D;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        if (LIVE(k, lane)) o[lane + 32 * k] = f2h(v[k]);
    }
}
