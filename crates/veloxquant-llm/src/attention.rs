//! Exact causal attention over f32 K/V (GQA), shared by every cache that can decode to f32.

use crate::error::{LlmError, Result};
use rayon::prelude::*;
use std::ops::Range;
pub(crate) use veloxquant::cpu::exp_approx;
use veloxquant::cpu::max_of;

thread_local! {
    /// One query block's scores (rows × keys), kept between tasks: at most Q_BLOCK × the
    /// context per thread.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

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
/// second source (a compressed cache's decoded codes). Per query block, each key column is
/// scored and weighted from the source its rows read; only the narrow band where the rows
/// disagree (the window moves within the block) is scored from both and selected per row,
/// so the work is that of one source plus the band — no per-query copies.
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
        let exact = Operands { query: q_blk, alpha: scale, keys: keys[g], values: values[g] };
        let from_codes = coded.map(|c| {
            let query = match c.query {
                Some(qq) => &qq[(h * n_q + r0) * head_dim..(h * n_q + r0 + rows) * head_dim],
                None => q_blk,
            };
            let alpha = if c.query.is_some() { 1.0 } else { scale };
            let ranges: Vec<Range<usize>> = (0..rows).map(|i| (c.range)(first_pos + i)).collect();
            (Operands { query, alpha, keys: c.keys[g], values: c.values[g] }, ranges)
        });
        let plan = match &from_codes {
            Some((_, ranges)) => ColumnPlan::new(ranges, n_keys),
            None => ColumnPlan::all_exact(n_keys),
        };
        let ranges = from_codes.as_ref().map_or(&[][..], |(_, r)| r.as_slice());
        let blk = Block { rows, n_keys, head_dim };
        SCORES.with_borrow_mut(|buf| {
            // Reused by every task on this thread: the pieces below write every column, so
            // it needs no zeroing (a zeroed rows × n_keys matrix per task was a memset of
            // ~80 MB per layer at pp512 @ d4096).
            if buf.len() < rows * n_keys {
                buf.resize(rows * n_keys, 0.0);
            }
            let scores = &mut buf[..rows * n_keys];
            // Each column is scored from the source its rows read; only the band of columns
            // whose source differs between rows is scored from both and selected per row.
            for piece in plan.exact() {
                blk.scores(scores, piece, &exact);
            }
            let mut bands: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
            if let Some((src, _)) = &from_codes {
                blk.scores(scores, plan.all_coded.clone(), src);
                for band in plan.bands() {
                    let mut sc = vec![0f32; rows * band.len()];
                    blk.scores_into(&mut sc, band.len(), band.clone(), src);
                    for (i, (row, r)) in scores.chunks_exact_mut(n_keys).zip(ranges).enumerate() {
                        let ov = overlap(r, &band);
                        let from = &sc[i * band.len()..(i + 1) * band.len()];
                        row[ov.clone()].copy_from_slice(&from[ov.start - band.start..ov.end - band.start]);
                    }
                    bands.push((band, sc));
                }
            }
            for (i, row) in scores.chunks_exact_mut(n_keys).enumerate() {
                softmax_prefix(row, first_pos + i + 1);
            }
            // A band's coded weights move to its own matrix (zero elsewhere), leaving the exact
            // ones in `scores`.
            for (band, pc) in &mut bands {
                let w = band.len();
                for (i, (row, r)) in scores.chunks_exact_mut(n_keys).zip(ranges).enumerate() {
                    let ov = overlap(r, band);
                    let to = &mut pc[i * w..(i + 1) * w];
                    to.fill(0.0);
                    to[ov.start - band.start..ov.end - band.start].copy_from_slice(&row[ov.clone()]);
                    row[ov].fill(0.0);
                }
            }
            let mut out = vec![0f32; rows * head_dim];
            let mut first = true;
            let mut acc = |p: &[f32], p_rs: usize, cols: Range<usize>, v: &[f32]| {
                blk.accumulate(&mut out, first, (p, p_rs), cols, v);
                first = false;
            };
            for piece in plan.exact() {
                acc(&scores[piece.start..], n_keys, piece, exact.values);
            }
            if let Some((src, _)) = &from_codes {
                let all = plan.all_coded.clone();
                acc(&scores[all.start..], n_keys, all, src.values);
                for (band, pc) in &bands {
                    acc(pc, band.len(), band.clone(), src.values);
                }
            }
            out
        })
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

/// a ∩ b, as an empty range inside b when they do not meet (so it indexes b's columns).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let lo = a.start.clamp(b.start, b.end);
    lo..a.end.clamp(lo, b.end)
}

