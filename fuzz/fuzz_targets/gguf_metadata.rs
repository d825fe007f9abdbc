//! Any bytes as a GGUF file's header and metadata: parse, derive the model config and
//! build the tokenizer, as loading a model does before reading tensors. Errors only.
#![no_main]

use libfuzzer_sys::fuzz_target;
use veloxquant_llm::gguf::Gguf;
use veloxquant_llm::{LlamaConfig, Tokenizer};

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::from_reader(std::io::Cursor::new(data), "fuzz-input") {
        let _ = LlamaConfig::from_metadata(&g);
        if let Ok(tok) = Tokenizer::from_gguf(&g) {
            let _ = tok.encode("Hello 123 world");
            let _ = tok.decode(&[0, 1, 2]);
        }
    }
});
