//! Products with x quantized to 8 bits per 32-value block (ggml's q8 activations, as
//! llama.cpp decodes): per block, an exact integer dot product of the weight codes with
//! x's codes, scaled once by d·dx, plus the weight offset times dx·Σqx. Integer dots need
//! no per-value conversion to f32: 32 multiply-adds are a `vpmaddubsw` + `vpmaddwd` pair
//! (AVX2); with AVX-512 VNNI, 64 are one `vpdpbusd` (`super::vnni`, over
//! `super::interleaved`'s layout).
//!
//! [`QuantX`] is x's quantization (shared by the reference and the kernels); the scalar
//! [`rows_ref`] defines the products; [`rows`] and [`rows_repacked`] are the AVX2 kernels.

use super::{PackedFormat, BLOCK};
use half::f16;

/// Most blocks per row the repacked kernel's stack buffers hold (2,048 columns; wider rows
/// take the per-block kernel). Small: the buffers are zeroed per row group.
pub const MAX_BLOCKS: usize = 64;

/// x quantized per block: codes `q` (`|q| ≤ 127`), scale `dx = max|x| / 127` and
/// `dx · Σq` per block (the offset term of the 4-bit formats).
#[derive(Clone, Debug)]
pub struct QuantX {
    pub q: Vec<i8>,
    pub scale: Vec<f32>,
    pub sum: Vec<f32>,
}

/// Round half to even by adding and subtracting 1.5·2²³ (|v·inv| ≤ 127; no libm call).
pub(super) const ROUND_SHIFT: f32 = 12_582_912.0;

/// Blocks of x above which [`QuantX::new`] quantizes in two halves on two threads: a
/// batched step's 16 rows (288–768 blocks) took 3–9 µs on one, with the other idle.
#[cfg(target_arch = "x86_64")]
const PAR_MIN_BLOCKS: usize = 256;

/// [`super::vnni::quantize`] of x, halved over the pool while more than
/// [`PAR_MIN_BLOCKS`] blocks remain (blocks are independent: the same bits).
#[cfg(target_arch = "x86_64")]
fn quantize_split(x: &[f32], q: &mut [i8], scale: &mut [f32], sum: &mut [f32]) {
    let blocks = scale.len();
    if blocks <= PAR_MIN_BLOCKS || rayon::current_num_threads() < 2 {
        // SAFETY: callers reach this only where `has_vnni()` detected AVX512F/BW
        // (`quantize` checks the lengths).
        return unsafe { super::vnni::quantize(x, q, scale, sum) };
    }
    let half = blocks / 2;
    let (x0, x1) = x.split_at(half * BLOCK);
    let (q0, q1) = q.split_at_mut(half * BLOCK);
    let (s0, s1) = scale.split_at_mut(half);
    let (m0, m1) = sum.split_at_mut(half);
    rayon::join(|| quantize_split(x0, q0, s0, m0), || quantize_split(x1, q1, s1, m1));
}

impl QuantX {
    /// `x`'s length must be a multiple of 32 (every row of x is whole blocks). The same
    /// bits as [`new_ref`](Self::new_ref), 16 values at a time where AVX-512 is detected.
    pub fn new(x: &[f32]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if super::vnni::has_vnni() {
            let blocks = x.len() / BLOCK;
            let (mut q, mut scale, mut sum) = (vec![0i8; blocks * BLOCK], vec![0f32; blocks], vec![0f32; blocks]);
            quantize_split(x, &mut q, &mut scale, &mut sum);
            return Self { q, scale, sum };
        }
        Self::new_ref(x)
    }

