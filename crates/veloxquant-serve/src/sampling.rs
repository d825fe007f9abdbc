//! Token choice per request: greedy (temperature 0, the same argmax as `generate`), or
//! temperature / top-k / top-p sampling from the request's own seeded generator, so the
//! same seed gives the same text whatever else runs in the batch.

use veloxquant::rng::SplitMix64;
use veloxquant_llm::eval::argmax;

/// Sampling parameters after validation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// 0: no limit.
    pub top_k: usize,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
    }

    /// Whether the choice is the argmax (the engine's greedy id is enough; no logits needed).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self { params, rng: SplitMix64::new(params.seed) }
    }

    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    /// The next token from a logits row. Non-finite logits count as −∞.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() || logits.is_empty() {
            return argmax(logits) as u32;
        }
        let p = self.params;
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
        if cand.is_empty() {
            return argmax(logits) as u32;
        }
        // Highest first, ties by id: a total order, so the result depends only on the logits.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(order);
        let max = cand[0].1 as f64;
        let t = p.temperature as f64;
        let mut probs: Vec<f64> = cand.iter().map(|&(_, v)| ((v as f64 - max) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut u = self.rng.next_f64() * mass;
        for (i, &x) in probs[..keep].iter().enumerate() {
            u -= x;
            if u < 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed }
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut k1 = Sampler::new(params(1.0, 1.0, 1, 5));
        assert_eq!(k1.sample(&[0.1, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_choices_and_limits_hold() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 1.0, 0, seed));
            (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8), "different seeds should differ somewhere in 40 draws");
        // top_k = 3: only the three largest logits (ids with (i*37)%11 == 10, 9, 8 → values 3.0, 2.7, 2.4).
        let mut top: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let allowed: Vec<u32> = top[..3].iter().map(|x| x.0).collect();
        let mut s = Sampler::new(params(5.0, 1.0, 3, 1));
        for _ in 0..200 {
            assert!(allowed.contains(&s.sample(&logits)));
        }
        // A tiny top_p keeps only the most likely token.
        let mut s = Sampler::new(params(1.0, 1e-6, 0, 1));
        for _ in 0..50 {
            assert_eq!(s.sample(&logits), top[0].0);
        }
    }

    #[test]
    fn non_finite_logits_never_chosen() {
        let mut s = Sampler::new(params(1.0, 1.0, 0, 3));
        for _ in 0..100 {
            let t = s.sample(&[f32::NAN, 0.0, f32::NEG_INFINITY, 0.5]);
            assert!(t == 1 || t == 3);
        }
    }
}
