//! A quality report like llama-perplexity's `--kl-divergence`: per method, against a base
//! run on the same windows, from each scored position's base and candidate log-probs and
//! its target token.
//!
//! | statistic      | definition (n scored positions)                                         |
//! |----------------|--------------------------------------------------------------------------|
//! | PPL ± err      | exp(mean NLL); err = PPL · sd(NLL)/√(n − 1) (as llama.cpp)               |
//! | PPL ratio ± err| exp(mean(NLL_q − NLL_base)); err = ratio · sd(Δ)/√(n − 1) (paired)      |
//! | ΔPPL %         | 100·(ratio − 1) ± 100·err                                              |
//! | KL ± err       | mean KL(base ‖ q); err = sd/√(n − 1)                                     |
//! | KL median / p99 / p99.9 / max | order statistics of the n KL values (nearest rank)        |
//! | same top % ± err | argmax agreement p; err = √(p(1 − p)/(n − 1))                         |
//! | RMS Δp ± err   | Δp = p_q(target) − p_base(target); √mean(Δp²), err = sd(Δp²)/(2·RMS·√(n − 1)); in % |

use std::time::Instant;

use crate::error::Result;
use crate::eval::{argmax, window_log_probs, NllAccumulator, WindowPlan};
use crate::kl_base::{KlBaseReader, KlBaseWriter};
use crate::model::Llama;
use crate::store::StoreFactory;

/// Running per-position values for one candidate against the base.
#[derive(Clone, Debug, Default)]
pub struct KlAccumulator {
    nll: Vec<f64>,
    nll_base: Vec<f64>,
    kl: Vec<f64>,
    same_top: usize,
    dp: Vec<f64>,
}

/// The finished statistics (see the module table). Percent where the name says so.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KlReport {
    pub n: usize,
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub ppl_base: f64,
    pub ppl_ratio: f64,
    pub ppl_ratio_stderr: f64,
    pub delta_ppl_pct: f64,
    pub delta_ppl_pct_stderr: f64,
    pub kl_mean: f64,
    pub kl_stderr: f64,
    pub kl_median: f64,
    pub kl_p99: f64,
    pub kl_p999: f64,
    pub kl_max: f64,
    pub same_top_pct: f64,
    pub same_top_stderr: f64,
    /// Percent of probability, as llama-perplexity prints it.
    pub rms_dp: f64,
    pub rms_dp_stderr: f64,
}

/// Mean and standard error sd/√(n − 1) (population sd, as llama.cpp).
fn mean_err(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    if x.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let m = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n;
    (m, if x.len() > 1 { (var / (n - 1.0)).sqrt() } else { 0.0 })
}

/// Nearest-rank quantile q ∈ [0, 1] of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl KlAccumulator {
    /// One scored position: base and candidate log-probability rows and the target token.
    pub fn push(&mut self, base: &[f32], cand: &[f32], target: usize) {
        self.push_with_top(base, argmax(base), cand, target)
    }

    /// As [`push`](Self::push), the base's top token given (a saved base keeps it exactly).
    pub fn push_with_top(&mut self, base: &[f32], base_top: usize, cand: &[f32], target: usize) {
        self.nll_base.push(-(base[target] as f64));
        self.nll.push(-(cand[target] as f64));
        self.kl.push(crate::eval::kl_divergence(base, cand));
        self.same_top += usize::from(base_top == argmax(cand));
        self.dp.push((cand[target] as f64).exp() - (base[target] as f64).exp());
    }

    pub fn len(&self) -> usize {
        self.kl.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kl.is_empty()
    }

    pub fn report(&self) -> KlReport {
        let n = self.kl.len();
        let nf = n as f64;
        let (nll, nll_err) = mean_err(&self.nll);
        let (nll_b, _) = mean_err(&self.nll_base);
        let diff: Vec<f64> = self.nll.iter().zip(&self.nll_base).map(|(a, b)| a - b).collect();
        let (d, d_err) = mean_err(&diff);
        let ratio = d.exp();
        let (kl_mean, kl_stderr) = mean_err(&self.kl);
        let mut sorted = self.kl.clone();
        sorted.sort_by(f64::total_cmp);
        let p = self.same_top as f64 / nf;
        let dp2: Vec<f64> = self.dp.iter().map(|v| v * v).collect();
        let (ms, ms_err) = mean_err(&dp2);
        let rms = ms.sqrt();
        KlReport {
            n,
            ppl: nll.exp(),
            ppl_stderr: nll.exp() * nll_err,
            ppl_base: nll_b.exp(),
            ppl_ratio: ratio,
            ppl_ratio_stderr: ratio * d_err,
            delta_ppl_pct: 100.0 * (ratio - 1.0),
            delta_ppl_pct_stderr: 100.0 * ratio * d_err,
            kl_mean,
            kl_stderr,
            kl_median: quantile(&sorted, 0.5),
            kl_p99: quantile(&sorted, 0.99),
            kl_p999: quantile(&sorted, 0.999),
            kl_max: sorted.last().copied().unwrap_or(f64::NAN),
            same_top_pct: 100.0 * p,
            same_top_stderr: if n > 1 { 100.0 * (p * (1.0 - p) / (nf - 1.0)).sqrt() } else { 0.0 },
            rms_dp: 100.0 * rms,
            rms_dp_stderr: if rms > 0.0 { 100.0 * ms_err / (2.0 * rms) } else { 0.0 },
        }
    }
}

