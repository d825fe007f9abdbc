//! The scheduler: one thread, one loop, continuous batching.
//!
//! Each turn: take new commands; drop requests whose client went away or whose time ran
//! out (their pages are freed at once); admit waiting requests while the KV budget allows
//! (a request reserves its prompt plus `max_tokens`; prefix hits fork cached pages
//! instead); then one batched forward — one decode token for every decoding sequence and
//! the next prefill chunk of prefilling ones, within a per-step prefill budget so a long
//! prompt never stalls the others for more than a chunk — and sample, stream, finish.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use veloxquant_llm::Tokenizer;

use crate::engine::{Engine, Out, SeqId, Want, Work};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix::{block_hashes, common_blocks, PrefixCache};
use crate::sampling::{Sampler, SamplingParams};
use crate::slots::{SlotAction, SlotEntry, Slots};
use crate::text::{Detokenizer, StopMatcher};

mod admit;

/// How the scheduler is bounded.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Sequences prefilling or decoding at once.
    pub max_running: usize,
    /// KV-cache bytes for live sequences, prefix checkpoints and slots together.
    pub kv_budget_bytes: usize,
    /// Tokens of one prompt per forward (a multiple of the page size).
    pub prefill_chunk: usize,
    /// Prompt tokens over all sequences per forward.
    pub step_prefill_tokens: usize,
    pub request_timeout: Duration,
    /// Checkpoints kept for prefix sharing (0: off).
    pub max_prefixes: usize,
    /// Ids that end generation (EOS, `<|im_end|>`); not part of the text.
    pub stop_ids: Vec<u32>,
    /// How long in-flight requests may run after a shutdown signal.
    pub shutdown_grace: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    Stop,
    Length,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens taken from cached pages (prefix cache or slot).
    pub cached_tokens: usize,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done { finish: Finish, usage: Usage, ids: Vec<u32> },
    Error(ApiError),
}

pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Already clamped to the context.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub slot: Option<usize>,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

pub enum Command {
    Generate(GenRequest),
    Slot {
        id: usize,
        action: SlotAction,
        reply: tokio::sync::oneshot::Sender<Result<serde_json::Value, ApiError>>,
    },
    /// Stop admitting; finish in-flight work within the grace period, then return.
    Shutdown,
}

struct Active {
    req: GenRequest,
    seq: SeqId,
    /// Prompt tokens in the cache.
    fed: usize,
    cached: usize,
    hashes: Vec<u64>,
    generated: Vec<u32>,
    /// Sampled and not yet fed.
    next: Option<u32>,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopMatcher,
    /// The text of a token it was fed met a stop sequence (found while the step ran).
    text_stopped: bool,
}

impl Active {
    fn reserve(&self) -> usize {
        self.req.prompt.len() + self.req.max_tokens
    }
}

pub struct Scheduler<E: Engine> {
    engine: E,
    tok: Arc<Tokenizer>,
    cfg: SchedConfig,
    metrics: Arc<Metrics>,
    rx: UnboundedReceiver<Command>,
    queue: VecDeque<GenRequest>,
    running: Vec<Active>,
    prefix: PrefixCache,
    /// When the KV gauges were last published, and the running count then.
    published: (Instant, usize),
    slots: Slots,
    stopping: Option<Instant>,
}

fn queue_dec(m: &Metrics) {
    m.queue_length.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
}

impl<E: Engine> Scheduler<E> {
    pub fn new(
        engine: E,
        tok: Arc<Tokenizer>,
        cfg: SchedConfig,
        metrics: Arc<Metrics>,
        rx: UnboundedReceiver<Command>,
        slots: Slots,
    ) -> Self {
        let t = engine.info().page_tokens;
        Metrics::set(&metrics.kv_budget_bytes, cfg.kv_budget_bytes as u64);
        let prefix = PrefixCache::new(t, cfg.max_prefixes);
        Self {
            engine,
            tok,
            cfg,
            metrics,
            rx,
            queue: VecDeque::new(),
            running: Vec::new(),
            prefix,
            published: (Instant::now(), 0),
            slots,
            stopping: None,
        }
    }

