//! Seeded 1-bit sketches (QJL: Zandieh et al., arXiv 2406.03482) and the per-token page
//! layout shared by the sketch-, sign- and code-based formats.
//!
//! A sketch S (m × d) maps x to the m sign bits of S·x, packed LSB-first (pack.rs, 1 bit).
//! Estimator of ⟨q, x⟩: √(π/2)/m · ‖x‖ · ⟨S·q, sign(S·x)⟩ — unbiased, variance
//! ≤ π/(2m)·‖q‖²‖x‖² (shared/REFERENCE.md §3).
//!
//! Kinds: `Gauss` rows i.i.d. N(0, I_d); `Orth` stacks ⌈m/d⌉ independent Haar-orthogonal
//! d × d blocks (seeded Gram–Schmidt), every row scaled to norm ρ = E‖g‖ =
//! √2·Γ((d+1)/2)/Γ(d/2) (≈ √(d − 1/2)) for g ~ N(0, I_d). Why: g = ‖g‖·u with ‖g‖
//! independent of the direction u, so E[⟨g,q⟩·sign⟨g,x⟩] = √(2/π)·⟨q,x⟩/‖x‖ splits into
//! E‖g‖ · E[⟨u,q⟩·sign⟨u,x⟩]; a row s = ρ·u therefore keeps the Gaussian estimator's
//! expectation exactly when ρ = E‖g‖, while the orthogonal rows cut its variance (≈ 2.7×
//! at m = d, REFERENCE.md §2). (1/E[1/‖g‖] ≈ √(d − 3/2) would shrink every estimate by
//! 0.967 at d = 16.)

use half::f16;

use super::SketchKind;
use crate::pack;
use crate::rng::{derive_seed, SplitMix64};
use crate::rotate::Rotation;

#[derive(Clone, Debug)]
pub struct Sketch {
    pub m: usize,
    pub d: usize,
    /// m × d, row-major.
    pub rows: Vec<f32>,
}

impl Sketch {
    pub fn new(kind: SketchKind, m: usize, d: usize, seed: u64) -> Self {
        let rows = match kind {
            SketchKind::Gauss => SplitMix64::new(seed).gaussian_vec(m * d),
            SketchKind::Orth => {
                let rho = orth_row_norm(d);
                let mut rows = Vec::with_capacity(m.div_ceil(d) * d * d);
                for blk in 0..m.div_ceil(d) {
                    match Rotation::dense(d, derive_seed(seed, &[blk as u64])) {
                        Rotation::Dense { m, .. } => rows.extend(m.iter().map(|v| v * rho)),
                        Rotation::Hadamard { .. } => unreachable!("dense() is dense"),
                    }
                }
                rows.truncate(m * d);
                rows
            }
        };
        Self { m, d, rows }
    }

    /// √(π/2)/m: the estimator's scale.
    pub fn scale(&self) -> f32 {
        ((std::f64::consts::PI / 2.0).sqrt() / self.m as f64) as f32
    }

    /// out (m) = S·x.
    pub fn project(&self, x: &[f32], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(self.rows.chunks_exact(self.d)) {
            *o = row.iter().zip(x).map(|(a, b)| a * b).sum();
        }
    }

    /// Packed sign bits of S·x (bit i set ⇔ (S·x)_i ≥ 0) into `out` (packed_bytes(m, 1)).
    pub fn encode_signs(&self, x: &[f32], out: &mut [u8]) {
        let mut p = vec![0f32; self.m];
        self.project(x, &mut p);
        out.fill(0);
        for (i, v) in p.iter().enumerate() {
            if *v >= 0.0 {
                out[i / 8] |= 1 << (i % 8);
            }
        }
    }

    /// out (d) += w · Sᵀ·sign, sign read from packed bits.
    pub fn add_back_projection(&self, bits: &[u8], w: f32, out: &mut [f32]) {
        for (i, row) in self.rows.chunks_exact(self.d).enumerate() {
            let s = if bit(bits, i) { w } else { -w };
            out.iter_mut().zip(row).for_each(|(o, r)| *o += s * r);
        }
    }
}

