//! Reference decode attention: decode every page to f32 with the format's reference
//! decoder, append the fp16 tail, then dense softmax attention in f64.

use super::check_query;
use crate::cache::{PagedCache, StreamStore};
use crate::error::Result;
use rayon::prelude::*;

/// Every page of one stream decoded by the format's reference decoder: paged tokens × d
/// (an open page contributes only its filled rows).
pub fn materialize_pages(s: &StreamStore) -> Vec<f32> {
    let mut out = vec![0f32; s.paged_tokens() * s.format().head_dim()];
    decode_pages(s, &mut out, false, |p, o| s.format().decode_page(p, o));
    out
}

/// [`materialize_pages`]' values into `out` (exactly paged tokens × d), through
/// [`Format::decode_page_fast`](crate::Format::decode_page_fast) and in parallel where
/// there are several pages: a prefill decodes a whole stream per layer.
pub fn materialize_pages_into(s: &StreamStore, out: &mut [f32]) {
    assert_eq!(out.len(), s.paged_tokens() * s.format().head_dim(), "materialize_pages_into: output size");
    let parallel = s.pages().len() >= PAR_MIN_PAGES;
    decode_pages(s, out, parallel, |p, o| s.format().decode_page_fast(p, o));
}

/// Streams of fewer pages decode on the calling thread (less work than handing it out).
const PAR_MIN_PAGES: usize = 8;

fn decode_pages(s: &StreamStore, out: &mut [f32], parallel: bool, decode: impl Fn(&[u8], &mut [f32]) + Sync) {
    let per_page = s.format().page_tokens() * s.format().head_dim();
    let one = |(p, o): (&crate::cache::Page, &mut [f32])| {
        if o.len() == per_page {
            decode(p, o);
        } else {
            // The open page: decode whole, keep its filled rows.
            let mut full = vec![0f32; per_page];
            decode(p, &mut full);
            o.copy_from_slice(&full[..o.len()]);
        }
    };
    if parallel {
        s.pages().par_iter().zip(out.par_chunks_mut(per_page)).for_each(one);
    } else {
        s.pages().iter().zip(out.chunks_mut(per_page)).for_each(one);
    }
}

/// All keys (or values) of one stream as n × d f32 in sequence order: sinks, pages, tail.
pub fn materialize(s: &StreamStore) -> Vec<f32> {
    let mut out: Vec<f32> = s.sink().iter().map(|v| v.to_f32()).collect();
    out.extend(materialize_pages(s));
    out.extend(s.tail().iter().map(|v| v.to_f32()));
    out
}

/// q: `[n_heads][d]` → `[n_heads][d]`. Softmax scale 1/√d.
pub fn decode_attention_ref(cache: &PagedCache, layer: usize, q: &[f32], n_heads: usize) -> Result<Vec<f32>> {
    let g = check_query(cache, layer, q, n_heads)?;
    let d = cache.config().head_dim;
    let lc = cache.layer(layer)?;
    // The same scaled query as the fused path, through the key format's scoring semantics
    // (identity except for formats that quantize the query, e.g. rabitq); the fp16 tail
    // is scored with the plain scaled query.
    let scale = 1.0 / (d as f32).sqrt();
    let q: Vec<f32> = q.iter().map(|v| v * scale).collect();
    let mut out = vec![0f32; n_heads * d];
    for (kvh, (ks, vs)) in lc.keys.iter().zip(&lc.values).enumerate() {
        let (k, v) = (materialize(ks), materialize(vs));
        let n = k.len() / d;
        // Keys scored through the format: positions [sinks, sinks + paged).
        let n_sink = ks.sink().len() / d;
        let n_paged = ks.paged_tokens();
        let q_group = &q[kvh * g * d..(kvh + 1) * g * d];
        let q_paged = ks.format().scoring_query_ref(q_group, g);
        for h in 0..g {
            let s: Vec<f64> = (0..n)
                .map(|t| {
                    let qh = if (n_sink..n_sink + n_paged).contains(&t) { &q_paged[..] } else { q_group };
                    qh[h * d..(h + 1) * d]
                        .iter()
                        .zip(&k[t * d..(t + 1) * d])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = w.iter().sum();
            for j in 0..d {
                let acc: f64 = (0..n).map(|t| w[t] * v[t * d + j] as f64).sum();
                out[(kvh * g + h) * d + j] = (acc / l) as f32;
            }
        }
    }
    Ok(out)
}
