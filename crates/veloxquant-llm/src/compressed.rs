//! The compressed KV store: veloxquant's paged cache behind the model's [`KvStore`] contract.
//!
//! Decode (one new token) runs the core's fused attention on the codes. A prefill or a
//! teacher-forced window attends exactly as token-by-token decode would have: the query at
//! position p sees keys older than its recent window through the codes (what decode would
//! have encoded by then, `paged_tokens(p + 1)`), the rest as the fp16 values the tail held.
//! Queries are grouped by that split point (it moves by T tokens in page mode, by one in
//! row mode).

use half::f16;
use rayon::prelude::*;
use veloxquant::attn::{decode_attention, materialize_pages_into};
use veloxquant::cache::StreamStore;
use veloxquant::{CacheConfig, PagedCache, VqError};

use crate::attention::{causal_attention_mixed, CodedSource};

fn refs(x: &[Vec<f32>]) -> Vec<&[f32]> {
    x.iter().map(|v| v.as_slice()).collect()
}
use crate::error::{LlmError, Result};
use crate::store::KvStore;

fn backend(e: VqError) -> LlmError {
    LlmError::StoreBackend(Box::new(e))
}

/// What the last append brought: per KV head, every position [0, end) whose exact
/// (fp16-rounded) K and V a prefill query may need — the sinks, the tail before the chunk,
/// and the chunk; positions only held as codes stay zero and are never read.
struct Pending {
    layer: usize,
    start: usize,
    /// Tokens held as codes before the chunk (more than the canonical split after a trim).
    coded_before: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

pub struct CompressedStore {
    cache: PagedCache,
    pending: Option<Pending>,
}

impl CompressedStore {
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        Ok(Self { cache: PagedCache::new(cfg).map_err(backend)?, pending: None })
    }

    /// Drop the `n` newest tokens (speculative-decoding rollback); later prefill chunks and
    /// decode steps see exactly what token-by-token decode from the trimmed state would.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        self.pending = None;
        self.cache.trim(n).map_err(backend)
    }

    /// A second sequence sharing this one's pages (e.g. several continuations of a prompt).
    pub fn fork(&self) -> Self {
        Self { cache: self.cache.fork(), pending: None }
    }

    /// A store over an existing cache (e.g. one loaded from a file): decoding continues
    /// from its tokens.
    pub fn from_cache(cache: PagedCache) -> Self {
        Self { cache, pending: None }
    }

    pub fn cache(&self) -> &PagedCache {
        &self.cache
    }
}

/// Tokens held as codes once `n` tokens are appended, starting from `coded_before` (the
/// cache's split when the chunk began): the window rule of `StreamStore::append` — row mode
/// encodes every token older than R, page mode whole pages once R + T tokens are exact. With
/// the canonical split (no trim) this is `PagedCache::paged_tokens(n)`.
fn coded_after(n: usize, sink: usize, recent: usize, t: usize, row_mode: bool, coded_before: usize) -> usize {
    let old = n.saturating_sub(sink);
    let exact = old.saturating_sub(coded_before);
    if row_mode {
        coded_before.max(old.saturating_sub(recent))
    } else if exact >= recent + t {
        coded_before + (exact - recent) / t * t
    } else {
        coded_before
    }
}

fn exact_rows(x: &[f32]) -> impl Iterator<Item = f32> + '_ {
    x.iter().map(|&v| f16::from_f32(v).to_f32())
}

fn f16_rows(x: &[f16]) -> impl Iterator<Item = f32> + '_ {
    x.iter().map(|v| v.to_f32())
}