/// Where the base log-probs come from.
pub enum Base<'a, 'b> {
    /// Run this store on every window, saving the rows to the writer if one is given.
    Run(&'a mut StoreFactory<'b>, Option<KlBaseWriter>),
    /// Read the rows a previous run saved (the same windows; the reader checked that).
    File(KlBaseReader),
}

/// The base run's own perplexity (time only when it ran).
#[derive(Clone, Debug, Default)]
pub struct BaseStats {
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub n_windows: usize,
    pub tokens_per_s: Option<f64>,
}

/// One candidate: its report and cost.
#[derive(Clone, Debug, Default)]
pub struct MethodReport {
    pub report: KlReport,
    pub tokens_per_s: f64,
    /// Largest `KvStore::resident_bytes` after a window.
    pub resident_bytes: usize,
}

/// Every window of `tokens` (llama-perplexity's layout, [`WindowPlan`]) through the base and
/// each candidate; `progress(windows_done)` after each window.
#[allow(clippy::too_many_arguments)]
pub fn compare_report(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    mut base: Base,
    candidates: &mut [&mut StoreFactory],
    progress: &mut dyn FnMut(usize),
) -> Result<(BaseStats, Vec<MethodReport>)> {
    let plan = WindowPlan::new(tokens.len(), n_ctx, n_windows)?;
    let n_vocab = model.config.n_vocab;
    let mut accs: Vec<KlAccumulator> = candidates.iter().map(|_| KlAccumulator::default()).collect();
    let mut costs = vec![(0f64, 0usize); candidates.len()];
    let (mut base_nll, mut base_secs) = (NllAccumulator::default(), 0f64);
    for w in 0..plan.n_windows {
        let window = &tokens[w * n_ctx..(w + 1) * n_ctx];
        let targets: Vec<usize> =
            (0..plan.n_scored_per_window()).map(|i| window[plan.first + i + 1] as usize).collect();
        let (lb, tops) = match &mut base {
            Base::Run(factory, save) => {
                let t0 = Instant::now();
                let (lb, _) = window_log_probs(model, window, &plan, bos, *factory)?;
                base_secs += t0.elapsed().as_secs_f64();
                if let Some(wr) = save {
                    wr.write_window(&lb, &targets)?;
                }
                let tops = lb.chunks_exact(n_vocab).map(argmax).collect();
                (lb, tops)
            }
            Base::File(r) => r.read_window(&targets)?,
        };
        for (row, &t) in lb.chunks_exact(n_vocab).zip(&targets) {
            base_nll.push(-(row[t] as f64));
        }
        for ((factory, acc), cost) in candidates.iter_mut().zip(accs.iter_mut()).zip(costs.iter_mut()) {
            let t0 = Instant::now();
            let (lc, resident) = window_log_probs(model, window, &plan, bos, *factory)?;
            cost.0 += t0.elapsed().as_secs_f64();
            cost.1 = cost.1.max(resident);
            for (i, (b, c)) in lb.chunks_exact(n_vocab).zip(lc.chunks_exact(n_vocab)).enumerate() {
                acc.push_with_top(b, tops[i], c, targets[i]);
            }
        }
        progress(w + 1);
    }
    if let Base::Run(_, Some(wr)) = base {
        wr.finish()?;
    }
    let evaluated = (plan.n_windows * n_ctx) as f64;
    let (ppl, ppl_stderr) = base_nll.ppl();
    let ran = base_secs > 0.0;
    let stats =
        BaseStats { ppl, ppl_stderr, n_windows: plan.n_windows, tokens_per_s: ran.then(|| evaluated / base_secs) };
    let out = accs
        .iter()
        .zip(&costs)
        .map(|(a, &(secs, resident))| MethodReport {
            report: a.report(),
            tokens_per_s: evaluated / secs,
            resident_bytes: resident,
        })
        .collect();
    Ok((stats, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ln(p: &[f64]) -> Vec<f32> {
        p.iter().map(|v| v.ln() as f32).collect()
    }

    /// Two positions, three tokens, every statistic worked out by hand.
    #[test]
    fn two_positions_by_hand() {
        let mut acc = KlAccumulator::default();
        // Position 1: base (0.5, 0.25, 0.25), candidate (0.25, 0.5, 0.25), target 0.
        acc.push(&ln(&[0.5, 0.25, 0.25]), &ln(&[0.25, 0.5, 0.25]), 0);
        // Position 2: base (0.8, 0.1, 0.1), candidate (0.8, 0.1, 0.1) (equal), target 1.
        acc.push(&ln(&[0.8, 0.1, 0.1]), &ln(&[0.8, 0.1, 0.1]), 1);
        let r = acc.report();
        let l2 = std::f64::consts::LN_2;
        // KL₁ = 0.5·ln(0.5/0.25) + 0.25·ln(0.25/0.5) + 0 = 0.25·ln 2; KL₂ = 0.
        let kl1 = 0.25 * l2;
        let close = |a: f64, b: f64, what: &str| assert!((a - b).abs() < 1e-6 * (1.0 + b.abs()), "{what}: {a} vs {b}");
        close(r.kl_mean, kl1 / 2.0, "mean KL");
        // sd (population) of {kl1, 0} = kl1/2; err = (kl1/2)/√1.
        close(r.kl_stderr, kl1 / 2.0, "KL err");
        close(r.kl_max, kl1, "KL max");
        close(r.kl_p99, kl1, "KL p99"); // nearest rank of 2 values: round(0.99) = index 1
        close(r.kl_median, kl1, "KL median"); // round(0.5) = 1 (ties round up)
                                              // NLL: base (ln 2, ln 10), candidate (ln 4, ln 10): ratio = exp(mean(ln 2, 0)) = √2.
        close(r.ppl_ratio, 2f64.sqrt(), "PPL ratio");
        close(r.delta_ppl_pct, 100.0 * (2f64.sqrt() - 1.0), "ΔPPL %");
        // Δ = (ln 2, 0): sd = ln2/2, err = √2 · ln2/2.
        close(r.ppl_ratio_stderr, 2f64.sqrt() * l2 / 2.0, "ratio err");
        close(r.ppl, (0.5 * (4f64.ln() + 10f64.ln())).exp(), "PPL"); // √40
        close(r.ppl_base, 20f64.sqrt(), "base PPL");
        // NLL (ln 4, ln 10): sd = (ln 10 − ln 4)/2 = ln(2.5)/2; err = √40 · that.
        close(r.ppl_stderr, 40f64.sqrt() * 2.5f64.ln() / 2.0, "PPL err");
        // Argmax: 0 vs 1 at position 1, 0 vs 0 at 2: 50 %, err = 100·√(0.25/1) = 50.
        close(r.same_top_pct, 50.0, "same top");
        close(r.same_top_stderr, 50.0, "same top err");
        // Δp: (0.25 − 0.5, 0.1 − 0.1) = (−0.25, 0): RMS = √(0.0625/2) = 0.1768 → 17.68 %.
        let rms = (0.0625f64 / 2.0).sqrt();
        close(r.rms_dp, 100.0 * rms, "RMS Δp");
        // Δp² = (0.0625, 0): sd = 0.03125, err of the mean = 0.03125; RMS err = that/(2·RMS).
        close(r.rms_dp_stderr, 100.0 * 0.03125 / (2.0 * rms), "RMS Δp err");
        assert_eq!(r.n, 2);
    }
}
