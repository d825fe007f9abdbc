//! Exact causal attention over f32 K/V (GQA), shared by every cache that can decode to f32.

use crate::error::{LlmError, Result};
use rayon::prelude::*;
pub(crate) use veloxquant::cpu::exp_approx;

/// Query rows per attention task: small enough to skip most of the causal upper triangle
/// and to give rayon several tasks per head.
const Q_BLOCK: usize = 128;

/// Attention over fewer (query, key) dot products than this runs on the calling thread:
/// a decode step over a short context is a few µs, less than the pool's task overhead.
const PAR_MIN_DOTS: usize = 1 << 11;

/// A second key/value source for [`causal_attention_mixed`]: for the query at absolute
/// position p, keys in `range(p)` are read from these arrays instead (same indexing).
pub struct CodedSource<'a> {
    pub keys: &'a [&'a [f32]],
    pub values: &'a [&'a [f32]],
    pub range: &'a (dyn Fn(usize) -> std::ops::Range<usize> + Sync),
    /// The query these keys are scored with, `[n_heads][n_q][head_dim]` and already scaled
    /// by 1/√head_dim (a format that quantizes the query, e.g. rabitq); `None`: q itself.
    pub query: Option<&'a [f32]>,
}

/// Exact causal attention over f32 keys/values, parallel over (head, query block).
///
/// `keys[g]`, `values[g]`: kv head g as `[len][head_dim]`. q: `[n_heads][n_q][head_dim]`.
/// Query head h reads kv head h / (n_heads / n_kv_heads) (GQA). Returns [n_q][n_heads * head_dim].
pub fn causal_attention_f32(
    q: &[f32],
    n_q: usize,
    keys: &[&[f32]],
    values: &[&[f32]],
    len: usize,
    head_dim: usize,
) -> Result<Vec<f32>> {
    causal_attention_mixed(q, n_q, keys, values, None, len, head_dim)
}

/// [`causal_attention_f32`] where each query may read part of its keys and values from a
/// second source (a compressed cache's decoded codes): two score gemms, a per-row select,
/// and the weights split between the two value gemms — no per-query copies.
pub fn causal_attention_mixed(
    q: &[f32],
    n_q: usize,
    keys: &[&[f32]],
    values: &[&[f32]],
    coded: Option<&CodedSource>,
    len: usize,
    head_dim: usize,
) -> Result<Vec<f32>> {
    let n_kv_heads = keys.len();
    if n_q == 0 {
        return Ok(Vec::new());
    }
    if n_kv_heads == 0 || values.len() != n_kv_heads || head_dim == 0 {
        return Err(LlmError::Store("no kv heads or key/value head count differ".into()));
    }
    if n_q > len {
        return Err(LlmError::ShapeMismatch { op: "attend: n_q <= len", expected: len, got: n_q });
    }
    if !q.len().is_multiple_of(n_q * head_dim) {
        return Err(LlmError::ShapeMismatch { op: "attend: q length", expected: n_q * head_dim, got: q.len() });
    }
    let n_heads = q.len() / (n_q * head_dim);
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(LlmError::ShapeMismatch {
            op: "attend: n_heads multiple of n_kv_heads",
            expected: n_kv_heads,
            got: n_heads,
        });
    }
    if let Some(qq) = coded.and_then(|c| c.query).filter(|qq| qq.len() != q.len()) {
        return Err(LlmError::ShapeMismatch { op: "attend: coded query length", expected: q.len(), got: qq.len() });
    }
    for kv in keys.iter().chain(values.iter()) {
        if kv.len() < len * head_dim {
            return Err(LlmError::ShapeMismatch {
                op: "attend: kv head length",
                expected: len * head_dim,
                got: kv.len(),
            });
        }
    }
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let n_blocks = n_q.div_ceil(Q_BLOCK);
    let tasks: Vec<(usize, usize)> = (0..n_heads).flat_map(|h| (0..n_blocks).map(move |b| (h, b))).collect();
    let task = |&(h, b): &(usize, usize)| {
        let r0 = b * Q_BLOCK;
        let rows = Q_BLOCK.min(n_q - r0);
        let first_pos = len - n_q + r0; // absolute position of row 0 of this block
        let n_keys = first_pos + rows;
        let g = h / group;
        let q_blk = &q[(h * n_q + r0) * head_dim..(h * n_q + r0 + rows) * head_dim];
        let mut scores = vec![0f32; rows * n_keys];
        // scores = scale * Q K^T
        gemm_rowmajor(rows, n_keys, head_dim, &mut scores, q_blk, head_dim, 1, keys[g], 1, head_dim, scale);
        let mut coded_p = coded.map(|c| {
            let mut sc = vec![0f32; rows * n_keys];
            let (qc, alpha) = match c.query {
                Some(qq) => (&qq[(h * n_q + r0) * head_dim..(h * n_q + r0 + rows) * head_dim], 1.0),
                None => (q_blk, scale),
            };
            gemm_rowmajor(rows, n_keys, head_dim, &mut sc, qc, head_dim, 1, c.keys[g], 1, head_dim, alpha);
            for (i, (row, crow)) in scores.chunks_exact_mut(n_keys).zip(sc.chunks_exact(n_keys)).enumerate() {
                let r = (c.range)(first_pos + i);
                row[r.clone()].copy_from_slice(&crow[r]);
            }
            sc
        });
        for (i, row) in scores.chunks_exact_mut(n_keys).enumerate() {
            let valid = first_pos + i + 1;
            softmax_prefix(row, valid);
        }
        // Move the coded keys' weights to their own matrix (zero elsewhere).
        if let (Some(c), Some(pc)) = (coded, coded_p.as_mut()) {
            for (i, (row, crow)) in scores.chunks_exact_mut(n_keys).zip(pc.chunks_exact_mut(n_keys)).enumerate() {
                let r = (c.range)(first_pos + i);
                crow.fill(0.0);
                crow[r.clone()].copy_from_slice(&row[r.clone()]);
                row[r].fill(0.0);
            }
        }
        let mut out = vec![0f32; rows * head_dim];
        // out = P V (+ P_coded V_coded)
        gemm_rowmajor(rows, head_dim, n_keys, &mut out, &scores, n_keys, 1, values[g], head_dim, 1, 1.0);
        if let (Some(c), Some(pc)) = (coded, coded_p) {
            let mut out2 = vec![0f32; rows * head_dim];
            gemm_rowmajor(rows, head_dim, n_keys, &mut out2, &pc, n_keys, 1, c.values[g], head_dim, 1, 1.0);
            out.iter_mut().zip(out2).for_each(|(a, b)| *a += b);
        }
        out
    };
    let parts: Vec<Vec<f32>> = if n_heads * n_q * len < PAR_MIN_DOTS {
        tasks.iter().map(task).collect()
    } else {
        tasks.par_iter().map(task).collect()
    };
    let width = n_heads * head_dim;
    let mut result = vec![0f32; n_q * width];
    for (&(h, b), part) in tasks.iter().zip(&parts) {
        let r0 = b * Q_BLOCK;
        for (i, src) in part.chunks_exact(head_dim).enumerate() {
            let dst = (r0 + i) * width + h * head_dim;
            result[dst..dst + head_dim].copy_from_slice(src);
        }
    }
    Ok(result)
}

