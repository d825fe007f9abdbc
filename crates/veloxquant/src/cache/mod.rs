//! The paged compressed KV cache.
//!
//! Per layer, KV head and stream (K, V): a list of full pages of T tokens in the stream's
//! format, plus an fp16 tail holding the newest tokens. A token is flushed to a page once T
//! tokens are older than the recent window R, so after n tokens the pages hold
//! `paged_tokens(n) = T·⌊max(0, n − R)/T⌋` tokens and the tail the remaining R..R+T−1.
//! Pages are reference-counted so sequences can share them later (fork).

mod stream;

use std::sync::Arc;

pub use stream::StreamStore;

use crate::error::{Result, VqError};
use crate::format::{check_finite, FormatCtx, FormatSpec, Stream};
use crate::rng::derive_seed;

/// One encoded page, shared by reference count.
pub type Page = Arc<[u8]>;

/// Default page size: KIVI-style per-channel groups and GPU tiles both want 32.
pub const DEFAULT_PAGE_TOKENS: usize = 32;

#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per page (T).
    pub page_tokens: usize,
    /// Newest tokens always kept exact in the fp16 tail (R).
    pub recent: usize,
    pub k: FormatSpec,
    pub v: FormatSpec,
    /// Base seed; rotations are derived per (layer, head, stream).
    pub seed: u64,
    /// Encode tokens one at a time when both formats allow it (row mode); false forces
    /// whole-page encoding with an fp16 tail of up to R + T − 1 tokens.
    pub encode_rows: bool,
}

impl CacheConfig {
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize, k: FormatSpec, v: FormatSpec) -> Self {
        Self {
            n_layers,
            n_kv_heads,
            head_dim,
            page_tokens: DEFAULT_PAGE_TOKENS,
            recent: 0,
            k,
            v,
            seed: 0x5EED,
            encode_rows: true,
        }
    }

    /// Tokens held in pages once `n` tokens have been appended (`row_mode`: see
    /// [`PagedCache::row_mode`]).
    pub fn paged_tokens(&self, n: usize, row_mode: bool) -> usize {
        let old = n.saturating_sub(self.recent);
        if row_mode {
            old
        } else {
            old / self.page_tokens * self.page_tokens
        }
    }
}

/// One layer: every KV head's K and V streams.
#[derive(Clone, Debug)]
pub struct LayerCache {
    pub keys: Vec<StreamStore>,
    pub values: Vec<StreamStore>,
    n_tokens: usize,
}

impl LayerCache {
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }
}

#[derive(Clone, Debug)]
pub struct PagedCache {
    cfg: CacheConfig,
    layers: Vec<LayerCache>,
    row_mode: bool,
}

