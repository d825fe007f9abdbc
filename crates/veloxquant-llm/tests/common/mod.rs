//! Shared test helpers: locating the model and the WikiText text.
#![allow(dead_code)]

pub mod tiny;

use std::path::PathBuf;
use std::sync::OnceLock;
use veloxquant_llm::{Llama, Tokenizer, WeightMode};

/// VELOXQUANT_MODEL, else fetch into $HOME/.cache/veloxquant (tests only read the env).
pub fn model_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("VELOXQUANT_MODEL") {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var("HOME").ok()?;
    match veloxquant_llm::fetch_model(&PathBuf::from(home).join(".cache/veloxquant")) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("SKIP: model unavailable: {e}");
            None
        }
    }
}

pub struct Loaded {
    pub model: Llama,
    pub tok: Tokenizer,
}

/// The model, loaded once per test binary; None (test skips) when unavailable.
pub fn loaded() -> Option<&'static Loaded> {
    static CELL: OnceLock<Option<Loaded>> = OnceLock::new();
    CELL.get_or_init(|| {
        let path = model_path()?;
        Some(Loaded {
            model: Llama::load(&path, WeightMode::DequantF32).expect("load model"),
            tok: Tokenizer::from_gguf_path(&path).expect("load tokenizer"),
        })
    })
    .as_ref()
}

/// The raw WikiText-2 test split, found relative to the working directory.
pub fn wikitext() -> Option<String> {
    for dir in ["../shared/data", "../../shared/data", "../../../shared/data"] {
        let p = PathBuf::from(dir).join("wikitext-2-raw-test.txt");
        if let Ok(bytes) = std::fs::read(&p) {
            return Some(String::from_utf8(bytes).expect("wikitext is UTF-8"));
        }
    }
    eprintln!("SKIP: wikitext-2-raw-test.txt not found under ../shared/data or ../../shared/data");
    None
}

pub fn fp16_factory(
    model: &Llama,
    n_ctx: usize,
) -> impl FnMut() -> veloxquant_llm::Result<Box<dyn veloxquant_llm::KvStore>> {
    let c = model.config.clone();
    move || Ok(Box::new(veloxquant_llm::Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, n_ctx)))
}