#[inline]
pub fn bit(bits: &[u8], i: usize) -> bool {
    bits[i / 8] >> (i % 8) & 1 == 1
}

/// Σ_i ±p_i with the signs of the packed bits: 2·Σ_{bit set} p_i − Σ p_i, `total` = Σ p_i.
pub fn signed_sum(p: &[f32], bits: &[u8], total: f32) -> f32 {
    let mut set = 0f32;
    for (chunk, &byte) in p.chunks(8).zip(bits) {
        let mut b = byte;
        for v in chunk {
            if b & 1 == 1 {
                set += v;
            }
            b >>= 1;
        }
    }
    2.0 * set - total
}

/// Row norm that keeps the estimator unbiased for Haar-orthogonal rows: E‖g‖ of a standard
/// Gaussian in R^d (the chi distribution's mean; module doc).
pub fn orth_row_norm(d: usize) -> f32 {
    let d = d as f64;
    (std::f64::consts::SQRT_2 * (libm::lgamma((d + 1.0) / 2.0) - libm::lgamma(d / 2.0)).exp()) as f32
}

/// Per-token layout: T rows of `row_bytes` code bytes, then `n_side` arrays of T f16
/// values (norms, corrections), the page padded to whole u32 words.
#[derive(Clone, Copy, Debug)]
pub struct TokenLayout {
    pub t: usize,
    pub row_bytes: usize,
    pub n_side: usize,
}

impl TokenLayout {
    pub fn page_bytes(&self) -> usize {
        (self.t * self.row_bytes + 2 * self.n_side * self.t).div_ceil(4) * 4
    }

    pub fn row<'a>(&self, page: &'a [u8], t: usize) -> &'a [u8] {
        &page[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    pub fn row_mut<'a>(&self, page: &'a mut [u8], t: usize) -> &'a mut [u8] {
        &mut page[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    fn side_at(&self, k: usize, t: usize) -> usize {
        self.t * self.row_bytes + 2 * (k * self.t + t)
    }

    /// Side value k of token t.
    #[inline]
    pub fn side(&self, page: &[u8], k: usize, t: usize) -> f32 {
        let o = self.side_at(k, t);
        f16::from_le_bytes([page[o], page[o + 1]]).to_f32()
    }

    /// Zero rows `from..` and their side values: an open page as a fresh one holds it.
    pub fn clear_rows_from(&self, page: &mut [u8], from: usize) {
        if from >= self.t || page.len() < self.page_bytes() {
            return;
        }
        page[from * self.row_bytes..self.t * self.row_bytes].fill(0);
        for k in 0..self.n_side {
            page[self.side_at(k, from)..self.side_at(k, self.t)].fill(0);
        }
    }

    /// Store side value k of token t (rounded to f16); returns the stored value.
    pub fn set_side(&self, page: &mut [u8], k: usize, t: usize, v: f32) -> f32 {
        let o = self.side_at(k, t);
        let h = f16::from_f32(v);
        page[o..o + 2].copy_from_slice(&h.to_le_bytes());
        h.to_f32()
    }
}

/// Bytes of a packed row of n codes of `bits` bits.
pub fn code_bytes(n: usize, bits: u32) -> usize {
    pack::packed_bytes(n, bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orth_row_norm_is_the_mean_gaussian_norm() {
        // ρ = E‖g‖, estimated by Monte Carlo (sd of ‖g‖ ≈ 0.71, so ± 0.0016 at n = 200k);
        // the old 1/E[1/‖g‖] sits 0.13 lower at d = 16.
        for d in [16, 64] {
            let mut rng = SplitMix64::new(3 + d as u64);
            let n = 200_000;
            let mean: f64 =
                (0..n).map(|_| (0..d).map(|_| rng.next_gaussian().powi(2)).sum::<f64>().sqrt()).sum::<f64>() / n as f64;
            let rho = orth_row_norm(d) as f64;
            assert!((mean - rho).abs() < 0.006, "d={d}: E‖g‖ {mean} vs ρ {rho}");
            assert!((rho - (d as f64 - 0.5).sqrt()).abs() < 0.01, "d={d}: {rho}");
        }
    }
}
