//! A tiny random Llama GGUF written at test time (2 layers, 4 query / 2 KV heads of size 16,
//! context 1024, a byte-level vocabulary of the 256 bytes + 2 merges + an end token), so the
//! model's code paths run without the real model. Shared by the llm and CLI tests.
#![allow(dead_code)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use veloxquant::rng::SplitMix64;

pub const N_CTX: usize = 1024;
pub const HIDDEN: usize = 64;
const FFN: usize = 128;
const N_HEADS: usize = 4;
const N_KV_HEADS: usize = 2;
const N_LAYERS: usize = 2;

/// GPT-2's byte-to-character map: printable bytes stand for themselves, the others for
/// code points from 256 on (what a byte-level BPE vocabulary spells tokens with).
fn byte_char(b: u8) -> char {
    let printable = |c: u32| (0x21..=0x7E).contains(&c) || (0xA1..=0xAC).contains(&c) || (0xAE..=0xFF).contains(&c);
    if printable(b as u32) {
        return char::from(b);
    }
    let rank = (0..b as u32).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + rank).expect("valid code point")
}

/// Token ids: byte b is id b; then "He", "ll", and the end token.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    v.extend(["He".to_string(), "ll".to_string(), "<|endoftext|>".to_string()]);
    v
}

pub fn n_vocab() -> usize {
    vocabulary().len()
}

fn weight(rng: &mut SplitMix64, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QTensor {
    let w: Vec<f32> = rng.gaussian_vec(rows * cols).iter().map(|x| x * scale).collect();
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn ones(n: usize) -> QTensor {
    QTensor::quantize(&Tensor::ones(n, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap()
}

/// The GGUF bytes of a tiny model with seeded random weights (tied embeddings).
pub fn tiny_llama(seed: u64) -> Vec<u8> {
    tiny_llama_as(seed, GgmlDType::F32, GgmlDType::F32)
}

/// As [`tiny_llama`], the layers' matmul weights stored as `dtype` and the embedding as
/// `embd` (the real model: Q4_1 layers, a Q8_0 embedding).
pub fn tiny_llama_as(seed: u64, dtype: GgmlDType, embd: GgmlDType) -> Vec<u8> {
    let tokens = vocabulary();
    let n_vocab = tokens.len();
    let u32v = |x: usize| Value::U32(x as u32);
    let strs = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let mut types = vec![Value::I32(1); n_vocab];
    types[n_vocab - 1] = Value::I32(3); // control
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u32v(N_LAYERS)),
        ("llama.context_length", u32v(N_CTX)),
        ("llama.embedding_length", u32v(HIDDEN)),
        ("llama.feed_forward_length", u32v(FFN)),
        ("llama.attention.head_count", u32v(N_HEADS)),
        ("llama.attention.head_count_kv", u32v(N_KV_HEADS)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", strs(&tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", strs(&["H e".to_string(), "l l".to_string()])),
        ("tokenizer.ggml.eos_token_id", u32v(n_vocab - 1)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ];
    let mut rng = SplitMix64::new(seed);
    let (h, kvd, s) = (HIDDEN, N_KV_HEADS * HIDDEN / N_HEADS, 1.0 / (HIDDEN as f32).sqrt());
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), weight(&mut rng, n_vocab, h, 1.0, embd)),
        ("output_norm.weight".into(), ones(h)),
    ];
    for i in 0..N_LAYERS {
        let mut add = |name: &str, t: QTensor| tensors.push((format!("blk.{i}.{name}.weight"), t));
        add("attn_norm", ones(h));
        add("ffn_norm", ones(h));
        add("attn_q", weight(&mut rng, h, h, 2.0 * s, dtype));
        add("attn_k", weight(&mut rng, kvd, h, 2.0 * s, dtype));
        add("attn_v", weight(&mut rng, kvd, h, s, dtype));
        add("attn_output", weight(&mut rng, h, h, s, dtype));
        add("ffn_gate", weight(&mut rng, FFN, h, s, dtype));
        add("ffn_up", weight(&mut rng, FFN, h, s, dtype));
        add("ffn_down", weight(&mut rng, h, FFN, s, dtype));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
    out.into_inner()
}

/// Writes the tiny model to `path`.
pub fn write_tiny_llama(path: &std::path::Path, seed: u64) {
    std::fs::write(path, tiny_llama(seed)).unwrap();
}

/// Byte offset of the first dimension (u64, GGUF order: innermost first) of tensor `name`
/// in a GGUF written by candle (name, u32 n_dims, dims).
pub fn tensor_dims_offset(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key).expect("tensor name in the file");
    at + key.len() + 4
}
