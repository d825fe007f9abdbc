// kivi (kivi.rs): per page the BITS-bit codes u of every row, then the groups' f16 scales s
// and zeros z (x̂ = s·u + z): keys grouped per channel over GRP tokens (PERCH), values per
// token over GRP channels. Encoded a whole page at a time (the cache runs in page mode).
#if FMT_ROW && KIND == 8
// kivi (kivi.rs encode_page): the f16 scale s = (max − min)/(2^b − 1) and zero z = min of
// group p, stored when `store`, and the codes u = clamp(round((x − z)/s), 0, 2^b − 1) (0 when
// s = 0) computed against their f32 values. Both divisions are the correctly rounded quotient
// (as the CPU's `/`) by Markstein's step: y0 = a·r, e = a − y0·b (exact by FMA), a·(1/b) ≈
// y0 + e·r with r = RN(1/b); RN of that is RN(a/b) when nothing under- or overflows, which
// the guards below ensure (else the IEEE division), at three FMA-pipe operations instead of
// a division per element.
#define KIVI_LEVELS ((float)((1 << BITS) - 1))
#define KIVI_NP (T * D / GRP)
// One group's (s, z) and 1/s. fast: s a finite f16 > 0 and z finite, so every x of the group
// (min ≤ x ≤ max, with max − min < 65520·levels) gives |x − z| < 2^21 and |(x − z)/s| < 2^46:
// no overflow, and the remainder can only underflow where |(x − z)/s| < 2^-70, which rounds
// to code 0 whichever way the last bit goes.
struct KiviGroup {
    float s, z, rs;
    bool fast;
};
__device__ __forceinline__ KiviGroup kivi_group(u8* page, int p, float lo, float hi, bool store) {
    const float span = hi - lo;
    // span/levels: r = RN(1/levels) is a constant; span ≥ 2^-100 keeps the remainder normal
    // (smaller spans give s < 2^-25, stored as f16 0 both ways).
    const float rl = 1.0f / KIVI_LEVELS;
    const float y0 = span * rl;
    const float sq = span >= 0x1p-100f && span <= 0x1p100f ? fmaf(fmaf(-y0, KIVI_LEVELS, span), rl, y0)
                                                          : __fdiv_rn(span, KIVI_LEVELS);
    // −0 as +0 (kivi.rs set_scale_zero): the sign of a zero min is the reduction's choice.
    const u16 s16 = f2h(sq), z16 = f2h(lo == 0.0f ? 0.0f : lo);
    if (store) {
        u16* sz = (u16*)(page + T * ROW_BYTES);
        sz[p] = s16;
        sz[KIVI_NP + p] = z16;
    }
    KiviGroup g;
    g.s = h2f(s16);
    g.z = h2f(z16);
    g.fast = g.s > 0.0f && g.s <= 65504.0f && fabsf(g.z) <= 65504.0f;
    g.rs = g.fast ? __frcp_rn(g.s) : 0.0f;
    return g;
}
// The code of x in a group with g.fast (Markstein's quotient q). clamp(round(q), 0, levels)
// as min(⌊RZ(q + 0.5)⌋, levels) with the floor's conversion saturating negatives to 0: for
// q ≥ 0, rounding the sum toward zero never carries it past the next integer, so the floor
// is round-half-away's; q < 0 gives 0 either way (NaN too).
__device__ __forceinline__ u32 kivi_code_fast(float x, const KiviGroup& g) {
    const float a = x - g.z;
    const float y0 = a * g.rs;
    const float q = fmaf(fmaf(-y0, g.s, a), g.rs, y0);
    return min(__float2uint_rd(__fadd_rz(q, 0.5f)), (u32)((1 << BITS) - 1));
}
__device__ __forceinline__ u32 kivi_code(float x, const KiviGroup& g) {
    if (g.fast) return kivi_code_fast(x, g);
    const float u = g.s > 0.0f ? roundf(__fdiv_rn(x - g.z, g.s)) : 0.0f;
    return (u32)fminf(fmaxf(u, 0.0f), KIVI_LEVELS);
}