/// Softmax over row[..valid]; row[valid..] (future keys) set to zero.
fn softmax_prefix(row: &mut [f32], valid: usize) {
    let (live, masked) = row.split_at_mut(valid);
    masked.fill(0.0);
    let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Separate map and sum passes so both vectorize (libm expf would not).
    live.iter_mut().for_each(|x| *x = exp_approx(*x - max));
    let mut lanes = [0f32; 8];
    let mut chunks = live.chunks_exact(8);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    let sum = lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>();
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|x| *x *= inv);
}

/// dst[m×n] (row-major, overwritten) = alpha · lhs[m×k] · rhs[k×n], with explicit strides
/// (row stride, column stride) for lhs and rhs so transposed operands need no copy.
#[allow(clippy::too_many_arguments)]
fn gemm_rowmajor(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
    alpha: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    let max_index = |rows: usize, cols: usize, rs: usize, cs: usize| (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs;
    assert!(dst.len() >= m * n);
    assert!(k == 0 || lhs.len() > max_index(m, k, lhs_rs, lhs_cs));
    assert!(k == 0 || rhs.len() > max_index(k, n, rhs_rs, rhs_cs));
    // SAFETY: the asserts above keep every index gemm touches (row*rs + col*cs) inside the
    // slices; dst is exclusively borrowed and does not alias lhs or rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::pseudo;

    // Plain triple loop: the oracle for the gemm path.
    fn attend_ref(q: &[f32], n_q: usize, k: &[Vec<f32>], v: &[Vec<f32>], len: usize, hd: usize) -> Vec<f32> {
        let n_heads = q.len() / (n_q * hd);
        let group = n_heads / k.len();
        let mut out = vec![0f32; n_q * n_heads * hd];
        for h in 0..n_heads {
            for i in 0..n_q {
                let pos = len - n_q + i;
                let qi = &q[(h * n_q + i) * hd..][..hd];
                let s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kj = &k[h / group][j * hd..][..hd];
                        qi.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let p = (sj - m).exp() / z;
                    for d in 0..hd {
                        out[i * n_heads * hd + h * hd + d] += (p * v[h / group][j * hd + d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_reference_across_block_edges() {
        let hd = 16;
        for &(len, n_q) in &[(1, 1), (5, 5), (300, 1), (300, 129), (257, 257)] {
            let k: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 10 + g)).collect();
            let v: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 20 + g)).collect();
            let q = pseudo(6 * n_q * hd, 3);
            let kr: Vec<&[f32]> = k.iter().map(|x| x.as_slice()).collect();
            let vr: Vec<&[f32]> = v.iter().map(|x| x.as_slice()).collect();
            let got = causal_attention_f32(&q, n_q, &kr, &vr, len, hd).unwrap();
            let want = attend_ref(&q, n_q, &k, &v, len, hd);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "len {len} n_q {n_q}: {a} vs {b}");
            }
        }
    }
}
