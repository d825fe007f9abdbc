//! `veloxquant cache save | load | inspect`: a prompt's compressed KV cache persisted to a
//! file and continued in another process.
//!
//! `save` prefills all prompt tokens but the last and writes the cache, with the prompt's
//! ids and the pending last token in the file's metadata; `load` checks the file against the
//! model, feeds the pending token as a decode step and generates. Both print the generated
//! ids on a `tokens:` line, so a save-then-continue run and a load-and-continue run compare
//! directly.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;

use veloxquant::cache::{LoadCheck, SaveInfo};
use veloxquant::{FormatSpec, PagedCache};
use veloxquant_llm::generate::continue_ids;
use veloxquant_llm::{model_fingerprint, CompressedStore, Greedy, KvStore, Llama, Tokenizer};

use crate::demo::GenerateArgs;
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

pub fn run(cmd: &CacheCmd) -> AnyResult {
    match cmd {
        CacheCmd::Save { file, gen } => save(file, &gen.model, &gen.prompt, &gen.method, gen.max_tokens),
        CacheCmd::Load { file, model, max_tokens } => load(file, model, *max_tokens),
        CacheCmd::Inspect { file } => inspect(file),
    }
}

fn save(file: &PathBuf, args: &ModelArgs, prompt: &str, method: &str, max_tokens: usize) -> AnyResult {
    let method = match Method::parse(method)? {
        Method::Fp16 => {
            Method::Compressed { k: FormatSpec::parse("fp16")?, v: FormatSpec::parse("fp16")?, recent: 0, sink: 0 }
        }
        m if m.needs_calibration() => {
            return Err("cache save does not calibrate: pick a method without vecinfer".into())
        }
        m => m,
    };
    let path = args.path()?;
    let (model, tok) = args.load()?;
    let ids = tok.encode(prompt)?;
    let Some((&next, context)) = ids.split_last() else { return Err("empty prompt".into()) };
    if context.is_empty() {
        return Err("the prompt needs at least two tokens (the cache holds all but the last)".into());
    }
    let cfg = method.cache_config_for(&model.config, None).ok_or("fp16 was mapped to a compressed method")?;
    let mut store = CompressedStore::new(cfg)?;
    for chunk in context.chunks(veloxquant_llm::generate::PREFILL_CHUNK) {
        model.forward(chunk, &mut store, chunk.len() - 1)?;
    }
    let info = SaveInfo {
        model: Some(model_fingerprint(&path)?),
        user: [
            ("method".to_string(), method.to_string()),
            ("context_ids".to_string(), join_ids(context)),
            ("next_token".to_string(), next.to_string()),
        ]
        .into(),
    };
    let t0 = std::time::Instant::now();
    let mut w = BufWriter::new(File::create(file).map_err(|e| format!("{}: {e}", file.display()))?);
    let bytes = store.cache().save(&mut w, &info)?;
    drop(w);
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

fn load(file: &PathBuf, args: &ModelArgs, max_tokens: usize) -> AnyResult {
    let path = args.path()?;
    let (model, tok) = args.load()?;
    let c = &model.config;
    let check = LoadCheck {
        n_layers: Some(c.n_layers),
        n_kv_heads: Some(c.n_kv_heads),
        head_dim: Some(c.head_dim),
        model: Some(model_fingerprint(&path)?),
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
    let stop: Vec<u32> = tok.eos.into_iter().chain(tok.token_id("<|im_end|>")).collect();
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
