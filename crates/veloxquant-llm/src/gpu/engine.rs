//! The GPU engine: sequences in the device cache, prefill in chunks, and batched decode
//! steps replayed from CUDA graphs.
//!
//! A decode step of B sequences is captured once per (B rounded up to a power of two, pages
//! covered) and replayed: the host plans the step (each sequence's append: pages allocated,
//! table deltas), uploads one small buffer (token ids, positions, append rows, deltas) and
//! the rows' slots, replays, and downloads the B sampled ids (or logits). Inside the step:
//! the deltas applied, embedding, per layer RMSNorm → QKV GEMM → RoPE → the cache append
//! (tokens leaving the window encoded) → split-K decode attention over the codes → output
//! GEMM (+residual) → RMSNorm → gate/up GEMM → SwiGLU → down GEMM (+residual); then the
//! final norm, the logits GEMM and argmax.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_cuda::attn::{DecodeOptions, DecodeOut, PlanCore};
use veloxquant_cuda::blas::Mat;
use veloxquant_cuda::cache::{encode_deltas, AppendSrc};
use veloxquant_cuda::ops::{sample_params, QOut};
use veloxquant_cuda::{AppendRow, Blas, GpuCacheConfig, GpuKvCache, PrefillAttn, PrefillKernel};

use super::model::{check_fits, gpu, GpuModel};
use crate::error::{LlmError, Result};
use crate::sample::{NextToken, SampleParams};

fn drv<E: std::fmt::Debug>(op: &'static str) -> impl FnOnce(E) -> LlmError {
    move |e| LlmError::Gpu(veloxquant_cuda::CudaError::Driver { op, err: format!("{e:?}") })
}

/// A cache method on the GPU: K and V formats, the recent window R and the sinks S.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuMethod {
    pub k: FormatSpec,
    pub v: FormatSpec,
    pub recent: usize,
    pub sink: usize,
}

impl GpuMethod {
    /// The fp16 cache (every token's K and V as fp16 rows).
    pub fn fp16() -> Self {
        // "fp16" is a registered name (conformance tests parse every one): cannot fail.
        let f = FormatSpec::parse("fp16").expect("fp16 is registered");
        Self { k: f.clone(), v: f, recent: 0, sink: 0 }
    }
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub method: GpuMethod,
    /// Sequence slots (also the largest decode batch).
    pub max_seqs: usize,
    /// Tokens per sequence (≤ the model's context).
    pub max_context: usize,
    /// Tokens of one sequence per prefill forward.
    pub prefill_chunk: usize,
    /// Tokens over all sequences per prefill forward.
    pub prefill_rows: usize,
    /// Logits rows one prefill call may return.
    pub logits_rows: usize,
    /// Coded tokens (per KV head, over all sequences) the page pool holds.
    pub pool_tokens: usize,
    /// Rotation seed (as `CacheConfig::seed`: the CPU's rotations for the same seed).
    pub seed: u64,
    /// Prefill attention kernel; `None`: the fastest that applies (`PrefillKernel::best`).
    pub prefill_kernel: Option<PrefillKernel>,
}

impl EngineConfig {
    /// `max_seqs` sequences of up to `max_context` tokens, every one able to fill its context.
    pub fn new(method: GpuMethod, max_seqs: usize, max_context: usize) -> Self {
        Self {
            method,
            max_seqs,
            max_context,
            prefill_chunk: 512.min(max_context.max(1)),
            prefill_rows: 4096,
            logits_rows: 4096,
            pool_tokens: max_seqs.saturating_mul(max_context),
            seed: 0x5EED,
            prefill_kernel: None,
        }
    }

    /// The CPU cache config this engine's cache mirrors.
    pub fn cpu_cache(&self, c: &crate::LlamaConfig) -> CacheConfig {
        let m = &self.method;
        let mut cfg = CacheConfig::new(c.n_layers, c.n_kv_heads, c.head_dim, m.k.clone(), m.v.clone());
        cfg.recent = m.recent;
        cfg.sink = m.sink;
        cfg.seed = self.seed;
        cfg
    }
}

/// Activation buffers, allocated once (captured graphs hold their addresses).
struct Bufs {
    x: CudaSlice<f32>,
    xn: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    q32: CudaSlice<f32>,
    q16: CudaSlice<u16>,
    k32: CudaSlice<f32>,
    att: CudaSlice<u16>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    ids_out: CudaSlice<i32>,
    /// Sampled ids (rows that sample; the step's argmax stays in ids_out).
    ids_sampled: CudaSlice<i32>,
    /// A launched prefill's next tokens: argmax rows, then sampled rows (2 × max_seqs).
    ids_pre: CudaSlice<i32>,
}

/// Host-written inputs of a forward (graphs hold their addresses too).
struct Uploads {
    /// Step upload: [ids (B)] [positions (B)] [append rows (6 B)] [deltas (1 + 2 D)].
    up: CudaSlice<i32>,
    /// Prefill upload: [ids (N)] [positions (N)].
    pre_up: CudaSlice<i32>,
    pre_rows: CudaSlice<AppendRow>,
    /// Sampling words, 4 per row (`veloxquant_cuda::ops::sample_params`).
    sample: CudaSlice<u64>,
    /// The same for a launched prefill's rows.
    pre_sample: CudaSlice<u64>,
}

/// What a captured step records (the benchmark times the parts apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepPart {
    All,
    Gemm,
    Attention,
    Rest,
}

struct StepGraph {
    plan: PlanCore,
    graph: CudaGraph,
}

/// Step output: the greedy ids of the sequences in order, and their logits when asked.
#[derive(Clone, Debug, Default)]
pub struct StepOut {
    pub ids: Vec<u32>,
    pub logits: Option<Vec<f32>>,
}

/// A prefill forward queued on the device ([`GpuEngine::prefill_launch`]), its tokens not yet
/// read.
#[must_use = "a launched prefill's tokens are read by prefill_collect"]
pub struct PendingPrefill {
    n_items: usize,
    /// Items that want a token, in order (row j of the device's ids), and whether it samples.
    wanted: Vec<(usize, bool)>,
}

