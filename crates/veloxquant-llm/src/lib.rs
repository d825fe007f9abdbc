//! Llama inference on CPU for KV-cache experiments: GGUF loading, tokenizer, a forward pass
//! whose attention goes through a pluggable [`KvStore`], and the evaluation harness
//! (perplexity like llama.cpp, KL / top-1 agreement, passkey retrieval).
//!
//! ```no_run
//! use veloxquant_llm::*;
//! # fn main() -> Result<()> {
//! let path = fetch_model(std::path::Path::new("/var/cache/veloxquant"))?;
//! let tok = Tokenizer::from_gguf_path(&path)?;
//! let model = Llama::load(&path, WeightMode::DequantF32)?;
//! let c = model.config.clone();
//! let mut fp16 = || -> Result<Box<dyn KvStore>> {
//!     Ok(Box::new(Fp16Store::with_capacity(c.n_layers, c.n_kv_heads, c.head_dim, 512)))
//! };
//! let text = std::fs::read_to_string("wikitext-2-raw-test.txt").unwrap();
//! let tokens = tok.encode(&text)?;
//! let stats = perplexity(&model, &tokens, 512, 80, tok.add_bos, &mut fp16)?;
//! println!("PPL {:.4} ± {:.4}", stats.ppl, stats.ppl_stderr);
//! # Ok(()) }
//! ```

pub mod allocate;
pub mod attention;
pub mod compressed;
pub mod error;
pub mod eval;
pub mod fetch;
pub mod generate;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kl_base;
pub mod model;
pub mod passkey;
mod pool;
pub mod qmatvec;
pub mod report;
pub mod sample;
pub mod store;
pub mod tokenizer;

pub use compressed::{calibrate, CompressedStore};
pub use error::{LlmError, Result};
pub use eval::{compare_many, compare_many_with_progress, compare_stores, perplexity, CompareStats, PplStats};
pub use fetch::{fetch_model, model_fingerprint};
pub use generate::{generate, GenStats, Greedy, Sampler, TextStream};
pub use model::batch::{BatchItem, BatchStore};
pub use model::{Llama, LlamaConfig, WeightBytes, WeightMode};
pub use passkey::{passkey_accuracy, passkey_prompt, PasskeyFormat, PasskeyStats};
pub use store::{causal_attention_f32, DenseStore, F32Store, Fp16Store, KvStore, StoreFactory, StoredValue};
pub use tokenizer::Tokenizer;

// The model is shared read-only across threads (rayon inside forward, callers across runs).
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Llama>();
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<Fp16Store>();
};

/// Deterministic inputs for the unit tests (xorshift, values in [-1, 1]).
#[cfg(test)]
pub(crate) mod test_util {
    pub fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }
}
