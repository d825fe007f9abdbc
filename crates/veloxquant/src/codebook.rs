//! Lloyd-Max scalar codebooks for a unit Gaussian, computed by the closed-form iteration.
//!
//! After a random rotation each coordinate of a unit vector in R^d is ≈ N(0, 1/d), so the
//! N(0,1) codebook scaled by 1/√d is the TurboQuant quantizer (Zandieh et al., arXiv
//! 2504.19874). Values are pinned against shared/REFERENCE.md §1 in the tests.

use std::sync::OnceLock;

/// Optimal b-bit quantizer of N(0,1): ascending centroids and the 2^b − 1 thresholds.
#[derive(Clone, Debug)]
pub struct GaussianCodebook {
    pub bits: u32,
    pub centroids: Vec<f64>,
    pub thresholds: Vec<f64>,
    /// Expected squared error for N(0,1) input.
    pub mse: f64,
}

fn pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// Centroid (conditional mean) of N(0,1) on [a, b].
fn cell_mean(a: f64, b: f64) -> (f64, f64) {
    let p = cdf(b) - cdf(a);
    ((pdf(a) - pdf(b)) / p, p)
}

fn lloyd_max(bits: u32) -> GaussianCodebook {
    let n = 1usize << bits;
    // Start from equal-probability cells; iterate centroid ↔ midpoint to a fixed point.
    let mut c: Vec<f64> = (0..n).map(|i| 2.5 * ((i as f64 + 0.5) / n as f64 * 2.0 - 1.0)).collect();
    let mut t = vec![0.0; n - 1];
    for _ in 0..200_000 {
        for i in 0..n - 1 {
            t[i] = 0.5 * (c[i] + c[i + 1]);
        }
        let mut delta: f64 = 0.0;
        for i in 0..n {
            let a = if i == 0 { f64::NEG_INFINITY } else { t[i - 1] };
            let b = if i == n - 1 { f64::INFINITY } else { t[i] };
            let (m, _) = cell_mean(a, b);
            delta = delta.max((m - c[i]).abs());
            c[i] = m;
        }
        if delta < 1e-13 {
            break;
        }
    }
    for i in 0..n - 1 {
        t[i] = 0.5 * (c[i] + c[i + 1]);
    }
    let mut energy = 0.0;
    for i in 0..n {
        let a = if i == 0 { f64::NEG_INFINITY } else { t[i - 1] };
        let b = if i == n - 1 { f64::INFINITY } else { t[i] };
        let (_, p) = cell_mean(a, b);
        energy += p * c[i] * c[i];
    }
    GaussianCodebook { bits, centroids: c, thresholds: t, mse: 1.0 - energy }
}

/// The cached b-bit codebook, b ∈ 1..=4.
pub fn gaussian(bits: u32) -> &'static GaussianCodebook {
    static BOOKS: [OnceLock<GaussianCodebook>; 4] = [const { OnceLock::new() }; 4];
    assert!((1..=4).contains(&bits), "codebook bits are checked by the formats");
    BOOKS[bits as usize - 1].get_or_init(|| lloyd_max(bits))
}

/// Thresholds of the widest (4-bit) codebook.
const MAX_THRESHOLDS: usize = 15;

/// How many of `t` lie strictly below y: a fixed count of compares, no branches, so a loop
/// over values vectorizes (NaN is below none: 0).
#[inline(always)]
fn count_below(t: &[f32; MAX_THRESHOLDS], y: f32) -> u8 {
    t.iter().map(|&t| u8::from(t < y)).sum()
}

#[inline(always)]
fn count_below_each(t: &[f32; MAX_THRESHOLDS], y: &[f32], codes: &mut [u8]) {
    codes.iter_mut().zip(y).for_each(|(c, &v)| *c = count_below(t, v));
}

/// [`count_below_each`] compiled for AVX-512. Safety: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn count_below_avx512(t: &[f32; MAX_THRESHOLDS], y: &[f32], codes: &mut [u8]) {
    count_below_each(t, y, codes)
}

/// A codebook scaled by 1/√d, in f32: what encoders compare against and decoders emit.
#[derive(Clone, Debug)]
pub struct ScaledCodebook {
    pub bits: u32,
    pub centroids: Vec<f32>,
    pub thresholds: Vec<f32>,
}

impl ScaledCodebook {
    /// Bytes of its centroid and threshold tables.
    pub fn state_bytes(&self) -> usize {
        (self.centroids.len() + self.thresholds.len()) * std::mem::size_of::<f32>()
    }

    pub fn new(bits: u32, d: usize) -> Self {
        let g = gaussian(bits);
        let s = 1.0 / (d as f64).sqrt();
        Self {
            bits,
            centroids: g.centroids.iter().map(|c| (c * s) as f32).collect(),
            thresholds: g.thresholds.iter().map(|t| (t * s) as f32).collect(),
        }
    }

