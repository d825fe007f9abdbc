//! Llama forward pass over GGUF weights; attention is delegated to a [`KvStore`].

use crate::error::{LlmError, Result};
use crate::gguf::Gguf;
use crate::qmatvec::PackedMatrix;
use crate::store::KvStore;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;
use std::io::{Seek, SeekFrom};
use std::path::Path;

pub mod batch;
mod weights;

pub use weights::WeightMode;
use weights::{linear, Proj};

/// Shapes and constants of a Llama model, from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub n_vocab: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Training context length (RoPE table size).
    pub n_ctx_train: usize,
}

/// Bounds on what metadata may declare: far above real Llama models, low enough that
/// the tables sized from them stay small.
const MAX_LAYERS: usize = 1 << 10;
const MAX_HEADS: usize = 1 << 10;
use veloxquant::format::MAX_HEAD_DIM;
const MAX_HIDDEN: usize = 1 << 16;
/// Largest vocabulary (real ones reach ≈ 256k).
const MAX_VOCAB: usize = 1 << 20;
/// RoPE table entries (n_ctx_train × head_dim / 2; Llama 3.1 at 128k needs 2^23).
const MAX_ROPE_ENTRIES: usize = 1 << 25;

impl LlamaConfig {
    /// Shapes and constants from the GGUF metadata alone (no tensor is read), checked for
    /// consistency and bounds; `n_vocab` is 0 until the embedding tensor is seen.
    pub fn from_metadata<R>(g: &Gguf<R>) -> Result<Self> {
        g.check_llama()?;
        let n_heads = g.usize("llama.attention.head_count")?;
        let hidden = g.usize("llama.embedding_length")?;
        let n_kv_heads =
            if g.has("llama.attention.head_count_kv") { g.usize("llama.attention.head_count_kv")? } else { n_heads };
        if n_heads == 0
            || n_kv_heads == 0
            || n_heads > MAX_HEADS
            || hidden > MAX_HIDDEN
            || !hidden.is_multiple_of(n_heads)
            || !n_heads.is_multiple_of(n_kv_heads)
        {
            return Err(LlmError::MissingMetadata {
                key: "llama.attention.head_count(_kv) consistent with embedding_length".into(),
            });
        }
        let head_dim = hidden / n_heads;
        let config = LlamaConfig {
            n_layers: g.usize("llama.block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            hidden,
            ffn_hidden: g.usize("llama.feed_forward_length")?,
            n_vocab: 0,
            rope_base: if g.has("llama.rope.freq_base") { g.f32("llama.rope.freq_base")? } else { 10_000.0 },
            rms_eps: g.f32("llama.attention.layer_norm_rms_epsilon")?,
            n_ctx_train: g.usize("llama.context_length")?,
        };
        let bad = |what: &str| Err(LlmError::InvalidArgument(format!("GGUF metadata: {what}")));
        if !head_dim.is_multiple_of(2) || head_dim > MAX_HEAD_DIM {
            return bad(&format!("head size {head_dim} must be even and ≤ {MAX_HEAD_DIM}"));
        }
        if config.n_layers == 0 || config.n_layers > MAX_LAYERS {
            return bad(&format!("block_count {} not in 1..={MAX_LAYERS}", config.n_layers));
        }
        if config.ffn_hidden == 0 || config.ffn_hidden > 16 * MAX_HIDDEN {
            return bad(&format!("feed_forward_length {} out of range", config.ffn_hidden));
        }
        if config.n_ctx_train == 0 || config.n_ctx_train * head_dim / 2 > MAX_ROPE_ENTRIES {
            return bad(&format!(
                "context_length {} × head size {head_dim} / 2 exceeds {MAX_ROPE_ENTRIES}",
                config.n_ctx_train
            ));
        }
        let in_range = |x: f32, lo: f32| x.is_finite() && x > lo;
        if !in_range(config.rope_base, 1.0) || !in_range(config.rms_eps, 0.0) {
            return bad("rope.freq_base must be > 1 and layer_norm_rms_epsilon > 0, both finite");
        }
        if g.has("llama.rope.dimension_count") && g.usize("llama.rope.dimension_count")? != head_dim {
            return Err(LlmError::InvalidArgument(
                "partial RoPE (rope.dimension_count != head_dim) is unsupported".into(),
            ));
        }
        Ok(config)
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K, V projections (one matmul when dense; one packed product when one format).
    qkv: Proj,
    wo: Proj,
    ffn_norm: Vec<f32>,
    /// gate and up projections (likewise).
    gate_up: Proj,
    w_down: Proj,
}

/// Bytes of a model's weights ([`Llama::weight_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightBytes {
    /// Everything held: embedding, norms, every matmul weight in each form kept.
    pub resident: usize,
    /// What one decode step's matmuls read (the form a one-token forward multiplies by).
    pub per_decode_token: usize,
}

/// A loaded Llama model (CPU).
pub struct Llama {
    pub config: LlamaConfig,
    /// token_embd as f32 [n_vocab][hidden] (embedding lookup; also the output when tied).
    embed: Tensor,
    output: Proj,
    /// The output projection is `embed` itself (its dense form shares the storage).
    output_tied: bool,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    /// cos/sin per (position, pair): [n_ctx_train][head_dim / 2]
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
}

impl Llama {
    pub fn load(path: &Path, mode: WeightMode) -> Result<Self> {
        let mut g = Gguf::open(path)?;
        Self::from_gguf(&mut g, mode)
    }

