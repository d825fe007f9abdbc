// Split-K (flash-decoding) attention over the codes, one query token per sequence.
// Grid: (n_splits, n_kv_heads, batch); block: NWARPS warps. A block owns a run of pages of
// one (sequence, KV head); its warps take pages in turn. Per page a warp scores all G query
// heads of the group against the 32 keys with tensor-core mma (keys = A operand, the G heads
// padded to n = 8 = B operand, so one read of the codes serves the group), updates an online
// softmax in base 2, and accumulates values as O^T += V^T · P^T in the value format's domain
// (rotated for turboquant_mse). Warps merge in shared memory; blocks write one partial each,
// merged by combine() in attn.cu. STREAMK (FAST only, see below): a persistent grid whose
// warps each stream an equal run of all rows' pages and write one partial per row they touch.
// Defines: D, T (= 32), G (<= 8), KK/VK (0 fp16, 1 q8_0, 2 q4_0, 3 codes, 8 kivi with KG/VG
// its group size: keys grouped per channel over tokens, values per token over channels; 9
// turboquant_frac; 10 vecinfer with KG/VG its sub-vector size; KK 5 two
// segments per key row: turboquant_prod's codes then sign bits, turboquant_rvq's stage-1 then
// stage-2 codes, K_MSE_BYTES the first's bytes, K2B the second's bits, K2SAME when the second
// segment has the first's bits and table, K2ONE when it has no weight of its own: qjl:2x's
// second block of signs; VK 5: turboquant_rvq values, V_MSE_BYTES and V2B
// likewise, accumulated in two domains, see V2SEG), KB/VB (code bits), KRATIO (rabitq: the key scale
// is ‖x‖/(x0·√d) from two sides), K_ROW_BYTES, V_ROW_BYTES, K_PAGE_BYTES, V_PAGE_BYTES, NWARPS; the variants below
// (STAGES, FUSEQ, SLACK, EXPFTZ, KROT, PDL, PMINB) as attn.rs sets them.
// On the H200 the 4-bit path is bound by shared memory (lookups, page staging; ~88 % of the
// L1/shared pipe at (8, 32k) under ncu): the variants trade it against instructions.
#define QD (D / 4)   // key dims per thread in the score operand
#define VC (D / 8)   // value dims per thread row-group in the PV operand
#define KS (D / 16)  // k-steps of the score mma, = M-tiles of the PV mma
#define NEG_INF (-__int_as_float(0x7f800000))
// FAST (sm_90: bulk copies; NOFAST=1 on older GPUs): 1- to 4-bit key codes (1-bit: qjl's
// signs, a symmetric table by sign-bit xor), 2- to 4-bit value codes, dequantized in registers
// (3-bit codes: one lookup per pair of codes as a 6-bit table entry: a key's two adjacent
// dims are 6 adjacent bits of its row (K3), values pair one dim of two tokens (V3)); 4-bit codes by one
// lookup per byte (two codes) in a lane-replicated f16x2 table in shared memory, 2-bit
// codes by byte lookups too when both streams are 2-bit (K2L / V2L), else the 4 centroids as
// f16 in two registers, two codes -> f16x2 by one prmt; pages streamed through a ring.
#ifndef NOFAST
#define NOFAST 0
#endif
#ifndef K1SYM
#define K1SYM 0
#endif
#ifndef K2B
#define K2B 1
#endif
#ifndef K2SAME
#define K2SAME 0
#endif
#ifndef KRATIO
#define KRATIO 0
#endif
#ifndef K2ONE
#define K2ONE 0  // KK 5: the second segment unweighted (qjl:2x's second block of signs)
#endif
#if !NOFAST && (D == 64 || D == 128) && (KK == 3 || KK == 5) && VK == 3 && ((KB >= 2 && KB <= 4) || (KB == 1 && K1SYM)) && (VB >= 2 && VB <= 4) && (KB != 4 || VB != 4 || KVSAME) && (KK != 5 || K2SAME || K2B == 1)
#define FAST 1
#else
#define FAST 0
#endif
#define K3 (FAST && KB == 3)
// V2SEG (VK 5, generic path): turboquant_rvq values accumulate in both stages' domains
// (turboquant_rvq.rs accumulate): stage 1's codes weighted by n₁ into acc, stage 2's by n₁·n₂
// into acc2; a partial holds both (VACC floats per head), and combine brings the second back
// through R₂ᵀ before adding it and undoing R₁.
#define V2SEG (VK == 5)
#define VACC (V2SEG ? 2 * D : D)
#if V2SEG && FAST
#error "two-domain values take the generic path"
#endif
#define V3 (FAST && VB == 3)
// Query hi and lo halves share one mma (columns [0,G) hi, [G,2G) lo) for G in {1, 2, 4}.
#define QPACK (G == 1 || G == 2 || G == 4)
#define KRB (QD * KB / 8)          // K bytes per thread per row (FAST)
#define KRW ((KRB + 3) / 4)
#define VRB (VC * VB / 8)          // V bytes per thread per row (FAST)
#define VRW ((VRB + 3) / 4)
// FAST: each warp streams its pages through a ring of STAGES page slots in dynamic
// shared memory, issued STAGES-1 pages ahead (measured against one page held in registers:
// ~20 % faster at (8, 32k)).
#ifndef STAGES
#define STAGES 2
#endif
#ifndef FUSEQ
#define FUSEQ 0
#endif
#if !FAST
#undef FUSEQ
#define FUSEQ 0
#endif
// The table (FAST: a 4-bit stream, or 2-bit K and V): the f16x2 pair tables live in dynamic
// shared memory at a 64-KiB-aligned shared address with a 256-byte stride per entry: word
// 64e + lane holds K's entry e, word 64e + 32 + lane V's, so the shared address of a lookup is
// one prmt (byte k of the codes into address byte 1, the lane's offset in byte 0, the table's
// base in bytes 2-3) and the lookup one LDS, never a bank conflict. The rings fill
// the space below the table (as many warps' as fit) and above it; after the loop the table's
// space holds macc.
// K2L (2-bit K and V): the table is K's alone, entry e = the centroids of byte e's four
// codes as two f16x2 (codes 0-1 at word 64e + lane, codes 2-3 at 64e + 32 + lane): one prmt and
// two LDS per code byte (K dims 4b … 4b + 3 of byte b, the default kdim; two 32-bit loads, not
// one 64-bit, so each lands in its own register of the mma operand without moves). V's 2-bit
// codes stay on the prmt path, unless K and V share the centroids (V2L): then the value rows of
// tokens A, B are zipped so that byte j holds (A, B) at two dims, and the same table gives the
// PV operand's (A, B) pairs at both (dims 4j + 2h, + 1 for half h: the default vdim).
#ifndef NOLUT2
#define NOLUT2 0
#endif
#define K2L (FAST && KB == 2 && VB == 2 && !NOLUT2)
// V1L (1-bit keys beside 2-bit values; LUT1V, Tuning::decode_lut1v): keys need no table (sign
// flips), so it holds the values' entries in K2L's layout and the values take V2L's path
// (H100, (8, 32k): qjl and rabitq keys 10–14 % faster than by prmt).
#ifndef LUT1V
#define LUT1V 0
#endif
#define V1L (FAST && KB == 1 && VB == 2 && LUT1V)
#define V2L ((K2L && KVSAME) || V1L)
// EXPFTZ: softmax weights by ex2.approx.ftz (weights below 2^-126 flush to 0).
#ifndef EXPFTZ
#define EXPFTZ 0
#endif
// The softmax weights reach the PV mma's B operand in registers (packed per 8-token half-tile,
// transposed by movmatrix) on the FAST path and, on the generic one, for value formats without
// a per-token scale (PMOVT: fp16, q8_0, q4_0, kivi, vecinfer); the others pass them through
// shared memory (pbuf): with the scales applied before the transpose, one d = 96 case
// (turboquant_rvq:2:2 keys, turboquant_mse:2 values, G = 1, row mode) failed the parity test
// on an H100 (2026-12-07), not yet explained, so those modules keep their verified code.
#define PMOVT (!FAST && VK != 3 && VK != 9 && !V2SEG)
// SLACK: see the softmax update.
#ifndef SLACK
#define SLACK 0
#endif
#ifndef KROT
#define KROT 0
#endif
// FAST: each page's K and V arrive by two cp.async.bulk copies issued by lane 0 and complete
// on a per-slot mbarrier (no per-lane copy instructions). The rows lie unswizzled: lanes with
// t >= 2 take the two rows of each value-token pair in swapped order (and the matching
// weights), which spreads one instruction's value-row reads over all banks.
#if FAST && ((K_PAGE_BYTES % 16) || (V_PAGE_BYTES % 16))
#error "cp.async.bulk copies whole 16-byte units: 2/4-bit pages are multiples of 16 bytes"
#endif
#define KSL ((K_PAGE_BYTES + 127) / 128 * 128)
#define VSL ((V_PAGE_BYTES + 127) / 128 * 128)
#define SLOT (KSL + VSL)

// Blocks per SM the register allocation is held to, as measured on the H200 (commit 24d8d09
// vs 7b29de4): q4_0 and 3-bit codes run best held to 4 blocks/SM (<= 128 registers, no
// spills), fp16 with an explicit 1-block bound; q8_0 and the FAST 2/4-bit paths keep the
// compiler's default bound.
#if defined(VQSM) && VQSM
// vecinfer's staged codebooks (VQSM) leave room for one block per SM: its registers uncapped
// (held to 4 blocks' 64 a thread, the page loop spilled).
#define MINB 1
#elif KK >= 2 && VK >= 2 && !FAST && D <= 128 && !V2SEG
#define MINB 4
#elif KK == 0 && VK == 0
#define MINB 1
#else
#define MINB 0
#endif

// The 8x8 f16 matrix held as the m8n8 fragment (lane g·4+t: row g, cols 2t, 2t+1), transposed.
__device__ __forceinline__ u32 movt(u32 a) {
    u32 d;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}
__device__ __forceinline__ float fexp2(float x) {
#if EXPFTZ
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#else
    return exp2f(x);
#endif
}

