//! Fused decode attention on the CPU.
//!
//! Work items are (KV head, run of pages); each scores all G query heads of its group
//! against a page in one pass over the key codes, updates an online-softmax [`Partial`], and
//! accumulates values in the value format's domain. Per KV head the partials merge in page
//! order, the value format finishes once (e.g. one inverse rotation per head), and the
//! exact fp16 tail merges last. Keys and values are never decoded to a tensor.

use rayon::prelude::*;

use super::check_query;
use super::state::Partial;
use crate::cache::{LayerCache, PagedCache, StreamStore};
use crate::error::Result;
use crate::format::rows::{RowKind, RowLayout};
use crate::format::QueryState;

/// Pages per work item: large enough to amortize the partial's merge, small enough that a
/// single KV head at 4k tokens still spreads over the threads.
const MIN_PAGES_PER_TASK: usize = 8;

/// q: `[n_heads][d]` → `[n_heads][d]`. Softmax scale 1/√d.
pub fn decode_attention(cache: &PagedCache, layer: usize, q: &[f32], n_heads: usize) -> Result<Vec<f32>> {
    let g = check_query(cache, layer, q, n_heads)?;
    let lc = cache.layer(layer)?;
    let n_pages = lc.keys[0].pages().len();
    if n_pages * lc.keys.len() >= MIN_PAGES_PER_TASK {
        let plan = Plan::checked(cache, layer, q, g)?;
        let mut out = run_plans(vec![plan]);
        // run_plans returns one output per plan.
        return Ok(out.pop().expect("one output per sequence"));
    }
    // Too few pages to hand out (a short context): one item per KV head, run in place, as
    // the batch path runs them (same bits), without its plans, task lists and a partial per
    // item (~20 allocations per layer and sequence, ~15 % of a short step's attention).
    let d = cache.config().head_dim;
    let q_scaled = scaled(q, d);
    let mut out = vec![0f32; q.len()];
    let mut part = Partial::empty(g, d);
    for (h, (ks, vs)) in lc.keys.iter().zip(&lc.values).enumerate() {
        let qh = &q_scaled[h * g * d..(h + 1) * g * d];
        part.reset(vs.format().acc_width());
        if n_pages > 0 {
            let qs = ks.format().prepare_query(qh, g);
            add_pages(&mut part, ks, vs, &qs, 0, n_pages);
        }
        finish_head(&mut part, ks, vs, qh, &mut out[h * g * d..(h + 1) * g * d]);
    }
    Ok(out)
}

/// One KV head's pages merged in `part`: finish the value format once, fold in the exact
/// fp16 sinks and tail, normalize into `out`.
fn finish_head(part: &mut Partial, ks: &StreamStore, vs: &StreamStore, q: &[f32], out: &mut [f32]) {
    let d = ks.format().head_dim();
    vs.format().finish(&mut part.acc, part.g);
    part.narrow(d);
    absorb_exact(part, ks, vs, q);
    part.output(out);
}

/// q · 1/√d.
fn scaled(q: &[f32], d: usize) -> Vec<f32> {
    let scale = 1.0 / (d as f32).sqrt();
    q.iter().map(|v| v * scale).collect()
}

