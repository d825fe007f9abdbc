//! The AVX-512 VNNI kernel over the [`Interleaved`] layout: tiles of 16 weight rows, one
//! at a time against one row of x (a decode step alone: memory-bound, one stream), else
//! two at a time against the rows of x in passes of [`GROUP_PASS`] (one at a time in
//! passes of [`PASS`] for a last odd or partial tile). A row of x's f32 accumulators, one
//! register per tile holding its 16 row sums, stay in registers. Per block and row of x:
//! the i32 start (the format's offset, or 0), 8 `vpdpbusd` with 4 bytes of x broadcast
//! (one broadcast serving both tiles of a pair), then `acc += f32(dot) · (d ⊙ dx)` and
//! for q4_1 `acc += m ⊙ (dx·Σqx)`. Each row of x takes the same f32 operations in the
//! same order whatever the pass or group holds (its integer dot is exact in any order),
//! so a row's result is the same bits at every batch size.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

use super::int8::{QuantX, ROUND_SHIFT};
use super::interleaved::{lines_per_block, Interleaved, Line, TILE};
use super::{PackedFormat, BLOCK, MAX_N_Q8};

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

/// Rows of x per pass over one tile: 8 accumulators + 8 dot registers + the code
/// registers and temporaries fit the 32 zmm registers.
const PASS: usize = 8;
/// Tiles per group (see [`tiles_pass`]). Two: a B = 16 step's products took 14.6 ms
/// against 16.2 for one tile at a time and 17.4 before the dot chains were interleaved
/// (`qmatvec_bench 16 q8`, medians of 5 alternating runs on the loaded 2-core VM); three
/// (passes of 4) and four (of 3) were no faster than two.
const GROUP_TILES: usize = 2;
/// Rows of x per pass over a group of tiles (2 × 6 dot and accumulator registers, the
/// two tiles' code registers and a broadcast of x; 4 and 5 measured the same).
const GROUP_PASS: usize = 6;
/// Fewest rows of x that take tiles in groups (one row of x, a decode step alone, is bound
/// by the memory and keeps one stream).
const GROUP_MIN_N: usize = 2;

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