/// One source's operands for a query block: its query rows (`[rows][head_dim]`, scored
/// with `alpha`) and its keys and values (`[len][head_dim]`, absolute positions).
struct Operands<'a> {
    query: &'a [f32],
    alpha: f32,
    keys: &'a [f32],
    values: &'a [f32],
}

/// Which key columns of a query block come from which source: `all_coded` is read through
/// the codes by every row, the columns outside `coded` exactly by every row, and the
/// bands between (rows disagree there: the window moves within the block) from both.
struct ColumnPlan {
    n_keys: usize,
    /// Columns any row reads through the codes.
    coded: Range<usize>,
    /// Columns every row reads through the codes (within `coded`).
    all_coded: Range<usize>,
}

impl ColumnPlan {
    fn all_exact(n_keys: usize) -> Self {
        Self { n_keys, coded: 0..0, all_coded: 0..0 }
    }

    /// From each row's coded range (empty: the row reads every key exactly).
    fn new(ranges: &[Range<usize>], n_keys: usize) -> Self {
        let live = || ranges.iter().filter(|r| !r.is_empty());
        let (Some(lo), Some(hi)) = (live().map(|r| r.start).min(), live().map(|r| r.end).max()) else {
            return Self::all_exact(n_keys);
        };
        let coded = lo..hi.min(n_keys).max(lo);
        let every = ranges.iter().all(|r| !r.is_empty());
        let (a, z) = (ranges.iter().map(|r| r.start).max(), ranges.iter().map(|r| r.end).min());
        let all_coded = match (a, z) {
            (Some(a), Some(z)) if every && a < z => a..z.min(coded.end),
            _ => lo..lo,
        };
        Self { n_keys, coded, all_coded }
    }

    /// Columns every row reads exactly: before and after `all_coded` (the bands included,
    /// scored both ways).
    fn exact_pieces(&self) -> [Range<usize>; 2] {
        let a = &self.all_coded;
        [0..a.start, a.end..self.n_keys]
    }

    fn exact(&self) -> impl Iterator<Item = Range<usize>> {
        self.exact_pieces().into_iter().filter(|r| !r.is_empty())
    }

    fn bands(&self) -> impl Iterator<Item = Range<usize>> {
        let (c, a) = (&self.coded, &self.all_coded);
        [c.start..a.start, a.end..c.end].into_iter().filter(|r| !r.is_empty())
    }
}

/// The shape of one (head, query block) task: `rows` queries over `n_keys` key columns.
#[derive(Clone, Copy)]
struct Block {
    rows: usize,
    n_keys: usize,
    head_dim: usize,
}

impl Block {
    /// scores[:, cols] = alpha · Q Kᵀ[cols] (scores row-major, rows × n_keys).
    fn scores(&self, scores: &mut [f32], cols: Range<usize>, src: &Operands) {
        let start = cols.start;
        self.scores_into(&mut scores[start..], self.n_keys, cols, src);
    }

    /// dst[i][j] (row stride dst_rs) = alpha · q_i · k_{cols.start + j}.
    fn scores_into(&self, dst: &mut [f32], dst_rs: usize, cols: Range<usize>, src: &Operands) {
        let d = self.head_dim;
        let lhs = Mat { data: src.query, rs: d, cs: 1 };
        let rhs = Mat { data: &src.keys[cols.start * d..], rs: 1, cs: d };
        gemm_into((self.rows, cols.len(), d), MatMut { data: dst, rs: dst_rs, accumulate: false }, lhs, rhs, src.alpha);
    }

    /// out (rows × head_dim) = (or += unless `first`) P[:, cols] · V[cols]; P given from its
    /// first column `cols.start`, with row stride p.1.
    fn accumulate(&self, out: &mut [f32], first: bool, p: (&[f32], usize), cols: Range<usize>, v: &[f32]) {
        let d = self.head_dim;
        let lhs = Mat { data: p.0, rs: p.1, cs: 1 };
        let rhs = Mat { data: &v[cols.start * d..], rs: d, cs: 1 };
        gemm_into((self.rows, d, cols.len()), MatMut { data: out, rs: d, accumulate: !first }, lhs, rhs, 1.0);
    }
}

