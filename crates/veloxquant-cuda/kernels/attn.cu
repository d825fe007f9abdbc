// Per-step helpers around decode_pages. Grid: (n_q_heads, batch); block: D threads.
// prep_query: q · log2(e)/√d, rotated once by the key rotation (the rotated-query trick), then
// as the key format needs (formats/: qjl's sketch, turboquant_prod's and turboquant_rvq's
// second query, rabitq's 4-bit query; selected by KSKETCH, KPROD, KRVQ, KRABITQ).
// combine: merge the split partials (16 per L2 round trip, no block barrier), one
// inverse value rotation on the merged accumulator,
// then the exact fp16 sinks and window, then normalize. Defines: D, G, KROT, KSKETCH, KPROD, KRVQ,
// KRABITQ, KFRAC, KCENTER, KVQ/KVQB, VROT, VRVQ, VFRAC, VCENTER, VVQ/VVQB, PDL (combine launched
// as a programmatic dependent of decode_pages: it scores the tail while decode_pages runs).
#define NEG_INF (-__int_as_float(0x7f800000))

// Each format's query preparation (FMT_QUERY): KTW, the floats per KV head of its key transform
// (default D, rotation signs); query_pre_fmt (QUERY_PRE_FMT), a step before the rotation;
// query_fmt (QUERY_FMT), which stores the query prepared after the scale and the rotation, or
// prep_query_fmt (PREP_QUERY_FMT), a preparation of its own; and the value format's
// value_post_fmt (VALUE_POST_FMT), combine's step on the merged accumulator (for the rotation;
// VACC2: two accumulators per head, turboquant_rvq's two domains, merged alike).
// @formats FMT_QUERY
#ifndef KTW
#define KTW (D + KDENSE_W)
#endif
#ifndef QUERY_FMT
#define QUERY_FMT 0
#endif
#ifndef PREP_QUERY_FMT
#define PREP_QUERY_FMT 0
#endif
#ifndef QUERY_PRE_FMT
#define QUERY_PRE_FMT 0
#endif
#ifndef VALUE_POST_FMT
#define VALUE_POST_FMT 0
#endif
#ifndef VACC2
#define VACC2 0
#endif
#define VW (VACC2 ? 2 * D : D)  // floats per head of a partial's accumulator

