//! Opening a GGUF file and typed metadata access with our error variants.

use crate::error::{LlmError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};

/// A parsed GGUF header plus the reader (the open file) for reading tensors.
pub struct Gguf<R = BufReader<File>> {
    pub path: PathBuf,
    pub content: Content,
    pub reader: R,
}

impl Gguf {
    /// Opens and parses the header; a short or garbled file gives `Truncated`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => LlmError::ModelNotFound { path: path.to_path_buf() },
            _ => LlmError::io(path, e),
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| LlmError::Truncated {
            path: path.to_path_buf(),
            detail: format!("GGUF header unreadable: {e}"),
        })?;
        Ok(Self { path: path.to_path_buf(), content, reader })
    }
}

impl<R: Read + Seek> Gguf<R> {
    /// Parses the header from any reader (memory, a fuzzer's input); `name` labels errors.
    /// candle's reader bounds every declared string and array by the bytes that remain.
    pub fn from_reader(mut reader: R, name: &str) -> Result<Self> {
        let content = Content::read(&mut reader).map_err(|e| LlmError::Truncated {
            path: PathBuf::from(name),
            detail: format!("GGUF header unreadable: {e}"),
        })?;
        Ok(Self { path: PathBuf::from(name), content, reader })
    }
}

impl<R> Gguf<R> {
    fn value(&self, key: &str) -> Result<&Value> {
        self.content.metadata.get(key).ok_or_else(|| missing(key))
    }

    pub fn has(&self, key: &str) -> bool {
        self.content.metadata.contains_key(key)
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.value(key)?.to_string().map(|s| s.as_str()).map_err(|_| missing(key))
    }

    /// Any integer type, as usize (GGUF writers differ in the width they pick).
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.value(key)?;
        let n = match v {
            Value::U8(x) => *x as i64,
            Value::I8(x) => *x as i64,
            Value::U16(x) => *x as i64,
            Value::I16(x) => *x as i64,
            Value::U32(x) => *x as i64,
            Value::I32(x) => *x as i64,
            Value::U64(x) => *x as i64,
            Value::I64(x) => *x,
            _ => return Err(missing(key)),
        };
        usize::try_from(n).map_err(|_| missing(key))
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        match self.value(key)? {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            _ => Err(missing(key)),
        }
    }

    pub fn bool(&self, key: &str) -> Result<bool> {
        self.value(key)?.to_bool().map_err(|_| missing(key))
    }

    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self.value(key)?.to_vec().map_err(|_| missing(key))?;
        arr.iter().map(|v| v.to_string().map(|s| s.as_str()).map_err(|_| missing(key))).collect()
    }

    pub fn i32_array(&self, key: &str) -> Result<Vec<i32>> {
        let arr = self.value(key)?.to_vec().map_err(|_| missing(key))?;
        arr.iter()
            .map(|v| match v {
                Value::I32(x) => Ok(*x),
                Value::U32(x) => Ok(*x as i32),
                _ => Err(missing(key)),
            })
            .collect()
    }

    /// Checks `general.architecture == "llama"`.
    pub fn check_llama(&self) -> Result<()> {
        let arch = self.str("general.architecture")?;
        if arch != "llama" {
            return Err(LlmError::WrongArchitecture { found: arch.into() });
        }
        Ok(())
    }
}

fn missing(key: &str) -> LlmError {
    LlmError::MissingMetadata { key: key.into() }
}
