//! The compressed KV store: veloxquant's paged cache behind the model's [`KvStore`] contract.
//!
//! Decode (one new token) runs the core's fused attention on the codes. A prefill or a
//! teacher-forced window attends exactly as token-by-token decode would have: the query at
//! position p sees keys older than its recent window through the codes (what decode would
//! have encoded by then, `paged_tokens(p + 1)`), the rest as the fp16 values the tail held.
//! Queries are grouped by that split point (it moves by T tokens in page mode, by one in
//! row mode).

use half::f16;
use veloxquant::attn::{decode_attention, materialize_pages};
use veloxquant::cache::StreamStore;
use veloxquant::{CacheConfig, PagedCache, VqError};

use crate::attention::causal_attention_f32;
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

    pub fn cache(&self) -> &PagedCache {
        &self.cache
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
        let start = self.cache.n_tokens(layer).map_err(backend)?;
        let (h, d) = (self.cache.config().n_kv_heads, self.cache.config().head_dim);
        let end = start + n_tokens;
        // Snapshot the tail (exact tokens before this chunk) before appending flushes it.
        let lc = self.cache.layer(layer).map_err(backend)?;
        let snap = |s: &StreamStore| f16_rows(s.tail()).collect::<Vec<f32>>();
        let (k_tail, v_tail): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            (lc.keys.iter().map(snap).collect(), lc.values.iter().map(snap).collect());
        self.cache.append(layer, k, v, n_tokens).map_err(backend)?;
        if n_tokens == 1 {
            self.pending = None;
            return Ok(());
        }
        let lc = self.cache.layer(layer).map_err(backend)?;
        let per = n_tokens * d;
        let build = |tail: &[f32], sink: &[f16], chunk: &[f32]| {
            let mut e = vec![0f32; end * d];
            e[(start * d - tail.len())..start * d].copy_from_slice(tail);
            e.iter_mut().zip(f16_rows(sink)).for_each(|(a, b)| *a = b);
            e[start * d..].iter_mut().zip(exact_rows(chunk)).for_each(|(a, b)| *a = b);
            e
        };
        let keys = (0..h).map(|i| build(&k_tail[i], lc.keys[i].sink(), &k[i * per..(i + 1) * per])).collect();
        let values = (0..h).map(|i| build(&v_tail[i], lc.values[i].sink(), &v[i * per..(i + 1) * per])).collect();
        self.pending = Some(Pending { layer, start, keys, values });
        Ok(())
    }

    fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
        let d = self.cache.config().head_dim;
        let n_sink = self.cache.config().sink;
        let len = self.cache.n_tokens(layer).map_err(backend)?;
        if n_q == 1 {
            return decode_attention(&self.cache, layer, q, q.len() / d).map_err(backend);
        }
        let p = self
            .pending
            .take()
            .filter(|p| p.layer == layer && len - n_q == p.start)
            .ok_or_else(|| LlmError::Store("a multi-token attend must follow the append of those tokens".into()))?;
        let n_heads = q.len() / (n_q * d);
        let lc = self.cache.layer(layer).map_err(backend)?;
        // Decode every page once (reference decoder): [kv head] → [paged tokens][d].
        let k_dec: Vec<Vec<f32>> = lc.keys.iter().map(materialize_pages).collect();
        let v_dec: Vec<Vec<f32>> = lc.values.iter().map(materialize_pages).collect();
        // What query position pos sees, as decode would have stored it with pos + 1 tokens:
        // exact sinks, then the coded run, then exact tokens. None: everything exact.
        let split = |pos: usize| (pos + 1 > n_sink).then(|| self.cache.paged_tokens(pos + 1));
        let width = n_heads * d;
        let mut out = vec![0f32; n_q * width];
        let mut i = 0;
        while i < n_q {
            let coded = split(p.start + i);
            let mut j = i + 1;
            while j < n_q && split(p.start + j) == coded {
                j += 1;
            }
            let end = p.start + j; // keys visible to the last query of the group
            let eff = |dec: &[Vec<f32>], exact: &[Vec<f32>]| -> Vec<Vec<f32>> {
                dec.iter()
                    .zip(exact)
                    .map(|(dk, ek)| match coded {
                        None => ek[..end * d].to_vec(),
                        Some(n_coded) => {
                            let mut e = ek[..n_sink * d].to_vec();
                            e.extend_from_slice(&dk[..n_coded * d]);
                            e.extend_from_slice(&ek[(n_sink + n_coded) * d..end * d]);
                            e
                        }
                    })
                    .collect()
            };
            let (ke, ve) = (eff(&k_dec, &p.keys), eff(&v_dec, &p.values));
            let rows = j - i;
            let qg: Vec<f32> =
                (0..n_heads).flat_map(|h| q[(h * n_q + i) * d..(h * n_q + j) * d].iter().copied()).collect();
            let kr: Vec<&[f32]> = ke.iter().map(|x| x.as_slice()).collect();
            let vr: Vec<&[f32]> = ve.iter().map(|x| x.as_slice()).collect();
            let part = causal_attention_f32(&qg, rows, &kr, &vr, end, d)?;
            out[i * width..j * width].copy_from_slice(&part);
            i = j;
        }
        Ok(out)
    }

    fn len(&self, layer: usize) -> usize {
        self.cache.n_tokens(layer).unwrap_or(0)
    }

    fn resident_bytes(&self) -> usize {
        self.cache.resident_bytes()
    }
}

/// Keys and values of the model on `tokens` (one forward pass through an fp16 store that
/// records what it is given), as calibration sets per (layer, KV head, stream) for
/// calibrated formats. `tokens` must not overlap the text being evaluated.
pub fn calibrate(model: &crate::model::Llama, tokens: &[u32]) -> Result<veloxquant::Calibration> {
    struct Recorder {
        inner: crate::store::Fp16Store,
        seen: Vec<(usize, Vec<f32>, Vec<f32>, usize)>,
    }
    impl KvStore for Recorder {
        fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n: usize) -> Result<()> {
            self.seen.push((layer, k.to_vec(), v.to_vec(), n));
            self.inner.append(layer, k, v, n)
        }
        fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
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
    let mut rec = Recorder { inner: crate::store::Fp16Store::for_config(c, tokens.len()), seen: Vec::new() };
    model.forward(tokens, &mut rec, tokens.len().saturating_sub(1))?;
    let mut cal = veloxquant::Calibration::new();
    for (layer, k, v, n) in rec.seen {
        let per = n * c.head_dim;
        for h in 0..c.n_kv_heads {
            cal.insert(layer, h, veloxquant::Stream::Keys, k[h * per..(h + 1) * per].to_vec());
            cal.insert(layer, h, veloxquant::Stream::Values, v[h * per..(h + 1) * per].to_vec());
        }
    }
    Ok(cal)
}