// Exact small-integer → f16x2 by the 1024-magic: bytes of w at selector positions become
// half2(q), then one f16x2 multiply by the block scale (one rounding, as q·s in f32 then
// cvt would give: the f32 product of an 8-bit q and an f16 scale is exact).
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// Two integer codes at the low bits of each half of x (the rest zero) as f16x2, exactly: OR-ed
// into 1024's f16 (1024 + u), then − 1024 (kivi's codes, no table).
__device__ __forceinline__ u32 ints_h2(u32 x) { return hsub2(x | 0x64006400u, 0x64006400u); }
// Codes [first, first + N) of a packed row (ROWW words of BITS-bit codes) -> N/2 f16x2 of
// table values. When N·BITS is a whole number of words the window is word-aligned for every
// thread (first is a multiple of N) and is read with the widest aligned vector loads.
// INTS (2- and 4-bit codes whose table is the integers 0, 1, …: kivi): the same f16 values
// by the 1024-magic in registers, no table lookups.
// MAXV: the widest vector load (words) the row's start allows beyond ROWW's own alignment.
// OFF: the bit where code 0 lies (a row's second segment); windows are word-aligned when OFF
// and N·BITS are whole words, else funnel-shifted. PAIRS: codes two at a time from ptab, the
// table of f16x2 (tab[c₀], tab[c₁]) at entry c₀ | c₁ << BITS (BITS ≤ 3: at most 64 words, so a
// lookup is at worst a two-way bank conflict), one load per pair instead of two and a prmt.
template <int BITS, int N, int ROWW, bool INTS = false, int MAXV = 4, int OFF = 0, bool PAIRS = false>
__device__ __forceinline__ void codes_to_h2(const u32* row, int first, const u16* tab, u32* out,
                                            const u32* ptab = nullptr) {
    static_assert(!PAIRS || BITS <= 3, "pair tables of at most 64 entries");
    static_assert(!INTS || BITS == 2 || BITS == 4, "integer codes by the magic: 2 or 4 bits");
    const bool ALIGNED = (N * BITS) % 32 == 0 && OFF % 32 == 0;
    const int NW = ALIGNED ? (N * BITS) / 32 : (N * BITS + 31) / 32 + 1;
    u32 sw[NW + 1];
    if (ALIGNED) {
        const u32* src = row + (OFF + first * BITS) / 32;
        if (NW % 4 == 0 && ROWW % 4 == 0 && MAXV >= 4) {
#pragma unroll
            for (int i = 0; i < NW / 4; i++) {
                vec4u v = ((const vec4u*)src)[i];
                sw[4 * i] = v.x; sw[4 * i + 1] = v.y; sw[4 * i + 2] = v.z; sw[4 * i + 3] = v.w;
            }
        } else if (NW % 2 == 0 && ROWW % 2 == 0 && MAXV >= 2) {
#pragma unroll
            for (int i = 0; i < NW / 2; i++) {
                vec2u v = ((const vec2u*)src)[i];
                sw[2 * i] = v.x; sw[2 * i + 1] = v.y;
            }
        } else {
#pragma unroll
            for (int i = 0; i < NW; i++) sw[i] = src[i];
        }
        sw[NW] = 0u;
    } else {
        int s = OFF + first * BITS, w0 = s >> 5, sh = s & 31;
        u32 w[NW + 1];
#pragma unroll
        for (int i = 0; i < NW; i++) w[i] = (w0 + i < ROWW) ? row[w0 + i] : 0u;
        w[NW] = 0u;
#pragma unroll
        for (int i = 0; i < NW; i++) sw[i] = (u32)(((((u64)w[i + 1]) << 32) | w[i]) >> sh);
        sw[NW] = 0u;
    }
#pragma unroll
    for (int c = 0; c < N; c += 2) {
        if (PAIRS) {
            const int bit = c * BITS, lo = bit >> 5, o = bit & 31;
            u32 v = sw[lo] >> o;
            if (o + 2 * BITS > 32) v |= sw[lo + 1] << (32 - o);
            out[c / 2] = ptab[v & ((1u << (2 * BITS)) - 1u)];
            continue;
        }
        if (INTS) {
            // Codes c, c + 1: 2·BITS bits at a multiple of 2·BITS (first is even), in one word;
            // b + (b << (16 − BITS)) moves code c + 1 to bit 16 without overlapping code c.
            const int bit = c * BITS;
            const u32 m = (1u << BITS) - 1u, b = (sw[bit >> 5] >> (bit & 31)) & (m | (m << BITS));
            const u32 x = (b * (1u + (1u << (16 - BITS)))) & (m | (m << 16));
            out[c / 2] = ints_h2(x);
            continue;
        }
        u32 cc[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int bit = (c + e) * BITS, lo = bit >> 5, o = bit & 31;
            u32 v = sw[lo] >> o;
            if (o + BITS > 32) v |= sw[lo + 1] << (32 - o);
            cc[e] = v & ((1u << BITS) - 1u);
        }
        out[c / 2] = (u32)tab[cc[0]] | ((u32)tab[cc[1]] << 16);
    }
}

// codes_to_h2 for rows at any byte alignment (d = 80 and 112: rows of D·BITS/8 bytes need not
// start on a word boundary): code by code (code_at_bytes).
template <int BITS, int N>
__device__ __forceinline__ void codes_to_h2_bytes(const u8* row, int first, const u16* tab, u32* out) {
#pragma unroll
    for (int c = 0; c < N; c += 2) {
        out[c / 2] = (u32)tab[code_at_bytes<BITS>(row, first + c)] | ((u32)tab[code_at_bytes<BITS>(row, first + c + 1)] << 16);
    }
}

// Codes [first, first + N) of a row segment of ROWW words: codes_to_h2 where rows are whole
// words (D % 32 = 0), else codes_to_h2_bytes. The formats' code readers all go through it.
template <int BITS, int N, int ROWW>
__device__ __forceinline__ void seg_codes_to_h2(const u8* seg, int first, const u16* tab, u32* out) {
#if D % 32 == 0
    codes_to_h2<BITS, N, ROWW>((const u32*)seg, first, tab, out);
#else
    codes_to_h2_bytes<BITS, N>(seg, first, tab, out);
#endif
}

