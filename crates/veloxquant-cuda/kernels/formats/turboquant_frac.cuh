// turboquant_frac (turboquant_frac.rs): per row the codes of y = R·(x − μ)/‖R·(x − μ)‖ in
// storage order — the NHI wide channels at BITS (= b + 1) bits, then the others at BITS2 (= b),
// one LSB-first stream of whole bytes — then per token one log-scale byte (rows.rs LogU8:
// code c → base·2^((c − 128)/16), 0 → 0). Per head (the transform, TW = 3D + 4 floats): the
// rotation's signs, μ (f16 values as f32; zeros without CENTER), each rotated channel's
// storage slot (as f32), the scale base. Thresholds: the wide codebook's, the narrow one's,
// then the log scale's 254 edges (rows.rs log_u8_edges); centroids: wide, then narrow.
#if FMT_ROW && KIND == 9
#define TW (3 * D + 4)
#define ROW_PRE 1
#define ROW_POST 1
#define PAGE_CODEC 1  // encode_pages_tpr (FMT_PAGE below; the host runs it on rows of whole words)
#define PAGE_STATE 1
// Bit position of storage slot s in a row.
__device__ __forceinline__ int frac_bit(int s) { return s < NHI ? s * BITS : NHI * BITS + (s - NHI) * BITS2; }

// x − μ before the rotation (turboquant_frac.rs rotated).
__device__ __forceinline__ void row_pre_fmt(float* v, const float* __restrict__ sg, int lane) {
#if CENTER
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] - sg[D + lane + 32 * k];
#endif
}
// + μ after the inverse rotation (kv_dense).
__device__ __forceinline__ void row_post_fmt(float* v, const float* __restrict__ sg, int lane) {
#if CENTER
#pragma unroll
    for (int k = 0; k < EPL; k++) v[k] = v[k] + sg[D + lane + 32 * k];
#endif
}

// rows.rs log_code: 1 + the edges r = s/base reaches (0 for s ≤ 0 or NaN). The estimate from
// log2f is at most a step off near an edge; the comparisons against the host's edges decide.
__device__ __forceinline__ u32 log_u8_code(float s, float base, const float* __restrict__ edges) {
    if (!(s > 0.0f)) return 0u;
    const float r = s / base;
    int c = (int)fminf(fmaxf(rintf(log2f(r) * 16.0f + 128.0f), 1.0f), 255.0f);
    while (c < 255 && r >= edges[c - 1]) c++;
    while (c > 1 && r < edges[c - 2]) c--;
    return (u32)c;
}

__device__ __forceinline__ float log_u8_value(u32 c, float base) {
    return c == 0u ? 0.0f : base * exp2f(((float)c - 128.0f) * (1.0f / 16.0f));
}

// turboquant_frac.rs encode_one on the rotated row (operation for operation): y = v·(1/‖v‖),
// each channel's code from its codebook, written at its storage slot; the scale ‖v‖ (or
// ‖v‖/⟨y, ŷ⟩, EDEN) as its log-scale byte. The codes meet in shared memory (one byte per
// slot), then lane p assembles row byte p.
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    __shared__ u8 slot_codes[32][D];  // per warp of the block (≤ 32 warps)
    u8* const codes = slot_codes[threadIdx.x >> 5];
    float thr_hi[NTHR], thr_lo[NTHR2];
#pragma unroll
    for (int j = 0; j < NTHR; j++) thr_hi[j] = thresholds[j];
#pragma unroll
    for (int j = 0; j < NTHR2; j++) thr_lo[j] = thresholds[NTHR + j];
    const float norm = norm_warp(v);
    const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
    float ip = 0.0f;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const float y = v[k] * inv;
        const int s = (int)sg[2 * D + lane + 32 * k];
        const bool wide = s < NHI;
        const u32 c = wide ? lloyd_code<NTHR>(y, thr_hi) : lloyd_code<NTHR2>(y, thr_lo);
        ip = ip + y * centroids[wide ? c : (1u << BITS) + c];
        codes[s] = (u8)c;
    }
    __syncwarp();
    u8* const row = page + t * ROW_BYTES;
    for (int p = lane; p < ROW_BYTES; p += 32) {
        u32 byte = 0;
#pragma unroll
        for (int b = 0; b < 8; b++) {
            const int q = 8 * p + b;
            const int s = q < NHI * BITS ? q / BITS : NHI + (q - NHI * BITS) / BITS2;
            const int o = q < NHI * BITS ? q % BITS : (q - NHI * BITS) % BITS2;
            byte |= (((u32)codes[s] >> o) & 1u) << b;
        }
        row[p] = (u8)byte;
    }
    float scale = norm;
