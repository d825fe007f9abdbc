//! The AVX-512 VNNI kernel over the [`Interleaved`] layout: one tile of 16 weight rows at
//! a time, against the rows of x in passes of [`PASS`] (their f32 accumulators, one
//! register per row of x holding its 16 row sums, stay in registers with the block's 8
//! code registers). Per block and row of x: the i32 start (the format's offset, or 0),
//! 8 `vpdpbusd` with 4 bytes of x broadcast, then `acc += f32(dot) · (d ⊙ dx)` and for
//! q4_1 `acc += m ⊙ (dx·Σqx)`. Each row of x takes the same instructions in the same
//! order whatever the pass holds, so a row's result is the same bits at every batch size.

use std::arch::x86_64::*;
use std::ops::Range;

use super::int8::{QuantX, ROUND_SHIFT};
use super::interleaved::{lines_per_block, Interleaved, Line, TILE};
use super::{PackedFormat, BLOCK, MAX_N_Q8};

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Rows of x per pass over a tile: 8 accumulators + 8 code registers + scales and
/// temporaries fit the 32 zmm registers.
const PASS: usize = 8;

/// How far ahead (in blocks of the tile stream, 8 × 320 bytes for q4_1) the first pass
/// prefetches the weights: one decode step's products at B = 1 went from 4.0 to 2.6 ms
/// with it (random SmolLM2-135M-shaped matrices, 2 threads); no change at B = 16.
const PREFETCH_BLOCKS: usize = 8;

/// Whether the CPU has AVX512F/BW/VL and VNNI (detected once).
pub fn has_vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
    })
}

/// [`QuantX::new_ref`]'s codes, scales and sums, bit for bit: per value the same f32
/// operations in the same order (the max is exact; NaN stays out of it, as `f32::max`
/// leaves it out, and gets code 0, as `as i8` gives it).
/// Safety: the CPU has AVX512F/BW ([`has_vnni`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn quantize(x: &[f32], q: &mut [i8], scale: &mut [f32], sum: &mut [f32]) {
    let blocks = x.len() / BLOCK;
    assert!(x.len() == blocks * BLOCK && q.len() == x.len() && scale.len() == blocks && sum.len() == blocks);
    let shift = _mm512_set1_ps(ROUND_SHIFT);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for b in 0..blocks {
        // SAFETY: block b's 32 values and codes lie within x and q (asserted lengths).
        let v = [_mm512_loadu_ps(x.as_ptr().add(b * BLOCK)), _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16))];
        // max(a, m) returns m when a is NaN (the second operand), so NaN never enters m.
        let m = _mm512_max_ps(_mm512_abs_ps(v[1]), _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps()));
        let dx = _mm512_reduce_max_ps(m) / 127.0;
        let inv = _mm512_set1_ps(if dx > 0.0 { 1.0 / dx } else { 0.0 });
        let mut s = _mm512_setzero_si512();
        for (h, &vh) in v.iter().enumerate() {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(vh, inv), shift), shift);
            // NaN r (from NaN or ±inf in x) gets code 0, as `NaN as i8`.
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let c = _mm512_maskz_cvttps_epi32(ordered, _mm512_min_ps(hi, _mm512_max_ps(lo, r)));
            s = _mm512_add_epi32(s, c);
            _mm_storeu_si128(q.as_mut_ptr().add(b * BLOCK + 16 * h).cast(), _mm512_cvtepi32_epi8(c));
        }
        scale[b] = dx;
        sum[b] = dx * _mm512_reduce_add_epi32(s) as f32;
    }
}

/// One task's operands, as raw pointers for the kernel's inner loops.
#[derive(Clone, Copy)]
struct Task {
    lines: *const Line,
    nb: usize,
    qx: *const i8,
    dx: *const f32,
    sx: *const f32,
    x_off: *const i32,
    out: [*mut f32; MAX_N_Q8],
}

