//! `veloxquant serve`: an OpenAI-compatible HTTP server over the compressed paged KV cache.
//!
//! A thin layer (DESIGN.md, "The engine"): axum routes ([`http`]) turn requests into token
//! ids and hand them to one scheduler thread ([`scheduler`]) that batches every running
//! sequence into one forward per step, admits requests by KV-cache memory, shares prompt
//! prefixes by forking cached pages ([`prefix`]) and parks caches in slots ([`slots`]).
//! The model sits behind a small [`Engine`] trait: the CPU engine here, the GPU engine with
//! the `cuda` feature — the same scheduler drives both.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use veloxquant_serve::{CpuEngine, ServeConfig, Server};
//! let path = std::path::Path::new("model.gguf");
//! let model = Arc::new(veloxquant_llm::Llama::load(path, veloxquant_llm::WeightMode::DequantF32)?);
//! let tok = Arc::new(veloxquant_llm::Tokenizer::from_gguf_path(path)?);
//! let c = &model.config;
//! let cache = veloxquant::CacheConfig::new(c.n_layers, c.n_kv_heads, c.head_dim,
//!     veloxquant::FormatSpec::parse("turboquant_mse:4")?, veloxquant::FormatSpec::parse("turboquant_mse:3")?);
//! let cfg = ServeConfig::new("smollm2", &tok, veloxquant_serve::chat_template(path)?);
//! // The engine is built on the scheduler's thread (a GPU engine must stay on one thread).
//! let server = Server::spawn(cfg, move || CpuEngine::new(model, cache), tok, "127.0.0.1:0".parse()?)?;
//! println!("listening on {}", server.addr);
//! server.shutdown()?;
//! # Ok(()) }
//! ```

pub mod api;
pub mod chat;
pub mod engine;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu_engine;
pub mod http;
pub mod metrics;
pub mod prefix;
pub mod sampling;
pub mod scheduler;
pub mod slots;
pub mod text;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

pub use engine::{CpuEngine, Engine, EngineInfo};
pub use error::{ApiError, Result, ServeError};
pub use metrics::Metrics;
pub use scheduler::SchedConfig;
use veloxquant_llm::Tokenizer;

/// Everything `serve` is configured with.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The name clients pass as `model` (others get 404).
    pub model_id: String,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// Requests waiting for admission before new ones get 503.
    pub max_queue: usize,
    pub max_slots: usize,
    /// `max_tokens` of a chat request that gives none (completions: 16, as OpenAI).
    pub default_max_tokens: usize,
    pub slot_dir: Option<PathBuf>,
    /// The model's fingerprint, written into slot files and checked when restoring.
    pub fingerprint: Option<String>,
    /// Jinja chat template (None: ChatML).
    pub chat_template: Option<String>,
    /// Longest sequence served (≤ the model's context).
    pub max_context: Option<usize>,
    pub sched: SchedConfig,
}

impl ServeConfig {
    /// Defaults: 64 running sequences, a 1 GiB KV budget, chunks of 256 tokens, a queue of
    /// 256, 10 minutes per request, prefix sharing on.
    pub fn new(model_id: &str, tok: &Tokenizer, chat_template: Option<String>) -> Self {
        Self {
            model_id: model_id.to_string(),
            api_key: None,
            max_body_bytes: 1 << 20,
            max_queue: 256,
            max_slots: 64,
            default_max_tokens: 512,
            slot_dir: None,
            fingerprint: None,
            chat_template,
            max_context: None,
            sched: SchedConfig {
                max_running: 64,
                kv_budget_bytes: 1 << 30,
                prefill_chunk: 256,
                step_prefill_tokens: 256,
                request_timeout: Duration::from_secs(600),
                max_prefixes: 64,
                stop_ids: default_stop_ids(tok),
                shutdown_grace: Duration::from_secs(30),
            },
        }
    }
}

/// The ids that end a generation, as `veloxquant generate` uses: EOS and `<|im_end|>`.
pub fn default_stop_ids(tok: &Tokenizer) -> Vec<u32> {
    tok.eos.into_iter().chain(tok.token_id("<|im_end|>")).collect()
}

/// The GGUF's `tokenizer.chat_template`, if it has one.
pub fn chat_template(path: &Path) -> Result<Option<String>> {
    let g = veloxquant_llm::gguf::Gguf::open(path)?;
    let key = "tokenizer.chat_template";
    Ok(if g.has(key) { Some(g.str(key)?.to_string()) } else { None })
}