    pub fn from_gguf(g: &mut Gguf, mode: WeightMode) -> Result<Self> {
        let config = LlamaConfig::from_metadata(g)?;
        let (hidden, n_kv_heads, head_dim) = (config.hidden, config.n_kv_heads, config.head_dim);
        let (h, kvd, f) = (hidden, n_kv_heads * head_dim, config.ffn_hidden);
        let n_vocab = check_tensors(g, &config)?;
        let embed_q = tensor(g, "token_embd.weight", Some(&[n_vocab, h]))?;
        let embed = embed_q.dequantize(&Device::Cpu)?;
        let output_tied = !g.content.tensor_infos.contains_key("output.weight");
        let output = if output_tied {
            let packed = if mode.packs() {
                PackedMatrix::from_qtensor(&embed_q)?.map(|p| p.with_q8_activations(mode == WeightMode::PackedQ8))
            } else {
                None
            };
            Proj::new(vec![(QMatMul::Tensor(embed.clone()), packed)], h)?
        } else {
            Proj::new(vec![linear(tensor(g, "output.weight", Some(&[n_vocab, h]))?, mode)?], h)?
        };
        let output_norm = vector(g, "output_norm.weight", h)?;
        let mut layers = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let mut lin = |name: &str, shape: [usize; 2]| {
                linear(tensor(g, &format!("blk.{i}.{name}.weight"), Some(&shape))?, mode)
            };
            let qkv = Proj::new(vec![lin("attn_q", [h, h])?, lin("attn_k", [kvd, h])?, lin("attn_v", [kvd, h])?], h)?;
            let wo = Proj::new(vec![lin("attn_output", [h, h])?], h)?;
            let gate_up = Proj::new(vec![lin("ffn_gate", [f, h])?, lin("ffn_up", [f, h])?], h)?;
            let w_down = Proj::new(vec![lin("ffn_down", [h, f])?], f)?;
            layers.push(Layer {
                attn_norm: vector(g, &format!("blk.{i}.attn_norm.weight"), h)?,
                ffn_norm: vector(g, &format!("blk.{i}.ffn_norm.weight"), h)?,
                qkv,
                wo,
                gate_up,
                w_down,
            });
        }
        let config = LlamaConfig { n_vocab, ..config };
        let (rope_cos, rope_sin) = rope_table(config.n_ctx_train, head_dim, config.rope_base);
        Ok(Self { config, embed, output, output_tied, output_norm, layers, rope_cos, rope_sin })
    }

    /// Bytes of the weights: resident, and read by each decode step's matmuls.
    pub fn weight_bytes(&self) -> WeightBytes {
        let norms = (self.output_norm.len() + 2 * self.layers.len() * self.config.hidden) * 4;
        let embed = self.embed.elem_count() * 4;
        let (mut resident, mut per_decode_token) = self.output.bytes();
        if self.output_tied {
            resident -= embed; // its dense form is the embedding, counted once
        }
        for l in &self.layers {
            for p in [&l.qkv, &l.wo, &l.gate_up, &l.w_down] {
                let (r, d) = p.bytes();
                resident += r;
                per_decode_token += d;
            }
        }
        WeightBytes { resident: resident + embed + norms, per_decode_token }
    }

    /// Runs `tokens` (new tokens, continuing at position `store.len(0)`) through the model,
    /// appending their K/V to `store`. Returns logits `[tokens.len() - logits_from][n_vocab]` for
    /// chunk positions `logits_from..`; earlier positions skip the output projection.
    pub fn forward(&self, tokens: &[u32], store: &mut dyn KvStore, logits_from: usize) -> Result<Vec<f32>> {
        self.forward_recording(tokens, store, logits_from, &mut |_, _| {})
    }

