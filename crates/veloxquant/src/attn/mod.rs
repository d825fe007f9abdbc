//! Decode attention over the paged cache: the fused path (scores and values straight from
//! the codes, GQA groups sharing one pass, context split over threads) and the plain
//! reference (decode every page, dense attention in f64).

mod fused;
mod reference;
pub mod state;

pub use fused::{decode_attention, decode_attention_batch};
pub use reference::{decode_attention_ref, materialize, materialize_pages, materialize_pages_into};

use crate::cache::PagedCache;
use crate::error::{Result, VqError};

/// Shape checks shared by both paths: q is [n_heads][d]; n_heads a multiple of n_kv_heads.
pub(crate) fn check_query(cache: &PagedCache, layer: usize, q: &[f32], n_heads: usize) -> Result<usize> {
    let cfg = cache.config();
    let lc = cache.layer(layer)?;
    if n_heads == 0 || !n_heads.is_multiple_of(cfg.n_kv_heads) {
        return Err(VqError::InvalidConfig(format!(
            "n_heads {n_heads} must be a positive multiple of n_kv_heads {}",
            cfg.n_kv_heads
        )));
    }
    if q.len() != n_heads * cfg.head_dim {
        return Err(VqError::ShapeMismatch { op: "decode query", expected: n_heads * cfg.head_dim, got: q.len() });
    }
    if !crate::format::all_finite(q) {
        let i = q.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(VqError::NonFinite { what: "query", token: i / cfg.head_dim, channel: i % cfg.head_dim });
    }
    if lc.n_tokens() == 0 {
        return Err(VqError::EmptyCache { layer });
    }
    Ok(n_heads / cfg.n_kv_heads)
}
