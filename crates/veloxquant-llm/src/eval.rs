//! Perplexity exactly like llama.cpp's `llama-perplexity`, plus KL divergence and top-1
//! agreement of a candidate cache against a reference cache on the same windows.

use crate::error::{LlmError, Result};
use crate::model::Llama;
use crate::store::StoreFactory;
use rayon::prelude::*;
use std::time::Instant;

/// Perplexity over scored positions, with llama.cpp's standard error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PplStats {
    pub ppl: f64,
    /// Standard error of the PPL estimate (llama.cpp's "±").
    pub ppl_stderr: f64,
    pub mean_nll: f64,
    pub n_scored: usize,
    pub n_windows: usize,
    pub n_ctx: usize,
    pub seconds: f64,
    /// Evaluated (prefilled) tokens per second, all positions of every window.
    pub tokens_per_s: f64,
    /// Largest `KvStore::resident_bytes` seen after a window.
    pub resident_bytes: usize,
}

/// Running sums of negative log-likelihoods.
#[derive(Clone, Debug, Default)]
pub struct NllAccumulator {
    sum: f64,
    sum_sq: f64,
    count: usize,
}

impl NllAccumulator {
    pub fn push(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    /// (ppl, stderr) as llama.cpp computes them.
    pub fn ppl(&self) -> (f64, f64) {
        if self.count == 0 {
            return (f64::NAN, f64::NAN);
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let ppl = mean.exp();
        let var = self.sum_sq / n - mean * mean;
        let err = if var > 0.0 && self.count > 1 { (var / (n - 1.0)).sqrt() * ppl } else { 0.0 };
        (ppl, err)
    }
}

/// Window layout shared by perplexity and comparison: consecutive non-overlapping chunks of
/// `n_ctx` tokens; logits at window positions `first..n_ctx-1` (first = n_ctx/2) predict
/// the next token, i.e. n_ctx - 1 - first scored tokens per window.
#[derive(Clone, Copy, Debug)]
pub struct WindowPlan {
    pub n_ctx: usize,
    pub n_windows: usize,
    pub first: usize,
}

impl WindowPlan {
    /// `n_windows == 0` means as many as the text holds; more than it holds are clamped.
    pub fn new(n_tokens: usize, n_ctx: usize, n_windows: usize) -> Result<Self> {
        if n_ctx < 4 {
            return Err(LlmError::InvalidArgument(format!("n_ctx {n_ctx} < 4")));
        }
        let available = n_tokens / n_ctx;
        if available == 0 {
            return Err(LlmError::TextTooShort { tokens: n_tokens, n_ctx });
        }
        let n_windows = if n_windows == 0 { available } else { n_windows.min(available) };
        Ok(Self { n_ctx, n_windows, first: n_ctx / 2 })
    }

    /// As [`new`](Self::new), and a window must fit `model`'s context (checked before any
    /// window is evaluated).
    pub fn for_model(model: &Llama, n_tokens: usize, n_ctx: usize, n_windows: usize) -> Result<Self> {
        let plan = Self::new(n_tokens, n_ctx, n_windows)?;
        // A window evaluates n_ctx − 1 positions.
        if n_ctx - 1 > model.config.n_ctx_train {
            return Err(LlmError::ContextOverflow { pos: n_ctx - 1, n_ctx_train: model.config.n_ctx_train });
        }
        Ok(plan)
    }

    pub fn n_scored_per_window(&self) -> usize {
        self.n_ctx - 1 - self.first
    }
}

/// Evaluates one window from an empty store in one teacher-forced forward call and returns
/// log-softmax rows `[n_scored][n_vocab]` for positions first..n_ctx-1.
pub fn window_log_probs(
    model: &Llama,
    window: &[u32],
    plan: &WindowPlan,
    bos: Option<u32>,
    factory: &mut StoreFactory,
) -> Result<(Vec<f32>, usize)> {
    if window.len() != plan.n_ctx {
        return Err(LlmError::ShapeMismatch { op: "window length", expected: plan.n_ctx, got: window.len() });
    }
    let mut toks = window.to_vec();
    if let Some(b) = bos {
        toks[0] = b; // llama.cpp replaces the window's first token by BOS when the vocab adds one
    }
    let mut store = factory()?;
    // Position n_ctx-1 predicts nothing inside the window: skip it.
    let n_eval = plan.n_ctx - 1;
    let mut logits = model.forward(&toks[..n_eval], store.as_mut(), plan.first)?;
    let n_vocab = model.config.n_vocab;
    logits.par_chunks_mut(n_vocab).for_each(log_softmax_in_place);
    Ok((logits, store.resident_bytes()))
}

/// llama.cpp `llama-perplexity` over the first `n_windows` windows of `tokens` (whole text,
/// tokenized once). `bos`: the tokenizer's BOS if it adds one.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    factory: &mut StoreFactory,
) -> Result<PplStats> {
    perplexity_with_progress(model, tokens, n_ctx, n_windows, bos, factory, &mut |_, _| {})
}

/// As [`perplexity`], calling `progress(windows_done, running_stats)` after every window.
pub fn perplexity_with_progress(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    factory: &mut StoreFactory,
    progress: &mut dyn FnMut(usize, &PplStats),
) -> Result<PplStats> {
    let plan = WindowPlan::for_model(model, tokens.len(), n_ctx, n_windows)?;
    let n_vocab = model.config.n_vocab;
    let t0 = Instant::now();
    let mut acc = NllAccumulator::default();
    let mut stats = PplStats::default();
    for w in 0..plan.n_windows {
        let window = &tokens[w * n_ctx..(w + 1) * n_ctx];
        let (lp, resident) = window_log_probs(model, window, &plan, bos, factory)?;
        for (i, row) in lp.chunks_exact(n_vocab).enumerate() {
            let target = window[plan.first + i + 1] as usize;
            acc.push(-(row[target] as f64));
        }
        let (ppl, err) = acc.ppl();
        let seconds = t0.elapsed().as_secs_f64();
        stats = PplStats {
            ppl,
            ppl_stderr: err,
            mean_nll: acc.sum / acc.count as f64,
            n_scored: acc.count,
            n_windows: w + 1,
            n_ctx,
            seconds,
            tokens_per_s: ((w + 1) * n_ctx) as f64 / seconds,
            resident_bytes: stats.resident_bytes.max(resident),
        };
        progress(w + 1, &stats);
    }
    Ok(stats)
}

/// A candidate cache compared with the reference on the same windows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompareStats {
    pub reference: PplStats,
    pub candidate: PplStats,
    /// Mean KL(reference ‖ candidate) over scored positions, nats.
    pub kl_mean: f64,
    /// Largest per-position KL seen.
    pub kl_max: f64,
    /// Fraction of scored positions whose argmax token agrees.
    pub top1_agreement: f64,
}

