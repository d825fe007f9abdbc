//! Opening a GGUF file and typed metadata access with our error variants.

use crate::error::{LlmError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
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
        let content = read_content(&mut reader, path)?;
        Ok(Self { path: path.to_path_buf(), content, reader })
    }
}

impl<R: Read + Seek> Gguf<R> {
    /// Parses the header from any reader (memory, a fuzzer's input); `name` labels errors.
    /// candle's reader bounds every declared string and array by the bytes that remain.
    pub fn from_reader(mut reader: R, name: &str) -> Result<Self> {
        let content = read_content(&mut reader, Path::new(name))?;
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

    /// Length of an array value (e.g. the vocabulary), without converting its elements.
    pub fn array_len(&self, key: &str) -> Result<usize> {
        Ok(self.value(key)?.to_vec().map_err(|_| missing(key))?.len())
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

/// candle's header reader, after our own walk over the key/value section: candle 0.11
/// divides by `general.alignment` unchecked, so a 0 there would panic (found by the
/// gguf_metadata fuzz target; the input is kept in fuzz/regressions).
fn read_content<R: Read + Seek>(reader: &mut R, path: &Path) -> Result<Content> {
    let unreadable = |detail: String| LlmError::Truncated { path: path.to_path_buf(), detail };
    let start = reader.stream_position().map_err(|e| LlmError::io(path, e))?;
    check_alignment(reader).map_err(|e| unreadable(format!("GGUF metadata: {e}")))?;
    reader.seek(SeekFrom::Start(start)).map_err(|e| LlmError::io(path, e))?;
    Content::read(reader).map_err(|e| unreadable(format!("GGUF header unreadable: {e}")))
}

/// Walks the metadata (never allocating a declared size: values are skipped) and fails if
/// `general.alignment` is an integer 0. Lengths are u32 in GGUF v1, u64 after.
fn check_alignment<R: Read + Seek>(r: &mut R) -> std::io::Result<()> {
    let _magic = read_u32(r)?;
    let wide = read_u32(r)? >= 2;
    let len = |r: &mut R| read_len(r, wide);
    let _n_tensors = len(r)?;
    let n_kv = len(r)?;
    for _ in 0..n_kv {
        let key_len = len(r)?;
        if key_len > 1 << 16 {
            return Err(invalid("metadata key longer than 64 KiB"));
        }
        let mut key = vec![0u8; key_len as usize];
        r.read_exact(&mut key)?;
        let ty = read_u32(r)?;
        if key == b"general.alignment" && matches!(ty, 0..=5) {
            let mut b = [0u8; 4];
            let size = [1, 1, 2, 2, 4, 4][ty as usize];
            r.read_exact(&mut b[..size])?;
            if b == [0; 4] {
                return Err(invalid("general.alignment is 0"));
            }
        } else {
            skip_value(r, ty, wide, 0)?;
        }
    }
    Ok(())
}

/// Skip one GGUF value of type `ty` (arrays nest at most 3 deep, as candle allows).
fn skip_value<R: Read + Seek>(r: &mut R, ty: u32, wide: bool, depth: usize) -> std::io::Result<()> {
    let len = |r: &mut R| read_len(r, wide);
    let fixed = |t: u32| match t {
        0 | 1 | 7 => Some(1u64),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    };
    let skip = |r: &mut R, n: u64| -> std::io::Result<()> {
        let n = i64::try_from(n).map_err(|_| invalid("value size overflows"))?;
        r.seek(SeekFrom::Current(n)).map(|_| ())
    };
    match ty {
        8 => {
            let n = len(r)?;
            skip(r, n)
        }
        9 => {
            if depth >= 3 {
                return Err(invalid("arrays nested too deep"));
            }
            let elem = read_u32(r)?;
            let n = len(r)?;
            match fixed(elem) {
                Some(size) => skip(r, n.checked_mul(size).ok_or_else(|| invalid("array size overflows"))?),
                // Each element reads bytes, so a lying count ends at the end of the input.
                None => (0..n).try_for_each(|_| skip_value(r, elem, wide, depth + 1)),
            }
        }
        t => match fixed(t) {
            Some(size) => skip(r, size),
            None => Err(invalid("unknown value type")),
        },
    }
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

fn read_u32<R: Read>(r: &mut R) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// A count or string length: u32 in GGUF v1, u64 from v2 on.
fn read_len<R: Read>(r: &mut R, wide: bool) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b[..if wide { 8 } else { 4 }])?;
    Ok(u64::from_le_bytes(b))
}

fn missing(key: &str) -> LlmError {
    LlmError::MissingMetadata { key: key.into() }
}