    /// As [`forward`](Self::forward), handing `hidden(layer, x)` every layer's input hidden
    /// state (`[n][hidden]`) on the way: a later [`forward_from_layer`](Self::forward_from_layer)
    /// can start there.
    pub fn forward_recording(
        &self,
        tokens: &[u32],
        store: &mut dyn KvStore,
        logits_from: usize,
        hidden: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || logits_from > n {
            return Err(LlmError::InvalidArgument(format!("forward: {n} tokens, logits_from {logits_from}")));
        }
        let pos0 = store.len(0);
        if pos0 + n > c.n_ctx_train {
            return Err(LlmError::ContextOverflow { pos: pos0 + n, n_ctx_train: c.n_ctx_train });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(LlmError::TokenOutOfRange { id, n_vocab: c.n_vocab });
        }
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let x: Vec<f32> = self.embed.index_select(&ids, 0)?.flatten_all()?.to_vec1()?;
        self.run_layers(x, 0, pos0, store, logits_from, hidden)
    }

    /// Continues a forward pass from `x`, the input hidden state of layer `first` (`[n][hidden]`,
    /// as [`forward_recording`](Self::forward_recording) handed it), at position
    /// `store.len(first)`: layers before `first` are skipped and their part of `store` is left
    /// untouched. Equals the full pass when `x` is what those layers produced.
    pub fn forward_from_layer(
        &self,
        x: Vec<f32>,
        first: usize,
        store: &mut dyn KvStore,
        logits_from: usize,
    ) -> Result<Vec<f32>> {
        let (h, n_layers) = (self.config.hidden, self.config.n_layers);
        let n = x.len() / h.max(1);
        if first >= n_layers || n == 0 || x.len() != n * h || logits_from > n {
            return Err(LlmError::InvalidArgument(format!(
                "forward_from_layer: layer {first} of {n_layers}, {} floats of hidden {h}, logits_from {logits_from}",
                x.len()
            )));
        }
        let pos0 = store.len(first);
        if pos0 + n > self.config.n_ctx_train {
            return Err(LlmError::ContextOverflow { pos: pos0 + n, n_ctx_train: self.config.n_ctx_train });
        }
        self.run_layers(x, first, pos0, store, logits_from, &mut |_, _| {})
    }

    /// Layers `first..` over hidden states `x` at positions `pos0..`, then the logits.
    fn run_layers(
        &self,
        mut x: Vec<f32>,
        first: usize,
        pos0: usize,
        store: &mut dyn KvStore,
        logits_from: usize,
        hidden: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (h, hd, kvd) = (c.hidden, c.head_dim, c.n_kv_heads * c.head_dim);
        let n = x.len() / h;
        for (li, layer) in self.layers.iter().enumerate().skip(first) {
            hidden(li, &x);
            let xn = rms_norm(&x, &layer.attn_norm, c.rms_eps);
            let mut qkv = layer.qkv.forward(xn, n)?.into_iter();
            let (mut q, mut k, v) =
                (qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default(), qkv.next().unwrap_or_default());
            self.rope(&mut q, pos0, c.n_heads);
            self.rope(&mut k, pos0, c.n_kv_heads);
            let q = to_heads(&q, n, c.n_heads, hd);
            let k = to_heads(&k, n, c.n_kv_heads, hd);
            let v = to_heads(&v, n, c.n_kv_heads, hd);
            debug_assert_eq!(k.len(), n * kvd);
            store.append(li, &k, &v, n)?;
            let att = store.attend(li, &q, n)?;
            if att.len() != n * h {
                return Err(LlmError::ShapeMismatch { op: "KvStore::attend output", expected: n * h, got: att.len() });
            }
            add_assign(&mut x, &layer.wo.forward1(att, n)?);

            let xn = rms_norm(&x, &layer.ffn_norm, c.rms_eps);
            let act = swiglu(&layer.gate_up.forward_joined(xn, n)?, c.ffn_hidden);
            add_assign(&mut x, &layer.w_down.forward1(act, n)?);
        }
        let n_out = n - logits_from;
        if n_out == 0 {
            return Ok(Vec::new());
        }
        let xn = rms_norm(&x[logits_from * h..], &self.output_norm, c.rms_eps);
        self.output.forward1(xn, n_out)
    }