#if EDEN
    ip = warp_sum_canonical(ip);
    if (ip > 0.0f) scale = norm / ip;
#endif
    if (lane == 0) {
        page[T * ROW_BYTES + t] = (u8)log_u8_code(scale, sg[3 * D], thresholds + NTHR + NTHR2);
        if (t == 0) {
            for (int i = T * ROW_BYTES + T; i < PAGE_BYTES; i++) page[i] = 0;
        }
    }
    __syncwarp();  // the slot codes are free for the warp's next row
}

// Row t back in the rotated domain, channel order (lane l: channels l, l + 32, …), times its
// scale; μ is added by row_post_fmt after the inverse rotation.
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const float sc = log_u8_value(page[T * ROW_BYTES + t], sg[3 * D]);
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int s = (int)sg[2 * D + lane + 32 * k];
        const bool wide = s < NHI;
        const int bit = frac_bit(s);
        // Two bytes hold any code (≤ 4 bits at an offset ≤ 7); the byte after a row's last is
        // still in the page (the next row or the scales).
        const u32 w = (u32)row[bit >> 3] | ((u32)row[(bit >> 3) + 1] << 8);
        const u32 c = (w >> (bit & 7)) & ((1u << (wide ? BITS : BITS2)) - 1u);
        v[k] = cen[wide ? c : (1u << BITS) + c] * sc;
    }
}
#endif

#if FMT_PAGE && KIND == 9
// One lane per row (encode_pages_tpr): the same operations as encode_row_fmt. The cell of y
// comes from the wide or the narrow codebook's bin table (format.rs bin_table; the two tables
// one after the other, each replicated per lane group as turboquant_mse.cuh's), the codes
// meet in the stage (free once the rows are in registers; a byte per storage slot, rows
// padded to D + 4 bytes: conflict-free) and are packed in slot order into W.
#define NB (2 * QK + 3)
#define EW (EDEN ? 4 : 2)
#define COPIES (32 / EW)
#define TAB_BYTES (2 * NB * 128)
#define CODES_OFF ((PAGE_BYTES + 15) / 16 * 16)
#if CODES_OFF + 32 * (D + 4) > STAGE
#error "the slot codes must fit in the stage after the page image"
#endif
struct PageCodec {
    u32 thi, tlo;                  // the tables' bases for this lane's copy (+ tab_bias)
    const float* __restrict__ edges;  // the log scale's 254 edges
};
__device__ __forceinline__ PageCodec page_codec(u8* dsm, const u32* __restrict__ table,
                                               const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, u32 tab_bias, int lane) {
    u32* tab = (u32*)dsm;
    copy_bins<EW>(tab, table, 2 * NB, WARPS * 32);
    __syncthreads();
    const u32 base = smem_addr(tab) + (u32)((lane % COPIES) * EW * 4) + tab_bias;
    return PageCodec{base, base + NB * 128, thresholds + NTHR + NTHR2};
}
#define PAGE_PRE 1
// x − μ before the rotation (row_pre_fmt); sgh: the head's transform.
__device__ __forceinline__ void page_pre_fmt(float* v, const float* sgh) {
#if CENTER
#pragma unroll
    for (int j = 0; j < D; j++) v[j] = v[j] - sgh[D + j];
#endif
}
// Rows whose norm is outside [2^-60, 2^60] (zeros, NaN, inf; sums of squares that are
// subnormal or overflow) are redone by page_fixup. Inside it ‖v‖² is a normal float within
// D·2^-24 of the exact sum, so every |y| ≤ 1 + 2^-16: the tables' bins cover it.
__device__ __forceinline__ bool page_row(const PageCodec& pc, float* v, u32* W, u8* st, const float* sgh,
                                         float rot_scale, u32 tab_mul, int lane) {
    const float norm = norm_tpr(v);
    const bool slow = !(norm >= 0x1p-60f && norm <= 0x1p60f);
    const float inv = slow ? 0.0f : 1.0f / norm;
    u8* const codes = st + CODES_OFF + lane * (D + 4);
#if EDEN
    float ipl[32];
#endif
#pragma unroll
    for (int j = 0; j < D; j++) {
        const float y = slow ? 0.0f : v[j] * inv;
        const int s = (int)sgh[2 * D + j];
        const float z = fmaf(y, (float)QS, 12582912.0f);
        const u32 a = (u32)__float_as_int(z) * tab_mul + (s < NHI ? pc.thi : pc.tlo);
        const vec4u ent = bin_entry<EW>(a);
        const u32 code = bin_code(ent, y);
#if EDEN
        const float p = y * __uint_as_float(code != ent.y ? ent.w : ent.z);
        if (j < 32) ipl[j] = 0.0f + p;
        else ipl[j & 31] = ipl[j & 31] + p;
#endif
        codes[s] = (u8)code;
    }
    // Slot order: the wide segment's codes, then the narrow one's, at compile-time bits.
#pragma unroll
    for (int i = 0; i < D / 4; i++) {
        const u32 c4 = *(const u32*)(codes + 4 * i);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int sl = 4 * i + e, width = sl < NHI ? BITS : BITS2, pos = frac_bit(sl);
            const u32 c = (c4 >> (8 * e)) & 0xFFu;
            W[pos >> 5] += c << (pos & 31);  // cells never overlap: + is |
            if ((pos & 31) + width > 32) W[(pos >> 5) + 1] += c >> (32 - (pos & 31));
        }
    }
    float scale = norm;