/// A decode step queued on the device ([`GpuEngine::step_launch`]), its results not yet read.
#[must_use = "a launched step's tokens are read by step_collect"]
pub struct PendingStep {
    b: usize,
    bucket: usize,
    /// Rows sampled on the device (the rest greedy), when any is.
    sampled: Option<Vec<bool>>,
    want_logits: bool,
}

pub struct GpuEngine {
    pub model: Arc<GpuModel>,
    pub cfg: EngineConfig,
    pub cache: GpuKvCache,
    blas: Blas,
    prefill: PrefillAttn,
    bufs: Bufs,
    uploads: Uploads,
    graphs: HashMap<(usize, usize, StepPart), StepGraph>,
    max_deltas: usize,
    stream: Arc<CudaStream>,
    /// Where the prefill forwards' time went (host clocks).
    pub prefill_times: PrefillTimes,
}

/// Host-clock split of the prefill forwards: planning and queuing the device work, then
/// waiting for the device (and the logits' copy).
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillTimes {
    pub forwards: u64,
    /// Allocating the chunks' pages and uploading the forward's inputs.
    pub plan_micros: u64,
    /// Queuing the layers' kernels.
    pub queue_micros: u64,
    /// The logits' kernels and copies, and the wait for the device.
    pub wait_micros: u64,
}

/// Device bytes of one engine's cache, prefill workspace and activations.
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineBytes {
    pub cache: usize,
    pub workspace: usize,
}

/// A linear layer through cuBLAS. (A hand-written small-batch kernel, f32 FMAs over 16-byte
/// chunks of the weights, was slower on the H200: Llama-8B's GEMMs took 10.7 ms per step at
/// B = 8 against cuBLAS's 4.2, SmolLM2's 0.56 ms at B = 1 against 0.49.)
#[allow(clippy::too_many_arguments)]
fn linear(blas: &Blas, n: usize, m: usize, k: usize, x: Mat, w: Mat, y: Mat, beta: f32) -> Result<()> {
    blas.linear(n, m, k, x, w, y, 1.0, beta).map_err(gpu)
}

/// `logits[..rows] = xn[..rows] · outputᵀ`: the vocabulary projection of normed rows.
fn project_logits(blas: &Blas, model: &GpuModel, bufs: &Bufs, rows: usize, st: &Arc<CudaStream>) -> Result<()> {
    let (h, nv) = (model.config.hidden, model.config.n_vocab);
    let (x, w, y) = (Mat::f16(&bufs.xn, h, st), Mat::f16(model.output_matrix(), h, st), Mat::f32(&bufs.logits, nv, st));
    linear(blas, rows, nv, h, x, w, y, 0.0)
}

/// The device sampler's words, 4 per row (zeros for a row that does not sample).
fn sample_words(sampling: &[Option<(SampleParams, u64)>]) -> Vec<u64> {
    let mut words = Vec::with_capacity(4 * sampling.len());
    for s in sampling {
        words.extend(match s {
            Some((p, draw)) => sample_params(p.temperature, p.top_p, p.top_k as u64, p.seed, *draw),
            None => [0; 4],
        });
    }
    words
}

fn act_rows(cfg: &EngineConfig) -> usize {
    cfg.prefill_rows.max(cfg.max_seqs)
}

/// The Llama layers over the `n` rows of `bufs.x` (embedded): per layer RMSNorm → fused QKV
/// GEMM → RoPE (queries to `q16`, grouped for the prefill GEMM, or `q32`) → `attend(layer,
/// bufs)` (reads the queries, `k32` and the V columns of `qkv`; writes `att`) → output GEMM
/// (+residual) → RMSNorm → gate/up GEMM → SwiGLU → down GEMM (+residual). The one
/// description of the layers that prefill and the decode step both run; `part` keeps a subset
/// of the launches (the benchmark's split: GEMMs, attention, the rest).
#[allow(clippy::too_many_arguments)]
fn forward_layers(
    model: &GpuModel,
    blas: &Blas,
    bufs: &mut Bufs,
    st: &Arc<CudaStream>,
    n: usize,
    pos: &cudarc::driver::CudaView<'_, i32>,
    grouped_q: bool,
    part: StepPart,
    attend: &mut dyn FnMut(usize, &mut Bufs) -> Result<()>,
) -> Result<()> {
    let c = &model.config;
    let (h, d, hq, hkv, f) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_hidden);
    let qkv_w = (hq + 2 * hkv) * d;
    let ops = &model.ops;
    let gemm = matches!(part, StepPart::All | StepPart::Gemm);
    let rest = matches!(part, StepPart::All | StepPart::Rest);
    for (l, w) in model.layers.iter().enumerate() {
        if rest {
            ops.rmsnorm(st, &bufs.x.slice(..), h, n, &w.attn_norm, c.rms_eps, &mut bufs.xn.slice_mut(..))
                .map_err(gpu)?;
        }
        if gemm {
            let (x, wq, y) = (Mat::f16(&bufs.xn, h, st), Mat::f16(&w.wqkv, h, st), Mat::f32(&bufs.qkv, qkv_w, st));
            linear(blas, n, qkv_w, h, x, wq, y, 0.0)?;
        }
        if rest {
            let q = if grouped_q {
                QOut::Grouped16(&mut bufs.q16.slice_mut(..))
            } else {
                QOut::F32(&mut bufs.q32.slice_mut(..))
            };
            let tables = (&model.rope_cos, &model.rope_sin);
            ops.rope(st, &bufs.qkv.slice(..), qkv_w, pos, n, tables, (hq, hkv, d), q, &mut bufs.k32.slice_mut(..))
                .map_err(gpu)?;
        }
        attend(l, bufs)?;
        if gemm {
            let (x, wo, y) = (Mat::f16(&bufs.att, hq * d, st), Mat::f16(&w.wo, hq * d, st), Mat::f32(&bufs.x, h, st));
            linear(blas, n, h, hq * d, x, wo, y, 1.0)?;
        }
        if rest {
            ops.rmsnorm(st, &bufs.x.slice(..), h, n, &w.ffn_norm, c.rms_eps, &mut bufs.xn.slice_mut(..))
                .map_err(gpu)?;
        }
        if gemm {
            let (x, wg, y) = (Mat::f16(&bufs.xn, h, st), Mat::f16(&w.w_gate_up, h, st), Mat::f32(&bufs.gu, 2 * f, st));
            linear(blas, n, 2 * f, h, x, wg, y, 0.0)?;
        }
        if rest {
            ops.swiglu(st, &bufs.gu.slice(..), f, n, &mut bufs.act.slice_mut(..)).map_err(gpu)?;
        }
        if gemm {
            let (x, wd, y) = (Mat::f16(&bufs.act, f, st), Mat::f16(&w.w_down, f, st), Mat::f32(&bufs.x, h, st));
            linear(blas, n, h, f, x, wd, y, 1.0)?;
        }
    }
    Ok(())
}

