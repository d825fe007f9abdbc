//! What the scheduler drives: an [`Engine`] holds sequences (each a KV cache) and runs one
//! batched forward per step. The CPU engine is the candle model over `CompressedStore`s;
//! the GPU engine (feature `cuda`, `gpu_engine.rs`) is `veloxquant_llm::gpu::GpuEngine`.
//! The scheduler is the same for both.

use std::sync::Arc;

use veloxquant::{CacheConfig, PagedCache};
use veloxquant_llm::{BatchItem, BatchStore, CompressedStore, KvStore, Llama};

use crate::error::{Result, ServeError};

/// A sequence inside an engine.
pub type SeqId = usize;

/// One sequence's new tokens in a step, and what it needs back for its last position.
#[derive(Clone, Copy, Debug)]
pub struct Work<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub want: Want,
}

/// What a work item needs back for its last position (`Nothing`: a prefill chunk that does
/// not end the prompt; `Sample`: the GPU engine samples on the device).
pub use veloxquant_llm::sample::NextToken as Want;

/// The chosen token for one work item's last position (`None` for `Want::Nothing`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Out {
    pub token: Option<u32>,
}

/// Facts the scheduler plans with.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// Longest sequence (prompt + generated tokens).
    pub n_ctx: usize,
    /// Tokens per cache page (prefix blocks are page-aligned).
    pub page_tokens: usize,
    /// The most sequences the engine can hold at once (live and cached), if bounded.
    pub max_seqs: Option<usize>,
    /// Bytes an fp16 cache would hold per token (K and V, every layer).
    pub fp16_bytes_per_token: usize,
    /// The cache configuration (for slot files: they must match it to be restored).
    pub cache: CacheConfig,
    pub device: &'static str,
}

/// Running totals of the prefill forwards' time (microseconds, host clocks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillPhases {
    /// Allocating the chunks' pages and uploading the forward's inputs.
    pub plan: u64,
    /// Queuing the forward's kernels.
    pub queue: u64,
    /// Waiting for the prompts' first tokens (after the step's decode rows, when it has any).
    pub wait: u64,
}

/// Not `Send`: an engine is built on the scheduler's thread and stays there (CUDA graphs
/// and contexts are bound to it).
pub trait Engine {
    fn info(&self) -> &EngineInfo;
    /// A new empty sequence.
    fn add(&mut self) -> Result<SeqId>;
    /// Frees a sequence; pages shared with a fork stay while the fork holds them.
    fn remove(&mut self, seq: SeqId);
    /// A second sequence sharing every page of `seq`.
    fn fork(&mut self, seq: SeqId) -> Result<SeqId>;
    /// Drops the `n` newest tokens of `seq`.
    fn trim(&mut self, seq: SeqId, n: usize) -> Result<()>;
    fn n_tokens(&self, seq: SeqId) -> usize;
    /// One batched forward over distinct sequences; one [`Out`] per work item, in order.
    fn forward(&mut self, work: &[Work<'_>]) -> Result<Vec<Out>>;
    /// As `forward`, running `during` while the device computes (the GPU engine: between a
    /// step's launch and its results); an engine that computes on the host runs it first.
    fn forward_overlapped(&mut self, work: &[Work<'_>], during: &mut dyn FnMut()) -> Result<Vec<Out>> {
        during();
        self.forward(work)
    }
    /// Where the prefill forwards' time went so far (engines that split it; zeros if not).
    fn prefill_phases(&self) -> PrefillPhases {
        PrefillPhases::default()
    }
    /// Bytes held by `seqs` together, pages shared between them counted once.
    fn kv_bytes(&self, seqs: &[SeqId]) -> usize;
    /// An upper bound on the bytes one unshared sequence of `n_tokens` holds.
    fn bytes_for_tokens(&self, n_tokens: usize) -> usize;
    /// A sequence as a CPU cache (slot files).
    fn export(&self, seq: SeqId) -> Result<PagedCache>;
    /// A new sequence holding a cache's tokens.
    fn import(&mut self, cache: PagedCache) -> Result<SeqId>;
}

/// Fits `bytes(n) ≤ a + b·n` for one sequence of a cache with this config, from two
/// measured caches (constant-valued tokens: sizes do not depend on values), with one extra
/// page per stream of slack (the open page).
pub(crate) fn cache_bound(cfg: &CacheConfig) -> Result<(usize, f64)> {
    let t = cfg.page_tokens;
    let kv = |n: usize| vec![0.01f32; cfg.n_kv_heads * n * cfg.head_dim];
    let measure = |n: usize| -> Result<usize> {
        let mut s = CompressedStore::new(cfg.clone())?;
        for l in 0..cfg.n_layers {
            s.append(l, &kv(n), &kv(n), n)?;
        }
        Ok(s.resident_bytes())
    };
    let (n1, n2) = (4 * t, 36 * t);
    let (b1, b2) = (measure(n1)?, measure(n2)?);
    let slope = (b2.saturating_sub(b1)) as f64 / (n2 - n1) as f64;
    let intercept = b1.saturating_sub((slope * n1 as f64) as usize) + (slope * t as f64) as usize;
    Ok((intercept, slope))
}

/// The model on the CPU: candle GEMMs over the batch, each sequence a [`CompressedStore`]
/// (fp16 is the paged `fp16` format, so forks and slots work for it too).
pub struct CpuEngine {
    model: Arc<Llama>,
    cfg: CacheConfig,
    seqs: Vec<Option<CompressedStore>>,
    info: EngineInfo,
    bound: (usize, f64),
}

impl CpuEngine {
    pub fn new(model: Arc<Llama>, cfg: CacheConfig) -> Result<Self> {
        let c = &model.config;
        if (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) != (c.n_layers, c.n_kv_heads, c.head_dim) {
            return Err(ServeError::Config("cache config does not match the model's shape".into()));
        }
        let page_tokens = cfg.page_tokens;
        let bound = cache_bound(&cfg)?;
        let info = EngineInfo {
            n_ctx: c.n_ctx_train,
            page_tokens,
            max_seqs: None,
            fp16_bytes_per_token: 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2,
            cache: cfg.clone(),
            device: "cpu",
        };
        Ok(Self { model, cfg, seqs: Vec::new(), info, bound })
    }

    fn put(&mut self, s: CompressedStore) -> SeqId {
        match self.seqs.iter().position(Option::is_none) {
            Some(i) => {
                self.seqs[i] = Some(s);
                i
            }
            None => {
                self.seqs.push(Some(s));
                self.seqs.len() - 1
            }
        }
    }

    fn get(&self, seq: SeqId) -> Result<&CompressedStore> {
        self.seqs.get(seq).and_then(Option::as_ref).ok_or_else(|| ServeError::Engine(format!("no sequence {seq}")))
    }
}

impl Engine for CpuEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn add(&mut self) -> Result<SeqId> {
        let s = CompressedStore::new(self.cfg.clone())?;
        Ok(self.put(s))
    }

    fn remove(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq) {
            *s = None;
        }
    }

    fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        let f = self.get(seq)?.fork();
        Ok(self.put(f))
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let s = self
            .seqs
            .get_mut(seq)
            .and_then(Option::as_mut)
            .ok_or_else(|| ServeError::Engine(format!("no sequence {seq}")))?;
        Ok(s.trim(n)?)
    }

