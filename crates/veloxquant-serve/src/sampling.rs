//! Token choice per request: greedy (temperature 0, the same argmax as `generate`), or
//! temperature / top-k / top-p sampling by `veloxquant_llm::sample` — the algorithm the GPU
//! engine runs on the device — keyed by the request's seed and its draw count, so the same
//! seed gives the same text whatever else runs in the batch.

use veloxquant_llm::sample::sample_token;
pub use veloxquant_llm::sample::SampleParams as SamplingParams;

pub struct Sampler {
    params: SamplingParams,
    /// Tokens sampled so far (the draw index of the next one).
    draws: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self { params, draws: 0 }
    }

    pub fn is_greedy(&self) -> bool {
        self.params.is_greedy()
    }

    pub fn params(&self) -> SamplingParams {
        self.params
    }

    /// The index of the next draw (what a device sampler needs with the params).
    pub fn draws(&self) -> u64 {
        self.draws
    }

    /// Counts a token chosen elsewhere (the GPU engine) with this sampler's next draw.
    pub fn note_draw(&mut self) {
        self.draws += 1;
    }

    /// The next token from a logits row. Non-finite logits are never chosen.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let id = sample_token(logits, &self.params, self.draws);
        self.draws += 1;
        id
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
        // top_k = 3 keeps the logits at or above the third largest: the value 2.4 and up
        // (ids with (i*37)%11 ∈ {8, 9, 10}).
        let third = {
            let mut v = logits.clone();
            v.sort_by(|a, b| b.total_cmp(a));
            v[2]
        };
        let mut s = Sampler::new(params(5.0, 1.0, 3, 1));
        for _ in 0..200 {
            assert!(logits[s.sample(&logits) as usize] >= third);
        }
        // A tiny top_p keeps only the most likely tokens (the ties of the largest value).
        let top = logits.iter().copied().fold(f32::MIN, f32::max);
        let mut s = Sampler::new(params(1.0, 1e-6, 0, 1));
        for _ in 0..50 {
            assert_eq!(logits[s.sample(&logits) as usize], top);
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
