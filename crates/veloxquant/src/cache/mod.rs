//! The paged compressed KV cache.
//!
//! Per layer, KV head and stream (K, V): a list of full pages of T tokens in the stream's
//! format, plus an fp16 tail holding the newest tokens. A token is flushed to a page once T
//! tokens are older than the recent window R, so after n tokens the pages hold
//! `paged_tokens(n) = T·⌊max(0, n − R)/T⌋` tokens and the tail the remaining R..R+T−1 —
//! or, in row mode (per-token formats), n − R tokens and exactly R in the tail.
//! Pages are reference-counted so sequences can share them later (fork).

mod persist;
mod stream;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub use persist::{is_cache_file, LoadCheck, SaveInfo, FILE_VERSION, FILE_VERSIONS_READ};
pub use stream::{StreamStore, MAX_WINDOW_TOKENS};

use crate::error::{Result, VqError};
use crate::format::{check_finite, FormatCtx, FormatSpec, Stream};
use crate::rng::derive_seed;

/// One encoded page, shared by reference count.
pub type Page = Arc<[u8]>;

/// Default page size: KIVI-style per-channel groups and GPU tiles both want 32.
pub const DEFAULT_PAGE_TOKENS: usize = 32;
/// Bounds [`CacheConfig::validate`] enforces (far above any real model), so a config never
/// builds millions of format instances.
pub const MAX_LAYERS: usize = 1 << 12;
pub const MAX_HEADS: usize = 1 << 10;

#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per page (T).
    pub page_tokens: usize,
    /// Newest tokens always kept exact in the fp16 tail (R).
    pub recent: usize,
    /// The K and V formats of every layer without an entry in `layers`.
    pub k: FormatSpec,
    pub v: FormatSpec,
    /// Per-layer K and V formats (one entry per layer), overriding `k` / `v`; `None`: every
    /// layer uses `k` / `v`. Code that needs a layer's format asks [`CacheConfig::spec`].
    pub layers: Option<Vec<LayerSpec>>,
    /// Base seed; rotations are derived per (layer, head, stream).
    pub seed: u64,
    /// Calibration vectors for calibrated formats (vecinfer); `None` for the others.
    pub calibration: Option<Arc<Calibration>>,
    /// Encode tokens one at a time when both formats allow it (row mode); false forces
    /// whole-page encoding with an fp16 tail of up to R + T − 1 tokens.
    pub encode_rows: bool,
    /// The first S tokens stay exact in fp16 (attention sinks, StreamingLLM, arXiv
    /// 2309.17453): models put large attention weight on them, so their keys' quantization
    /// error costs more than S·16 bits buy elsewhere.
    pub sink: usize,
}

/// One layer's K and V formats (per-layer configurations, e.g. from an allocator).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub k: FormatSpec,
    pub v: FormatSpec,
}

impl LayerSpec {
    pub fn new(k: FormatSpec, v: FormatSpec) -> Self {
        Self { k, v }
    }

    pub fn get(&self, stream: Stream) -> &FormatSpec {
        match stream {
            Stream::Keys => &self.k,
            Stream::Values => &self.v,
        }
    }
}

/// Calibration vectors for calibrated formats, per (layer, KV head, stream): each set is
/// `n × head_dim` f32 (e.g. keys of the model on calibration text, which must not be the
/// evaluation text). A set given for a whole stream serves every (layer, head) that has no
/// set of its own. The cache hands each format instance its set through
/// [`FormatCtx::calibration`]; training happens once, when the cache is built.
/// (Some((layer, head)) or None for "every head", stream).
type CalibKey = (Option<(usize, usize)>, Stream);

#[derive(Clone, Debug, Default)]
pub struct Calibration {
    sets: HashMap<CalibKey, Arc<[f32]>>,
    /// E[q qᵀ] (d × d) per (layer, KV head) of the queries of its group.
    query_moments: HashMap<(usize, usize), Arc<[f32]>>,
}

impl Calibration {
    pub fn new() -> Self {
        Self::default()
    }

    /// Vectors for one (layer, KV head, stream).
    pub fn insert(&mut self, layer: usize, head: usize, stream: Stream, vectors: Vec<f32>) {
        self.sets.insert((Some((layer, head)), stream), vectors.into());
    }

    /// Vectors for every (layer, head) of a stream without a set of its own.
    pub fn insert_for_all(&mut self, stream: Stream, vectors: Vec<f32>) {
        self.sets.insert((None, stream), vectors.into());
    }