// int8 pair (low 16 bits of w) -> f16x2(q0·s, q1·s); s2 = scale in both halves.
__device__ __forceinline__ u32 i8x2_h2(u32 w, u32 s2) {
    u32 t = prmt(w, 0u, 0x4140u) ^ 0x00800080u;  // (q + 128) as u8 in each half
    return hmul2(hsub2(t | 0x64006400u, 0x64806480u), s2);  // 1024+q+128 − 1152
}
// two nibbles (bits 0-3 and 16-19 of t) -> f16x2((n0 − 8)·s, (n1 − 8)·s).
__device__ __forceinline__ u32 u4x2_h2(u32 t, u32 s2) {
    return hmul2(hsub2((t & 0x000F000Fu) | 0x64006400u, 0x64086408u), s2);  // 1024+n − 1032
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// NB bytes at p (2, 4, 8 or 16, aligned to their size) as words, by one load.
template <int NB>
__device__ __forceinline__ void ldraw(const u8* p, u32* w) {
    if (NB >= 16) {
        vec4u v = *(const vec4u*)p;
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if (NB == 8) {
        vec2u v = *(const vec2u*)p;
        w[0] = v.x; w[1] = v.y;
    } else if (NB == 4) {
        w[0] = *(const u32*)p;
    } else {
        w[0] = *(const u16*)p;
    }
}

// Each format's readers (FMT_DECODE): k_row (thread t's quarter of a key row as KS*2 f16x2)
// and v_row (dims [g*VC, (g+1)*VC) of a value row as VC/2 f16x2), or K_ROW / V_ROW for
// page-level layouts (kivi; V_TILE: the PV operands of two token pairs at once); a key layout of its own by kdim_fmt (KDIM_FMT), a key scale of its
// own by kscale (KRATIO).
// @formats FMT_DECODE
#ifndef K_ROW
#define K_ROW(kp, row, t, tab, out) k_row((kp) + (row) * K_ROW_BYTES, t, tab, out)
#endif
#ifndef V_ROW
#define V_ROW(vp, row, g, tab, out) v_row((vp) + (row) * V_ROW_BYTES, g, tab, out)
#endif
#if V2SEG
#define V_SECOND(vp, row, g, tab, out) v_second((vp) + (row) * V_ROW_BYTES, g, tab, out)
#endif
#if !KRATIO && !defined(KSCALE_FMT)
// Token i's key scale from the page's sides kn: ‖x‖ (codes, qjl, both two-segment formats).
__device__ __forceinline__ float kscale(const u16* kn, int i) { return h2f(kn[i]); }
#endif
#ifndef VSCALE_FMT
// Token i's value scale from the page's sides vn: ‖x‖ (codes).
__device__ __forceinline__ float vscale(const u16* vn, int i) { return h2f(vn[i]); }
#endif
#ifndef KDIM_FMT
#define KDIM_FMT 0
#endif
#ifndef VDIM_FMT
#define VDIM_FMT 0
#endif

// FAST 1-bit rows (k1_dequant): word i = 2ks + j/2 pairs bits (15 − i, 31 − i) of the
// thread's word (d = 128), or (7 − i, 15 − i) of its 16 bits (d = 64).
__device__ __forceinline__ int kdim1(int t, int ks, int j) {
    return t * QD + (D == 128 ? ((j & 1) ? 31 : 15) : ((j & 1) ? 15 : 7)) - (2 * ks + (j >> 1));
}

// The key dim that thread t's slot j of k-step ks holds (the Q operand uses the same map).
__device__ __forceinline__ int kdim(int t, int ks, int j) {
#if FAST && KB == 1
    return kdim1(t, ks, j);
#elif FAST && KB == 2 && !K2L
    return t * QD + 16 * (ks >> 2) + (ks & 3) + 4 * j;
#elif KDIM_FMT
    return kdim_fmt(t, ks, j);
#else
    return t * QD + 4 * ks + j;
#endif
}

#if FAST
// Table entry for byte k of w; lb = the table's shared address (low 16 bits zero) + the
// lane's offset (lane·4, + 128 for V).
__device__ __forceinline__ u32 plut(u32 lb, u32 w, int k) {
    u32 r;
    asm("{\n\t.reg .u32 a;\n\tprmt.b32 a, %1, %2, %3;\n\tld.shared.u32 %0, [a];\n\t}"
        : "=r"(r) : "r"(w), "r"(lb), "r"(0x7604u | ((u32)k << 4)));
    return r;
}
// V2L: the 2-bit codes of rows a and b zipped, byte j = (a, b) at dims 4j + 2h and 4j + 2h + 1
// (two bits each: a, b, a', b' from the low end).
__device__ __forceinline__ u32 zip2(u32 a, u32 b, int h) {
    const u32 lo = h ? (((a >> 4) & 0x03030303u) | ((b >> 2) & 0x0C0C0C0Cu))
                     : ((a & 0x03030303u) | ((b << 2) & 0x0C0C0C0Cu));
    const u32 hi = h ? (((a >> 2) & 0x30303030u) | (b & 0xC0C0C0C0u))
                     : (((a << 2) & 0x30303030u) | ((b << 4) & 0xC0C0C0C0u));
    return lo | hi;
}
// K2L: the two f16x2 of byte k of w's entry (lb: the table's base + lane·4).
__device__ __forceinline__ void plut4(u32 lb, u32 w, int k, u32& lo, u32& hi) {
    asm("{\n\t.reg .u32 a;\n\tprmt.b32 a, %2, %3, %4;\n\tld.shared.u32 %0, [a];\n\tld.shared.u32 %1, [a+128];\n\t}"
        : "=r"(lo), "=r"(hi) : "r"(w), "r"(lb), "r"(0x7604u | ((u32)k << 4)));
}
#if K3 || V3
// A lane's window into a page's rows: its byte offset within a row split once, outside the
// page loop, into the aligned word offset and the funnel shift (the rows are whole words,
// checked below), so each page's window costs its loads and shifts alone.
struct Win {
    int wo;
    u32 sh;
};
__device__ __forceinline__ Win win_of(int off) { return Win{off & ~3, (u32)(off & 3) * 8u}; }
// NW words of the window in the row at `row` (word-aligned, shared memory), its first byte
// first. Reads up to 4 bytes past them (still inside the page slot: the norms follow the
// rows). SH0: the window is word-aligned for every lane (no shift).
template <int NW, bool SH0>
__device__ __forceinline__ void ldw(const u8* row, Win w, u32* out) {
    const u32* wp = (const u32*)(row + w.wo);
    if (SH0) {
#pragma unroll
        for (int i = 0; i < NW; i++) out[i] = wp[i];
        return;
    }
    u32 raw[NW + 1];
#pragma unroll
    for (int i = 0; i <= NW; i++) raw[i] = wp[i];
#pragma unroll
    for (int i = 0; i < NW; i++) out[i] = __funnelshift_r(raw[i], raw[i + 1], w.sh);
}
#if (K3 && (K_ROW_BYTES % 4 || K_MSE_BYTES % 4)) || (V3 && V_ROW_BYTES % 4)
#error "3-bit FAST rows are whole words (d = 64, 128)"
#endif
// x with bit s of the window at bit `to` (a constant shift either way, s and to constant).
__device__ __forceinline__ u32 at_bit(u32 x, int s, int to) { return s >= to ? x >> (s - to) : x << (to - s); }
#endif
#if K3
// The f16x2 (centroid of code 2m, of code 2m + 1) of a key row's window w: the 6 bits at 6m
// as the entry (lbk: the table's lane base for K).
template <int NW>
__device__ __forceinline__ u32 lut6(u32 lbk, const u32* w, int m) {
    const int bit = 6 * m, wi = bit >> 5, o = bit & 31;
    const u32 x = o <= 26 || wi + 1 >= NW ? at_bit(w[wi], o, 8) : at_bit(__funnelshift_r(w[wi], w[wi + 1], o), 0, 8);
    u32 r;
    asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"((x & 0x3F00u) | lbk));
    return r;
}
#endif
#if V3
// Two value windows a, b (rows A, B; code i at bit 3i) zipped for the V table: e holds at bit
// 6m the entry (A's code 2m, B's code 2m) of codes 0-9, o the same for codes 2m + 1 — one shift
// and one bit select each, so a lookup is then one shift, one mask and the load.
#define M3EVEN 0x071C71C7u  // the 3-bit groups 0, 2, 4, 6, 8
__device__ __forceinline__ void zip3(u32 a, u32 b, u32& e, u32& o) {
    e = (a & M3EVEN) | ((b << 3) & ~M3EVEN);
    o = ((a >> 3) & M3EVEN) | (b & ~M3EVEN);
}
// The V table's f16x2 for the entry at bit 6m of x (lbv: the table's lane base for V).
__device__ __forceinline__ u32 lut_at(u32 lbv, u32 x, int m) {
    u32 r;
    asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"((at_bit(x, 6 * m, 8) & 0x3F00u) | lbv));
    return r;
}
#endif
#endif

#if FAST
// 1-bit rows a, b (this thread's QD bits) with a symmetric table {c, −c} (K1SYM; qjl's and
// turboquant_prod's signs: ±1): code 1 is code 0's f16 with the sign flipped. Bits
// (15 − i, 31 − i) of the word shifted to the halves' sign bits, masked and xor-ed into
// base = (c, c): one shift and one LOP3 per f16x2. d = 64: the 16 bits as w << 16 | w << 8,
// so bits 7 − i and 15 − i land on 15 and 31 (kdim1).
__device__ __forceinline__ void k1_dequant(u32 ra, u32 rb, u32 base, u32* ka, u32* kb) {
    const u32 wa = D == 128 ? ra : ((ra << 16) | ((ra & 0xFFFFu) << 8));
    const u32 wb = D == 128 ? rb : ((rb << 16) | ((rb & 0xFFFFu) << 8));
#pragma unroll
    for (int i = 0; i < 2 * KS; i++) {
        ka[i] = ((wa << i) & 0x80008000u) ^ base;
        kb[i] = ((wb << i) & 0x80008000u) ^ base;
    }
}

// One 16-token key tile (FAST): this thread's code words of rows g (ra) and g + 8 (rb) as the
// score mma's A operand. 4-bit: one table lookup per byte (lbk: the table's lane base);
// 2-bit: byte lookups (K2L), else the 4 centroids (kt0, kt1) selected by prmt.
__device__ __forceinline__ void k_dequant(const u32* ra, const u32* rb, u32 lbk, u32 kt0, u32 kt1, u32* ka,
                                          u32* kb) {
#if KB == 4
#pragma unroll
    for (int by = 0; by < KRB; by++) {
        ka[by] = plut(lbk, ra[by / 4], by % 4);
        kb[by] = plut(lbk, rb[by / 4], by % 4);
    }
#elif KB == 1
    k1_dequant(ra[0], rb[0], (kt0 & 0xFFFFu) * 0x10001u, ka, kb);
#elif K3
#pragma unroll
    for (int m = 0; m < QD / 2; m++) {
        ka[m] = lut6<KRW>(lbk, ra, m);
        kb[m] = lut6<KRW>(lbk, rb, m);
    }
#elif K2L
#pragma unroll
    for (int by = 0; by < KRB; by++) {
        plut4(lbk, ra[by / 4], by % 4, ka[2 * by], ka[2 * by + 1]);
        plut4(lbk, rb[by / 4], by % 4, kb[2 * by], kb[2 * by + 1]);
    }
#else
#pragma unroll
    for (int wi = 0; wi < KRW; wi++) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 sa = ((ra[wi] >> (2 * k)) & 0x03030303u) * 0x22u + 0x10101010u;
            const u32 sb = ((rb[wi] >> (2 * k)) & 0x03030303u) * 0x22u + 0x10101010u;
            ka[8 * wi + 2 * k] = prmt(kt0, kt1, sa);
            ka[8 * wi + 2 * k + 1] = prmt(kt0, kt1, sa >> 16);
            kb[8 * wi + 2 * k] = prmt(kt0, kt1, sb);
            kb[8 * wi + 2 * k + 1] = prmt(kt0, kt1, sb >> 16);
        }
    }
#endif
}
#endif

#if FAST
// x rotated left by n bits (n in {0, 16}: swaps the f16 halves when 16).
__device__ __forceinline__ u32 rot16(u32 x, u32 n) {
    u32 r;
    asm("shf.l.wrap.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(x), "r"(n));
    return r;
}
__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Lane 0 only: the page's K and V into the slot at dst, completing on bar.
__device__ __forceinline__ void bulk_page(const u8* kp, const u8* vp, u32 dst, u32 bar) {
    // the slot's previous contents were read by ordinary loads, ordered before the async writes
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                 "r"((u32)(K_PAGE_BYTES + V_PAGE_BYTES)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(kp), "r"((u32)K_PAGE_BYTES), "r"(bar) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst + KSL), "l"(vp), "r"((u32)V_PAGE_BYTES), "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
#endif

// The value dim that acc[mt]'s row half `hf` holds for row-group g.
__device__ __forceinline__ int vdim(int g, int mt, int hf) {
#if FAST && VB == 2 && !V2L
    return VC == 16 ? g * VC + (mt & 1) * 8 + (mt >> 1) + 4 * hf : g * VC + mt + 4 * hf;
#elif VDIM_FMT
    return vdim_fmt(g, mt, hf);
#else
    return g * VC + 2 * mt + hf;
#endif
}

// One B-operand register pair of the query (x0, x1): hi = f16x2(x), lo = the rounding error;
// QPACK: columns g < G hold hi, columns G..2G lo (score_tile sums them).
__device__ __forceinline__ void q_operand(float x0, float x1, int g, u32& qh, u32& ql) {
    const u32 hi = pack_h2(x0, x1);
    const u32 lo = pack_h2(x0 - h2f((u16)(hi & 0xffff)), x1 - h2f((u16)(hi >> 16)));
#if QPACK
    qh = g < G ? hi : lo;
#else
    qh = hi;
#endif
    ql = lo;
}

// Score one 16-token tile: keys ka (rows g) / kb (rows g+8) against the query operand; the
// result c[0..1] = (token g, heads 2t, 2t+1), c[2..3] = token g+8 (QPACK: hi + lo summed).
__device__ __forceinline__ void score_tile(const u32* ka, const u32* kb, const u32 (*qh)[2],
                                           const u32 (*ql)[2], int t, float* c) {
    c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        mma16816(c, ka[2 * ks], kb[2 * ks], ka[2 * ks + 1], kb[2 * ks + 1], qh[ks][0], qh[ks][1]);
#if !QPACK
        mma16816(c, ka[2 * ks], kb[2 * ks], ka[2 * ks + 1], kb[2 * ks + 1], ql[ks][0], ql[ks][1]);
#endif
    }
#if QPACK && G == 1
    c[0] += c[1]; c[1] = c[0];
    c[2] += c[3]; c[3] = c[2];
#elif QPACK
#pragma unroll
    for (int i = 0; i < 4; i++) c[i] += __shfl_xor_sync(FULL_MASK, c[i], G / 2);
#endif
}

// Scores of the page's rows >= `valid` (unwritten rows of a partly filled page) to −inf:
// their softmax weights are exactly 0, so whatever those rows hold is never added.
__device__ __forceinline__ void mask_rows(float (*s)[4], int valid, int g) {
    if (valid >= T) return;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        if (16 * mt + g >= valid) s[mt][0] = s[mt][1] = NEG_INF;
        if (16 * mt + g + 8 >= valid) s[mt][2] = s[mt][3] = NEG_INF;
    }
}