#if EDEN
    const float ip = tree32(ipl);
    if (ip > 0.0f) scale = norm / ip;
#endif
    st[32 * ROW_BYTES + lane] = (u8)log_u8_code(scale, sgh[3 * D], pc.edges);
    for (int o = 32 * ROW_BYTES + 32 + lane; o < PAGE_BYTES; o += 32) st[o] = 0;
    return slow;
}
#define PAGE_FIXUP 1
// The rare rows page_row hands back: the warp re-encodes each with the warp-per-row code into
// the page image.
__device__ __forceinline__ void page_fixup(const void* __restrict__ x, int job, const int* __restrict__ head_idx,
                                           const float* __restrict__ signs, float rot_scale,
                                           const float* __restrict__ thresholds,
                                           const float* __restrict__ centroids, u8* st, bool slow, int lane) {
    redo_slow_rows(x, job, slow, lane, [&](float* vw, int s) {
        encode_row_warp(vw, st, s, signs + (size_t)head_idx[job] * TW, rot_scale, thresholds, centroids, lane);
    });
}
#endif

#if FMT_DECODE && (KK == 9 || VK == 9)
// Codes [first, first + N) of a split row (NH wide codes of HB bits, then LB-bit ones) as N/2
// f16x2 from the wide table thi or the narrow one tlo. Byte loads: split rows need not be
// whole words (d = 64 at 3.25 bits: 26 bytes).
template <int HB, int LB, int NH, int N>
__device__ __forceinline__ void split_to_h2(const u8* row, int first, const u16* thi, const u16* tlo, u32* out) {
#pragma unroll
    for (int c = 0; c < N; c += 2) {
        u32 h[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int s = first + c + e;
            const bool wide = s < NH;
            const int bit = wide ? s * HB : NH * HB + (s - NH) * LB;
            const u32 w = (u32)row[bit >> 3] | ((u32)row[(bit >> 3) + 1] << 8);
            const u32 code = (w >> (bit & 7)) & ((1u << (wide ? HB : LB)) - 1u);
            h[e] = wide ? thi[code] : tlo[code];
        }
        out[c / 2] = h[0] | (h[1] << 16);
    }
}
// The scale byte c of token i as 2^((c − 128)/16) (0 for c = 0): the base is applied to the
// query (keys: prep_query) or to the merged accumulator (values: combine).
__device__ __forceinline__ float log_u8_unit(const void* scales, int i) {
    const u32 c = ((const u8*)scales)[i];
    return c == 0u ? 0.0f : exp2f(((float)c - 128.0f) * (1.0f / 16.0f));
}
#endif
// Where each thread's window lies in one segment and the segments start at whole words (NHI
// a multiple of the window), a window is plain codes of its segment's width: read by word
// loads (codes_to_h2), not code by code. Rows of two segments take the EVEN readers below
// where they can; this serves rows of one width (NHI 0 or d).
#if FMT_DECODE && (KK == 9 || VK == 9)
template <int HB, int LB, int NH, int N, int RB>
__device__ __forceinline__ void split_words_to_h2(const u8* row, int first, const u16* thi, const u16* tlo, u32* out) {
    if (first < NH) {
        codes_to_h2<HB, N, RB / 4>((const u32*)row, first, thi, out);
    } else {
        // The narrow segment starts NH·HB/8 bytes in: vector loads no wider than that allows.
        constexpr int OFF = NH * HB / 8, MAXV = OFF % 16 == 0 ? 4 : (OFF % 8 == 0 ? 2 : 1);
        codes_to_h2<LB, N, (RB - OFF) / 4, false, MAXV>((const u32*)(row + OFF), first - NH, tlo, out);
    }
}
#endif
// EVEN (rows of whole words, both segments present, a multiple of 2·P wide channels): part p
// of P (the P threads sharing a row) reads the p-th share of each segment — NH/P wide codes,
// then (D − NH)/P narrow ones — so every thread runs the same code: with a thread's window in
// one segment (the slot order), lanes of both widths split the warp and the two paths were
// issued one after the other (H100, (8, 32k): 2,693 instructions per page). kdim_fmt and
// vdim_fmt map the thread's slots to channels for the query and the output.
#if FMT_DECODE && (KK == 9 || VK == 9)
// Segments of at most 3 bits are read a pair of codes at a time (codes_to_h2 PAIRS) from the
// block's pair tables: the keys' wide and narrow codes, then the values'.
__shared__ u32 frac_pairs[4][64];
#define DECODE_TABLES_FMT 1
__device__ __forceinline__ void decode_tables_fmt(const u16* kt, const u16* k2t, const u16* vt, const u16* v2t,
                                                  int tid, int nthreads) {
#if KK == 9
    const int bits[2] = {KB, KLB};
#else
    const int bits[2] = {4, 4};
#endif
#if VK == 9
    const int vbits[2] = {VB, VLB};
#else
    const int vbits[2] = {4, 4};
#endif
    for (int i = tid; i < 4 * 64; i += nthreads) {
        const int which = i >> 6, e = i & 63;
        const int b = which < 2 ? bits[which] : vbits[which - 2];
        const u16* t = which == 0 ? kt : (which == 1 ? k2t : (which == 2 ? vt : v2t));
        const int m = (1 << b) - 1;
        frac_pairs[which][e] = b <= 3 ? ((u32)t[e & m] | ((u32)t[(e >> b) & m] << 16)) : 0u;
    }
}
template <int HB, int LB, int NH, int N, int ROWW>
__device__ __forceinline__ void split_even_to_h2(const u8* row, int part, const u16* thi, const u16* tlo,
                                                 const u32* phi, const u32* plo, u32* out) {
    constexpr int P = D / N, NW = NH / P, NN = N - NW, OFFW = NH * HB / 32;
    static_assert(NW % 2 == 0 && NN % 2 == 0 && NW > 0 && NN > 0, "each share is whole pairs");
    codes_to_h2<HB, NW, ROWW, false, 4, 0, HB <= 3>((const u32*)row, part * NW, thi, out, phi);
    constexpr int MAXV = OFFW % 4 == 0 ? 4 : (OFFW % 2 == 0 ? 2 : 1);
    codes_to_h2<LB, NN, ROWW, false, MAXV, NH * HB, LB <= 3>((const u32*)row, part * NN, tlo, out + NW / 2, plo);
}
// Element i of part p's list (wide codes first) as its storage slot.
template <int NH, int N>
__device__ __forceinline__ int even_slot(int p, int i) {
    constexpr int NW = NH / (D / N);
    return i < NW ? p * NW + i : NH + p * (N - NW) + (i - NW);
}
#endif
#define K_EVEN (FMT_DECODE && KK == 9 && KNHI > 0 && KNHI < D && KNHI % 8 == 0 && K_ROW_BYTES % 4 == 0)
#define V_EVEN (FMT_DECODE && VK == 9 && VNHI > 0 && VNHI < D && VNHI % 16 == 0 && V_ROW_BYTES % 4 == 0)
#if K_EVEN
#define K_ROW(kp, row, t, tab, out) \
    split_even_to_h2<KB, KLB, KNHI, QD, K_ROW_BYTES / 4>((kp) + (row) * K_ROW_BYTES, t, ktab, k2tab, frac_pairs[0], \
                                                          frac_pairs[1], out)
