//! AVX2 + FMA + F16C kernels. Each decodes 8 values of a row into one register (f16
//! convert, i8/nibble widen × block scale, or b-bit index → centroid by permute) and feeds
//! every query head of the GQA group from that one decode.

use std::arch::x86_64::*;

use super::{scale_weights, Scratch, CODES, F16, MAX_G, Q4, Q8, SPLIT};
use crate::format::rows::{RowKind, RowLayout, Q4_BLOCK_BYTES, Q8_BLOCK_BYTES};

pub(super) struct Tabs {
    lo: __m256,
    hi: __m256,
    shifts: __m256i,
    mask: __m256i,
}

/// Lookup state for b-bit codes into a 16-entry table.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tabs_of(bits: u32, table: &[f32; 16]) -> Tabs {
    let b = bits as i32;
    Tabs {
        lo: _mm256_loadu_ps(table.as_ptr()),
        hi: _mm256_loadu_ps(table.as_ptr().add(8)),
        shifts: _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b),
        mask: _mm256_set1_epi32((1 << b) - 1),
    }
}

/// The kind's code tables: (first segment, second segment of a split row).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tabs(l: &RowLayout) -> (Tabs, Tabs) {
    match &l.kind {
        RowKind::Codes { bits, table } => (tabs_of(*bits, table), tabs_of(*bits, table)),
        RowKind::Split { hi_bits, hi_table, lo_table, .. } => {
            (tabs_of(*hi_bits, hi_table), tabs_of(hi_bits - 1, lo_table))
        }
        _ => (tabs_of(0, &[0f32; 16]), tabs_of(0, &[0f32; 16])),
    }
}

/// 8-value chunks of a row per segment: [(byte offset, first chunk, chunks)]; one segment
/// for every kind but split rows.
fn segments(l: &RowLayout) -> [(usize, usize, usize); 2] {
    let nk = l.d / 8;
    match &l.kind {
        RowKind::Split { n_hi, .. } => [(0, 0, n_hi / 8), (l.kind.lo_offset(), n_hi / 8, nk - n_hi / 8)],
        _ => [(0, 0, nk), (0, nk, 0)],
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)))
}

/// Values 8k..8k+8 of the row starting at `row`, without the per-token scale.
/// Caller guarantees the row (plus 3 bytes of slack for CODES) is inside the page.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const K: u8, const B: u32>(row: *const u8, k: usize, t: &Tabs) -> __m256 {
    match K {
        F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * k).cast())),
        Q8 => {
            let blk = row.add((k / 4) * Q8_BLOCK_BYTES);
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * (k % 4)).cast()));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(f16_at(blk)))
        }
        Q4 => {
            let blk = row.add((k / 4) * Q4_BLOCK_BYTES);
            let j = k % 4;
            let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * (j % 2)).cast()));
            let n = if j < 2 { _mm256_and_si256(b, _mm256_set1_epi32(0xF)) } else { _mm256_srli_epi32(b, 4) };
            let q = _mm256_sub_epi32(n, _mm256_set1_epi32(8));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(f16_at(blk)))
        }
        _ => {
            let w = row.add(k * B as usize).cast::<u32>().read_unaligned();
            let idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), t.shifts), t.mask);
            let lo = _mm256_permutevar8x32_ps(t.lo, idx);
            if B <= 3 {
                lo
            } else {
                let hi = _mm256_permutevar8x32_ps(t.hi, idx);
                _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// acc[h] += Σ_k q_h[8·(c0 + k) ..] · chunk k of the segment at `row`, for `nk` chunks.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_segment<const K: u8, const B: u32>(
    row: *const u8,
    qp: *const f32,
    d: usize,
    (c0, nk): (usize, usize),
    g: usize,
    tb: &Tabs,
    acc: &mut [__m256; MAX_G],
) {
    for k in 0..nk {
        let v = load8::<K, B>(row, k, tb);
        for (h, a) in acc.iter_mut().enumerate().take(g) {
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * d + 8 * (c0 + k))), v, *a);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores_k<const K: u8, const B: u32, const BL: u32>(
    l: &RowLayout,
    q: &[f32],
    n_q: usize,
    page: &[u8],
    out: &mut [f32],
) {
    let (tb, tb2) = tabs(l);
    let [(_, c0, n0), (off1, c1, n1)] = segments(l);
    let mut scales = Scratch::<32>::new();
    let scales = scales.zeroed(l.t);
    l.row_scales(page, scales);
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        let qp = q.as_ptr().add(h0 * l.d);
        for t in 0..l.t {
            let row = page.as_ptr().add(t * l.row_bytes);
            let mut acc = [_mm256_setzero_ps(); MAX_G];
            if K == SPLIT {
                dot_segment::<CODES, B>(row, qp, l.d, (c0, n0), g, &tb, &mut acc);
                dot_segment::<CODES, BL>(row.add(off1), qp, l.d, (c1, n1), g, &tb2, &mut acc);
            } else {
                dot_segment::<K, B>(row, qp, l.d, (c0, n0), g, &tb, &mut acc);
            }
            let s = scales[t];
            for (h, a) in acc.iter().enumerate().take(g) {
                out[(h0 + h) * l.t + t] = hsum(*a) * s;
            }
        }
    }
}

