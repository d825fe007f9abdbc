//! The GPU engine behind the scheduler (feature `cuda`): `veloxquant_llm::gpu::GpuEngine`
//! — sequence slots in the device cache, chunked prefill, graph-replayed batched decode.
//! A step's decode rows go through one `GpuEngine::step` (greedy ids from the device;
//! logits downloaded only when a row samples), its prefill chunks through one `prefill`.

use std::sync::Arc;

use veloxquant::PagedCache;
use veloxquant_llm::gpu::{EngineConfig, GpuEngine, GpuMethod, GpuModel};

use crate::engine::{cache_bound, Engine, EngineInfo, Out, PrefillPhases, SeqId, Want, Work};
use crate::error::{Result, ServeError};

pub struct GpuServeEngine {
    engine: GpuEngine,
    info: EngineInfo,
    /// The CPU cache's bytes for n tokens (the device counts a slot the same way).
    bound: (usize, f64),
}

impl GpuServeEngine {
    /// `max_seqs` slots (live sequences, prefix checkpoints and slots together) of up to
    /// `max_context` tokens; the page pool sized so the cache stays within `kv_budget_bytes`.
    /// `prefill` = (chunk, tokens per step): the scheduler's, so one step's prefill is one
    /// forward of the engine.
    pub fn new(
        model: Arc<GpuModel>,
        method: GpuMethod,
        max_seqs: usize,
        max_context: usize,
        kv_budget_bytes: usize,
        prefill: (usize, usize),
    ) -> Result<Self> {
        let c = model.config.clone();
        let mut ecfg = EngineConfig::new(method, max_seqs, max_context);
        ecfg.prefill_chunk = prefill.0.clamp(1, max_context.max(1));
        ecfg.prefill_rows = prefill.1.max(ecfg.prefill_chunk);
        // One logits row per prefilled item (its last position); the decode rows' buffer
        // (max_seqs rows) covers them.
        ecfg.logits_rows = 1;
        let cpu = ecfg.cpu_cache(&c);
        let t = cpu.page_tokens;
        let bound = cache_bound(&cpu)?;
        // Pool: the budget over the coded bytes per token (the exact window is per slot).
        let per_token = bound.1.max(1e-9);
        let fixed = bound.0.saturating_mul(max_seqs);
        let pool = ((kv_budget_bytes.saturating_sub(fixed)) as f64 / per_token) as usize;
        if pool < max_context {
            return Err(ServeError::Config(format!(
                "--kv-budget-mib holds {pool} tokens after {max_seqs} slots' fixed bytes; one sequence needs {max_context}"
            )));
        }
        ecfg.pool_tokens = pool;
        let info = EngineInfo {
            n_ctx: max_context,
            page_tokens: t,
            max_seqs: Some(max_seqs),
            fp16_bytes_per_token: 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2,
            cache: cpu,
            device: "cuda",
        };
        let mut engine = GpuEngine::new(model, ecfg)?;
        let t0 = std::time::Instant::now();
        let graphs = engine.capture_all_steps()?;
        eprintln!("veloxquant serve: {graphs} decode step graphs captured in {:.2} s", t0.elapsed().as_secs_f64());
        Ok(Self { engine, info, bound })
    }

    fn err(e: veloxquant_llm::LlmError) -> ServeError {
        ServeError::Llm(e)
    }
}

impl Engine for GpuServeEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn add(&mut self) -> Result<SeqId> {
        self.engine.add_sequence().map_err(Self::err)
    }

    fn remove(&mut self, seq: SeqId) {
        let _ = self.engine.remove_sequence(seq);
    }

    fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        self.engine.fork(seq).map_err(Self::err)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.engine.trim(seq, n).map_err(Self::err)
    }

    fn n_tokens(&self, seq: SeqId) -> usize {
        self.engine.n_tokens(seq).unwrap_or(0)
    }

    fn forward(&mut self, work: &[Work<'_>]) -> Result<Vec<Out>> {
        self.forward_overlapped(work, &mut || {})
    }

    fn forward_overlapped(&mut self, work: &[Work<'_>], during: &mut dyn FnMut()) -> Result<Vec<Out>> {
        let mut outs = vec![Out::default(); work.len()];
        let pre: Vec<usize> = (0..work.len()).filter(|&i| work[i].tokens.len() > 1).collect();
        let dec: Vec<usize> = (0..work.len()).filter(|&i| work[i].tokens.len() == 1).collect();
        // The prefill's forward, then the decode rows' step, queued back to back: the device
        // runs both while the host streams text; prompts' first tokens are chosen there.
        let pending_pre = if pre.is_empty() {
            None
        } else {
            let items: Vec<(usize, &[u32], Want)> =
                pre.iter().map(|&i| (work[i].seq, work[i].tokens, work[i].want)).collect();
            Some(self.engine.prefill_launch(&items).map_err(Self::err)?)
        };
        if !dec.is_empty() {
            // Decode rows sample on the device: no logits cross to the host.
            let toks: Vec<(usize, u32)> = dec.iter().map(|&i| (work[i].seq, work[i].tokens[0])).collect();
            let sampling: Vec<_> = dec
                .iter()
                .map(|&i| match work[i].want {
                    Want::Sample(p, draw) => Some((p, draw)),
                    _ => None,
                })
                .collect();
            let pending = self.engine.step_launch(&toks, &sampling, false);
            let pending = match pending {
                Ok(p) => p,
                Err(e) => {
                    // The prefill was queued: read it back so the engine is left consistent.
                    if let Some(p) = pending_pre {
                        let _ = self.engine.prefill_collect(p);
                    }
                    return Err(Self::err(e));
                }
            };
            during();
            let st = self.engine.step_collect(pending).map_err(Self::err)?;
            for (j, &i) in dec.iter().enumerate() {
                outs[i] = Out { token: (work[i].want != Want::Nothing).then(|| st.ids[j]) };
            }
        } else {
            during();
        }
        if let Some(p) = pending_pre {
            let ids = self.engine.prefill_collect(p).map_err(Self::err)?;
            for (&i, id) in pre.iter().zip(ids) {
                outs[i] = Out { token: id };
            }
        }
        Ok(outs)
    }

    fn prefill_phases(&self) -> PrefillPhases {
        let t = self.engine.prefill_times;
        PrefillPhases { plan: t.plan_micros, queue: t.queue_micros, wait: t.wait_micros }
    }

    /// Slots' bytes with each shared page group split among its holders, so over a set
    /// that holds every sharer a group counts once.
    fn kv_bytes(&self, seqs: &[SeqId]) -> usize {
        let group = self.bound.1 * self.info.page_tokens as f64;
        seqs.iter()
            .map(|&s| {
                let whole = self.engine.cache.slot_bytes(s).unwrap_or(0) as f64;
                let refs = self.engine.cache.group_refs(s).unwrap_or_default();
                let shared: f64 = refs.iter().map(|&r| group * (1.0 - 1.0 / r.max(1) as f64)).sum();
                (whole - shared).max(0.0)
            })
            .sum::<f64>() as usize
    }

    fn bytes_for_tokens(&self, n_tokens: usize) -> usize {
        self.bound.0 + (self.bound.1 * n_tokens as f64).ceil() as usize
    }

    fn export(&self, seq: SeqId) -> Result<PagedCache> {
        self.engine.export(seq).map_err(Self::err)
    }

    fn import(&mut self, cache: PagedCache) -> Result<SeqId> {
        self.engine.import(&cache).map_err(Self::err)
    }
}