#define KDIM_FMT 1
__device__ __forceinline__ int kdim_fmt(int t, int ks, int j) { return even_slot<KNHI, QD>(t, 4 * ks + j); }
#elif FMT_DECODE && KK == 9 && KNHI % QD == 0 && (KNHI * KB) % 32 == 0 && K_ROW_BYTES % 4 == 0
#define K_ROW(kp, row, t, tab, out) \
    split_words_to_h2<KB, KLB, KNHI, QD, K_ROW_BYTES>((kp) + (row) * K_ROW_BYTES, (t) * QD, ktab, k2tab, out)
#elif FMT_DECODE && KK == 9
#define K_ROW(kp, row, t, tab, out) split_to_h2<KB, KLB, KNHI, QD>((kp) + (row) * K_ROW_BYTES, (t) * QD, ktab, k2tab, out)
#endif
#if FMT_DECODE && KK == 9
#define KSCALE_FMT 1
__device__ __forceinline__ float kscale(const u16* kn, int i) { return log_u8_unit(kn, i); }
#endif
#if V_EVEN
#define V_ROW(vp, row, g, tab, out) \
    split_even_to_h2<VB, VLB, VNHI, VC, V_ROW_BYTES / 4>((vp) + (row) * V_ROW_BYTES, g, vtab, v2tab, \
                                                          frac_pairs[2], frac_pairs[3], out)