// kivi's layout for encode_rows (BLK): lane l holds channels [EPL·l, EPL·l + EPL) of each token,
// so a token's slice is one vector load and the lane's codes are whole bytes of the row (2-bit
// at d = 64: a byte per pair of lanes), stored without a cross-lane pack.
#define KIN_B (IN_KIND == 0 ? 4 : 2)
__device__ __forceinline__ void kivi_load_blk(const void* x, size_t row, int lane, float* v) {
    // The lane's EPL·KIN_B bytes (4 to 32) as words, by the widest aligned loads.
    constexpr int NW = EPL * KIN_B / 4;
    const u32* p = (const u32*)((const u8*)x + (row * D + (size_t)EPL * lane) * KIN_B);
    u32 w[NW];
#pragma unroll
    for (int i = 0; i < NW; i += NW >= 4 ? 4 : NW) {
        if (NW >= 4) {
            const vec4u a = *(const vec4u*)(p + i);
            w[i] = a.x; w[i + 1] = a.y; w[i + 2] = a.z; w[i + 3] = a.w;
        } else if (NW == 2) {
            const vec2u a = *(const vec2u*)p;
            w[0] = a.x; w[1] = a.y;
        } else {
            w[0] = p[0];
        }
    }
#pragma unroll
    for (int i = 0; i < NW; i++) {
#if IN_KIND == 0
        v[i] = __uint_as_float(w[i]);
#elif IN_KIND == 1
        v[2 * i] = h2f((u16)(w[i] & 0xFFFFu));
        v[2 * i + 1] = h2f((u16)(w[i] >> 16));
#else
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
#endif
    }
}
// The lane's EPL codes (BLK layout: code k at bit BITS·k of its slice) into row `row`.
__device__ __forceinline__ void kivi_store_blk(const u32* code, u8* row, int lane) {
    u32 pk = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) pk |= code[k] << (BITS * k);
    if (EPL * BITS == 4) {
        pk |= __shfl_down_sync(FULL_MASK, pk, 1) << 4;
        if ((lane & 1) == 0) row[lane >> 1] = (u8)pk;
    } else if (EPL * BITS == 8) {
        row[lane] = (u8)pk;
    } else if (EPL * BITS == 16) {
        ((u16*)row)[lane] = (u16)pk;
    } else {
        ((u32*)row)[lane] = pk;
    }
}

// A whole page by one warp: load(i, v) puts token i's elements in v, lane l holding channels
// [EPL·l, EPL·l + EPL) (BLK) or l, l + 32, … (the cache's appends, as they load rows). Keys:
// per channel (a lane's own), min/max over each group of GRP tokens, then the codes (the
// tokens loaded twice, not held: 32·EPL registers). Values: per token, min/max over groups of
// GRP channels, in the lane and then by shuffles. min/max are exact in any order and the
// quotients correctly rounded, so both layouts give the CPU's pages.
template <bool BLK, class Load>
__device__ __forceinline__ void kivi_page_warp(Load load, u8* page, int lane) {
    float v[EPL];
    u32 code[EPL];
    auto store = [&](int i) {
        if (BLK) kivi_store_blk(code, page + i * ROW_BYTES, lane);
        else pack_codes_warp<BITS>(code, page + i * ROW_BYTES, lane);
    };
#if PERCH
    for (int g0 = 0; g0 < T; g0 += GRP) {
        float lo[EPL], hi[EPL];
#pragma unroll
        for (int k = 0; k < EPL; k++) { lo[k] = __int_as_float(0x7f800000); hi[k] = -lo[k]; }
        // Unrolled so that several tokens' loads are in flight at once.
#pragma unroll 8
        for (int i = g0; i < g0 + GRP; i++) {
            load(i, v);
#pragma unroll
            for (int k = 0; k < EPL; k++) { lo[k] = fminf(lo[k], v[k]); hi[k] = fmaxf(hi[k], v[k]); }
        }
        KiviGroup sz[EPL];
        bool all_fast = true;
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            sz[k] = kivi_group(page, (g0 / GRP) * D + (BLK ? EPL * lane + k : lane + 32 * k), lo[k], hi[k], true);
            all_fast = all_fast && sz[k].fast;
        }
#pragma unroll 4
        for (int i = g0; i < g0 + GRP; i++) {
            load(i, v);
            if (BLK && all_fast) {  // the fast quotient without a branch per element
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code_fast(v[k], sz[k]);
            } else {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code(v[k], sz[k]);
            }
            store(i);
        }
    }
#else
#pragma unroll 4
    for (int i = 0; i < T; i++) {
        load(i, v);
        if (BLK) {
            // A value group of GRP channels is GRP / EPL consecutive lanes (EPL ≤ 8 ≤ GRP / 2).
            float lo = v[0], hi = v[0];
#pragma unroll
            for (int k = 1; k < EPL; k++) { lo = fminf(lo, v[k]); hi = fmaxf(hi, v[k]); }
#pragma unroll
            for (int off = GRP / EPL / 2; off > 0; off >>= 1) {
                lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
                hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
            }
            const int ch = EPL * lane;
            const KiviGroup g = kivi_group(page, i * (D / GRP) + ch / GRP, lo, hi, ch % GRP == 0);
            if (g.fast) {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code_fast(v[k], g);
            } else {
#pragma unroll
                for (int k = 0; k < EPL; k++) code[k] = kivi_code(v[k], g);
            }
        } else {
#pragma unroll
            for (int k = 0; k < EPL; k++) {
                float lo = v[k], hi = v[k];
#pragma unroll
                for (int off = GRP / 2; off > 0; off >>= 1) {
                    lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, off));
                    hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, off));
                }
                const int ch = lane + 32 * k;
                code[k] = kivi_code(v[k], kivi_group(page, i * (D / GRP) + ch / GRP, lo, hi, ch % GRP == 0));
            }
        }
        store(i);
    }
