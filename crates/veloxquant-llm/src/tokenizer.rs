//! Byte-level BPE tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.*`).

use crate::error::{LlmError, Result};
use crate::gguf::Gguf;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

/// GGUF token type for control tokens (llama.cpp `LLAMA_TOKEN_TYPE_CONTROL`).
const TOKEN_TYPE_CONTROL: i32 = 3;

/// Tokenizer plus the special-token facts the harness needs.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab: HashMap<String, u32>,
    id_to_token: Vec<String>,
    is_control: Vec<bool>,
    /// BOS id, present only when the GGUF asks for it to be prepended.
    pub add_bos: Option<u32>,
    pub eos: Option<u32>,
}

impl Tokenizer {
    pub fn from_gguf_path(path: &Path) -> Result<Self> {
        Self::from_gguf(&Gguf::open(path)?)
    }

    /// Supports `tokenizer.ggml.model == "gpt2"` with the `smollm` (or default GPT-2) pre-tokenizer.
    pub fn from_gguf<R>(g: &Gguf<R>) -> Result<Self> {
        let model = g.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(LlmError::Tokenizer(format!(
                "tokenizer model {model:?} unsupported (only byte-level BPE \"gpt2\")"
            )));
        }
        let tokens = g.str_array("tokenizer.ggml.tokens")?;
        let merges_raw = g.str_array("tokenizer.ggml.merges")?;
        let types = if g.has("tokenizer.ggml.token_type") {
            g.i32_array("tokenizer.ggml.token_type")?
        } else {
            vec![1; tokens.len()]
        };
        let pre = if g.has("tokenizer.ggml.pre") { g.str("tokenizer.ggml.pre")? } else { "default" };
        let mut vocab = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert((*t).to_string(), i as u32);
        }
        let merges = merges_raw
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| LlmError::Tokenizer(format!("malformed merge {m:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(
                vocab.iter().map(|(k, v)| (k.clone(), *v)).collect::<tokenizers::models::bpe::Vocab>(),
                merges,
            )
            .build()
            .map_err(|e| LlmError::Tokenizer(e.to_string()))?;
        let byte_level = ByteLevel::new(false, false, true);
        // llama.cpp "smollm": every \p{N} char is its own piece, then the GPT-2 pattern.
        let pre_tok: PreTokenizerWrapper = match pre {
            "smollm" => {
                let digits = Split::new(SplitPattern::Regex(r"\p{N}".into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| LlmError::Tokenizer(e.to_string()))?;
                Sequence::new(vec![digits.into(), byte_level.into()]).into()
            }
            "default" | "gpt2" | "gpt-2" => byte_level.into(),
            other => return Err(LlmError::Tokenizer(format!("pre-tokenizer {other:?} unsupported (smollm, gpt2)"))),
        };
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let add_bos_flag = g.has("tokenizer.ggml.add_bos_token") && g.bool("tokenizer.ggml.add_bos_token")?;
        let bos = opt_id(g, "tokenizer.ggml.bos_token_id")?;
        let eos = opt_id(g, "tokenizer.ggml.eos_token_id")?;
        Ok(Self {
            inner,
            vocab,
            id_to_token: tokens.iter().map(|s| s.to_string()).collect(),
            is_control: (0..tokens.len()).map(|i| types.get(i) == Some(&TOKEN_TYPE_CONTROL)).collect(),
            add_bos: if add_bos_flag { bos } else { None },
            eos,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.id_to_token.len()
    }

    /// Encodes plain text; special-token text is not parsed (llama.cpp `parse_special = false`).
    /// Prepends BOS only when the GGUF says so.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| LlmError::Tokenizer(e.to_string()))?;
        let mut out = Vec::with_capacity(enc.len() + 1);
        out.extend(self.add_bos);
        out.extend_from_slice(enc.get_ids());
        Ok(out)
    }

    /// Encodes without BOS (for pieces spliced into a prompt).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| LlmError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids; control tokens are kept as their literal text.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| LlmError::Tokenizer(e.to_string()))
    }

    /// Ids that end a generation: EOS and ChatML's `<|im_end|>`, where the vocabulary has them.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.eos.into_iter().chain(self.token_id("<|im_end|>")).collect()
    }

    /// Id of an exact vocabulary entry such as `<|im_start|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }
}

fn opt_id<R>(g: &Gguf<R>, key: &str) -> Result<Option<u32>> {
    if g.has(key) {
        Ok(Some(g.usize(key)? as u32))
    } else {
        Ok(None)
    }
}