    /// Index of the cell holding y: the number of thresholds strictly below y (NaN: 0).
    #[inline]
    pub fn quantize(&self, y: f32) -> u8 {
        count_below(&self.padded_thresholds(), y)
    }

    /// [`quantize`](Self::quantize) of every value of `y` into `codes` (AVX-512 where the
    /// CPU has it: a decode step encodes each token leaving the window, and a scalar search
    /// per value was most of a row's encode).
    pub fn quantize_into(&self, y: &[f32], codes: &mut [u8]) {
        assert_eq!(y.len(), codes.len(), "quantize_into: one code per value");
        let t = self.padded_thresholds();
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd_level() == crate::cpu::SimdLevel::Avx512 {
            // SAFETY: AVX-512F was detected at run time.
            return unsafe { count_below_avx512(&t, y, codes) };
        }
        count_below_each(&t, y, codes)
    }

    /// The thresholds, then +∞ up to 15 (which no value is below).
    fn padded_thresholds(&self) -> [f32; MAX_THRESHOLDS] {
        std::array::from_fn(|i| self.thresholds.get(i).copied().unwrap_or(f32::INFINITY))
    }

    /// Centroids repeated to fill 16 entries: entry i = centroid (i mod 2^b), so a SIMD
    /// lookup may index with 4 bits of which only the low b are the code.
    pub fn table16(&self) -> [f32; 16] {
        std::array::from_fn(|i| self.centroids[i % self.centroids.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free counts equal a scan of the thresholds below y: at every
    /// threshold, its neighbours in f32, between, beyond both ends, ±0, ±∞ and NaN.
    #[test]
    fn quantize_counts_thresholds_below() {
        for bits in 1..=4 {
            for d in [64, 96, 128] {
                let cb = ScaledCodebook::new(bits, d);
                // Sorted: the GPU's thread-per-row encoders take the centroid of the last
                // threshold below y (a chain of selects) as centroids[count].
                assert!(cb.thresholds.windows(2).all(|w| w[0] <= w[1]), "bits {bits} d {d}: thresholds unsorted");
                let mut ys = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e30, -1e30];
                for &t in &cb.thresholds {
                    ys.extend([t, t.next_up(), t.next_down(), t * 0.5, t * 2.0]);
                }
                for i in -1000..=1000 {
                    ys.push(i as f32 * 1e-3);
                }
                let mut codes = vec![0u8; ys.len()];
                cb.quantize_into(&ys, &mut codes);
                for (&y, &c) in ys.iter().zip(&codes) {
                    let scan = cb.thresholds.iter().filter(|&&t| t < y).count() as u8;
                    assert_eq!(cb.quantize(y), scan, "bits {bits} d {d} y {y}");
                    assert_eq!(c, scan, "quantize_into: bits {bits} d {d} y {y}");
                }
            }
        }
    }

    // shared/REFERENCE.md §1 (converged Lloyd-Max values for N(0,1)).
    const REF: [(u32, f64, &[f64], &[f64]); 4] = [
        (1, 0.363380, &[0.797885], &[0.0]),
        (2, 0.117482, &[0.452780, 1.510418], &[0.0, 0.981599]),
        (3, 0.034548, &[0.245094, 0.756005, 1.343909, 2.151946], &[0.0, 0.500550, 1.049957, 1.747927]),
        (
            4,
            0.009501,
            &[0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590],
            &[0.0, 0.258222, 0.522404, 0.799550, 1.099286, 1.437139, 1.843532, 2.400803],
        ),
    ];

    #[test]
    fn pins_reference_values() {
        for (bits, mse, pos_c, pos_t) in REF {
            let cb = gaussian(bits);
            assert!((cb.mse - mse).abs() < 1e-5, "b={bits} mse {} vs {mse}", cb.mse);
            let n = cb.centroids.len();
            for (i, &c) in pos_c.iter().enumerate() {
                assert!((cb.centroids[n / 2 + i] - c).abs() < 1e-5, "b={bits} c{i}");
                assert!((cb.centroids[n / 2 - 1 - i] + c).abs() < 1e-5, "b={bits} symmetric c{i}");
            }
            for (i, &t) in pos_t.iter().enumerate() {
                assert!((cb.thresholds[n / 2 - 1 + i] - t).abs() < 1e-5, "b={bits} t{i}");
            }
        }
        assert!((gaussian(1).mse - (1.0 - 2.0 / std::f64::consts::PI)).abs() < 1e-9);
    }

    #[test]
    fn quantize_picks_nearest_centroid() {
        let cb = ScaledCodebook::new(3, 64);
        for i in -400..400 {
            let y = i as f32 / 1000.0;
            let q = cb.quantize(y) as usize;
            let best =
                (0..8).min_by(|&a, &b| (cb.centroids[a] - y).abs().total_cmp(&(cb.centroids[b] - y).abs())).unwrap();
            assert!((cb.centroids[q] - y).abs() <= (cb.centroids[best] - y).abs() + 1e-7);
        }
    }
}
