//! Online-softmax partial state for G query heads: running max m, running sum l and the
//! unnormalized accumulator. Partials over disjoint key ranges merge exactly (flash-decoding);
//! an empty partial (m = −∞, l = 0) merges as a no-op.

#[derive(Clone, Debug)]
pub struct Partial {
    pub g: usize,
    pub d: usize,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub acc: Vec<f32>,
}

impl Partial {
    pub fn empty(g: usize, d: usize) -> Self {
        Self { g, d, m: vec![f32::NEG_INFINITY; g], l: vec![0.0; g], acc: vec![0.0; g * d] }
    }

    /// Keep the first g × d floats of the accumulator as a d-wide partial (after a value
    /// format's `finish` has brought a wider accumulator back to d).
    pub fn narrow(&mut self, d: usize) {
        debug_assert!(d <= self.d);
        self.acc.truncate(self.g * d);
        self.d = d;
    }

    /// Back to [`empty`](Self::empty) with a `d`-wide accumulator, reusing the buffers.
    pub fn reset(&mut self, d: usize) {
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
        self.acc.clear();
        self.acc.resize(self.g * d, 0.0);
        self.d = d;
    }

    pub fn is_empty(&self) -> bool {
        self.l.iter().all(|&l| l == 0.0)
    }

    /// Fold in scores of n new keys (s[h·stride + t], t < n): rescales the accumulator and
    /// returns, in `w` (same stride), the weights exp(s − m) the caller must now accumulate
    /// values with; w[h·stride + t] = 0 for t ≥ n.
    pub fn absorb_scores(&mut self, s: &[f32], stride: usize, n: usize, w: &mut [f32]) {
        for h in 0..self.g {
            let row = &s[h * stride..h * stride + n];
            w[h * stride + n..(h + 1) * stride].fill(0.0);
            let m_new = crate::cpu::max_of(row, self.m[h]);
            let alpha = if self.m[h] == f32::NEG_INFINITY { 0.0 } else { (self.m[h] - m_new).exp() };
            // A vectorized exp (rel. error < 3e-7): libm's expf here was the bulk of a
            // decode step, one call per (query head, key).
            let sum = crate::cpu::exp_sum(row, m_new, &mut w[h * stride..h * stride + n]);
            self.l[h] = self.l[h] * alpha + sum;
            self.m[h] = m_new;
            if alpha != 1.0 {
                self.acc[h * self.d..(h + 1) * self.d].iter_mut().for_each(|a| *a *= alpha);
            }
        }
    }

    /// Merge another partial over a disjoint key range (same accumulator domain).
    pub fn merge(&mut self, o: &Partial) {
        for h in 0..self.g {
            if o.l[h] == 0.0 {
                continue;
            }
            let m = self.m[h].max(o.m[h]);
            let a = if self.l[h] == 0.0 { 0.0 } else { (self.m[h] - m).exp() };
            let b = (o.m[h] - m).exp();
            self.l[h] = self.l[h] * a + o.l[h] * b;
            self.m[h] = m;
            let (x, y) = (&mut self.acc[h * self.d..(h + 1) * self.d], &o.acc[h * self.d..(h + 1) * self.d]);
            x.iter_mut().zip(y).for_each(|(p, q)| *p = *p * a + q * b);
        }
    }

    /// acc / l per head.
    pub fn output(&self, out: &mut [f32]) {
        for h in 0..self.g {
            let inv = if self.l[h] > 0.0 { 1.0 / self.l[h] } else { 0.0 };
            for (o, a) in out[h * self.d..(h + 1) * self.d].iter_mut().zip(&self.acc[h * self.d..(h + 1) * self.d]) {
                *o = a * inv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_merge_equals_one_pass() {
        let (g, d, n) = (2, 3, 10);
        let s: Vec<f32> = (0..g * n).map(|i| ((i * 7 % 11) as f32) * 0.3 - 1.0).collect();
        let v: Vec<f32> = (0..n * d).map(|i| (i % 5) as f32 - 2.0).collect();
        let run = |lo: usize, hi: usize| {
            let mut p = Partial::empty(g, d);
            let m = hi - lo;
            let sub: Vec<f32> = (0..g).flat_map(|h| s[h * n + lo..h * n + hi].to_vec()).collect();
            let mut w = vec![0.0; g * m];
            p.absorb_scores(&sub, m, m, &mut w);
            for h in 0..g {
                for t in 0..m {
                    for j in 0..d {
                        p.acc[h * d + j] += w[h * m + t] * v[(lo + t) * d + j];
                    }
                }
            }
            p
        };
        let whole = run(0, n);
        let mut parts = run(0, 4);
        parts.merge(&run(4, 4)); // empty partition
        parts.merge(&run(4, n));
        let (mut a, mut b) = (vec![0.0; g * d], vec![0.0; g * d]);
        whole.output(&mut a);
        parts.output(&mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
