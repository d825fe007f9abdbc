//! `veloxquant serve`: the OpenAI-compatible server (crate `veloxquant-serve`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use veloxquant::{CacheConfig, FormatSpec};
use veloxquant_llm::{model_fingerprint, Llama, LlamaConfig, Tokenizer};
use veloxquant_serve::{chat_template, CpuEngine, ServeConfig};

use crate::model::{Method, ModelArgs, DEFAULT_METHOD};
use crate::util::AnyResult;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind (loopback by default; expose deliberately).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The KV cache of every sequence: `fp16` or `KSPEC[/VSPEC][@R][+S]`.
    #[arg(long, default_value = DEFAULT_METHOD)]
    pub method: String,
    #[arg(long, value_enum, default_value_t = crate::gpu::Device::Cpu)]
    pub device: crate::gpu::Device,
    /// How the CPU holds the weights, as `generate --weights`. Default `f32`: a request's
    /// tokens are then the same alone or batched (`q8` decodes ~10× faster per sequence here,
    /// but a step's row count picks its products' kernels, so batching changes rounding).
    #[arg(long, value_enum, default_value_t = crate::demo::Weights::F32)]
    pub weights: crate::demo::Weights,
    /// KV-cache memory for live sequences, prefix checkpoints and slots together.
    #[arg(long, default_value_t = 1024)]
    pub kv_budget_mib: usize,
    /// Sequences prefilling or decoding at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests waiting for admission; beyond that, 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Prompt tokens of one sequence per forward (a multiple of 32) [default: 256 on the CPU,
    /// 4096 with --device cuda].
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Prompt tokens over all sequences per forward (bounds the stall decoders see) [default:
    /// 256 on the CPU, 8192 with --device cuda].
    #[arg(long)]
    pub step_prefill_tokens: Option<usize>,
    /// Prefix checkpoints kept for sharing (0: prefix sharing off).
    #[arg(long, default_value_t = 64)]
    pub max_prefixes: usize,
    /// Seconds a request may take from arrival to its last token.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Seconds in-flight requests may run on after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_s: u64,
    /// Require `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Folder for `POST /slots/{id}?action=save|restore` files.
    #[arg(long)]
    pub slot_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub max_slots: usize,
    /// The name clients pass as `model` (default: the GGUF's file stem).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Longest sequence served (default: the model's context).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// `max_tokens` of chat requests that give none.
    #[arg(long, default_value_t = 512)]
    pub default_max_tokens: usize,
    #[arg(long, default_value_t = 1024)]
    pub max_body_kib: usize,
    /// `--device cuda`: sequence slots of the device cache (live + prefix checkpoints + slots).
    #[arg(long, default_value_t = 320)]
    pub gpu_slots: usize,
}

/// The CPU cache config of a method (fp16 is the paged fp16 format: forks share its pages).
fn cache_config(m: &Method, c: &LlamaConfig) -> AnyResult<CacheConfig> {
    match m.cache_config_for(c, None) {
        Some(cfg) => Ok(cfg),
        None => {
            let fp16 = || FormatSpec::parse("fp16");
            Ok(CacheConfig::new(c.n_layers, c.n_kv_heads, c.head_dim, fp16()?, fp16()?))
        }
    }
}

pub fn run(a: &ServeArgs, path: &std::path::Path) -> AnyResult {
    let method = Method::parse("method", &a.method)?;
    if method.needs_calibration() {
        return Err(
            "serve does not calibrate: pick a method without a calibrated format (vecinfer, turboquant_frac)".into()
        );
    }
    let path = path.to_path_buf();
    let tok = Arc::new(Tokenizer::from_gguf_path(&path)?);
    let name = a.model_name.clone().unwrap_or_else(|| {
        path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let mut cfg = ServeConfig::new(&name, &tok, chat_template(&path)?);
    cfg.api_key = a.api_key.clone();
    cfg.max_body_bytes = a.max_body_kib << 10;
    cfg.max_queue = a.max_queue;
    cfg.max_slots = a.max_slots;
    cfg.default_max_tokens = a.default_max_tokens;
    cfg.slot_dir = a.slot_dir.clone();
    cfg.fingerprint = Some(model_fingerprint(&path)?);
    cfg.max_context = a.max_context;
    let s = &mut cfg.sched;
    s.max_running = a.max_running;
    s.kv_budget_bytes = a.kv_budget_mib << 20;
    // The GPU's defaults, measured under load (benchmarks/results/serve-gpu-notes.md): each
    // chunk re-reads the prompt's coded pages, and the GPU's forward costs little more for
    // 8k rows than for 256, so larger chunks cut prefill time and time to first token alike.
    let (chunk, step) = if a.device == crate::gpu::Device::Cuda { (4096, 8192) } else { (256, 256) };
    s.prefill_chunk = a.prefill_chunk.unwrap_or(chunk);
    s.step_prefill_tokens = a.step_prefill_tokens.unwrap_or(step);
    s.max_prefixes = a.max_prefixes;
    s.request_timeout = Duration::from_secs(a.timeout_s);
    s.shutdown_grace = Duration::from_secs(a.shutdown_grace_s);
    if let Some(d) = &a.slot_dir {
        std::fs::create_dir_all(d).map_err(|e| format!("--slot-dir {}: {e}", d.display()))?;
    }
    let bind = SocketAddr::new(a.host, a.port);
    eprintln!("method {method} · KV budget {} MiB · device {:?}", a.kv_budget_mib, a.device);
    if a.device == crate::gpu::Device::Cuda {
        return serve_cuda(a, &method, &path, cfg, tok, bind);
    }
    let model = Arc::new(Llama::load(&path, a.weights.mode())?);
    let cache = cache_config(&method, &model.config)?;
    veloxquant_serve::serve_blocking(cfg, move || CpuEngine::new(model, cache), tok, bind)?;
    Ok(())
}

#[cfg(feature = "cuda")]
fn serve_cuda(
    a: &ServeArgs,
    method: &Method,
    path: &std::path::Path,
    cfg: ServeConfig,
    tok: Arc<Tokenizer>,
    bind: SocketAddr,
) -> AnyResult {
    use veloxquant_llm::gpu::{GpuMethod, GpuModel};
    use veloxquant_serve::{gpu_engine::GpuServeEngine, ServeError};
    let gm = match method {
        Method::Fp16 => GpuMethod::fp16(),
        m => crate::gpu::gpu_method(m)?,
    };
    let (path, slots, budget, max_context) =
        (path.to_path_buf(), a.gpu_slots, cfg.sched.kv_budget_bytes, a.max_context);
    let prefill = (cfg.sched.prefill_chunk, cfg.sched.step_prefill_tokens);
    // Device, weights and engine live on the scheduler's thread (CUDA graphs stay there).
    let make = move || {
        let dev = veloxquant_cuda::GpuDevice::new(0).map_err(|e| ServeError::Engine(format!("--device cuda: {e}")))?;
        let model = Arc::new(GpuModel::load(&dev, &path)?);
        let ctx = max_context.unwrap_or(model.config.n_ctx_train).min(model.config.n_ctx_train);
        GpuServeEngine::new(model, gm, slots, ctx, budget, prefill)
    };
    veloxquant_serve::serve_blocking(cfg, make, tok, bind)?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn serve_cuda(
    _: &ServeArgs,
    _: &Method,
    _: &std::path::Path,
    _: ServeConfig,
    _: Arc<Tokenizer>,
    _: SocketAddr,
) -> AnyResult {
    Err("this build has no GPU support: rebuild with `--features cuda`".into())
}
