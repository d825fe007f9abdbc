//! Files in and out: inputs must be regular files (a FIFO or /dev/zero would hang or read
//! without end); outputs are written to a temporary file in the same folder and renamed
//! into place, and an existing file is replaced only when it is what the command writes
//! (else `--force`), never when it is one of the command's inputs or a GGUF model.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::check::ArgError;
use crate::util::AnyResult;

/// Largest text `eval` reads (the WikiText-2 test split is 1.3 MB).
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

/// What an output holds, to recognize an existing file of the same kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    Cache,
    Json,
    Svg,
    Markdown,
}

impl OutputKind {
    fn name(self) -> &'static str {
        match self {
            Self::Cache => "veloxquant cache",
            Self::Json => "JSON",
            Self::Svg => "SVG",
            Self::Markdown => "Markdown table",
        }
    }

    /// Whether the existing file at `path` (a regular file) is of this kind; empty counts.
    fn matches(self, path: &Path, len: u64) -> bool {
        let Ok(f) = File::open(path) else { return false };
        if len == 0 {
            return true;
        }
        // The text kinds are judged on the whole file, read within the text bound.
        let head = |mut f: File| -> Option<Vec<u8>> {
            let mut head = Vec::new();
            (len <= MAX_TEXT_BYTES && f.read_to_end(&mut head).is_ok()).then_some(head)
        };
        let starts = |h: &[u8], with: &[&str]| {
            let text = String::from_utf8_lossy(h);
            with.iter().any(|w| text.trim_start().starts_with(w))
        };
        match self {
            Self::Cache => veloxquant::cache::is_cache_file(&mut std::io::BufReader::new(f)),
            Self::Json => head(f).is_some_and(|h| serde_json::from_slice::<serde_json::Value>(&h).is_ok()),
            Self::Svg => head(f).is_some_and(|h| starts(&h, &["<svg", "<?xml"])),
            Self::Markdown => head(f).is_some_and(|h| std::str::from_utf8(&h).is_ok() && starts(&h, &["|"])),
        }
    }
}

/// An input file: it exists and is a regular file; returns its size.
pub fn check_input(path: &Path, what: &str) -> Result<u64, ArgError> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => file_err(path, format!("{what} not found")),
        _ => file_err(path, format!("{what}: {e}")),
    })?;
    if !meta.is_file() {
        return Err(file_err(path, format!("{what} is not a regular file")));
    }
    Ok(meta.len())
}

/// Whether two paths name the same file (same device and inode, or the same canonical path).
fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
    }
    matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// May `path` be written as `kind`? Nonexistent: yes. Existing: only a regular file that is
/// no input of the command and no GGUF model, and of `kind` unless `force`.
pub fn check_output(path: &Path, kind: OutputKind, inputs: &[&Path], force: bool) -> Result<(), ArgError> {
    if path.as_os_str().is_empty() || path.file_name().is_none() {
        return Err(file_err(path, "not a file name".into()));
    }
    if let Some(input) = inputs.iter().find(|i| same_file(path, i)) {
        return Err(file_err(path, format!("is an input of this command ({}): never overwritten", input.display())));
    }
    let meta = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(file_err(path, e.to_string())),
        Ok(m) => m,
    };
    if !meta.is_file() {
        return Err(file_err(path, "exists and is not a regular file: never replaced".into()));
    }
    let mut magic = [0u8; 4];
    if File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF" {
        return Err(file_err(path, "is a GGUF model: never overwritten".into()));
    }
    if !force && !kind.matches(path, meta.len()) {
        return Err(file_err(path, format!("exists and is not a {} file: pass --force to replace it", kind.name())));
    }
    Ok(())
}

fn file_err(path: &Path, why: String) -> ArgError {
    ArgError::File { path: path.to_path_buf(), why }
}

/// A regular file of at most `max` bytes, read whole.
pub fn read_bounded(path: &Path, what: &str, max: u64) -> AnyResult<Vec<u8>> {
    let len = check_input(path, what)?;
    if len > max {
        return Err(format!("{}: {what} is {len} B, more than {max} B", path.display()).into());
    }
    let mut bytes = Vec::new();
    // take(): the file may grow while it is read.
    File::open(path)
        .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > max {
        return Err(format!("{}: {what} grew past {max} B while read", path.display()).into());
    }
    Ok(bytes)
}

/// Writes through `write` into a temporary file next to `path`, then renames it into place:
/// a failure leaves any previous file untouched and no partial file behind.
pub fn write_atomic<T>(path: &Path, write: impl FnOnce(&mut BufWriter<File>) -> AnyResult<T>) -> AnyResult<T> {
    let dir = match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            d.to_path_buf()
        }
        None => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| format!("{}: not a file name", path.display()))?;
    let tmp = dir.join(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let f =
            File::options().write(true).create_new(true).open(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        let mut w = BufWriter::new(f);
        let out = write(&mut w)?;
        w.flush()?;
        w.get_ref().sync_all()?;
        drop(w);
        std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(out)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