    /// Runs until shut down (or every sender is gone) and in-flight work is over.
    pub fn run(mut self) {
        loop {
            let idle = self.running.is_empty() && self.queue.is_empty();
            if idle && self.stopping.is_some() {
                break;
            }
            if idle {
                match self.rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            self.reap();
            let t0 = Instant::now();
            self.admit();
            Metrics::add(&self.metrics.admit_micros_total, t0.elapsed().as_micros() as u64);
            if !self.running.is_empty() {
                // A panic inside the engine must not take the server down: the step's
                // sequences may be half-appended, so their requests fail (500) and go.
                let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step()));
                if let Err(p) = stepped {
                    let what =
                        p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    let what = what.unwrap_or_else(|| "a panic".into());
                    eprintln!("veloxquant serve: a step panicked ({what}); its requests fail, the server goes on");
                    for a in std::mem::take(&mut self.running) {
                        Metrics::inc(&self.metrics.requests_failed_total);
                        let _ = a.req.events.send(Event::Error(ApiError::internal(format!("internal error: {what}"))));
                        self.engine.remove(a.seq);
                    }
                }
            }
            // The gauges walk every sequence's pages (~0.2 ms at 250 sequences on the GPU
            // engine): refreshed when sequences came or went or none run, else every
            // PUBLISH_EVERY.
            let t0 = Instant::now();
            let changed = self.running.len() != self.published.1 || self.running.is_empty();
            if changed || self.published.0.elapsed() >= PUBLISH_EVERY {
                self.publish();
                self.published = (t0, self.running.len());
            }
            Metrics::add(&self.metrics.publish_micros_total, t0.elapsed().as_micros() as u64);
        }
        for a in std::mem::take(&mut self.running) {
            self.engine.remove(a.seq);
        }
        self.publish();
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(r) if self.stopping.is_some() => {
                queue_dec(&self.metrics);
                Metrics::inc(&self.metrics.requests_rejected_total);
                let _ = r.events.send(Event::Error(ApiError::busy("the server is shutting down")));
            }
            Command::Generate(r) => self.queue.push_back(r),
            Command::Slot { id, action, reply } => {
                let busy = self.running.iter().any(|a| a.req.slot == Some(id));
                let res = if busy {
                    Err(ApiError::with_status(axum::http::StatusCode::CONFLICT, format!("slot {id} is in use")))
                } else {
                    let room = self.cfg.kv_budget_bytes.saturating_sub(self.used_bytes() + self.growth());
                    self.slots.act(&mut self.engine, id, action, room)
                };
                let _ = reply.send(res);
            }
            Command::Shutdown => self.stopping = Some(Instant::now()),
        }
    }

    /// Cancels requests whose client is gone, that ran out of time, or that outlived the
    /// shutdown grace period.
    fn reap(&mut self) {
        let now = Instant::now();
        let timeout = self.cfg.request_timeout;
        let past_grace = self.stopping.is_some_and(|t| now.duration_since(t) > self.cfg.shutdown_grace);
        let verdict = |r: &GenRequest| -> Option<Option<ApiError>> {
            if r.events.is_closed() {
                Some(None)
            } else if now.duration_since(r.received) > timeout {
                Some(Some(ApiError::timeout()))
            } else if past_grace {
                Some(Some(ApiError::busy("the server shut down before the request finished")))
            } else {
                None
            }
        };
        let m = self.metrics.clone();
        let drop_one = |r: &GenRequest, err: Option<ApiError>| match err {
            None => Metrics::inc(&m.requests_cancelled_total),
            Some(e) => {
                Metrics::inc(&m.requests_failed_total);
                let _ = r.events.send(Event::Error(e));
            }
        };
        self.queue.retain(|r| match verdict(r) {
            None => true,
            Some(err) => {
                queue_dec(&m);
                drop_one(r, err);
                false
            }
        });
        let mut keep = Vec::with_capacity(self.running.len());
        for a in std::mem::take(&mut self.running) {
            match verdict(&a.req) {
                None => keep.push(a),
                Some(err) => {
                    drop_one(&a.req, err);
                    self.engine.remove(a.seq);
                }
            }
        }
        self.running = keep;
    }

    /// Where a prefill chunk starting at `fed` ends: the next chunk boundary, the last page
    /// boundary before the prompt's end (a checkpoint), the prompt's end, or the budget.
    fn chunk_end(&self, a: &Active, budget: usize) -> usize {
        let (len, c, t) = (a.req.prompt.len(), self.cfg.prefill_chunk, self.engine.info().page_tokens);
        let last_page = (len - 1) / t * t;
        let mut end = ((a.fed / c + 1) * c).min(len).min(a.fed + budget);
        if a.fed < last_page && last_page < end {
            end = last_page;
        }
        end
    }

    fn step(&mut self) {
        let mut budget = self.cfg.step_prefill_tokens;
        // (index into running, start, end) for prefill chunks; decode rows use `next`.
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (i, a) in self.running.iter().enumerate() {
            if a.fed < a.req.prompt.len() {
                if budget == 0 {
                    continue;
                }
                let end = self.chunk_end(a, budget);
                budget -= end - a.fed;
                plan.push((i, a.fed, end));
            } else if a.next.is_some() {
                plan.push((i, 0, 0));
            }
        }
        if plan.is_empty() {
            return;
        }
        // The work's tokens owned (prompt chunks copied): the text of the last step's tokens is
        // handled, borrowing the running requests, while the engine computes this one.
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|&(i, s, e)| {
                let a = &self.running[i];
                if e > s {
                    a.req.prompt[s..e].to_vec()
                } else {
                    vec![a.next.unwrap_or(0)]
                }
            })
            .collect();
        let work: Vec<Work<'_>> = plan
            .iter()
            .zip(&tokens)
            .map(|(&(i, s, e), t)| {
                let a = &self.running[i];
                let want = if a.sampler.is_greedy() {
                    Want::Greedy
                } else {
                    Want::Sample(a.sampler.params(), a.sampler.draws())
                };
                let want = if e > s && e < a.req.prompt.len() { Want::Nothing } else { want };
                Work { seq: a.seq, tokens: t, want }
            })
            .collect();
        let rows = work.len();
        let prefilled: usize = plan.iter().map(|&(_, s, e)| e - s).sum();
        let ctx = OutputCtx {
            n_ctx: self.engine.info().n_ctx,
            tok: self.tok.clone(),
            stop_ids: self.cfg.stop_ids.clone(),
            metrics: self.metrics.clone(),
        };
        let running = &mut self.running;
        let mut text_micros = 0u64;
        let t0 = Instant::now();
        let result = self.engine.forward_overlapped(&work, &mut || {
            let t = Instant::now();
            ctx.stream_pending(running);
            text_micros = t.elapsed().as_micros() as u64;
        });
        let micros = t0.elapsed().as_micros() as u64;
        drop(work);
        Metrics::add(&self.metrics.text_micros_total, text_micros);
        Metrics::add(&self.metrics.forward_micros_total, micros);
        self.metrics.forward_micros_max.fetch_max(micros, std::sync::atomic::Ordering::Relaxed);
        Metrics::inc(&self.metrics.steps_total);
        Metrics::add(&self.metrics.step_rows_total, rows as u64);
        if prefilled > 0 {
            let p = self.engine.prefill_phases();
            Metrics::set(&self.metrics.prefill_plan_micros_total, p.plan);
            Metrics::set(&self.metrics.prefill_queue_micros_total, p.queue);
            Metrics::set(&self.metrics.prefill_wait_micros_total, p.wait);
        }
        Metrics::add(&self.metrics.prefill_tokens_total, prefilled as u64);
        if prefilled == 0 {
            Metrics::inc(&self.metrics.decode_steps_total);
            Metrics::add(&self.metrics.decode_step_rows_total, rows as u64);
            Metrics::add(&self.metrics.decode_micros_total, micros);
        }
        let outs = match result {
            Ok(o) => o,
            Err(e) => {
                // An engine failure ends every request in the step; the server goes on.
                let mut failed: Vec<usize> = plan.iter().map(|p| p.0).collect();
                failed.sort_unstable();
                for &i in failed.iter().rev() {
                    let a = self.running.swap_remove(i);
                    Metrics::inc(&self.metrics.requests_failed_total);
                    let _ = a.req.events.send(Event::Error(ApiError::internal(format!("engine: {e}"))));
                    self.engine.remove(a.seq);
                }
                return;
            }
        };
        let t0 = Instant::now();
        let mut done = Vec::new();
        for (&(i, s, e), out) in plan.iter().zip(outs) {
            if e > s {
                self.running[i].fed = e;
                self.checkpoint(i);
                if e < self.running[i].req.prompt.len() {
                    continue;
                }
            } else {
                let a = &mut self.running[i];
                a.generated.push(a.next.take().unwrap_or(0));
                if a.text_stopped {
                    // Its last token's text met a stop sequence while this step ran: the
                    // step's token for it is dropped.
                    done.push((i, Finish::Stop));
                    continue;
                }
            }
            let n_cached = self.engine.n_tokens(self.running[i].seq);
            if let Some(f) = ctx.on_output(&mut self.running[i], out, n_cached) {
                done.push((i, f));
            }
        }
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, f) in done {
            let a = self.running.swap_remove(i);
            self.finish(a, f);
        }
        Metrics::add(&self.metrics.output_micros_total, t0.elapsed().as_micros() as u64);
    }

    /// After a prefill chunk: leave a checkpoint if it ended on a chunk boundary or on the
    /// prompt's last page boundary.
    fn checkpoint(&mut self, i: usize) {
        let (t, c) = (self.engine.info().page_tokens, self.cfg.prefill_chunk);
        let a = &self.running[i];
        let (n, len) = (a.fed, a.req.prompt.len());
        let on_boundary = n % c == 0 || n == (len - 1) / t * t;
        if self.cfg.max_prefixes == 0 || n < t || n % t != 0 || !on_boundary || n == a.cached {
            return;
        }
        let hash = a.hashes[n / t - 1];
        if self.prefix.contains(hash) || !self.seq_room(1) {
            return;
        }
        // A fork copies the exact tail now and, later, the open page either side writes.
        let cost = self.engine.bytes_for_tokens(0);
        if self.used_bytes() + self.growth() + cost > self.cfg.kv_budget_bytes {
            return;
        }
        let (seq, tokens) = (a.seq, a.req.prompt[..n].to_vec());
        if let Ok(f) = self.engine.fork(seq) {
            for s in self.prefix.insert(hash, f, tokens) {
                self.engine.remove(s);
            }
        }
    }

    fn finish(&mut self, mut a: Active, finish: Finish) {
        let rest = a.stops.flush();
        if !rest.is_empty() {
            let _ = a.req.events.send(Event::Text(rest));
        }
        let usage =
            Usage { prompt_tokens: a.req.prompt.len(), completion_tokens: a.generated.len(), cached_tokens: a.cached };
        let _ = a.req.events.send(Event::Done { finish, usage, ids: a.generated.clone() });
        match a.req.slot {
            Some(id) => {
                let n = self.engine.n_tokens(a.seq);
                let mut tokens = std::mem::take(&mut a.req.prompt);
                tokens.extend_from_slice(&a.generated);
                tokens.truncate(n);
                if let Some(old) = self.slots.park(id, SlotEntry { seq: a.seq, tokens }) {
                    self.engine.remove(old);
                }
            }
            None => self.engine.remove(a.seq),
        }
    }

    fn publish(&mut self) {
        let m = self.metrics.clone();
        let live = self.live_seqs();
        let in_use = self.engine.kv_bytes(&live);
        let mut all = live;
        all.extend(self.held_seqs());
        let mut total = self.engine.kv_bytes(&all);
        m.kv_bytes_peak.fetch_max(total as u64, std::sync::atomic::Ordering::Relaxed);
        // A safety valve: checkpoints give way before the budget is exceeded for long.
        while total > self.cfg.kv_budget_bytes && !self.prefix.is_empty() {
            if let Some(s) = self.prefix.evict_lru() {
                self.engine.remove(s);
            }
            total = self.used_bytes();
        }
        let fp16 = self.engine.info().fp16_bytes_per_token;
        let tokens: usize = self.running.iter().map(|a| self.engine.n_tokens(a.seq)).sum();
        Metrics::set(&m.sequences_running, self.running.len() as u64);
        Metrics::set(&m.kv_bytes_in_use, in_use as u64);
        Metrics::set(&m.kv_bytes_cached, total.saturating_sub(in_use) as u64);
        Metrics::set(&m.kv_bytes_fp16_equivalent, (tokens * fp16) as u64);
    }
}

