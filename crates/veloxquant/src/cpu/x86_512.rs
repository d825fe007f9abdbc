//! AVX-512 (F + VBMI) kernels: 16 values per step. The 16-entry centroid table of a ≤ 4-bit
//! code is one `vpermps` lookup, so a TurboQuant code chunk decodes in 3 µops (qword
//! broadcast load, multishift, permute) — the AVX2 path needs two permutes and a blend
//! for 8 values. Same semantics and layouts as `x86.rs`; selected when the CPU has AVX-512F.

use std::arch::x86_64::*;

use super::{scale_weights, CODES, F16, MAX_G, Q4, Q8, SPLIT};
use crate::format::rows::{RowKind, RowLayout, Q4_BLOCK_BYTES, Q8_BLOCK_BYTES};

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

/// Two tokens per step (each q chunk loaded once feeds both); per-token accumulators are
/// folded to 8 lanes and parked, then reduced 8 tokens at a time by a transpose-add.
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
    let nk = l.d / 16;
    let mut park = vec![0f32; MAX_G * l.t * 8];
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        let qp = q.as_ptr().add(h0 * l.d);
        let pp = park.as_mut_ptr();
        let mut t = 0;
        while t < l.t {
            let pair = t + 1 < l.t;
            let r0 = page.as_ptr().add(t * l.row_bytes);
            let r1 = if pair { r0.add(l.row_bytes) } else { r0 };
            let mut a0 = [_mm512_setzero_ps(); MAX_G];
            let mut a1 = [_mm512_setzero_ps(); MAX_G];
            for k in 0..nk {
                let v0 = load16::<K, B>(r0, k, &tb);
                let v1 = load16::<K, B>(r1, k, &tb);
                for h in 0..g {
                    let qv = _mm512_loadu_ps(qp.add(h * l.d + 16 * k));
                    a0[h] = _mm512_fmadd_ps(qv, v0, a0[h]);
                    a1[h] = _mm512_fmadd_ps(qv, v1, a1[h]);
                }
            }
            for h in 0..g {
                _mm256_storeu_ps(pp.add((h * l.t + t) * 8), fold8(a0[h]));
                if pair {
                    _mm256_storeu_ps(pp.add((h * l.t + t + 1) * 8), fold8(a1[h]));
                }
            }
            t += 2;
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
            for (t, ot) in o.iter_mut().enumerate() {
                *ot *= l.row_scale(page, t);
            }
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
    let nk = l.d / 16;
    let mut ws = vec![0f32; MAX_G * l.t];
    for h0 in (0..n_q).step_by(MAX_G) {
        let g = MAX_G.min(n_q - h0);
        scale_weights(l, page, &w[h0 * l.t..], g, &mut ws);
        let ap = acc.as_mut_ptr().add(h0 * l.d);
        for k in 0..nk {
            let mut a = [_mm512_setzero_ps(); MAX_G];
            for (h, x) in a.iter_mut().enumerate().take(g) {
                *x = _mm512_loadu_ps(ap.add(h * l.d + 16 * k));
            }
            for t in 0..l.t {
                let v = load16::<K, B>(page.as_ptr().add(t * l.row_bytes), k, &tb);
                for (h, x) in a.iter_mut().enumerate().take(g) {
                    *x = _mm512_fmadd_ps(_mm512_set1_ps(*ws.get_unchecked(h * l.t + t)), v, *x);
                }
            }
            for (h, x) in a.iter().enumerate().take(g) {
                _mm512_storeu_ps(ap.add(h * l.d + 16 * k), *x);
            }
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