#if (KSKETCH || KPROD) && D <= 128
// The sketched query's D loads per thread all in flight at once (sketch_query_block): ptxas
// keeps them in registers when told the block is D threads, one per SM at least.
#define PREP_BOUNDS __launch_bounds__(D, 1)
#else
#define PREP_BOUNDS
#endif
extern "C" __global__ void PREP_BOUNDS prep_query(const float* __restrict__ q, float* __restrict__ qprep,
                                      const float* __restrict__ ksigns, float krot_scale) {
    __shared__ float s[D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const size_t at = ((size_t)b * n_q + hq) * D + tid;
    const float* const kt = ksigns + (size_t)(hq / G) * KTW;  // the KV head's key transform
#if PDL
    // decode_pages (launched as a programmatic dependent) may start its set-up now; it waits
    // for this grid's completion before reading qprep.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if PREP_QUERY_FMT
    prep_query_fmt(q[at], qprep + at, kt, krot_scale, s, tid);
    return;
#endif
    float x = q[at] * (LOG2E / sqrtf((float)D));
#if QUERY_PRE_FMT
    x = query_pre_fmt(x, kt, tid);
#endif
#if KROT
    x *= kt[tid];
    x = rot_block<KDENSE_W, false>(x, s, tid, kt + (KTW - KDENSE_W)) * krot_scale;
#endif
#if QUERY_FMT
    query_fmt(x, qprep, at, (size_t)gridDim.x * gridDim.y * D, kt, krot_scale, s, tid);
#else
    qprep[at] = x;
#endif
}

extern "C" __global__ void combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                   const int* __restrict__ part_rows, int n_splits, int n_kv, const float* __restrict__ q,
                                   const u16* __restrict__ kx, const u16* __restrict__ vx,
                                   const int* __restrict__ slot_of, const int* __restrict__ seq_len,
                                   const int* __restrict__ n_coded, int n_sink, int ring_cap,
                                   const float* __restrict__ vsigns, float vrot_scale,
                                   const float* __restrict__ ksigns, float* __restrict__ out,
                                   u16* __restrict__ out16) {
    extern __shared__ float ts[];  // scores of the exact tokens (n_sink + ring_cap)
    __shared__ float s[D];
    __shared__ float qs[D];
    const int hq = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, n_q = gridDim.x;
    const int hkv = hq / G, gi = hq % G;
    const int warp = tid >> 5, lane = tid & 31;
    const int row = b * n_kv + hkv;

    // The exact tokens of slot_of[b] (cache.rs): the sinks [0, min(S, n)) at slots 0.., the
    // window [S + coded, n) in the ring at slot S + (j − S) mod ring_cap. Their scores first:
    // they need only q and the exact rows, not decode_pages' partials.
    const int slot = slot_of[b];
    const int n = slot < 0 ? 0 : seq_len[slot];
    const int ns = min(n, n_sink);
    const int w0 = slot < 0 ? 0 : n_sink + n_coded[slot];
    const int nw = max(n - w0, 0);
    const int nt = ns + nw;
    const int xs = n_sink + ring_cap;
    const size_t xrow = (size_t)((slot < 0 ? 0 : slot) * n_kv + hkv) * xs;
    const u16* const kt = kx + xrow * D;
    const u16* const vt = vx + xrow * D;
    // Token i's row: a sink, or the window's (i − ns)-th at ring slot S + (coded + i − ns) mod C
    // (i − ns < nw ≤ C: one conditional subtraction, no division per token).
    const int r0 = (slot < 0 || ring_cap <= 0) ? 0 : n_coded[slot] % ring_cap;
    auto exact_slot = [&](int i) {
        int j = r0 + (i - ns);
        j -= j >= ring_cap ? ring_cap : 0;
        return i < ns ? i : n_sink + j;
    };
    // The exact tokens' share (max mt, weight sum lx, value ax of this thread's dim), all of it
    // before the wait: with PDL it overlaps decode_pages' last blocks. One thread per token
    // scores a whole key row (D/8 independent 16-byte loads), so a step costs one round trip
    // per D tokens, not one per token.
    float mt = NEG_INF, lx = 0.0f, ax = 0.0f;
    if (nt > 0) {
        qs[tid] = q[((size_t)b * n_q + hq) * D + tid] * (LOG2E / sqrtf((float)D));
        __syncthreads();
        for (int i = tid; i < nt; i += D) {
            const int sl = exact_slot(i);
            // 16-byte aligned: rows of D halves (D % 8 == 0) from an aligned allocation.
            const vec4u* kr = reinterpret_cast<const vec4u*>(kt + (size_t)sl * D);
            vec4u w[D / 8];
#pragma unroll
            for (int c = 0; c < D / 8; c++) w[c] = kr[c];
            float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
            for (int c = 0; c < D / 8; c++) {
                const u32 h[4] = {w[c].x, w[c].y, w[c].z, w[c].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    a0 += qs[8 * c + 2 * j] * h2f((u16)(h[j] & 0xffff));
                    a1 += qs[8 * c + 2 * j + 1] * h2f((u16)(h[j] >> 16));
                }
            }
            ts[i] = a0 + a1;
        }
        __syncthreads();  // every score in ts
#pragma unroll 8
        for (int i = 0; i < nt; i++) mt = fmaxf(mt, ts[i]);
        // This thread's dim of XC value rows per round trip, every load issued before the first
        // use: under decode_pages' full-bandwidth traffic a load waits microseconds, so a
        // 132-token window read 8 rows at a time cost tens of µs (the ragged case's floor).
        constexpr int XC = 64;
        for (int i0 = 0; i0 < nt; i0 += XC) {
            u16 v[XC];
#pragma unroll
            for (int j = 0; j < XC; j++) v[j] = i0 + j < nt ? vt[(size_t)exact_slot(i0 + j) * D + tid] : (u16)0;
#pragma unroll
            for (int j = 0; j < XC; j++) {
                if (i0 + j < nt) {
                    const float w = exp2f(ts[i0 + j] - mt);
                    lx += w;
                    ax += w * h2f(v[j]);
                }
            }
        }
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    // The partials in chunks of CH splits, each chunk's loads issued at once (this thread's
    // accumulator element and the splits' (m, l), one address across the block): one L2 round
    // trip per chunk and no block barrier; chunks merged online (rescaled to the running max).
    // The row's partials: its n_splits splits, or (stream grid, part_rows non-null) the
    // (first, count) decode_pages wrote.
    const int n_parts = part_rows ? part_rows[2 * row + 1] : n_splits;
    const size_t base = (size_t)(part_rows ? part_rows[2 * row] : row * n_splits) * G + gi;
    const int CH = 16;
    float M = NEG_INF, L = 0.0f, A = 0.0f;
#if VACC2
    float A2 = 0.0f;
#endif
    for (int c0 = 0; c0 < n_parts; c0 += CH) {
        float a[CH], m[CH], l[CH];
#if VACC2
        float a2[CH];
#endif
#pragma unroll
        for (int i = 0; i < CH; i++) {
            const bool on = c0 + i < n_parts;
            const size_t o = base + (size_t)(c0 + i) * G;
            a[i] = on ? part_acc[o * VW + tid] : 0.0f;
#if VACC2
            a2[i] = on ? part_acc[o * VW + D + tid] : 0.0f;
#endif
            m[i] = on ? part_ml[o * 2] : NEG_INF;
            l[i] = on ? part_ml[o * 2 + 1] : 0.0f;
        }
        float mc = M;
#pragma unroll
        for (int i = 0; i < CH; i++) mc = fmaxf(mc, m[i]);
        if (mc == NEG_INF) continue;  // only empty splits so far
        const float sc = M == NEG_INF ? 0.0f : exp2f(M - mc);
        L *= sc;
        A *= sc;
#if VACC2
        A2 *= sc;
#endif
#pragma unroll
        for (int i = 0; i < CH; i++) {
            if (m[i] != NEG_INF) {
                const float w = exp2f(m[i] - mc);
                L += l[i] * w;
                A += a[i] * w;
#if VACC2
                A2 += a2[i] * w;
#endif
            }
        }
        M = mc;
    }
#if KCENTER
    // turboquant_frac keys with a mean μ: every coded score lacks ⟨q, μ⟩ (one constant per
    // head, turboquant_frac.rs scores), so the codes' max moves by it (in log2 units).
    {
        __shared__ float red[D / 32];
        float p = q[((size_t)b * n_q + hq) * D + tid] * ksigns[(size_t)hkv * KTW + D + tid];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) p += __shfl_xor_sync(FULL_MASK, p, off);
        if (lane == 0) red[warp] = p;
        __syncthreads();
        float aux = 0.0f;
#pragma unroll
        for (int w = 0; w < D / 32; w++) aux += red[w];
        if (M != NEG_INF) M += aux * (LOG2E / sqrtf((float)D));
    }
#endif
#if VALUE_POST_FMT && VACC2
    A = value_post_fmt(A, A2, vsigns, vrot_scale, s, hkv, tid);
#elif VALUE_POST_FMT
    A = value_post_fmt(A, vsigns, vrot_scale, s, hkv, tid);
#elif VFRAC
    // turboquant_frac values: the accumulator is in storage order and unit scale — times the
    // base, each channel from its slot, the inverse rotation, then μ by the codes' weight.
    {
        const float* vt = vsigns + (size_t)hkv * (3 * D + 4);
        s[tid] = A * vt[3 * D];
        __syncthreads();
        A = s[(int)vt[2 * D + tid]];
        __syncthreads();
        A = fwht_block(A, s, tid) * (vt[tid] * vrot_scale);
#if VCENTER
        A += L * vt[D + tid];
#endif
    }
#elif VROT
    A = rot_block<VDENSE_W, true>(A, s, tid, vsigns + hkv * (D + VDENSE_W) + D) *
        (vsigns[hkv * (D + VDENSE_W) + tid] * vrot_scale);
#endif
    // The codes' share and the exact tokens', each rescaled to the larger max.
    const float m2 = fmaxf(M, mt);
    if (m2 != NEG_INF) {
        const float sc = M == NEG_INF ? 0.0f : exp2f(M - m2);
        const float sx = mt == NEG_INF ? 0.0f : exp2f(mt - m2);
        L = L * sc + lx * sx;
        A = A * sc + ax * sx;
    }
    const float r = L > 0.0f ? A / L : 0.0f;
    const size_t at = ((size_t)b * n_q + hq) * D + tid;
    if (out16) out16[at] = f2h(r);
    else out[at] = r;
}