    /// The quantization, one value at a time (defines it; NaN values get code 0 and are
    /// left out of the block's max|x|).
    pub fn new_ref(x: &[f32]) -> Self {
        let blocks = x.len() / BLOCK;
        let (mut q, mut scale, mut sum) = (vec![0i8; blocks * BLOCK], vec![0f32; blocks], vec![0f32; blocks]);
        for (b, (xb, qb)) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)).enumerate() {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let dx = amax / 127.0;
            let inv = if dx > 0.0 { 1.0 / dx } else { 0.0 };
            let mut s = 0i32;
            for (o, &v) in qb.iter_mut().zip(xb) {
                *o = ((v * inv + ROUND_SHIFT) - ROUND_SHIFT).clamp(-127.0, 127.0) as i8;
                s += *o as i32;
            }
            scale[b] = dx;
            sum[b] = dx * s as f32;
        }
        Self { q, scale, sum }
    }

    /// The values the codes stand for, `dx · q` (what the products multiply by).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q.iter().enumerate().map(|(i, &q)| self.scale[i / BLOCK] * q as f32).collect()
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One block's codes as integers in value order (q4: 0..=15; q8_0: signed), its scale d,
/// and its offset per unit of x (q4_0: −8d, q4_1: m, q8_0: 0).
fn block_codes(format: PackedFormat, b: &[u8], codes: &mut [i32; BLOCK]) -> (f32, f32) {
    let d = f16_at(b, 0);
    match format {
        PackedFormat::Q8_0 => {
            for (c, &q) in codes.iter_mut().zip(&b[2..34]) {
                *c = q as i8 as i32;
            }
            (d, 0.0)
        }
        _ => {
            let (at, m) = if format == PackedFormat::Q4_1 { (4, f16_at(b, 2)) } else { (2, -8.0 * d) };
            for (j, &q) in b[at..at + 16].iter().enumerate() {
                codes[j] = (q & 0x0F) as i32;
                codes[j + 16] = (q >> 4) as i32;
            }
            (d, m)
        }
    }
}

/// Weight rows `w` (whole rows of `n_blocks` blocks) against `n` rows of quantized x:
/// `out[r·n + j] = Σ_b d·dx·(codes · qx) + offset·dx·Σqx`, the integer dots exact.
pub(super) fn rows_ref(format: PackedFormat, w: &[u8], n_blocks: usize, x: &QuantX, n: usize, out: &mut [f32]) {
    let bb = format.block_bytes();
    let mut codes = [0i32; BLOCK];
    for (row, o) in w.chunks_exact(n_blocks * bb).zip(out.chunks_exact_mut(n)) {
        o.fill(0.0);
        for (bi, block) in row.chunks_exact(bb).enumerate() {
            let (d, m) = block_codes(format, block, &mut codes);
            for (j, oj) in o.iter_mut().enumerate() {
                let xb = j * n_blocks + bi;
                let qx = &x.q[xb * BLOCK..][..BLOCK];
                let dot: i32 = codes.iter().zip(qx).map(|(&a, &b)| a * b as i32).sum();
                *oj += d * x.scale[xb] * dot as f32 + m * x.sum[xb];
            }
        }
    }
}

/// A matrix's blocks relaid for the SIMD kernel (same values, same bytes): per row the
/// scales (and q4_1 minimums) as separate f16 arrays, and the q4 codes of blocks 2p and
/// 2p + 1 in one 32-byte group — byte k holds value k of the first in its low nibble and
/// of the second in its high nibble — so one load and three operations split two blocks'
/// codes. q8_0 codes stay as they are. Only for rows of an even number of blocks.
#[derive(Clone, Debug)]
pub struct Repacked {
    nb: usize,
    codes: Vec<u8>,
    d: Vec<u16>,
    m: Vec<u16>,
}

impl Repacked {
    /// Code bytes of one weight row (32 per block for q8_0, 16 for the 4-bit formats).
    fn row_code_bytes(&self) -> usize {
        self.codes.len() * self.nb / self.d.len()
    }