#define VDIM_FMT 1
__device__ __forceinline__ int vdim_fmt(int g, int mt, int hf) { return even_slot<VNHI, VC>(g, 2 * mt + hf); }
#elif FMT_DECODE && VK == 9 && VNHI % VC == 0 && (VNHI * VB) % 32 == 0 && V_ROW_BYTES % 4 == 0
#define V_ROW(vp, row, g, tab, out) \
    split_words_to_h2<VB, VLB, VNHI, VC, V_ROW_BYTES>((vp) + (row) * V_ROW_BYTES, (g) * VC, vtab, v2tab, out)
#elif FMT_DECODE && VK == 9
#define V_ROW(vp, row, g, tab, out) split_to_h2<VB, VLB, VNHI, VC>((vp) + (row) * V_ROW_BYTES, (g) * VC, vtab, v2tab, out)
#endif
#if FMT_DECODE && VK == 9
#define VSCALE_FMT 1
__device__ __forceinline__ float vscale(const u16* vn, int i) { return log_u8_unit(vn, i); }
#endif

#if FMT_QUERY && KFRAC
#define KTW (3 * D + 4)
#define QUERY_FMT 1
// The rotated query's channel tid stored at its slot, times the keys' scale base.
__device__ __forceinline__ void query_fmt(float x, float* __restrict__ qprep, size_t at, size_t second,
                                          const float* __restrict__ kt, float krot_scale, float* s, int tid) {
    qprep[at - tid + (int)kt[2 * D + tid]] = x * kt[3 * D];
}
#endif
