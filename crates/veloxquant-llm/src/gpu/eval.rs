//! Evaluation on the GPU: windows batched through one engine per method, the fp16 cache's
//! log-probabilities computed once per batch of windows and reused for every method; the
//! statistics are the CPU harness's (eval.rs).

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use super::engine::{EngineConfig, GpuEngine, GpuMethod};
use super::model::GpuModel;
use crate::error::Result;
use crate::eval::{argmax, kl_divergence, log_softmax_in_place, NllAccumulator, PplStats, WindowPlan};

/// One method's numbers against the fp16 cache (as `CompareStats`, plus the cache's device
/// bytes per window).
#[derive(Clone, Debug, Default)]
pub struct GpuEvalRow {
    pub stats: PplStats,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub top1_agreement: f64,
}

#[derive(Default)]
struct Acc {
    nll: NllAccumulator,
    kl_sum: f64,
    kl_max: f64,
    agree: usize,
    n: usize,
    seconds: f64,
    resident: usize,
}

impl Acc {
    fn row(&self, plan: &WindowPlan) -> GpuEvalRow {
        let (ppl, err) = self.nll.ppl();
        let n = self.n.max(1) as f64;
        GpuEvalRow {
            stats: PplStats {
                ppl,
                ppl_stderr: err,
                mean_nll: ppl.ln(),
                n_scored: self.n,
                n_windows: plan.n_windows,
                n_ctx: plan.n_ctx,
                seconds: self.seconds,
                tokens_per_s: (plan.n_windows * plan.n_ctx) as f64 / self.seconds.max(1e-9),
                resident_bytes: self.resident,
            },
            kl_mean: self.kl_sum / n,
            kl_max: self.kl_max,
            top1_agreement: self.agree as f64 / n,
        }
    }
}

/// Log-softmax rows `[n_scored][n_vocab]` of each window of `batch`, through `engine`.
fn batch_log_probs(engine: &mut GpuEngine, windows: &[Vec<u32>], plan: &WindowPlan) -> Result<(Vec<Vec<f32>>, usize)> {
    let n_eval = plan.n_ctx - 1;
    let slots: Vec<usize> = windows.iter().map(|_| engine.add_sequence()).collect::<Result<_>>()?;
    let items: Vec<(usize, &[u32], usize)> =
        slots.iter().zip(windows).map(|(&s, w)| (s, &w[..n_eval], plan.first)).collect();
    let out = engine.prefill(&items);
    let resident = slots.iter().filter_map(|&s| engine.cache.slot_bytes(s).ok()).max().unwrap_or(0);
    for s in slots {
        engine.remove_sequence(s)?;
    }
    let mut out = out?;
    let nv = engine.model.config.n_vocab;
    out.par_iter_mut().for_each(|lp| lp.par_chunks_mut(nv).for_each(log_softmax_in_place));
    Ok((out, resident))
}

/// PPL of the fp16 cache and of each method, with KL and top-1 against fp16, on the first
/// `n_windows` windows of `n_ctx` tokens (llama-perplexity's protocol), `batch` windows per
/// prefill. Returns (fp16 row, one row per method).
#[allow(clippy::too_many_arguments)]
pub fn compare_methods_gpu(
    model: &Arc<GpuModel>,
    tokens: &[u32],
    n_ctx: usize,
    n_windows: usize,
    bos: Option<u32>,
    methods: &[GpuMethod],
    batch: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<(GpuEvalRow, Vec<GpuEvalRow>)> {
    let plan = WindowPlan::new(tokens.len(), n_ctx, n_windows)?;
    let batch = batch.clamp(1, plan.n_windows);
    let engine_for = |m: &GpuMethod| -> Result<GpuEngine> {
        let mut cfg = EngineConfig::new(m.clone(), batch, n_ctx);
        cfg.prefill_chunk = n_ctx;
        cfg.prefill_rows = batch * n_ctx;
        cfg.logits_rows = n_ctx;
        GpuEngine::new(model.clone(), cfg)
    };
    let mut reference = engine_for(&GpuMethod::fp16())?;
    let mut engines: Vec<GpuEngine> = methods.iter().map(engine_for).collect::<Result<_>>()?;
    let mut r = Acc::default();
    let mut accs: Vec<Acc> = methods.iter().map(|_| Acc::default()).collect();
    let mut w0 = 0;
    while w0 < plan.n_windows {
        let w1 = (w0 + batch).min(plan.n_windows);
        let windows: Vec<Vec<u32>> = (w0..w1)
            .map(|w| {
                let mut t = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
                if let Some(b) = bos {
                    t[0] = b;
                }
                t
            })
            .collect();
        let targets = |wi: usize, i: usize| tokens[(w0 + wi) * n_ctx + plan.first + i + 1] as usize;
        let t0 = Instant::now();
        let (lr, rr) = batch_log_probs(&mut reference, &windows, &plan)?;
        r.seconds += t0.elapsed().as_secs_f64();
        r.resident = r.resident.max(rr);
        let nv = model.config.n_vocab;
        for (wi, lp) in lr.iter().enumerate() {
            for (i, row) in lp.chunks_exact(nv).enumerate() {
                r.nll.push(-(row[targets(wi, i)] as f64));
                r.n += 1;
            }
        }
        for (e, acc) in engines.iter_mut().zip(accs.iter_mut()) {
            let t0 = Instant::now();
            let (lc, rc) = batch_log_probs(e, &windows, &plan)?;
            acc.seconds += t0.elapsed().as_secs_f64();
            acc.resident = acc.resident.max(rc);
            for (wi, (a_w, b_w)) in lr.iter().zip(&lc).enumerate() {
                let per: Vec<(f64, bool)> = a_w
                    .par_chunks(nv)
                    .zip(b_w.par_chunks(nv))
                    .map(|(a, b)| (kl_divergence(a, b), argmax(a) == argmax(b)))
                    .collect();
                for (i, (row, (kl, same))) in b_w.chunks_exact(nv).zip(per).enumerate() {
                    acc.nll.push(-(row[targets(wi, i)] as f64));
                    acc.kl_sum += kl;
                    acc.kl_max = acc.kl_max.max(kl);
                    acc.agree += usize::from(same);
                    acc.n += 1;
                }
            }
        }
        w0 = w1;
        progress(w0);
    }
    Ok((r.row(&plan), accs.iter().map(|a| a.row(&plan)).collect()))
}