#endif
}
__device__ __forceinline__ void encode_row_fmt(float* v, u8* page, int t, const float* __restrict__ sg,
                                               float rot_scale, const float* __restrict__ thresholds,
                                               const float* __restrict__ centroids, int lane) {
    // Whole pages only (kivi_page_warp); never called.
}
// s·u + z of the element's group (kivi.rs decode_page).
__device__ __forceinline__ void decode_row_fmt(const u8* page, int t, const float* __restrict__ sg, float rot_scale,
                                               const float* __restrict__ cen, int lane, float* v) {
    const u8* row = page + t * ROW_BYTES;
    const u32* w = (const u32*)row;
    const u16* sz = (const u16*)(page + T * ROW_BYTES);
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        const int ch = lane + 32 * k, bit = ch * BITS;
        const u32 c = (w[bit >> 5] >> (bit & 31)) & ((1u << BITS) - 1u);
        const int p = PERCH ? (t / GRP) * D + ch : t * (D / GRP) + ch / GRP;
        v[k] = h2f(sz[p]) * (float)c + h2f(sz[KIVI_NP + p]);
    }
}
#endif

#if FMT_DECODE
#ifndef KG
#define KG 32
#endif
#ifndef VG
#define VG 32
#endif
#endif
#if FMT_DECODE && KK == 8
// kivi keys (kivi.rs): row `row` of page kp as k_row's quarter for thread t, k = s·u + z with
// (s, z) of each channel's token group. An f16x2 slot pairs codes c and c + KHW of a code
// word (KHW: half a word's codes), 16 bits apart: one shift and one mask put both at a half's
// low bits, OR-ed into 1024's f16 (1024 + u exactly), then − 1024 and s·u + z as f16x2 — the
// values the per-element reading gave, in four instructions a pair. A group as long as the
// page is the same for every row: its scales and zeros load once a page.
// d = 96 at 2 bits (a thread's 24 codes are not whole words): code by code, contiguous slots.
#define KCPW (32 / KB)  // codes per word
#define KHW (KCPW / 2)
#define KPAIRS ((QD * KB) % 32 == 0)
#if KPAIRS
#define KDIM_FMT 1
__device__ __forceinline__ int kdim_fmt(int t, int ks, int j) {
    const int p = 2 * ks + (j >> 1);  // the thread's f16x2 slot
    return t * QD + KCPW * (p / KHW) + p % KHW + KHW * (j & 1);
}
#endif
__device__ __forceinline__ void k_row_kivi(const u8* kp, int row, int t, const u16* tab, u32* out) {
    const int grp = KG >= T ? 0 : row / KG;
    const u32* s2 = (const u32*)(kp + T * K_ROW_BYTES) + (grp * D + t * QD) / 2;
    const u32* z2 = s2 + (T * D / KG) / 2;
    u32 sw[QD / 2], zw[QD / 2];
#if K_PAGE_BYTES % 16 == 0 && (T * K_ROW_BYTES) % 16 == 0 && QD % 8 == 0 && (T * D / KG) % 8 == 0
    // 16-byte loads: pages and their scales start 16-byte aligned, and so do the thread's QD
    // channels and the zeros.
#pragma unroll
    for (int i = 0; i < QD / 8; i++) {
        const vec4u s = ((const vec4u*)s2)[i], z = ((const vec4u*)z2)[i];
        sw[4 * i] = s.x; sw[4 * i + 1] = s.y; sw[4 * i + 2] = s.z; sw[4 * i + 3] = s.w;
        zw[4 * i] = z.x; zw[4 * i + 1] = z.y; zw[4 * i + 2] = z.z; zw[4 * i + 3] = z.w;
    }
#else
#pragma unroll
    for (int i = 0; i < QD / 2; i++) { sw[i] = s2[i]; zw[i] = z2[i]; }
#endif
#if KPAIRS
    constexpr int NW = QD * KB / 32;  // the thread's code words: 1 to 8, at a multiple of their size
    const u32* wp = (const u32*)(kp + row * K_ROW_BYTES) + t * NW;
    u32 w[NW];
#pragma unroll
    for (int i = 0; i < NW; i += (NW % 4 == 0 ? 4 : NW % 2 == 0 ? 2 : 1))
        ldraw<NW % 4 == 0 ? 16 : NW % 2 == 0 ? 8 : 4>((const u8*)(wp + i), w + i);
    constexpr u32 M2 = ((1u << KB) - 1u) * 0x10001u;
#pragma unroll
    for (int p = 0; p < QD / 2; p++) {
        const int wi = p / KHW, c = p % KHW, lo = KCPW * wi + c;  // dims lo and lo + KHW (same parity)
        const u32 sel = (c & 1) ? 0x7632u : 0x5410u;
        out[p] = hfma2(ints_h2((w[wi] >> (KB * c)) & M2), prmt(sw[lo / 2], sw[(lo + KHW) / 2], sel),
                       prmt(zw[lo / 2], zw[(lo + KHW) / 2], sel));
    }
#else
    codes_to_h2<KB, QD, K_ROW_BYTES / 4, true>((const u32*)(kp + row * K_ROW_BYTES), t * QD, tab, out);
#pragma unroll
    for (int i = 0; i < QD / 2; i++) out[i] = hfma2(out[i], sw[i], zw[i]);
#endif
}
#define K_ROW(kp, row, t, tab, out) k_row_kivi(kp, row, t, tab, out)
#endif
#if FMT_DECODE && VK == 8
#if VG % VC == 0 && (VC * VB) % 16 == 0
// kivi values (v = s·u + z, (s, z) per token and group of VG ≥ VC channels): the PV mma's A
// operands for the tokens (tA, tA + 1) and (tA + 8, tA + 9) at once (V_TILE). Two tokens'
// 16-bit chunks of codes side by side (one prmt) hold each dim's two codes 16 bits apart, so
// an operand (one dim, two tokens) is one shift and mask, the 1024-magic and s·u + z by the
// tokens' (s, z) pairs: the bits of the per-row reading, without its per-element shifts and the
// transposing prmt.
__device__ __forceinline__ void v_tile_kivi(const u8* vp, int tA, int g, u32 (*va)[4]) {
    constexpr int NB = VC * VB / 8;  // the thread's code bytes per row (2 to 16)
    constexpr int NWR = NB >= 4 ? NB / 4 : 1;
    constexpr int CPC = 16 / VB;     // codes per 16-bit chunk
    constexpr u32 M2 = ((1u << VB) - 1u) * 0x10001u;
    const int tok[4] = {tA, tA + 1, tA + 8, tA + 9};
    u32 w[4][NWR];
#pragma unroll
    for (int r = 0; r < 4; r++) ldraw<NB>(vp + tok[r] * V_ROW_BYTES + g * NB, w[r]);
    const u16* sz = (const u16*)(vp + T * V_ROW_BYTES);
    const int gp = (g * VC) / VG;
    u32 sp[2], zp[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int p0 = tok[2 * h] * (D / VG) + gp, p1 = tok[2 * h + 1] * (D / VG) + gp;
        sp[h] = (u32)sz[p0] | ((u32)sz[p1] << 16);
        zp[h] = (u32)sz[T * D / VG + p0] | ((u32)sz[T * D / VG + p1] << 16);
    }
#pragma unroll
    for (int mt = 0; mt < KS; mt++) {
        const int i = (2 * mt) / CPC, l = (2 * mt) % CPC;  // chunk, code within it
        const u32 sel = (i & 1) ? 0x7632u : 0x5410u;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 u = prmt(w[2 * h][i / 2], w[2 * h + 1][i / 2], sel);
#pragma unroll
            for (int e = 0; e < 2; e++) va[mt][2 * h + e] = hfma2(ints_h2((u >> (VB * (l + e))) & M2), sp[h], zp[h]);
        }
    }
}
#define V_TILE(vp, tA, g, va) v_tile_kivi(vp, tA, g, va)
#else
// d = 96: a thread's VC = 12 dims need not be whole bytes nor lie in one group: row `row`'s
// dims as f16x2 pairs (2m, 2m + 1), each pair's (s, z) by its own group.
__device__ __forceinline__ void v_row_kivi(const u8* vp, int row, int g, const u16* tab, u32* out) {
    codes_to_h2<VB, VC, V_ROW_BYTES / 4, true>((const u32*)(vp + row * V_ROW_BYTES), g * VC, tab, out);
    const u16* sz = (const u16*)(vp + T * V_ROW_BYTES);
#pragma unroll
    for (int m = 0; m < VC / 2; m++) {
        const int p = row * (D / VG) + (g * VC + 2 * m) / VG;
        out[m] = hfma2(out[m], (u32)sz[p] * 0x10001u, (u32)sz[T * D / VG + p] * 0x10001u);
    }
}
#define V_ROW(vp, row, g, tab, out) v_row_kivi(vp, row, g, tab, out)
#endif
#endif
