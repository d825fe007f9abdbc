//! CPU kernels for the row-coded layouts: feature detection once, then the widest path the
//! machine has (AVX2+FMA+F16C on x86-64), with a portable scalar path that defines the
//! semantics.

/// Kernel instance per row kind and code widths: `$f::<KIND, BITS, LO_BITS>(layout, args...)`
/// (defined before the SIMD modules so they see it). LO_BITS is the second segment's width of
/// a split row, 0 for the other kinds.
#[cfg(target_arch = "x86_64")]
macro_rules! dispatch_row_kind {
    ($l:expr, $f:ident, $($args:expr),*) => {
        match &$l.kind {
            RowKind::F16 => $f::<F16, 0, 0>($l, $($args),*),
            RowKind::Q8_0 => $f::<Q8, 0, 0>($l, $($args),*),
            RowKind::Q4_0 => $f::<Q4, 0, 0>($l, $($args),*),
            RowKind::Codes { bits: 1, .. } => $f::<CODES, 1, 0>($l, $($args),*),
            RowKind::Codes { bits: 2, .. } => $f::<CODES, 2, 0>($l, $($args),*),
            RowKind::Codes { bits: 3, .. } => $f::<CODES, 3, 0>($l, $($args),*),
            RowKind::Codes { .. } => $f::<CODES, 4, 0>($l, $($args),*),
            RowKind::Split { hi_bits: 2, .. } => $f::<SPLIT, 2, 1>($l, $($args),*),
            RowKind::Split { hi_bits: 3, .. } => $f::<SPLIT, 3, 2>($l, $($args),*),
            RowKind::Split { .. } => $f::<SPLIT, 4, 3>($l, $($args),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod fwht_x86;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

use std::sync::OnceLock;

use crate::format::rows::RowLayout;

/// Row-kind tags of the SIMD kernels' const generic (see `dispatch_row_kind!`).
#[cfg(target_arch = "x86_64")]
const F16: u8 = 0;
#[cfg(target_arch = "x86_64")]
const Q8: u8 = 1;
#[cfg(target_arch = "x86_64")]
const Q4: u8 = 2;
#[cfg(target_arch = "x86_64")]
const CODES: u8 = 3;
#[cfg(target_arch = "x86_64")]
const SPLIT: u8 = 4;
/// Query heads scored per pass; larger groups take several passes.
#[cfg(target_arch = "x86_64")]
const MAX_G: usize = 8;

/// `ws[h·T + t] = w[h·T + t] · scale_t` for the first `g` heads of `w`: the value
/// accumulators then multiply each token's row by one broadcast weight.
#[cfg(target_arch = "x86_64")]
fn scale_weights(l: &RowLayout, scales: &[f32], w: &[f32], g: usize, ws: &mut [f32]) {
    for h in 0..g {
        let (wh, wsh) = (&w[h * l.t..(h + 1) * l.t], &mut ws[h * l.t..(h + 1) * l.t]);
        wsh.iter_mut().zip(wh).zip(scales).for_each(|((o, &wi), &s)| *o = wi * s);
    }
}

/// Page scratch of zeroed floats: on the stack up to `N` (the default 32-token page), else
/// on the heap. The kernels run once per page, where an allocation was a visible share.
/// Built uninitialized and zeroed in place by [`Scratch::zeroed`], only the floats asked
/// for: an array built initialized and then moved into the struct was copied on every call
/// (up to 8 KiB, 6 % of a short-context decode step in `memcpy`).
pub(crate) struct Scratch<const N: usize> {
    stack: [std::mem::MaybeUninit<f32>; N],
    heap: Vec<f32>,
}

impl<const N: usize> Scratch<N> {
    pub(crate) fn new() -> Self {
        Self { stack: [std::mem::MaybeUninit::uninit(); N], heap: Vec::new() }
    }

    /// `n` zeroed floats.
    pub(crate) fn zeroed(&mut self, n: usize) -> &mut [f32] {
        if n > N {
            self.heap = vec![0.0; n];
            return &mut self.heap;
        }
        let part = &mut self.stack[..n];
        part.iter_mut().for_each(|v| {
            v.write(0.0);
        });
        // SAFETY: the n ≤ N elements were just initialized; MaybeUninit<f32> has f32's
        // layout, so they read as n floats.
        unsafe { std::slice::from_raw_parts_mut(part.as_mut_ptr().cast::<f32>(), n) }
    }
}

/// Instruction sets the fused kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Scalar,
    Avx2,
    Avx512,
}

/// Detected once per process.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vbmi") {
                return SimdLevel::Avx512;
            }
            return SimdLevel::Avx2;
        }
        SimdLevel::Scalar
    })
}