/// Evaluates every window with both stores and compares their next-token distributions.
pub fn compare_stores(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    reference: &mut StoreFactory,
    candidate: &mut StoreFactory,
) -> Result<CompareStats> {
    let mut out = compare_many(model, tokens, n_ctx, n_windows, bos, reference, &mut [candidate])?;
    out.pop().ok_or_else(|| LlmError::InvalidArgument("no candidate".into()))
}

// Per-candidate running sums for compare_many.
#[derive(Default)]
struct CompareAcc {
    nll: NllAccumulator,
    kl_sum: f64,
    kl_max: f64,
    agree: usize,
    seconds: f64,
    resident_bytes: usize,
}

/// Like [`compare_stores`] for several candidates, running the reference once per window
/// (the reference's log-probs are reused for every candidate). One result per candidate.
pub fn compare_many(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    reference: &mut StoreFactory,
    candidates: &mut [&mut StoreFactory],
) -> Result<Vec<CompareStats>> {
    compare_many_with_progress(model, tokens, n_ctx, n_windows, bos, reference, candidates, &mut |_| {})
}

/// As [`compare_many`], calling `progress(windows_done)` after every window.
#[allow(clippy::too_many_arguments)]
pub fn compare_many_with_progress(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    reference: &mut StoreFactory,
    candidates: &mut [&mut StoreFactory],
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<CompareStats>> {
    let plan = WindowPlan::for_model(model, tokens.len(), n_ctx, n_windows)?;
    let n_vocab = model.config.n_vocab;
    let mut r = CompareAcc::default();
    let mut cs: Vec<CompareAcc> = candidates.iter().map(|_| CompareAcc::default()).collect();
    for w in 0..plan.n_windows {
        let window = &tokens[w * n_ctx..(w + 1) * n_ctx];
        let t0 = Instant::now();
        let (lr, rr) = window_log_probs(model, window, &plan, bos, reference)?;
        r.seconds += t0.elapsed().as_secs_f64();
        r.resident_bytes = r.resident_bytes.max(rr);
        for (i, a) in lr.chunks_exact(n_vocab).enumerate() {
            r.nll.push(-(a[window[plan.first + i + 1] as usize] as f64));
        }
        for (factory, c) in candidates.iter_mut().zip(cs.iter_mut()) {
            let t0 = Instant::now();
            let (lc, rc) = window_log_probs(model, window, &plan, bos, *factory)?;
            c.seconds += t0.elapsed().as_secs_f64();
            c.resident_bytes = c.resident_bytes.max(rc);
            for (i, (a, b)) in lr.chunks_exact(n_vocab).zip(lc.chunks_exact(n_vocab)).enumerate() {
                c.nll.push(-(b[window[plan.first + i + 1] as usize] as f64));
                let kl = kl_divergence(a, b);
                c.kl_sum += kl;
                c.kl_max = c.kl_max.max(kl);
                c.agree += usize::from(argmax(a) == argmax(b));
            }
        }
        progress(w + 1);
    }
    let stats = |acc: &CompareAcc| {
        let (ppl, err) = acc.nll.ppl();
        PplStats {
            ppl,
            ppl_stderr: err,
            mean_nll: acc.nll.sum / acc.nll.count as f64,
            n_scored: acc.nll.count,
            n_windows: plan.n_windows,
            n_ctx,
            seconds: acc.seconds,
            tokens_per_s: (plan.n_windows * n_ctx) as f64 / acc.seconds,
            resident_bytes: acc.resident_bytes,
        }
    };
    let reference_stats = stats(&r);
    Ok(cs
        .iter()
        .map(|c| {
            let n = c.nll.count.max(1) as f64;
            CompareStats {
                reference: reference_stats.clone(),
                candidate: stats(c),
                kl_mean: c.kl_sum / n,
                kl_max: c.kl_max,
                top1_agreement: c.agree as f64 / n,
            }
        })
        .collect())
}

/// KL(p ‖ q) from two log-probability rows, nats.
pub fn kl_divergence(log_p: &[f32], log_q: &[f32]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&a, &b)| {
            let p = (a as f64).exp();
            if p > 0.0 {
                p * (a as f64 - b as f64)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        .max(0.0)
}

/// Index of the largest value (first on ties).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Numerically stable log-softmax, normaliser accumulated in f64.
pub fn log_softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    row.iter_mut().for_each(|v| *v = (*v as f64 - log_z) as f32);
}