    pub fn get(&self, layer: usize, head: usize, stream: Stream) -> Option<Arc<[f32]>> {
        self.sets.get(&(Some((layer, head)), stream)).or_else(|| self.sets.get(&(None, stream))).cloned()
    }

    /// Second moments E[q qᵀ] (d × d, row-major) of the queries that score (layer, KV head).
    pub fn insert_query_moments(&mut self, layer: usize, head: usize, moments: Vec<f32>) {
        self.query_moments.insert((layer, head), moments.into());
    }

    pub fn query_moments(&self, layer: usize, head: usize) -> Option<Arc<[f32]>> {
        self.query_moments.get(&(layer, head)).cloned()
    }
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
            layers: None,
            seed: 0x5EED,
            calibration: None,
            encode_rows: true,
            sink: 0,
        }
    }

    /// Checks the sizes against their bounds before anything is built: layers, KV heads, R
    /// and S (head and page sizes are checked by [`FormatSpec::build`]).
    pub fn validate(&self) -> Result<()> {
        let bad =
            |what: &str, v: usize, max: usize| Err(VqError::InvalidConfig(format!("{what} = {v} not in 1..={max}")));
        if !(1..=MAX_LAYERS).contains(&self.n_layers) {
            return bad("n_layers", self.n_layers, MAX_LAYERS);
        }
        if !(1..=MAX_HEADS).contains(&self.n_kv_heads) {
            return bad("n_kv_heads", self.n_kv_heads, MAX_HEADS);
        }
        if let Some(ls) = &self.layers {
            if ls.len() != self.n_layers {
                return Err(VqError::InvalidConfig(format!(
                    "{} per-layer specs for {} layers",
                    ls.len(),
                    self.n_layers
                )));
            }
        }
        stream::check_window(self.recent, self.sink)
    }

    /// The format of `stream` in `layer`: its per-layer entry when `layers` is set, else
    /// `k` / `v` (also for a layer index past the list, which [`PagedCache::new`] rejects).
    pub fn spec(&self, layer: usize, stream: Stream) -> &FormatSpec {
        match self.layers.as_ref().and_then(|l| l.get(layer)) {
            Some(ls) => ls.get(stream),
            None => match stream {
                Stream::Keys => &self.k,
                Stream::Values => &self.v,
            },
        }
    }

    /// Whether every layer uses `k` / `v` (no per-layer entry differs from them).
    pub fn is_uniform(&self) -> bool {
        self.layers.as_ref().is_none_or(|ls| ls.iter().all(|l| l.k == self.k && l.v == self.v))
    }

    /// Tokens held in pages once `n` tokens have been appended (`row_mode`: see
    /// [`PagedCache::row_mode`]); they are positions [S, S + paged) after the S sinks.
    pub fn paged_tokens(&self, n: usize, row_mode: bool) -> usize {
        let old = n.saturating_sub(self.sink).saturating_sub(self.recent);
        if row_mode {
            old
        } else {
            old / self.page_tokens * self.page_tokens
        }
    }
}

/// One layer's format instances: (K per head, V per head).
type FormatPair = (Vec<Arc<dyn crate::Format>>, Vec<Arc<dyn crate::Format>>);

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

/// What fixes an uncalibrated format instance: its spec and context.
type FormatKey = (String, usize, usize, u8, u64);

/// The live uncalibrated format instances, by what they were built from.
static SHARED_FORMATS: std::sync::Mutex<Option<HashMap<FormatKey, std::sync::Weak<dyn crate::Format>>>> =
    std::sync::Mutex::new(None);

/// `spec.build(ctx)`, shared with every live cache that built the same instance: a format
/// is immutable once built and determined by its spec and context unless it is calibrated
/// or restored from saved state, so caches of one configuration (a server's sequences) hold
/// one copy of each rotation and codebook instead of one per sequence — fewer bytes, and
/// fewer cold cache lines per decode step.
fn shared_format(spec: &FormatSpec, ctx: &FormatCtx) -> Result<Arc<dyn crate::Format>> {
    if ctx.calibration.is_some() || ctx.query_moments.is_some() || ctx.state.is_some() {
        return spec.build(ctx);
    }
    let key = (format!("{spec:?}"), ctx.head_dim, ctx.page_tokens, ctx.stream as u8, ctx.seed);
    let mut guard = SHARED_FORMATS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(f) = map.get(&key).and_then(std::sync::Weak::upgrade) {
        return Ok(f);
    }
    let f = spec.build(ctx)?;
    // Entries of dropped instances go when the map would double (amortized O(1) per build).
    if map.len() >= 1024 && map.len().is_power_of_two() {
        map.retain(|_, w| w.strong_count() > 0);
    }
    map.insert(key, Arc::downgrade(&f));
    Ok(f)
}