/// Softmax over row[..valid]; row[valid..] (future keys) set to zero.
fn softmax_prefix(row: &mut [f32], valid: usize) {
    let (live, masked) = row.split_at_mut(valid);
    masked.fill(0.0);
    let max = max_of(live, f32::NEG_INFINITY);
    // Not `exp_sum`'s AVX-512 exponentials (fused multiply-adds, other bits): the server's
    // greedy text must equal `generate`'s (veloxquant-serve tests/server.rs), which this
    // softmax's rounding decides. Separate map and sum passes so both vectorize.
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

/// A read-only strided matrix: element (i, j) at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

/// A destination matrix with unit column stride; `accumulate`: add to what it holds.
struct MatMut<'a> {
    data: &'a mut [f32],
    rs: usize,
    accumulate: bool,
}

/// dst[m×n] (= or +=) alpha · lhs[m×k] · rhs[k×n]; strides let transposed operands and
/// column ranges of a larger matrix go in without a copy.
fn gemm_into((m, n, k): (usize, usize, usize), dst: MatMut, lhs: Mat, rhs: Mat, alpha: f32) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: zero unless accumulating (gemm reads nothing then).
        if !dst.accumulate {
            dst.data.chunks_mut(dst.rs).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    let max_index = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(n <= dst.rs && dst.data.len() > max_index(m, n, dst.rs, 1));
    assert!(lhs.data.len() > max_index(m, k, lhs.rs, lhs.cs));
    assert!(rhs.data.len() > max_index(k, n, rhs.rs, rhs.cs));
    // SAFETY: the asserts above keep every index gemm touches (row*rs + col*cs) inside the
    // slices; dst is exclusively borrowed and does not alias lhs or rhs, and its rows
    // (n ≤ rs) do not overlap.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            1,
            dst.rs as isize,
            dst.accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            if dst.accumulate { 1.0 } else { 0.0 },
            alpha,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Tokens per task of [`decode_attention_f16`]: fixed, so the split (and the rounding) is
/// the same whatever the thread count.
const DECODE_CHUNK: usize = 1024;

/// One query token's attention over f16 keys and values held as rows (`keys[g]`: kv head g,
/// `[len][head_dim]` f16 little-endian bytes), straight from the f16 bytes: the core's fused
/// page kernels score and accumulate 32 rows at a time for the G query heads of a kv head
/// (each row read once for the group), with no f32 copy of the cache. Parallel over (kv head,
/// DECODE_CHUNK tokens), merged in chunk order. q: `[n_heads][head_dim]`; returns
/// `[n_heads * head_dim]`.
pub fn decode_attention_f16(
    q: &[f32],
    keys: &[&[u8]],
    values: &[&[u8]],
    len: usize,
    head_dim: usize,
) -> Result<Vec<f32>> {
    use veloxquant::format::rows::{RowKind, RowLayout};
    let n_kv = keys.len();
    if n_kv == 0 || values.len() != n_kv || head_dim == 0 || len == 0 {
        return Err(LlmError::Store(
            "decode attention: no kv heads, no tokens, or key/value head counts differ".into(),
        ));
    }
    if !q.len().is_multiple_of(head_dim * n_kv) {
        return Err(LlmError::ShapeMismatch {
            op: "attend: q length (n_heads × head_dim)",
            expected: head_dim * n_kv,
            got: q.len(),
        });
    }
    let row = 2 * head_dim;
    for kv in keys.iter().chain(values.iter()) {
        if kv.len() < len * row {
            return Err(LlmError::ShapeMismatch { op: "attend: kv head bytes", expected: len * row, got: kv.len() });
        }
    }
    let group = q.len() / (head_dim * n_kv);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let n_chunks = len.div_ceil(DECODE_CHUNK);
    let page = |t: usize| RowLayout::new(RowKind::F16, head_dim, t);
    let full = page(32);
    // (max, sum) per head and the unnormalized outputs of one (kv head, chunk).
    let task = |(g, c): (usize, usize)| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let qs: Vec<f32> = q[g * group * head_dim..(g + 1) * group * head_dim].iter().map(|x| x * scale).collect();
        let (t0, t1) = (c * DECODE_CHUNK, ((c + 1) * DECODE_CHUNK).min(len));
        let n = t1 - t0;
        // scores[h][t] for the chunk, then the weights in place.
        let mut s = vec![0f32; group * n];
        let mut buf = vec![0f32; group * 32];
        for p0 in (t0..t1).step_by(32) {
            let rows = 32.min(t1 - p0);
            let l = if rows == 32 { full.clone() } else { page(rows) };
            veloxquant::cpu::scores(&l, &qs, group, &keys[g][p0 * row..(p0 + rows) * row], &mut buf);
            for h in 0..group {
                s[h * n + p0 - t0..][..rows].copy_from_slice(&buf[h * rows..][..rows]);
            }
        }
        let (mut m, mut z) = (vec![0f32; group], vec![0f32; group]);
        let mut w = vec![0f32; group * n];
        for h in 0..group {
            m[h] = max_of(&s[h * n..(h + 1) * n], f32::NEG_INFINITY);
            z[h] = veloxquant::cpu::exp_sum(&s[h * n..(h + 1) * n], m[h], &mut w[h * n..(h + 1) * n]);
        }
        let mut acc = vec![0f32; group * head_dim];
        for p0 in (t0..t1).step_by(32) {
            let rows = 32.min(t1 - p0);
            let l = if rows == 32 { full.clone() } else { page(rows) };
            for h in 0..group {
                buf[h * rows..][..rows].copy_from_slice(&w[h * n + p0 - t0..][..rows]);
            }
            veloxquant::cpu::accumulate(&l, &buf, group, &values[g][p0 * row..(p0 + rows) * row], &mut acc);
        }
        (m, z, acc)
    };
    let tasks: Vec<(usize, usize)> = (0..n_kv).flat_map(|g| (0..n_chunks).map(move |c| (g, c))).collect();
    let parts: Vec<_> = if n_kv * len * group < PAR_MIN_DOTS {
        tasks.into_iter().map(task).collect()
    } else {
        tasks.into_par_iter().map(task).collect()
    };
    let mut out = vec![0f32; q.len()];
    for g in 0..n_kv {
        let chunk = &parts[g * n_chunks..(g + 1) * n_chunks];
        for h in 0..group {
            let mx = chunk.iter().fold(f32::NEG_INFINITY, |a, p| a.max(p.0[h]));
            let o = &mut out[(g * group + h) * head_dim..][..head_dim];
            let mut z = 0f32;
            for (m, zc, acc) in chunk {
                let f = exp_approx(m[h] - mx);
                z += f * zc[h];
                o.iter_mut().zip(&acc[h * head_dim..][..head_dim]).for_each(|(a, b)| *a += f * b);
            }
            o.iter_mut().for_each(|a| *a /= z);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::pseudo;

    /// One source for the oracle: keys, values (per kv head) and the query rows it is scored
    /// with (already scaled by 1/√d), `[n_heads][n_q][hd]`.
    struct RefSource<'a> {
        k: &'a [Vec<f32>],
        v: &'a [Vec<f32>],
        q: &'a [f32],
    }

    // Plain triple loop in f64: the oracle for the gemm path. Query at position p reads key
    // j from `coded` when j ∈ range(p), else from `exact`.
    fn attend_mixed_ref(
        n_q: usize,
        exact: &RefSource,
        coded: &RefSource,
        range: &dyn Fn(usize) -> Range<usize>,
        len: usize,
        hd: usize,
    ) -> Vec<f32> {
        let n_heads = exact.q.len() / (n_q * hd);
        let group = n_heads / exact.k.len();
        let mut out = vec![0f32; n_q * n_heads * hd];
        for h in 0..n_heads {
            for i in 0..n_q {
                let pos = len - n_q + i;
                let src = |j: usize| if range(pos).contains(&j) { coded } else { exact };
                let s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let (qi, kj) = (&src(j).q[(h * n_q + i) * hd..][..hd], &src(j).k[h / group][j * hd..][..hd]);
                        qi.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let p = (sj - m).exp() / z;
                    for d in 0..hd {
                        out[i * n_heads * hd + h * hd + d] += (p * src(j).v[h / group][j * hd + d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    fn attend_ref(q: &[f32], n_q: usize, k: &[Vec<f32>], v: &[Vec<f32>], len: usize, hd: usize) -> Vec<f32> {
        let scaled: Vec<f32> = q.iter().map(|x| x / (hd as f32).sqrt()).collect();
        let exact = RefSource { k, v, q: &scaled };
        attend_mixed_ref(n_q, &exact, &exact, &|_| 0..0, len, hd)
    }

    fn refs(x: &[Vec<f32>]) -> Vec<&[f32]> {
        x.iter().map(|v| v.as_slice()).collect()
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

    /// The two-source path against the oracle, for the windows a compressed cache produces:
    /// row mode (the split moves by one per query), page mode (by T), a floor left by a
    /// trim, sinks, rows with nothing coded yet, and a coded query that differs from q.
    /// The fused f16 decode against the f64 oracle on the same f16-rounded keys and values:
    /// tails of a 32-row page, chunk edges (1024), GQA groups 1–9, head sizes on the AVX-512,
    /// AVX2 and scalar kernels; keys with a large common offset so a softmax not merged by
    /// each chunk's own max would overflow or lose the small weights.
    #[test]
    fn f16_decode_matches_reference_across_pages_and_chunks() {
        use half::f16;
        let bytes = |x: &[f32]| -> Vec<u8> { x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect() };
        let round = |x: Vec<f32>| -> Vec<f32> { x.into_iter().map(|v| f16::from_f32(v).to_f32()).collect() };
        for &(len, g, hd, n_kv) in &[
            (1, 1, 64, 1),
            (31, 3, 64, 3),
            (33, 4, 16, 2),
            (1024, 2, 64, 2),
            (1025, 9, 24, 1),
            (2100, 3, 64, 3),
            (700, 8, 128, 2),
        ] {
            let k: Vec<Vec<f32>> = (0..n_kv)
                .map(|h| {
                    round(
                        pseudo(len * hd, 40 + h as u32)
                            .iter()
                            .enumerate()
                            .map(|(i, x)| 4.0 * x + if i % hd == 0 { 30.0 } else { 0.0 })
                            .collect(),
                    )
                })
                .collect();
            let v: Vec<Vec<f32>> = (0..n_kv).map(|h| round(pseudo(len * hd, 50 + h as u32))).collect();
            let q = pseudo(n_kv * g * hd, 7);
            let (kb, vb): (Vec<Vec<u8>>, Vec<Vec<u8>>) =
                (k.iter().map(|x| bytes(x)).collect(), v.iter().map(|x| bytes(x)).collect());
            let (kr, vr): (Vec<&[u8]>, Vec<&[u8]>) =
                (kb.iter().map(|x| x.as_slice()).collect(), vb.iter().map(|x| x.as_slice()).collect());
            let got = decode_attention_f16(&q, &kr, &vr, len, hd).unwrap();
            let want = attend_ref(&q, 1, &k, &v, len, hd);
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-5, "len {len} G {g} d {hd} kv {n_kv}: worst {worst}");
        }
        let one = [0u8; 128];
        assert!(decode_attention_f16(&[0.0; 64], &[&one[..]], &[&one[..]], 2, 64).is_err(), "rows shorter than len");
        assert!(decode_attention_f16(&[0.0; 63], &[&one[..]], &[&one[..]], 1, 64).is_err(), "q not whole heads");
        assert!(decode_attention_f16(&[0.0; 64], &[&one[..]], &[&one[..]], 0, 64).is_err(), "no tokens");
    }

    #[test]
    fn mixed_attention_matches_reference_for_every_window_shape() {
        let hd = 16;
        // (sinks, recent, page tokens (1: row mode), coded floor)
        let windows = [(0, 0, 1, 0), (3, 5, 1, 0), (4, 8, 32, 0), (2, 5, 1, 70), (0, 16, 16, 0), (40, 5, 32, 0)];
        for &(len, n_q) in &[(1, 1), (9, 9), (300, 1), (300, 129), (257, 257), (600, 300)] {
            for &(sink, recent, t, floor) in &windows {
                let k: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 10 + g)).collect();
                let v: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 20 + g)).collect();
                let kc: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 30 + g)).collect();
                let vc: Vec<Vec<f32>> = (0..2).map(|g| pseudo(len * hd, 40 + g)).collect();
                let q = pseudo(6 * n_q * hd, 3);
                let qc: Vec<f32> = pseudo(6 * n_q * hd, 4).iter().map(|x| x * 0.3).collect();
                let range = move |pos: usize| {
                    let old = (pos + 1).saturating_sub(sink + recent);
                    let c = (old / t * t).max(floor).min((pos + 1).saturating_sub(sink));
                    if pos < sink || c == 0 {
                        0..0
                    } else {
                        sink..sink + c
                    }
                };
                let (kcr, vcr) = (refs(&kc), refs(&vc));
                let src = CodedSource { keys: &kcr, values: &vcr, range: &range, query: Some(&qc) };
                let got = causal_attention_mixed(&q, n_q, &refs(&k), &refs(&v), Some(&src), len, hd).unwrap();
                let scaled: Vec<f32> = q.iter().map(|x| x / (hd as f32).sqrt()).collect();
                let exact = RefSource { k: &k, v: &v, q: &scaled };
                let codes = RefSource { k: &kc, v: &vc, q: &qc };
                let want = attend_mixed_ref(n_q, &exact, &codes, &range, len, hd);
                let worst = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                assert!(worst < 1e-4, "len {len} n_q {n_q} window {:?}: {worst}", (sink, recent, t, floor));
            }
        }
    }
}
