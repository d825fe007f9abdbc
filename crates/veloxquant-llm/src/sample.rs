//! Token sampling — temperature, top-k, top-p — as one algorithm that the CPU runs here and
//! the GPU runs in `sample_rows` (veloxquant-cuda's kernels/model.cu), so a request's choice
//! does not depend on where it ran or what else was in the batch.
//!
//! Top-k and top-p each become a threshold on the logit: keep every finite logit at or
//! above the k-th largest, then at or above the largest value whose kept tokens hold
//! `top_p` of the probability mass (ties at a threshold are all kept). The choice among the
//! kept tokens is the Gumbel-max: `argmax (l − max)/T + G`, with `G` a Gumbel draw hashed
//! from (seed, draw, token id) — exactly a sample of the softmax, with no sort of the
//! vocabulary and nothing sequential across tokens (the GPU finds the thresholds by
//! bisection, the CPU by selection).

use crate::eval::argmax;

/// One request's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 (or below): greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// 0: no limit.
    pub top_k: usize,
    pub seed: u64,
}

impl SampleParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
    }

    /// Whether the choice is the argmax (no noise, no thresholds).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser (the kernel's `mix64`).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The Gumbel noise of token `id` at a request's `draw`-th sample.
pub fn gumbel(seed: u64, draw: u64, id: u64) -> f64 {
    let h = mix64(
        mix64(seed.wrapping_add(GOLDEN.wrapping_mul(draw.wrapping_add(1))))
            .wrapping_add(GOLDEN.wrapping_mul(id.wrapping_add(1))),
    );
    // In (0, 1): 53 bits, centred in their interval.
    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(-u.ln()).ln()
}

/// The unnormalised probability the top-p threshold sums (the kernel's arithmetic: f32
/// difference, f64 quotient and exp).
fn weight(l: f32, max: f32, t: f32) -> f64 {
    ((l - max) as f64 / t as f64).exp()
}

/// What a sequence's last computed position gives back: nothing (a prompt chunk that does
/// not end the prompt), the argmax, or a token sampled with these parameters at this draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NextToken {
    Nothing,
    Greedy,
    Sample(SampleParams, u64),
}

impl NextToken {
    /// The chosen token from a logits row (the GPU engine makes the same choice on the device).
    pub fn choose(&self, logits: &[f32]) -> Option<u32> {
        match self {
            NextToken::Nothing => None,
            NextToken::Greedy => Some(argmax(logits) as u32),
            NextToken::Sample(p, draw) => Some(sample_token(logits, p, *draw)),
        }
    }
}

/// The token chosen from one logits row at the request's `draw`-th sample. Non-finite
/// logits are never chosen (a row with none finite gives token 0).
pub fn sample_token(logits: &[f32], p: &SampleParams, draw: u64) -> u32 {
    if p.is_greedy() {
        return argmax(logits) as u32;
    }
    let Some((floor, max)) = kept_floor(logits, p) else { return 0 };
    let t = p.temperature as f64;
    let mut best = (f64::NEG_INFINITY, 0u32);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_finite() && l >= floor {
            let s = (l - max) as f64 / t + gumbel(p.seed, draw, i as u64);
            if s > best.0 {
                best = (s, i as u32);
            }
        }
    }
    best.1
}

/// The smallest kept logit after top-k and top-p, and the largest finite logit (`None`:
/// no finite logit).
pub fn kept_floor(logits: &[f32], p: &SampleParams) -> Option<(f32, f32)> {
    let mut finite: Vec<f32> = logits.iter().copied().filter(|v| v.is_finite()).collect();
    let max = finite.iter().copied().reduce(f32::max)?;
    let mut floor = f32::NEG_INFINITY;
    if p.top_k > 0 && p.top_k < finite.len() {
        finite.select_nth_unstable_by(p.top_k - 1, |a, b| b.total_cmp(a));
        floor = finite[p.top_k - 1];
        finite.retain(|&v| v >= floor);
    }
    if p.top_p < 1.0 {
        floor = floor.max(top_p_floor(logits, &mut finite, floor, max, p));
    }
    if floor == f32::NEG_INFINITY {
        floor = finite.iter().copied().fold(max, f32::min);
    }
    Some((floor, max))
}

