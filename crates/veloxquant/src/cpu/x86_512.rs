//! AVX-512 (F + VBMI) kernels: 16 values per step. The 16-entry centroid table of a ≤ 4-bit
//! code is one `vpermps` lookup, so a TurboQuant code chunk decodes in 3 µops (qword
//! broadcast load, multishift, permute) — the AVX2 path needs two permutes and a blend
//! for 8 values. Same semantics and layouts as `x86.rs`; selected when the CPU has AVX-512F.

use std::arch::x86_64::*;

use super::{scale_weights, Scratch, CODES, F16, MAX_G, Q4, Q8, SPLIT};
use crate::format::rows::{RowKind, RowLayout, RowScale, Q4_BLOCK_BYTES, Q8_BLOCK_BYTES};

struct Tabs {
    table: __m512,
    /// multishift control: byte 4i of the result takes the 8 bits at offset B·i.
    ctrl: __m512i,
}

#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
unsafe fn tabs(l: &RowLayout) -> Tabs {
    let (b, table) = match &l.kind {
        RowKind::Codes { bits, table } => (*bits as usize, *table),
        _ => (0, [0f32; 16]),
    };
    let mut ctrl = [0u8; 64];
    for i in 0..16 {
        ctrl[4 * i] = (b * i) as u8;
    }
    Tabs { table: _mm512_loadu_ps(table.as_ptr()), ctrl: _mm512_loadu_si512(ctrl.as_ptr().cast()) }
}

#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)))
}

/// The page's per-token scales into `out[..T]`: f16 norms 16 at a time by `vcvtph2ps`
/// (`RowLayout::row_scales` converts one at a time through a run-time dispatch).
#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
unsafe fn page_scales(l: &RowLayout, page: &[u8], out: &mut [f32]) {
    match (l.scales_at, l.scale) {
        (Some(o), RowScale::F16) if l.t.is_multiple_of(16) && out.len() >= l.t && page.len() >= o + 2 * l.t => {
            for i in (0..l.t).step_by(16) {
                // SAFETY: bytes o + 2i .. o + 2i + 32 lie within the page (checked above) and
                // out[i..i + 16] within out.
                let h = _mm256_loadu_si256(page.as_ptr().add(o + 2 * i).cast());
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        _ => l.row_scales(page, out),
    }
}

/// Values 16k..16k+16 of the row at `row`, without the per-token scale.
#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn load16<const K: u8, const B: u32>(row: *const u8, k: usize, t: &Tabs) -> __m512 {
    match K {
        F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(32 * k).cast())),
        Q8 => {
            let blk = row.add((k / 2) * Q8_BLOCK_BYTES);
            let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(2 + 16 * (k % 2)).cast()));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(f16_at(blk)))
        }
        Q4 => {
            let blk = row.add((k / 2) * Q4_BLOCK_BYTES);
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(2).cast()));
            let n =
                if k.is_multiple_of(2) { _mm512_and_si512(b, _mm512_set1_epi32(0xF)) } else { _mm512_srli_epi32(b, 4) };
            let q = _mm512_sub_epi32(n, _mm512_set1_epi32(8));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(f16_at(blk)))
        }
        _ => {
            // Codes 16k..16k+16 are the 16·B bits at byte 2kB: broadcast that qword, let
            // multishift move code i to the low byte of dword i, and look up. vpermps reads
            // only an index's low 4 bits and the table repeats every 2^B entries, so the
            // neighbouring codes left in the upper bits need no mask.
            let w = _mm512_set1_epi64(row.add(2 * k * B as usize).cast::<i64>().read_unaligned());
            _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(t.ctrl, w), t.table)
        }
    }
}