impl KvStore for CompressedStore {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n_tokens: usize) -> Result<()> {
        if n_tokens == 1 {
            // A decode step's attention reads the cache itself: no chunk to keep.
            self.cache.append(layer, k, v, n_tokens).map_err(backend)?;
            self.pending = None;
            return Ok(());
        }
        let start = self.cache.n_tokens(layer).map_err(backend)?;
        let (h, d) = (self.cache.config().n_kv_heads, self.cache.config().head_dim);
        let end = start + n_tokens;
        // Snapshot the sinks and the tail (exact tokens before this chunk) before appending
        // flushes it; the chunk's own leading tokens complete any unfilled sinks, so the
        // exact rows need nothing from after the append and build while it encodes.
        let lc = self.cache.layer(layer).map_err(backend)?;
        let snap = |s: &StreamStore| (f16_rows(s.sink()).collect::<Vec<f32>>(), f16_rows(s.tail()).collect());
        let before: Vec<(Vec<f32>, Vec<f32>)> = lc.keys.iter().chain(&lc.values).map(snap).collect();
        let coded_before = lc.keys[0].paged_tokens();
        let per = n_tokens * d;
        let chunks: Vec<&[f32]> = k.chunks(per).chain(v.chunks(per)).collect();
        let build = |((sink, tail), chunk): (&(Vec<f32>, Vec<f32>), &&[f32])| {
            let mut e = vec![0f32; end * d];
            e[..sink.len()].copy_from_slice(sink);
            e[(start * d - tail.len())..start * d].copy_from_slice(tail);
            e[start * d..].iter_mut().zip(exact_rows(chunk)).for_each(|(a, b)| *a = b);
            e
        };
        let (appended, mut keys) = rayon::join(
            || self.cache.append(layer, k, v, n_tokens),
            || before.par_iter().zip(&chunks).map(build).collect::<Vec<Vec<f32>>>(),
        );
        appended.map_err(backend)?;
        let values = keys.split_off(h);
        self.pending = Some(Pending { layer, start, coded_before, keys, values });
        Ok(())
    }

    fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
        let d = self.cache.config().head_dim;
        let n_sink = self.cache.config().sink;
        let len = self.cache.n_tokens(layer).map_err(backend)?;
        if n_q == 0 {
            return Ok(Vec::new());
        }
        if n_q == 1 {
            return decode_attention(&self.cache, layer, q, q.len() / d).map_err(backend);
        }
        let p = self
            .pending
            .take()
            .filter(|p| p.layer == layer && len.checked_sub(n_q) == Some(p.start))
            .ok_or_else(|| LlmError::Store("a multi-token attend must follow the append of those tokens".into()))?;
        let lc = self.cache.layer(layer).map_err(backend)?;
        // Decoded codes at their absolute positions [S, S + paged); exact values elsewhere.
        // (No codes yet while the sinks are still filling: len may be below S.)
        let place = |s: &StreamStore| {
            let mut full = vec![0f32; len * d];
            let coded = s.paged_tokens() * d;
            if coded > 0 {
                materialize_pages_into(s, &mut full[n_sink * d..n_sink * d + coded]);
            }
            full
        };
        let (k_dec, v_dec): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            rayon::join(|| lc.keys.par_iter().map(place).collect(), || lc.values.par_iter().map(place).collect());
        // What query position pos sees, as decode would have stored it with pos + 1 tokens:
        // keys [S, S + coded) through the codes, the rest exact.
        let cfg = self.cache.config();
        let (recent, t, row_mode, coded_before) = (cfg.recent, cfg.page_tokens, self.cache.row_mode(), p.coded_before);
        let range = move |pos: usize| match coded_after(pos + 1, n_sink, recent, t, row_mode, coded_before) {
            0 => 0..0, // nothing coded yet: S may lie beyond this query's keys
            c => n_sink..n_sink + c,
        };
        let n_kv = lc.keys.len();
        if !q.len().is_multiple_of(n_q * d) || !(q.len() / (n_q * d)).is_multiple_of(n_kv) || q.is_empty() {
            return Err(LlmError::ShapeMismatch {
                op: "attend: q of whole query heads per KV head",
                expected: n_kv * n_q * d,
                got: q.len(),
            });
        }
        let q_coded = scoring_queries(lc, q, n_q, d);
        let (kd, vd, ke, ve) = (refs(&k_dec), refs(&v_dec), refs(&p.keys), refs(&p.values));
        let coded = CodedSource { keys: &kd, values: &vd, range: &range, query: Some(&q_coded) };
        let out = causal_attention_mixed(q, n_q, &ke, &ve, Some(&coded), len, d)?;
        Ok(out)
    }

    fn len(&self, layer: usize) -> usize {
        self.cache.n_tokens(layer).unwrap_or(0)
    }

    fn resident_bytes(&self) -> usize {
        self.cache.resident_bytes()
    }
}