/// The block's 8 code registers: register g, lane r = row r's codes `4g..4g+4` as u8.
/// Safety: `blk` points at the block's first line of a tile (`lines_per_block` lines).
#[inline(always)]
unsafe fn codes<const F: u8>(blk: *const Line) -> [__m512i; 8] {
    let mut w = [_mm512_setzero_si512(); 8];
    if F == Q8_0 {
        for (g, wg) in w.iter_mut().enumerate() {
            *wg = _mm512_load_si512(blk.add(g).cast());
        }
        return w;
    }
    let mask = _mm512_set1_epi8(0x0F);
    for h in 0..4 {
        let v = _mm512_load_si512(blk.add(h).cast());
        w[h] = _mm512_and_si512(v, mask);
        w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    w
}

/// Tile `tile` against rows `j0..j0 + M` of x, written at `t.out[j][at..at + valid]`.
/// Safety: the tile exists in `t.lines`; x rows `j0..j0 + M` exist in `t` (codes, scales,
/// sums, offsets of `t.nb` blocks each); `t.out[j]` holds `at + valid` values, `valid ≤ 16`.
#[inline(always)]
unsafe fn tile_pass<const F: u8, const M: usize>(t: &Task, tile: usize, j0: usize, at: usize, valid: usize) {
    let lpb = lines_per_block(match F {
        Q4_0 => PackedFormat::Q4_0,
        Q4_1 => PackedFormat::Q4_1,
        _ => PackedFormat::Q8_0,
    });
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..t.nb {
        let blk = t.lines.add((tile * t.nb + b) * lpb);
        if j0 == 0 {
            for l in 0..lpb {
                // A hint: the address may lie past the matrix (wrapping_add: no UB).
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BLOCKS * lpb + l).cast());
            }
        }
        let w = codes::<F>(blk);
        let sl = blk.add(lpb - 1).cast::<u8>();
        let d = _mm512_cvtph_ps(_mm256_load_si256(sl.cast()));
        let m = if F == Q4_1 { _mm512_cvtph_ps(_mm256_load_si256(sl.add(32).cast())) } else { _mm512_setzero_ps() };
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let xb = (j0 + j) * t.nb + b;
            let xq = t.qx.add(xb * BLOCK).cast::<i32>();
            let mut dot = if F == Q4_1 { _mm512_setzero_si512() } else { _mm512_set1_epi32(*t.x_off.add(xb)) };
            for (g, &wg) in w.iter().enumerate() {
                dot = _mm512_dpbusd_epi32(dot, wg, _mm512_set1_epi32(xq.add(g).read_unaligned()));
            }
            let s = _mm512_mul_ps(d, _mm512_set1_ps(*t.dx.add(xb)));
            *acc_j = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *acc_j);
            if F == Q4_1 {
                *acc_j = _mm512_fmadd_ps(m, _mm512_set1_ps(*t.sx.add(xb)), *acc_j);
            }
        }
    }
    let keep: __mmask16 = if valid >= TILE { 0xFFFF } else { (1u16 << valid) - 1 };
    for (j, &acc_j) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(t.out[j0 + j].add(at), keep, acc_j);
    }
}

/// The tiles of rows `first..rows_end` (`first` on a tile; outputs at `r − first`) against
/// n rows of x. Safety: as [`tile_pass`] for every tile and pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn run<const F: u8>(t: Task, first: usize, rows_end: usize, n: usize) {
    let mut r = first;
    while r < rows_end {
        let (tile, valid) = (r / TILE, (rows_end - r).min(TILE));
        let mut j0 = 0;
        while j0 < n {
            let m = (n - j0).min(PASS);
            let at = r - first;
            match m {
                1 => tile_pass::<F, 1>(&t, tile, j0, at, valid),
                2 => tile_pass::<F, 2>(&t, tile, j0, at, valid),
                3 => tile_pass::<F, 3>(&t, tile, j0, at, valid),
                4 => tile_pass::<F, 4>(&t, tile, j0, at, valid),
                5 => tile_pass::<F, 5>(&t, tile, j0, at, valid),
                6 => tile_pass::<F, 6>(&t, tile, j0, at, valid),
                7 => tile_pass::<F, 7>(&t, tile, j0, at, valid),
                _ => tile_pass::<F, PASS>(&t, tile, j0, at, valid),
            }
            j0 += m;
        }
        r += TILE;
    }
}

/// `out[j][r − rows.start] = W_r · x̂_j` for the weight rows `rows` (starting on a tile)
/// and the `out.len()` ≤ 16 rows of quantized x, `x_off` from
/// [`super::interleaved::x_offsets`].
/// Safety: the CPU has AVX512F/BW/VL, AVX512-VNNI and F16C ([`has_vnni`]).
pub unsafe fn rows(il: &Interleaved, rows: Range<usize>, x: &QuantX, x_off: &[i32], out: &mut [&mut [f32]]) {
    let (n, nb) = (out.len(), il.n_blocks());
    assert!((1..=MAX_N_Q8).contains(&n) && rows.start.is_multiple_of(TILE) && rows.end <= il.rows());
    assert!(out.iter().all(|o| o.len() == rows.len()));
    assert!(x.q.len() >= n * nb * BLOCK && x.scale.len() >= n * nb && x.sum.len() >= n * nb);
    assert!(il.format() == PackedFormat::Q4_1 || x_off.len() >= n * nb);
    assert!(il.lines().len() >= il.rows().div_ceil(TILE) * nb * lines_per_block(il.format()));
    let mut ptrs = [std::ptr::null_mut(); MAX_N_Q8];
    for (p, o) in ptrs.iter_mut().zip(out.iter_mut()) {
        *p = o.as_mut_ptr();
    }
    let t = Task {
        lines: il.lines().as_ptr(),
        nb,
        qx: x.q.as_ptr(),
        dx: x.scale.as_ptr(),
        sx: x.sum.as_ptr(),
        x_off: x_off.as_ptr(),
        out: ptrs,
    };
    // SAFETY: the asserts bound every line (tiles of `rows` lie within the matrix's), every
    // block of x and offset read, and every output written (tile starts `at` < rows.len(),
    // `valid` clipped to rows.end); the caller vouches for the features.
    match il.format() {
        PackedFormat::Q4_0 => run::<Q4_0>(t, rows.start, rows.end, n),
        PackedFormat::Q4_1 => run::<Q4_1>(t, rows.start, rows.end, n),
        PackedFormat::Q8_0 => run::<Q8_0>(t, rows.start, rows.end, n),
    }
}