/// A running server (its own tokio runtime and scheduler thread).
pub struct Server {
    pub addr: SocketAddr,
    pub metrics: Arc<Metrics>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    /// Binds `addr` (port 0: any free port) and serves in the background until
    /// [`Server::shutdown`].
    pub fn spawn<E, F>(cfg: ServeConfig, make: F, tok: Arc<Tokenizer>, addr: SocketAddr) -> Result<Self>
    where
        E: Engine,
        F: FnOnce() -> Result<E> + Send + 'static,
    {
        let rt = runtime()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics = Arc::new(Metrics::default());
        let m = metrics.clone();
        let thread = std::thread::Builder::new().name("veloxquant-http".into()).spawn(move || {
            rt.block_on(serve_on(cfg, make, tok, listener, m, async {
                let _ = stopped.await;
            }))
        })?;
        Ok(Self { addr, metrics, stop: Some(stop), thread: Some(thread) })
    }

    /// Graceful shutdown: stop accepting, let in-flight requests finish (within the grace
    /// period), join.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServeError::Engine("the server thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // Two I/O threads: the model's work is on the scheduler thread and rayon's pool.
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// Serves on `bind` until SIGINT or SIGTERM, then shuts down gracefully (the CLI's entry).
pub fn serve_blocking<E, F>(cfg: ServeConfig, make: F, tok: Arc<Tokenizer>, bind: SocketAddr) -> Result<()>
where
    E: Engine,
    F: FnOnce() -> Result<E> + Send + 'static,
{
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(bind).await?;
        eprintln!("veloxquant serve: listening on http://{}", listener.local_addr()?);
        serve_on(cfg, make, tok, listener, Arc::new(Metrics::default()), shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    eprintln!("veloxquant serve: shutting down (finishing in-flight requests)");
}

async fn serve_on<E, F>(
    mut cfg: ServeConfig,
    make: F,
    tok: Arc<Tokenizer>,
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<()>
where
    E: Engine,
    F: FnOnce() -> Result<E> + Send + 'static,
{
    let t = cfg.sched.prefill_chunk;
    if t == 0 || !t.is_multiple_of(32) || cfg.sched.max_running == 0 {
        return Err(ServeError::Config(
            "prefill chunk must be a positive multiple of 32 (the page size); max running sequences > 0".into(),
        ));
    }
    cfg.sched.step_prefill_tokens = cfg.sched.step_prefill_tokens.max(1);
    let template = chat::ChatTemplate::new(cfg.chat_template.as_deref(), &tok)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let slots = slots::Slots::new(cfg.slot_dir.clone(), cfg.fingerprint.clone());
    let (info_tx, info_rx) = std::sync::mpsc::channel();
    let (sched_cfg, m, tk) = (cfg.sched.clone(), metrics.clone(), tok.clone());
    let worker = std::thread::Builder::new().name("veloxquant-scheduler".into()).spawn(move || {
        let engine = match make() {
            Ok(e) => e,
            Err(e) => {
                let _ = info_tx.send(Err(e));
                return;
            }
        };
        let _ = info_tx.send(Ok(engine.info().clone()));
        scheduler::Scheduler::new(engine, tk, sched_cfg, m, rx, slots).run();
    })?;
    let info: EngineInfo = tokio::task::spawn_blocking(move || info_rx.recv())
        .await
        .map_err(|e| ServeError::Engine(e.to_string()))?
        .map_err(|_| ServeError::Engine("the engine thread ended before starting".into()))??;
    if !cfg.sched.prefill_chunk.is_multiple_of(info.page_tokens.max(1)) {
        return Err(ServeError::Config(format!(
            "prefill chunk must be a multiple of the page size {}",
            info.page_tokens
        )));
    }
    let n_ctx = cfg.max_context.unwrap_or(info.n_ctx).min(info.n_ctx);
    let state = Arc::new(http::AppState {
        tx: tx.clone(),
        tok,
        template,
        model_id: cfg.model_id.clone(),
        n_ctx,
        metrics,
        api_key: cfg.api_key.as_deref().map(http::key_digest),
        max_queue: cfg.max_queue,
        max_slots: cfg.max_slots,
        default_max_tokens: cfg.default_max_tokens,
        seeds: AtomicU64::new(seed_from_clock()),
    });
    let app = http::router(state, cfg.max_body_bytes);
    let shutdown = async move {
        stop.await;
        let _ = tx.send(scheduler::Command::Shutdown);
    };
    let served = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    let joined = tokio::task::spawn_blocking(move || worker.join()).await;
    served?;
    match joined {
        Ok(Ok(())) => Ok(()),
        _ => Err(ServeError::Engine("the scheduler thread panicked".into())),
    }
}

fn seed_from_clock() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
}
