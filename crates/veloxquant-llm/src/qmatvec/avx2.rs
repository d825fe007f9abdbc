//! AVX2 + FMA + F16C kernels. One or two rows of x (decode): per block, d · (codes · x) +
//! m · Σx, Σx computed once per product. Three to eight rows (batched decode): each block
//! is dequantized once into four registers of 8 f32 (the scalar reference's values) and
//! multiplied into every row. The codes' order in registers is fixed by a broadcast load
//! and per-lane shifts; x is permuted once per product to match ([`prepare_x`]).
//!
//! Every function here requires AVX2, FMA and F16C (the caller detected them) and reads
//! through raw pointers inside the slices that [`rows`] checks up front.

use std::arch::x86_64::*;
use std::borrow::Cow;

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

/// x in the kernel's order: each 32-value block of a row of x permuted as the 4-bit decode
/// yields values (see [`codes`]), and per block Σx / 8 (the q4 formats' offset term, spread
/// over 8 lanes; dividing by 8 is exact). q8_0 keeps x as it is.
pub(super) fn prepare_x(format: PackedFormat, x: &[f32]) -> (Cow<'_, [f32]>, Vec<f32>) {
    if format == PackedFormat::Q8_0 {
        return (Cow::Borrowed(x), Vec::new());
    }
    let mut xp = vec![0f32; x.len()];
    for (dst, src) in xp.chunks_exact_mut(BLOCK).zip(x.chunks_exact(BLOCK)) {
        for (i, d) in dst.iter_mut().enumerate() {
            let (k, l) = (i / 8, i % 8);
            *d = src[4 * k + l / 2 + 16 * (l % 2)];
        }
    }
    let sums = x.chunks_exact(BLOCK).map(|b| b.iter().sum::<f32>() / 8.0).collect();
    (Cow::Owned(xp), sums)
}

/// The 32 codes of a block as f32 in four registers. q4: register k holds the 8 nibbles of
/// code bytes 4k..4k+4 (low then high nibble of each byte: values 4k, 4k+16, 4k+1, …),
/// split by one broadcast load and a per-lane shift (no shuffles); q8_0: values in order.
/// Safety: `qs` points at the block's 16 (q4) or 32 (q8_0) code bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes<const F: u8>(qs: *const u8) -> [__m256; 4] {
    if F == Q8_0 {
        return [i8x8(qs), i8x8(qs.add(8)), i8x8(qs.add(16)), i8x8(qs.add(24))];
    }
    [nibbles(qs), nibbles(qs.add(4)), nibbles(qs.add(8)), nibbles(qs.add(12))]
}

/// The 8 nibbles of the 4 bytes at `p` (lane l: byte l / 2, low nibble first) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256 {
    let word = _mm256_set1_epi32(p.cast::<i32>().read_unaligned());
    let shifted = _mm256_srlv_epi32(word, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(0x0F)))
}

/// The 8 signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The block's scale d and offset m (q4_0: −8d, so its values d·q − 8d = d·(q − 8); q8_0: 0),
/// broadcast. Safety: `b` points at the block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_offset<const F: u8>(b: *const u8) -> (__m256, __m256) {
    let bits = if F == Q4_1 { b.cast::<i32>().read_unaligned() } else { b.cast::<u16>().read_unaligned() as i32 };
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    let d = _mm256_broadcastss_ps(dm);
    let m = match F {
        Q4_1 => _mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
        Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
        _ => _mm256_setzero_ps(),
    };
    (d, m)
}

/// The block's 32 values, in `codes` order, rounded as candle rounds them: q4_0
/// fma(q, d, −8d) = one rounding of d·(q − 8); q4_1 q·d + m with two; q8_0 q·d.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values<const F: u8>(q: [__m256; 4], d: __m256, m: __m256) -> [__m256; 4] {
    let mut v = q;
    for x in &mut v {
        *x = match F {
            Q4_0 => _mm256_fmadd_ps(*x, d, m),
            Q4_1 => _mm256_add_ps(_mm256_mul_ps(*x, d), m),
            _ => _mm256_mul_ps(*x, d),
        };
    }
    v
}

/// The sum of a register's 8 lanes (no target features of its own: inlined into the
/// kernels that have them; the int8 kernels use it too).
#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Pointers and sizes of one task (checked by [`rows`]).
#[derive(Clone, Copy)]
struct Task {
    w: *const u8,
    n_rows: usize,
    n_blocks: usize,
    /// N rows of prepared x (`prepare_x`), and their per-block Σx / 8 (q4 formats).
    x: *const f32,
    x_sums: *const f32,
    out: *mut f32,
}

