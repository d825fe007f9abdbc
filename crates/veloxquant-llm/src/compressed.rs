//! The compressed KV store: veloxquant's paged cache behind the model's [`KvStore`] contract.
//!
//! Decode (one new token) runs the core's fused attention on the codes. A prefill or a
//! teacher-forced window attends exactly as token-by-token decode would have: the query at
//! position p sees keys older than its recent window through the codes (what decode would
//! have encoded by then, `paged_tokens(p + 1)`), the rest as the fp16 values the tail held.
//! Queries are grouped by that split point (it moves by T tokens in page mode, by one in
//! row mode).

use half::f16;
use veloxquant::attn::decode_attention;
use veloxquant::{CacheConfig, PagedCache, VqError};

use crate::attention::causal_attention_f32;
use crate::error::{LlmError, Result};
use crate::store::KvStore;

fn backend(e: VqError) -> LlmError {
    LlmError::StoreBackend(Box::new(e))
}

/// What the last append brought: per KV head, the exact (fp16-rounded) K and V of tokens
/// [paged_tokens(start), end), which a prefill's queries may need beyond the tail.
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

    fn exact_rows(x: &[f32]) -> impl Iterator<Item = f32> + '_ {
        x.iter().map(|&v| f16::from_f32(v).to_f32())
    }
}

impl KvStore for CompressedStore {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n_tokens: usize) -> Result<()> {
        let start = self.cache.n_tokens(layer).map_err(backend)?;
        let (h, d) = (self.cache.config().n_kv_heads, self.cache.config().head_dim);
        // Snapshot the tail (exact tokens before this chunk) before appending flushes it.
        let lc = self.cache.layer(layer).map_err(backend)?;
        let tail = |s: &veloxquant::cache::StreamStore| s.tail().iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let mut keys: Vec<Vec<f32>> = lc.keys.iter().map(tail).collect();
        let mut values: Vec<Vec<f32>> = lc.values.iter().map(tail).collect();
        self.cache.append(layer, k, v, n_tokens).map_err(backend)?;
        if n_tokens > 1 {
            let per = n_tokens * d;
            for i in 0..h {
                keys[i].extend(Self::exact_rows(&k[i * per..(i + 1) * per]));
                values[i].extend(Self::exact_rows(&v[i * per..(i + 1) * per]));
            }
            self.pending = Some(Pending { layer, start, keys, values });
        } else {
            self.pending = None;
        }
        Ok(())
    }

    fn attend(&mut self, layer: usize, q: &[f32], n_q: usize) -> Result<Vec<f32>> {
        let cfg = self.cache.config().clone();
        let d = cfg.head_dim;
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
        let decode = |s: &veloxquant::cache::StreamStore| veloxquant::attn::materialize_pages(s);
        let k_dec: Vec<Vec<f32>> = lc.keys.iter().map(decode).collect();
        let v_dec: Vec<Vec<f32>> = lc.values.iter().map(decode).collect();
        let exact_from = self.cache.paged_tokens(p.start);
        let width = n_heads * d;
        let mut out = vec![0f32; n_q * width];
        let mut i = 0;
        while i < n_q {
            let pos = p.start + i;
            let split = self.cache.paged_tokens(pos + 1);
            // Queries sharing this split point: up to the position where it next moves.
            let mut j = i + 1;
            while j < n_q && self.cache.paged_tokens(p.start + j + 1) == split {
                j += 1;
            }
            let end = p.start + j; // keys visible to the last query of the group
            let eff = |dec: &[Vec<f32>], exact: &[Vec<f32>]| -> Vec<Vec<f32>> {
                dec.iter()
                    .zip(exact)
                    .map(|(dk, ek)| {
                        let mut e = dk[..split * d].to_vec();
                        e.extend_from_slice(&ek[(split - exact_from) * d..(end - exact_from) * d]);
                        e
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