// A format's 16 centroids (f16), passed by value: the table build needs no global load.
struct Tab16 { u16 v[16]; };

// This lane's query operands from prepared rows qb (head hh at qb + hh·D; KK 5: the second
// query at qb2). ALL: every head; else only lanes of head `only`, whose row is qb itself.
template <bool ALL>
__device__ __forceinline__ void q_operands(const float* qb, const float* qb2, int only, int g, int t, u32 (*qh)[2],
                                           u32 (*ql)[2], u32 (*qh2)[2], u32 (*ql2)[2]) {
#if QPACK
    const int head = g < G ? g : g - G;
    const bool on = g < 2 * G;
#else
    const int head = g;
    const bool on = g < G;
#endif
    if (!ALL && !(on && head == only)) return;
    const float* r = ALL ? qb + head * D : qb;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            q_operand(on ? r[kdim(t, ks, 2 * hh)] : 0.0f, on ? r[kdim(t, ks, 2 * hh + 1)] : 0.0f, g, qh[ks][hh],
                      ql[ks][hh]);
#if KK == 5
            // The second segment's map: the first's (K2SAME, and k_second's order on the
            // generic path), else FAST's 1-bit one.
            const float* r2 = qb2 + head * D;
            const bool one = FAST && !K2SAME;
            const int e0 = one ? kdim1(t, ks, 2 * hh) : kdim(t, ks, 2 * hh);
            const int e1 = one ? kdim1(t, ks, 2 * hh + 1) : kdim(t, ks, 2 * hh + 1);
            q_operand(on ? r2[e0] : 0.0f, on ? r2[e1] : 0.0f, g, qh2[ks][hh], ql2[ks][hh]);
#endif
        }
    }
}

// FUSEQ: one query row (lane i holds dims i + 32k, already scaled by log2(e)/√d) sign-flipped
// by sg and Hadamard-rotated in place (the butterflies of span < 32 by shuffles, the others
// within the lane), each butterfly (a + o, a − o) as in prep_query: the same bits.
__device__ __forceinline__ void fuse_rotate(float* x, const float* sg, float krot_scale, int lane) {
#if KROT
#pragma unroll
    for (int k = 0; k < D / 32; k++) x[k] *= sg[lane + 32 * k];
#pragma unroll
    for (int hs = 1; hs < 32; hs <<= 1) {
#pragma unroll
        for (int k = 0; k < D / 32; k++) {
            const float o = __shfl_xor_sync(FULL_MASK, x[k], hs);
            x[k] = (lane & hs) ? (o - x[k]) : (x[k] + o);
        }
    }
#pragma unroll
    for (int m = 1; m < D / 32; m <<= 1) {
#pragma unroll
        for (int k = 0; k < D / 32; k++) {
            if (!(k & m)) {
                const float a = x[k], o = x[k | m];
                x[k] = a + o;
                x[k | m] = a - o;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < D / 32; k++) x[k] *= krot_scale;
#endif
}

// STREAMK (FAST): a persistent grid of one block per SM slot; the flat list of all (row,
// page) pairs (rows = (sequence, KV head) in order, each row's coded pages) is cut into equal
// runs of consecutive pages, one per warp, so every warp streams the same number of pages
// through its ring with no block barrier after the set-up. A warp writes one partial per row
// its run touches, at index (global warp + row): unique, and each row's partials contiguous
// (warps and rows both increase along the list). Block 0 writes each row's (first partial,
// count) to part_rows for combine. Measured against the split-K grid on the H200 (the
// serving shape ran 5.8 waves of one block per SM, each with a table build, ring prologue
// and merge).
#ifndef STREAMK
#define STREAMK 0
#endif
#if STREAMK && !FAST
#error "the stream grid is the FAST path's"
#endif
#ifndef BALANCE
#define BALANCE 0
#endif
#if BALANCE && STREAMK
#error "BALANCE deals split-K blocks"
#endif
#define SKMAXB 512  // sequences per step the stream grid's prefix sums hold (attn.rs SKMAXB)
#if STREAMK
// Flat page x's physical page, row and valid tokens (rs: the sequences' page prefix sums;
// ssl, snc: their slots and coded tokens, in shared memory: one global load per page).
__device__ __forceinline__ void sk_page(int x, const int* rs, int batch, int n_kv, const int* ssl, const int* snc,
                                        const int* page_table, int max_pages, int& phys, int& row, int& valid) {
    int bb = 0;  // the last sequence whose pages start at or before x
#pragma unroll
    for (int step = SKMAXB / 2; step > 0; step >>= 1) {
        if (bb + step < batch && n_kv * rs[bb + step] <= x) bb += step;
    }
    const int np = rs[bb + 1] - rs[bb];
    const int off = x - n_kv * rs[bb];
    const int h = off / np, p = off - h * np;
    phys = page_table[(size_t)(ssl[bb] * n_kv + h) * max_pages + p];
    valid = snc[bb] - p * T;
    row = bb * n_kv + h;
}
// The warp's partial of row pidx − warp: (m, l) per head and the unnormalized accumulator,
// in the layout of the split-K merge's output.
__device__ __forceinline__ void sk_flush(int pidx, float m0, float m1, float l0, float l1, const float (*acc)[4],
                                         int g, int t, float* part_acc, float* part_ml) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(FULL_MASK, l1, off);
    }
    const size_t pb = (size_t)pidx * G;
    if (g == 0 && 2 * t < G) {
        part_ml[(pb + 2 * t) * 2] = m0;
        part_ml[(pb + 2 * t) * 2 + 1] = l0;
    }
    if (g == 0 && 2 * t + 1 < G) {
        part_ml[(pb + 2 * t + 1) * 2] = m1;
        part_ml[(pb + 2 * t + 1) * 2 + 1] = l1;
    }
#pragma unroll
    for (int mt = 0; mt < KS; mt++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int hh = 2 * t + (c & 1);
            if (hh < G) part_acc[(pb + hh) * D + vdim(g, mt, c >> 1)] = acc[mt][c];
        }
    }
}
#endif

#if FAST && defined(PMINB)
#undef MINB
#define MINB PMINB
#endif
#if MINB > 0
#define DECODE_BOUNDS __launch_bounds__(NWARPS * 32, MINB)
#else
#define DECODE_BOUNDS __launch_bounds__(NWARPS * 32)
#endif
extern "C" __global__ void DECODE_BOUNDS decode_pages(
    const float* __restrict__ qprep, const u8* __restrict__ kpool, const u8* __restrict__ vpool,
    const int* __restrict__ page_table, const int* __restrict__ slot_of, const int* __restrict__ n_coded,
    int max_pages,
    int pages_per_split, int n_splits, int n_kv, const Tab16 ktab_p, const Tab16 vtab_p, const Tab16 k2tab_p,
    const Tab16 v2tab_p,
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    const float* __restrict__ q, const float* __restrict__ ksigns, float krot_scale, int batch,
    int* __restrict__ part_rows, const float* __restrict__ vsigns) {
    __shared__ u16 ktab[16], vtab[16];
#if KK == 5 || KK == 9
    __shared__ u16 k2tab[16];  // the second segment's table (turboquant_frac: the narrow codes')
#endif
#if VK == 5 || VK == 9
    __shared__ u16 v2tab[16];  // the second segment's table (turboquant_rvq's stage 2)
#endif
#if STREAMK
    __shared__ float qw[NWARPS][FUSEQ ? D : 1];  // FUSEQ: each warp's query row being rotated
    __shared__ int rs[SKMAXB + 1];  // pages of the sequences before b (rs[batch]: all)
    __shared__ int ssl[SKMAXB], snc[SKMAXB];  // each sequence's slot and coded tokens
    __shared__ int ctot[SKMAXB / 32];
#elif FAST
    __shared__ float qstage[G * D];  // FUSEQ: the group's prepared queries
#elif !PMOVT
    __shared__ float pbuf[NWARPS][32][9];  // softmax weights
#endif
#if !STREAMK
    __shared__ float mml[NWARPS][8][2];
#endif
#if FAST
    extern __shared__ __align__(128) u8 dsm[];
    const u32 dsm_s = (u32)__cvta_generic_to_shared(dsm);
    const u32 tpad = (0u - dsm_s) & 0xFFFFu;
    u8* const tabp = dsm + tpad;  // the table: shared address dsm_s + tpad, low 16 bits zero
    u8* const post = tabp;        // after the loop: macc
#else
    __shared__ __align__(16) u32 big[NWARPS * 8 * D];
#ifdef DECODE_SETUP_FMT
    extern __shared__ __align__(16) u8 dsm[];  // the format's staged state (decode_setup_fmt)
#endif
#endif
#if STREAMK
    (void)post;
#elif FAST
    float (*macc)[8][D] = (float (*)[8][D])post;
#else
    float (*macc)[8][D] = (float (*)[8][D])big;
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#if PDL
    // combine (launched as a programmatic dependent) may start its set-up now; it waits for
    // this grid's completion before reading the partials.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if STREAMK
    const int gw = blockIdx.x * NWARPS + warp;  // this warp's run of the flat page list
#else
    const int h = blockIdx.y;
#if BALANCE
    // BALANCE (split-K, batch ≤ SKMAXB): each KV head's N = n_splits·batch blocks are dealt to
    // the sequences by the pages they hold now, not by the plan's longest: sequence bb takes
    // ⌈P_bb / pps⌉ blocks (its pages cut evenly), pps the least found, refining up from ΣP / N,
    // whose chunks fit the N blocks (the plan's pages_per_split always does). A ragged batch
    // then runs at its mean length's pace, not its longest's. Block 0 of each KV head writes
    // the rows' (first partial, count) for combine; blocks left without a chunk return.
    __shared__ int bpages[SKMAXB], bfirst[SKMAXB + 1];
    const int nblk = gridDim.x * gridDim.z, fb = blockIdx.z * gridDim.x + blockIdx.x;
    for (int bb = tid; bb < batch; bb += NWARPS * 32) {
        const int sl = slot_of[bb];
        bpages[bb] = sl < 0 ? 0 : min((n_coded[sl] + T - 1) / T, max_pages);
    }
    __syncthreads();
    if (warp == 0) {
        auto chunks = [&](int pps) {  // Σ ⌈P / pps⌉ over the sequences, on every lane
            int c = 0;
            for (int bb = lane; bb < batch; bb += 32) c += (bpages[bb] + pps - 1) / pps;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) c += __shfl_xor_sync(FULL_MASK, c, off);
            return c;
        };
        const int tot = chunks(1);
        int pps = min(max((tot + nblk - 1) / nblk, 1), pages_per_split);
        for (int it = 0;; it++) {
            const int c = chunks(pps);
            if (c <= nblk || pps >= pages_per_split) break;
            // Grown by the overshoot (at least a page); after six tries the plan's size.
            const int grown = max(pps + 1, (int)(((long long)pps * c + nblk - 1) / nblk));
            pps = it >= 6 ? pages_per_split : min(grown, pages_per_split);
        }
        int carry = 0;  // the chunks' exclusive prefix sums, 32 sequences at a time
        for (int base = 0; base < batch; base += 32) {
            const int bb = base + lane;
            const int x = bb < batch ? (bpages[bb] + pps - 1) / pps : 0;
            int inc = x;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int o = __shfl_up_sync(FULL_MASK, inc, off);
                if (lane >= off) inc += o;
            }
            if (bb < batch) bfirst[bb] = carry + inc - x;
            carry += __shfl_sync(FULL_MASK, inc, 31);
        }
        if (lane == 0) bfirst[batch] = min(carry, nblk);
    }
    __syncthreads();
    if (fb == 0) {
        for (int bb = tid; bb < batch; bb += NWARPS * 32) {
            const int r = bb * n_kv + h, f0 = min(bfirst[bb], nblk);
            part_rows[2 * r] = h * nblk + f0;
            part_rows[2 * r + 1] = min(bfirst[bb + 1], nblk) - f0;
        }
    }
    if (fb >= bfirst[batch]) return;  // the whole block: no chunk left
    int b = 0;  // the last sequence whose chunks start at or before fb (its range holds fb)