/// Chunk-outer over one segment: each 8-wide slice of the G accumulators stays in registers
/// across all T tokens of the page; weights (× the token's scale) are broadcast from memory.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy_segment<const K: u8, const B: u32>(
    l: &RowLayout,
    page: &[u8],
    (off, c0, nk): (usize, usize, usize),
    (g, ws): (usize, &[f32]),
    tb: &Tabs,
    ap: *mut f32,
) {
    for k in 0..nk {
        let c = c0 + k;
        let mut a = [_mm256_setzero_ps(); MAX_G];
        for (h, x) in a.iter_mut().enumerate().take(g) {
            *x = _mm256_loadu_ps(ap.add(h * l.d + 8 * c));
        }
        for t in 0..l.t {
            let v = load8::<K, B>(page.as_ptr().add(t * l.row_bytes + off), k, tb);
            for (h, x) in a.iter_mut().enumerate().take(g) {
                *x = _mm256_fmadd_ps(_mm256_broadcast_ss(ws.get_unchecked(h * l.t + t)), v, *x);
            }
        }
        for (h, x) in a.iter().enumerate().take(g) {
            _mm256_storeu_ps(ap.add(h * l.d + 8 * c), *x);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate_k<const K: u8, const B: u32, const BL: u32>(
    l: &RowLayout,
    w: &[f32],
    n_q: usize,
    page: &[u8],
    acc: &mut [f32],
) {
    let (tb, tb2) = tabs(l);
    let [s0, s1] = segments(l);
    let mut ws = Scratch::<{ MAX_G * 32 }>::new();
    let ws = ws.zeroed(n_q.min(MAX_G) * l.t);
    let mut scales = Scratch::<32>::new();
    let scales = scales.zeroed(l.t);
    l.row_scales(page, scales);
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        scale_weights(l, scales, &w[h0 * l.t..], g, ws);
        let ap = acc.as_mut_ptr().add(h0 * l.d);
        if K == SPLIT {
            axpy_segment::<CODES, B>(l, page, s0, (g, ws), &tb, ap);
            axpy_segment::<CODES, BL>(l, page, s1, (g, ws), &tb2, ap);
        } else {
            axpy_segment::<K, B>(l, page, s0, (g, ws), &tb, ap);
        }
    }
}

/// SAFETY (caller): AVX2, FMA and F16C are available; `page` holds `l.page_bytes()` bytes
/// (so every row read, and the ≤ 3 bytes a packed-code load reads past a row, stay inside
/// it: codes pages end with ≥ 4 bytes of scales); q/out/acc hold n_q·d / n_q·T floats.
pub unsafe fn scores(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    dispatch_row_kind!(l, scores_k, q, n_q, page, out)
}

/// SAFETY (caller): as for [`scores`].
pub unsafe fn accumulate(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    dispatch_row_kind!(l, accumulate_k, w, n_q, page, acc)
}
