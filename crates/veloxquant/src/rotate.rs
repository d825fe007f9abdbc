//! Seeded orthogonal rotations.
//!
//! Power-of-two d: randomized Hadamard R = H·D/√d (D a seeded ±1 diagonal, H the
//! Walsh–Hadamard matrix, applied in place in O(d log d)). Any other d (80, 96, 112, …): a
//! seeded Haar-random dense orthogonal matrix (Gram–Schmidt of a Gaussian matrix in f64).
//! Both are exactly orthogonal up to f32 rounding, so norms and inner products survive.

use crate::error::{Result, VqError};
use crate::reduce::dot_canonical;
use crate::rng::SplitMix64;

#[derive(Clone, Debug)]
pub enum Rotation {
    Hadamard { signs: Vec<f32>, scale: f32 },
    Dense { d: usize, m: Vec<f32> },
}

impl Rotation {
    /// Hadamard for power-of-two d, dense orthogonal otherwise.
    pub fn new(d: usize, seed: u64) -> Result<Self> {
        if d == 0 {
            return Err(VqError::UnsupportedHeadDim { format: "rotation".into(), d, why: "d must be > 0" });
        }
        if d.is_power_of_two() {
            Ok(Self::hadamard(d, seed))
        } else {
            Ok(Self::dense(d, seed))
        }
    }

    fn hadamard(d: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let signs = (0..d).map(|_| if rng.next_u64() >> 63 == 1 { -1.0 } else { 1.0 }).collect();
        Self::Hadamard { signs, scale: (1.0 / (d as f64).sqrt()) as f32 }
    }

    /// Any d: Haar-random orthogonal (modified Gram–Schmidt on Gaussian rows, in f64).
    pub fn dense(d: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut rows: Vec<Vec<f64>> = (0..d).map(|_| (0..d).map(|_| rng.next_gaussian()).collect()).collect();
        for i in 0..d {
            for j in 0..i {
                let (done, rest) = rows.split_at_mut(i);
                let p: f64 = done[j].iter().zip(&rest[0]).map(|(a, b)| a * b).sum();
                for (x, y) in rest[0].iter_mut().zip(&done[j]) {
                    *x -= p * y;
                }
            }
            let n = rows[i].iter().map(|x| x * x).sum::<f64>().sqrt();
            rows[i].iter_mut().for_each(|x| *x /= n);
        }
        Self::Dense { d, m: rows.into_iter().flatten().map(|x| x as f32).collect() }
    }

    /// Bytes this rotation holds: d sign floats (Hadamard) or the d² dense matrix.
    pub fn state_bytes(&self) -> usize {
        match self {
            Self::Hadamard { signs, .. } => std::mem::size_of_val(signs.as_slice()),
            Self::Dense { m, .. } => std::mem::size_of_val(m.as_slice()),
        }
    }

    pub fn dim(&self) -> usize {
        match self {
            Self::Hadamard { signs, .. } => signs.len(),
            Self::Dense { d, .. } => *d,
        }
    }

    /// x ← R·x.
    pub fn apply(&self, x: &mut [f32]) {
        match self {
            Self::Hadamard { signs, scale } => {
                x.iter_mut().zip(signs).for_each(|(v, s)| *v *= s);
                fwht(x);
                x.iter_mut().for_each(|v| *v *= scale);
            }
            Self::Dense { d, m } => {
                let src = x.to_vec();
                for (i, out) in x.iter_mut().enumerate() {
                    *out = dot_canonical(&m[i * d..(i + 1) * d], &src);
                }
            }
        }
    }

    /// x ← Rᵀ·x (the inverse).
    pub fn apply_inverse(&self, x: &mut [f32]) {
        match self {
            Self::Hadamard { signs, scale } => {
                fwht(x);
                x.iter_mut().zip(signs).for_each(|(v, s)| *v *= s * scale);
            }
            Self::Dense { d, m } => {
                let src = x.to_vec();
                x.fill(0.0);
                for (i, &s) in src.iter().enumerate() {
                    for (o, &r) in x.iter_mut().zip(&m[i * d..(i + 1) * d]) {
                        *o += r * s;
                    }
                }
            }
        }
    }
}

/// In-place fast Walsh–Hadamard transform (unnormalized), canonical butterfly order: the
/// AVX2 butterflies where detected (the same bits as [`fwht_ref`]; a decode step rotates
/// every appended key and value and each query, ~300 ns each scalar at d = 64).
pub fn fwht(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x.len() >= 8 && x.len().is_power_of_two() && crate::cpu::simd_level() != crate::cpu::SimdLevel::Scalar {
        // SAFETY: simd_level() detected AVX2; the length is a power of two ≥ 8.
        return unsafe { crate::cpu::fwht_x86::fwht(x) };
    }
    fwht_ref(x)
}

/// [`fwht`] one butterfly at a time (defines it).
pub fn fwht_ref(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orthogonal_for_power_of_two_and_other_d() {
        for d in [64, 128, 80, 96, 112] {
            let r = Rotation::new(d, 7).unwrap();
            assert_eq!(matches!(r, Rotation::Hadamard { .. }), d.is_power_of_two());
            let mut rng = SplitMix64::new(d as u64);
            for _ in 0..20 {
                let x = rng.gaussian_vec(d);
                let mut y = x.clone();
                r.apply(&mut y);
                let nx: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                let ny: f64 = y.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                assert!((nx - ny).abs() / nx < 1e-5, "d={d} norm {nx} vs {ny}");
                r.apply_inverse(&mut y);
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() < 1e-5 * nx as f32, "d={d} inverse");
                }
            }
            // Rᵀ R = I column by column.
            for i in 0..d {
                let mut e = vec![0f32; d];
                e[i] = 1.0;
                r.apply(&mut e);
                r.apply_inverse(&mut e);
                for (j, v) in e.iter().enumerate() {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((v - want).abs() < 1e-5, "d={d} (RᵀR)[{i}][{j}] = {v}");
                }
            }
        }
    }

    #[test]
    fn fwht_matches_the_reference_bit_for_bit() {
        let mut rng = SplitMix64::new(3);
        for log in 0..=9 {
            let n = 1 << log;
            for _ in 0..8 {
                let mut x = rng.gaussian_vec(n);
                x[0] = -0.0;
                x[n - 1] *= 1e30; // large and small magnitudes round differently
                let mut want = x.clone();
                fwht_ref(&mut want);
                fwht(&mut x);
                assert_eq!(
                    x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "n={n}"
                );
            }
        }
    }

    #[test]
    fn seeds_differ_and_repeat() {
        let a = Rotation::new(64, 1).unwrap();
        let b = Rotation::new(64, 2).unwrap();
        let c = Rotation::new(64, 1).unwrap();
        let mut x = vec![1f32; 64];
        let (mut y, mut z) = (x.clone(), x.clone());
        a.apply(&mut x);
        b.apply(&mut y);
        c.apply(&mut z);
        assert_ne!(x, y);
        assert_eq!(x, z);
        assert!(Rotation::new(0, 1).is_err());
    }
}