/// The largest logit value `v ≥ floor` whose tokens at or above it hold `top_p` of the mass
/// of the tokens at or above `floor`. `cand` holds (at least) those tokens' logits; the
/// largest are sorted in growing prefixes until the mass is reached.
fn top_p_floor(logits: &[f32], cand: &mut [f32], floor: f32, max: f32, p: &SampleParams) -> f32 {
    let t = p.temperature;
    let total: f64 = logits.iter().filter(|l| l.is_finite() && **l >= floor).map(|&l| weight(l, max, t)).sum();
    let need = p.top_p as f64 * total;
    let desc = |a: &f32, b: &f32| b.total_cmp(a);
    let mut m = 256.min(cand.len());
    loop {
        if m < cand.len() {
            cand.select_nth_unstable_by(m - 1, desc);
        }
        let top = &mut cand[..m];
        top.sort_unstable_by(desc);
        let mut acc = 0.0f64;
        for &v in top.iter() {
            acc += weight(v, max, t);
            if acc >= need {
                return v;
            }
        }
        if m == cand.len() {
            // Rounding left the sum a hair short of `need`: every candidate is kept.
            return floor;
        }
        m = (4 * m).min(cand.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SampleParams {
        SampleParams { temperature, top_p, top_k, seed }
    }

    /// The kept set by brute force: sort everything, cut at k, then at the mass.
    fn kept_reference(logits: &[f32], p: &SampleParams) -> Vec<u32> {
        let max = logits.iter().copied().filter(|v| v.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let mut ids: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize].is_finite()).collect();
        ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        if p.top_k > 0 && p.top_k < ids.len() {
            let kth = logits[ids[p.top_k - 1] as usize];
            ids.retain(|&i| logits[i as usize] >= kth);
        }
        if p.top_p < 1.0 {
            let w: Vec<f64> = ids.iter().map(|&i| weight(logits[i as usize], max, p.temperature)).collect();
            let need = p.top_p as f64 * w.iter().sum::<f64>();
            let mut acc = 0.0;
            let mut cut = ids.len();
            for (j, x) in w.iter().enumerate() {
                acc += x;
                if acc >= need {
                    cut = j + 1;
                    break;
                }
            }
            let last = logits[ids[cut - 1] as usize];
            ids.retain(|&i| logits[i as usize] >= last);
        }
        ids.sort_unstable();
        ids
    }

    fn random_logits(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = veloxquant::rng::SplitMix64::new(seed);
        (0..n).map(|_| (r.next_gaussian() as f32) * scale).collect()
    }

    #[test]
    fn chosen_tokens_lie_in_the_brute_force_kept_set() {
        // The threshold is exactly the reference's smallest kept logit, and every draw is kept.
        for (case, &(t, tp, k)) in
            [(1.0, 0.9, 0), (0.7, 1.0, 40), (1.3, 0.5, 100), (0.8, 0.95, 3), (2.0, 0.2, 0)].iter().enumerate()
        {
            let logits = random_logits(5000, 11 + case as u64, 3.0);
            let p = params(t, tp, k, 5);
            let kept = kept_reference(&logits, &p);
            let smallest = kept.iter().map(|&i| logits[i as usize]).fold(f32::INFINITY, f32::min);
            assert_eq!(kept_floor(&logits, &p).map(|f| f.0), Some(smallest), "case {case}: threshold");
            let mut seen = std::collections::HashSet::new();
            for draw in 0..300 {
                let id = sample_token(&logits, &p, draw);
                assert!(kept.binary_search(&id).is_ok(), "case {case}: token {id} outside the kept set");
                seen.insert(id);
            }
            assert!(seen.len() > 1 || kept.len() == 1, "case {case}: sampling never varied");
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // 8 tokens, 40,000 draws: each frequency within 4 standard errors of its probability.
        let logits = [0.0f32, 1.0, -1.0, 2.0, 0.5, -3.0, 1.5, f32::NAN];
        let t = 0.9;
        let w: Vec<f64> =
            logits.iter().map(|&l| if l.is_finite() { ((l - 2.0) / t).exp() as f64 } else { 0.0 }).collect();
        let z: f64 = w.iter().sum();
        let n = 40_000;
        let mut counts = [0usize; 8];
        let p = params(t, 1.0, 0, 99);
        for draw in 0..n {
            counts[sample_token(&logits, &p, draw as u64) as usize] += 1;
        }
        assert_eq!(counts[7], 0, "NaN chosen");
        for i in 0..7 {
            let prob = w[i] / z;
            let se = (prob * (1.0 - prob) / n as f64).sqrt();
            let f = counts[i] as f64 / n as f64;
            assert!((f - prob).abs() < 4.0 * se + 1e-4, "token {i}: frequency {f:.4} vs probability {prob:.4}");
        }
    }

    #[test]
    fn same_seed_same_choice_other_seed_differs() {
        let logits = random_logits(2000, 3, 2.0);
        let p = params(1.0, 0.95, 0, 7);
        let a: Vec<u32> = (0..50).map(|d| sample_token(&logits, &p, d)).collect();
        let b: Vec<u32> = (0..50).map(|d| sample_token(&logits, &p, d)).collect();
        let c: Vec<u32> = (0..50).map(|d| sample_token(&logits, &SampleParams { seed: 8, ..p }, d)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn edge_rows() {
        let p = params(1.0, 0.9, 0, 1);
        assert_eq!(sample_token(&[f32::NAN, f32::NEG_INFINITY], &p, 0), 0, "no finite logit: token 0");
        assert_eq!(sample_token(&[f32::NAN, 0.5, f32::INFINITY], &p, 0), 1, "the only finite logit");
        // A tiny top_p keeps only the largest; ties at the top are both kept.
        let tiny = params(1.0, 1e-6, 0, 1);
        let row = [0.0f32, 3.0, 1.0, 3.0];
        let got: std::collections::HashSet<u32> = (0..64).map(|d| sample_token(&row, &tiny, d)).collect();
        assert_eq!(got, [1u32, 3].into_iter().collect());
        assert_eq!(sample_token(&row, &params(0.0, 1.0, 0, 1), 0), 1, "greedy: first of the ties");
    }
}