/// TOK tokens per step (each q chunk loaded once feeds them all); per-token accumulators are
/// folded to 8 lanes and parked, then reduced 8 tokens at a time by a transpose-add. The
/// head count G is a constant so the TOK·G accumulators stay in registers (a run-time count
/// left them in memory: a load and a store per FMA).
#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn scores_g<const K: u8, const B: u32, const G: usize, const TOK: usize>(
    l: &RowLayout,
    qp: *const f32,
    page: &[u8],
    pp: *mut f32,
    tb: &Tabs,
) {
    let nk = l.d / 16;
    let mut t = 0;
    while t < l.t {
        let nt = (l.t - t).min(TOK);
        // Past the page's end the last row repeats (its results are not parked).
        let rows: [*const u8; TOK] = std::array::from_fn(|i| page.as_ptr().add((t + i.min(nt - 1)) * l.row_bytes));
        let mut a = [[_mm512_setzero_ps(); G]; TOK];
        for k in 0..nk {
            let v: [__m512; TOK] = std::array::from_fn(|i| load16::<K, B>(rows[i], k, tb));
            for h in 0..G {
                let qv = _mm512_loadu_ps(qp.add(h * l.d + 16 * k));
                for (ai, vi) in a.iter_mut().zip(&v) {
                    ai[h] = _mm512_fmadd_ps(qv, *vi, ai[h]);
                }
            }
        }
        for h in 0..G {
            for (i, ai) in a.iter().enumerate().take(nt) {
                _mm256_storeu_ps(pp.add((h * l.t + t + i) * 8), fold8(ai[h]));
            }
        }
        t += TOK;
    }
}

#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
unsafe fn scores_k<const K: u8, const B: u32, const BL: u32>(
    l: &RowLayout,
    q: &[f32],
    n_q: usize,
    page: &[u8],
    out: &mut [f32],
) {
    if K == SPLIT {
        // Split rows' segments are multiples of 8 values, not 16: the AVX2 kernel serves.
        return super::x86::scores_k::<K, B, BL>(l, q, n_q, page, out);
    }
    let tb = tabs(l);
    let mut park = Scratch::<{ MAX_G * 32 * 8 }>::new();
    let park = park.zeroed(n_q.min(MAX_G) * l.t * 8);
    let mut scales = Scratch::<32>::new();
    let scales = scales.zeroed(l.t);
    page_scales(l, page, scales);
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        let qp = q.as_ptr().add(h0 * l.d);
        let pp = park.as_mut_ptr();
        // Four tokens per step up to 4 heads (16 accumulators), two beyond.
        match g {
            1 => scores_g::<K, B, 1, 4>(l, qp, page, pp, &tb),
            2 => scores_g::<K, B, 2, 4>(l, qp, page, pp, &tb),
            3 => scores_g::<K, B, 3, 4>(l, qp, page, pp, &tb),
            4 => scores_g::<K, B, 4, 4>(l, qp, page, pp, &tb),
            5 => scores_g::<K, B, 5, 2>(l, qp, page, pp, &tb),
            6 => scores_g::<K, B, 6, 2>(l, qp, page, pp, &tb),
            7 => scores_g::<K, B, 7, 2>(l, qp, page, pp, &tb),
            _ => scores_g::<K, B, 8, 2>(l, qp, page, pp, &tb),
        }
        for h in 0..g {
            let o = &mut out[(h0 + h) * l.t..(h0 + h + 1) * l.t];
            let mut t = 0;
            while t + 8 <= l.t {
                let p = pp.add((h * l.t + t) * 8);
                _mm256_storeu_ps(o.as_mut_ptr().add(t), transpose_sum8(p));
                t += 8;
            }
            for (t, ot) in o.iter_mut().enumerate().skip(t) {
                *ot = park[(h * l.t + t) * 8..(h * l.t + t + 1) * 8].iter().sum();
            }
            o.iter_mut().zip(scales.iter()).for_each(|(ot, &s)| *ot *= s);
        }
    }
}

#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn fold8(v: __m512) -> __m256 {
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
}

/// Eight parked 8-lane vectors (rows of 8 floats at p) → their eight horizontal sums.
#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn transpose_sum8(p: *const f32) -> __m256 {
    let r = |i: usize| _mm256_loadu_ps(p.add(8 * i));
    let t0 = _mm256_hadd_ps(r(0), r(1));
    let t1 = _mm256_hadd_ps(r(2), r(3));
    let t2 = _mm256_hadd_ps(r(4), r(5));
    let t3 = _mm256_hadd_ps(r(6), r(7));
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31))
}