const fn format_of<const F: u8>() -> PackedFormat {
    match F {
        Q4_0 => PackedFormat::Q4_0,
        Q4_1 => PackedFormat::Q4_1,
        _ => PackedFormat::Q8_0,
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

/// Code register g of a block: lane r = row r's codes `4g..4g+4` as u8 (for q4, the low
/// nibbles of line g, or for g ≥ 4 the high nibbles of line g − 4).
/// Safety: `blk` points at the block's first line of a tile (`lines_per_block` lines).
#[inline(always)]
unsafe fn code<const F: u8>(blk: *const Line, g: usize) -> __m512i {
    if F == Q8_0 {
        return _mm512_load_si512(blk.add(g).cast());
    }
    let v = _mm512_load_si512(blk.add(g % 4).cast());
    let v = if g >= 4 { _mm512_srli_epi16(v, 4) } else { v };
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

/// What a pass over a group of tiles prefetches: `per_block` lines from
/// `base + b · per_block` at block b (hints only: any address).
#[derive(Clone, Copy)]
struct Prefetch {
    base: *const Line,
    per_block: usize,
}

impl Prefetch {
    /// Pass `pass` of `passes` over the `tiles` tiles from `tile` in `t`. One pass over one
    /// tile (1 row of x, a decode step alone) runs at the memory's pace: it prefetches
    /// [`PREFETCH_BLOCKS`] ahead in the stream. Otherwise the passes share the next
    /// group's lines out evenly (the tiles of a group lie one after the other), so that
    /// the loads go on while the later passes compute from L1.
    fn new(t: &Task, lpb: usize, tile: usize, tiles: usize, pass: usize, passes: usize) -> Self {
        if passes == 1 && tiles == 1 {
            let base = t.lines.wrapping_add((tile * t.nb + PREFETCH_BLOCKS) * lpb);
            return Self { base, per_block: lpb };
        }
        let per_block = (tiles * lpb).div_ceil(passes);
        Self { base: t.lines.wrapping_add((tile + tiles) * t.nb * lpb + pass * t.nb * per_block), per_block }
    }
}

/// Tiles `tile..tile + T` against rows `j0..j0 + M` of x, tile i written at
/// `t.out[j][at + 16i..]` (`valid` values of the last tile, 16 of the others).
/// Safety: the tiles exist in `t.lines`; x rows `j0..j0 + M` exist in `t` (codes, scales,
/// sums, offsets of `t.nb` blocks each); `t.out[j]` holds `at + 16(T − 1) + valid` values,
/// `valid ≤ 16`.
#[inline(always)]
unsafe fn tiles_pass<const F: u8, const M: usize, const T: usize>(
    t: &Task,
    tile: usize,
    j0: usize,
    at: usize,
    valid: usize,
    pf: Prefetch,
) {
    let lpb = lines_per_block(format_of::<F>());
    let mut acc = [[_mm512_setzero_ps(); M]; T];
    for b in 0..t.nb {
        let blk: [*const Line; T] = std::array::from_fn(|i| t.lines.add(((tile + i) * t.nb + b) * lpb));
        for l in 0..pf.per_block {
            // A hint: the address may lie past the matrix (wrapping_add: no UB).
            _mm_prefetch::<_MM_HINT_T0>(pf.base.wrapping_add(b * pf.per_block + l).cast());
        }
        // The M·T dot chains advance together, code register g of every tile against
        // every row of x, then g + 1: the instruction stream keeps M·T independent
        // `vpdpbusd` in view (one row's chain of 8 at a time waited on their latency), and
        // each broadcast of x serves the T tiles (a `vpdpbusd` with a broadcast operand
        // ran at 0.7× the rate of one with registers). Integer sums: the same in any order.
        let mut dot = [[_mm512_setzero_si512(); M]; T];
        if F != Q4_1 {
            for dot_i in dot.iter_mut() {
                for (j, dot_ij) in dot_i.iter_mut().enumerate() {
                    *dot_ij = _mm512_set1_epi32(*t.x_off.add((j0 + j) * t.nb + b));
                }
            }
        }
        // One tile: its 8 code registers up front (4 loads for q4, each split in two);
        // two: code register g of each when it is used (registers are short).
        let one = if T == 1 { std::array::from_fn(|g| code::<F>(blk[0], g)) } else { [_mm512_setzero_si512(); 8] };
        for (g, &one_g) in one.iter().enumerate() {
            let w: [__m512i; T] = std::array::from_fn(|i| if T == 1 { one_g } else { code::<F>(blk[i], g) });
            for j in 0..M {
                let xq = t.qx.add(((j0 + j) * t.nb + b) * BLOCK).cast::<i32>();
                let xg = _mm512_set1_epi32(xq.add(g).read_unaligned());
                for (dot_i, &w_i) in dot.iter_mut().zip(&w) {
                    dot_i[j] = _mm512_dpbusd_epi32(dot_i[j], w_i, xg);
                }
            }
        }
        for ((acc_i, dot_i), &blk_i) in acc.iter_mut().zip(&dot).zip(&blk) {
            let sl = blk_i.add(lpb - 1).cast::<u8>();
            let d = _mm512_cvtph_ps(_mm256_load_si256(sl.cast()));
            for (j, (acc_ij, &dot_ij)) in acc_i.iter_mut().zip(dot_i).enumerate() {
                let xb = (j0 + j) * t.nb + b;
                let s = _mm512_mul_ps(d, _mm512_set1_ps(*t.dx.add(xb)));
                *acc_ij = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_ij), s, *acc_ij);
                if F == Q4_1 {
                    let m = _mm512_cvtph_ps(_mm256_load_si256(sl.add(32).cast()));
                    *acc_ij = _mm512_fmadd_ps(m, _mm512_set1_ps(*t.sx.add(xb)), *acc_ij);
                }
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        let keep: __mmask16 = if i + 1 < T || valid >= TILE { 0xFFFF } else { (1u16 << valid) - 1 };
        for (j, &acc_ij) in acc_i.iter().enumerate() {
            _mm512_mask_storeu_ps(t.out[j0 + j].add(at + TILE * i), keep, acc_ij);
        }
    }
}

/// The tiles of rows `first..rows_end` (`first` on a tile; outputs at `r − first`) against
/// n rows of x. Safety: as [`tile_pass`] for every tile and pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
unsafe fn run<const F: u8>(t: Task, first: usize, rows_end: usize, n: usize) {
    let lpb = lines_per_block(format_of::<F>());
    let mut r = first;
    while r < rows_end {
        // Whole tiles in groups where several rows of x share the broadcasts.
        let group = n >= GROUP_MIN_N && r + GROUP_TILES * TILE <= rows_end;
        let (tile, valid, tiles) = (r / TILE, (rows_end - r).min(TILE), if group { GROUP_TILES } else { 1 });
        let pass_n = if group { GROUP_PASS } else { PASS };
        let (mut j0, passes) = (0, n.div_ceil(pass_n));
        while j0 < n {
            let m = (n - j0).min(pass_n);
            let (at, pf) = (r - first, Prefetch::new(&t, lpb, tile, tiles, j0 / pass_n, passes));
            macro_rules! by_m {
                ($tiles:expr, $($m:literal)*) => {
                    match m {
                        $($m => tiles_pass::<F, $m, $tiles>(&t, tile, j0, at, valid, pf),)*
                        _ => unreachable!(),
                    }
                };
            }
            if group {
                by_m!(GROUP_TILES, 1 2 3 4 5 6)
            } else {
                by_m!(1, 1 2 3 4 5 6 7 8)
            }
            j0 += m;
        }
        r += tiles * TILE;
    }
}

/// `out[j][r − rows.start] = W_r · x̂_j` for the weight rows `rows` (starting on a tile)
/// and the `out.len()` ≤ 16 rows of quantized x, `x_off` from
/// [`super::interleaved::x_offsets`]. Writes every element of every `out[j]` (so `out`
/// may start uninitialized: a batched step's outputs are ~10 MB, not worth zeroing first).
/// Safety: the CPU has AVX512F/BW/VL, AVX512-VNNI and F16C ([`has_vnni`]).
pub unsafe fn rows(
    il: &Interleaved,
    rows: Range<usize>,
    x: &QuantX,
    x_off: &[i32],
    out: &mut [&mut [MaybeUninit<f32>]],
) {
    let (n, nb) = (out.len(), il.n_blocks());
    assert!((1..=MAX_N_Q8).contains(&n) && rows.start.is_multiple_of(TILE) && rows.end <= il.rows());
    assert!(out.iter().all(|o| o.len() == rows.len()));
    assert!(x.q.len() >= n * nb * BLOCK && x.scale.len() >= n * nb && x.sum.len() >= n * nb);
    assert!(il.format() == PackedFormat::Q4_1 || x_off.len() >= n * nb);
    assert!(il.lines().len() >= il.rows().div_ceil(TILE) * nb * lines_per_block(il.format()));
    let mut ptrs = [std::ptr::null_mut(); MAX_N_Q8];
    for (p, o) in ptrs.iter_mut().zip(out.iter_mut()) {
        *p = o.as_mut_ptr().cast::<f32>();
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
    // `valid` clipped to rows.end); the caller vouches for the features. `run` walks every
    // tile of `rows` and every row of x, so each output is written once (the last tile's
    // mask keeps exactly its `valid` lanes).
    match il.format() {
        PackedFormat::Q4_0 => run::<Q4_0>(t, rows.start, rows.end, n),
        PackedFormat::Q4_1 => run::<Q4_1>(t, rows.start, rows.end, n),
        PackedFormat::Q8_0 => run::<Q8_0>(t, rows.start, rows.end, n),
    }
}
