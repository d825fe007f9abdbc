// turboquant_mse (turboquant_mse.rs over rows.rs' packed codes): per row the BITS-bit
// Lloyd-Max codes of y = R·x/‖R·x‖, then per token the f16 scale ‖x‖ (or ‖x‖/⟨y, ŷ⟩, EDEN).
// The packed-code readers below also serve qjl's and rabitq's sign rows (1-bit codes) and the
// first segment of turboquant_prod and turboquant_rvq.
#if FMT_ROW && (KIND == 3 || KIND == 5 || KIND == 7)
// Row t's codes decoded through the f32 centroids, times the token's first side (its scale).
__device__ __forceinline__ void codes_row_decode(const u8* page, int t, const float* __restrict__ cen, int lane,
                                                 float* v) {
    const u8* row = page + t * ROW_BYTES;
    const float s = h2f(((const u16*)(page + T * ROW_BYTES))[t]);
#if D % 32 == 0
    const u32* w = (const u32*)row;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int bit = (lane + 32 * k) * BITS, wi = bit >> 5, o = bit & 31;
        u32 c = w[wi] >> o;
        if (o + BITS > 32) c |= w[wi + 1] << (32 - o);
        v[k] = cen[c & ((1u << BITS) - 1u)] * s;
    }
#else
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = LIVE(k, lane) ? cen[code_at_bytes<BITS>(row, lane + 32 * k)] * s : 0.0f;
#endif
}
#endif
#if FMT_ROW && KIND == 3
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below)
#define PAGE_STATE 1  // its own PageCodec and page_codec
// Codes of one row held by a warp (lane l: elements l, l+32, …, already rotated) into `row`
// (global or shared); returns the row's scale (every lane).
__device__ __forceinline__ float codes_row_warp(const float* v, u8* row, const float* __restrict__ thresholds,
                                                const float* __restrict__ centroids, int lane) {
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
        code[k] = lloyd_code<NTHR>(y[k], thr);
    }
    pack_codes_warp<BITS>(code, row, lane);
    float scale = norm;
#if EDEN
    float ip = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) ip = ip + y[k] * centroids[code[k]];
    ip = warp_sum_canonical(ip);
    if (ip > 0.0f) scale = norm / ip;
#endif
    return scale;
}
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    u8* row = page + t * ROW_BYTES;
    float scale = codes_row_warp(v, row, thresholds, centroids, lane);
    put_sides(page, t, scale, 1, lane);
}
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    codes_row_decode(page, t, cen, lane, v);
}
#endif

#if FMT_DECODE && KK == 3
// One key row's quarter for thread t: KS*2 f16x2 = (slots j0,j1), (j2,j3) per k-step.
__device__ __forceinline__ void k_row(const u8* kr, int t, const u16* tab, u32* out) {
    seg_codes_to_h2<KB, QD, K_ROW_BYTES / 4>(kr, t * QD, tab, out);
}
#endif
#if FMT_DECODE && VK == 3
// One value row's dims [g*VC, (g+1)*VC) as VC/2 f16x2 pairs (2m, 2m+1).
__device__ __forceinline__ void v_row(const u8* vr, int g, const u16* tab, u32* out) {
    seg_codes_to_h2<VB, VC, V_ROW_BYTES / 4>(vr, g * VC, tab, out);
}
#endif

#if FMT_PAGE && KIND == 3
// The Lloyd-Max cell table in shared memory (bin b of this lane's copy at tab + 32 b +
// (lane % COPIES)·EW words), replicated so that lookups are free of bank conflicts.
#define NB (2 * QK + 3)
#define EW (EDEN ? 4 : 2)
#define COPIES (32 / EW)
#define TAB_BYTES (NB * 128)
struct PageCodec {
    u32 tbase;
};
__device__ __forceinline__ PageCodec page_codec(u8* dsm, const u32* __restrict__ table,
                                               const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, u32 tab_bias, int lane) {
    u32* tab = (u32*)dsm;
    copy_bins<EW>(tab, table, NB, WARPS * 32);
    __syncthreads();
    // Bin b of this lane's copy lives at tab + 32 b + (lane % COPIES)·EW; b comes from the bits
    // of z = y·QS + 1.5·2^23 as bits(z) − (0x4B400000 − QK − 1), folded into one multiply-add.
    // tab_bias = −(0x4B400000 − QK − 1)·128 mod 2^32 comes from the host so that ptxas keeps the
    // whole base in one register (it would split a literal into an extra add per lookup).
    return PageCodec{smem_addr(tab) + (u32)((lane % COPIES) * EW * 4) + tab_bias};
}
// Returns whether the row is outside the Markstein range (zeros, tiny or huge values): the
// warp redoes those with the warp-per-row code (page_fixup).
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
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
    // Rows outside the Markstein range (zeros, tiny or huge values) are redone by page_fixup.
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
        const u32 a = (u32)__float_as_int(z) * tab_mul + pc.tbase;  // IMAD: keeps the ALU pipe free
        const vec4u ent = bin_entry<EW>(a);
        const u32 code = bin_code(ent, y);
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
    const float ip = tree32(ipl);
    if (ip > 0.0f) scale = norm / ip;
#endif
    ((u16*)(st + 32 * ROW_BYTES))[lane] = f2h(scale);
    for (int o = 32 * ROW_BYTES + 64 + 4 * lane; o < PAGE_BYTES; o += 128) *(u32*)(st + o) = 0;
    return slow;
}
#define PAGE_FIXUP 1
__device__ __forceinline__ void page_fixup(const void* __restrict__ x, int job, const int* __restrict__ head_idx,
                                           const float* __restrict__ signs, float rot_scale,
                                           const float* __restrict__ thresholds,
                                           const float* __restrict__ centroids, u8* st, bool slow, int lane) {
    // The rare rows the fast division does not cover: the whole warp re-encodes each one
    // with the warp-per-row code (plain IEEE division) into the page image.
    redo_slow_rows(x, job, slow, lane, [&](float* vw, int s) {
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
    });
}
#endif

#if FMT_PAGE && KIND == 3 && PF
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
    copy_bins<EW>(tab, table, NB, WARPS2 * 32);
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
            const vec4u ent = bin_entry<EW>(a);
            const u32 code = bin_code(ent, y);
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