/// One decode step for a batch of sequences of any lengths (say forks of one prompt): every
/// sequence's (KV head, page run) items run in one parallel pass. Each output equals
/// [`decode_attention`] on that sequence alone, bit for bit.
pub fn decode_attention_batch(seqs: &[(&PagedCache, &[f32])], layer: usize, n_heads: usize) -> Result<Vec<Vec<f32>>> {
    let plans = seqs
        .iter()
        .map(|&(cache, q)| Plan::checked(cache, layer, q, check_query(cache, layer, q, n_heads)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(run_plans(plans))
}

/// The plans' items in one pass (in parallel when there are enough pages), then each
/// sequence's heads combined: one output per plan, in order.
fn run_plans(plans: Vec<Plan<'_>>) -> Vec<Vec<f32>> {
    let tasks: Vec<(usize, usize, usize, usize)> =
        plans.iter().enumerate().flat_map(|(b, p)| p.tasks.iter().map(move |&(h, p0, p1)| (b, h, p0, p1))).collect();
    let run = |&(b, h, p0, p1): &(usize, usize, usize, usize)| {
        let pl = &plans[b];
        pages_partial(&pl.lc.keys[h], &pl.lc.values[h], &pl.prepared[h], p0, p1)
    };
    // Fewer pages than one task's minimum run here: handing them to the pool costs more.
    let n_pages: usize = tasks.iter().map(|t| t.3 - t.2).sum();
    let mut partials: Vec<Partial> = if n_pages < MIN_PAGES_PER_TASK {
        tasks.iter().map(run).collect()
    } else {
        tasks.par_iter().map(run).collect()
    };
    let mut outs = Vec::with_capacity(plans.len());
    for pl in plans.iter().rev() {
        let mine = partials.split_off(partials.len() - pl.tasks.len());
        outs.push(pl.combine(mine));
    }
    outs.reverse();
    outs
}

/// One sequence's share of a decode step: prepared queries and its work items.
struct Plan<'a> {
    lc: &'a LayerCache,
    g: usize,
    d: usize,
    q_scaled: Vec<f32>,
    prepared: Vec<QueryState>,
    /// (KV head, first page, end page), grouped by head in page order.
    tasks: Vec<(usize, usize, usize)>,
}

impl<'a> Plan<'a> {
    /// The plan of a query `check_query` accepted with `g` query heads per KV head.
    fn checked(cache: &'a PagedCache, layer: usize, q: &[f32], g: usize) -> Result<Self> {
        let d = cache.config().head_dim;
        let lc = cache.layer(layer)?;
        let q_scaled = scaled(q, d);
        let n_kv = lc.keys.len();
        let n_pages = lc.keys[0].pages().len();
        // No pages yet (a short sequence): only the exact tokens are read, nothing to prepare.
        let prepared: Vec<QueryState> = if n_pages == 0 {
            Vec::new()
        } else {
            (0..n_kv).map(|h| lc.keys[h].format().prepare_query(&q_scaled[h * g * d..(h + 1) * g * d], g)).collect()
        };
        let threads = rayon::current_num_threads().max(1);
        let per_task = MIN_PAGES_PER_TASK.max((n_pages * n_kv).div_ceil(threads * 4));
        let tasks = (0..n_kv)
            .flat_map(|h| (0..n_pages).step_by(per_task).map(move |p| (h, p, (p + per_task).min(n_pages))))
            .collect();
        Ok(Self { lc, g, d, q_scaled, prepared, tasks })
    }

    /// Per KV head: merge its partials in page order, then [`finish_head`].
    fn combine(&self, partials: Vec<Partial>) -> Vec<f32> {
        let (g, d, lc) = (self.g, self.d, self.lc);
        let mut out = vec![0f32; lc.keys.len() * g * d];
        let mut it = self.tasks.iter().zip(partials).peekable();
        for h in 0..lc.keys.len() {
            let (ks, vs) = (&lc.keys[h], &lc.values[h]);
            // The first partial as it is (merging it into an empty one gives the same bits).
            let mut acc = match it.next_if(|((th, _, _), _)| *th == h) {
                Some((_, p)) => p,
                None => Partial::empty(g, vs.format().acc_width()),
            };
            while let Some((_, p)) = it.next_if(|((th, _, _), _)| *th == h) {
                acc.merge(&p);
            }
            let qh = &self.q_scaled[h * g * d..(h + 1) * g * d];
            finish_head(&mut acc, ks, vs, qh, &mut out[h * g * d..(h + 1) * g * d]);
        }
        out
    }
}

/// Scores and weights of up to this many (query head, key) pairs live on the stack (a page
/// of 32 keys for up to 4 query heads per KV head).
const STACK_SCORES: usize = 128;

/// Runs `f` with two zeroed scratch slices of `n` floats (on the stack when small: a decode
/// step at a short context makes several per layer and sequence).
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    if n <= STACK_SCORES {
        let (mut s, mut w) = ([0f32; STACK_SCORES], [0f32; STACK_SCORES]);
        f(&mut s[..n], &mut w[..n])
    } else {
        f(&mut vec![0f32; n], &mut vec![0f32; n])
    }
}

fn pages_partial(ks: &StreamStore, vs: &StreamStore, qs: &QueryState, p0: usize, p1: usize) -> Partial {
    let mut part = Partial::empty(qs.n_q, vs.format().acc_width());
    add_pages(&mut part, ks, vs, qs, p0, p1);
    part
}

/// Folds pages `p0..p1` of one KV head into `part`.
fn add_pages(part: &mut Partial, ks: &StreamStore, vs: &StreamStore, qs: &QueryState, p0: usize, p1: usize) {
    let (kf, vf) = (ks.format(), vs.format());
    let (g, t) = (qs.n_q, kf.page_tokens());
    with_scratch(g * t, |s, w| {
        for p in p0..p1 {
            // An open page's unfilled rows are neither scored nor accumulated.
            let rows = ks.rows_in_page(p);
            let (s, w) = (&mut s[..g * rows], &mut w[..g * rows]);
            kf.scores_rows(qs, &ks.pages()[p], rows, s);
            part.absorb_scores(s, rows, rows, w);
            vf.accumulate_rows(w, g, &vs.pages()[p], rows, &mut part.acc);
        }
    });
}

/// Folds the exact fp16 tokens (sinks, then the tail) into `part`, scored with the fp16 row
/// kernels.
fn absorb_exact(part: &mut Partial, ks: &StreamStore, vs: &StreamStore, q: &[f32]) {
    let (g, d) = (part.g, ks.format().head_dim());
    for (k, v) in [(ks.sink(), vs.sink()), (ks.tail(), vs.tail())] {
        let n = k.len() / d;
        if n == 0 {
            continue;
        }
        let layout = RowLayout::new(RowKind::F16, d, n);
        with_scratch(g * n, |s, w| {
            layout.scores(q, g, f16_bytes(k), s);
            part.absorb_scores(s, n, n, w);
            layout.accumulate(w, g, f16_bytes(v), &mut part.acc);
        });
    }
}

fn f16_bytes(x: &[half::f16]) -> &[u8] {
    // SAFETY: f16 is a 2-byte plain-old-data type with no padding (repr(transparent) over
    // u16); any byte pattern is a valid u8 and the length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}
