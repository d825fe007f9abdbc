//! Passkey retrieval: a 5-digit number hidden in filler text at a chosen depth.

use crate::error::{LlmError, Result};
use crate::generate::{generate_ids, Greedy};
use crate::model::Llama;
use crate::store::StoreFactory;
use crate::tokenizer::Tokenizer;

const INTRO: &str = "There is an important info hidden inside a lot of irrelevant text. \
Find it and memorize it. I will quiz you about the important information there.\n\n";
const FILLER: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
// Ends with the space so the next token must start the number (digits are split singly,
// so the needle reads "is", " ", "7", ...).
const QUESTION: &str = "\n\nWhat is the pass key? The pass key is ";
/// Tokens decoded after the prompt: a space and five single-digit tokens, plus slack; a chat
/// answer first restates "The pass key is".
const ANSWER_TOKENS_PLAIN: usize = 8;
const ANSWER_TOKENS_CHAT: usize = 16;
/// Longest prompt built (far above any context here; the text grows with it).
pub const MAX_PASSKEY_TOKENS: usize = 1 << 20;

/// Prompt wrapping: plain text, or SmolLM2's ChatML template around the same text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PasskeyFormat {
    #[default]
    Plain,
    Chat,
}

#[derive(Clone, Debug)]
pub struct PasskeyPrompt {
    pub tokens: Vec<u32>,
    pub passkey: u32,
    /// Fraction of the filler placed before the needle.
    pub depth: f64,
}

/// Builds a prompt of at most `target_tokens` tokens (close to it) with a seeded passkey
/// hidden after `depth` (0..=1) of the filler.
pub fn passkey_prompt(
    tok: &Tokenizer,
    target_tokens: usize,
    depth: f64,
    seed: u64,
    format: PasskeyFormat,
) -> Result<PasskeyPrompt> {
    if !(0.0..=1.0).contains(&depth) {
        return Err(LlmError::InvalidArgument(format!("depth {depth} not in [0, 1]")));
    }
    if target_tokens > MAX_PASSKEY_TOKENS {
        return Err(LlmError::InvalidArgument(format!(
            "passkey prompt of {target_tokens} tokens: at most {MAX_PASSKEY_TOKENS}"
        )));
    }
    let passkey = 10_000 + (veloxquant::rng::SplitMix64::new(seed).next_u64() % 90_000) as u32;
    let needle = format!("The pass key is {passkey}. Remember it. {passkey} is the pass key. ");
    let (head, tail) = match format {
        PasskeyFormat::Plain => (Vec::new(), Vec::new()),
        PasskeyFormat::Chat => chat_wrap(tok)?,
    };
    let fixed = tok.encode(INTRO)?.len()
        + tok.encode_raw(&needle)?.len()
        + tok.encode_raw(QUESTION)?.len()
        + head.len()
        + tail.len();
    // Measured inside a run: a filler's trailing space merges with the next "The".
    let per_filler = tok.encode_raw(&FILLER.repeat(9))?.len() - tok.encode_raw(&FILLER.repeat(8))?.len();
    if fixed + per_filler > target_tokens {
        return Err(LlmError::InvalidArgument(format!(
            "target {target_tokens} tokens is too short for a passkey prompt"
        )));
    }
    let mut n_fill = (target_tokens - fixed) / per_filler + 2; // overshoot, then trim

    loop {
        let before = ((n_fill as f64) * depth).round() as usize;
        let text = format!("{INTRO}{}{needle}{}{QUESTION}", FILLER.repeat(before), FILLER.repeat(n_fill - before));
        let body = tok.encode(&text)?;
        let mut tokens = Vec::with_capacity(body.len() + head.len() + tail.len());
        tokens.extend_from_slice(&head);
        tokens.extend_from_slice(&body);
        tokens.extend_from_slice(&tail);
        if tokens.len() <= target_tokens || n_fill == 0 {
            return Ok(PasskeyPrompt { tokens, passkey, depth });
        }
        n_fill -= 1;
    }
}