#pragma unroll
    for (int step = SKMAXB / 2; step > 0; step >>= 1) {
        if (b + step < batch && bfirst[b + step] <= fb) b += step;
    }
    const int cj = fb - bfirst[b], cn = bfirst[b + 1] - bfirst[b];
    const int p0 = (int)((long long)cj * bpages[b] / cn), pend = (int)((long long)(cj + 1) * bpages[b] / cn);
    const int part = h * nblk + fb;
#else
    const int b = blockIdx.z, p0 = blockIdx.x * pages_per_split, pend = p0 + pages_per_split;
    const int part = (b * n_kv + h) * n_splits + blockIdx.x;
#endif
#endif
#if FUSEQ && !STREAMK
    // This warp's first query head (hh = warp), loaded now: the loads overlap the set-up.
    float q0[D / 32];
    if (warp < G) {
#pragma unroll
        for (int k = 0; k < D / 32; k++) q0[k] = q[((size_t)(b * n_kv + h) * G + warp) * D + lane + 32 * k];
    }
#endif
#if !STREAMK
    // Row b of the step reads cache slot slot_of[b] (< 0: an idle row, no pages); the slot's
    // n_coded tokens fill ⌈n_coded / T⌉ pages, the last one possibly in part (row mode).
    const int cslot = slot_of[b];
    const int nc = cslot < 0 ? 0 : n_coded[cslot];
    const int np = (nc + T - 1) / T;
    const int* pt = page_table + (size_t)((cslot < 0 ? 0 : cslot) * n_kv + h) * max_pages;
#endif
#if FAST
    // The first pages go in flight before anything else: this warp's pages are first + NWARPS·j,
    // j < nmine; lane i holds the physical index of page j = i (mod 32) of the chunk being
    // fetched (the first chunk read without waiting for n_pages: entries past it are unused).
#if FAST
    const int nlow = min((int)(tpad / (STAGES * SLOT)), NWARPS);  // rings below the table
    {
        // The host sized the dynamic part for its layout; never write past it.
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (tpad + 65536u + (u32)(NWARPS - nlow) * (STAGES * SLOT) > dyn) __trap();
    }
    u8* const ring = warp < nlow ? dsm + warp * (STAGES * SLOT) : tabp + 65536 + (warp - nlow) * (STAGES * SLOT);
#else
    u8* const ring = dsm + warp * (STAGES * SLOT);
#endif
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
#if !STREAMK
    const int first = p0 + warp;
    int ptv;
    {
        const int pi = first + NWARPS * lane;
        ptv = pi < min(pend, max_pages) ? pt[pi] : 0;
    }
    const int p1 = min(pend, np);
    const int nmine = first < p1 ? (p1 - first + NWARPS - 1) / NWARPS : 0;
#endif
    __shared__ __align__(8) u64 mbar[NWARPS][STAGES];
    const u32 bar_s = (u32)__cvta_generic_to_shared(&mbar[warp][0]);
    if (lane == 0) {
#pragma unroll
        for (int f = 0; f < STAGES; f++) mbar_init(bar_s + 8 * f);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
#if !STREAMK
#pragma unroll
    for (int f = 0; f < STAGES - 1; f++) {
        if (f < nmine) {
            const int ph = __shfl_sync(FULL_MASK, ptv, f);
            if (lane == 0)
                bulk_page(kpool + (size_t)ph * K_PAGE_BYTES, vpool + (size_t)ph * V_PAGE_BYTES, ring_s + f * SLOT,
                          bar_s + 8 * f);
        }
    }
#endif
#else
    const int p1 = min(pend, np);
#endif
#if STREAMK
    // Each sequence's pages into rs[1 + b] (the loads overlap the table build below).
    for (int bb = tid; bb < batch; bb += NWARPS * 32) {
        const int sl = slot_of[bb];
        const int nc = sl < 0 ? 0 : n_coded[sl];
        ssl[bb] = max(sl, 0);
        snc[bb] = nc;
        rs[1 + bb] = min((nc + T - 1) / T, max_pages);
    }
    if (tid == 0) rs[0] = 0;
#endif
    if (tid < 16) {
        u16 kx = 0, vx = 0;  // constant indices: the parameters stay in the constant bank
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (tid == i) { kx = ktab_p.v[i]; vx = vtab_p.v[i]; }
        }
        ktab[tid] = kx;
        vtab[tid] = vx;
#if KK == 5 || KK == 9
        u16 k2x = 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (tid == i) k2x = k2tab_p.v[i];
        }
        k2tab[tid] = k2x;
#endif
#if VK == 5 || VK == 9
        u16 v2x = 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (tid == i) v2x = v2tab_p.v[i];
        }
        v2tab[tid] = v2x;
#endif
    }
#if !FAST && defined(DECODE_SETUP_FMT)
    decode_setup_fmt(dsm, ksigns, vsigns, h, tid, NWARPS * 32);  // a format's per-block state
#endif
    __syncthreads();
#if !FAST && defined(DECODE_TABLES_FMT)
    // A format's tables derived from the code tables (turboquant_frac's pair tables).
#if KK == 5 || KK == 9
    const u16* const k2t = k2tab;
#else
    const u16* const k2t = ktab;
#endif
#if VK == 5 || VK == 9
    const u16* const v2t = v2tab;
#else
    const u16* const v2t = vtab;
#endif
    decode_tables_fmt(ktab, k2t, vtab, v2t, tid, NWARPS * 32);
    __syncthreads();
#endif
#if FAST
    {
        // Entry e's 32 K words are equal (as are its 32 V words, K2L: its 32 second K words):
        // 16-byte stores of one value.
        for (int i = tid; i < 256 * 16; i += NWARPS * 32) {
            const int e = i >> 4;
#if K2L || V1L
            const u16* t2 = V1L ? vtab : ktab;
            const int sh = (i & 8) ? 4 : 0;  // codes 2-3 in the entry's second half
            const u32 x = (u32)t2[(e >> sh) & 3] | ((u32)t2[(e >> (sh + 2)) & 3] << 16);
#else
            const u16* ts = (i & 8) ? vtab : ktab;
#if K3 || V3
            // A 3-bit stream's entry e < 64 pairs the centroids of codes e & 7 and e >> 3.
            const bool three = (i & 8) ? V3 : K3;
            const u32 x = three ? ((u32)ts[e & 7] | ((u32)ts[(e >> 3) & 7] << 16))
                                : ((u32)ts[e & 15] | ((u32)ts[e >> 4] << 16));
#else
            const u32 x = (u32)ts[e & 15] | ((u32)ts[e >> 4] << 16);
#endif
#endif
            *(vec4u*)(tabp + 16 * i) = vec4u{x, x, x, x};
        }
        __syncthreads();
    }
    const u32 lbk = dsm_s + tpad + (u32)lane * 4u, lbv = lbk + 128u;
    const u32 kt0 = (u32)ktab[0] | ((u32)ktab[1] << 16), kt1 = (u32)ktab[2] | ((u32)ktab[3] << 16);
    const u32 vt0 = (u32)vtab[0] | ((u32)vtab[1] << 16), vt1 = (u32)vtab[2] | ((u32)vtab[3] << 16);
#endif
    // load: the group's prepared queries as the B operand, split hi + lo for ~f32 accuracy
    // (QPACK: column g < G holds head g's hi part, column G + g its lo part).
    u32 qh[KS][2], ql[KS][2];
    // KK 5: the second query (prep_query's second half: turboquant_prod's c·S·R·q,
    // turboquant_rvq's R₂·R₁·q) for the second segment.
    u32 qh2[KK == 5 ? KS : 1][2], ql2[KK == 5 ? KS : 1][2];