    /// Rotates adjacent pairs (2i, 2i+1) of each head: llama.cpp's "normal" RoPE, which GGUF
    /// Q/K weights (permuted at conversion) expect. x: [n][n_heads][head_dim].
    fn rope(&self, x: &mut [f32], pos0: usize, n_heads: usize) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        let rotate = |(t, row): (usize, &mut [f32])| {
            let base = (pos0 + t) * half;
            let (cos, sin) = (&self.rope_cos[base..base + half], &self.rope_sin[base..base + half]);
            for head in row.chunks_exact_mut(hd) {
                for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * cos[i] - b * sin[i];
                    pair[1] = a * sin[i] + b * cos[i];
                }
            }
        };
        if x.len() < PAR_MIN_FLOATS {
            x.chunks_mut(n_heads * hd).enumerate().for_each(rotate);
        } else {
            x.par_chunks_mut(n_heads * hd).enumerate().for_each(rotate);
        }
    }
}

pub(crate) fn rope_table(n_pos: usize, head_dim: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = vec![0f32; n_pos * half];
    let mut sin = vec![0f32; n_pos * half];
    for p in 0..n_pos {
        for i in 0..half {
            // theta in f64: at position 8191 f32 would lose ~1e-3 rad.
            let inv_freq = (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
            let theta = p as f64 * inv_freq;
            cos[p * half + i] = theta.cos() as f32;
            sin[p * half + i] = theta.sin() as f32;
        }
    }
    (cos, sin)
}

/// Every tensor the model reads, checked before any is read (a corrupt dimension must not
/// size an allocation): its shape against the metadata, with n_vocab the tokenizer's
/// vocabulary size (the embedding's rows, bounded, in a file without a vocabulary), and its
/// bytes inside the file. Returns n_vocab.
pub(crate) fn check_tensors(g: &mut Gguf, c: &LlamaConfig) -> Result<usize> {
    let n_vocab = if g.has("tokenizer.ggml.tokens") {
        g.array_len("tokenizer.ggml.tokens")?
    } else {
        let embd = g.content.tensor_infos.get("token_embd.weight");
        embd.and_then(|t| t.shape.dims().first().copied()).unwrap_or(0)
    };
    if n_vocab == 0 || n_vocab > MAX_VOCAB {
        return Err(LlmError::InvalidArgument(format!(
            "GGUF metadata: vocabulary of {n_vocab} not in 1..={MAX_VOCAB}"
        )));
    }
    let (h, kvd, f) = (c.hidden, c.n_kv_heads * c.head_dim, c.ffn_hidden);
    let mut want = vec![("token_embd.weight".to_string(), vec![n_vocab, h]), ("output_norm.weight".into(), vec![h])];
    if g.content.tensor_infos.contains_key("output.weight") {
        want.push(("output.weight".into(), vec![n_vocab, h]));
    }
    for i in 0..c.n_layers {
        for (name, shape) in [
            ("attn_norm", vec![h]),
            ("ffn_norm", vec![h]),
            ("attn_q", vec![h, h]),
            ("attn_k", vec![kvd, h]),
            ("attn_v", vec![kvd, h]),
            ("attn_output", vec![h, h]),
            ("ffn_gate", vec![f, h]),
            ("ffn_up", vec![f, h]),
            ("ffn_down", vec![h, f]),
        ] {
            want.push((format!("blk.{i}.{name}.weight"), shape));
        }
    }
    let file_len = g.reader.seek(SeekFrom::End(0)).map_err(|e| LlmError::io(&g.path, e))?;
    let data_start = g.content.tensor_data_offset;
    for (name, shape) in want {
        let info = g.content.tensor_infos.get(&name).ok_or_else(|| LlmError::MissingTensor { name: name.clone() })?;
        if info.shape.dims() != shape.as_slice() {
            return Err(LlmError::BadTensorShape { name, expected: shape, got: info.shape.dims().to_vec() });
        }
        // Shapes equal bounded metadata, so the element count fits; the bytes must be there.
        let (block, size) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        let elems: usize = shape.iter().product();
        let end = data_start.checked_add(info.offset).and_then(|s| s.checked_add((elems / block * size) as u64));
        if !elems.is_multiple_of(block) || end.is_none_or(|e| e > file_len) {
            return Err(LlmError::Truncated {
                path: g.path.clone(),
                detail: format!("tensor {name}: its {elems} values are not inside the file"),
            });
        }
    }
    Ok(n_vocab)
}

pub(crate) fn tensor(g: &mut Gguf, name: &str, shape: Option<&[usize]>) -> Result<QTensor> {
    if !g.content.tensor_infos.contains_key(name) {
        return Err(LlmError::MissingTensor { name: name.into() });
    }
    let t = g
        .content
        .tensor(&mut g.reader, name, &Device::Cpu)
        .map_err(|e| LlmError::Truncated { path: g.path.clone(), detail: format!("tensor {name}: {e}") })?;
    if let Some(s) = shape {
        expect_shape(name, &t, s)?;
    }
    Ok(t)
}

fn expect_shape(name: &str, t: &QTensor, shape: &[usize]) -> Result<()> {
    if t.shape().dims() != shape {
        return Err(LlmError::BadTensorShape {
            name: name.into(),
            expected: shape.to_vec(),
            got: t.shape().dims().to_vec(),
        });
    }
    Ok(())
}

pub(crate) fn vector(g: &mut Gguf, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = tensor(g, name, Some(&[len]))?;
    Ok(t.dequantize(&Device::Cpu)?.to_vec1()?)
}

/// Elementwise passes over fewer floats run on the calling thread: handing a decode step's
/// few thousand floats to the pool costs more (waking its threads, ~10 µs) than the pass
/// (measured: these passes, ~10 per layer, were a third of a packed decode step's time).
const PAR_MIN_FLOATS: usize = 1 << 15;

/// RMS norms over more values than this split over the pool, in groups of
/// [`NORM_ROWS`] rows: a 16-row batch (9,216 values) takes ~2 µs on one thread, less than
/// waking the pool for it.
const PAR_MIN_NORM: usize = 1 << 16;

/// Rows whose sums of squares run side by side: each row's f64 sum is one add after
/// another (the order that fixes its bits), ~4 cycles of latency apiece, so one row at a
/// time ran at ~1.3 ns a value; 8 independent chains keep the adder busy.
const NORM_ROWS: usize = 8;

/// Each row's `Σ v²` in f64, added in the row's order, for `G` rows of `width` at once.
#[inline(always)]
fn sums_of_squares<const G: usize>(rows: &[f32], width: usize) -> [f64; G] {
    let rows: [&[f32]; G] = std::array::from_fn(|r| &rows[r * width..(r + 1) * width]);
    let mut s = [0f64; G];
    for i in 0..width {
        for (s_r, row) in s.iter_mut().zip(&rows) {
            let v = row[i] as f64;
            *s_r += v * v;
        }
    }
    s
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let width = w.len();
    let mut out = vec![0f32; x.len()];
    let norm = |(o, r): (&mut [f32], &[f32])| {
        let mut sums = [0f64; NORM_ROWS];
        if r.len() == NORM_ROWS * width {
            sums = sums_of_squares::<NORM_ROWS>(r, width);
        } else {
            for (s, row) in sums.iter_mut().zip(r.chunks_exact(width)) {
                *s = sums_of_squares::<1>(row, width)[0];
            }
        }
        for ((o, r), &sum) in o.chunks_exact_mut(width).zip(r.chunks_exact(width)).zip(&sums) {
            let s = (1.0 / (sum / width as f64 + eps as f64).sqrt()) as f32;
            for ((o, &v), &g) in o.iter_mut().zip(r).zip(w) {
                *o = v * s * g;
            }
        }
    };
    let group = NORM_ROWS * width;
    if x.len() < PAR_MIN_NORM {
        out.chunks_mut(group).zip(x.chunks(group)).for_each(norm);
    } else {
        out.par_chunks_mut(group).zip(x.par_chunks(group)).for_each(norm);
    }
    out
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    if x.len() < PAR_MIN_FLOATS {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
    } else {
        x.par_iter_mut().zip(y.par_iter()).for_each(|(a, b)| *a += b);
    }
}

/// SwiGLU passes over more values than this split over the pool: a batched step's
/// 16 × 1536 values took ~16 µs a layer on one thread (the division dominates), a single
/// sequence's 1536 ~2 µs, less than handing them out.
const PAR_MIN_SWIGLU: usize = 1 << 14;

/// silu(g) · u = g / (1 + e^−g) · u, with e^−g by `exp_approx` (relative error < 3e-7;
/// clamped to [−87, 88], where the result is 0 or g · u to f32 precision): branch-free, so a
/// row vectorizes (glibc's `expf`, one call per value, was 1.4 ms of a 16-row decode step).
#[inline(always)]
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + veloxquant::cpu::exp_approx((-g).min(88.0))) * u
}

