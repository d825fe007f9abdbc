//! AVX2 + FMA + F16C kernel: each block is dequantized once into four registers of 8 f32
//! (the same values as the scalar reference) and multiplied into every row of x.
//!
//! Every function here requires AVX2, FMA and F16C (the caller detected them) and reads
//! through raw pointers inside the slices that [`rows`] checks up front.

use std::arch::x86_64::*;

use super::{PackedFormat, RowsParams, BLOCK, MAX_N};

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

const fn block_bytes(f: u8) -> usize {
    match f {
        Q4_0 => 18,
        Q4_1 => 20,
        _ => 34,
    }
}

/// i8 lanes 0–7 and 8–15 of `v`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_i8(v: __m128i) -> (__m256, __m256) {
    (_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))))
}

/// The 32 values of the block at `b`, in order, as four registers.
/// Safety: `b` points at `block_bytes(F)` readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant<const F: u8>(b: *const u8) -> [__m256; 4] {
    // d (and m for q4_1) are the first f16s of the block; one convert gives both.
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(if F == Q4_1 {
        b.cast::<i32>().read_unaligned()
    } else {
        b.cast::<u16>().read_unaligned() as i32
    }));
    let d = _mm256_broadcastss_ps(dm);
    if F == Q8_0 {
        let (q0, q1) = widen_i8(_mm_loadu_si128(b.add(2).cast()));
        let (q2, q3) = widen_i8(_mm_loadu_si128(b.add(18).cast()));
        return [_mm256_mul_ps(q0, d), _mm256_mul_ps(q1, d), _mm256_mul_ps(q2, d), _mm256_mul_ps(q3, d)];
    }
    let qs = _mm_loadu_si128(b.add(if F == Q4_1 { 4 } else { 2 }).cast());
    let mask = _mm_set1_epi8(0x0F);
    let (mut lo, mut hi) = (_mm_and_si128(qs, mask), _mm_and_si128(_mm_srli_epi16(qs, 4), mask));
    if F == Q4_0 {
        // q − 8 in the integer domain: then d · (q − 8) is one rounding, as in candle.
        let eight = _mm_set1_epi8(8);
        (lo, hi) = (_mm_sub_epi8(lo, eight), _mm_sub_epi8(hi, eight));
    }
    let ((q0, q1), (q2, q3)) = (widen_i8(lo), widen_i8(hi));
    if F == Q4_1 {
        // q · d + m with two roundings (no FMA), exactly candle's dequantized value.
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        return [
            _mm256_add_ps(_mm256_mul_ps(q0, d), m),
            _mm256_add_ps(_mm256_mul_ps(q1, d), m),
            _mm256_add_ps(_mm256_mul_ps(q2, d), m),
            _mm256_add_ps(_mm256_mul_ps(q3, d), m),
        ];
    }
    [_mm256_mul_ps(q0, d), _mm256_mul_ps(q1, d), _mm256_mul_ps(q2, d), _mm256_mul_ps(q3, d)]
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `out[r·N + j] = W_r · x_j` for `n_rows` rows at `w`, with A accumulators per row of x
/// (independent FMA chains: one row of x needs 4 to hide the FMA latency, 8 rows have 8).
/// Safety: `w` holds n_rows rows of n_blocks blocks, `x` N rows of n_blocks · 32 floats,
/// `out` n_rows · N floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_n<const F: u8, const N: usize, const A: usize>(
    w: *const u8,
    n_rows: usize,
    n_blocks: usize,
    x: *const f32,
    out: *mut f32,
) {
    let (bb, cols) = (block_bytes(F), n_blocks * BLOCK);
    for r in 0..n_rows {
        let row = w.add(r * n_blocks * bb);
        let mut acc = [[_mm256_setzero_ps(); A]; N];
        for bi in 0..n_blocks {
            let v = dequant::<F>(row.add(bi * bb));
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let xb = x.add(j * cols + bi * BLOCK);
                for (g, &vg) in v.iter().enumerate() {
                    acc_j[g % A] = _mm256_fmadd_ps(vg, _mm256_loadu_ps(xb.add(8 * g)), acc_j[g % A]);
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            let s = acc_j[1..].iter().fold(acc_j[0], |s, &a| _mm256_add_ps(s, a));
            *out.add(r * N + j) = hsum(s);
        }
    }
}

/// Checks the slice sizes the pointer kernel relies on, then runs the instance for
/// (format, n).
/// Safety: the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(p: RowsParams<'_>) {
    let (n, bb) = (p.n, p.format.block_bytes());
    let n_rows = p.out.len() / n.max(1);
    assert!((1..=MAX_N).contains(&n) && p.out.len() == n_rows * n);
    assert!(p.w.len() == n_rows * p.n_blocks * bb && p.x.len() >= n * p.n_blocks * BLOCK);
    let (w, x, out) = (p.w.as_ptr(), p.x.as_ptr(), p.out.as_mut_ptr());
    // SAFETY (every instance below): the asserts give the sizes `rows_n` reads and writes
    // (n_rows whole rows of W, n rows of x, n_rows · n outputs); the caller has the features.
    macro_rules! by_n {
        ($f:expr) => {
            match n {
                1 => rows_n::<$f, 1, 4>(w, n_rows, p.n_blocks, x, out),
                2 => rows_n::<$f, 2, 4>(w, n_rows, p.n_blocks, x, out),
                3 => rows_n::<$f, 3, 2>(w, n_rows, p.n_blocks, x, out),
                4 => rows_n::<$f, 4, 2>(w, n_rows, p.n_blocks, x, out),
                5 => rows_n::<$f, 5, 1>(w, n_rows, p.n_blocks, x, out),
                6 => rows_n::<$f, 6, 1>(w, n_rows, p.n_blocks, x, out),
                7 => rows_n::<$f, 7, 1>(w, n_rows, p.n_blocks, x, out),
                _ => rows_n::<$f, 8, 1>(w, n_rows, p.n_blocks, x, out),
            }
        };
    }
    match p.format {
        PackedFormat::Q4_0 => by_n!(Q4_0),
        PackedFormat::Q4_1 => by_n!(Q4_1),
        PackedFormat::Q8_0 => by_n!(Q8_0),
    }
}