impl GpuEngine {
    /// Plan the engine's memory, check it fits the device's free memory, then allocate.
    pub fn new(model: Arc<GpuModel>, cfg: EngineConfig) -> Result<Self> {
        let c = model.config.clone();
        let bad = |what: String| Err(LlmError::InvalidArgument(format!("GPU engine: {what}")));
        if cfg.max_seqs == 0 || cfg.max_context == 0 || cfg.prefill_chunk == 0 || cfg.prefill_rows < cfg.prefill_chunk {
            return bad("max_seqs, max_context, prefill_chunk must be > 0 and prefill_rows ≥ prefill_chunk".into());
        }
        if cfg.max_context > c.n_ctx_train {
            return bad(format!("max_context {} exceeds the model's context {}", cfg.max_context, c.n_ctx_train));
        }
        let gcfg = GpuCacheConfig::from_cpu(&cfg.cpu_cache(&c), cfg.max_seqs, cfg.max_context, cfg.pool_tokens);
        let cache_bytes = gcfg.device_bytes().map_err(gpu)?;
        let ws_guess = Self::activation_bytes(&c, &cfg) + (64 << 20);
        check_fits(&model.dev, "the KV cache and activations", cache_bytes + ws_guess)?;
        let cache = GpuKvCache::new(&model.dev, gcfg).map_err(gpu)?;
        let kernel = cfg.prefill_kernel.unwrap_or_else(|| PrefillKernel::best(&cache.cfg));
        let prefill_ws =
            PrefillAttn::workspace_bytes_for(&cache, c.n_heads, cfg.prefill_chunk, cfg.max_context, kernel);
        check_fits(&model.dev, "the prefill workspace", prefill_ws + Self::activation_bytes(&c, &cfg))?;
        let prefill =
            PrefillAttn::with_kernel(&cache, c.n_heads, cfg.prefill_chunk, cfg.max_context, kernel).map_err(gpu)?;
        let st = model.dev.stream.clone();
        let (h, d, hq, hkv, f) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_hidden);
        let rows = act_rows(&cfg);
        let qkv_w = (hq + 2 * hkv) * d;
        let max_deltas = cfg.max_seqs * (hkv + 2) + 16;
        let a32 = |n: usize| st.alloc_zeros::<f32>(n.max(1)).map_err(drv("alloc activations"));
        let a16 = |n: usize| st.alloc_zeros::<u16>(n.max(1)).map_err(drv("alloc activations"));
        let bufs = Bufs {
            x: a32(rows * h)?,
            xn: a16(rows * h.max(f))?,
            qkv: a32(rows * qkv_w)?,
            q32: a32(cfg.max_seqs * hq * d)?,
            q16: a16(rows * hq * d)?,
            k32: a32(rows * hkv * d)?,
            att: a16(rows * hq * d)?,
            gu: a32(rows * 2 * f)?,
            act: a16(rows * f)?,
            logits: a32(cfg.logits_rows.max(cfg.max_seqs) * c.n_vocab)?,
            ids_out: st.alloc_zeros::<i32>(cfg.max_seqs).map_err(drv("alloc"))?,
            ids_sampled: st.alloc_zeros::<i32>(cfg.max_seqs).map_err(drv("alloc"))?,
            ids_pre: st.alloc_zeros::<i32>(2 * cfg.max_seqs).map_err(drv("alloc"))?,
        };
        let uploads = Uploads {
            up: st.alloc_zeros::<i32>(8 * cfg.max_seqs + 1 + 2 * max_deltas).map_err(drv("alloc"))?,
            pre_up: st.alloc_zeros::<i32>(2 * cfg.prefill_rows).map_err(drv("alloc"))?,
            pre_rows: st.alloc_zeros::<AppendRow>(cfg.prefill_rows).map_err(drv("alloc"))?,
            sample: st.alloc_zeros::<u64>(4 * cfg.max_seqs).map_err(drv("alloc"))?,
            pre_sample: st.alloc_zeros::<u64>(4 * cfg.max_seqs).map_err(drv("alloc"))?,
        };
        let blas = Blas::new(&model.dev).map_err(gpu)?;
        let e = Self {
            model,
            cfg,
            cache,
            blas,
            prefill,
            bufs,
            uploads,
            graphs: HashMap::new(),
            max_deltas,
            stream: st,
            prefill_times: PrefillTimes::default(),
        };
        // The decode kernels compile now (one plan's modules serve every batch and page
        // bucket), not inside the first step a request waits for.
        PlanCore::new(&e.cache, c.n_heads, 1, e.page_bucket(1), DecodeOptions::default()).map_err(gpu)?;
        Ok(e)
    }

    fn activation_bytes(c: &crate::LlamaConfig, cfg: &EngineConfig) -> usize {
        let (h, d, hq, hkv, f) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_hidden);
        let rows = act_rows(cfg);
        rows * (h * 4
            + h.max(f) * 2
            + (hq + 2 * hkv) * d * 4
            + hq * d * 2
            + hkv * d * 4
            + hq * d * 2
            + 2 * f * 4
            + f * 2)
            + cfg.logits_rows.max(cfg.max_seqs) * c.n_vocab * 4
    }

    /// The prefill attention kernel this engine runs.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        self.prefill.kernel()
    }

    /// Device bytes this engine holds: the cache, and prefill workspace plus activations.
    pub fn device_bytes(&self) -> EngineBytes {
        let c = &self.model.config;
        EngineBytes {
            cache: self.cache.cfg.device_bytes().unwrap_or(0),
            workspace: PrefillAttn::workspace_bytes_for(
                &self.cache,
                c.n_heads,
                self.cfg.prefill_chunk,
                self.cfg.max_context,
                self.prefill.kernel(),
            ) + Self::activation_bytes(c, &self.cfg),
        }
    }

    /// A new empty sequence (a cache slot).
    pub fn add_sequence(&mut self) -> Result<usize> {
        self.cache.add_seq().map_err(gpu)
    }
    pub fn remove_sequence(&mut self, slot: usize) -> Result<()> {
        self.cache.remove_seq(slot).map_err(gpu)
    }
    /// A second sequence sharing this one's pages.
    pub fn fork(&mut self, slot: usize) -> Result<usize> {
        self.cache.fork(slot).map_err(gpu)
    }
    /// Drop the `n` newest tokens of a sequence.
    pub fn trim(&mut self, slot: usize, n: usize) -> Result<()> {
        self.cache.trim(slot, n).map_err(gpu)
    }
    pub fn n_tokens(&self, slot: usize) -> Result<usize> {
        self.cache.n_tokens(slot).map_err(gpu)
    }

    /// A sequence as a CPU cache (save it with `PagedCache::save`, continue it on the CPU).
    pub fn export(&self, slot: usize) -> Result<veloxquant::PagedCache> {
        self.cache.to_paged_cache(slot, &self.cfg.cpu_cache(&self.model.config)).map_err(gpu)
    }

    /// A new sequence holding a CPU cache's tokens (e.g. loaded from a cache file made by
    /// `export` or by the CPU): decoding continues from them.
    pub fn import(&mut self, cache: &veloxquant::PagedCache) -> Result<usize> {
        if cache.n_tokens(0).map_err(|e| LlmError::StoreBackend(Box::new(e)))? > self.cfg.max_context {
            return Err(LlmError::InvalidArgument(
                "import: the cache holds more tokens than the engine's context".into(),
            ));
        }
        self.cache.upload(cache).map_err(gpu)
    }

    fn check_tokens(&self, toks: &[u32], slot: usize, n_new: usize) -> Result<()> {
        let c = &self.model.config;
        if let Some(&id) = toks.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(LlmError::TokenOutOfRange { id, n_vocab: c.n_vocab });
        }
        let pos = self.n_tokens(slot)? + n_new;
        if pos > self.cfg.max_context {
            return Err(LlmError::ContextOverflow { pos, n_ctx_train: self.cfg.max_context });
        }
        Ok(())
    }

    /// Each (slot, new tokens) checked by `check_tokens`, the slots distinct (`what` names
    /// the call in the error).
    fn check_distinct<'a>(&self, what: &str, chunks: impl IntoIterator<Item = (usize, &'a [u32])>) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for (slot, toks) in chunks {
            if !seen.insert(slot) {
                return Err(LlmError::InvalidArgument(format!("{what}: slot {slot} appears twice")));
            }
            self.check_tokens(toks, slot, toks.len())?;
        }
        Ok(())
    }

    /// Teacher-forced prefill of each `(slot, tokens)`, in chunks: the tokens are appended to
    /// the sequences; returns, per item, the logits `[n][n_vocab]` of its positions
    /// `logits_from..` (as `Llama::forward`; `logits_from = tokens.len()`: none).
    pub fn prefill(&mut self, items: &[(usize, &[u32], usize)]) -> Result<Vec<Vec<f32>>> {
        self.check_distinct("prefill", items.iter().map(|&(slot, toks, _)| (slot, toks)))?;
        for &(_, toks, lf) in items {
            if lf > toks.len() {
                return Err(LlmError::InvalidArgument(format!("prefill: logits_from {lf} > {} tokens", toks.len())));
            }
        }
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        let mut done = vec![0usize; items.len()];
        loop {
            // One forward: the next chunk of every unfinished item, within prefill_rows.
            let mut round: Vec<(usize, usize, usize)> = Vec::new(); // (item, start, len)
            let mut rows = 0;
            for (i, &(_, toks, _)) in items.iter().enumerate() {
                let len = (toks.len() - done[i]).min(self.cfg.prefill_chunk);
                if len == 0 || rows + len > self.cfg.prefill_rows {
                    continue;
                }
                round.push((i, done[i], len));
                rows += len;
            }
            if round.is_empty() {
                break;
            }
            let logits = self.prefill_round(items, &round)?;
            for (&(i, _, len), lg) in round.iter().zip(logits) {
                done[i] += len;
                out[i].extend(lg);
            }
        }
        Ok(out)
    }

    /// Queues the layers of one forward over `chunks` (slot, tokens), appending them to the
    /// slots' caches; the final hidden states stay in `bufs.x` (chunk after chunk).
    fn queue_layers(&mut self, chunks: &[(usize, &[u32])]) -> Result<()> {
        let t0 = std::time::Instant::now();
        let c = self.model.config.clone();
        let (h, d, hq, hkv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads);
        let qkv_w = (hq + 2 * hkv) * d;
        let mut ids = Vec::new();
        let mut pos = Vec::new();
        let mut rows = Vec::new();
        for &(slot, toks) in chunks {
            let p0 = self.cache.n_tokens(slot).map_err(gpu)?;
            rows.push(self.cache.plan_append(slot, toks.len(), ids.len()).map_err(gpu)?);
            for (j, &t) in toks.iter().enumerate() {
                ids.push(t as i32);
                pos.push((p0 + j) as i32);
            }
        }
        let n = ids.len();
        self.cache.sync_meta().map_err(gpu)?;
        let st = self.stream.clone();
        let Self { cache, blas, prefill, bufs, uploads, model, .. } = self;
        ids.extend_from_slice(&pos);
        st.memcpy_htod(&ids, &mut uploads.pre_up.slice_mut(..2 * n)).map_err(drv("htod prefill"))?;
        st.memcpy_htod(&rows, &mut uploads.pre_rows.slice_mut(..rows.len())).map_err(drv("htod prefill"))?;
        let planned = t0.elapsed();
        let ids_v = uploads.pre_up.slice(..n);
        let pos_v = uploads.pre_up.slice(n..2 * n);
        model.ops.embed(&st, &ids_v, n, &model.embed, h, &mut bufs.x.slice_mut(..)).map_err(gpu)?;
        let pre_rows = &uploads.pre_rows;
        let mut attend = |l: usize, bufs: &mut Bufs| -> Result<()> {
            let ksrc = AppendSrc { data: bufs.k32.slice(..), stride: hkv * d };
            let vsrc = AppendSrc { data: bufs.qkv.slice((hq + hkv) * d..), stride: qkv_w };
            let (rv, q) = (pre_rows.slice(..rows.len()), bufs.q16.slice(..));
            prefill
                .run_many(blas, cache, l, &rows, &rv, (&ksrc, &vsrc), &q, n, &mut bufs.att.slice_mut(..), &st)
                .map_err(gpu)?;
            Ok(())
        };
        forward_layers(model, blas, bufs, &st, n, &pos_v, true, StepPart::All, &mut attend)?;
        let t = &mut self.prefill_times;
        t.forwards += 1;
        t.plan_micros += planned.as_micros() as u64;
        t.queue_micros += (t0.elapsed() - planned).as_micros() as u64;
        Ok(())
    }

    /// One forward over chunks (item, start, len) of `items`; logits per chunk for its
    /// positions at or past the item's logits_from.
    fn prefill_round(
        &mut self,
        items: &[(usize, &[u32], usize)],
        round: &[(usize, usize, usize)],
    ) -> Result<Vec<Vec<f32>>> {
        let chunks: Vec<(usize, &[u32])> =
            round.iter().map(|&(i, start, len)| (items[i].0, &items[i].1[start..start + len])).collect();
        self.queue_layers(&chunks)?;
        let t0 = std::time::Instant::now();
        let c = self.model.config.clone();
        let (h, nv) = (c.hidden, c.n_vocab);
        let st = self.stream.clone();
        let Self { bufs, model, blas, .. } = self;
        let ops = &model.ops;
        // Logits of the wanted rows, chunk by chunk (each chunk's rows are contiguous).
        let logits_cap = bufs.logits.len() / nv;
        let mut out = Vec::with_capacity(round.len());
        let mut r0 = 0;
        for &(i, start, len) in round {
            let lf = items[i].2;
            let first = lf.max(start).min(start + len) - start;
            let m = len - first;
            if m == 0 {
                out.push(Vec::new());
                r0 += len;
                continue;
            }
            if m > logits_cap {
                return Err(LlmError::InvalidArgument(format!(
                    "prefill: {m} logits rows exceed the engine's {logits_cap}"
                )));
            }
            let xs = bufs.x.slice((r0 + first) * h..);
            ops.rmsnorm(&st, &xs, h, m, &model.output_norm, c.rms_eps, &mut bufs.xn.slice_mut(..)).map_err(gpu)?;
            project_logits(blas, model, bufs, m, &st)?;
            let mut lg = vec![0f32; m * nv];
            st.memcpy_dtoh(&bufs.logits.slice(..m * nv), &mut lg).map_err(drv("dtoh logits"))?;
            out.push(lg);
            r0 += len;
        }
        st.synchronize().map_err(drv("synchronize"))?;
        self.prefill_times.wait_micros += t0.elapsed().as_micros() as u64;
        Ok(out)
    }

    /// One prefill forward over `items` (slot, tokens, what its last position returns), queued
    /// on the device with no wait: each item's next token is chosen there (argmax, or
    /// `crate::sample::sample_token`'s algorithm) and read by
    /// [`prefill_collect`](Self::prefill_collect); the host may queue a decode step between
    /// (a server's step). The items must fit one forward: distinct slots, each ≤
    /// `prefill_chunk` tokens, together ≤ `prefill_rows`.
    pub fn prefill_launch(&mut self, items: &[(usize, &[u32], NextToken)]) -> Result<PendingPrefill> {
        self.check_distinct("prefill_launch", items.iter().map(|&(slot, toks, _)| (slot, toks)))?;
        let mut rows = 0usize;
        for &(_, toks, _) in items {
            if toks.is_empty() || toks.len() > self.cfg.prefill_chunk {
                return Err(LlmError::InvalidArgument(format!(
                    "prefill_launch: a chunk of {} tokens (1..={})",
                    toks.len(),
                    self.cfg.prefill_chunk
                )));
            }
            rows += toks.len();
        }
        if items.is_empty() || rows > self.cfg.prefill_rows {
            return Err(LlmError::InvalidArgument(format!(
                "prefill_launch: {rows} tokens in {} items (one forward: 1..={} tokens)",
                items.len(),
                self.cfg.prefill_rows
            )));
        }
        let chunks: Vec<(usize, &[u32])> = items.iter().map(|&(s, t, _)| (s, t)).collect();
        self.queue_layers(&chunks)?;
        let t0 = std::time::Instant::now();
        let c = self.model.config.clone();
        let (h, nv) = (c.hidden, c.n_vocab);
        // The wanted rows' final norms side by side (row k of xn), then one logits GEMM.
        let mut wanted = Vec::new(); // (item, its row in bufs.x)
        let mut r0 = 0;
        for (i, &(_, toks, want)) in items.iter().enumerate() {
            r0 += toks.len();
            if want != NextToken::Nothing {
                wanted.push((i, r0 - 1));
            }
        }
        let k = wanted.len();
        let sampling: Vec<Option<(SampleParams, u64)>> = wanted
            .iter()
            .map(|&(i, _)| match items[i].2 {
                NextToken::Sample(p, draw) if !p.is_greedy() => Some((p, draw)),
                _ => None,
            })
            .collect();
        let st = self.stream.clone();
        let Self { bufs, model, blas, uploads, .. } = self;
        let ops = &model.ops;
        if k > 0 {
            for (j, &(_, r)) in wanted.iter().enumerate() {
                let (xs, mut xn) = (bufs.x.slice(r * h..(r + 1) * h), bufs.xn.slice_mut(j * h..(j + 1) * h));
                ops.rmsnorm(&st, &xs, h, 1, &model.output_norm, c.rms_eps, &mut xn).map_err(gpu)?;
            }
            project_logits(blas, model, bufs, k, &st)?;
            let logits = bufs.logits.slice(..k * nv);
            ops.argmax(&st, &logits, k, nv, &mut bufs.ids_pre.slice_mut(..k)).map_err(gpu)?;
            if sampling.iter().any(Option::is_some) {
                let words = sample_words(&sampling);
                st.memcpy_htod(&words, &mut uploads.pre_sample.slice_mut(..4 * k)).map_err(drv("htod sampling"))?;
                let params = uploads.pre_sample.slice(..4 * k);
                ops.sample(&st, &logits, k, nv, &params, &mut bufs.ids_pre.slice_mut(k..2 * k)).map_err(gpu)?;
            }
        }
        self.prefill_times.queue_micros += t0.elapsed().as_micros() as u64;
        let wanted = wanted.iter().zip(&sampling).map(|(&(i, _), s)| (i, s.is_some())).collect();
        Ok(PendingPrefill { n_items: items.len(), wanted })
    }

    /// The next tokens of a launched prefill, one per item (`None` where it wanted none);
    /// waits for the device.
    pub fn prefill_collect(&mut self, p: PendingPrefill) -> Result<Vec<Option<u32>>> {
        let t0 = std::time::Instant::now();
        let k = p.wanted.len();
        let mut out = vec![None; p.n_items];
        if k > 0 {
            // Argmax rows, then (when any row samples) the sampled rows.
            let n = if p.wanted.iter().any(|w| w.1) { 2 * k } else { k };
            let mut ids = vec![0i32; n];
            self.stream.memcpy_dtoh(&self.bufs.ids_pre.slice(..n), &mut ids).map_err(drv("dtoh ids"))?;
            for (j, &(i, sampled)) in p.wanted.iter().enumerate() {
                out[i] = Some(ids[if sampled { k + j } else { j }] as u32);
            }
        }
        self.stream.synchronize().map_err(drv("synchronize"))?;
        self.prefill_times.wait_micros += t0.elapsed().as_micros() as u64;
        Ok(out)
    }

    /// One decode step: token `t` appended to each `(slot, t)` (distinct slots), attention
    /// over its cache; returns the greedy next ids (and the logits `[B][n_vocab]` when
    /// `want_logits`). Replays a captured graph (captured on first use of its shape).
    pub fn step(&mut self, tokens: &[(usize, u32)], want_logits: bool) -> Result<StepOut> {
        self.step_sampled(tokens, &[], want_logits)
    }

    /// [`Self::step`] where row `i` with `sampling[i] = Some((params, draw))` takes a token
    /// sampled on the device (`crate::sample::sample_token`'s algorithm) instead of the
    /// argmax; `sampling` is empty or one entry per row.
    pub fn step_sampled(
        &mut self,
        tokens: &[(usize, u32)],
        sampling: &[Option<(SampleParams, u64)>],
        want_logits: bool,
    ) -> Result<StepOut> {
        let pending = self.step_launch(tokens, sampling, want_logits)?;
        self.step_collect(pending)
    }

    /// As [`step_sampled`](Self::step_sampled), up to the device work queued: the caches
    /// already count the new tokens; [`step_collect`](Self::step_collect) waits for the
    /// results (the host may do other work between, e.g. a server's streaming).
    pub fn step_launch(
        &mut self,
        tokens: &[(usize, u32)],
        sampling: &[Option<(SampleParams, u64)>],
        want_logits: bool,
    ) -> Result<PendingStep> {
        let b = tokens.len();
        if !sampling.is_empty() && sampling.len() != b {
            return Err(LlmError::InvalidArgument(format!("step: {} sampling entries for {b} rows", sampling.len())));
        }
        if b == 0 || b > self.cfg.max_seqs {
            return Err(LlmError::InvalidArgument(format!("step of {b} sequences (1..={})", self.cfg.max_seqs)));
        }
        self.check_distinct("step", tokens.iter().map(|(slot, t)| (*slot, std::slice::from_ref(t))))?;
        let bucket = b.next_power_of_two().min(self.cfg.max_seqs);
        let mut ids = vec![0i32; bucket];
        let mut pos = vec![0i32; bucket];
        let mut rows = vec![AppendRow::IDLE; bucket];
        let mut slot_of = vec![-1i32; bucket];
        for (i, &(slot, t)) in tokens.iter().enumerate() {
            pos[i] = self.cache.n_tokens(slot).map_err(gpu)? as i32;
            rows[i] = self.cache.plan_append(slot, 1, i).map_err(gpu)?;
            ids[i] = t as i32;
            slot_of[i] = slot as i32;
        }
        let slots: Vec<usize> = tokens.iter().map(|&(s, _)| s).collect();
        let pages = self.cache.max_pages(&slots);
        self.launch_step(bucket, pages, &ids, &pos, &rows, &slot_of, StepPart::All)?;
        let st = self.stream.clone();
        let sampled = sampling.iter().any(Option::is_some);
        if sampled {
            let words = sample_words(sampling);
            let nv = self.model.config.n_vocab;
            st.memcpy_htod(&words, &mut self.uploads.sample.slice_mut(..4 * b)).map_err(drv("htod sampling"))?;
            let (logits, params) = (self.bufs.logits.slice(..b * nv), self.uploads.sample.slice(..4 * b));
            let mut ids = self.bufs.ids_sampled.slice_mut(..b);
            self.model.ops.sample(&st, &logits, b, nv, &params, &mut ids).map_err(gpu)?;
        }
        let sampled = sampled.then(|| sampling.iter().map(Option::is_some).collect());
        Ok(PendingStep { b, bucket, sampled, want_logits })
    }

    /// The results of a launched step (waits for the device).
    pub fn step_collect(&mut self, p: PendingStep) -> Result<StepOut> {
        let PendingStep { b, bucket, sampled, want_logits } = p;
        let st = self.stream.clone();
        let mut out = vec![0i32; bucket];
        st.memcpy_dtoh(&self.bufs.ids_out.slice(..bucket), &mut out).map_err(drv("dtoh ids"))?;
        if let Some(is_sampled) = sampled {
            let mut ids = vec![0i32; b];
            st.memcpy_dtoh(&self.bufs.ids_sampled.slice(..b), &mut ids).map_err(drv("dtoh sampled"))?;
            for (i, &s) in is_sampled.iter().enumerate() {
                if s {
                    out[i] = ids[i];
                }
            }
        }
        let logits = if want_logits {
            let nv = self.model.config.n_vocab;
            let mut lg = vec![0f32; b * nv];
            st.memcpy_dtoh(&self.bufs.logits.slice(..b * nv), &mut lg).map_err(drv("dtoh logits"))?;
            Some(lg)
        } else {
            None
        };
        st.synchronize().map_err(drv("synchronize"))?;
        Ok(StepOut { ids: out[..b].iter().map(|&x| x as u32).collect(), logits })
    }

    /// Captures now the step graph of every batch bucket and page bucket a step can take, so
    /// no request waits for a capture (a server's start-up, as graph-replaying servers do).
    /// Returns how many were captured.
    pub fn capture_all_steps(&mut self) -> Result<usize> {
        let max_pages = self.cache.cfg.max_pages_per_seq;
        let mut n = 0;
        let mut b = 1usize;
        loop {
            let bucket = b.next_power_of_two().min(self.cfg.max_seqs);
            let mut pages = 1;
            loop {
                let covered = self.page_bucket(pages);
                let key = (bucket, covered, StepPart::All);
                if !self.graphs.contains_key(&key) {
                    let g = self.capture(bucket, covered, StepPart::All)?;
                    self.graphs.insert(key, g);
                    n += 1;
                }
                if covered >= max_pages {
                    break;
                }
                pages = covered + 1;
            }
            if bucket >= self.cfg.max_seqs {
                break;
            }
            b = bucket + 1;
        }
        Ok(n)
    }

    /// Pages covered by the graph for `pages` (power-of-two buckets from 16).
    fn page_bucket(&self, pages: usize) -> usize {
        pages.max(16).next_power_of_two().min(self.cache.cfg.max_pages_per_seq)
    }

    /// Upload a planned step and replay (capturing first) its graph.
    #[allow(clippy::too_many_arguments)]
    fn launch_step(
        &mut self,
        bucket: usize,
        pages: usize,
        ids: &[i32],
        pos: &[i32],
        rows: &[AppendRow],
        slot_of: &[i32],
        part: StepPart,
    ) -> Result<()> {
        let covered = self.page_bucket(pages);
        let key = (bucket, covered, part);
        // Deltas ride in the upload, applied by the graph's first kernel; more than it holds
        // (a burst of forks or trims) are applied now instead.
        if self.cache.pending_deltas() > self.max_deltas {
            self.cache.sync_meta().map_err(gpu)?;
        }
        let pending = self.cache.take_deltas();
        if !self.graphs.contains_key(&key) {
            let g = self.capture(bucket, covered, part)?;
            self.graphs.insert(key, g);
        }
        let mut deltas = encode_deltas(&pending);
        deltas.resize(1 + 2 * self.max_deltas, 0);
        let mut up = Vec::with_capacity(self.uploads.up.len());
        up.extend_from_slice(&ids[..bucket]);
        up.extend_from_slice(&pos[..bucket]);
        for r in rows {
            up.extend_from_slice(&[r.slot, r.pos0, r.n, r.coded0, r.coded1, r.src_row]);
        }
        up.resize(self.up_deltas_at(bucket), 0);
        up.extend_from_slice(&deltas);
        let st = self.stream.clone();
        st.memcpy_htod(&up, &mut self.uploads.up.slice_mut(..up.len())).map_err(drv("htod step"))?;
        // Inserted above in this call (captured when missing); nothing removes graphs between.
        let g = self.graphs.get_mut(&key).expect("graph inserted above");
        st.memcpy_htod(slot_of, g.plan.rows_mut()).map_err(drv("htod rows"))?;
        g.plan.note_rows(slot_of);
        g.graph.launch().map_err(drv("graph launch"))?;
        Ok(())
    }

    /// Offset of the deltas in the step upload for a bucket.
    fn up_deltas_at(&self, bucket: usize) -> usize {
        8 * bucket
    }

    fn capture(&mut self, bucket: usize, covered: usize, part: StepPart) -> Result<StepGraph> {
        let c = &self.model.config;
        let mut plan = PlanCore::new(&self.cache, c.n_heads, bucket, covered, DecodeOptions::default()).map_err(gpu)?;
        let st = self.stream.clone();
        // Warm-up with idle rows (nothing written to the cache): modules load and cuBLAS
        // picks its kernels outside the capture.
        let idle: Vec<i32> = vec![-1; bucket];
        let mut up = vec![0i32; 2 * bucket];
        for _ in 0..bucket {
            up.extend_from_slice(&[-1, 0, 0, 0, 0, 0]);
        }
        up.resize(self.up_deltas_at(bucket) + 1, 0);
        st.memcpy_htod(&up, &mut self.uploads.up.slice_mut(..up.len())).map_err(drv("htod"))?;
        st.memcpy_htod(&idle, plan.rows_mut()).map_err(drv("htod"))?;
        plan.note_rows(&idle);
        self.record_step(&mut plan, bucket, part)?;
        st.synchronize().map_err(drv("synchronize"))?;
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(drv("begin capture"))?;
        let rec = self.record_step(&mut plan, bucket, part);
        let graph = st.end_capture(CUgraphInstantiate_flags(0)).map_err(drv("end capture"))?;
        rec?;
        let graph = graph.ok_or_else(|| {
            LlmError::Gpu(veloxquant_cuda::CudaError::Driver { op: "capture", err: "empty graph".into() })
        })?;
        Ok(StepGraph { plan, graph })
    }

    /// The step's launches (see the module docs), reading the step upload.
    fn record_step(&mut self, plan: &mut PlanCore, bucket: usize, part: StepPart) -> Result<()> {
        let c = self.model.config.clone();
        let (h, d, hq, hkv, nv) = (c.hidden, c.head_dim, c.n_heads, c.n_kv_heads, c.n_vocab);
        let qkv_w = (hq + 2 * hkv) * d;
        let n = bucket;
        let st = self.stream.clone();
        let deltas_at = self.up_deltas_at(bucket);
        let Self { cache, blas, bufs, uploads, model, .. } = self;
        let ops = &model.ops;
        let gemm = matches!(part, StepPart::All | StepPart::Gemm);
        let attn = matches!(part, StepPart::All | StepPart::Attention);
        let rest = matches!(part, StepPart::All | StepPart::Rest);
        let up = &uploads.up;
        if attn {
            cache.launch_deltas_from(&up.slice(deltas_at..), &st).map_err(gpu)?;
        }
        let ids_v = up.slice(..n);
        let pos_v = up.slice(n..2 * n);
        // SAFETY: AppendRow is six i32 (repr(C)); the upload holds 6·n i32 at 2n.. .
        let rows_v = unsafe { up.slice(2 * n..8 * n).transmute::<AppendRow>(n) }
            .ok_or_else(|| LlmError::InvalidArgument("step upload too small".into()))?;
        if rest {
            ops.embed(&st, &ids_v, n, &model.embed, h, &mut bufs.x.slice_mut(..)).map_err(gpu)?;
        }
        let max_enc = if cache.row_mode { 1 } else { cache.cfg.page_tokens };
        let mut attend = |l: usize, bufs: &mut Bufs| -> Result<()> {
            if !attn {
                return Ok(());
            }
            let ksrc = AppendSrc { data: bufs.k32.slice(..), stride: hkv * d };
            let vsrc = AppendSrc { data: bufs.qkv.slice((hq + hkv) * d..), stride: qkv_w };
            cache.launch_append(l, &rows_v, n, 1, max_enc, &ksrc, &vsrc, &st).map_err(gpu)?;
            plan.run_on(cache, l, &bufs.q32.slice(..), DecodeOut::F16(&mut bufs.att.slice_mut(..)), &st).map_err(gpu)
        };
        forward_layers(model, blas, bufs, &st, n, &pos_v, false, part, &mut attend)?;
        if rest {
            ops.rmsnorm(&st, &bufs.x.slice(..), h, n, &model.output_norm, c.rms_eps, &mut bufs.xn.slice_mut(..))
                .map_err(gpu)?;
        }
        if gemm {
            project_logits(blas, model, bufs, n, &st)?;
        }
        if rest {
            ops.argmax(&st, &bufs.logits.slice(..), n, nv, &mut bufs.ids_out.slice_mut(..)).map_err(gpu)?;
        }
        Ok(())
    }

    /// Benchmark: `slots` (filled, e.g. by `cache.fill_random`) take one planned step, then its
    /// graph (or the graph of one part of it) is replayed `iters` times; returns each replay's
    /// GPU time in ms (events around each launch). Replays re-append the same token.
    pub fn time_step(&mut self, slots: &[usize], iters: usize, part: StepPart) -> Result<Vec<f32>> {
        let b = slots.len();
        if b == 0 || b > self.cfg.max_seqs || iters == 0 {
            return Err(LlmError::InvalidArgument(format!("time_step: {b} slots, {iters} iterations")));
        }
        let bucket = b.next_power_of_two().min(self.cfg.max_seqs);
        let mut ids = vec![0i32; bucket];
        let mut pos = vec![0i32; bucket];
        let mut rows = vec![AppendRow::IDLE; bucket];
        let mut slot_of = vec![-1i32; bucket];
        for (i, &slot) in slots.iter().enumerate() {
            pos[i] = self.cache.n_tokens(slot).map_err(gpu)? as i32;
            rows[i] = self.cache.plan_append(slot, 1, i).map_err(gpu)?;
            ids[i] = (i * 7919 % self.model.config.n_vocab) as i32;
            slot_of[i] = slot as i32;
        }
        let pages = self.cache.max_pages(slots);
        self.launch_step(bucket, pages, &ids, &pos, &rows, &slot_of, part)?;
        let st = self.stream.clone();
        st.synchronize().map_err(drv("synchronize"))?;
        let key = (bucket, self.page_bucket(pages), part);
        let g = self.graphs.get(&key).ok_or_else(|| {
            LlmError::Gpu(veloxquant_cuda::CudaError::Driver {
                op: "time_step",
                err: "no graph captured for this step".into(),
            })
        })?;
        let ctx = &self.model.dev.ctx;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters + 3 {
            let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let e0 = ctx.new_event(timing).map_err(drv("event"))?;
            let e1 = ctx.new_event(timing).map_err(drv("event"))?;
            e0.record(&st).map_err(drv("record"))?;
            g.graph.launch().map_err(drv("graph launch"))?;
            e1.record(&st).map_err(drv("record"))?;
            e1.synchronize().map_err(drv("sync"))?;
            times.push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))?);
        }
        Ok(times.split_off(3))
    }
}