#if STREAMK
    // The sequences' page prefix sums: chunks of 32 scanned by the warps, then the chunks'
    // totals by warp 0, then added.
    __syncthreads();
    for (int c = warp; 32 * c < batch; c += NWARPS) {
        const int i = 1 + 32 * c + lane;
        int x = i <= batch ? rs[i] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(FULL_MASK, x, off);
            if (lane >= off) x += o;
        }
        if (i <= batch) rs[i] = x;
        if (lane == 31) ctot[c] = x;
    }
    __syncthreads();
    const int nchunk = (batch + 31) / 32;
    if (warp == 0) {
        int x = lane < nchunk ? ctot[lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(FULL_MASK, x, off);
            if (lane >= off) x += o;
        }
        if (lane < nchunk) ctot[lane] = x;  // inclusive
    }
    __syncthreads();
    for (int i = 33 + tid; i <= batch; i += NWARPS * 32) rs[i] += ctot[(i - 1) / 32 - 1];
    __syncthreads();
    const int n_pages = n_kv * rs[batch];
    const int n_warps = gridDim.x * NWARPS;
    const int ppw = max((n_pages + n_warps - 1) / n_warps, 1);  // pages per warp's run
    if (blockIdx.x == 0) {
        // Row r's pages [start, start + np) of the flat list lie in the runs of warps
        // start / ppw … (start + np − 1) / ppw: its partials are (warp + r) for those warps.
        for (int r = tid; r < batch * n_kv; r += NWARPS * 32) {
            const int bb = r / n_kv, hk = r - bb * n_kv;
            const int np_r = rs[bb + 1] - rs[bb];
            const int start = n_kv * rs[bb] + hk * np_r;
            const int wf = start / ppw, wl = (start + np_r - 1) / ppw;
            part_rows[2 * r] = wf + r;
            part_rows[2 * r + 1] = np_r > 0 ? wl - wf + 1 : 0;
        }
    }
    const int x0 = gw * ppw;
    const int nmine = max(min(x0 + ppw, n_pages) - x0, 0);
    // Lane i: page x0 + 32c + i of the chunk c being fetched (fph, frow, fval), of the next one
    // (nph, nrow, nval: looked up 16 pages ahead of its first fetch) and of the chunk being
    // consumed (crow, cval); the fetch runs at most STAGES − 1 < 16 pages ahead.
    int fph = 0, frow = -1, fval = 0, nph = 0, nrow = -1, nval = 0, crow = -1, cval = 0;
    if (lane < nmine) sk_page(x0 + lane, rs, batch, n_kv, ssl, snc, page_table, max_pages, fph, frow, fval);
#pragma unroll
    for (int f = 0; f < STAGES - 1; f++) {
        if (f < nmine) {
            const int ph = __shfl_sync(FULL_MASK, fph, f);
            if (lane == 0)
                bulk_page(kpool + (size_t)ph * K_PAGE_BYTES, vpool + (size_t)ph * V_PAGE_BYTES, ring_s + f * SLOT,
                          bar_s + 8 * f);
        }
    }
    int cur_row = -1;  // the row whose partial the warp accumulates
#if PDL
    // prep_query (this grid's programmatic primary) has written qprep: read below.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#else
#if FUSEQ
    // prep_query fused: the group's G query rows, scaled by log2(e)/√d, sign-flipped and
    // Hadamard-rotated (a warp per head: lane i holds dims i + 32k).
    for (int hh = warp; hh < G; hh += NWARPS) {
        const float sc = LOG2E / sqrtf((float)D);
        float x[D / 32];
#pragma unroll
        for (int k = 0; k < D / 32; k++)
            x[k] = (hh == warp ? q0[k] : q[((size_t)(b * n_kv + h) * G + hh) * D + lane + 32 * k]) * sc;
        fuse_rotate(x, ksigns + h * D, krot_scale, lane);
#pragma unroll
        for (int k = 0; k < D / 32; k++) qstage[hh * D + lane + 32 * k] = x[k];
    }
    __syncthreads();
    const float* qb = qstage;
#else
#if PDL
    // prep_query (this grid's programmatic primary, when launched as one) has written qprep.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const float* qb = qprep + ((size_t)(b * n_kv + h) * G) * D;
#endif
    // FUSEQ is off for KK 5 (the second query comes from prep_query).
    q_operands<true>(qb, qb + (size_t)batch * n_kv * G * D, 0, g, t, qh, ql, qh2, ql2);
#endif
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float acc[KS][4];
#pragma unroll
    for (int i = 0; i < KS; i++) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
#if V2SEG
    float acc2[KS][4];
#pragma unroll
    for (int i = 0; i < KS; i++) { acc2[i][0] = acc2[i][1] = acc2[i][2] = acc2[i][3] = 0.0f; }
#endif

#if FAST
    // This lane reads value-token pairs (2t, 2t+1) in swapped order when t >= 2: offsets of its
    // first value row and of the other row relative to it.
    const int vsw = (t >> 1) & 1;
    const int v_row0 = (2 * t + vsw) * V_ROW_BYTES, v_other = (1 - 2 * vsw) * V_ROW_BYTES;
#if V3
    const Win vwin = win_of(g * VRB);  // 3-bit windows are not byte-aligned per lane
#else
    const int v_lane = v_row0 + g * VRB;
#endif
#if K3
    const Win kwin = win_of(t * KRB);
#endif
    const u32 vn_rot = 16u * vsw;
    // Unrolled by the ring's depth, the slots are constants in each copy of the body.
#pragma unroll STAGES
    for (int j = 0; j < nmine; j++) {
        const int slot = j % STAGES, fslot = (j + STAGES - 1) % STAGES;
        float s[2][4];
        {
            const int f = j + STAGES - 1;
#if STREAMK
            if ((j & 31) == 0) { crow = frow; cval = fval; }
            if ((f & 31) == 0 && f < nmine) { fph = nph; frow = nrow; fval = nval; }
            if ((f & 31) == 16 && f + 16 < nmine) {
                nph = 0; nrow = -1; nval = 0;
                if (f + 16 + lane < nmine)
                    sk_page(x0 + f + 16 + lane, rs, batch, n_kv, ssl, snc, page_table, max_pages, nph, nrow, nval);
            }
            const int ptv = fph;
#else
            if ((f & 31) == 0) ptv = f + lane < nmine ? pt[first + NWARPS * (f + lane)] : 0;
#endif
            __syncwarp();  // every lane is done with slot fslot (page j - 1)
            if (f < nmine) {
                const int ph = __shfl_sync(FULL_MASK, ptv, f & 31);
                if (lane == 0)
                    bulk_page(kpool + (size_t)ph * K_PAGE_BYTES, vpool + (size_t)ph * V_PAGE_BYTES,
                              ring_s + fslot * SLOT, bar_s + 8 * fslot);
            }
            mbar_wait(bar_s + 8 * slot, (u32)(j / STAGES) & 1u);
        }
#if STREAMK
        const int valid = __shfl_sync(FULL_MASK, cval, j & 31);
        {
            const int row = __shfl_sync(FULL_MASK, crow, j & 31);
            if (row != cur_row) {
                // A new row: the last one's partial out, this one's query operands in.
                if (cur_row >= 0) sk_flush(gw + cur_row, m0, m1, l0, l1, acc, g, t, part_acc, part_ml);
                cur_row = row;
#if FUSEQ
                // prep_query fused, as the split-K grid does it, by this warp alone: the heads'
                // rows loaded four at a time (one load round each), rotated and staged one by
                // one, each lane taking its operands from its own head's row.
#pragma unroll
                for (int h0 = 0; h0 < G; h0 += 4) {
                    float x[4][D / 32];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
#pragma unroll
                        for (int k = 0; k < D / 32; k++)
                            x[i][k] = h0 + i < G ? q[((size_t)row * G + h0 + i) * D + lane + 32 * k] * (LOG2E / sqrtf((float)D)) : 0.0f;
                    }
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        if (h0 + i >= G) break;
                        fuse_rotate(x[i], ksigns + (row % n_kv) * D, krot_scale, lane);
                        __syncwarp();  // the last head's operands are read
#pragma unroll
                        for (int k = 0; k < D / 32; k++) qw[warp][lane + 32 * k] = x[i][k];
                        __syncwarp();
                        q_operands<false>(qw[warp], nullptr, h0 + i, g, t, qh, ql, qh2, ql2);
                    }
                }
#if QPACK
                if (!(g < 2 * G)) q_operands<true>(qw[warp], nullptr, 0, g, t, qh, ql, qh2, ql2);
#else
                if (!(g < G)) q_operands<true>(qw[warp], nullptr, 0, g, t, qh, ql, qh2, ql2);
#endif
#else
                const float* qb = qprep + (size_t)row * G * D;
                q_operands<true>(qb, qb + (size_t)batch * n_kv * G * D, 0, g, t, qh, ql, qh2, ql2);
#endif
                m0 = m1 = NEG_INF;
                l0 = l1 = 0.0f;
#pragma unroll
                for (int i = 0; i < KS; i++) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
            }
        }
#endif
        const u8* const kst = ring + slot * SLOT;
        const u8* const vst = kst + KSL;
        const u16* const knp = (const u16*)(kst + T * K_ROW_BYTES);
        const u16* const vnp = (const u16*)(vst + T * V_ROW_BYTES);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            u32 ka[KS * 2], kb[KS * 2];
            u32 kra[KRW], krb[KRW];
#if K3
            ldw<KRW, KRB % 4 == 0>(kst + (16 * mt + g) * K_ROW_BYTES, kwin, kra);
            ldw<KRW, KRB % 4 == 0>(kst + (16 * mt + g + 8) * K_ROW_BYTES, kwin, krb);
#else
            ldraw<KRB>(kst + ((16 * mt + g) * K_ROW_BYTES + t * KRB), kra);
            ldraw<KRB>(kst + ((16 * mt + g + 8) * K_ROW_BYTES + t * KRB), krb);
#endif
            k_dequant(kra, krb, lbk, kt0, kt1, ka, kb);
            float c[4];
            score_tile(ka, kb, qh, ql, t, c);
            const float n0 = kscale(knp, 16 * mt + g), n1 = kscale(knp, 16 * mt + g + 8);