impl PagedCache {
    pub fn new(cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let built = Self::build_formats(&cfg, |_, _, _| None)?;
        let row_mode = Self::row_mode_of(&cfg, &built);
        let wrap = |fs: Vec<Arc<dyn crate::Format>>| -> Result<Vec<StreamStore>> {
            fs.into_iter().map(|f| StreamStore::new(f, cfg.recent, row_mode, cfg.sink)).collect()
        };
        let layers = built
            .into_iter()
            .map(|(k, v)| Ok(LayerCache { keys: wrap(k)?, values: wrap(v)?, n_tokens: 0 }))
            .collect::<Result<_>>()?;
        Ok(Self { cfg, layers, row_mode })
    }

    /// Every format instance, per layer (K heads, V heads); calibrated ones train here, once
    /// each, unless `state` returns their saved state.
    fn build_formats(
        cfg: &CacheConfig,
        state: impl Fn(usize, usize, Stream) -> Option<Arc<[f32]>>,
    ) -> Result<Vec<FormatPair>> {
        let mut built = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let mk = |spec: &FormatSpec, stream: Stream| -> Result<Vec<Arc<dyn crate::Format>>> {
                (0..cfg.n_kv_heads)
                    .map(|h| {
                        let seed = derive_seed(cfg.seed, &[l as u64, h as u64, stream as u64]);
                        let mut ctx = FormatCtx::new(cfg.head_dim, cfg.page_tokens, stream, seed);
                        ctx.calibration = cfg.calibration.as_ref().and_then(|c| c.get(l, h, stream));
                        ctx.query_moments = cfg.calibration.as_ref().and_then(|c| c.query_moments(l, h));
                        ctx.state = state(l, h, stream);
                        shared_format(spec, &ctx)
                    })
                    .collect()
            };
            built
                .push((mk(cfg.spec(l, Stream::Keys), Stream::Keys)?, mk(cfg.spec(l, Stream::Values), Stream::Values)?));
        }
        Ok(built)
    }

    /// Row mode needs both streams of every layer row-granular (their pages must stay
    /// aligned, and the mode is one for the cache).
    fn row_mode_of(cfg: &CacheConfig, built: &[FormatPair]) -> bool {
        cfg.encode_rows && built.iter().all(|(k, v)| k[0].row_granular() && v[0].row_granular())
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

    /// Append `n_tokens` tokens to `layer`: k and v are `[n_kv_heads][n_tokens][head_dim]`.
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

    /// Drop the `n` newest tokens of every layer (speculative-decoding rollback, reuse of a
    /// prompt prefix). Checked for every layer before anything changes. Surviving tokens keep
    /// their stored form, so attention over them is unchanged (see [`StreamStore`]'s trim for
    /// the one page-mode exception); pages shared with a fork are never written.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        for (layer, lc) in self.layers.iter().enumerate() {
            if n > lc.n_tokens {
                return Err(VqError::TrimTooFar { layer, requested: n, held: lc.n_tokens });
            }
        }
        for lc in &mut self.layers {
            for s in lc.keys.iter_mut().chain(lc.values.iter_mut()) {
                s.trim(n)?;
            }
            lc.n_tokens -= n;
        }
        Ok(())
    }

    /// A second sequence with the same contents that shares every page (reference counts,
    /// no copy); pages are copied only where one of the two would write into a shared page
    /// (the open page in row mode). fp16 tails and sinks are small and copied.
    pub fn fork(&self) -> Self {
        self.clone()
    }

    /// Bytes in use: pages, page-table entries, the fp16 tail and sink tokens held, and
    /// per-instance state (growth slack of buffers not counted).
    pub fn resident_bytes(&self) -> usize {
        self.streams().map(StreamStore::resident_bytes).sum()
    }

    /// Bytes allocated by several caches together, counting pages and format state shared
    /// between forks once: what a server holding these sequences pays.
    pub fn resident_bytes_shared(caches: &[&PagedCache]) -> usize {
        let mut pages = HashSet::new();
        let mut formats = HashSet::new();
        let mut total = 0;
        for s in caches.iter().flat_map(|c| c.streams()) {
            total += s.resident_bytes();
            for (ptr, len) in s.page_ptrs() {
                if !pages.insert(ptr) {
                    total -= len + stream::ARC_HEADER;
                }
            }
            if !formats.insert(Arc::as_ptr(s.format_arc()).cast::<()>()) {
                total -= s.format().state_bytes();
            }
        }
        total
    }

    fn streams(&self) -> impl Iterator<Item = &StreamStore> {
        self.layers.iter().flat_map(|l| l.keys.iter().chain(&l.values))
    }

    /// Bits per value of the K and V page formats, side information included (averaged over
    /// layers when they differ).
    pub fn bits_per_value(&self) -> (f64, f64) {
        let n = self.layers.len() as f64;
        let mean = |f: fn(&LayerCache) -> &StreamStore| {
            self.layers.iter().map(|l| f(l).format().bits_per_value()).sum::<f64>() / n
        };
        (mean(|l| &l.keys[0]), mean(|l| &l.values[0]))
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

/// One stream of one (layer, KV head) as a cache holds it: what moves a sequence between
/// devices (a GPU cache downloads into these, `PagedCache::from_contents` rebuilds the CPU
/// cache, and `contents` goes the other way).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamContents {
    /// Pages in order, `page_bytes` each; the open page's unwritten rows zero.
    pub pages: Vec<Vec<u8>>,
    /// Rows of the open last page (row mode), 0 when every page is full.
    pub open_rows: usize,
    /// The fp16 window, oldest token first.
    pub tail: Vec<half::f16>,
    /// The sink tokens held so far.
    pub sink: Vec<half::f16>,
}