/// Whether this machine can run `level` (levels are nested: AVX-512 ⊃ AVX2 ⊃ scalar).
fn runs(level: SimdLevel) -> bool {
    match simd_level() {
        SimdLevel::Avx512 => true,
        SimdLevel::Avx2 => level != SimdLevel::Avx512,
        SimdLevel::Scalar => level == SimdLevel::Scalar,
    }
}

/// Levels this machine can run, best first (tests run every one against the scalar path).
pub fn available_levels() -> Vec<SimdLevel> {
    [SimdLevel::Avx512, SimdLevel::Avx2, SimdLevel::Scalar].into_iter().filter(|l| runs(*l)).collect()
}

/// out[h·T + t] = q_h · (scale_t · row_t) for n_q queries of d floats.
pub fn scores(l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    scores_at(simd_level(), l, q, n_q, page, out)
}

/// acc[h·d ..] += Σ_t w[h·T + t] · scale_t · row_t.
pub fn accumulate(l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    accumulate_at(simd_level(), l, w, n_q, page, acc)
}

/// [`scores`] on a chosen level; a level the CPU lacks falls back to scalar.
pub fn scores_at(level: SimdLevel, l: &RowLayout, q: &[f32], n_q: usize, page: &[u8], out: &mut [f32]) {
    assert!(page.len() >= l.page_bytes() && q.len() >= n_q * l.d && out.len() >= n_q * l.t);
    #[cfg(target_arch = "x86_64")]
    if runs(level) {
        match level {
            // SAFETY: the level's features were detected at run time; the assert above gives
            // the buffer sizes the kernels' unchecked loads rely on.
            SimdLevel::Avx512 if l.d.is_multiple_of(16) => return unsafe { x86_512::scores(l, q, n_q, page, out) },
            SimdLevel::Avx512 | SimdLevel::Avx2 if l.d.is_multiple_of(8) => {
                return unsafe { x86::scores(l, q, n_q, page, out) }
            }
            _ => {}
        }
    }
    scalar::scores(l, q, n_q, page, out)
}

/// [`accumulate`] on a chosen level; a level the CPU lacks falls back to scalar.
pub fn accumulate_at(level: SimdLevel, l: &RowLayout, w: &[f32], n_q: usize, page: &[u8], acc: &mut [f32]) {
    assert!(page.len() >= l.page_bytes() && w.len() >= n_q * l.t && acc.len() >= n_q * l.d);
    #[cfg(target_arch = "x86_64")]
    if runs(level) {
        match level {
            // SAFETY: as in `scores_at`.
            SimdLevel::Avx512 if l.d.is_multiple_of(16) => return unsafe { x86_512::accumulate(l, w, n_q, page, acc) },
            SimdLevel::Avx512 | SimdLevel::Avx2 if l.d.is_multiple_of(8) => {
                return unsafe { x86::accumulate(l, w, n_q, page, acc) }
            }
            _ => {}
        }
    }
    scalar::accumulate(l, w, n_q, page, acc)
}