    fn n_tokens(&self, seq: SeqId) -> usize {
        self.get(seq).map(|s| s.len(0)).unwrap_or(0)
    }

    fn forward(&mut self, work: &[Work<'_>]) -> Result<Vec<Out>> {
        // Hand out one &mut per distinct sequence, in work order.
        let mut slots: Vec<Option<&mut CompressedStore>> = self.seqs.iter_mut().map(Option::as_mut).collect();
        let mut items = Vec::with_capacity(work.len());
        for w in work {
            let store = slots
                .get_mut(w.seq)
                .and_then(Option::take)
                .ok_or_else(|| ServeError::Engine(format!("sequence {} missing or given twice", w.seq)))?;
            let logits_from = if w.want == Want::Nothing { w.tokens.len() } else { w.tokens.len().saturating_sub(1) };
            items.push(BatchItem { tokens: w.tokens, store: store as &mut dyn BatchStore, logits_from });
        }
        let logits = self.model.forward_batch(&mut items)?;
        Ok(work.iter().zip(logits).map(|(w, lg)| Out { token: w.want.choose(&lg) }).collect())
    }

    fn kv_bytes(&self, seqs: &[SeqId]) -> usize {
        let caches: Vec<&PagedCache> = seqs.iter().filter_map(|&s| self.get(s).ok()).map(|s| s.cache()).collect();
        PagedCache::resident_bytes_shared(&caches)
    }

    fn bytes_for_tokens(&self, n_tokens: usize) -> usize {
        self.bound.0 + (self.bound.1 * n_tokens as f64).ceil() as usize
    }

    fn export(&self, seq: SeqId) -> Result<PagedCache> {
        Ok(self.get(seq)?.cache().fork())
    }

    fn import(&mut self, cache: PagedCache) -> Result<SeqId> {
        let c = cache.config();
        let same = (c.n_layers, c.n_kv_heads, c.head_dim, c.page_tokens, c.recent, c.sink, &c.k, &c.v, c.seed)
            == (
                self.cfg.n_layers,
                self.cfg.n_kv_heads,
                self.cfg.head_dim,
                self.cfg.page_tokens,
                self.cfg.recent,
                self.cfg.sink,
                &self.cfg.k,
                &self.cfg.v,
                self.cfg.seed,
            );
        if !same {
            return Err(ServeError::Config("the cache file was made with another method or model shape".into()));
        }
        Ok(self.put(CompressedStore::from_cache(cache)))
    }
}
