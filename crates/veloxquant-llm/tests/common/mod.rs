//! Shared test helpers: locating the model and the WikiText text, and saying so when a
//! test has to skip for want of them.
#![allow(dead_code)]

pub mod tiny;

use std::io::Write;
use std::path::PathBuf;
use std::sync::OnceLock;
use veloxquant_llm::{Llama, Tokenizer, WeightMode};

/// Tells that the calling test skips and why, on the process's stderr itself: libtest
/// hides what a passing test prints with `eprintln!`, and a skip must be seen.
pub fn skip(why: &str) {
    let name = std::thread::current().name().unwrap_or("test").to_string();
    let _ = writeln!(std::io::stderr(), "SKIP {name}: {why}");
}

/// VELOXQUANT_MODEL, else fetched into $HOME/.cache/veloxquant (tests only read the env).
fn find_model() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("VELOXQUANT_MODEL").map(PathBuf::from) {
        return if p.is_file() { Ok(p) } else { Err(format!("VELOXQUANT_MODEL={} is not a file", p.display())) };
    }
    let home = std::env::var_os("HOME").ok_or("model unavailable: no $HOME to fetch it into")?;
    veloxquant_llm::fetch_model(&PathBuf::from(home).join(".cache/veloxquant"))
        .map_err(|e| format!("model unavailable: {e}"))
}

/// The model's path; None (and a SKIP line) when it cannot be had.
pub fn model_path() -> Option<PathBuf> {
    find_model().map_err(|why| skip(&why)).ok()
}

pub struct Loaded {
    pub model: Llama,
    pub tok: Tokenizer,
}

/// The model, loaded once per test binary; None (and a SKIP line) when unavailable.
pub fn loaded() -> Option<&'static Loaded> {
    static CELL: OnceLock<Result<Loaded, String>> = OnceLock::new();
    let cell = CELL.get_or_init(|| {
        let path = find_model()?;
        Ok(Loaded {
            model: Llama::load(&path, WeightMode::DequantF32).expect("load model"),
            tok: Tokenizer::from_gguf_path(&path).expect("load tokenizer"),
        })
    });
    cell.as_ref().map_err(|why| skip(why)).ok()
}

/// The raw WikiText-2 test split: VELOXQUANT_TEXT, else found relative to the working
/// directory; None (and a SKIP line) when absent.
pub fn wikitext() -> Option<String> {
    let dirs = ["../shared/data", "../../shared/data", "../../../shared/data"];
    let candidates: Vec<PathBuf> = match std::env::var_os("VELOXQUANT_TEXT") {
        Some(p) => vec![PathBuf::from(p)],
        None => dirs.iter().map(|d| PathBuf::from(d).join("wikitext-2-raw-test.txt")).collect(),
    };
    for p in &candidates {
        if let Ok(bytes) = std::fs::read(p) {
            return Some(String::from_utf8(bytes).expect("wikitext is UTF-8"));
        }
    }
    let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    skip(&format!("wikitext-2-raw-test.txt not found (tried {})", tried.join(", ")));
    None
}

pub fn fp16_factory(
    model: &Llama,
    n_ctx: usize,
) -> impl FnMut() -> veloxquant_llm::Result<Box<dyn veloxquant_llm::KvStore>> {
    let c = model.config.clone();
    move || Ok(Box::new(veloxquant_llm::Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx)))
}