    /// None when a row's block count is odd (the per-block kernel runs instead).
    pub(super) fn new(format: PackedFormat, data: &[u8], rows: usize, nb: usize) -> Option<Self> {
        if !nb.is_multiple_of(2) || rows == 0 || nb > MAX_BLOCKS {
            return None;
        }
        let bb = format.block_bytes();
        let (mut codes, mut d, mut m) = (Vec::with_capacity(rows * nb * 32), Vec::with_capacity(rows * nb), Vec::new());
        for row in data.chunks_exact(nb * bb) {
            for block in row.chunks_exact(bb) {
                d.push(u16::from_le_bytes([block[0], block[1]]));
                if format == PackedFormat::Q4_1 {
                    m.push(u16::from_le_bytes([block[2], block[3]]));
                }
            }
            if format == PackedFormat::Q8_0 {
                row.chunks_exact(bb).for_each(|b| codes.extend_from_slice(&b[2..34]));
                continue;
            }
            let at = if format == PackedFormat::Q4_1 { 4 } else { 2 };
            let mut values = [[0u8; BLOCK]; 2];
            for pair in row.chunks_exact(2 * bb) {
                for (h, block) in pair.chunks_exact(bb).enumerate() {
                    for (j, &q) in block[at..at + 16].iter().enumerate() {
                        values[h][j] = q & 0x0F;
                        values[h][j + 16] = q >> 4;
                    }
                }
                codes.extend((0..BLOCK).map(|k| values[0][k] | (values[1][k] << 4)));
            }
        }
        Some(Self { nb, codes, d, m })
    }

