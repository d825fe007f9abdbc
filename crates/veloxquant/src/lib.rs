//! veloxquant: KV-cache compression with attention computed directly on the codes.
//!
//! ```
//! use veloxquant::{CacheConfig, FormatSpec, PagedCache, attn};
//! # fn main() -> Result<(), veloxquant::VqError> {
//! let k = FormatSpec::parse("turboquant_mse:4:eden")?;
//! let v = FormatSpec::parse("turboquant_mse:3")?;
//! let mut cache = PagedCache::new(CacheConfig::new(1, 2, 64, k, v))?; // 1 layer, 2 KV heads, d=64
//! let mut rng = veloxquant::rng::SplitMix64::new(1);
//! let n = 100; // tokens of a prefill chunk: [kv_head][token][d]
//! cache.append(0, &rng.gaussian_vec(2 * n * 64), &rng.gaussian_vec(2 * n * 64), n)?;
//! let q = rng.gaussian_vec(4 * 64); // 4 query heads (GQA 2:1), one decode step
//! let out = attn::decode_attention(&cache, 0, &q, 4)?;
//! let exact = attn::decode_attention_ref(&cache, 0, &q, 4)?;
//! assert!(out.iter().zip(&exact).all(|(a, b)| (a - b).abs() < 1e-4));
//! # Ok(()) }
//! ```

pub mod attn;
pub mod cache;
pub mod codebook;
pub mod cpu;
pub mod error;
pub mod format;
pub mod kmeans;
pub mod pack;
pub mod reduce;
pub mod rng;
pub mod rotate;

pub use cache::{CacheConfig, Calibration, LayerSpec, PagedCache};
pub use error::{Result, VqError};
pub use format::{Format, FormatSpec, NormMode, SketchKind, Stream, REGISTRY};