/// One row of [`swiglu`]: the same operations on each value whatever the vector width, so
/// the AVX-512 build of it gives the same bits as the portable one.
#[inline(always)]
fn swiglu_row(o: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
        *o = silu_times(g, u);
    }
}

/// [`swiglu_row`] compiled for AVX-512 (16 values per instruction).
/// Safety: the CPU has AVX512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu_row_avx512(o: &mut [f32], gate: &[f32], up: &[f32]) {
    swiglu_row(o, gate, up)
}

/// SwiGLU of the joined gate/up product `gu [n][gate | up]` (each `f` wide): `[n][f]`,
/// silu(gate) · up.
fn swiglu(gu: &[f32], f: usize) -> Vec<f32> {
    let mut out = vec![0f32; gu.len() / 2];
    #[cfg(target_arch = "x86_64")]
    let wide = veloxquant::cpu::simd_level() == veloxquant::cpu::SimdLevel::Avx512;
    let row = |(o, r): (&mut [f32], &[f32])| {
        let (gate, up) = r.split_at(f);
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: AVX-512 was detected at run time (`simd_level`).
            return unsafe { swiglu_row_avx512(o, gate, up) };
        }
        swiglu_row(o, gate, up)
    };
    if out.len() < PAR_MIN_SWIGLU {
        out.chunks_mut(f).zip(gu.chunks(2 * f)).for_each(row);
    } else {
        out.par_chunks_mut(f).zip(gu.par_chunks(2 * f)).for_each(row);
    }
    out
}

