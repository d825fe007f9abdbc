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

/// Σ `a[i]`² in the canonical order.
pub fn sum_sq_canonical(a: &[f32]) -> f32 {
    dot_canonical(a, a)
}

fn butterfly(lanes: &mut [f32; 32]) -> f32 {
    let mut off = 16;
    while off > 0 {
        let prev = *lanes;
        for l in 0..32 {
            lanes[l] = prev[l] + prev[l ^ off];
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
}