    pub(super) fn bytes(&self) -> usize {
        self.codes.len() + 2 * (self.d.len() + self.m.len())
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use simd::{rows, rows_repacked};

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::super::avx2::hsum;
    use super::super::{PackedFormat, BLOCK, MAX_N_Q8 as MAX_N};
    use super::{QuantX, Repacked, MAX_BLOCKS};
    use std::mem::MaybeUninit;

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// The block's 32 weight codes as unsigned bytes in value order, and the signs to put
    /// on x (q4: codes are 0..=15, x unchanged; q8_0: |w|, and x takes w's sign, so the
    /// unsigned × signed product is w · x). Safety: `qs` points at the code bytes.
    // The helpers and the body carry no target features of their own: they are inlined
    // into `rows_avx2` / `rp_avx2`, whose features they are compiled with.
    #[inline(always)]
    unsafe fn weight_bytes<const F: u8>(qs: *const u8) -> __m256i {
        if F == Q8_0 {
            return _mm256_loadu_si256(qs.cast());
        }
        let v = _mm_loadu_si128(qs.cast());
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(v, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// Σ over 4-byte groups of u·s (u unsigned, s signed) into 8 i32 lanes.
    #[inline(always)]
    unsafe fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
        // |u·s| ≤ 128 · 127 per byte pair: the i16 pair sums (≤ 32,512) do not saturate.
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    #[derive(Clone, Copy)]
    struct Task {
        w: *const u8,
        n_rows: usize,
        n_blocks: usize,
        qx: *const i8,
        scale: *const f32,
        sum: *const f32,
        out: *mut f32,
    }

    /// Rows `r0..r0 + R` of the task: R weight rows at once give R·N independent
    /// accumulation chains (one row and one x would wait on one FMA's latency per block).
    /// Safety: as [`rows_body`], and `r0 + R ≤ t.n_rows`.
    #[inline(always)]
    unsafe fn rows_group<const F: u8, const N: usize, const R: usize>(t: Task, r0: usize) {
        let bb = match F {
            Q4_0 => 18,
            Q4_1 => 20,
            _ => 34,
        };
        let qs_at = if F == Q4_1 { 4 } else { 2 };
        let mut acc = [[_mm256_setzero_ps(); N]; R];
        let mut off = [[0f32; N]; R];
        for bi in 0..t.n_blocks {
            for (k, (acc_k, off_k)) in acc.iter_mut().zip(off.iter_mut()).enumerate() {
                let b = t.w.add(((r0 + k) * t.n_blocks + bi) * bb);
                let bits =
                    if F == Q4_1 { b.cast::<i32>().read_unaligned() } else { b.cast::<u16>().read_unaligned() as i32 };
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
                let d = _mm_cvtss_f32(dm);
                let m = match F {
                    Q4_1 => _mm_cvtss_f32(_mm_movehdup_ps(dm)),
                    Q4_0 => -8.0 * d,
                    _ => 0.0,
                };
                let wq = weight_bytes::<F>(b.add(qs_at));
                let wu = if F == Q8_0 { _mm256_sign_epi8(wq, wq) } else { wq };
                for j in 0..N {
                    let xb = j * t.n_blocks + bi;
                    let mut xq = _mm256_loadu_si256(t.qx.add(xb * BLOCK).cast());
                    if F == Q8_0 {
                        xq = _mm256_sign_epi8(xq, wq);
                    }
                    let dot = dot_avx2(wu, xq);
                    let s = _mm256_set1_ps(d * *t.scale.add(xb));
                    acc_k[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc_k[j]);
                    if F != Q8_0 {
                        off_k[j] += m * *t.sum.add(xb);
                    }
                }
            }
        }
        for k in 0..R {
            for j in 0..N {
                *t.out.add((r0 + k) * N + j) = hsum(acc[k][j]) + off[k][j];
            }
        }
    }

    /// The kernel for one format and row count.
    /// Safety: `t` describes readable rows of W and x and writable outputs; the CPU has
    /// AVX2, FMA and F16C.
    #[inline(always)]
    unsafe fn rows_body<const F: u8, const N: usize>(t: Task) {
        // R · N ≥ 4 chains where the rows allow it.
        const fn group(n: usize) -> usize {
            if n == 1 {
                4
            } else if n == 2 {
                2
            } else {
                1
            }
        }
        let mut r = 0;
        if group(N) == 4 {
            while r + 4 <= t.n_rows {
                rows_group::<F, N, 4>(t, r);
                r += 4;
            }
        } else if group(N) == 2 {
            while r + 2 <= t.n_rows {
                rows_group::<F, N, 2>(t, r);
                r += 2;
            }
        }
        while r < t.n_rows {
            rows_group::<F, N, 1>(t, r);
            r += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_avx2<const F: u8, const N: usize>(t: Task) {
        rows_body::<F, N>(t)
    }

    /// Per row and row of x, the block scales d·dx (into `s`) and the offset Σ m·dx·Σq.
    /// Safety: `d`, `m` hold `nb` f16 (m: q4_1 only) and x holds N rows of `nb` blocks.
    #[inline(always)]
    unsafe fn scales<const F: u8, const N: usize>(
        d: *const u16,
        m: *const u16,
        nb: usize,
        x: &QuantX,
        s: &mut [[MaybeUninit<f32>; MAX_BLOCKS]; N],
        off: &mut [f32; N],
    ) {
        let one = |p: *const u16| _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.read_unaligned() as i32)));
        for j in 0..N {
            let (dx, sx) = (x.scale.as_ptr().add(j * nb), x.sum.as_ptr().add(j * nb));
            let mut acc = _mm256_setzero_ps();
            let mut b = 0;
            while b + 8 <= nb {
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.add(b).cast()));
                _mm256_storeu_ps(s[j].as_mut_ptr().add(b).cast(), _mm256_mul_ps(dv, _mm256_loadu_ps(dx.add(b))));
                let mv = match F {
                    Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(m.add(b).cast())),
                    _ => _mm256_mul_ps(dv, _mm256_set1_ps(-8.0)),
                };
                if F != Q8_0 {
                    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx.add(b)), acc);
                }
                b += 8;
            }
            let mut o = hsum(acc);
            while b < nb {
                let db = one(d.add(b));
                s[j][b] = MaybeUninit::new(db * *dx.add(b));
                let mb = if F == Q4_1 { one(m.add(b)) } else { -8.0 * db };
                if F != Q8_0 {
                    o += mb * *sx.add(b);
                }
                b += 1;
            }
            off[j] = o;
        }
    }

    /// [`scales`] for rows `row..row + R`: per row, row of x and block, d·dx, and per row
    /// and row of x the offset term. Safety: as [`scales`], the rows exist in `rp`.
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    unsafe fn group_scales<const F: u8, const N: usize, const R: usize>(
        rp: &Repacked,
        x: &QuantX,
        row: usize,
    ) -> ([[[MaybeUninit<f32>; MAX_BLOCKS]; N]; R], [[f32; N]; R]) {
        let nb = rp.nb;
        // Not zeroed (a 4 KiB memset per row at N = 16): `scales` writes s[k][j][..nb],
        // every entry the kernels read.
        let mut s = [[[MaybeUninit::<f32>::uninit(); MAX_BLOCKS]; N]; R];
        let mut off = [[0f32; N]; R];
        for k in 0..R {
            let r = row + k;
            let m = if F == Q4_1 { rp.m.as_ptr().add(r * nb) } else { std::ptr::null() };
            scales::<F, N>(rp.d.as_ptr().add(r * nb), m, nb, x, &mut s[k], &mut off[k]);
        }
        (s, off)
    }

    /// Rows `row..row + R` over the repacked layout (two blocks per code load for q4),
    /// written to `out[(r − first)·N + j]`. Safety: the rows exist in `rp`, x holds N rows
    /// of `rp.nb` blocks, `out` holds `(row + R − first) · N` values.
    #[inline(always)]
    unsafe fn rows_repacked_group<const F: u8, const N: usize, const R: usize, const A: usize>(
        rp: &Repacked,
        x: &QuantX,
        row: usize,
        first: usize,
        out: *mut f32,
    ) {
        let nb = rp.nb;
        let code_bytes = rp.row_code_bytes();
        let (s, off) = group_scales::<F, N, R>(rp, x, row);
        // A chains per row of x: two where there are few rows, one where there are many (R·N·A
        // accumulators must stay in registers).
        let mut acc = [[[_mm256_setzero_ps(); A]; N]; R];
        let mask = _mm256_set1_epi8(0x0F);
        let qx = x.q.as_ptr();
        let step = if F == Q8_0 { 1 } else { 2 };
        let mut b = 0;
        while b < nb {
            for k in 0..R {
                let c = rp.codes.as_ptr().add((row + k) * code_bytes + b * BLOCK / step);
                let v = _mm256_loadu_si256(c.cast());
                let (w0, w1) = if F == Q8_0 {
                    (v, v)
                } else {
                    (_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask))
                };
                for j in 0..N {
                    for h in 0..step {
                        let xb = j * nb + b + h;
                        let mut xq = _mm256_loadu_si256(qx.add(xb * BLOCK).cast());
                        let mut wu = if h == 0 { w0 } else { w1 };
                        if F == Q8_0 {
                            xq = _mm256_sign_epi8(xq, wu);
                            wu = _mm256_sign_epi8(wu, wu);
                        }
                        let dot = dot_avx2(wu, xq);
                        let sc = _mm256_set1_ps(s[k][j][b + h].assume_init());
                        let a = h % A;
                        acc[k][j][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[k][j][a]);
                    }
                }
            }
            b += step;
        }
        for k in 0..R {
            for j in 0..N {
                let sum = acc[k][j][1..].iter().fold(acc[k][j][0], |a, &b| _mm256_add_ps(a, b));
                *out.add((row + k - first) * N + j) = hsum(sum) + off[k][j];
            }
        }
    }

    #[inline(always)]
    unsafe fn rows_repacked_body<const F: u8, const N: usize>(
        rp: &Repacked,
        x: &QuantX,
        rows: std::ops::Range<usize>,
        out: *mut f32,
    ) {
        // Two rows at once for one row of x (four accumulation chains).
        let mut r = rows.start;
        if N == 1 {
            while r + 2 <= rows.end {
                rows_repacked_group::<F, N, 2, 2>(rp, x, r, rows.start, out);
                r += 2;
            }
        }
        while r < rows.end {
            if N <= 4 {
                rows_repacked_group::<F, N, 1, 2>(rp, x, r, rows.start, out);
            } else {
                rows_repacked_group::<F, N, 1, 1>(rp, x, r, rows.start, out);
            }
            r += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rp_avx2<const F: u8, const N: usize>(
        rp: &Repacked,
        x: &QuantX,
        rows: std::ops::Range<usize>,
        out: *mut f32,
    ) {
        rows_repacked_body::<F, N>(rp, x, rows, out)
    }

    /// [`rows`] over a [`Repacked`] matrix: weight rows `rows` into `out [row][n]`.
    /// Safety: the CPU has AVX2, FMA and F16C.
    pub unsafe fn rows_repacked(
        format: PackedFormat,
        rp: &Repacked,
        rows: std::ops::Range<usize>,
        x: &QuantX,
        n: usize,
        out: &mut [f32],
    ) {
        let total = rp.d.len() / rp.nb;
        assert!((1..=MAX_N).contains(&n) && rows.end <= total && out.len() == rows.len() * n);
        assert!(rp.nb <= MAX_BLOCKS && x.q.len() >= n * rp.nb * BLOCK && x.scale.len() >= n * rp.nb);
        assert!(format != PackedFormat::Q4_1 || rp.m.len() == rp.d.len());
        let o = out.as_mut_ptr();
        // SAFETY (every instance): the asserts bound the rows, blocks and outputs read and
        // written; the caller vouches for the features.
        macro_rules! by_n {
            ($k:ident, $f:expr) => {
                match n {
                    1 => $k::<$f, 1>(rp, x, rows, o),
                    2 => $k::<$f, 2>(rp, x, rows, o),
                    3 => $k::<$f, 3>(rp, x, rows, o),
                    4 => $k::<$f, 4>(rp, x, rows, o),
                    5 => $k::<$f, 5>(rp, x, rows, o),
                    6 => $k::<$f, 6>(rp, x, rows, o),
                    7 => $k::<$f, 7>(rp, x, rows, o),
                    8 => $k::<$f, 8>(rp, x, rows, o),
                    9 => $k::<$f, 9>(rp, x, rows, o),
                    10 => $k::<$f, 10>(rp, x, rows, o),
                    11 => $k::<$f, 11>(rp, x, rows, o),
                    12 => $k::<$f, 12>(rp, x, rows, o),
                    13 => $k::<$f, 13>(rp, x, rows, o),
                    14 => $k::<$f, 14>(rp, x, rows, o),
                    15 => $k::<$f, 15>(rp, x, rows, o),
                    _ => $k::<$f, 16>(rp, x, rows, o),
                }
            };
        }
        match format {
            PackedFormat::Q4_0 => by_n!(rp_avx2, Q4_0),
            PackedFormat::Q4_1 => by_n!(rp_avx2, Q4_1),
            PackedFormat::Q8_0 => by_n!(rp_avx2, Q8_0),
        }
    }

    /// `out[r·n + j] = W_r · x̂_j` for the rows in `w` (n ≤ 16 rows of quantized x).
    /// Safety: the CPU has AVX2, FMA and F16C.
    pub unsafe fn rows(format: PackedFormat, w: &[u8], n_blocks: usize, x: &QuantX, n: usize, out: &mut [f32]) {
        let n_rows = out.len() / n.max(1);
        assert!((1..=MAX_N).contains(&n) && out.len() == n_rows * n);
        assert!(w.len() == n_rows * n_blocks * format.block_bytes());
        assert!(x.q.len() >= n * n_blocks * BLOCK && x.scale.len() >= n * n_blocks && x.sum.len() >= n * n_blocks);
        let t = Task {
            w: w.as_ptr(),
            n_rows,
            n_blocks,
            qx: x.q.as_ptr(),
            scale: x.scale.as_ptr(),
            sum: x.sum.as_ptr(),
            out: out.as_mut_ptr(),
        };
        // SAFETY (every instance): the asserts give the extents read and written; the
        // caller vouches for the features.
        macro_rules! by_n {
            ($k:ident, $f:expr) => {
                match n {
                    1 => $k::<$f, 1>(t),
                    2 => $k::<$f, 2>(t),
                    3 => $k::<$f, 3>(t),
                    4 => $k::<$f, 4>(t),
                    5 => $k::<$f, 5>(t),
                    6 => $k::<$f, 6>(t),
                    7 => $k::<$f, 7>(t),
                    8 => $k::<$f, 8>(t),
                    9 => $k::<$f, 9>(t),
                    10 => $k::<$f, 10>(t),
                    11 => $k::<$f, 11>(t),
                    12 => $k::<$f, 12>(t),
                    13 => $k::<$f, 13>(t),
                    14 => $k::<$f, 14>(t),
                    15 => $k::<$f, 15>(t),
                    _ => $k::<$f, 16>(t),
                }
            };
        }
        match format {
            PackedFormat::Q4_0 => by_n!(rows_avx2, Q4_0),
            PackedFormat::Q4_1 => by_n!(rows_avx2, Q4_1),
            PackedFormat::Q8_0 => by_n!(rows_avx2, Q8_0),
        }
    }
}