/// [n][n_heads][hd] → [n_heads][n][hd] (one token's rows are already in that order).
fn to_heads(x: &[f32], n: usize, n_heads: usize, hd: usize) -> std::borrow::Cow<'_, [f32]> {
    if n == 1 || n_heads == 1 {
        return x.into();
    }
    let mut out = vec![0f32; x.len()];
    for t in 0..n {
        for h in 0..n_heads {
            let src = (t * n_heads + h) * hd;
            let dst = (h * n + t) * hd;
            out[dst..dst + hd].copy_from_slice(&x[src..src + hd]);
        }
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::{rms_norm, silu_times, swiglu};
    use veloxquant::rng::SplitMix64;

    /// The norm and SwiGLU are the same bits as their one-value-at-a-time definitions, for
    /// row counts around the norm's groups of 8 and past its parallel threshold.
    #[test]
    fn rms_norm_and_swiglu_equal_their_definitions_bit_for_bit() {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (width, rows) in [(576, 1), (576, 7), (576, 8), (576, 9), (576, 17), (96, 700), (1536, 3)] {
            let mut rng = SplitMix64::new((width * 1000 + rows) as u64);
            let mut x = rng.gaussian_vec(width * rows);
            x[0] = 0.0;
            x[width * rows - 1] *= 1e3;
            let w = rng.gaussian_vec(width);
            let want: Vec<f32> = x
                .chunks(width)
                .flat_map(|r| {
                    let ms = r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / r.len() as f64;
                    let s = (1.0 / (ms + 1e-5f64).sqrt()) as f32;
                    r.iter().zip(&w).map(move |(&v, &g)| v * s * g)
                })
                .collect();
            assert_eq!(bits(&rms_norm(&x, &w, 1e-5)), bits(&want), "rms_norm {rows}×{width}");
            let gu = rng.gaussian_vec(2 * width * rows);
            let want: Vec<f32> = gu
                .chunks(2 * width)
                .flat_map(|r| {
                    let (gate, up) = r.split_at(width);
                    gate.iter().zip(up).map(|(&g, &u)| silu_times(g, u))
                })
                .collect();
            assert_eq!(bits(&swiglu(&gu, width)), bits(&want), "swiglu {rows}×{width}");
        }
    }

    /// silu(g) · u against f64, over gates from −120 to 120 (both clamps of the exp).
    #[test]
    fn silu_matches_f64() {
        let mut worst = 0f64;
        for i in -240_000..=240_000 {
            let g = i as f32 * 5e-4;
            let want = g as f64 / (1.0 + (-(g as f64)).exp()) * 1.5;
            let got = silu_times(g, 1.5) as f64;
            // Relative where the value is representable; near-zero tails absolutely.
            let err = (got - want).abs() / want.abs().max(1e-30);
            if want.abs() > 1e-30 {
                worst = worst.max(err);
            } else {
                assert!(got.abs() < 1e-30, "g={g}: {got} vs {want}");
            }
        }
        assert!(worst < 1e-6, "relative error {worst}");
    }
}
