//! Canonical f32 reductions.
//!
//! Codes must be bit-identical on CPU and GPU, and codes depend on norms. A GPU warp sums
//! with a lane-strided partial sum followed by a xor-butterfly; these functions do exactly
//! that on the CPU so both sides round identically (no FMA contraction on either side).

/// Σ `a[i]·b[i]` in the canonical order: lane l sums indices l, l+32, … sequentially, then
/// lanes combine pairwise by xor-butterfly over offsets 16, 8, 4, 2, 1.
pub fn dot_canonical(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0f32; 32];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let p = x * y;
        lanes[i % 32] += p;
    }
    butterfly(&mut lanes)
}

/// Σ `term(i)` for i < n in the canonical order of [`dot_canonical`] (whose terms are
/// `a[i]·b[i]`): for products whose factors are not both in slices.
pub fn sum_canonical_by(n: usize, mut term: impl FnMut(usize) -> f32) -> f32 {
    let mut lanes = [0f32; 32];
    for i in 0..n {
        lanes[i % 32] += term(i);
    }
    butterfly(&mut lanes)
}

/// Σ `a[i]`² in the canonical order.
pub fn sum_sq_canonical(a: &[f32]) -> f32 {
    dot_canonical(a, a)
}

/// Lane 0 of the xor-butterfly over offsets 16, 8, 4, 2, 1. Lane l < off reads lanes l and
/// l ^ off = l + off, so lane 0's tree needs only the lower `off` lanes of each round.
fn butterfly(lanes: &mut [f32; 32]) -> f32 {
    let mut off = 16;
    while off > 0 {
        for l in 0..off {
            lanes[l] += lanes[l + off];
        }
        off /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_sum() {
        let a: Vec<f32> = (0..130).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let exact: f64 = a.iter().map(|&x| x as f64 * x as f64).sum();
        let got = sum_sq_canonical(&a) as f64;
        assert!((got - exact).abs() / exact < 1e-6, "{got} vs {exact}");
    }

    /// The canonical order written out as a GPU warp runs it (every lane of every round of
    /// the xor-butterfly), lane 0 taken: the same bits as the reductions here.
    #[test]
    fn equals_the_full_warp_butterfly_bit_for_bit() {
        let mut rng = crate::rng::SplitMix64::new(11);
        for n in [1, 31, 32, 33, 64, 80, 128, 257] {
            let a: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 1e3).collect();
            let b: Vec<f32> = (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 1e-2).collect();
            let mut lanes = [0f32; 32];
            for i in 0..n {
                lanes[i % 32] += a[i] * b[i];
            }
            for off in [16, 8, 4, 2, 1] {
                let prev = lanes;
                for (l, lane) in lanes.iter_mut().enumerate() {
                    *lane = prev[l] + prev[l ^ off];
                }
            }
            assert_eq!(dot_canonical(&a, &b).to_bits(), lanes[0].to_bits(), "n = {n}");
            assert_eq!(sum_canonical_by(n, |i| a[i] * b[i]).to_bits(), lanes[0].to_bits(), "n = {n}");
        }
    }
}
