//! AVX2 + FMA + F16C kernels. Each decodes 8 values of a row into one register (f16
//! convert, i8/nibble widen × block scale, or b-bit index → centroid by permute) and feeds
//! every query head of the GQA group from that one decode.

use std::arch::x86_64::*;

use super::{scale_weights, CODES, F16, MAX_G, Q4, Q8};
use crate::format::rows::{RowKind, RowLayout, Q4_BLOCK_BYTES, Q8_BLOCK_BYTES};

struct Tabs {
    lo: __m256,
    hi: __m256,
    shifts: __m256i,
    mask: __m256i,
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tabs(l: &RowLayout) -> Tabs {
    let (bits, table) = match &l.kind {
        RowKind::Codes { bits, table } => (*bits as i32, *table),
        _ => (0, [0f32; 16]),
    };
    Tabs {
        lo: _mm256_loadu_ps(table.as_ptr()),
        hi: _mm256_loadu_ps(table.as_ptr().add(8)),
        shifts: _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits),
        mask: _mm256_set1_epi32((1 << bits) - 1),
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

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_k<const K: u8, const B: u32>(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    let tb = tabs(l);
    let nk = l.d / 8;
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        let qp = q.as_ptr().add(h0 * l.d);
        for t in 0..l.t {
            let row = page.as_ptr().add(t * l.row_bytes);
            let mut acc = [_mm256_setzero_ps(); MAX_G];
            for k in 0..nk {
                let v = load8::<K, B>(row, k, &tb);
                for (h, a) in acc.iter_mut().enumerate().take(g) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(h * l.d + 8 * k)), v, *a);
                }
            }
            let s = l.row_scale(page, t);
            for (h, a) in acc.iter().enumerate().take(g) {
                out[(h0 + h) * l.t + t] = hsum(*a) * s;
            }
        }
    }
}

/// Chunk-outer: each 8-wide slice of the G accumulators stays in registers across all T
/// tokens of the page; weights (× the token's scale) are broadcast from memory.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_k<const K: u8, const B: u32>(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    let tb = tabs(l);
    let nk = l.d / 8;
    let mut ws = vec![0f32; MAX_G * l.t];
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        scale_weights(l, page, &w[h0 * l.t..], g, &mut ws);
        let ap = acc.as_mut_ptr().add(h0 * l.d);
        for k in 0..nk {
            let mut a = [_mm256_setzero_ps(); MAX_G];
            for (h, x) in a.iter_mut().enumerate().take(g) {
                *x = _mm256_loadu_ps(ap.add(h * l.d + 8 * k));
            }
            for t in 0..l.t {
                let v = load8::<K, B>(page.as_ptr().add(t * l.row_bytes), k, &tb);
                for (h, x) in a.iter_mut().enumerate().take(g) {
                    *x = _mm256_fmadd_ps(_mm256_broadcast_ss(ws.get_unchecked(h * l.t + t)), v, *x);
                }
            }
            for (h, x) in a.iter().enumerate().take(g) {
                _mm256_storeu_ps(ap.add(h * l.d + 8 * k), *x);
            }
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
