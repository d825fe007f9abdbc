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
use crate::cache::{PagedCache, StreamStore};
use crate::error::Result;
use crate::format::rows::{RowKind, RowLayout};
use crate::format::QueryState;

/// Pages per work item: large enough to amortize the partial's merge, small enough that a
/// single KV head at 4k tokens still spreads over the threads.
const MIN_PAGES_PER_TASK: usize = 8;

/// q: [n_heads][d] → [n_heads][d]. Softmax scale 1/√d.
pub fn decode_attention(cache: &PagedCache, layer: usize, q: &[f32], n_heads: usize) -> Result<Vec<f32>> {
    let g = check_query(cache, layer, q, n_heads)?;
    let d = cache.config().head_dim;
    let lc = cache.layer(layer)?;
    let scale = 1.0 / (d as f32).sqrt();
    let q_scaled: Vec<f32> = q.iter().map(|v| v * scale).collect();
    let n_kv = lc.keys.len();
    let n_pages = lc.keys[0].pages().len();

    let prepared: Vec<QueryState> =
        (0..n_kv).map(|h| lc.keys[h].format().prepare_query(&q_scaled[h * g * d..(h + 1) * g * d], g)).collect();

    let threads = rayon::current_num_threads().max(1);
    let per_task = MIN_PAGES_PER_TASK.max((n_pages * n_kv).div_ceil(threads * 4));
    let tasks: Vec<(usize, usize, usize)> = (0..n_kv)
        .flat_map(|h| (0..n_pages).step_by(per_task).map(move |p| (h, p, (p + per_task).min(n_pages))))
        .collect();
    let partials: Vec<Partial> =
        tasks.par_iter().map(|&(h, p0, p1)| pages_partial(&lc.keys[h], &lc.values[h], &prepared[h], p0, p1)).collect();

    let mut out = vec![0f32; n_heads * d];
    let mut it = tasks.iter().zip(partials).peekable();
    for h in 0..n_kv {
        let vf = lc.values[h].format();
        let mut acc = Partial::empty(g, vf.acc_width());
        while let Some(((th, _, _), p)) = it.next_if(|((th, _, _), _)| *th == h) {
            debug_assert_eq!(*th, h);
            acc.merge(&p);
        }
        vf.finish(&mut acc.acc, g);
        let mut acc = acc.narrowed(d);
        acc.merge(&tail_partial(&lc.keys[h], &lc.values[h], &q_scaled[h * g * d..(h + 1) * g * d], g));
        acc.output(&mut out[h * g * d..(h + 1) * g * d]);
    }
    Ok(out)
}

fn pages_partial(ks: &StreamStore, vs: &StreamStore, qs: &QueryState, p0: usize, p1: usize) -> Partial {
    let (kf, vf) = (ks.format(), vs.format());
    let (g, t) = (qs.n_q, kf.page_tokens());
    let mut part = Partial::empty(g, vf.acc_width());
    let (mut s, mut w) = (vec![0f32; g * t], vec![0f32; g * t]);
    for p in p0..p1 {
        kf.scores(qs, &ks.pages()[p], &mut s);
        // An open page's unfilled rows are zero bytes (finite); they get weight 0.
        part.absorb_scores(&s, t, ks.rows_in_page(p), &mut w);
        vf.accumulate(&w, g, &vs.pages()[p], &mut part.acc);
    }
    part
}

/// The exact fp16 tokens (sinks, then the tail), scored with the fp16 row kernels.
fn tail_partial(ks: &StreamStore, vs: &StreamStore, q: &[f32], g: usize) -> Partial {
    let d = ks.format().head_dim();
    let mut part = Partial::empty(g, d);
    for (k, v) in [(ks.sink(), vs.sink()), (ks.tail(), vs.tail())] {
        let n = k.len() / d;
        if n == 0 {
            continue;
        }
        let layout = RowLayout::new(RowKind::F16, d, n);
        let (mut s, mut w) = (vec![0f32; g * n], vec![0f32; g * n]);
        layout.scores(q, g, f16_bytes(k), &mut s);
        part.absorb_scores(&s, n, n, &mut w);
        layout.accumulate(&w, g, f16_bytes(v), &mut part.acc);
    }
    part
}

fn f16_bytes(x: &[half::f16]) -> &[u8] {
    // SAFETY: f16 is a 2-byte plain-old-data type with no padding (repr(transparent) over
    // u16); any byte pattern is a valid u8 and the length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}
