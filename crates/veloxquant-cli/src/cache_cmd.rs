//! `veloxquant cache save | load | inspect`: a prompt's compressed KV cache persisted to a
//! file and continued in another process.
//!
//! `save` prefills all prompt tokens but the last and writes the cache, with the prompt's
//! ids and the pending last token in the file's metadata; `load` checks the file against the
//! model, feeds the pending token as a decode step and generates. Both print the generated
//! ids on a `tokens:` line, so a save-then-continue run and a load-and-continue run compare
//! directly.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::{FormatSpec, PagedCache};
use veloxquant_llm::generate::continue_ids;
use veloxquant_llm::{model_fingerprint, CompressedStore, Greedy, KvStore, Llama, Tokenizer};

use crate::check::{ArgError, Ctx};
use crate::demo::{GenPlan, GenerateArgs};
use crate::files::{check_input, write_atomic, OutputKind};
use crate::model::{Method, ModelArgs};
use crate::util::AnyResult;

#[derive(clap::Subcommand)]
pub enum CacheCmd {
    /// Prefill a prompt with a compressed cache (`fp16` means fp16 pages), save the cache to
    /// FILE, then generate `--max-tokens` from the in-memory cache (0: only save).
    Save {
        file: PathBuf,
        #[command(flatten)]
        gen: GenerateArgs,
    },
    /// Load a saved cache (checked against the model) and continue generating.
    Load {
        file: PathBuf,
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
    },
    /// Print a cache file's layers, formats, bits, bytes and tokens; verifies its checksum.
    Inspect { file: PathBuf },
}

impl CacheCmd {
    /// The model a subcommand runs (inspect needs none).
    pub fn model_args(&self) -> Option<&ModelArgs> {
        match self {
            Self::Save { gen, .. } => Some(&gen.model),
            Self::Load { model, .. } => Some(model),
            Self::Inspect { .. } => None,
        }
    }

    /// `save`: a prompt of at least 2 tokens and the continuation within the context, a
    /// file that may be (re)written as a cache; `load`, `inspect`: a regular file.
    pub fn plan(&self, ctx: &Ctx) -> Result<Option<GenPlan>, ArgError> {
        match self {
            Self::Save { file, gen } => {
                ctx.output(Some(file), OutputKind::Cache, &[])?;
                let mut p = gen.plan(ctx, 0, 2)?;
                if p.method == Method::Fp16 {
                    let fp16 = FormatSpec::parse("fp16").map_err(|source| ArgError::Spec {
                        arg: "method",
                        value: "fp16".into(),
                        source,
                    })?;
                    p.method = Method::Compressed { k: fp16.clone(), v: fp16, recent: 0, sink: 0 };
                }
                Ok(Some(p))
            }
            Self::Load { file, max_tokens, .. } => {
                check_input(file, "cache file")?;
                ctx.within_context("max-tokens", *max_tokens, 0, 1)?;
                Ok(None)
            }
            Self::Inspect { file } => check_input(file, "cache file").map(|_| None),
        }
    }
}

pub fn run(cmd: &CacheCmd, plan: Option<&GenPlan>, model_path: Option<&Path>) -> AnyResult {
    match (cmd, plan, model_path) {
        (CacheCmd::Save { file, gen }, Some(p), Some(m)) => save(file, m, &gen.prompt, p),
        (CacheCmd::Load { file, max_tokens, .. }, _, Some(m)) => load(file, m, *max_tokens),
        (CacheCmd::Inspect { file }, _, _) => inspect(file),
        _ => Err("cache: no plan or model for this subcommand".into()),
    }
}

fn save(file: &Path, path: &Path, prompt: &str, p: &GenPlan) -> AnyResult {
    let (method, max_tokens) = (&p.method, p.max_tokens);
    let (model, tok) = crate::model::load(path)?;
    let ids = tok.encode(prompt)?;
    let Some((&next, context)) = ids.split_last() else { return Err("empty prompt".into()) };
    if context.is_empty() {
        return Err("the prompt needs at least two tokens (the cache holds all but the last)".into());
    }
    // The prompt and the continuation must fit the context: refused before the prefill.
    if ids.len() + max_tokens > model.config.n_ctx_train {
        return Err(format!(
            "the prompt's {} tokens and --max-tokens {max_tokens} exceed the model's context of {} tokens",
            ids.len(),
            model.config.n_ctx_train
        )
        .into());
    }
    let cfg = method.cache_config_for(&model.config, None).ok_or("fp16 was mapped to a compressed method")?;
    let mut store = CompressedStore::new(cfg)?;
    for chunk in context.chunks(veloxquant_llm::generate::PREFILL_CHUNK) {
        model.forward(chunk, &mut store, chunk.len() - 1)?;
    }
    let info = SaveInfo {
        model: Some(model_fingerprint(path)?),
        user: [
            ("method".to_string(), method.to_string()),
            ("context_ids".to_string(), join_ids(context)),
            ("next_token".to_string(), next.to_string()),
        ]
        .into(),
    };
    let t0 = std::time::Instant::now();
    let bytes = write_atomic(file, |w| Ok(store.cache().save(w, &info)?))?;
    println!(
        "saved {} tokens ({method}) to {} in {:.1} ms: {bytes} B on disk, {} B resident",
        context.len(),
        file.display(),
        t0.elapsed().as_secs_f64() * 1e3,
        store.resident_bytes()
    );
    if max_tokens > 0 {
        continue_and_print(&model, &tok, next, max_tokens, &mut store)?;
    }
    Ok(())
}

