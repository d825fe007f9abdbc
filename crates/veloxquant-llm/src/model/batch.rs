//! One forward pass over several sequences at once (continuous batching on the CPU).
//!
//! Every sequence brings its own new tokens (a prefill chunk, or one decode token) and its
//! own [`KvStore`]. The rows of all sequences are concatenated, so each matrix product
//! (QKV, output, gate/up, down, logits) reads the weights once for the whole batch — on a
//! memory-bound CPU that is where batching pays. RoPE, the cache append and attention run
//! per sequence, all sequences of a layer in one parallel pass (a sequence's append and
//! attention are one task, so the pool is woken once per layer for them; a decode row over
//! a paged cache runs the fused decode attention, which splits its page runs further).
//!
//! Each sequence sees exactly what [`Llama::forward`] on it alone would compute, up to
//! the rounding of the matrix products (a GEMM over B rows may sum in another order than
//! over one); greedy tokens agree (tested against `generate` in the server crate).

use rayon::prelude::*;

use super::{add_assign, rms_norm, swiglu, to_heads, Llama};
use crate::compressed::CompressedStore;
use crate::error::{LlmError, Result};
use crate::store::{DenseStore, KvStore, StoredValue};
use candle_core::{Device, Tensor};

/// A store that can take part in a batched forward (its append and attention run on a
/// pool thread).
pub trait BatchStore: KvStore + Send {}

impl BatchStore for CompressedStore {}

impl<T: StoredValue> BatchStore for DenseStore<T> {}

/// One sequence's share of a batched forward.
pub struct BatchItem<'a> {
    /// New tokens, continuing at position `store.len(0)`.
    pub tokens: &'a [u32],
    pub store: &'a mut dyn BatchStore,
    /// Logits are returned for chunk positions `logits_from..` (`tokens.len()`: none).
    pub logits_from: usize,
}

impl Llama {
    /// [`Llama::forward`] for several sequences in one pass; returns each item's logits
    /// `[tokens.len() - logits_from][n_vocab]`, in order. Every item is checked before
    /// anything is appended.
    pub fn forward_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut offsets = Vec::with_capacity(items.len() + 1);
        let mut pos0s = Vec::with_capacity(items.len());
        let mut all = Vec::new();
        offsets.push(0);
        for it in items.iter() {
            let n = it.tokens.len();
            if n == 0 || it.logits_from > n {
                return Err(LlmError::InvalidArgument(format!(
                    "forward_batch: {n} tokens, logits_from {}",
                    it.logits_from
                )));
            }
            let pos0 = it.store.len(0);
            if pos0 + n > c.n_ctx_train {
                return Err(LlmError::ContextOverflow { pos: pos0 + n, n_ctx_train: c.n_ctx_train });
            }
            if let Some(&id) = it.tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
                return Err(LlmError::TokenOutOfRange { id, n_vocab: c.n_vocab });
            }
            all.extend_from_slice(it.tokens);
            pos0s.push(pos0);
            offsets.push(all.len());
        }
        crate::pool::polling(|| self.run_batch(items, &all, &offsets, &pos0s))
    }

    /// The checked batch's layers and logits: `all` its tokens, `offsets` each item's first
    /// row, `pos0s` each item's first position.
    fn run_batch(
        &self,
        items: &mut [BatchItem<'_>],
        all: &[u32],
        offsets: &[usize],
        pos0s: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let n_rows = all.len();
        let ids = Tensor::new(all, &Device::Cpu)?;
        let mut x: Vec<f32> = self.embed.index_select(&ids, 0)?.flatten_all()?.to_vec1()?;
        let hd = c.head_dim;
        let (qw, kw) = (c.n_heads * hd, c.n_kv_heads * hd);
        for (li, layer) in self.layers.iter().enumerate() {
            let mut qkv = layer.qkv.forward(rms_norm(&x, &layer.attn_norm, c.rms_eps), n_rows)?.into_iter();
            let (mut q, mut k, v) =
                (qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default());
            for (i, w) in offsets.windows(2).enumerate() {
                self.rope(&mut q[w[0] * qw..w[1] * qw], pos0s[i], c.n_heads);
                self.rope(&mut k[w[0] * kw..w[1] * kw], pos0s[i], c.n_kv_heads);
            }
            let att = self.attend_batch(items, li, offsets, (&q, &k, &v))?;
            add_assign(&mut x, &layer.wo.forward1(att, n_rows)?);

            let gu = layer.gate_up.forward_joined(rms_norm(&x, &layer.ffn_norm, c.rms_eps), n_rows)?;
            add_assign(&mut x, &layer.w_down.forward1(swiglu(&gu, c.ffn_hidden), n_rows)?);
        }
        self.batch_logits(items, offsets, &x)
    }

    /// Append each item's K/V to its store and attend, all items in one parallel pass (a
    /// store's own attention splits further over the pool: the fused decode over its page
    /// runs, the dense heads); returns `[n_rows][hidden]`.
    fn attend_batch(
        &self,
        items: &mut [BatchItem<'_>],
        layer: usize,
        offsets: &[usize],
        (q, k, v): (&[f32], &[f32], &[f32]),
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (h, hd) = (c.hidden, c.head_dim);
        let (qw, kw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let mut out = vec![0f32; offsets[offsets.len() - 1] * h];
        let mut outs = Vec::with_capacity(items.len());
        let mut rest = out.as_mut_slice();
        for w in offsets.windows(2) {
            let (mine, tail) = rest.split_at_mut((w[1] - w[0]) * h);
            outs.push(mine);
            rest = tail;
        }
        items.par_iter_mut().zip(outs).zip(offsets.par_windows(2)).try_for_each(|((it, o), w)| -> Result<()> {
            let (r0, r1) = (w[0], w[1]);
            let n = r1 - r0;
            let kh = to_heads(&k[r0 * kw..r1 * kw], n, c.n_kv_heads, hd);
            let vh = to_heads(&v[r0 * kw..r1 * kw], n, c.n_kv_heads, hd);
            it.store.append(layer, &kh, &vh, n)?;
            let a = it.store.attend(layer, &to_heads(&q[r0 * qw..r1 * qw], n, c.n_heads, hd), n)?;
            check_len(&a, n * h)?;
            o.copy_from_slice(&a);
            Ok(())
        })?;
        Ok(out)
    }

    /// The final norm and the output projection over the rows that want logits, in one
    /// product written straight into each item's logits.
    fn batch_logits(&self, items: &[BatchItem<'_>], offsets: &[usize], x: &[f32]) -> Result<Vec<Vec<f32>>> {
        let (h, nv) = (self.config.hidden, self.config.n_vocab);
        let mut rows = Vec::new();
        let mut out = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            let (from, to) = (offsets[i] + it.logits_from, offsets[i + 1]);
            rows.extend_from_slice(&x[from * h..to * h]);
            out.push(vec![0f32; (to - from) * nv]);
        }
        if rows.is_empty() {
            return Ok(out);
        }
        let mut ys: Vec<&mut [f32]> = out.iter_mut().flat_map(|o| o.chunks_mut(nv)).collect();
        self.output.forward1_into(rms_norm(&rows, &self.output_norm, self.config.rms_eps), &mut ys)?;
        Ok(out)
    }
}

fn check_len(a: &[f32], expected: usize) -> Result<()> {
    if a.len() != expected {
        return Err(LlmError::ShapeMismatch { op: "batched attention output", expected, got: a.len() });
    }
    Ok(())
}