impl PagedCache {
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        if cfg.n_layers == 0 || cfg.n_kv_heads == 0 {
            return Err(VqError::InvalidConfig("n_layers and n_kv_heads must be > 0".into()));
        }
        let build = |spec: &FormatSpec, stream: Stream, l: usize, h: usize| {
            let seed = derive_seed(cfg.seed, &[l as u64, h as u64, stream as u64]);
            spec.build(&FormatCtx { head_dim: cfg.head_dim, page_tokens: cfg.page_tokens, stream, seed })
        };
        // Row mode needs both streams row-granular (their pages must stay aligned).
        let row_mode = cfg.encode_rows
            && build(&cfg.k, Stream::Keys, 0, 0)?.row_granular()
            && build(&cfg.v, Stream::Values, 0, 0)?.row_granular();
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let mk = |spec: &FormatSpec, stream: Stream| -> Result<Vec<StreamStore>> {
                (0..cfg.n_kv_heads)
                    .map(|h| Ok(StreamStore::new(build(spec, stream, l, h)?, cfg.recent, row_mode)))
                    .collect()
            };
            let keys = mk(&cfg.k, Stream::Keys)?;
            let values = mk(&cfg.v, Stream::Values)?;
            layers.push(LayerCache { keys, values, n_tokens: 0 });
        }
        Ok(Self { cfg, layers, row_mode })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Whether tokens are encoded one at a time as they leave the recent window (both
    /// formats row-granular), rather than in whole pages of T.
    pub fn row_mode(&self) -> bool {
        self.row_mode
    }

    /// Tokens held in pages (through the codes) once `n` tokens have been appended.
    pub fn paged_tokens(&self, n: usize) -> usize {
        self.cfg.paged_tokens(n, self.row_mode)
    }

    pub fn layer(&self, layer: usize) -> Result<&LayerCache> {
        self.layers.get(layer).ok_or(VqError::OutOfRange { what: "layer", index: layer, len: self.layers.len() })
    }

    pub fn n_tokens(&self, layer: usize) -> Result<usize> {
        Ok(self.layer(layer)?.n_tokens)
    }

    /// Append `n_tokens` tokens to `layer`: k and v are [n_kv_heads][n_tokens][head_dim].
    /// NaN/Inf are rejected (typed error) before anything is stored.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32], n_tokens: usize) -> Result<()> {
        let (h, d) = (self.cfg.n_kv_heads, self.cfg.head_dim);
        let n_layers = self.layers.len();
        let lc =
            self.layers.get_mut(layer).ok_or(VqError::OutOfRange { what: "layer", index: layer, len: n_layers })?;
        for (x, op) in [(k, "append keys"), (v, "append values")] {
            if x.len() != h * n_tokens * d {
                return Err(VqError::ShapeMismatch { op, expected: h * n_tokens * d, got: x.len() });
            }
        }
        check_finite("appended keys", k, d)?;
        check_finite("appended values", v, d)?;
        let per_head = n_tokens * d;
        for i in 0..h {
            lc.keys[i].append(&k[i * per_head..(i + 1) * per_head])?;
            lc.values[i].append(&v[i * per_head..(i + 1) * per_head])?;
        }
        lc.n_tokens += n_tokens;
        Ok(())
    }

    /// Bytes actually allocated: pages, page table, fp16 tails and per-instance state.
    pub fn resident_bytes(&self) -> usize {
        self.streams().map(StreamStore::resident_bytes).sum()
    }

    fn streams(&self) -> impl Iterator<Item = &StreamStore> {
        self.layers.iter().flat_map(|l| l.keys.iter().chain(&l.values))
    }

    /// Bits per value of the K and V page formats, side information included.
    pub fn bits_per_value(&self) -> (f64, f64) {
        let l = &self.layers[0];
        (l.keys[0].format().bits_per_value(), l.values[0].format().bits_per_value())
    }

    /// Resident bits per stored value for K and V at the current length, counting the fp16
    /// tail and all state (what a user pays at this context).
    pub fn effective_bits(&self) -> (f64, f64) {
        let n: usize = self.layers.iter().map(|l| l.n_tokens).sum::<usize>() * self.cfg.n_kv_heads * self.cfg.head_dim;
        let bits = |f: fn(&LayerCache) -> &Vec<StreamStore>| {
            let b: usize = self.layers.iter().flat_map(|l| f(l).iter()).map(StreamStore::resident_bytes).sum();
            if n == 0 {
                0.0
            } else {
                (b * 8) as f64 / n as f64
            }
        };
        (bits(|l| &l.keys), bits(|l| &l.values))
    }

    /// The shared page buffers (for tests of sharing and of resident accounting).
    pub fn pages(&self, layer: usize, head: usize) -> (&[Page], &[Page]) {
        let l = &self.layers[layer];
        (l.keys[head].pages(), l.values[head].pages())
    }
}

/// Check appended data for NaN/Inf; exposed for stores outside this crate.
pub fn check_kv_finite(k: &[f32], v: &[f32], d: usize) -> Result<()> {
    check_finite("keys", k, d)?;
    check_finite("values", v, d)
}