#if KK == 5
            {
                // + n₂·⟨q₂, second segment⟩: turboquant_prod's γ·⟨c·S·R·q, ±1⟩ over the sign bits,
                // turboquant_rvq's n₂·⟨R₂·R₁·q, ẑ⟩ over the stage-2 codes (dequantized as the first).
#if K2SAME
#if K3
                const u8* sr = kst + K_MSE_BYTES;
                ldw<KRW, KRB % 4 == 0>(sr + (16 * mt + g) * K_ROW_BYTES, kwin, kra);
                ldw<KRW, KRB % 4 == 0>(sr + (16 * mt + g + 8) * K_ROW_BYTES, kwin, krb);
#else
                const u8* sr = kst + K_MSE_BYTES + t * KRB;
                ldraw<KRB>(sr + (16 * mt + g) * K_ROW_BYTES, kra);
                ldraw<KRB>(sr + (16 * mt + g + 8) * K_ROW_BYTES, krb);
#endif
                k_dequant(kra, krb, lbk, kt0, kt1, ka, kb);
#else
                const u8* sr = kst + K_MSE_BYTES + t * (QD / 8);
                u32 sa, sb;
                if (QD == 32) {
                    sa = *(const u32*)(sr + (16 * mt + g) * K_ROW_BYTES);
                    sb = *(const u32*)(sr + (16 * mt + g + 8) * K_ROW_BYTES);
                } else {
                    sa = *(const u16*)(sr + (16 * mt + g) * K_ROW_BYTES);
                    sb = *(const u16*)(sr + (16 * mt + g + 8) * K_ROW_BYTES);
                }
                k1_dequant(sa, sb, (u32)k2tab[0] * 0x10001u, ka, kb);  // base (c₀, c₀): −1 for the signs
#endif
                float c2[4];
                score_tile(ka, kb, qh2, ql2, t, c2);
#if K2ONE
                const float g0 = 1.0f, g1 = 1.0f;  // qjl:2x: one side, both halves alike
#else
                const float g0 = h2f(knp[T + 16 * mt + g]), g1 = h2f(knp[T + 16 * mt + g + 8]);
#endif
                c[0] += g0 * c2[0]; c[1] += g0 * c2[1]; c[2] += g1 * c2[2]; c[3] += g1 * c2[3];
            }
#endif
            s[mt][0] = c[0] * n0; s[mt][1] = c[1] * n0; s[mt][2] = c[2] * n1; s[mt][3] = c[3] * n1;
        }
#if STREAMK
        mask_rows(s, valid, g);
#else
        mask_rows(s, nc - (first + NWARPS * j) * T, g);
#endif
#else
    for (int p = p0 + warp; p < p1; p += NWARPS) {
        float s[2][4];
        const int phys = pt[p];
        const u8* kp = kpool + (size_t)phys * K_PAGE_BYTES;
        const u8* vp = vpool + (size_t)phys * V_PAGE_BYTES;
        // score: s[mt] = (tok 16mt+g | +8) x (head 2t | 2t+1), log2 units
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            u32 ka[KS * 2], kb[KS * 2];
            K_ROW(kp, 16 * mt + g, t, ktab, ka);
            K_ROW(kp, 16 * mt + g + 8, t, ktab, kb);
            float c[4];
            score_tile(ka, kb, qh, ql, t, c);
#if KK == 3 || KK == 9
            const u16* kn = (const u16*)(kp + T * K_ROW_BYTES);
            float n0 = kscale(kn, 16 * mt + g), n1 = kscale(kn, 16 * mt + g + 8);
            c[0] *= n0; c[1] *= n0; c[2] *= n1; c[3] *= n1;
#elif KK == 5
            {
                // n₁·(⟨q₁, first segment⟩ + n₂·⟨q₂, second segment⟩)
                k_second(kp + (16 * mt + g) * K_ROW_BYTES, t, k2tab, ka);
                k_second(kp + (16 * mt + g + 8) * K_ROW_BYTES, t, k2tab, kb);
                float c2[4];
                score_tile(ka, kb, qh2, ql2, t, c2);
                const u16* kn = (const u16*)(kp + T * K_ROW_BYTES);
                const float n0 = h2f(kn[16 * mt + g]), n1 = h2f(kn[16 * mt + g + 8]);
#if K2ONE
                const float g0 = 1.0f, g1 = 1.0f;
#else
                const float g0 = h2f(kn[T + 16 * mt + g]), g1 = h2f(kn[T + 16 * mt + g + 8]);
#endif
                c[0] = (c[0] + g0 * c2[0]) * n0; c[1] = (c[1] + g0 * c2[1]) * n0;
                c[2] = (c[2] + g1 * c2[2]) * n1; c[3] = (c[3] + g1 * c2[3]) * n1;
            }
#endif
            s[mt][0] = c[0]; s[mt][1] = c[1]; s[mt][2] = c[2]; s[mt][3] = c[3];
        }
        mask_rows(s, nc - p * T, g);
#endif  // FAST
        // update state: online softmax per head column. The running max m may trail the
        // scores by up to SLACK (log2 units): weights stay <= 2^SLACK (exact enough in f16, far
        // from its range), and the max is reduced across lanes, and the state rescaled, only
        // when a score exceeds m + SLACK (the first page, then rarely; SLACK = 0: whenever a
        // head's max grows).
        float x0 = fmaxf(fmaxf(s[0][0], s[0][2]), fmaxf(s[1][0], s[1][2]));
        float x1 = fmaxf(fmaxf(s[0][1], s[0][3]), fmaxf(s[1][1], s[1][3]));
        if (__any_sync(FULL_MASK, x0 > m0 + SLACK || x1 > m1 + SLACK)) {
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                x0 = fmaxf(x0, __shfl_xor_sync(FULL_MASK, x0, off));
                x1 = fmaxf(x1, __shfl_xor_sync(FULL_MASK, x1, off));
            }
            const float mn0 = fmaxf(m0, x0), mn1 = fmaxf(m1, x1);
            const float a0 = fexp2(m0 - mn0), a1 = fexp2(m1 - mn1);
            m0 = mn0; m1 = mn1;
            l0 *= a0; l1 *= a1;
#pragma unroll
            for (int i = 0; i < KS; i++) { acc[i][0] *= a0; acc[i][1] *= a1; acc[i][2] *= a0; acc[i][3] *= a1; }
#if V2SEG
#pragma unroll
            for (int i = 0; i < KS; i++) { acc2[i][0] *= a0; acc2[i][1] *= a1; acc2[i][2] *= a0; acc2[i][3] *= a1; }
#endif
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            s[mt][0] = fexp2(s[mt][0] - m0); s[mt][2] = fexp2(s[mt][2] - m0);
            s[mt][1] = fexp2(s[mt][1] - m1); s[mt][3] = fexp2(s[mt][3] - m1);
        }
        l0 += (s[0][0] + s[0][2]) + (s[1][0] + s[1][2]);
        l1 += (s[0][1] + s[0][3]) + (s[1][1] + s[1][3]);
#if FAST
        // B operand of the PV mma: the weights of tokens 16mt + 2t, +1 (b0) and + 8, + 9 (b1)
        // for head g, times the value norms, from the score layout (token g | g + 8, heads 2t,
        // 2t + 1) by one transpose per 8-token half-tile.
        u32 pb[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const float n0 = h2f(vnp[16 * mt + g]), n1 = h2f(vnp[16 * mt + g + 8]);
            pb[mt][0] = movt(pack_h2(s[mt][0] * n0, s[mt][1] * n0));
            pb[mt][1] = movt(pack_h2(s[mt][2] * n1, s[mt][3] * n1));
            pb[mt][0] = rot16(pb[mt][0], vn_rot);  // this lane's token pairs in swapped order
            pb[mt][1] = rot16(pb[mt][1], vn_rot);
        }
#elif PMOVT
        // The generic path's B operand the same way, for value formats without a per-token scale.
        u32 pb[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            pb[mt][0] = movt(pack_h2(s[mt][0], s[mt][1]));
            pb[mt][1] = movt(pack_h2(s[mt][2], s[mt][3]));
        }
#else
        __syncwarp();
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            pbuf[warp][16 * mt + g][2 * t] = s[mt][0];
            pbuf[warp][16 * mt + g][2 * t + 1] = s[mt][1];
            pbuf[warp][16 * mt + g + 8][2 * t] = s[mt][2];
            pbuf[warp][16 * mt + g + 8][2 * t + 1] = s[mt][3];
        }
        __syncwarp();
#endif
        // accumulate: O^T[dim][head] += V^T[dim][tok] · P^T[tok][head]
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const int tA = 16 * kk + 2 * t;
#if !FAST && !PMOVT
            float wA = pbuf[warp][tA][g], wB = pbuf[warp][tA + 1][g];
            float wC = pbuf[warp][tA + 8][g], wD = pbuf[warp][tA + 9][g];
#endif
#if FAST
            u32 vr[4][VRW];
#if V3
            const u8* const vw = vst + v_row0 + 16 * kk * V_ROW_BYTES;
            ldw<VRW, VRB % 4 == 0>(vw, vwin, vr[0]);
            ldw<VRW, VRB % 4 == 0>(vw + v_other, vwin, vr[1]);
            ldw<VRW, VRB % 4 == 0>(vw + 8 * V_ROW_BYTES, vwin, vr[2]);
            ldw<VRW, VRB % 4 == 0>(vw + 8 * V_ROW_BYTES + v_other, vwin, vr[3]);
#else
            const u8* const vl = vst + v_lane + 16 * kk * V_ROW_BYTES;
            ldraw<VRB>(vl, vr[0]);
            ldraw<VRB>(vl + v_other, vr[1]);
            ldraw<VRB>(vl + 8 * V_ROW_BYTES, vr[2]);
            ldraw<VRB>(vl + 8 * V_ROW_BYTES + v_other, vr[3]);
#endif
            const u32 b0 = pb[kk][0], b1 = pb[kk][1];
