//! Lengths beyond the model's context, on a tiny random model (no download): typed errors
//! before any work, never an allocation failure or a hang; and streamed text in whole
//! characters.

mod common;

use common::tiny;
use veloxquant_llm::generate::{continue_ids, generate_ids};
use veloxquant_llm::{
    passkey_accuracy, passkey_prompt, perplexity, Fp16Store, Greedy, KvStore, Llama, LlmError, PasskeyFormat,
    TextStream, Tokenizer, WeightMode,
};

/// The tiny model, from a file of the calling test's own (tests run in parallel).
fn tiny_model(test: &str) -> (Llama, Tokenizer) {
    let dir = std::env::temp_dir().join(format!("vq-llm-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{test}.gguf"));
    tiny::write_tiny_llama(&path, 3);
    let loaded = (Llama::load(&path, WeightMode::DequantF32).unwrap(), Tokenizer::from_gguf_path(&path).unwrap());
    std::fs::remove_file(&path).ok();
    loaded
}

fn overflow<T: std::fmt::Debug>(r: Result<T, LlmError>) -> bool {
    matches!(r, Err(LlmError::ContextOverflow { n_ctx_train: tiny::N_CTX, .. }))
}

#[test]
fn lengths_beyond_the_context_are_refused_before_any_work() {
    let (m, tok) = tiny_model("lengths");
    let c = m.config.clone();
    let prompt = tok.encode("Hello").unwrap();
    let t0 = std::time::Instant::now();
    for max_tokens in [usize::MAX, 1_000_000_000_000, tiny::N_CTX] {
        let mut store = Fp16Store::for_config(&c, prompt.len().saturating_add(max_tokens));
        let r = generate_ids(&m, &prompt, max_tokens, &[], &mut store, &mut Greedy, &mut |_| true);
        assert!(overflow(r), "generate --max-tokens {max_tokens}");
        assert_eq!(store.len(0), 0, "nothing prefilled");
        let r = continue_ids(&m, prompt[0], max_tokens, &[], &mut store, &mut Greedy, &mut |_| true);
        assert!(overflow(r), "continue {max_tokens}");
    }
    // At the limit the whole text fits: prompt + generated = the context.
    let mut store = Fp16Store::for_config(&c, tiny::N_CTX);
    let g = generate_ids(&m, &prompt, tiny::N_CTX - prompt.len(), &[], &mut store, &mut Greedy, &mut |_| true).unwrap();
    assert_eq!(prompt.len() + g.tokens.len(), tiny::N_CTX);
    let mut f = || -> veloxquant_llm::Result<Box<dyn KvStore>> { Ok(Box::new(Fp16Store::for_config(&c, 64))) };
    for target in [1_000_000_000_000, 20_000, tiny::N_CTX] {
        let r = passkey_accuracy(&m, &tok, &mut f, target, &[0.5], 1, 7, PasskeyFormat::Plain);
        assert!(overflow(r), "passkey --lengths {target}");
    }
    let r = passkey_prompt(&tok, 1_000_000_000_000, 0.5, 1, PasskeyFormat::Plain);
    assert!(matches!(r, Err(LlmError::InvalidArgument(_))), "{:?}", r.err());
    for (n, depths) in [(0, &[0.5][..]), (1, &[][..])] {
        let r = passkey_accuracy(&m, &tok, &mut f, 100, depths, n, 7, PasskeyFormat::Plain);
        assert!(matches!(r, Err(LlmError::InvalidArgument(_))), "n {n}: {:?}", r.err());
    }
    // A window of n_ctx evaluates n_ctx − 1 positions: N_CTX + 1 fits, N_CTX + 2 does not.
    let tokens: Vec<u32> = (0..4 * tiny::N_CTX as u32).map(|i| i % 200).collect();
    assert!(overflow(perplexity(&m, &tokens, tiny::N_CTX + 2, 1, None, &mut f)));
    assert!(perplexity(&m, &tokens, tiny::N_CTX + 1, 1, None, &mut f).is_ok());
    assert!(t0.elapsed().as_secs() < 30, "refusals took {:?}", t0.elapsed());
}

#[test]
fn streamed_text_comes_in_whole_characters() {
    let (_, tok) = tiny_model("stream");
    // The tiny vocabulary holds single bytes: every multi-byte character spans tokens.
    let text = "naïve café — 日本 🦀!";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() > text.chars().count(), "characters split across tokens");
    let one_by_one: String = ids.iter().map(|&id| tok.decode(&[id]).unwrap()).collect();
    assert!(one_by_one.contains('\u{FFFD}'), "decoding single tokens breaks characters");
    let mut s = TextStream::new(&tok);
    let mut out = String::new();
    for &id in &ids {
        let piece = s.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        out += &piece;
    }
    out += &s.finish().unwrap();
    assert_eq!(out, text);
    // An unfinished character at the end comes out (as U+FFFD) from finish.
    let mut s = TextStream::new(&tok);
    let crab = tok.encode("🦀").unwrap();
    assert_eq!(s.push(crab[0]).unwrap(), "");
    assert_eq!(s.finish().unwrap(), "\u{FFFD}");
}