/// How often the KV gauges are refreshed while the running set stays the same.
const PUBLISH_EVERY: Duration = Duration::from_millis(20);

/// What a row's output handling reads (owned: the rows' handling borrows the scheduler).
struct OutputCtx {
    n_ctx: usize,
    tok: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    metrics: Arc<Metrics>,
}

impl OutputCtx {
    /// The model's output for a sequence's last position (`n_cached` tokens in its cache):
    /// choose, and finish (its text sent now) or go on (its text sent while the next step
    /// runs: `stream_pending`).
    fn on_output(&self, a: &mut Active, out: Out, n_cached: usize) -> Option<Finish> {
        let Some(id) = out.token else { return Some(Finish::Length) };
        if !a.sampler.is_greedy() {
            a.sampler.note_draw();
        }
        if self.stop_ids.contains(&id) {
            return Some(Finish::Stop);
        }
        Metrics::inc(&self.metrics.generated_tokens_total);
        if a.generated.len() + 1 >= a.req.max_tokens || n_cached + 1 >= self.n_ctx {
            a.generated.push(id);
            return Some(if self.stream(a, id) { Finish::Stop } else { Finish::Length });
        }
        a.next = Some(id);
        None
    }

    /// `id`'s text onto the request's, what may be sent sent; true when a stop sequence was met.
    fn stream(&self, a: &mut Active, id: u32) -> bool {
        let decode = |ids: &[u32]| self.tok.decode(ids).ok();
        let piece = a.detok.push(id, &decode);
        let emit = a.stops.push(&piece);
        if !emit.text.is_empty() {
            let _ = a.req.events.send(Event::Text(emit.text));
        }
        emit.stopped
    }

    /// The text of the tokens the running requests are being fed (chosen last step: a
    /// request's `next` is sent exactly once, in the step that feeds it).
    fn stream_pending(&self, running: &mut [Active]) {
        for a in running.iter_mut() {
            if let Some(id) = a.next {
                a.text_stopped = self.stream(a, id);
            }
        }
    }
}