#if VB == 4
#pragma unroll
            for (int wi = 0; wi < VRW; wi++) {
                const u32 vA = vr[0][wi], vB = vr[1][wi];
                const u32 vC = vr[2][wi], vD = vr[3][wi];
                const u32 loAB = (vA & 0x0F0F0F0Fu) | ((vB << 4) & 0xF0F0F0F0u);
                const u32 hiAB = ((vA >> 4) & 0x0F0F0F0Fu) | (vB & 0xF0F0F0F0u);
                const u32 loCD = (vC & 0x0F0F0F0Fu) | ((vD << 4) & 0xF0F0F0F0u);
                const u32 hiCD = ((vC >> 4) & 0x0F0F0F0Fu) | (vD & 0xF0F0F0F0u);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    if (4 * wi + k < KS) {
                        mma16816(acc[4 * wi + k], plut(lbv, loAB, k), plut(lbv, hiAB, k),
                                 plut(lbv, loCD, k), plut(lbv, hiCD, k), b0, b1);
                    }
                }
            }
#elif V3
            // Rows A, B (this lane's token pair) and C, D (the pair 8 tokens on): code i of the
            // lane's window at bit 3i; the A operand's halves pair one dim of two tokens.
            // Segments of 10 codes: 0-9 in word 0, 10-15 (d = 128) from bit 30.
            constexpr int NSEG = (VC + 9) / 10;
            u32 eab[NSEG], oab[NSEG], ecd[NSEG], ocd[NSEG];
#pragma unroll
            for (int sg = 0; sg < NSEG; sg++) {
                u32 x[4];
#pragma unroll
                for (int r = 0; r < 4; r++) x[r] = sg == 0 ? vr[r][0] : __funnelshift_r(vr[r][0], vr[r][VRW - 1], 30);
                zip3(x[0], x[1], eab[sg], oab[sg]);
                zip3(x[2], x[3], ecd[sg], ocd[sg]);
            }
#pragma unroll
            for (int mt = 0; mt < KS; mt++) {
                const int sg = mt / 5, m = mt % 5;
                mma16816(acc[mt], lut_at(lbv, eab[sg], m), lut_at(lbv, oab[sg], m), lut_at(lbv, ecd[sg], m),
                         lut_at(lbv, ocd[sg], m), b0, b1);
            }
#elif V2L
            const u32 vA = vr[0][0], vB = vr[1][0];
            const u32 vC = vr[2][0], vD = vr[3][0];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 zab = zip2(vA, vB, h), zcd = zip2(vC, vD, h);
#pragma unroll
                for (int j = 0; j < VC / 4; j++) {
                    u32 a0, a1, a2, a3;
                    plut4(lbk, zab, j, a0, a1);
                    plut4(lbk, zcd, j, a2, a3);
                    mma16816(acc[2 * j + h], a0, a1, a2, a3, b0, b1);
                }
            }
#else
            const u32 vA = vr[0][0], vB = vr[1][0];
            const u32 vC = vr[2][0], vD = vr[3][0];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 xa = (vA >> (2 * k)) & 0x03030303u, xb = (vB >> (2 * k)) & 0x03030303u;
                const u32 xc = (vC >> (2 * k)) & 0x03030303u, xd = (vD >> (2 * k)) & 0x03030303u;
                const u32 s0 = prmt(xa, xb, 0x5140u) * 0x22u + 0x10101010u;
                const u32 s1 = prmt(xc, xd, 0x5140u) * 0x22u + 0x10101010u;
                const int mt0 = VC == 16 ? 2 * k : k;
                mma16816(acc[mt0], prmt(vt0, vt1, s0), prmt(vt0, vt1, s0 >> 16), prmt(vt0, vt1, s1),
                         prmt(vt0, vt1, s1 >> 16), b0, b1);
                if (VC == 16) {
                    const u32 s2 = prmt(xa, xb, 0x7362u) * 0x22u + 0x10101010u;
                    const u32 s3 = prmt(xc, xd, 0x7362u) * 0x22u + 0x10101010u;
                    mma16816(acc[(2 * k + 1) % KS], prmt(vt0, vt1, s2), prmt(vt0, vt1, s2 >> 16), prmt(vt0, vt1, s3),
                             prmt(vt0, vt1, s3 >> 16), b0, b1);
                }
            }
#endif
#else
#if PMOVT
            const u32 b0 = pb[kk][0], b1 = pb[kk][1];
#else
#if VK == 3 || VK == 9 || V2SEG
            const u16* vn = (const u16*)(vp + T * V_ROW_BYTES);
            wA *= vscale(vn, tA); wB *= vscale(vn, tA + 1); wC *= vscale(vn, tA + 8); wD *= vscale(vn, tA + 9);
#endif
            const u32 b0 = pack_h2(wA, wB), b1 = pack_h2(wC, wD);
#endif
#ifdef V_TILE
            // The format builds the A operands (dim, token pair) itself (kivi).
            u32 va[KS][4];
            V_TILE(vp, tA, g, va);
#pragma unroll
            for (int mt = 0; mt < KS; mt++) mma16816(acc[mt], va[mt][0], va[mt][1], va[mt][2], va[mt][3], b0, b1);
#else
            u32 xa[VC / 2], xb[VC / 2], xc[VC / 2], xd[VC / 2];
            V_ROW(vp, tA, g, vtab, xa);
            V_ROW(vp, tA + 1, g, vtab, xb);
            V_ROW(vp, tA + 8, g, vtab, xc);
            V_ROW(vp, tA + 9, g, vtab, xd);
#pragma unroll
            for (int mt = 0; mt < KS; mt++) {
                mma16816(acc[mt], prmt(xa[mt], xb[mt], 0x5410), prmt(xa[mt], xb[mt], 0x7632),
                         prmt(xc[mt], xd[mt], 0x5410), prmt(xc[mt], xd[mt], 0x7632), b0, b1);
            }
#endif
#if V2SEG
            {
                // Stage 2: the weights (already times n₁) times n₂, the codes through v2tab.
                const u32 c0 = pack_h2(wA * h2f(vn[T + tA]), wB * h2f(vn[T + tA + 1]));
                const u32 c1 = pack_h2(wC * h2f(vn[T + tA + 8]), wD * h2f(vn[T + tA + 9]));
                V_SECOND(vp, tA, g, v2tab, xa);
                V_SECOND(vp, tA + 1, g, v2tab, xb);
                V_SECOND(vp, tA + 8, g, v2tab, xc);
                V_SECOND(vp, tA + 9, g, v2tab, xd);
#pragma unroll
                for (int mt = 0; mt < KS; mt++) {
                    mma16816(acc2[mt], prmt(xa[mt], xb[mt], 0x5410), prmt(xa[mt], xb[mt], 0x7632),
                             prmt(xc[mt], xd[mt], 0x5410), prmt(xc[mt], xd[mt], 0x7632), c0, c1);
                }
            }
#endif
#endif
        }
    }

#if STREAMK
    if (cur_row >= 0) sk_flush(gw + cur_row, m0, m1, l0, l1, acc, g, t, part_acc, part_ml);
#else
    // merge: warps of the block, then one partial per (sequence, KV head, split). Each lane's
    // 4·KS accumulators go to its own row of macc, XOR-swizzled by the lane, so the stores (one
    // value index, all lanes) and the loads (one lane, all its values) hit distinct banks.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(FULL_MASK, l0, off);
        l1 += __shfl_xor_sync(FULL_MASK, l1, off);
    }
    if (g == 0) {
        mml[warp][2 * t][0] = m0; mml[warp][2 * t][1] = l0;
        mml[warp][2 * t + 1][0] = m1; mml[warp][2 * t + 1][1] = l1;
    }
    __syncthreads();  // every warp's (m, l) is in; every warp is done with what macc overlays
    constexpr int NV = 4 * KS;  // accumulators per lane
    // Value i of lane l at slot i ^ (l mod NV); NV not a power of two (d = 96): (i + l) mod NV.
#define MSWZ(i, l) ((NV & (NV - 1)) == 0 ? ((i) ^ ((l) % NV)) : (((i) + (l)) % NV))
    float* const mrow = &macc[0][0][0] + (warp * 32 + lane) * NV;
#pragma unroll
    for (int mt = 0; mt < KS; mt++) {
#pragma unroll
        for (int c = 0; c < 4; c++) mrow[MSWZ(4 * mt + c, lane)] = acc[mt][c];
    }
    // Each warp's weight per head, 2^(m_w − M), and the merged (M, L).
    __shared__ float wsc[NWARPS][8];
    const size_t o0 = (size_t)part * G;
    if (tid < G) {
        float M = NEG_INF, L = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; w++) M = fmaxf(M, mml[w][tid][0]);
#pragma unroll
        for (int w = 0; w < NWARPS; w++) {
            const float mw = mml[w][tid][0];
            const float sc = mw == NEG_INF ? 0.0f : exp2f(mw - M);
            wsc[w][tid] = sc;
            L += mml[w][tid][1] * sc;
        }
        part_ml[(o0 + tid) * 2] = M;
        part_ml[(o0 + tid) * 2 + 1] = L;
    }
    __syncthreads();
    // The warps' accumulators in macc, weighted, into the partial's floats [at, at + D) per head.
    // Value i of lane ln: acc[i / 4][i % 4] = (dim vdim(ln / 4, i / 4, i % 4 / 2), head
    // 2·(ln % 4) + i % 2).
    auto merge_into = [&](int at) {
        for (int k = tid; k < 32 * NV; k += NWARPS * 32) {
            const int ln = k / NV, i = k % NV;
            const int hh = 2 * (ln & 3) + (i & 1);
            if (hh >= G) continue;
            const float* src = &macc[0][0][0] + ln * NV + MSWZ(i, ln);
            float A = 0.0f;
#pragma unroll
            for (int w = 0; w < NWARPS; w++) A += src[w * 32 * NV] * wsc[w][hh];
            part_acc[(o0 + hh) * VACC + at + vdim(ln >> 2, i >> 2, (i >> 1) & 1)] = A;
        }
    };
    merge_into(0);
#if V2SEG
    // The second domain's accumulators the same way, into floats [D, 2D).
    __syncthreads();  // every thread's reads of the first are done
#pragma unroll
    for (int mt = 0; mt < KS; mt++) {
#pragma unroll
        for (int c = 0; c < 4; c++) mrow[MSWZ(4 * mt + c, lane)] = acc2[mt][c];
    }
    __syncthreads();
    merge_into(D);
#endif
#endif
}
