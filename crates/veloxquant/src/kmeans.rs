//! Seeded k-means with k-means++ initialization (Arthur & Vassilvitskii 2007), used to
//! train product-quantization codebooks (vecinfer). Deterministic for a given seed.

use crate::rng::SplitMix64;

#[derive(Clone, Debug)]
pub struct KMeans {
    pub dim: usize,
    /// k × dim, row-major.
    pub centroids: Vec<f32>,
    /// Σ squared distance to the assigned centroid after each assignment step; Lloyd's
    /// iteration makes it non-increasing (tested).
    pub objective: Vec<f64>,
}

fn dist2(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum()
}

/// Index and squared distance of the nearest centroid.
pub fn nearest(centroids: &[f32], dim: usize, x: &[f32]) -> (usize, f64) {
    let mut best = (0, f64::INFINITY);
    for (c, cen) in centroids.chunks_exact(dim).enumerate() {
        let e = dist2(cen, x);
        if e < best.1 {
            best = (c, e);
        }
    }
    best
}

/// Cluster the n = data.len()/dim points into k ≤ n clusters; at most `iters` Lloyd steps,
/// stopping early once no assignment changes.
pub fn kmeans(data: &[f32], dim: usize, k: usize, iters: usize, seed: u64) -> KMeans {
    let n = data.len() / dim;
    assert!(k >= 1 && n >= k, "kmeans needs at least k points (checked by callers)");
    let point = |i: usize| &data[i * dim..(i + 1) * dim];
    let mut rng = SplitMix64::new(seed);
    // k-means++: first centre uniform, then each with probability ∝ D².
    let mut centroids = Vec::with_capacity(k * dim);
    centroids.extend_from_slice(point((rng.next_u64() % n as u64) as usize));
    let mut d2: Vec<f64> = (0..n).map(|i| dist2(point(i), &centroids[..dim])).collect();
    for _ in 1..k {
        let total: f64 = d2.iter().sum();
        let pick = if total > 0.0 {
            let mut r = rng.next_f64() * total;
            d2.iter()
                .position(|&w| {
                    r -= w;
                    r < 0.0
                })
                .unwrap_or(n - 1)
        } else {
            (rng.next_u64() % n as u64) as usize
        };
        let c = point(pick).to_vec();
        for (i, e) in d2.iter_mut().enumerate() {
            *e = e.min(dist2(point(i), &c));
        }
        centroids.extend(c);
    }
    let mut assign = vec![usize::MAX; n];
    let mut objective = Vec::new();
    for _ in 0..iters {
        let mut changed = false;
        let mut obj = 0.0;
        for (i, a) in assign.iter_mut().enumerate() {
            let (c, e) = nearest(&centroids, dim, point(i));
            changed |= *a != c;
            *a = c;
            obj += e;
        }
        objective.push(obj);
        if !changed {
            break;
        }
        let mut sum = vec![0f64; k * dim];
        let mut count = vec![0usize; k];
        for (i, &a) in assign.iter().enumerate() {
            count[a] += 1;
            for (s, v) in sum[a * dim..(a + 1) * dim].iter_mut().zip(point(i)) {
                *s += *v as f64;
            }
        }
        for c in 0..k {
            if count[c] > 0 {
                for j in 0..dim {
                    centroids[c * dim + j] = (sum[c * dim + j] / count[c] as f64) as f32;
                }
            }
        }
    }
    KMeans { dim, centroids, objective }
}