/// Chunk-outer: each 16-wide slice of the G accumulators (G constant: in registers) stays
/// across all T tokens of the page; weights (× the token's scale) are broadcast from memory.
#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn accumulate_g<const K: u8, const B: u32, const G: usize>(
    l: &RowLayout,
    ws: &[f32],
    page: &[u8],
    ap: *mut f32,
    tb: &Tabs,
) {
    for k in 0..l.d / 16 {
        let mut a: [__m512; G] = std::array::from_fn(|h| _mm512_loadu_ps(ap.add(h * l.d + 16 * k)));
        for t in 0..l.t {
            let v = load16::<K, B>(page.as_ptr().add(t * l.row_bytes), k, tb);
            for (h, x) in a.iter_mut().enumerate() {
                *x = _mm512_fmadd_ps(_mm512_set1_ps(*ws.get_unchecked(h * l.t + t)), v, *x);
            }
        }
        for (h, x) in a.iter().enumerate() {
            _mm512_storeu_ps(ap.add(h * l.d + 16 * k), *x);
        }
    }
}

#[target_feature(enable = "avx512f,avx512vbmi,avx2,fma,f16c")]
unsafe fn accumulate_k<const K: u8, const B: u32, const BL: u32>(
    l: &RowLayout,
    w: &[f32],
    n_q: usize,
    page: &[u8],
    acc: &mut [f32],
) {
    if K == SPLIT {
        return super::x86::accumulate_k::<K, B, BL>(l, w, n_q, page, acc);
    }
    let tb = tabs(l);
    let mut ws = Scratch::<{ MAX_G * 32 }>::new();
    let ws = ws.zeroed(n_q.min(MAX_G) * l.t);
    let mut scales = Scratch::<32>::new();
    let scales = scales.zeroed(l.t);
    page_scales(l, page, scales);
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        scale_weights(l, scales, &w[h0 * l.t..], g, ws);
        let ap = acc.as_mut_ptr().add(h0 * l.d);
        match g {
            1 => accumulate_g::<K, B, 1>(l, ws, page, ap, &tb),
            2 => accumulate_g::<K, B, 2>(l, ws, page, ap, &tb),
            3 => accumulate_g::<K, B, 3>(l, ws, page, ap, &tb),
            4 => accumulate_g::<K, B, 4>(l, ws, page, ap, &tb),
            5 => accumulate_g::<K, B, 5>(l, ws, page, ap, &tb),
            6 => accumulate_g::<K, B, 6>(l, ws, page, ap, &tb),
            7 => accumulate_g::<K, B, 7>(l, ws, page, ap, &tb),
            _ => accumulate_g::<K, B, 8>(l, ws, page, ap, &tb),
        }
    }
}

/// SAFETY (caller): AVX-512F/VBMI, AVX2, FMA and F16C are available; d % 16 == 0; `page`
/// holds `l.page_bytes()` bytes (a code load reads ≤ 7 bytes past a row, inside the page's
/// ≥ 8-byte scale area); q/out/acc hold n_q·d / n_q·T floats.
pub unsafe fn scores(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    dispatch_row_kind!(l, scores_k, q, n_q, page, out)
}

/// SAFETY (caller): as for [`scores`].
pub unsafe fn accumulate(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    dispatch_row_kind!(l, accumulate_k, w, n_q, page, acc)
}

/// [`super::exp_sum`] 16 lanes at a time: exp_approx's range reduction and polynomial (with
/// fused multiply-adds), the tail masked. SAFETY (caller): AVX-512F; `w.len() ≥ s.len()`.
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn exp_sum(s: &[f32], m: f32, w: &mut [f32]) -> f32 {
    let n = s.len();
    let (mv, lo) = (_mm512_set1_ps(m), _mm512_set1_ps(-87.0));
    let (log2e, round) = (_mm512_set1_ps(std::f32::consts::LOG2_E), _mm512_set1_ps(12_582_912.0));
    let (ln2_hi, ln2_lo) = (_mm512_set1_ps(0.693_145_75), _mm512_set1_ps(1.428_606_8e-6));
    let c = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0].map(|v: f32| _mm512_set1_ps(v));
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let k16 = (n - i).min(16);
        let mask: __mmask16 = if k16 == 16 { 0xFFFF } else { (1u16 << k16) - 1 };
        // SAFETY: lanes < k16 lie within s and w (masked loads and stores touch no others).
        let x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s.as_ptr().add(i)), mv), lo);
        let k = _mm512_sub_ps(_mm512_fmadd_ps(x, log2e, round), round);
        let r = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, x));
        let mut p = c[0];
        for &ci in &c[1..] {
            p = _mm512_fmadd_ps(p, r, ci);
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)));
        let v = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
        _mm512_mask_storeu_ps(w.as_mut_ptr().add(i), mask, v);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, v));
        i += 16;
    }
    _mm512_reduce_add_ps(sum)
}