/// What decode scores the coded keys with, for every query row ([n_heads][n_q][d]): the
/// query scaled by 1/√d through the key format's scoring semantics (rabitq's 4-bit query;
/// the scaled query itself for the others), so prefill describes the estimator that runs.
fn scoring_queries(lc: &veloxquant::cache::LayerCache, q: &[f32], n_q: usize, d: usize) -> Vec<f32> {
    let scale = 1.0 / (d as f32).sqrt();
    let n_heads = q.len() / (n_q * d);
    let group = n_heads / lc.keys.len();
    let mut out = Vec::with_capacity(q.len());
    let mut scaled = vec![0f32; n_q * d];
    for (h, rows) in q.chunks_exact(n_q * d).enumerate() {
        scaled.iter_mut().zip(rows).for_each(|(s, v)| *s = v * scale);
        // Every row at once: the formats' query semantics are per row.
        out.extend(lc.keys[h / group].format().scoring_query_ref(&scaled, n_q));
    }
    out
}

/// Keys and values of the model on `tokens` (one forward pass through an fp16 store that
/// records what it is given), as calibration sets per (layer, KV head, stream) for
/// calibrated formats, plus the second moments E[q qᵀ] of each KV head's queries (formats
/// that weigh key channels by query energy use them). `tokens` must not overlap the text
/// being evaluated.
pub fn calibrate(model: &crate::model::Llama, tokens: &[u32]) -> Result<veloxquant::Calibration> {
    struct Recorder {
        inner: crate::store::Fp16Store,
        seen: Vec<(usize, Vec<f32>, Vec<f32>, usize)>,
        /// Per (layer, KV head): Σ q qᵀ (d × d, f64) and the number of queries.
        moments: std::collections::HashMap<(usize, usize), (Vec<f64>, usize)>,
        heads: (usize, usize, usize),
    }
    impl KvStore for Recorder {
        fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
            self.seen.push((layer, k.to_vec(), v.to_vec(), n));
            self.inner.append(layer, k, v, n)
        }
        fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
            let (n_heads, n_kv, d) = self.heads;
            let g = n_heads / n_kv.max(1);
            for (hq, rows) in q.chunks_exact(n_q * d).enumerate() {
                let (m, count) = self.moments.entry((layer, hq / g)).or_insert_with(|| (vec![0.0; d * d], 0));
                for r in rows.chunks_exact(d) {
                    for (a, &ra) in r.iter().enumerate() {
                        m[a * d..(a + 1) * d].iter_mut().zip(r).for_each(|(x, &rb)| *x += (ra * rb) as f64);
                    }
                }
                *count += n_q;
            }
            self.inner.attend(layer, q, n_q)
        }
        fn len(&self, layer: usize) -> usize {
            self.inner.len(layer)
        }
        fn resident_bytes(&self) -> usize {
            self.inner.resident_bytes()
        }
    }
    let c = &model.config;
    let mut rec = Recorder {
        inner: crate::store::Fp16Store::for_config(c, tokens.len()),
        seen: Vec::new(),
        moments: Default::default(),
        heads: (c.n_heads, c.n_kv_heads, c.head_dim),
    };
    model.forward(tokens, &mut rec, tokens.len().saturating_sub(1))?;
    let mut cal = veloxquant::Calibration::new();
    for (layer, k, v, n) in rec.seen {
        let per = n * c.head_dim;
        for h in 0..c.n_kv_heads {
            cal.insert(layer, h, veloxquant::Stream::Keys, k[h * per..(h + 1) * per].to_vec());
            cal.insert(layer, h, veloxquant::Stream::Values, v[h * per..(h + 1) * per].to_vec());
        }
    }
    for ((layer, h), (m, count)) in rec.moments {
        cal.insert_query_moments(layer, h, m.iter().map(|x| (x / count.max(1) as f64) as f32).collect());
    }
    Ok(cal)
}