/// Per layer, per KV head: (keys, values).
pub type CacheContents = Vec<Vec<(StreamContents, StreamContents)>>;

impl PagedCache {
    /// A cache holding `contents` (as `contents()` returns them), checked like a loaded file:
    /// page sizes, window and sink sizes, the same token count in every stream. Calibrated
    /// formats train from `cfg.calibration` as `new` does.
    pub fn from_contents(cfg: CacheConfig, contents: CacheContents) -> Result<Self> {
        let built = Self::build_formats(&cfg, |_, _, _| None)?;
        let row_mode = Self::row_mode_of(&cfg, &built);
        if contents.len() != cfg.n_layers || contents.iter().any(|l| l.len() != cfg.n_kv_heads) {
            return Err(VqError::InvalidConfig(format!(
                "contents for {} layers × {} heads expected",
                cfg.n_layers, cfg.n_kv_heads
            )));
        }
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for ((kf, vf), heads) in built.into_iter().zip(contents) {
            let mut keys = Vec::with_capacity(cfg.n_kv_heads);
            let mut values = Vec::with_capacity(cfg.n_kv_heads);
            for ((k, v), (fk, fv)) in heads.into_iter().zip(kf.into_iter().zip(vf)) {
                for (c, f, out) in [(k, fk, &mut keys), (v, fv, &mut values)] {
                    let parts = stream::StreamParts {
                        pages: c.pages.into_iter().map(Page::from).collect(),
                        open_rows: c.open_rows,
                        tail: c.tail,
                        sink: c.sink,
                    };
                    out.push(StreamStore::from_parts(f, cfg.recent, row_mode, cfg.sink, parts)?);
                }
            }
            let n_tokens = keys[0].n_tokens();
            if keys.iter().chain(&values).any(|s| s.n_tokens() != n_tokens) {
                return Err(VqError::FileCorrupt("streams of a layer hold different token counts".into()));
            }
            layers.push(LayerCache { keys, values, n_tokens });
        }
        let n0 = layers[0].n_tokens;
        if layers.iter().any(|l| l.n_tokens != n0) {
            return Err(VqError::FileCorrupt("layers hold different token counts".into()));
        }
        Ok(Self { cfg, layers, row_mode })
    }

    /// Every stream's contents, `[layer][head]` × (K, V) (the open page's stale rows zeroed).
    pub fn contents(&self) -> CacheContents {
        let one = |s: &StreamStore| {
            let f = s.format();
            let mut pages: Vec<Vec<u8>> = s.pages().iter().map(|p| p.to_vec()).collect();
            if s.open_rows() > 0 {
                if let Some(last) = pages.last_mut() {
                    f.clear_rows_from(last, s.open_rows());
                }
            }
            StreamContents { pages, open_rows: s.open_rows(), tail: s.tail().to_vec(), sink: s.sink().to_vec() }
        };
        self.layers.iter().map(|l| l.keys.iter().zip(&l.values).map(|(k, v)| (one(k), one(v))).collect()).collect()
    }
}

/// Check appended data for NaN/Inf; exposed for stores outside this crate.
pub fn check_kv_finite(k: &[f32], v: &[f32], d: usize) -> Result<()> {
    check_finite("keys", k, d)?;
    check_finite("values", v, d)
}