/// Dense f32 helpers used by the fp16 tail and the reference path.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums: lets the compiler vectorize without reassociation licence.
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            s[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    s.iter().sum::<f32>() + tail
}

pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += w * b);
}

/// The softmax weights of one head's scores after their max: `w[i] = e^(s[i] − m)` (as
/// [`exp_approx`], within its error), returning Σ w. 16 at a time with AVX-512: the scalar
/// loop was a tenth of a decode step (a page's 32 scores per head, sequential sums).
pub fn exp_sum(s: &[f32], m: f32, w: &mut [f32]) -> f32 {
    assert!(w.len() >= s.len());
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the level was detected at run time; w holds s.len() floats (asserted).
        return unsafe { x86_512::exp_sum(s, m, w) };
    }
    let mut sum = 0.0;
    for (wi, &si) in w.iter_mut().zip(s) {
        *wi = exp_approx(si - m);
        sum += *wi;
    }
    sum
}

/// max(init, s[..]) (exact in any order; NaN-free scores).
pub fn max_of(s: &[f32], init: f32) -> f32 {
    let mut m = [init; 8];
    let c = s.chunks_exact(8);
    let rest = c.remainder().iter().fold(init, |a, &b| a.max(b));
    for x in c {
        for i in 0..8 {
            m[i] = m[i].max(x[i]);
        }
    }
    m.iter().fold(rest, |a, &b| a.max(b))
}

/// e^x for x ≤ 88 (softmax after max subtraction; SwiGLU's e^−g clamped there), relative
/// error < 3e-7: range reduction x = k·ln2 + r, |r| ≤ ln2/2, then a degree-6 Taylor
/// polynomial; branch-free so it vectorizes. Underflows to 0 below -87.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let x = x.max(-87.0);
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = x - k * LN2_HI - k * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from k + 127 (in 1..=254 after the clamp) read off the mantissa of
    // 2^23 + k + 127: the same bits as `(k as i32 + 127) << 23`, without the saturating
    // float-to-int cast that kept the loop from vectorizing.
    let scale = f32::from_bits((k + (127.0 + 8_388_608.0)).to_bits() << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_approx_matches_exp() {
        let mut worst = 0f64;
        for i in -176_000..=200_000 {
            let x = -(i as f32) * 5e-4; // 88 .. -100
            let (got, want) = (super::exp_approx(x) as f64, (x as f64).exp());
            if want > 1e-37 {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert!(got <= 1e-37, "x={x}: {got}"); // clamped at -87: underflows to ~0
            }
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }

    /// The softmax helpers (AVX-512 where present) against f64: every tail length of the
    /// 16-lane loop, scores spread over [m − 100, m], the max exact.
    #[test]
    fn exp_sum_and_max_match_f64() {
        let mut rng = crate::rng::SplitMix64::new(4);
        for n in 1..=40 {
            let s: Vec<f32> = (0..n).map(|_| -(rng.next_f64() as f32) * 100.0 + 3.0).collect();
            let m = super::max_of(&s, f32::NEG_INFINITY);
            assert_eq!(m, s.iter().copied().fold(f32::NEG_INFINITY, f32::max), "n={n}");
            assert_eq!(super::max_of(&s, 1e9), 1e9);
            let mut w = vec![f32::NAN; n + 3];
            let sum = super::exp_sum(&s, m, &mut w);
            let want: Vec<f64> = s.iter().map(|&x| ((x - m) as f64).exp()).collect();
            for (i, (&g, &e)) in w.iter().zip(&want).enumerate() {
                assert!((g as f64 - e).abs() <= 3e-7 * e + 1e-37, "n={n} i={i}: {g} vs {e}");
            }
            assert!(w[n..].iter().all(|v| v.is_nan()), "n={n}: wrote past the scores");
            let total: f64 = want.iter().sum();
            assert!((sum as f64 - total).abs() <= 1e-6 * total, "n={n}: {sum} vs {total}");
        }
    }
}