// "<|im_start|>user\n" … "<|im_end|>\n<|im_start|>assistant\n", special ids spliced in.
fn chat_wrap(tok: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>)> {
    let id = |t: &str| tok.token_id(t).ok_or_else(|| LlmError::Tokenizer(format!("vocabulary lacks {t}")));
    let (start, end) = (id("<|im_start|>")?, id("<|im_end|>")?);
    let mut head = vec![start];
    head.extend(tok.encode_raw("user\n")?);
    let mut tail = vec![end];
    tail.extend(tok.encode_raw("\n")?);
    tail.push(start);
    tail.extend(tok.encode_raw("assistant\n")?);
    Ok((head, tail))
}

/// First run of exactly five digits in `text`.
pub fn extract_passkey(text: &str) -> Option<u32> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let j = (i..bytes.len()).find(|&j| !bytes[j].is_ascii_digit()).unwrap_or(bytes.len());
            if j - i == 5 {
                return text[i..j].parse().ok();
            }
            i = j;
        } else {
            i += 1;
        }
    }
    None
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct PasskeyStats {
    pub target_tokens: usize,
    pub n_trials: usize,
    pub n_correct: usize,
    /// (depth, trials, correct)
    pub per_depth: Vec<(f64, usize, usize)>,
    /// Wrong answers: (depth, passkey, decoded answer text).
    pub failures: Vec<(f64, u32, String)>,
}

impl PasskeyStats {
    pub fn accuracy(&self) -> f64 {
        self.n_correct as f64 / self.n_trials.max(1) as f64
    }
}

/// Tokens decoded for an answer: a prompt of `target_tokens` needs this many more in the
/// model's context.
pub fn answer_tokens(format: PasskeyFormat) -> usize {
    match format {
        PasskeyFormat::Plain => ANSWER_TOKENS_PLAIN,
        PasskeyFormat::Chat => ANSWER_TOKENS_CHAT,
    }
}

/// At least one trial at one depth (the CPU and GPU harnesses refuse the same).
pub fn check_trials(n: usize, depths: &[f64]) -> Result<()> {
    if n == 0 || depths.is_empty() {
        return Err(LlmError::InvalidArgument(format!(
            "passkey: {n} trials at {} depths: nothing to measure",
            depths.len()
        )));
    }
    Ok(())
}

/// The seed of trial `trial` at depth index `di` (the CPU and GPU runs build the same prompts).
pub fn trial_seed(seed: u64, di: usize, trial: usize) -> u64 {
    seed ^ ((di as u64) << 32) ^ (trial as u64).wrapping_mul(0x9E37_79B9)
}

/// Greedy-decodes the answer for `n` seeded prompts at each depth; a trial is correct when
/// the first five-digit number generated equals the passkey.
#[allow(clippy::too_many_arguments)]
pub fn passkey_accuracy(
    model: &Llama,
    tok: &Tokenizer,
    factory: &mut StoreFactory,
    target_tokens: usize,
    depths: &[f64],
    n: usize,
    seed: u64,
    format: PasskeyFormat,
) -> Result<PasskeyStats> {
    check_trials(n, depths)?;
    let answer = answer_tokens(format);
    // Prompt and answer must fit the context: refused before any prompt is built.
    let n_ctx_train = model.config.n_ctx_train;
    match target_tokens.checked_add(answer) {
        Some(pos) if pos <= n_ctx_train => {}
        pos => return Err(LlmError::ContextOverflow { pos: pos.unwrap_or(usize::MAX), n_ctx_train }),
    }
    let stop = tok.stop_ids();
    let mut stats = PasskeyStats { target_tokens, ..Default::default() };
    for (di, &depth) in depths.iter().enumerate() {
        let mut correct = 0;
        for trial in 0..n {
            let trial_seed = trial_seed(seed, di, trial);
            let p = passkey_prompt(tok, target_tokens, depth, trial_seed, format)?;
            let mut store = factory()?;
            let g = generate_ids(model, &p.tokens, answer, &stop, store.as_mut(), &mut Greedy, &mut |_| true)?;
            let text = tok.decode(&g.tokens)?;
            if extract_passkey(&text) == Some(p.passkey) {
                correct += 1;
            } else {
                stats.failures.push((depth, p.passkey, text));
            }
        }
        stats.per_depth.push((depth, n, correct));
        stats.n_trials += n;
        stats.n_correct += correct;
    }
    Ok(stats)
}