fn load(file: &PathBuf, path: &Path, max_tokens: usize) -> AnyResult {
    let (model, tok) = crate::model::load(path)?;
    let c = &model.config;
    let check = LoadCheck {
        n_layers: Some(c.n_layers),
        n_kv_heads: Some(c.n_kv_heads),
        head_dim: Some(c.head_dim),
        model: Some(model_fingerprint(path)?),
    };
    let t0 = std::time::Instant::now();
    let (cache, info) = open(file, &check)?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let meta = |k: &str| info.user.get(k).ok_or_else(|| format!("{}: no {k:?} in the file's metadata", file.display()));
    let next: u32 = meta("next_token")?.parse().map_err(|e| format!("next_token: {e}"))?;
    let n_ctx = meta("context_ids")?.split(',').filter(|s| !s.is_empty()).count();
    if cache.n_tokens(0)? != n_ctx {
        return Err(format!("the cache holds {} tokens, its metadata names {n_ctx}", cache.n_tokens(0)?).into());
    }
    println!("loaded {n_ctx} tokens ({}) from {} in {load_ms:.1} ms (checked)", meta("method")?, file.display());
    let mut store = CompressedStore::from_cache(cache);
    continue_and_print(&model, &tok, next, max_tokens, &mut store)
}

fn open(file: &PathBuf, check: &LoadCheck) -> AnyResult<(PagedCache, SaveInfo)> {
    let f = File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(PagedCache::load(&mut BufReader::new(f), check).map_err(|e| format!("{}: {e}", file.display()))?)
}

fn continue_and_print(
    model: &Llama,
    tok: &Tokenizer,
    next: u32,
    max_tokens: usize,
    store: &mut CompressedStore,
) -> AnyResult {
    let stop = tok.stop_ids();
    let out = continue_ids(model, next, max_tokens, &stop, store, &mut Greedy, &mut |_| true)?;
    println!("{}{}", tok.decode(&[next])?, tok.decode(&out)?);
    println!("tokens: {}", join_ids(&out));
    Ok(())
}

fn inspect(file: &PathBuf) -> AnyResult {
    let size = std::fs::metadata(file).map_err(|e| format!("{}: {e}", file.display()))?.len();
    let (cache, info) = open(file, &LoadCheck::default())?;
    let cfg = cache.config();
    let (kb, vb) = cache.bits_per_value();
    let (ek, ev) = cache.effective_bits();
    let tokens: Vec<usize> = (0..cfg.n_layers).map(|l| cache.n_tokens(l)).collect::<Result<_, _>>()?;
    let (lo, hi) = (tokens.iter().min().copied().unwrap_or(0), tokens.iter().max().copied().unwrap_or(0));
    println!(
        "file          {} ({size} B), format version {}, checksum ok",
        file.display(),
        veloxquant::cache::FILE_VERSION
    );
    println!("model         {}", info.model.as_deref().unwrap_or("(not recorded)"));
    println!(
        "shape         {} layers × {} KV heads × d {}, pages of {} tokens",
        cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.page_tokens
    );
    println!(
        "formats       K {} / V {}, window R = {}, sinks S = {}, {} mode",
        cfg.k,
        cfg.v,
        cfg.recent,
        cfg.sink,
        if cache.row_mode() { "row" } else { "page" }
    );
    if !cfg.is_uniform() {
        for l in 0..cfg.n_layers {
            let (k, v) = (cfg.spec(l, veloxquant::Stream::Keys), cfg.spec(l, veloxquant::Stream::Values));
            println!("  layer {l:<4}  K {k} / V {v}");
        }
    }
    println!("tokens        {}", if lo == hi { lo.to_string() } else { format!("{lo}..{hi} per layer") });
    println!("bits/value    pages K {kb:.3} / V {vb:.3}; resident K {ek:.3} / V {ev:.3}");
    println!("resident      {} B", cache.resident_bytes());
    for (k, v) in &info.user {
        let shown = if v.len() > 60 {
            format!("{}… ({} chars)", v.chars().take(60).collect::<String>(), v.len())
        } else {
            v.clone()
        };
        println!("meta {k:<8} {shown}");
    }
    Ok(())
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
