//! Streaming text generation.

use crate::error::{LlmError, Result};
use crate::eval::argmax;
use crate::model::Llama;
use crate::store::KvStore;
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// Chooses the next token from a logits row.
pub trait Sampler {
    fn sample(&mut self, logits: &[f32]) -> u32;
}

/// Argmax decoding (first index on ties).
#[derive(Clone, Copy, Debug, Default)]
pub struct Greedy;

impl Sampler for Greedy {
    fn sample(&mut self, logits: &[f32]) -> u32 {
        argmax(logits) as u32
    }
}

/// Prompt tokens per forward call during prefill; bounds activation memory on long prompts.
pub const PREFILL_CHUNK: usize = 2048;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenStats {
    /// Generated ids (without the prompt).
    pub tokens: Vec<u32>,
    pub n_prompt: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second, excluding prefill.
    pub decode_tokens_per_s: f64,
}

/// Greedy/sampled generation from token ids; `on_token(id)` returns false to stop early.
/// Stops at `stop` ids. The store must be empty or hold exactly the context before `prompt`.
#[allow(clippy::too_many_arguments)]
pub fn generate_ids(
    model: &Llama,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    store: &mut dyn KvStore,
    sampler: &mut dyn Sampler,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenStats> {
    if prompt.is_empty() {
        return Err(LlmError::InvalidArgument("empty prompt".into()));
    }
    check_room(model, store, prompt.len(), max_tokens)?;
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(PREFILL_CHUNK) {
        logits = model.forward(chunk, store, chunk.len() - 1)?;
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let out = decode_loop(model, logits, max_tokens, stop, store, sampler, on_token)?;
    let decode_s = t1.elapsed().as_secs_f64();
    Ok(GenStats {
        n_prompt: prompt.len(),
        prefill_s,
        decode_s,
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s,
        decode_tokens_per_s: out.len() as f64 / decode_s.max(1e-9),
        tokens: out,
    })
}

/// Generation from a store that already holds the context before `next` (a cache saved
/// after prefilling all but the last prompt token, then loaded): feeds `next` as a decode
/// step, then samples as [`generate_ids`] does. Prefill, save, load and this give the same
/// tokens as prefill and this in one process.
pub fn continue_ids(
    model: &Llama,
    next: u32,
    max_tokens: usize,
    stop: &[u32],
    store: &mut dyn KvStore,
    sampler: &mut dyn Sampler,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    check_room(model, store, 1, max_tokens)?;
    let logits = model.forward(&[next], store, 0)?;
    decode_loop(model, logits, max_tokens, stop, store, sampler, on_token)
}

/// The whole text — what `store` holds, `n_input` new tokens and `max_tokens` generated —
/// must fit the model's context: checked before any work (and before `max_tokens` sizes
/// anything), so a huge request is a clear error, not an allocation failure.
fn check_room(model: &Llama, store: &dyn KvStore, n_input: usize, max_tokens: usize) -> Result<()> {
    let n_ctx_train = model.config.n_ctx_train;
    match store.len(0).checked_add(n_input).and_then(|n| n.checked_add(max_tokens)) {
        Some(pos) if pos <= n_ctx_train => Ok(()),
        pos => Err(LlmError::ContextOverflow { pos: pos.unwrap_or(usize::MAX), n_ctx_train }),
    }
}

fn decode_loop(
    model: &Llama,
    mut logits: Vec<f32>,
    max_tokens: usize,
    stop: &[u32],
    store: &mut dyn KvStore,
    sampler: &mut dyn Sampler,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(max_tokens);
    for step in 0..max_tokens {
        let next = sampler.sample(&logits);
        out.push(next);
        if stop.contains(&next) || !on_token(next) || step + 1 == max_tokens {
            break;
        }
        logits = model.forward(&[next], store, 0)?;
    }
    Ok(out)
}

/// Encodes `prompt`, generates up to `max_tokens`, streaming decoded text to `on_text`
/// (whole UTF-8 characters only). Stops at EOS or `<|im_end|>`.
pub fn generate(
    model: &Llama,
    tok: &Tokenizer,
    prompt: &str,
    max_tokens: usize,
    store: &mut dyn KvStore,
    sampler: &mut dyn Sampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenStats> {
    let ids = tok.encode(prompt)?;
    generate_from_ids(model, tok, &ids, max_tokens, store, sampler, on_text)
}

/// As [`generate`] from already-built ids (e.g. a chat template with special tokens).
pub fn generate_from_ids(
    model: &Llama,
    tok: &Tokenizer,
    ids: &[u32],
    max_tokens: usize,
    store: &mut dyn KvStore,
    sampler: &mut dyn Sampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenStats> {
    let stop = tok.stop_ids();
    let mut stream = TextStream::new(tok);
    let mut err = None;
    let stats = generate_ids(model, ids, max_tokens, &stop, store, sampler, &mut |id| {
        if stop.contains(&id) {
            return false;
        }
        match stream.push(id) {
            Ok(text) => {
                if !text.is_empty() {
                    on_text(&text);
                }
                true
            }
            Err(e) => {
                err = Some(e);
                false
            }
        }
    })?;
    if let Some(e) = err {
        return Err(e);
    }
    let rest = stream.finish()?;
    if !rest.is_empty() {
        on_text(&rest);
    }
    Ok(stats)
}

/// The decoded text of a growing token sequence, handed out in whole UTF-8 characters: a
/// character whose bytes span several byte-level tokens waits for its last byte (decoding
/// one token at a time prints U+FFFD instead).
pub struct TextStream<'a> {
    tok: &'a Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self { tok, ids: Vec::new(), printed: 0 }
    }

    /// Adds `id`; returns the text completed by it (empty while a character is unfinished).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids)?;
        // A trailing U+FFFD is a character split across tokens: wait for the rest.
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = text.get(self.printed..).unwrap_or_default().to_string();
        self.printed = text.len();
        Ok(new)
    }

    /// What is left: an unfinished character at the end, as U+FFFD.
    pub fn finish(self) -> Result<String> {
        let text = self.tok.decode(&self.ids)?;
        Ok(text.get(self.printed..).unwrap_or_default().to_string())
    }
}