/// `out[r·N + j] = W_r · x_j`, for N ≤ 2 rows of x: per block, the codes' dot product
/// with x times d, plus m · Σx (one FMA each per block, not a dequantize per value).
/// Safety: `t` describes readable W and x rows and writable outputs.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_factored<const F: u8, const N: usize>(t: Task) {
    let (bb, cols) = (block_bytes(F), t.n_blocks * BLOCK);
    let qs_at = if F == Q4_1 { 4 } else { 2 };
    for r in 0..t.n_rows {
        let row = t.w.add(r * t.n_blocks * bb);
        // Separate d and m accumulators: each takes one FMA per block (short chains).
        let (mut acc_d, mut acc_m) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
        for bi in 0..t.n_blocks {
            let b = row.add(bi * bb);
            let q = codes::<F>(b.add(qs_at));
            let (d, m) = scale_offset::<F>(b);
            for j in 0..N {
                let xb = t.x.add(j * cols + bi * BLOCK);
                let mut dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                dot = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb.add(8)), dot);
                dot = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb.add(16)), dot);
                dot = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), dot);
                acc_d[j] = _mm256_fmadd_ps(d, dot, acc_d[j]);
                if F != Q8_0 {
                    let s = _mm256_broadcast_ss(&*t.x_sums.add(j * t.n_blocks + bi));
                    acc_m[j] = _mm256_fmadd_ps(m, s, acc_m[j]);
                }
            }
        }
        for j in 0..N {
            *t.out.add(r * N + j) = hsum(_mm256_add_ps(acc_d[j], acc_m[j]));
        }
    }
}

/// `out[r·N + j] = W_r · x_j`, for 3 ≤ N ≤ 8 rows of x: each block is dequantized once
/// into registers and multiplied into every row of x, with A accumulators per row (8 rows
/// give 8 independent FMA chains; fewer rows split theirs).
/// Safety: as [`rows_factored`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_dequant<const F: u8, const N: usize, const A: usize>(t: Task) {
    let (bb, cols) = (block_bytes(F), t.n_blocks * BLOCK);
    let qs_at = if F == Q4_1 { 4 } else { 2 };
    for r in 0..t.n_rows {
        let row = t.w.add(r * t.n_blocks * bb);
        let mut acc = [[_mm256_setzero_ps(); A]; N];
        for bi in 0..t.n_blocks {
            let b = row.add(bi * bb);
            let (d, m) = scale_offset::<F>(b);
            let v = values::<F>(codes::<F>(b.add(qs_at)), d, m);
            for (j, acc_j) in acc.iter_mut().enumerate() {
                let xb = t.x.add(j * cols + bi * BLOCK);
                for (g, &vg) in v.iter().enumerate() {
                    acc_j[g % A] = _mm256_fmadd_ps(vg, _mm256_loadu_ps(xb.add(8 * g)), acc_j[g % A]);
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            let s = acc_j[1..].iter().fold(acc_j[0], |s, &a| _mm256_add_ps(s, a));
            *t.out.add(r * N + j) = hsum(s);
        }
    }
}

/// Checks the slice sizes the pointer kernels rely on, then runs the instance for
/// (format, n). `p.x` and `p.x_sums` are as [`prepare_x`] returns them.
/// Safety: the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(p: RowsParams<'_>) {
    let (n, bb) = (p.n, p.format.block_bytes());
    let n_rows = p.out.len() / n.max(1);
    assert!((1..=MAX_N).contains(&n) && p.out.len() == n_rows * n);
    assert!(p.w.len() == n_rows * p.n_blocks * bb && p.x.len() >= n * p.n_blocks * BLOCK);
    assert!(p.format == PackedFormat::Q8_0 || p.x_sums.len() >= n * p.n_blocks);
    let t = Task {
        w: p.w.as_ptr(),
        n_rows,
        n_blocks: p.n_blocks,
        x: p.x.as_ptr(),
        x_sums: p.x_sums.as_ptr(),
        out: p.out.as_mut_ptr(),
    };
    // SAFETY (every instance below): the asserts give the sizes the kernels read and write
    // (n_rows whole rows of W, n rows of x and of sums, n_rows · n outputs); the caller
    // has the features.
    macro_rules! by_n {
        ($f:expr) => {
            match n {
                1 => rows_factored::<$f, 1>(t),
                2 => rows_factored::<$f, 2>(t),
                3 => rows_dequant::<$f, 3, 2>(t),
                4 => rows_dequant::<$f, 4, 2>(t),
                5 => rows_dequant::<$f, 5, 1>(t),
                6 => rows_dequant::<$f, 6, 1>(t),
                7 => rows_dequant::<$f, 7, 1>(t),
                _ => rows_dequant::<$f, 8, 1>(t),
            }
        };
    }
    match p.format {
        PackedFormat::Q4_0 => by_n!(Q4_0),
        PackedFormat::Q4_1 => by_n!(Q4_1),
        PackedFormat::Q8_0 => by_n!(Q8_0),
    }
}
